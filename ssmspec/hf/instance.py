"""Coupling to how a model was placed: accelerate's module hooks (where a module's own forward is called from) and
transformers' tensor parallelism (`tensor_parallel`).

A model loaded with `device_map` (accelerate's big-model inference: layers on several devices, weights offloaded
to CPU or disk) has a hook on its modules: accelerate keeps the module's forward in the instance attribute
`_old_forward` and sets the instance `forward` to a wrapper that moves the inputs to the module's execution device
and loads offloaded weights (`_hf_hook.pre_forward`), calls `_old_forward`, and puts the weights back. ssmspec's
instance forwards (a mixer's `MixerForward`, a generic module's `TreeStepForward`) go in that slot, inside the hook,
so every verify forward runs with the weights resident and on the layer's device. This module is the one place
that names accelerate's attributes and transformers' `_tp_size`.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn

HOOK = "_hf_hook"  # accelerate.hooks.add_hook_to_module: the hook object
HOOKED_FORWARD = "_old_forward"  # ... and the forward it wraps


def hooked(module: nn.Module) -> bool:
    """Whether accelerate has hooked the module (its instance `forward` is accelerate's wrapper)."""
    return HOOK in module.__dict__ and HOOKED_FORWARD in module.__dict__


def slot(module: nn.Module) -> str:
    """The instance attribute the module's own forward is called through."""
    return HOOKED_FORWARD if hooked(module) else "forward"


def own_forward(module: nn.Module) -> Any:
    """What the module's own-forward slot holds on the instance: None where it calls its class's forward."""
    current = module.__dict__.get(slot(module))
    if _is_class_forward(module, current):
        return None
    return current


def set_own_forward(module: nn.Module, forward: Any) -> None:
    """Make `forward` the module's own forward (inside accelerate's hook where it has one)."""
    setattr(module, slot(module), forward)


def restore_own_forward(module: nn.Module) -> None:
    """Give the module its class's forward back (accelerate's hook, if any, stays and calls it)."""
    if hooked(module):
        setattr(module, HOOKED_FORWARD, types.MethodType(type(module).forward, module))
    else:
        module.__dict__.pop("forward", None)


def _is_class_forward(module: nn.Module, fn: Any) -> bool:
    if fn is None:
        return True
    return getattr(fn, "__func__", None) is type(module).forward and getattr(fn, "__self__", None) is module


def tensor_parallel(model: nn.Module) -> int:
    """The degree of tensor parallelism the model was loaded with (`from_pretrained(tp_plan=...)`: transformers
    records it as `_tp_size`); 1 where it was not sharded."""
    size = getattr(model, "_tp_size", None)
    return int(size) if isinstance(size, int) and size > 1 else 1
