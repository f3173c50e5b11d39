"""Coupling to how a model was placed: accelerate's module hooks (where a module's own forward is called from) and
transformers' tensor parallelism (`tensor_parallel`, `Agreement`).

A model loaded with `device_map` (accelerate's big-model inference: layers on several devices, weights offloaded
to CPU or disk) has a hook on its modules: accelerate keeps the module's forward in the instance attribute
`_old_forward` and sets the instance `forward` to a wrapper that moves the inputs to the module's execution device
and loads offloaded weights (`_hf_hook.pre_forward`), calls `_old_forward`, and puts the weights back. ssmspec's
instance forwards (a mixer's `MixerForward`, a generic module's `TreeStepForward`) go in that slot, inside the hook,
so every verify forward runs with the weights resident and on the layer's device. This module is the one place
that names accelerate's attributes and transformers' `_tp_size`, `_mesh_manager` and `distributed_config`.

A model loaded with `from_pretrained(tp_plan=...)` runs in several processes that each hold a shard of some weights
and meet in collectives inside every forward: each process must run the same forwards (the same tree sizes, the same
steps) in the same order. ssmspec's choices are deterministic functions of the logits (identical on every process
after the collectives) except where they follow measured time (the adaptive policy, the cost curve, the one-node
path); `Agreement` makes those measurements the same on every process.
"""

from __future__ import annotations

import inspect
import types
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
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


def forward_takes(model: nn.Module, name: str) -> bool:
    """Whether the model's forward takes the keyword `name` (position_ids, HF's logits_to_keep), as HF's generate
    checks before passing it."""
    return name in inspect.signature(model.forward).parameters


def offloaded(model: nn.Module) -> bool:
    """Whether some of the model's weights are offloaded (accelerate's `device_map` to the CPU or disk): they sit on the
    meta device between forwards, and its hooks load them inside each forward."""
    return any(p.device.type == "meta" for p in model.parameters())


def _is_class_forward(module: nn.Module, fn: Any) -> bool:
    if fn is None:
        return True
    return getattr(fn, "__func__", None) is type(module).forward and getattr(fn, "__self__", None) is module


def uncompiled_call(model: nn.Module) -> Any:
    """`model(...)` without the compiled forward `model.compile` installed (nn.Module internals, named here: its
    `_call_impl` runs hooks and forward eagerly, as an uncompiled module's `__call__` does)."""
    return model._call_impl if getattr(model, "_compiled_call_impl", None) is not None else model


def compile_wrapper(model: nn.Module) -> bool:
    """Whether `model` is the wrapper `torch.compile(model)` returns (torch internals, named here: Dynamo's
    OptimizedModule, which forwards attributes to the module it wraps, `_orig_mod`)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def tensor_parallel(model: nn.Module) -> int:
    """The degree of tensor parallelism the model was loaded with (`from_pretrained(tp_plan=...)`: transformers
    records it as `_tp_size`); 1 where it was not sharded."""
    size = getattr(model, "_tp_size", None)
    return int(size) if isinstance(size, int) and size > 1 else 1


def parallel_degrees(model: nn.Module) -> dict[str, int]:
    """The degrees of transformers' other kinds of parallelism a model was loaded with (pipeline, FSDP, expert,
    data replicas: `config.distributed_config`), those above 1 only."""
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    names = {"pp_size": "pipeline", "fsdp_size": "FSDP", "ep_size": "expert", "dp_replicate_size": "data replica"}
    degrees = {label: getattr(config, name, 1) for name, label in names.items()}
    return {label: int(d) for label, d in degrees.items() if isinstance(d, int) and d > 1}


def tensor_parallel_group(model: nn.Module) -> Any:
    """The process group a tensor-parallel model's forwards meet in (its device mesh's "tp" dimension), None for a
    model that is not sharded."""
    if tensor_parallel(model) <= 1:
        return None
    manager = getattr(model, "_mesh_manager", None)
    mesh = manager.get_mesh("tp") if manager is not None else getattr(model, "_device_mesh", None)
    if mesh is not None and mesh.ndim > 1:  # (pp, fsdp, tp): the tp dimension's group
        mesh = mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None
    return mesh.get_group() if mesh is not None else dist.group.WORLD


class Agreement:
    """The same measurements on every process of a tensor-parallel model: `seconds(...)` returns, for each value,
    the largest any process measured (one all-reduce), so that choices that follow time (speculate or decode
    plainly, how deep, which path) are the same on every process and their forwards' collectives match. For a
    model that is not sharded it returns the values as given and costs nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.group = tensor_parallel_group(model)
        self.device = torch.device("cpu")
        if self.group is not None and "nccl" in str(dist.get_backend(self.group)):
            self.device = torch.device("cuda", torch.cuda.current_device())  # NCCL reduces device tensors only

    @property
    def sharded(self) -> bool:
        """Whether the model runs in several processes (tensor parallelism)."""
        return self.group is not None

    def same(self, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Whether every process passed equal tensors (a checksum of each, one all-reduce); True on one process.
        The answer is the same on every process, so all of them go on, or all of them raise."""
        if self.group is None:
            return True
        sums = [zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()) if t is not None else -1
                for t in tensors]  # fmt: skip
        both = torch.tensor(sums + [-x for x in sums], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)  # the largest and the smallest at once
        n = len(sums)
        return bool((both[:n] == -both[n:]).all())

    def seconds(self, values: Sequence[float]) -> list[float]:
        """`values` (seconds measured on this process), each replaced by its largest over the processes."""
        if self.group is None:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()


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


def agree_on_inputs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: bool,
    generator: torch.Generator | None,
) -> Agreement:  # fmt: skip
    """Under tensor parallelism every process must verify the same trees (their forwards meet in collectives), so
    they must start from the same prompts and, when `sampling`, the same random state (`generator`'s, else torch's
    global one on the prompts' device): checked once per call (one all-reduce), raising on every process alike
    rather than hanging in a mismatched collective or drawing different tokens. Nothing on one process. Returns the
    model's Agreement."""
    agreement = Agreement(model)
    if not agreement.sharded:
        return agreement
    tensors = [input_ids, attention_mask]
    if sampling:
        device = input_ids.device
        state = generator.get_state() if generator is not None else (
            torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state())  # fmt: skip
        tensors.append(state)
    if not agreement.same(tensors):
        what = "input_ids and attention_mask" + (", and the same random state to sample" if sampling else "")
        raise ValueError(
            f"the processes of a tensor-parallel model must generate alike, but they were given different "
            f"prompts or random states: every process needs the same {what} (seed every process alike, or pass "
            "generators seeded alike)"
        )
    return agreement


# where a transformers forward reads the host while a step is captured, and what runs it without: (the file it reads
# from, the advice)
CAPTURE_HINTS = (
    (
        "integrations/moe.py",
        "HF's eager experts loop over the experts a batch routes to (a host read); "
        "`model.set_experts_implementation('batched_mm')` (or 'grouped_mm' where it supports the dtype) runs them "
        "without one",
    ),
)


def capture_hint(message: str) -> str:
    """Advice for a step capture that failed on a host read inside transformers' code (named by `message`), or ''."""
    return next((f"; {advice}" for where, advice in CAPTURE_HINTS if where in message), "")
