"""Coupling to transformers' kernel seams: finding them in a mixer's code, pointing them at ssmspec's tree
adapters, and handing each adapter the verification of the mixer that called it.

Transformers routes the recurrence of every SSM-like mixer through a few named functions (kernel seams),
decorated with `use_kernel_func_from_hub_with_fallback(name, ...)` or defined by a modeling module under a
seam's name and call signature (LFM3's width-7 `causal_conv1d_fn`). `install(model)` finds the seams each
module's forward calls and points those names in the modeling module at wrappers: outside verification a
wrapper calls HF's function unchanged (plain forwards stay bit-identical, for every model of the family);
inside, it calls the seam's adapter (ssmspec.ops) with a `MixerCall`: the verification of the cache the
mixer was given, and the mixer's own layer index. The mixer's instance `forward` (a `MixerForward`) sets
that call for its duration, per thread; nothing is process-global, so two models verify in two threads.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ssmspec.errors import UnsupportedModelError
from ssmspec.hf import instance
from ssmspec.ops import ADAPTERS, Record
from ssmspec.verification import Verification

# Every seam name transformers uses for SSM-like recurrences, with the leading parameters of its call
# signature (a module-local function is a seam only if it has this name and these parameters).
KNOWN_SEAMS: dict[str, tuple[str, ...]] = {
    "causal_conv1d_fn": ("hidden_states", "weight"),
    "causal_conv1d_update": ("hidden_states", "conv_state", "weight"),
    "selective_scan_fn": ("hidden_states", "dt", "A", "B", "C"),
    "selective_state_update": (),
    "mamba_inner_fn": (),
    "mamba_chunk_scan_combined": ("hidden_states", "dt", "A", "B", "C"),
    "mamba_split_conv1d_scan_combined": (),
    "chunk_gated_delta_rule": ("query", "key", "value", "g", "beta"),
    "fused_recurrent_gated_delta_rule": (),
    "chunk_kda": ("query", "key", "value", "g", "beta"),
    "fused_recurrent_kda": (),
}
# Keyword arguments a mixer passes on through **kwargs that its seam's signature does not name reach a kernel
# only if the kernel names them (HF's seam wrapper drops the rest; a module-local function ignores them). These
# are the ones kernels do name: set to anything but None, the call fails closed.
KERNEL_EXTRAS = frozenset({
    "seq_idx", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "initial_state", "initial_states",
    "final_states_out", "return_final_states", "cache_seqlens", "conv_state_indices", "ssm_state_indices",
    "state_indices", "offsets", "indices",
})  # fmt: skip
CACHE_ARGUMENTS = ("past_key_values", "cache_params", "past_key_value", "cache")


def seam_name(fn: Any) -> str | None:
    """The kernel name of a function decorated with `use_kernel_func_from_hub_with_fallback`, else None."""
    code = getattr(fn, "__code__", None)
    if code is None or "func_name" not in code.co_freevars or fn.__closure__ is None:
        return None
    value = fn.__closure__[code.co_freevars.index("func_name")].cell_contents
    return value if value in KNOWN_SEAMS else None


def local_seam_name(fn: Any, global_name: str, module_name: str) -> str | None:
    """The seam a plain function defined in a modeling module stands for: same name, same leading
    parameters as HF's function of that name (e.g. LFM3's own width-7 `causal_conv1d_fn`), else None."""
    head = KNOWN_SEAMS.get(global_name)
    if not head or not isinstance(fn, types.FunctionType) or fn.__module__ != module_name:
        return None
    if fn.__name__ != global_name:
        return None
    params = [p.name for p in inspect.signature(fn).parameters.values()]
    return global_name if tuple(params[: len(head)]) == head else None


# ------------------------------------------------------------------------------------------- per-thread call
class _Local(threading.local):
    mixer: MixerCall | None = None  # the mixer running inside a verification, in this thread


_LOCAL = _Local()


@dataclass
class MixerCall:
    """A mixer's forward during a verification: what its seams' adapters see (ssmspec.ops.SeamCall)."""

    verification: Verification
    layer: int
    module: str
    parts: dict[str, int] = field(default_factory=dict)  # per seam: slices of the state called on so far
    part: int | None = None  # the slice the seam call in progress owns (None: the whole state)

    @property
    def tree(self):
        return self.verification.tree

    @property
    def commit_strategy(self) -> str:
        return self.verification.commit_strategy

    @property
    def in_place(self) -> bool:
        return self.verification.in_place

    def committed_state(self, seam: str, expected: tuple[int, ...]) -> torch.Tensor | None:
        """This mixer's committed recurrent state, checked against the shape the seam call implies. A mixer that
        calls the seam once per head on a slice of its state [B, H, ...] (Zamba v1's per-head scans: its cache
        holds [B, H, D, S], each call a [B, D, S] slice) owns slice k of it on its k-th call in a forward, HF's
        order of heads (the transform-time probe checks the result by value)."""
        h0 = self.verification.committed_state(self.layer)
        self.part = None
        if h0 is None or tuple(h0.shape) == tuple(expected):
            return h0
        if h0.dim() == len(expected) + 1 and h0.shape[0] == expected[0] and tuple(h0.shape[2:]) == tuple(expected[1:]):
            part = self.parts.get(seam, 0)
            if part < h0.shape[1]:
                self.parts[seam] = part + 1
                self.part = part
                return h0[:, part]
        raise UnsupportedModelError(
            self.module,
            f"calls `{seam}` on a state of shape {tuple(expected)} but its cached recurrent state is "
            f"{tuple(h0.shape)}; ssmspec cannot tell which part of the state a call owns",
        )

    def advanced(self, seam: str) -> None:
        """This mixer's recurrent state (or the slice the call owns) was advanced in place (`in_place`)."""
        self.verification.claim(self.module, seam, self.layer, 0, False, self.part)

    def record(self, seam: str, kind: str, *, states: torch.Tensor | None = None, **replay: Any) -> None:
        """Leave what commit needs for this mixer's recurrent state (or the slice the call owns)."""
        rec = Record(kind, self.layer, 0, states, replay, part=self.part)
        self.verification.record(self.module, seam, rec)


class MixerForward:
    """A mixer's instance `forward`: the class's forward, run with the mixer's verification made visible to
    its seams when the cache it was given is verifying a tree. Picklable (no closures)."""

    def __init__(self, module: nn.Module, path: str) -> None:
        params = list(inspect.signature(type(module).forward).parameters)[1:]
        names = [n for n in CACHE_ARGUMENTS if n in params]
        if not names:
            raise UnsupportedModelError(path, "its forward takes no cache argument, so it cannot verify a tree")
        if not isinstance(getattr(module, "layer_idx", None), int):
            raise UnsupportedModelError(path, "the mixer has no integer `layer_idx` to find its cached state by")
        self.module = module
        self.path = path
        self.cache_name = names[0]
        self.cache_pos = params.index(names[0])

    def __call__(self, *args, **kwargs):
        forward = type(self.module).forward
        cache = kwargs.get(self.cache_name, args[self.cache_pos] if len(args) > self.cache_pos else None)
        verification = getattr(cache, "verification", None)
        if verification is None:
            return forward(self.module, *args, **kwargs)
        outer = _LOCAL.mixer
        _LOCAL.mixer = MixerCall(verification, self.module.layer_idx, self.path)
        try:
            return forward(self.module, *args, **kwargs)
        finally:
            _LOCAL.mixer = outer


def _is_default(value: Any, default: Any) -> bool:
    if value is default or value is None:
        return True
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return False
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - incomparable values are not the default
        return False


def tree_aware(seam: Callable, name: str) -> Callable:
    """Wrap one seam: HF's function outside verification, the seam's tree adapter inside (failing closed on
    arguments the adapter does not know)."""
    params = list(inspect.signature(seam).parameters.values())
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    signature = frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    adapter = ADAPTERS.get(name)

    @functools.wraps(seam)
    def wrapper(*args, **kwargs):
        call = _LOCAL.mixer
        if call is None:
            return seam(*args, **kwargs)
        if adapter is None:
            raise UnsupportedModelError(
                call.module, f"calls the seam `{name}` while verifying a tree; ssmspec has no tree adapter for it"
            )
        arguments = dict(zip(names, args))
        arguments.update(kwargs)
        for arg, value in arguments.items():
            if arg in adapter.understands or arg in adapter.ignores:
                continue
            if arg not in signature and arg not in KERNEL_EXTRAS:
                continue  # dropped before any implementation sees it
            if not _is_default(value, defaults.get(arg)):
                raise UnsupportedModelError(
                    call.module,
                    f"calls `{name}` with `{arg}` set; ssmspec's tree adapter for it does not know that argument",
                )
        full = dict(defaults)
        full.update(arguments)
        return adapter.run(call, full)

    wrapper.__ssmspec_seam__ = name
    return wrapper


# ------------------------------------------------------------------------------------------- the pass
def _code_names(cls: type) -> tuple[set[str], dict[str, Any]]:
    """Global names used by the class's forward and by the methods of the class it calls (one level)."""
    fn = inspect.unwrap(cls.forward)
    names = set(fn.__code__.co_names)
    for attr in fn.__code__.co_names:
        method = getattr(cls, attr, None)
        if isinstance(method, types.FunctionType) and method is not fn and method.__module__ == fn.__module__:
            names |= set(inspect.unwrap(method).__code__.co_names)
    return names, fn.__globals__


def seams_called_by(module: nn.Module) -> dict[str, tuple[str, Callable]]:
    """Global names in the module's forward that are kernel seams -> (seam name, function)."""
    names, glb = _code_names(type(module))
    found = {}
    for name in names:
        obj = glb.get(name)
        if obj is None:
            continue
        seam = getattr(obj, "__ssmspec_seam__", None) or seam_name(obj)
        seam = seam or local_seam_name(obj, name, glb.get("__name__", ""))
        if seam is not None:
            found[name] = (seam, obj)
    return found


def point_globals(module: nn.Module, seams: dict[str, tuple[str, Callable]] | None = None) -> None:
    """Point the seam names in the module's modeling code at ssmspec wrappers (idempotent; the wrappers pass
    through outside verification, so other models of the family are unaffected). `seams`: what
    `seams_called_by(module)` found, if the caller has it already."""
    glb = inspect.unwrap(type(module).forward).__globals__
    for global_name, (seam, fn) in (seams if seams is not None else seams_called_by(module)).items():
        if not hasattr(fn, "__ssmspec_seam__"):
            glb[global_name] = tree_aware(fn, seam)


def install(model: nn.Module) -> tuple[dict[str, list[str]], list[nn.Module]]:
    """Make every module whose forward calls kernel seams tree-aware. Returns ({module path: [seam names]},
    the modules given a MixerForward now, for `uninstall` if the transform is refused)."""
    rewritten: dict[str, list[str]] = {}
    changed: list[nn.Module] = []
    try:
        for path, module in model.named_modules():
            seams = seams_called_by(module)
            if not seams:
                continue
            current = instance.own_forward(module)
            if not isinstance(current, MixerForward):
                if current is not None:
                    raise UnsupportedModelError(path, f"its forward is already replaced on the instance ({current!r})")
                instance.set_own_forward(module, MixerForward(module, path))
                changed.append(module)
            point_globals(module, seams)
            rewritten[path] = sorted({s for s, _ in seams.values()})
    except BaseException:
        uninstall(changed)
        raise
    return rewritten, changed


def uninstall(modules: list[nn.Module]) -> None:
    """Give the modules their class forward back."""
    for module in modules:
        instance.restore_own_forward(module)


def reinstall(model: nn.Module) -> None:
    """After unpickling a transformed model in a new process: point its modeling modules' seams again."""
    for module in model.modules():
        if isinstance(instance.own_forward(module), MixerForward):
            point_globals(module)
