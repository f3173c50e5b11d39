"""The `ssmspec` torch.compile backend: FX passes over each Dynamo graph, then Inductor.

    model.compile(backend="ssmspec")                      # in place: HF generate then uses it
    model.compile(backend="ssmspec", options={"kernels": False, "fuse": False, "inductor": False})

Options: `kernels` (None / "auto": on CUDA each tree op runs its Triton kernel or its reference, whichever
was measured faster for its shapes on this GPU (ssmspec.kernels.select), the reference path on CPU;
True / "kernels" lowers every tree op to its triton_op, so Inductor sees the kernels, also on CPU under
TRITON_INTERPRET=1; False / "reference" keeps the reference ops), `fuse` (graph
simplifications around the tree ops and, where no kernel runs, the traceable references inlined so that
Inductor fuses them with the mixer's ops; default True), `inductor` (hand the graph to Inductor, default True;
False runs the rewritten FX graph as is, for debugging), `prepack` (CPU float32 / bfloat16 linears on oneDNN
weights packed once, ssmspec.linear; default True). Registered on `import ssmspec` and through the
`torch_dynamo_backends` entry point, so `backend="ssmspec"` also works in a fresh interpreter.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ssmspec.compile.passes import (
    fold_conv_padding,
    inline_tree_ops,
    is_tree_op,
    lower_tree_ops,
    opaque_cumsums,
    prepack_linears,
)
from ssmspec.errors import not_one_of
from ssmspec.ops import using_kernel_policy

_OPTION_NAMES = ("kernels", "fuse", "inductor", "prepack", "mode")
_KERNEL_OPTION = {None: "auto", "auto": "auto", True: "kernels", "kernels": "kernels", False: "reference",
                  "reference": "reference"}  # fmt: skip
# graphs one compiled model may hold: its prefill lengths, one per tree-size bucket and decode, one commit per
# path width (Dynamo's default of 8 per code object is shared by every model of the same class)
RECOMPILE_LIMIT = 64


def region_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch.compile keyword arguments giving one model's compiled region its own recompilation budget
    (`isolate_recompiles`, `recompile_limit`, where this torch has them; torch internals, named here). Without
    it a target and its draft of the same class, whose forwards are one code object, share Dynamo's 8 entries
    and the later graphs silently run eager. The caller's own values win; an older torch gets nothing added."""
    params = _compile_parameters()
    out = dict(kwargs)
    if "isolate_recompiles" in params:
        out.setdefault("isolate_recompiles", True)
    if "recompile_limit" in params:
        out.setdefault("recompile_limit", RECOMPILE_LIMIT)
    return out


def mode_and_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch.compile keyword arguments with a `mode` and `options` both given made acceptable to torch.compile, which
    refuses the pair: for the ssmspec backend the mode travels among its options (the backend hands it to Inductor
    with the other settings), for any other backend it becomes the settings it stands for (Inductor's
    `list_mode_options`, torch internals named here), the caller's options winning."""
    mode, options = kwargs.get("mode"), kwargs.get("options")
    if mode is None or options is None:
        return kwargs
    out = {k: v for k, v in kwargs.items() if k != "mode"}
    if out.get("backend") == "ssmspec":
        out["options"] = {"mode": mode, **options}
    else:
        from torch._inductor import list_mode_options

        out["options"] = {**list_mode_options(mode), **options}
    return out


# torch.compile modes whose compiled graphs run as torch's own CUDA graphs (cudagraph trees) on CUDA
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_mode(kwargs: dict[str, Any]) -> str | None:
    """The torch.compile mode of compile keyword arguments (given as `mode`, or among the ssmspec backend's options)."""
    return kwargs.get("mode") or (kwargs.get("options") or {}).get("mode")


def _compile_parameters() -> frozenset[str]:
    """The keyword arguments this torch's `torch.compile` takes."""
    return frozenset(inspect.signature(torch.compile).parameters)


@dataclass
class BackendStats:
    """What the backend did to the graphs it compiled (for tests and debugging)."""

    graphs: int = 0
    tree_ops: int = 0
    lowered: int = 0
    folded: int = 0
    inlined: int = 0  # reference tree-op calls traced into the graph for Inductor to fuse
    packed: int = 0  # linears pointed at ssmspec::packed_linear (CPU)
    fallbacks: int = 0  # graphs run without Inductor after it failed on them
    workarounds: int = 0  # graphs Inductor compiled only with their cumsums opaque (torch 2.11 scan bug)
    per_graph: list[dict[str, int]] = field(default_factory=list)


STATS = BackendStats()


def ssmspec_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None, mode: str | None = None
) -> Callable:
    """The Dynamo backend (`torch.compile(..., backend="ssmspec")`; use `model.compile(...)` on a model).

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: "kernels" (None / "auto": per shape the faster of kernel and reference on CUDA; True /
            "kernels": lower every tree op to its Triton kernel; False / "reference": keep the references),
            "fuse" (graph simplifications around the tree ops, default True), "inductor" (hand the graph to
            Inductor, default True; a graph Inductor fails on runs without it, with a warning), "prepack" (on a
            CPU, float32 / bfloat16 linears on oneDNN weights packed once, ssmspec.linear; default True, False
            for a model transformed with `prepack=False`); any other key
            is an Inductor config setting applied to this model's graphs (as `torch.compile(options=...)`),
            e.g. `{"cpp_wrapper": True}`: Inductor's C++ wrapper instead of its Python one, which on CPU takes
            most of the per-call overhead off small verify steps (and compiles for minutes instead of seconds).
        mode: torch.compile's mode, handed to Inductor ("reduce-overhead": CUDA graphs; also taken from
            `options["mode"]`, as torch.compile refuses both); a transformed model
            compiled with `model.compile` verifies with static shapes (SpecConfig.static_shapes).

    Returns:
        The compiled graph, running under its kernel policy.

    Raises:
        ValueError: an option that is neither ssmspec's nor an Inductor config setting, or a bad kernels value.
    """
    options = dict(options or {})
    mode = options.get("mode") or mode  # (`mode_and_options`: torch.compile takes a mode or options, not both)
    patches = {k: v for k, v in options.items() if k not in _OPTION_NAMES}
    unknown = set(patches) - set(_inductor_settings()) if patches else set()
    if unknown:
        raise ValueError(
            f"ssmspec backend: unknown options {sorted(unknown)}: neither ssmspec's {_OPTION_NAMES} nor Inductor "
            "config settings (torch._inductor.config)"
        )
    policy = _KERNEL_OPTION.get(options.get("kernels"))
    if policy is None:
        raise not_one_of("ssmspec backend: kernels", options["kernels"], _KERNEL_OPTION)
    tree_ops = sum(1 for n in gm.graph.nodes if is_tree_op(n))
    folded = fold_conv_padding(gm) if options.get("fuse", True) else 0
    packed = prepack_linears(gm) if options.get("prepack", True) else 0
    lowered = lower_tree_ops(gm) if policy == "kernels" else 0
    # the references run where no kernel does: inlined, Inductor fuses them (not without Inductor: the graph
    # would then call the Python functions op by op, which is what the eager fast path already does)
    inlined = 0
    if policy != "kernels" and options.get("inductor", True) and options.get("fuse", True):
        inlined = inline_tree_ops(gm, on_cuda=policy == "reference")
    if policy != "reference" and any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
        from ssmspec.kernels import enable_eager_kernels

        # reference ops left in the graph (and the model's eager commits) dispatch through the selector, under
        # the policy of the model running (this graph's, set below; "reference" for every other model)
        enable_eager_kernels()
    STATS.graphs += 1
    STATS.tree_ops += tree_ops
    STATS.lowered += lowered
    STATS.folded += folded
    STATS.inlined += inlined
    STATS.packed += packed
    STATS.per_graph.append({"tree_ops": tree_ops, "lowered": lowered, "folded": folded, "inlined": inlined,
                            "packed": packed})  # fmt: skip
    if not options.get("inductor", True):
        compiled = gm.forward
    else:
        compiled = _inductor_or_fallback(gm, example_inputs, mode, patches)
    return _with_policy(compiled, policy)


def _inductor_settings() -> dict[str, Any]:
    """Inductor's config settings by name (torch internals: `torch._inductor.config`)."""
    from torch._inductor import config

    return config.get_config_copy()


def _inductor_or_fallback(
    gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None, patches: dict | None = None
) -> Callable:
    """Inductor's compilation of the graph, or, if Inductor fails on it (at compile time or at its first
    run: Triton codegen bugs such as torch 2.11's `get_block_shape` TypeError on HF's Mamba2 path), the
    graph as ssmspec's passes left it, with one warning naming the failure. User code never crashes
    because of a compiler failure; errors the graph itself raises still propagate."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    def fallback(exc: BaseException) -> Callable:
        warnings.warn(
            f"ssmspec backend: Inductor failed on a graph ({type(exc).__name__}: {str(exc).splitlines()[0][:200]});"
            " running that graph without Inductor's code generation",
            RuntimeWarning,
            stacklevel=2,
        )
        STATS.fallbacks += 1
        return gm.forward

    config = {**(list_mode_options(mode) if mode else {}), **(patches or {})}

    def workaround(exc: BaseException) -> Callable:
        """Inductor once more with the graph's cumsums opaque (`opaque_cumsums`: torch 2.11's split-scan codegen
        bug); a graph without any, or one that fails again, falls back."""
        if not opaque_cumsums(gm):
            return fallback(exc)
        try:
            compiled = compile_fx(gm, example_inputs, config_patches=config or None)
        except Exception:  # noqa: BLE001 - not that bug: fall back for this graph (its cumsums stay opaque)
            return fallback(exc)
        warnings.warn(
            f"ssmspec backend: Inductor failed on a graph ({type(exc).__name__}: {str(exc).splitlines()[0][:200]});"
            " compiled it with ATen's cumsum instead of Inductor's scan (a torch 2.11 split-scan codegen bug)",
            RuntimeWarning,
            stacklevel=2,
        )
        STATS.workarounds += 1
        return compiled

    try:
        compiled = compile_fx(gm, example_inputs, config_patches=config or None)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: the workaround, else fall back
        return workaround(exc)
    state = {"run": compiled, "proven": False}

    def run(*args):
        if state["proven"]:
            return state["run"](*args)
        try:
            out = state["run"](*args)
        except Exception as exc:  # noqa: BLE001 - the first run compiles Triton code lazily
            state["run"] = workaround(exc)
            try:
                out = state["run"](*args)
            except Exception:  # noqa: BLE001 - the workaround compiled but fails to run: fall back
                state["run"] = fallback(exc)
                out = state["run"](*args)
        state["proven"] = True
        return out

    return run


def _with_policy(compiled: Callable, policy: str) -> Callable:
    """Run a compiled graph under its own kernel policy (per thread: other models are unaffected)."""

    def run(*args):
        with using_kernel_policy(policy):
            return compiled(*args)

    return run


def register() -> None:
    """Register the backend under the name "ssmspec" (idempotent)."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    # while torch loads the entry point, _BACKENDS holds it and torch registers the function itself
    if "ssmspec" not in _COMPILER_FNS and _BACKENDS.get("ssmspec") is None:
        register_backend(ssmspec_backend, name="ssmspec")


register()
