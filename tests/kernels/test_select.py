"""The measured kernel choice: the faster side runs, a disagreeing kernel never does, choices are per shape."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from ssmspec import kernels as K
from ssmspec.compile.backend import _with_policy, ssmspec_backend
from ssmspec.kernels import _dispatcher
from ssmspec.kernels.select import KernelSelector
from ssmspec.ops import kernel_policy, using_kernel_policy
from ssmspec.ops._common import reference_impl
from ssmspec.tree import TokenTree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on CUDA these run the compiled kernels (pytest -m gpu selects them); on a CPU the Triton interpreter
pytestmark = pytest.mark.gpu


class Counted:
    """A side whose cost is a sleep and whose calls are counted."""

    def __init__(self, seconds: float, offset: float = 0.0) -> None:
        self.seconds, self.offset, self.calls = seconds, offset, 0

    def __call__(self, x):
        self.calls += 1
        time.sleep(self.seconds)
        return x * 2 + self.offset


@pytest.mark.parametrize("kernel_faster", [True, False])
def test_faster_side_is_chosen_once_per_signature(kernel_faster):
    slow, fast = Counted(0.004), Counted(0.0)
    ref, ker = (slow, fast) if kernel_faster else (fast, slow)
    sel = KernelSelector(repeats=3)
    x = torch.ones(3)
    with sel.forced("auto"):
        _choose_and_rerun(sel, ref, ker, x, kernel_faster)


def _choose_and_rerun(sel, ref, ker, x, kernel_faster):
    torch.testing.assert_close(sel.run("op", ref, ker, (x,)), x * 2)
    (choice,) = sel.choices.values()
    assert choice.use_kernel is kernel_faster and choice.agrees
    assert (choice.kernel_ms < choice.reference_ms) is kernel_faster
    before = (ref.calls, ker.calls)
    for _ in range(3):
        sel.run("op", ref, ker, (x,))
    winner_calls = (ker.calls - before[1]) if kernel_faster else (ref.calls - before[0])
    loser_calls = (ref.calls - before[0]) if kernel_faster else (ker.calls - before[1])
    assert (winner_calls, loser_calls) == (3, 0)
    sel.run("op", ref, ker, (torch.ones(4),))  # a new shape is measured on its own
    assert len(sel.choices) == 2


def test_disagreeing_kernel_is_never_chosen():
    sel = KernelSelector(repeats=1)
    x = torch.ones(3)
    with pytest.warns(RuntimeWarning, match="kernel bad disagrees with its reference"), sel.forced("auto"):
        out = sel.run("bad", Counted(0.002), Counted(0.0, offset=1e-2), (x,))
    torch.testing.assert_close(out, x * 2)
    (choice,) = sel.choices.values()
    assert not choice.use_kernel and not choice.agrees and choice.max_abs_diff == pytest.approx(1e-2)


def test_failing_kernel_is_never_chosen():
    """A kernel that raises (e.g. a Triton compile error for a dtype) falls back to the reference, with a warning."""

    def broken(x):
        raise RuntimeError("CompilationError: Expected dtype ['fp32', 'fp64'] but got bf16")

    sel = KernelSelector(repeats=1)
    x = torch.ones(3)
    with pytest.warns(RuntimeWarning, match="kernel k failed"), sel.forced("auto"):
        out = sel.run("k", Counted(0.0), broken, (x,))
        out2 = sel.run("k", Counted(0.0), broken, (x,))  # decided once: no second attempt, no second warning
    torch.testing.assert_close(out, x * 2)
    torch.testing.assert_close(out2, x * 2)
    (choice,) = sel.choices.values()
    assert not choice.use_kernel and not choice.agrees


def test_forced_policies():
    ref, ker = Counted(0.0), Counted(0.0, offset=1.0)
    sel = KernelSelector()
    assert sel.policy == "reference"  # a model not compiled with the backend runs the references
    assert float(sel.run("op", ref, ker, (torch.zeros(1),))) == 0.0
    with sel.forced("kernels"):
        assert float(sel.run("op", ref, ker, (torch.zeros(1),))) == 1.0
        with sel.forced("reference"):
            assert float(sel.run("op", ref, ker, (torch.zeros(1),))) == 0.0
    assert sel.policy == "reference" and not sel.choices
    with pytest.raises(ValueError, match="kernel policy must be one of"), sel.forced("fastest"):
        pass


def test_policy_is_per_thread():
    """A model running under "kernels" in one thread does not change what another thread runs."""
    import threading

    seen = {}
    started, release = threading.Event(), threading.Event()

    def other():
        started.wait()
        seen["other"] = kernel_policy()
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with using_kernel_policy("kernels"):
        started.set()
        release.wait(10)
        seen["main"] = kernel_policy()
    t.join()
    assert seen == {"main": "kernels", "other": "reference"}


def test_real_kernel_measured_against_its_reference():
    """A real triton_op (interpreted on CPU: far slower) against its reference, through the op dispatcher's
    argument binding: they agree, and the slower interpreter kernel is not chosen."""
    tree = TokenTree.from_lists([[5, 6, 7, 8]], [[-1, 0, 0, 2]])
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 3, 3 + 4, generator=g).to(DEVICE), torch.randn(3, 3, generator=g).to(DEVICE)
    anc = tree.ancestors(3).to(DEVICE)
    op = torch.ops.ssmspec.tree_causal_conv1d.default
    sel = KernelSelector(repeats=2)
    old, K.SELECTOR = K.SELECTOR, sel
    try:
        run = _dispatcher("ssmspec::tree_causal_conv1d", reference_impl(op), K.KERNELS[op])
        with warnings.catch_warnings(), sel.forced("auto"):
            warnings.simplefilter("error")
            out = run(x, w, None, anc, activation="silu")
    finally:
        K.SELECTOR = old
    torch.testing.assert_close(out, op(x, w, None, anc, "silu"))
    (choice,) = sel.choices.values()
    assert choice.agrees and choice.max_abs_diff < 1e-5
    assert choice.use_kernel is (choice.kernel_ms < choice.reference_ms)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="float64 is routed to the reference on CUDA only")
def test_float64_runs_the_reference_by_design():
    """Triton's float64 support on GPUs is partial (a float64 tree SSD fails to compile on an H100): float64
    CUDA calls never reach a kernel, whatever the policy."""
    ref, ker = Counted(0.0), Counted(0.0, offset=1.0)

    def reference(x_ext, weight, bias, ancestors, activation):
        return ref(x_ext)

    def kernel(x_ext, weight, bias, ancestors, activation):
        return ker(x_ext)

    run = _dispatcher("ssmspec::tree_causal_conv1d", reference, kernel)
    with using_kernel_policy("kernels"):
        run(torch.zeros(1, 1, 2, dtype=torch.float64, device="cuda"), None, None, None, "")
        run(torch.zeros(1, 1, 2, dtype=torch.float32, device="cuda"), None, None, None, "")
    assert (ref.calls, ker.calls) == (1, 1)


def test_float64_is_kernel_material_only_off_the_gpu():
    """The decision itself, on any machine (fake CUDA tensors): float64 CUDA calls go to the reference, float64
    CPU calls (the interpreter) and half/single precision CUDA calls may use a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        cuda64 = torch.empty(2, dtype=torch.float64, device="cuda")
        cuda16 = torch.empty(2, dtype=torch.bfloat16, device="cuda")
    assert not K.kernel_supports((cuda16, cuda64)) and K.kernel_supports((cuda16, None, 1.0))
    assert K.kernel_supports((torch.zeros(1, dtype=torch.float64),))


def test_backend_kernel_option():
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with pytest.raises(ValueError, match="kernels must be one of"):
        ssmspec_backend(gm, [torch.ones(1)], options={"kernels": "fastest"})
    seen = []
    _with_policy(lambda *a: seen.append(K.SELECTOR.policy), "kernels")()
    assert seen == ["kernels"] and K.SELECTOR.policy == "reference"  # a compiled graph runs under its own policy
