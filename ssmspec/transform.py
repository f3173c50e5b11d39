"""ssmspec.transform(): make a Hugging Face SSM / hybrid causal LM verify token trees and speculate.

It runs the seam rewrite pass (ssmspec.passes.seams) on every mixer, checks that every recurrent layer is
covered (otherwise UnsupportedModelError names the module), and gives the model an HF-style `generate`
that speculates when asked to (prompt_lookup_num_tokens, assistant_model, speculation=SpecConfig(...)).
Plain forwards and plain `generate` calls are HF's own, unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from ssmspec.errors import UnsupportedModelError
from ssmspec.passes.seams import rewrite_mixers

_RECURRENT_NAME = re.compile(
    r"mamba|mixer|rwkv|recurrent|lstm|rglru|ssm|linear_?attn|time_?mix|conv|selfattention|block", re.I
)
_SUPPORTED_ATTN = ("eager", "sdpa")
# Filled by ssmspec.speculate.generate on import (imports point down the layers, so transform cannot import
# the decoding loop): the mixin that adds speculative `generate`, and checks run on every transformed model.
GENERATE_MIXINS: list[type] = []
POST_TRANSFORM_CHECKS: list[Callable[[nn.Module], None]] = []


@dataclass
class TransformInfo:
    """What transform() found: rewritten mixers and their seams, recurrent and attention layer indices."""

    mixers: dict[str, list[str]]
    recurrent_layers: list[int]
    attention_layers: list[int]


def _describe(model: nn.Module) -> str:
    for path, module in model.named_modules():
        name = type(module).__name__
        if path and _RECURRENT_NAME.search(name) and not re.search(r"Model$|ForCausalLM", name):
            return f"{path} ({name})"
    return type(model).__name__


def _check(model: nn.Module, mixers: dict[str, list[str]]) -> TransformInfo:
    config = model.config
    stateful = bool(getattr(model, "_is_stateful", False))
    try:
        layers = DynamicCache(config=config).layers
    except Exception as exc:  # noqa: BLE001 - any failure here means HF cannot cache this model generically
        if stateful:
            raise UnsupportedModelError(_describe(model), f"its cache cannot be built generically ({exc})") from exc
        layers = []
    recurrent = [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
    attention = [i for i, layer in enumerate(layers) if isinstance(layer, CacheLayerMixin)]
    if stateful and not mixers:
        raise UnsupportedModelError(
            _describe(model),
            "its recurrence does not go through a known transformers kernel seam (causal_conv1d, selective_scan, "
            "mamba_chunk_scan_combined, chunk_gated_delta_rule, chunk_kda)",
        )
    covered = {getattr(model.get_submodule(p), "layer_idx", None) for p in mixers}
    for i in recurrent:
        if i not in covered:
            raise UnsupportedModelError(f"layer {i}", "a recurrent layer whose mixer calls no known kernel seam")
    for i, layer in enumerate(layers):
        if hasattr(layer, "sliding_window") or "Sliding" in type(layer).__name__:
            raise UnsupportedModelError(f"layer {i}", "sliding-window attention is not supported for tree verification")
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if attention and impl not in _SUPPORTED_ATTN:
        raise UnsupportedModelError(
            type(model).__name__, f"attention implementation {impl!r} cannot take a tree mask; use 'sdpa' or 'eager'"
        )
    return TransformInfo(mixers=mixers, recurrent_layers=recurrent, attention_layers=attention)


_CLASS_CACHE: dict[type, type] = {}


def transform(hf_model: nn.Module, config: object | None = None) -> nn.Module:
    """Make `hf_model` tree-verifiable and speculative, in place; returns the same object.

    Plain forward logits stay HF's own, and so does `generate` without speculation arguments, unless
    `config` (a SpecConfig) is given: then `generate` speculates with it by default.
    """
    if not hasattr(hf_model, "generate") or not hasattr(hf_model, "config"):
        raise TypeError("ssmspec.transform expects a Hugging Face causal LM (a PreTrainedModel with generate)")
    mixers = rewrite_mixers(hf_model)
    info = _check(hf_model, mixers)
    cls = type(hf_model)
    mixins = tuple(m for m in GENERATE_MIXINS if not isinstance(hf_model, m))
    if mixins:
        if cls not in _CLASS_CACHE:
            _CLASS_CACHE[cls] = type(f"SSMSpec{cls.__name__}", (*mixins, cls), {"__module__": cls.__module__})
        hf_model.__class__ = _CLASS_CACHE[cls]
    hf_model.ssmspec_info = info
    hf_model.ssmspec_config = config
    for check in POST_TRANSFORM_CHECKS:
        check(hf_model)
    return hf_model
