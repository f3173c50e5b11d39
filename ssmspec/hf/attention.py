"""Coupling to transformers' attention functions: SDPA attention over grouped key/value heads without copying them.

HF's SDPA attention (`transformers.integrations.sdpa_attention.sdpa_attention_forward`) repeats the key and value heads
up to the query heads (`repeat_kv`) for every call of more than one query token with a mask: a full copy of the
layer's K/V, `num_key_value_groups` times over, for every verify step (a long batched run of a grouped-query hybrid
held 70 MiB of such copies at its peak, at 6,000 tokens). HF packs a single query token onto the key/value heads
instead (`pack_gqa`); `grouped_sdpa` does the same for any number of query tokens: the query heads of each key/value
head become rows of one attention over that head, each row masked as its own query token. Every query row attends
to the same keys with the same mask as with repeated heads.

While ssmspec runs a forward (`grouping`, per thread: its prefill, decode and verify steps), the SDPA attention of a
modeling module whose code looks its attention function up in `ALL_ATTENTION_FUNCTIONS` gets `grouped_sdpa`
(`install` points that name at an `AttentionFunctions` proxy); outside, on other threads and for every other
implementation, HF's own function runs unchanged, so plain forwards stay HF's. Private transformers API used here:
the module-level `ALL_ATTENTION_FUNCTIONS` registry and the signature of its "sdpa" function.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

_LOCAL = threading.local()
REGISTRY = "ALL_ATTENTION_FUNCTIONS"
# the mask of one attention call over grouped heads repeats a step's mask per query head of a key/value head, and SDPA
# takes it as float32 (a boolean one converted inside): beyond this many bytes the groups are attended one call each
# (each call then reads the keys again: at 6,000 slots, batch 8 and 25 nodes, one call's mask took 14 MiB)
GROUPED_MASK_BYTES = 4 << 20


@contextlib.contextmanager
def grouping(on: bool = True) -> Iterator[None]:
    """SDPA attention of ssmspec's forwards on this thread runs on the grouped key/value heads (`grouped_sdpa`)."""
    outer = getattr(_LOCAL, "on", False)
    _LOCAL.on = on
    try:
        yield
    finally:
        _LOCAL.on = outer


def grouped_sdpa(hf_sdpa: Callable) -> Callable:
    """HF's SDPA attention function `hf_sdpa`, with more than one query token over grouped key/value heads run
    without repeating the heads where `grouping` is on (see the module docstring); anything else (one token, no mask,
    a mask per head, a position bias, keys and values of other widths, training) goes to `hf_sdpa`."""

    def attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        groups = int(getattr(module, "num_key_value_groups", 1) or 1)
        plain = (
            not getattr(_LOCAL, "on", False) or groups <= 1 or query.shape[2] == 1 or attention_mask is None
            or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[2] != query.shape[2]
            or dropout or module.training
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or key.shape[1] * groups != query.shape[1] or kwargs.get("cache") is not None
        )  # fmt: skip
        if plain:
            return hf_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        b, heads, n, _ = query.shape
        # query head h = kv_head * groups + r (HF's repeat_kv order): row r * n + i of kv_head's attention, the groups
        # r in chunks whose mask stays within GROUPED_MASK_BYTES
        per_group = max(attention_mask.shape[0], b) * n * attention_mask.shape[-1] * 4
        chunk = max(1, min(groups, GROUPED_MASK_BYTES // max(per_group, 1)))
        grouped = query.reshape(b, heads // groups, groups, n, query.shape[-1])
        parts = []
        for r in range(0, groups, chunk):
            k = min(chunk, groups - r)
            rows = grouped[:, :, r : r + k].reshape(b, heads // groups, k * n, query.shape[-1])
            mask = attention_mask if k == 1 else attention_mask.repeat(1, 1, k, 1)
            out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
            parts.append(out.reshape(out.shape[0], heads // groups, k, n, value.shape[-1]))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return out.reshape(out.shape[0], heads, n, value.shape[-1]).transpose(1, 2).contiguous(), None

    attention.__wrapped__ = hf_sdpa
    return attention


class AttentionFunctions:
    """A modeling module's `ALL_ATTENTION_FUNCTIONS`, with "sdpa" looked up as `grouped_sdpa` of HF's (which passes
    through outside ssmspec's forwards); everything else is the registry's."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry
        self._grouped: dict[int, Callable] = {}

    def _wrap(self, name: str | None, fn: Callable) -> Callable:
        if name != "sdpa" or fn is None:
            return fn
        if id(fn) not in self._grouped:
            self._grouped[id(fn)] = grouped_sdpa(fn)
        return self._grouped[id(fn)]

    def get_interface(self, attn_implementation: str, default: Callable) -> Callable:
        return self._wrap(attn_implementation, self._registry.get_interface(attn_implementation, default))

    def __getitem__(self, name: str) -> Callable:
        return self._wrap(name, self._registry[name])

    def get(self, name: str, default: Any = None) -> Any:
        return self._wrap(name, self._registry.get(name, default))

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)


def install(model: nn.Module) -> int:
    """Point `ALL_ATTENTION_FUNCTIONS` in the modeling code of every module of `model` that looks its attention up
    there at an `AttentionFunctions` proxy (idempotent; pass-through outside ssmspec's forwards). Returns how many
    modeling modules it changed."""
    changed = 0
    seen: set[int] = set()
    for module in model.modules():
        forward = inspect.unwrap(type(module).forward)
        glb = getattr(forward, "__globals__", None)
        code = getattr(forward, "__code__", None)
        if glb is None or code is None or REGISTRY not in code.co_names or id(glb) in seen:
            continue
        seen.add(id(glb))
        registry = glb.get(REGISTRY)
        if registry is not None and not isinstance(registry, AttentionFunctions) and hasattr(registry, "get_interface"):
            glb[REGISTRY] = AttentionFunctions(registry)
            changed += 1
    return changed
