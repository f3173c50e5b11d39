"""Measured choice between each Triton kernel and the reference op it replaces, on the caller's own GPU.

A kernel that is slower than its reference must not run by default, and which one wins depends on the GPU,
the dtype and the shapes (tree size, heads, state size). Under the default policy "auto", the first call of
an op with a new argument signature runs both sides, checks that they agree, times them (warm-up, then the
median of a few interleaved calls, synchronised), and every later call with that signature runs the faster
one. "kernels" and "reference" force one side (benchmarks, debugging). A kernel that fails (a compile error)
or whose output disagrees with the reference is never chosen, and a warning names the op and the reason.
The policy is the running model's (ssmspec.ops.kernel_policy, per thread): "reference" unless that model
was compiled with the ssmspec backend, so compiling one model never changes how another runs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ssmspec.ops import kernel_policy, using_kernel_policy


@dataclass(frozen=True)
class Choice:
    """The outcome of one measurement: which side runs for an (op, signature), and why."""

    use_kernel: bool
    kernel_ms: float
    reference_ms: float
    max_abs_diff: float
    agrees: bool


def signature(args: Sequence[Any]) -> tuple:
    """What the choice depends on: shapes, dtypes and devices of tensors, values of everything else."""
    return tuple(
        (tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a if a is None else repr(a)
        for a in args
    )


def _outputs(out: Any) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]


def _max_diff(a: Any, b: Any) -> tuple[float, bool]:
    """Largest absolute difference over the outputs, and whether they agree within the dtype's tolerance."""
    worst, ok = 0.0, True
    for x, y in zip(_outputs(a), _outputs(b), strict=True):
        if x.shape != y.shape:
            return float("inf"), False
        if x.numel() == 0:
            continue
        if not x.is_floating_point():
            ok = ok and torch.equal(x, y)
            continue
        xd, yd = x.double(), y.double()
        worst = max(worst, float((xd - yd).abs().max()))
        tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(x.dtype, 2e-2)
        ok = ok and bool(torch.allclose(xd, yd, rtol=tol, atol=tol)) and bool(torch.isfinite(yd).all())
    return worst, ok


def _timer(device_type: str) -> Callable[[Callable[[], Any]], float]:
    """Milliseconds of one call, synchronising the device when it is asynchronous."""

    def run(fn: Callable[[], Any]) -> float:
        if device_type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    return run


class KernelSelector:
    """Per-(op, signature) choice between a kernel and its reference (see the module docstring). The
    measurements are a cache of facts about this GPU; the policy that uses them is per thread."""

    def __init__(self, repeats: int = 5) -> None:
        self.repeats = repeats
        self.choices: dict[tuple, Choice] = {}

    @property
    def policy(self) -> str:
        """The policy of the model running in this thread."""
        return kernel_policy()

    @contextlib.contextmanager
    def forced(self, policy: str) -> Iterator[None]:
        """Run a block under another policy (this thread only)."""
        with using_kernel_policy(policy):
            yield

    def run(self, name: str, reference: Callable, kernel: Callable, args: Sequence[Any]) -> Any:
        """Call the side the policy (and, under "auto", the measurement for this signature) picks."""
        policy = kernel_policy()
        if policy == "kernels":
            return kernel(*args)
        if policy == "reference":
            return reference(*args)
        key = (name, signature(args))
        choice = self.choices.get(key)
        if choice is None:
            choice = self.choices[key] = self.measure(name, reference, kernel, args)
        return (kernel if choice.use_kernel else reference)(*args)

    def measure(self, name: str, reference: Callable, kernel: Callable, args: Sequence[Any]) -> Choice:
        """Run both sides on these arguments: agreement first, then the median time of each."""
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        timer = _timer(device)
        want = reference(*args)
        try:
            got = kernel(*args)  # also the warm-up (Triton compiles here)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or run is never chosen
            warnings.warn(
                f"ssmspec: kernel {name} failed for {signature(args)} ({type(exc).__name__}: {str(exc)[:200]}); "
                "running the reference for these shapes",
                RuntimeWarning,
                stacklevel=3,
            )
            return Choice(False, float("nan"), float("nan"), float("nan"), False)
        diff, agrees = _max_diff(want, got)
        if not agrees:
            warnings.warn(
                f"ssmspec: kernel {name} disagrees with its reference (max abs diff {diff:.3g}) for "
                f"{signature(args)}; running the reference for these shapes",
                RuntimeWarning,
                stacklevel=3,
            )
            return Choice(False, float("nan"), float("nan"), diff, False)
        t_ref, t_ker = [], []
        for _ in range(self.repeats):
            t_ref.append(timer(lambda: reference(*args)))
            t_ker.append(timer(lambda: kernel(*args)))
        ref_ms, ker_ms = statistics.median(t_ref), statistics.median(t_ker)
        return Choice(ker_ms < ref_ms, ker_ms, ref_ms, diff, True)

    def summary(self) -> list[dict]:
        """One row per measured (op, signature), for reports and benchmarks."""
        return [
            {
                "op": name,
                "signature": sig,
                "kernel": c.use_kernel,
                "kernel_ms": c.kernel_ms,
                "reference_ms": c.reference_ms,
                "max_abs_diff": c.max_abs_diff,
            }  # fmt: skip
            for (name, sig), c in self.choices.items()
        ]


SELECTOR = KernelSelector()
