"""Coupling to transformers' `generate`: resolve a call's settings exactly as HF does (its own private
helpers for the config merge, special tokens, attention mask and lengths), then hold every GenerationConfig
field against a whitelist: each value that differs from HF's default is applied by speculative generate or
refused with an error naming it. Nothing is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from ssmspec.errors import UnsupportedSettingError

# applied exactly by ssmspec's speculative generate (a cache is always used; ssmspec never compiles behind
# the user's back, so use_cache and disable_compile hold too)
APPLIED = frozenset({
    "max_length", "max_new_tokens", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache",
    "return_dict_in_generate", "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "disable_compile",
})  # fmt: skip
# applied at their default (greedy, one beam, one sequence), refused otherwise
REFUSED_UNLESS_DEFAULT = frozenset({"do_sample", "num_beams", "num_return_sequences"})
# settings HF's greedy search itself never reads (sampling and beam-only knobs): no effect, as in HF
NO_EFFECT_WHEN_GREEDY = frozenset({
    "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
    "length_penalty", "early_stopping", "low_memory",
})  # fmt: skip
# bookkeeping, not settings; and universal-assisted-decoding knobs, meaningless without an assistant tokenizer
METADATA = frozenset({
    "transformers_version", "_from_model_config", "is_assistant", "decoder_start_token_id",
    "assistant_lookbehind", "target_lookbehind",
})  # fmt: skip
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
# why each refused setting is refused (the error message and the docs' tables say it)
_NOT_YET = "not applied by speculative decoding yet"
_PROCESSOR = "a logits processor (changes the logits the greedy choice is made from); not applied per tree node yet"
_STOPPING = "a stopping criterion that is not evaluated per emitted token yet"
_STRATEGY = "another decoding strategy than greedy search"
_HF_RUNTIME = "configures HF's own cache or compilation, which speculative decoding does not use"
_HF_SPECULATION = "HF's own speculation variant, not ssmspec's"
REASONS = {
    "do_sample": "speculative sampling is not implemented yet: use do_sample=False (greedy)",
    "num_beams": "speculative decoding does not combine with beam search (num_beams > 1)",
    "num_return_sequences": "speculative generate returns one sequence per prompt",
    "output_scores": "speculative generate does not return scores yet",
    "output_logits": "speculative generate does not return logits yet",
    "output_attentions": "speculative generate does not return attentions",
    "output_hidden_states": "speculative generate does not return hidden states",
    "token_healing": "token healing rewrites the prompt's last tokens; not applied yet",
    "stop_strings": _STOPPING,
    "max_time": _STOPPING,
    **dict.fromkeys(
        (
            "repetition_penalty",
            "encoder_repetition_penalty",
            "no_repeat_ngram_size",
            "encoder_no_repeat_ngram_size",
            "bad_words_ids",
            "min_length",
            "min_new_tokens",
            "suppress_tokens",
            "begin_suppress_tokens",
            "forced_bos_token_id",
            "forced_eos_token_id",
            "sequence_bias",
            "exponential_decay_length_penalty",
            "guidance_scale",
            "watermarking_config",
            "remove_invalid_values",
            "renormalize_logits",
        ),
        _PROCESSOR,
    ),  # fmt: skip
    **dict.fromkeys(
        ("penalty_alpha", "num_beam_groups", "diversity_penalty", "constraints", "force_words_ids", "dola_layers"),
        _STRATEGY,
    ),
    **dict.fromkeys(
        (
            "cache_implementation",
            "cache_config",
            "max_cache_len",
            "compile_config",
            "prefill_chunk_size",
            "continuous_batching_config",
        ),
        _HF_RUNTIME,
    ),  # fmt: skip
    **dict.fromkeys(
        ("assistant_early_exit", "assistant_ensemble_weight", "speculation_type", "use_mtp"), _HF_SPECULATION
    ),
}
# arguments of HF's generate() outside the GenerationConfig
CALL_ARGUMENTS = (
    "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "streamer",
    "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "assistant_tokenizer",
)  # fmt: skip


@dataclass
class Plan:
    """A generate call, resolved: what the speculative loop needs."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    eos_token_ids: list[int]
    pad_token_id: int
    return_dict: bool
    config: GenerationConfig


def _is_set(value: Any, default: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return value is not default
    if not value and not default:  # None, False, 0, empty: all "unset"
        return False
    return value != default


def classify(name: str) -> tuple[str, str]:
    """(status, note) of one GenerationConfig field: "not a setting", "applied", "no effect", "refused unless
    default" or "refused". The one place that decides; `refused_settings` and the docs' tables both use it."""
    if name in METADATA or name.startswith("_"):
        return "not a setting", "bookkeeping, or meaningful only with an assistant tokenizer"
    if name in REFUSED_UNLESS_DEFAULT:
        return "refused unless default", REASONS[name]
    if name == "num_assistant_tokens_schedule":
        return "applied", f"one of {', '.join(SCHEDULES)}; heuristic adapts the draft depth"
    if name in APPLIED:
        return "applied", "exactly as HF's generate"
    if name in NO_EFFECT_WHEN_GREEDY:
        return "no effect", "greedy decoding does not read it (as in HF)"
    return "refused", REASONS.get(name, _NOT_YET)


def refused_settings(config: GenerationConfig) -> list[tuple[str, Any, str]]:
    """(name, value, reason) of every setting that differs from HF's default and is not applied exactly."""
    defaults = GenerationConfig._get_default_generation_params()
    blank = GenerationConfig()
    out = []
    for name, value in config.to_dict().items():
        if not _is_set(value, defaults.get(name, getattr(blank, name, None))):
            continue
        status, note = classify(name)
        if status.startswith("refused"):
            out.append((name, value, note))
    return out


def settings_table() -> list[tuple[str, str, str]]:
    """(field, status, note) for every GenerationConfig field and generate argument: the docs render it, so the
    documented behaviour is the code's."""
    rows = [(name, *classify(name)) for name in sorted(GenerationConfig().to_dict())]
    return rows + [(arg, "refused if given", _NOT_YET) for arg in CALL_ARGUMENTS]


def resolve(model, inputs: torch.Tensor | None, generation_config: GenerationConfig | None, kwargs: dict) -> Plan:
    """Resolve a speculative generate call as HF's generate() would, refusing what it would not apply."""
    kwargs = dict(kwargs)
    kwargs.pop("trust_remote_code", None)
    kwargs.pop("tokenizer", None)  # only used by stop strings, which are refused below
    for name in CALL_ARGUMENTS:
        value = kwargs.pop(name, None)
        if value is None or value is False or (name in ("logits_processor", "stopping_criteria") and len(value) == 0):
            continue
        raise UnsupportedSettingError(name, f"generate argument `{name}`: {_NOT_YET}")
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("speculative generate needs input_ids (inputs_embeds are not supported)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got {shape}")
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    attention_mask = model_kwargs.pop("attention_mask", None)
    for name in ("output_attentions", "output_hidden_states"):  # HF copies these to the model kwargs too
        model_kwargs.pop(name, None)
    if model_kwargs:
        raise ValueError(f"speculative generate does not take {sorted(model_kwargs)}")
    refused = refused_settings(config)
    if refused:
        name, value, reason = refused[0]
        raise UnsupportedSettingError(name, f"generation setting {name}={value!r} is set: {reason}")
    batch = input_ids.shape[0]
    model._prepare_special_tokens(config, attention_mask is not None, device=input_ids.device, batch_size=batch)
    if attention_mask is None:
        attention_mask = model._prepare_attention_mask_for_generation(input_ids, config, {})
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=has_default_max_length, has_default_min_length=True,
        model_input_name="input_ids", inputs_tensor=input_ids, input_ids_length=input_ids.shape[1],
    )  # fmt: skip
    model._validate_generated_length(config, input_ids.shape[1], has_default_max_length)
    eos = config._eos_token_tensor
    eos_ids = [] if eos is None else [int(e) for e in eos.flatten().tolist()]
    pad = config._pad_token_tensor
    pad_id = int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0)
    return Plan(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=int(config.max_length) - input_ids.shape[1],
        eos_token_ids=eos_ids,
        pad_token_id=pad_id,
        return_dict=bool(config.return_dict_in_generate),
        config=config,
    )
