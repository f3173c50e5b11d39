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

import torch
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


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: accelerate's hook's `execution_device` where it has one (an offloaded module's weights
    sit on the meta device between forwards), else the device of its first parameter that is not on meta, else the
    CPU. `next(model.parameters()).device` was meta for a model whose embedding was offloaded to disk, and ssmspec
    built its inputs there."""
    hook = module.__dict__.get(HOOK)
    for h in [hook, *getattr(hook, "hooks", ())]:  # accelerate's SequentialHook holds several
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def input_device(model: nn.Module) -> torch.device:
    """Where a model's token ids go: its input embedding's execution device (`execution_device`)."""
    getter = getattr(model, "get_input_embeddings", None)
    embed = getter() if getter is not None else None
    return execution_device(embed if isinstance(embed, nn.Module) else model)
