"""Coupling to transformers' cache layers: which layer holds what (conv / recurrent states, attention K/V,
a sliding window) and how ssmspec reads and rewrites them. Nothing else in ssmspec touches layer internals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

# cache layer types whose K/V ssmspec can verify trees on (HF's layer-type names): the rest is refused
SUPPORTED_ATTENTION_TYPES = ("full_attention", "sliding_attention", "hybrid", "hybrid_sliding")


@dataclass(frozen=True)
class AttentionLayer:
    """One layer's attention cache: its index and sliding window (None = full attention)."""

    index: int
    window: int | None


def layer_types(config) -> list[str]:
    """HF's cache layer type per decoder layer (what DynamicCache(config) builds from)."""
    return get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]


def unsupported_layer(layers: list, types: list[str]) -> tuple[int, str] | None:
    """(layer index, reason) of the first cache layer ssmspec cannot verify trees on, else None."""
    for i, layer in enumerate(layers):
        kind = types[i] if i < len(types) else type(layer).__name__
        if isinstance(layer, (DummyLayer, LinearAttentionCacheLayerMixin)) and not isinstance(layer, CacheLayerMixin):
            continue
        if not isinstance(layer, DynamicLayer):
            return i, f"its cache layer {type(layer).__name__} ({kind}) is not a dynamic attention cache"
        if kind not in SUPPORTED_ATTENTION_TYPES:
            return i, f"attention layer type {kind!r} (only full and sliding-window attention take a tree mask)"
        if type(layer).__name__ not in (
            "DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionAndFullAttentionLayer",
            "LinearAttentionAndSlidingWindowAttentionLayer",
        ):  # fmt: skip
            return i, f"its cache layer {type(layer).__name__} keeps more than keys and values"
    return None


def attention_layers(layers: list) -> list[AttentionLayer]:
    """The layers holding attention K/V, with their windows."""
    out = []
    for i, layer in enumerate(layers):
        if isinstance(layer, DynamicLayer):
            window = layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None
            out.append(AttentionLayer(i, int(window) if window is not None else None))
    return out


def recurrent_layers(layers: list) -> list[int]:
    """Indices of the layers holding conv / recurrent states."""
    return [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


def kv(layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A layer's stored keys and values ([B, H, slots, D]), None before the first update."""
    if not layer.is_initialized or layer.keys is None or layer.keys.ndim != 4:
        return None, None
    return layer.keys, layer.values


def kv_width(layer) -> int:
    """How many slots the layer stores."""
    keys, _ = kv(layer)
    return 0 if keys is None else keys.shape[-2]


def set_kv(layer, keys: torch.Tensor, values: torch.Tensor, seen: int) -> None:
    """Replace a layer's K/V (after ssmspec rewrote them); `seen` is the absolute number of slots so far."""
    layer.keys, layer.values = keys, values
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = seen


def conv_state(layer, state_idx: int) -> torch.Tensor | None:
    """The committed conv state (None before the first update)."""
    return layer.conv_states[state_idx] if layer.has_previous_state[state_idx] else None


def recurrent_state(layer, state_idx: int) -> torch.Tensor | None:
    """The committed recurrent state (None before the first update)."""
    if not layer.is_recurrent_states_initialized[state_idx]:
        return None
    return layer.recurrent_states[state_idx]


def state_dicts(layer) -> dict[str, dict[int, torch.Tensor | None]]:
    """The layer's conv and recurrent state dicts (empty for attention-only layers)."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return {}
    return {"conv_states": layer.conv_states, "recurrent_states": layer.recurrent_states}


def stack_states(layers: list, indices: list[int]) -> int:
    """Put the conv / recurrent states of equal shape, dtype and device of the given layers into one tensor each
    (in layer order), every layer's state becoming a view of it: a commit then updates all layers with one op
    per tensor instead of one per layer. HF updates these states in place (`copy_`, static addresses), so the
    views stay the states; marked static as HF marks its own (CUDA graphs). Returns the number of stacks."""
    groups: dict[tuple, list] = {}
    for i in indices:
        for name, states in state_dicts(layers[i]).items():
            for k, t in states.items():
                if t is not None:
                    groups.setdefault((name, tuple(t.shape), t.dtype, t.device), []).append((states, k, t))
    count = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        stack = torch.stack([t for _, _, t in members])
        for j, (states, k, _) in enumerate(members):
            states[k] = stack[j]
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(states[k])
        count += 1
    return count
