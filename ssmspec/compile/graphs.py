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

import operator
import os
import traceback
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ssmspec.errors import CaptureError
from ssmspec.static import CaptureMode

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


def _refuse_host_read(func) -> None:
    """A captured step may not read a device value on the host: refused, naming the op and the model code."""
    if func in HOST_READS:
        raise CaptureError(
            f"{func} reads a device value on the host while a step is captured (a CUDA graph cannot replay it), "
            f"at {_caller()}"
        )


class _Tape(CaptureMode):
    """Records every op a step runs (CPU capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse_host_read(func)
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A tensor's shape, strides and dtype, on the meta device (holding no reference to it)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class _Recorder(_Tape):
    """Records a step as an FX graph of the ops it runs (a CPU capture to be compiled whole): each tensor an op produced
    is a node; a tensor read that no recorded op produced is the graph's input (a model parameter or buffer: a
    constant of the graph, read where it lives), a view of another tensor an `as_strided` of its base. Tensors are
    held weakly, so that the ones still alive when the step has returned are exactly those its caller keeps (its
    outputs, the records it left on Python objects): the graph's outputs."""

    def __init__(self, constants: dict[int, tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.constants = constants  # id(tensor) -> (name, tensor): the model's parameters and buffers
        self.used_constants: dict[str, torch.Tensor] = {}
        self.inputs: list[torch.Tensor] = []  # the graph's placeholders, in order (held: they outlive the step)
        self._nodes: dict[int, tuple[weakref.ref, fx.Node, bool]] = {}  # id -> (tensor, node, produced by the step)

    def _known(self, t: torch.Tensor) -> fx.Node | None:
        entry = self._nodes.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _node(self, t: torch.Tensor) -> fx.Node:
        node = self._known(t)
        if node is not None:
            return node
        if id(t) in self.constants:
            name, _ = self.constants[id(t)]
            self.used_constants[name] = t
            node = self.graph.get_attr(name)
        elif t._base is not None:  # a view made before the step (a layer's slice of a stacked state): of its base
            node = self.graph.call_function(
                torch.ops.aten.as_strided.default,
                (self._node(t._base), list(t.shape), list(t.stride()), t.storage_offset()),  # fmt: skip
            )
        else:
            node = self.graph.placeholder(f"input_{len(self.inputs)}")
            self.inputs.append(t)
        node.meta["val"] = _meta(t)
        self._nodes[id(t)] = (weakref.ref(t), node, False)
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse_host_read(func)
        node_args = pytree.tree_map_only(torch.Tensor, self._node, (args, kwargs))
        out = func(*args, **kwargs)
        node = self.graph.call_function(func, *node_args)
        node.meta["val"] = pytree.tree_map_only(torch.Tensor, _meta, out)  # (shapes for the compiler's passes)
        if isinstance(out, torch.Tensor):  # (an in-place op's result: the tensor it updated, an input or not)
            entry = self._nodes.get(id(out))
            self._nodes[id(out)] = (weakref.ref(out), node, entry is None or entry[0]() is not out or entry[2])
        elif isinstance(out, (tuple, list)):
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    item = self.graph.call_function(operator.getitem, (node, i))
                    item.meta["val"] = node.meta["val"][i]
                    self._nodes[id(t)] = (weakref.ref(t), item, True)
        return out

    def finish(self) -> tuple[fx.GraphModule, list[torch.Tensor]]:
        """The recorded graph, returning every tensor the step produced that is still alive, and those tensors."""
        order = {node: i for i, node in enumerate(self.graph.nodes)}  # (deterministic: the graph's own order)
        kept = [(t, node) for ref, node, produced in self._nodes.values() if produced and (t := ref()) is not None]
        kept.sort(key=lambda item: order[item[1]])
        self.graph.output(tuple(node for _, node in kept))
        root = torch.nn.Module()
        for name, t in self.used_constants.items():
            root.register_buffer(name, t, persistent=False)
        return fx.GraphModule(root, self.graph), [t for t, _ in kept]


def _caller() -> str:
    """Where the running op was called from, outside torch: the innermost frames of the model's and ssmspec's code."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(torch_dir)][:-3]  # (the refusal's own)
    return " <- ".join(f"{f.filename}:{f.lineno} ({f.name})" for f in reversed(frames[-3:]))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same memory (an in-place result, a view recomputed on the same base)."""
    return (
        a is b
        or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


class StepCompiler(Protocol):
    """Compiles a recorded step (CPU): `constants` the tensors that are the graph's constants (the model's parameters
    and buffers, by id, with the names the graph gives them); a call returns a function of the graph's inputs that
    returns its outputs."""

    constants: dict[int, tuple[str, torch.Tensor]]

    def __call__(self, gm: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]: ...


class StepGraph:
    """One step captured over static tensors: `capture(fn)` once, then `replay()` per step.

    `fn()` takes no arguments: it reads its inputs from tensors the caller fills before each replay (copied in
    place) and returns a pytree whose tensors are the step's outputs, overwritten by every replay. Python objects
    it returns (records of what it computed, holding tensors) are the capture's, and their tensors too hold each
    replay's values.

    On a CPU with a `compiler`, the step is compiled instead: its ops, recorded once as an FX graph, become one
    compiled function (Inductor's C++, ssmspec.compile.lower) that a replay calls on the step's tensors; the tensors
    the step produced and its caller kept are the graph's outputs, copied into the capture's by each replay.

    Args:
        device: where the step runs: CUDA captures a `torch.cuda.CUDAGraph`, anything else the op tape, or with
            `compiler` a compiled graph.
        pool: a CUDA memory pool shared with other graphs of the same caller (`torch.cuda.graph_pool_handle()`);
            graphs that share one must replay one at a time, in any order.
        compiler: (CPU) compiles the recorded step.
    """

    def __init__(self, device: torch.device, pool: Any = None, compiler: StepCompiler | None = None) -> None:
        self.device = torch.device(device)
        self.pool = pool
        self.compiler = compiler if self.device.type != "cuda" else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tape: list[tuple[Any, tuple, dict, Any]] | None = None
        self.compiled: Callable[..., Any] | None = None  # the compiled step, called on `inputs`
        self.inputs: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []  # what the compiled step's outputs are copied into
        self.outputs: Any = None
        self.replays = 0

    @property
    def captured(self) -> bool:
        """Whether `capture` has run."""
        return self.graph is not None or self.tape is not None or self.compiled is not None

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
            elif self.compiler is not None:
                recorder = _Recorder(self.compiler.constants)
                with recorder:
                    self.outputs = fn()
                gm, self.kept = recorder.finish()
                self.inputs = recorder.inputs
                self.compiled = self.compiler(gm, self.inputs)
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
        elif self.compiled is not None:
            for kept, new in zip(self.kept, self.compiled(*self.inputs)):
                if new is not kept:
                    kept.copy_(new)
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
