"""Coupling to transformers' `generate`: resolve a call's settings exactly as HF does (its own private
helpers for the config merge, special tokens, attention mask and lengths), then hold every GenerationConfig
field against a whitelist: each value that differs from HF's default is applied by speculative generate or
refused with an error naming it. Nothing is silently ignored.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import logits_process
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ssmspec.errors import UnsupportedSettingError
from ssmspec.hf import instance as hf_instance

# applied exactly by ssmspec's speculative generate (a cache is always used; ssmspec never compiles behind
# the user's back, so use_cache and disable_compile hold too)
APPLIED = frozenset({
    "max_length", "max_new_tokens", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache",
    "return_dict_in_generate", "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "disable_compile", "do_sample",
    "output_scores", "output_logits", "stop_strings", "max_time",
})  # fmt: skip
# logits processors HF builds from the config: applied to every verified node with that node's own ids
PROCESSORS = frozenset({
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "min_length", "min_new_tokens", "suppress_tokens", "begin_suppress_tokens",
    "forced_bos_token_id", "forced_eos_token_id", "sequence_bias", "exponential_decay_length_penalty",
    "watermarking_config", "remove_invalid_values", "renormalize_logits",
})  # fmt: skip
# warpers: applied when sampling; HF's greedy search never reads them (no effect, as in HF)
WARPERS = frozenset({"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"})
# applied at their default (one beam, one sequence per prompt when greedy), refused otherwise
REFUSED_UNLESS_DEFAULT = frozenset({"num_beams", "num_return_sequences"})
# beam-search-only knobs: no effect on sampling or greedy search, as in HF
NO_EFFECT = frozenset({"length_penalty", "early_stopping", "low_memory"})
# bookkeeping, not settings; and universal-assisted-decoding knobs, meaningless without an assistant tokenizer
METADATA = frozenset({
    "transformers_version", "_from_model_config", "is_assistant", "decoder_start_token_id",
    "assistant_lookbehind", "target_lookbehind",
})  # fmt: skip
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
# why each refused setting is refused (the error message and the docs' tables say it)
_NOT_YET = "not applied by speculative decoding yet"
_STRATEGY = "another decoding strategy than greedy search or sampling"
_HF_RUNTIME = "configures HF's own cache or compilation, which speculative decoding does not use"
_HF_SPECULATION = "HF's own speculation variant, not ssmspec's"
_STATEFUL = (
    "keeps state between calls or depends on the row's place in the batch; ssmspec scores tree nodes in any order"
)
REASONS = {
    "num_beams": "speculative decoding does not combine with beam search (num_beams > 1)",
    "num_return_sequences": "several sequences per prompt need do_sample=True (as in HF)",
    "output_attentions": "speculative generate does not return attentions",
    "output_hidden_states": "speculative generate does not return hidden states",
    "token_healing": "token healing rewrites the prompt's last tokens with a nested generate; not applied",
    "guidance_scale": "classifier-free guidance runs a second, unconditional model pass per token; not applied",
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
# arguments of HF's generate() outside the GenerationConfig, applied
CALL_ARGUMENTS_APPLIED = {
    "logits_processor": "applied per tree node; a custom processor must depend only on the ids it is given",
    "stopping_criteria": "applied per emitted token; a custom criterion must depend only on the ids it is given",
    "streamer": "receives the prompt, then each step's accepted tokens (as HF: one put per generated column)",
    "tokenizer": "used by stop_strings, as in HF",
}
# arguments of HF's generate() outside the GenerationConfig, refused when given
CALL_ARGUMENTS_REFUSED = {
    "prefix_allowed_tokens_fn": "takes the row's index in the batch; ssmspec scores tree nodes, not batch rows",
    "synced_gpus": "multi-GPU synchronised generation is not supported",
    "negative_prompt_ids": "classifier-free guidance is not applied",
    "negative_prompt_attention_mask": "classifier-free guidance is not applied",
    "custom_generate": "a custom decoding loop replaces speculative decoding",
    "assistant_tokenizer": "universal assisted decoding (another tokenizer) is not supported",
}
CALL_ARGUMENTS = (*CALL_ARGUMENTS_APPLIED, *CALL_ARGUMENTS_REFUSED)


# forward arguments that are not part of a prompt (the loop owns the cache, positions and outputs)
_NOT_PROMPT_INPUTS = frozenset({
    "input_ids", "inputs_embeds", "attention_mask", "past_key_values", "cache_params", "state", "position_ids",
    "cache_position", "labels", "use_cache", "logits_to_keep", "return_dict", "output_attentions",
    "output_hidden_states", "kwargs",
})  # fmt: skip


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
    # HF's processors per row (rows without left padding share one list)
    processors: list[LogitsProcessorList] = field(default_factory=list)
    # stopping criteria beyond EOS and max length (which the loop applies itself)
    stopping: StoppingCriteriaList = field(default_factory=StoppingCriteriaList)
    streamer: Any = None
    tokenizer: Any = None  # generate's `tokenizer=` (stop strings; tokenizing a retrieval corpus)
    # the prompt's other inputs for the model's forward (a multimodal prompt's pixel values, grids, token types)
    model_inputs: dict[str, Any] = field(default_factory=dict)
    generator: torch.Generator | None = None  # generate's `generator=`: what sampling draws from
    # the GenerationConfig fields of USER_SET the call's config sets (differing from HF's defaults)
    user_set: frozenset[str] = frozenset()
    tensor_parallel: int = 1  # the model's tensor-parallel degree (1: one process)
    agreement: Any = None  # the model's hf.instance.Agreement (timings agreed by every process of a sharded model)


# the GenerationConfig fields whose being set (not only their value) speculation reads: a draft model's depth, its
# confidence threshold
USER_SET = ("num_assistant_tokens", "assistant_confidence_threshold")


def _is_set(value: Any, default: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return value is not default
    if not value and not default:  # None, False, 0, empty: all "unset"
        return False
    return value != default


def is_user_set(config: GenerationConfig, name: str) -> bool:
    """Whether `config.name` differs from HF's own default for it (set by the user or the model's config)."""
    value = getattr(config, name, None)
    if value is None:  # transformers 5 leaves unset fields None and fills HF's defaults in generate
        return False
    defaults = GenerationConfig._get_default_generation_params()
    return _is_set(value, defaults.get(name, getattr(GenerationConfig(), name, None)))


def classify(name: str) -> tuple[str, str]:
    """(status, note) of one GenerationConfig field: "not a setting", "applied", "no effect", "refused unless
    default" or "refused". The one place that decides; `refused_settings` and the docs' tables both use it."""
    if name in METADATA or name.startswith("_"):
        return "not a setting", "bookkeeping, or meaningful only with an assistant tokenizer"
    if name == "num_return_sequences":
        return "applied", "with do_sample=True: each prompt repeated, as in HF; greedy refuses values > 1"
    if name in REFUSED_UNLESS_DEFAULT:
        return "refused unless default", REASONS[name]
    if name == "num_assistant_tokens_schedule":
        return "applied", f"one of {', '.join(SCHEDULES)}; heuristic adapts the draft depth"
    if name == "do_sample":
        return "applied", "lossless speculative sampling (rejection sampling over chains and trees)"
    if name == "watermarking_config":
        return "applied", "green-list watermarking per tree node; SynthID (stateful) is refused"
    if name in ("stop_strings", "max_time"):
        return "applied", "a stopping criterion, evaluated after every emitted token"
    if name in ("output_scores", "output_logits"):
        return "applied", "one [batch, vocab] tensor per generated token, as HF's"
    if name in APPLIED:
        return "applied", "exactly as HF's generate"
    if name in PROCESSORS:
        return "applied", "HF's logits processor, applied to every tree node with that node's own ids"
    if name in WARPERS:
        return "applied", "with do_sample=True (HF's warper, per tree node); greedy does not read it, as in HF"
    if name in NO_EFFECT:
        return "no effect", "beam search only; greedy search and sampling do not read it (as in HF)"
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
        if name == "num_return_sequences" and not config.do_sample:
            status, note = "refused", REASONS[name]
        if status.startswith("refused"):
            out.append((name, value, note))
    return out


def settings_table() -> list[tuple[str, str, str]]:
    """(field, status, note) for every GenerationConfig field and generate argument: the docs render it, so the
    documented behaviour is the code's."""
    rows = [(name, *classify(name)) for name in sorted(GenerationConfig().to_dict())]
    rows += [(arg, "applied", note) for arg, note in CALL_ARGUMENTS_APPLIED.items()]
    return rows + [(arg, "refused if given", note) for arg, note in CALL_ARGUMENTS_REFUSED.items()]


def _call_arguments(kwargs: dict) -> tuple[Any, torch.Generator | None, dict[str, Any]]:
    """generate's own arguments taken out of `kwargs` (tokenizer, generator, the rest of CALL_ARGUMENTS), those
    speculation refuses refused by name."""
    tokenizer = kwargs.pop("tokenizer", None)
    generator = kwargs.pop("generator", None)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator= must be a torch.Generator, got {type(generator).__name__}")
    given = {name: kwargs.pop(name, None) for name in CALL_ARGUMENTS if name != "tokenizer"}
    for name in CALL_ARGUMENTS_REFUSED:
        value = given[name]
        if value is None or value is False:
            continue
        raise UnsupportedSettingError(name, f"generate argument `{name}` is given: {CALL_ARGUMENTS_REFUSED[name]}")
    return tokenizer, generator, given


def _prompt(model, inputs: torch.Tensor | None, generation_config: GenerationConfig | None, kwargs: dict):
    """The prompt's token ids [batch, length]: `inputs`, `input_ids=`, or as HF a BOS token alone (one row);
    `inputs_embeds` refused (drafts are token ids)."""
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None and kwargs.get("inputs_embeds") is not None:
        raise UnsupportedSettingError("inputs_embeds", "speculative generate takes the prompt as input_ids (drafts "
                                      "are token ids), not inputs_embeds; pass input_ids")  # fmt: skip
    if input_ids is None:
        sources = (kwargs.get("bos_token_id"), getattr(generation_config, "bos_token_id", None),
                   model.generation_config.bos_token_id, getattr(model.config, "bos_token_id", None))  # fmt: skip
        bos = next((b for b in sources if b is not None), None)
        if bos is None:
            raise ValueError("generate() was given no input_ids, and the model has no bos_token_id to start from")
        input_ids = torch.full((1, 1), int(bos), dtype=torch.long, device=hf_instance.input_device(model))
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got {shape}")
    return input_ids


def resolve(model, inputs: torch.Tensor | None, generation_config: GenerationConfig | None, kwargs: dict) -> Plan:
    """Resolve a speculative generate call as HF's generate() would, refusing what it would not apply; builds
    HF's own logits processors and stopping criteria for it. Everything speculation reads of transformers for the
    call is in the Plan (under tensor parallelism every process checked to have been given the same inputs:
    `hf.instance.agree_on_inputs`)."""
    kwargs = dict(kwargs)
    kwargs.pop("trust_remote_code", None)
    tokenizer, generator, given = _call_arguments(kwargs)
    input_ids = _prompt(model, inputs, generation_config, kwargs)
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    attention_mask = model_kwargs.pop("attention_mask", None)
    for name in ("output_attentions", "output_hidden_states"):  # HF copies these to the model kwargs too
        model_kwargs.pop(name, None)
    # what else the prompt holds for the model's forward (a multimodal prompt's pixel values, grids, token types):
    # the generic path's prefill passes it to HF's forward as HF's generate does
    takes = set(inspect.signature(model.forward).parameters) - _NOT_PROMPT_INPUTS
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None}
    unknown = sorted(k for k in model_kwargs if k not in takes)
    if unknown:
        raise ValueError(f"speculative generate does not take {unknown}")
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
    prompt = input_ids
    if config.do_sample and config.num_return_sequences > 1:  # as HF's _expand_inputs_for_generation
        input_ids = input_ids.repeat_interleave(config.num_return_sequences, dim=0)
        attention_mask = attention_mask.repeat_interleave(config.num_return_sequences, dim=0)
    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length, model_input_name="input_ids", inputs_tensor=prompt,
        input_ids_length=input_ids.shape[1],
    )  # fmt: skip
    model._validate_generated_length(config, input_ids.shape[1], has_default_max_length)
    processors = _row_processors(model, config, input_ids, attention_mask, given["logits_processor"])
    vocab = int(model.config.get_text_config().vocab_size)
    _checked(processors[0], input_ids, vocab, "logits_processor")
    custom_criteria = given["stopping_criteria"] or StoppingCriteriaList()
    criteria = model._get_stopping_criteria(config, custom_criteria, tokenizer=tokenizer)
    eos = config._eos_token_tensor
    eos_ids = [] if eos is None else [int(e) for e in eos.flatten().tolist()]
    pad = config._pad_token_tensor
    pad_id = int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0)
    agreement = hf_instance.agree_on_inputs(model, input_ids, attention_mask, bool(config.do_sample), generator)
    return Plan(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=int(config.max_length) - input_ids.shape[1],
        eos_token_ids=eos_ids,
        pad_token_id=pad_id,
        return_dict=bool(config.return_dict_in_generate),
        config=config,
        processors=processors,
        stopping=_checked(
            StoppingCriteriaList(c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))),
            input_ids,
            vocab,
            "stopping_criteria",
        ),  # fmt: skip
        tokenizer=tokenizer,
        streamer=given["streamer"],
        model_inputs=model_kwargs,
        generator=generator,
        user_set=frozenset(name for name in USER_SET if is_user_set(config, name)),
        tensor_parallel=hf_instance.tensor_parallel(model),
        agreement=agreement,
    )


# HF processors whose output depends on the scores alone (not on the ids nor their length): the warpers and a
# few fixed masks; exact types only (a subclass may read the ids)
_IDS_FREE = (
    logits_process.TemperatureLogitsWarper, logits_process.TopKLogitsWarper, logits_process.TopPLogitsWarper,
    logits_process.TopHLogitsWarper, logits_process.MinPLogitsWarper, logits_process.TypicalLogitsWarper,
    logits_process.EpsilonLogitsWarper, logits_process.EtaLogitsWarper, logits_process.InfNanRemoveLogitsProcessor,
    logits_process.LogitNormalization, logits_process.SuppressTokensLogitsProcessor,
)  # fmt: skip


def reads_ids(processor) -> bool:
    """Whether a processor's output may depend on the ids it is given (then it is called per id length)."""
    return type(processor) not in _IDS_FREE


# HF processors that hold one entry per batch row (the prompt rows, or each row's padding length)
_PER_ROW = (
    logits_process.RepetitionPenaltyLogitsProcessor,
    logits_process.EncoderRepetitionPenaltyLogitsProcessor,
    logits_process.EncoderNoRepeatNGramLogitsProcessor,
)


def _row_processors(model, config, input_ids, attention_mask, custom) -> list[LogitsProcessorList]:
    """HF's processor list for each row, built by HF's own helper. HF builds one list for the batch, and a few
    processors keep one entry per row (the encoder-prompt penalties; the repetition penalty's per-row padding
    length); ssmspec calls processors per tree node, so then each row gets its own list built from that row
    alone (the padding length as a plain int)."""
    build = lambda r: model._get_logits_processor(  # noqa: E731
        generation_config=config, input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids if r is None else input_ids[r : r + 1],
        logits_processor=custom or LogitsProcessorList(), device=input_ids.device,
        model_kwargs={} if r is None else {"attention_mask": attention_mask[r : r + 1]},
    )  # fmt: skip
    if input_ids.shape[0] == 1 and bool(attention_mask.all()):
        return [build(None)]
    shared = build(0) if input_ids.shape[0] == 1 else build(None)
    if not any(isinstance(p, _PER_ROW) for p in shared):
        return [shared] * input_ids.shape[0]
    rows = [build(r) for r in range(input_ids.shape[0])]
    for own in rows:
        for p in own:
            if isinstance(p, logits_process.RepetitionPenaltyLogitsProcessor) and isinstance(
                p.prompt_ignore_length, torch.Tensor
            ):
                p.prompt_ignore_length = int(p.prompt_ignore_length[0])
    return rows


# HF's processors that keep state between calls or read the row's index in the batch: refused by the setting
# that makes HF build them
_STATEFUL_PROCESSORS = {
    logits_process.SynthIDTextWatermarkLogitsProcessor: "watermarking_config",
    logits_process.PrefixConstrainedLogitsProcessor: "prefix_allowed_tokens_fn",
    logits_process.UnbatchedClassifierFreeGuidanceLogitsProcessor: "guidance_scale",
    logits_process.ClassifierFreeGuidanceLogitsProcessor: "guidance_scale",
}
_MODULES_OF_PURE = ("transformers.generation.logits_process", "transformers.generation.stopping_criteria")


def _checked(items, input_ids: torch.Tensor, vocab: int, argument: str):
    """The processors (or criteria) of a call, each one known to depend only on the ids it is given: HF's
    own (minus the stateful ones, refused by name), and custom ones that pass a behavioural check on a copy."""
    for item in items:
        cls = type(item)
        if cls in _STATEFUL_PROCESSORS:
            name = _STATEFUL_PROCESSORS[cls]
            raise UnsupportedSettingError(name, f"{name}: HF's {cls.__name__} {_STATEFUL}")
        if cls.__module__ not in _MODULES_OF_PURE:
            problem = _impurity(item, input_ids, vocab)
            if problem:
                raise UnsupportedSettingError(
                    argument, f"{argument}: {cls.__name__} {problem}; ssmspec calls it once per tree node with "
                    "that node's ids (any order, any batch), so it must depend only on the ids it is given",
                )  # fmt: skip
    return items


def _impurity(item, input_ids: torch.Tensor, vocab: int) -> str | None:
    """Why a custom processor or criterion is not a function of its inputs alone (None if it looks like one):
    called on a deep copy (the user's object is never touched) with the prompt batch, then with each row
    alone, then again; its attributes must not change and each row's output must not depend on the batch."""
    try:
        probe = copy.deepcopy(item)
    except Exception as exc:  # noqa: BLE001 - any failure means it cannot be checked
        return f"cannot be copied to check it ({type(exc).__name__}: {exc})"
    scores = torch.randn(input_ids.shape[0], vocab, generator=torch.Generator().manual_seed(0))
    try:
        before = _state(probe)
        whole = probe(input_ids, scores.clone())
        if _state(probe) != before:
            return "changes its own attributes when called"
        for r in range(input_ids.shape[0]):
            alone = probe(input_ids[r : r + 1], scores[r : r + 1].clone())
            if not torch.equal(torch.as_tensor(alone), torch.as_tensor(whole)[r : r + 1]):
                return "gives a row a different result depending on the other rows of the batch"
        again = probe(input_ids, scores.clone())
        if not torch.equal(torch.as_tensor(again), torch.as_tensor(whole)):
            return "gives a different result when called again with the same inputs"
    except Exception as exc:  # noqa: BLE001
        return f"fails on a single row ({type(exc).__name__}: {exc})"
    return None


def _state(obj) -> Any:
    """A comparable snapshot of an object's attributes: tensors and plain containers by value, other objects
    by identity."""
    return _fingerprint(vars(obj))


def _fingerprint(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.detach().cpu().flatten().tolist())
    if isinstance(value, (int, float, str, bool, bytes, type(None))):
        return value
    if depth < 4 and isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, tuple(_fingerprint(v, depth + 1) for v in items))
    if depth < 4 and isinstance(value, dict):
        return ("dict", tuple((repr(k), _fingerprint(v, depth + 1)) for k, v in value.items()))
    return ("object", id(value))
