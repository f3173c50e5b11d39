"""Steps captured once over static tensors and replayed: `StepGraph`.

On CUDA a step is a `torch.cuda.CUDAGraph`: captured once (after one warm-up run on a side stream, which lets
lazily initialised libraries set themselves up), then every later step is `graph.replay()`: no Python, no kernel
launches from the host, the same addresses read and written each time. On a CPU, where there are no CUDA graphs,
the same contract is kept by an op tape: the capture runs the step once under a `TorchDispatchMode` that records
every ATen (and ssmspec custom) op with the tensors it read and wrote; a replay runs those ops again on the same
tensors, writing each result where the capture's went. Python code between the ops does not run again on either
device, so a step that would be wrong as a CUDA graph (a tensor replaced instead of updated in place, a host value
baked in) is wrong on the tape too, and CPU tests see it. A host read while capturing (`.item()`, `bool(t)`, ...)
fails the capture with `CaptureError` naming the op, on both devices.

What a captured function may do: read and write tensors that live as long as the graph (its static inputs, the
cache's buffers), and allocate temporaries (on CUDA they come from the graph's memory pool and are reused by every
replay: a tensor the step returns is overwritten by the next replay of the same graph).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from ssmspec.errors import CaptureError

# ops that read a device value on the host: a captured step may not depend on one (CUDA refuses them while capturing)
HOST_READS = frozenset(
    {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten.equal.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten.unique_consecutive.default,
        torch.ops.aten._unique2.default,
    }
)


class _Tape(TorchDispatchMode):
    """Records every op a step runs (CPU capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise CaptureError(
                f"{func} reads a device value on the host while a step is captured (a CUDA graph cannot replay it), "
                f"at {_caller()}"
            )
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _caller() -> str:
    """Where the running op was called from, outside torch: the innermost frames of the model's and ssmspec's code."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(torch_dir)][:-2]
    return " <- ".join(f"{f.filename}:{f.lineno} ({f.name})" for f in reversed(frames[-3:]))


def capturing() -> bool:
    """Whether the current code runs inside a step capture (CUDA stream capture or the CPU op tape): code that keeps
    Python-side caches or reads the host takes its tensor-only path then, as under torch.compile."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    return isinstance(_get_current_dispatch_mode(), _Tape)


def static() -> bool:
    """Whether code must keep to tensor-only paths now: compiling (Dynamo) or capturing a step."""
    return torch.compiler.is_compiling() or capturing()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same memory (an in-place result, a view recomputed on the same base)."""
    return (
        a is b
        or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


class StepGraph:
    """One step captured over static tensors: `capture(fn)` once, then `replay()` per step.

    `fn()` takes no arguments: it reads its inputs from tensors the caller fills before each replay (copied in
    place) and returns a pytree whose tensors are the step's outputs, overwritten by every replay. Python objects
    it returns (records of what it computed, holding tensors) are the capture's, and their tensors too hold each
    replay's values.

    Args:
        device: where the step runs: CUDA captures a `torch.cuda.CUDAGraph`, anything else the op tape.
        pool: a CUDA memory pool shared with other graphs of the same caller (`torch.cuda.graph_pool_handle()`);
            graphs that share one must replay one at a time, in any order.
    """

    def __init__(self, device: torch.device, pool: Any = None) -> None:
        self.device = torch.device(device)
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tape: list[tuple[Any, tuple, dict, Any]] | None = None
        self.outputs: Any = None
        self.replays = 0

    @property
    def captured(self) -> bool:
        """Whether `capture` has run."""
        return self.graph is not None or self.tape is not None

    def capture(self, fn: Callable[[], Any], warmup: bool = True) -> Any:
        """Capture `fn` and return its outputs for the inputs as they are now (the step this call stands for). On
        CUDA, with `warmup`, `fn` runs once eagerly first (libraries initialise lazily) and the graph is then replayed
        once, so such an `fn` must be idempotent (writing its scratch, not the state it reads); without it (an `fn`
        that advances state, run eagerly before by its caller) it runs once, as the graph's first replay. On the op
        tape it runs once, recorded.

        Raises:
            CaptureError: `fn` read the host, or the device refused the capture (the cause chained).
        """
        if self.captured:
            raise RuntimeError("this step is already captured")
        try:
            if self.device.type == "cuda":
                if warmup:
                    stream = torch.cuda.Stream(self.device)
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        fn()
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs = fn()
                self.graph = graph
                graph.replay()
            else:
                tape = _Tape()
                with tape:
                    self.outputs = fn()
                self.tape = tape.ops
        except CaptureError:
            raise
        except RuntimeError as e:
            raise CaptureError(f"capturing a step on {self.device} failed: {e}") from e
        return self.outputs

    def replay(self) -> Any:
        """Run the captured step again on what its inputs hold now; returns the capture's outputs (refreshed)."""
        if self.graph is not None:
            self.graph.replay()
        elif self.tape is not None:
            for func, args, kwargs, out in self.tape:
                result = func(*args, **kwargs)
                for new, old in zip(pytree.tree_leaves(result), pytree.tree_leaves(out)):
                    if isinstance(old, torch.Tensor) and not _same(new, old):
                        old.copy_(new)
        else:
            raise RuntimeError("replay before capture")
        self.replays += 1
        return self.outputs
