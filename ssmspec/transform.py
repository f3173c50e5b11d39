"""ssmspec.transform(): make a Hugging Face SSM / hybrid causal LM verify token trees and speculate.

It runs the seam rewrite pass (ssmspec.passes.seams) on every mixer, checks that every recurrent layer is
covered (otherwise UnsupportedModelError names the module), and gives the model an HF-style `generate`
that speculates when asked to (prompt_lookup_num_tokens, assistant_model, speculation=SpecConfig(...)).
Plain forwards and plain `generate` calls are HF's own, unchanged.
"""

from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin
from transformers.utils import ModelOutput

from ssmspec.errors import UnsupportedModelError
from ssmspec.passes.seams import rewrite_mixers
from ssmspec.speculate.config import SpecConfig
from ssmspec.speculate.drafters import DraftModelDrafter, NoDrafter, PromptLookupDrafter
from ssmspec.speculate.engine import speculative_generate

_RECURRENT_NAME = re.compile(r"mamba|mixer|rwkv|recurrent|lstm|rglru|ssm|linear_?attn|time_?mix|conv", re.I)
_SUPPORTED_ATTN = ("eager", "sdpa")
# generation settings that change greedy logits; speculation does not apply them yet, so they are refused
_LOGITS_SETTINGS = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "guidance_scale": None,
    "exponential_decay_length_penalty": None,
}


@dataclass
class TransformInfo:
    """What transform() found: rewritten mixers and their seams, recurrent and attention layer indices."""

    mixers: dict[str, list[str]]
    recurrent_layers: list[int]
    attention_layers: list[int]


@dataclass
class SpecGenerateOutput(ModelOutput):
    """`generate(..., return_dict_in_generate=True)` output: sequences plus speculation statistics."""

    sequences: torch.Tensor | None = None
    spec_stats: dict[str, Any] | None = None


def _describe(model: nn.Module) -> str:
    for path, module in model.named_modules():
        if path and _RECURRENT_NAME.search(type(module).__name__):
            return f"{path} ({type(module).__name__})"
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


class SpecGenerationMixin:
    """Adds speculation to HF's `generate`; without speculation arguments it is HF's generate unchanged."""

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        prompt_lookup_num_tokens: int | None = None,
        assistant_model: nn.Module | None = None,
        speculation: SpecConfig | None = None,
        **kwargs: Any,
    ):
        """HF generate; speculative (greedy, exact) when prompt_lookup_num_tokens, assistant_model or
        speculation is given."""
        if prompt_lookup_num_tokens is None and assistant_model is None and speculation is None:
            return super().generate(inputs, generation_config, **kwargs)
        return _speculative(
            self, inputs, generation_config, prompt_lookup_num_tokens, assistant_model, speculation, kwargs
        )


def _speculative(model, inputs, generation_config, lookup, assistant, spec, kwargs):
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("speculative generate needs input_ids")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got shape {tuple(input_ids.shape)}")
    attention_mask = kwargs.pop("attention_mask", None)
    return_dict = kwargs.pop("return_dict_in_generate", None)
    gc = copy.deepcopy(generation_config or model.generation_config)
    unused = gc.update(**kwargs)
    if unused:
        raise ValueError(f"speculative generate does not take {sorted(unused)}")
    return_dict = gc.return_dict_in_generate if return_dict is None else return_dict
    if gc.do_sample:
        raise NotImplementedError("speculative sampling is not implemented yet: use do_sample=False (greedy)")
    if (gc.num_beams or 1) > 1:
        raise ValueError("speculative decoding does not combine with beam search (num_beams > 1)")
    for name, default in _LOGITS_SETTINGS.items():
        value = getattr(gc, name, default)
        if value not in (default, None) and not (name == "min_length" and value == 0):
            raise NotImplementedError(f"generation setting {name}={value!r} is not applied by speculative decoding yet")
    eos = gc.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
        if gc.pad_token_id is not None and gc.pad_token_id not in eos and bool((input_ids == gc.pad_token_id).any()):
            attention_mask = (input_ids != gc.pad_token_id).long()
    if attention_mask.shape != input_ids.shape:
        raise ValueError("attention_mask must have the shape of input_ids")
    if bool((attention_mask.sum(-1) == 0).any()):
        raise ValueError("a batch row is all padding: every row needs at least one real token")
    if gc.max_new_tokens is not None:
        max_new = int(gc.max_new_tokens)
    else:
        max_new = int(gc.max_length) - input_ids.shape[1]
    if max_new < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new}")

    spec = spec or SpecConfig(
        drafter="draft_model" if assistant is not None else "prompt_lookup",
        num_draft_tokens=lookup if lookup is not None else (gc.num_assistant_tokens or 5),
    )
    if spec.drafter == "draft_model":
        if assistant is None:
            raise ValueError("SpecConfig(drafter='draft_model') needs assistant_model=")
        vocab = model.config.get_text_config().vocab_size
        drafter = DraftModelDrafter(assistant, vocab, strategy=spec.commit)
    elif spec.drafter == "prompt_lookup":
        drafter = PromptLookupDrafter(spec.max_matching_ngram_size, tree=spec.tree)
    else:
        drafter = NoDrafter()
    nodes = spec.tree_budget if spec.tree else spec.num_draft_tokens
    sequences, stats, _ = speculative_generate(
        model,
        input_ids,
        attention_mask,
        max_new_tokens=max_new,
        eos_token_ids=eos,
        pad_token_id=int(pad),
        drafter=drafter,
        max_draft_nodes=nodes,
        max_draft_depth=spec.num_draft_tokens,
        strategy=spec.commit,
    )
    if not return_dict:
        return sequences
    summary = asdict(stats)
    summary["mean_accepted_per_step"] = stats.mean_accepted_per_step
    return SpecGenerateOutput(sequences=sequences, spec_stats=summary)


_CLASS_CACHE: dict[type, type] = {}


def transform(hf_model: nn.Module, config: SpecConfig | None = None) -> nn.Module:
    """Make `hf_model` tree-verifiable and speculative, in place; returns the same object.

    Plain forward logits and plain `generate` stay HF's own. `config` sets the default speculation
    used when `generate(..., speculation=True)`-style calls give no SpecConfig of their own.
    """
    if not hasattr(hf_model, "generate") or not hasattr(hf_model, "config"):
        raise TypeError("ssmspec.transform expects a Hugging Face causal LM (a PreTrainedModel with generate)")
    mixers = rewrite_mixers(hf_model)
    info = _check(hf_model, mixers)
    cls = type(hf_model)
    if not isinstance(hf_model, SpecGenerationMixin):
        if cls not in _CLASS_CACHE:
            _CLASS_CACHE[cls] = type(
                f"SSMSpec{cls.__name__}", (SpecGenerationMixin, cls), {"__module__": cls.__module__}
            )
        hf_model.__class__ = _CLASS_CACHE[cls]
    hf_model.ssmspec_info = info
    hf_model.ssmspec_config = config
    return hf_model
