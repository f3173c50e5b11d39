"""Every Triton kernel equals its reference op (Hypothesis over shapes, dtypes and tree topologies).

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors (set in conftest), so
shapes stay tiny; on CUDA the same tests run on the GPU."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ssmspec import kernels as K
from ssmspec import ops as R
from ssmspec.testing.strategies import trees

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on CUDA these run the compiled kernels (pytest -m gpu selects them); on a CPU the Triton interpreter
pytestmark = pytest.mark.gpu
# every dtype users run: half precision inputs are computed in float32 by both sides (accumulation, exp)
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float64: 1e-10, torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _rand(g, *shape, dtype):
    return torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE)


def _close(a, b, dtype):
    """Kernel output `a` equals reference output `b` within the dtype's tolerance, in the same layout: compiled graphs
    check a custom op's real strides against its fake's, which is the reference's (dims of size 1 aside)."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    torch.testing.assert_close(a, b, rtol=TOL[dtype], atol=TOL[dtype])
    assert [st for n, st in zip(a.shape, a.stride()) if n > 1] == [st for n, st in zip(b.shape, b.stride()) if n > 1], (
        a.stride(),
        b.stride(),
    )


def _time_major(x, yes):
    """x [B, C, N] as the mixers pass it where `yes`: a transposed view of [B, N, C] memory (a projection's output)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2) if yes else x


@pytest.fixture(autouse=True, scope="module")
def _no_float_arguments():
    """No kernel gets a Python float as a runtime argument: Triton passes it as float32, so a float64 kernel would
    compute with a rounded constant (1/sqrt(K), a dt limit) that the Triton interpreter, in float64, does not show."""
    import importlib
    import pkgutil

    import ssmspec.kernels

    names = [m.name for m in pkgutil.iter_modules(ssmspec.kernels.__path__)]
    modules = [importlib.import_module(f"ssmspec.kernels.{name}") for name in names]
    patched = [m for m in modules if hasattr(m, "wrap_triton")]

    def checked(real):
        def wrap(kernel):
            launch = real(kernel)

            class Launcher:
                def __getitem__(self, grid):
                    run = launch[grid]

                    def call(*args, **kwargs):
                        floats = [i for i, a in enumerate(args) if isinstance(a, float)]
                        assert not floats, f"{kernel.__name__}: float runtime arguments at positions {floats}"
                        return run(*args, **kwargs)

                    return call

            return Launcher()

        return wrap

    originals = {m: m.wrap_triton for m in patched}
    for m in patched:
        m.wrap_triton = checked(originals[m])
    yield
    for m, real in originals.items():
        m.wrap_triton = real


@st.composite
def setups(draw, max_nodes=9):
    b = draw(st.integers(1, 2))
    tree = draw(trees(batch_size=b, max_nodes=max_nodes))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    return tree, dtype, torch.Generator().manual_seed(seed)


def _on(tree):
    return tree.ancestor_mask.to(DEVICE), tree.parents.to(DEVICE), tree.depth.to(DEVICE)


@given(setups(), st.integers(1, 5), st.integers(2, 4), st.sampled_from(["", "silu"]), st.booleans(), st.booleans())
def test_tree_conv(setup, channels, width, act, bias, time_major):
    tree, dtype, g = setup
    b, n = tree.tokens.shape
    x = _time_major(_rand(g, b, channels, width + n, dtype=dtype), time_major)
    w = _rand(g, channels, width, dtype=dtype)
    bb = _rand(g, channels, dtype=dtype) if bias else None
    anc = tree.ancestors(width).to(DEVICE)
    _close(K.tree_causal_conv1d(x, w, bb, anc, act), R.tree_causal_conv1d(x, w, bb, anc, act), dtype)


@given(setups(), st.integers(1, 2), st.integers(1, 2), st.integers(1, 5), st.integers(1, 6), st.booleans(),
       st.booleans(), st.sampled_from([(0.0, float("inf")), (0.01, 2.0)]))  # fmt: skip
def test_tree_ssd_and_replay_state(setup, groups, heads_per_group, p, s, with_h0, d_per_p, limit):
    tree, dtype, g = setup
    b, n = tree.tokens.shape
    h = groups * heads_per_group
    x, dt = _rand(g, b, n, h, p, dtype=dtype), _rand(g, b, n, h, dtype=dtype)
    A = -torch.rand(h, generator=g, dtype=dtype).to(DEVICE) - 0.1
    Bm, Cm = _rand(g, b, n, groups, s, dtype=dtype), _rand(g, b, n, groups, s, dtype=dtype)
    D = _rand(g, h, p, dtype=dtype) if d_per_p else _rand(g, h, dtype=dtype)
    bias = _rand(g, h, dtype=dtype)
    h0 = _rand(g, b, h, p, s, dtype=dtype) if with_h0 else None
    anc, _, _ = _on(tree)
    args = (x, dt, A, Bm, Cm, D, bias, h0, anc, True, *limit, True)
    (y1, s1), (y0, s0) = K.tree_ssd(*args), R.tree_ssd(*args)
    _close(y1, y0, dtype)
    _close(s1, s0, dtype)
    last = torch.randint(0, n, (b,), generator=g).to(DEVICE)
    mask = anc[torch.arange(b, device=DEVICE), last]
    sargs = (x, dt, A, Bm, bias, h0, mask, True, *limit)
    _close(K.ssd_state_at(*sargs), R.ssd_state_at(*sargs), dtype)
    _close(R.ssd_state_at(*sargs), s0[torch.arange(b, device=DEVICE), last], dtype)  # replay == materialize
    # commit batches layers: A and dt_bias given per row ([B, H]) must mean the same
    rowwise = (x, dt, A.expand(b, h), Bm, bias.expand(b, h), h0, mask, True, *limit)
    _close(R.ssd_state_at(*rowwise), R.ssd_state_at(*sargs), dtype)
    _close(K.ssd_state_at(*rowwise), R.ssd_state_at(*sargs), dtype)


@given(setups(), st.integers(1, 6), st.integers(1, 5), st.booleans(), st.booleans(), st.booleans())
def test_tree_selective_scan(setup, d, s, with_z, with_h0, time_major):
    tree, dtype, g = setup
    b, n = tree.tokens.shape
    tm = functools.partial(_time_major, yes=time_major)  # (HF's Mamba passes x, dt, z, B and C time-major)
    args = (
        tm(_rand(g, b, d, n, dtype=dtype)), tm(_rand(g, b, d, n, dtype=dtype)),
        -torch.rand(d, s, generator=g, dtype=dtype).to(DEVICE), tm(_rand(g, b, s, n, dtype=dtype)),
        tm(_rand(g, b, s, n, dtype=dtype)), _rand(g, d, dtype=dtype),
        tm(_rand(g, b, d, n, dtype=dtype)) if with_z else None, _rand(g, d, dtype=dtype),
        _rand(g, b, d, s, dtype=dtype) if with_h0 else None, *_on(tree)[1:], True, True,
    )  # fmt: skip
    (y1, s1), (y0, s0) = K.tree_selective_scan(*args), R.tree_selective_scan(*args)
    _close(y1, y0, dtype)
    _close(s1, s0, dtype)


@given(setups(), st.integers(1, 2), st.integers(1, 2), st.integers(1, 5), st.integers(1, 4), st.booleans(),
       st.booleans(), st.booleans())  # fmt: skip
def test_tree_delta_rule(setup, hk, ratio, kd, vd, kda, l2, with_h0):
    tree, dtype, g = setup
    b, n = tree.tokens.shape
    h = hk * ratio
    gate_shape = (b, n, h, kd) if kda else (b, n, h)
    args = (
        _rand(g, b, n, hk, kd, dtype=dtype), _rand(g, b, n, hk, kd, dtype=dtype), _rand(g, b, n, h, vd, dtype=dtype),
        -torch.rand(*gate_shape, generator=g, dtype=dtype).to(DEVICE),
        torch.rand(b, n, h, generator=g, dtype=dtype).to(DEVICE),
        _rand(g, b, h, kd, vd, dtype=dtype) if with_h0 else None, *_on(tree)[1:], l2, True,
    )  # fmt: skip
    (o1, s1), (o0, s0) = K.tree_delta_rule(*args), R.tree_delta_rule(*args)
    _close(o1, o0, dtype)
    _close(s1, s0, dtype)


@given(setups(), st.integers(1, 4), st.integers(1, 5))
def test_commit_kernels(setup, c, s):
    tree, dtype, g = setup
    b, n = tree.tokens.shape
    committed, nodes = _rand(g, b, c, s, dtype=dtype), _rand(g, b, c, n, dtype=dtype)
    last = torch.randint(0, n, (b,), generator=g)
    path, lengths = tree.paths(last)
    path, lengths, last = path.to(DEVICE), lengths.to(DEVICE), last.to(DEVICE)
    assert torch.equal(K.conv_window(committed, nodes, path, lengths), R.conv_window(committed, nodes, path, lengths))
    states = _rand(g, b, n, 2, 3, dtype=dtype)
    assert torch.equal(K.gather_states(states, last), R.gather_states(states, last))


def test_tree_too_large_for_one_block_is_an_error():
    n = K.ssd.MAX_NODES + 1
    x = torch.zeros(1, n, 1, 1, device=DEVICE)
    with pytest.raises(ValueError, match="nodes"):
        K.tree_ssd(x, x[..., 0], torch.zeros(1, device=DEVICE), x, x, None, None, None,
                   torch.ones(1, n, n, dtype=torch.bool, device=DEVICE), True, 0.0, 1.0, False)  # fmt: skip


def test_each_kernel_has_its_reference_ops_schema_declared_once():
    """A kernel op's arguments (names, types, order, defaults) and outputs are its reference op's: `kernel_op` takes
    them from the reference, and refuses at registration a kernel whose parameters differ."""
    from ssmspec.kernels import KERNELS
    from ssmspec.kernels._common import kernel_op

    for reference, kernel in KERNELS.items():
        assert str(kernel._schema).removeprefix(kernel._schema.name) == str(reference._schema).removeprefix(
            reference._schema.name
        ), reference
    with pytest.raises(TypeError, match=r"takes \['states', 'index'\], the reference op takes \['states', 'last'\]"):

        @kernel_op(torch.ops.ssmspec.gather_states.default)
        def gather(states, index):  # (a renamed argument: a call by keyword would miss it)
            return states
