"""HF-style speculative generate: resolve the call as HF's generate() would (ssmspec.hf.generation), pick the
drafter, run the loop, and shape the output as HF does (a tensor, or a ModelOutput with `sequences`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.utils import ModelOutput

from ssmspec.errors import UnsupportedSettingError
from ssmspec.hf.generation import resolve
from ssmspec.speculate.ahead import AheadDrafter, DraftAheadDrafter
from ssmspec.speculate.config import SpecConfig
from ssmspec.speculate.decoding import Decoding
from ssmspec.speculate.drafters import Drafter, DraftModelDrafter, FusedDrafter, NoDrafter, PromptLookupDrafter
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.retrieval import SuffixIndex, corpus_index, frequent_tokens

_DEFAULT_CONFIDENCE = GenerationConfig._get_default_generation_params()["assistant_confidence_threshold"]


@dataclass
class SpecGenerateOutput(ModelOutput):
    """`generate(..., return_dict_in_generate=True)` output: sequences plus speculation statistics."""

    sequences: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    spec_stats: dict[str, Any] | None = None


def _corpus(model: nn.Module, spec: SpecConfig, plan) -> SuffixIndex:
    """The SuffixIndex of `spec.corpus`, built or loaded once per model (kept on it, never shared)."""
    cache = model.__dict__.get("_ssmspec_corpus_indexes", {})
    index = corpus_index(spec.corpus, plan.tokenizer, int(model.config.get_text_config().vocab_size), cache)
    model.__dict__["_ssmspec_corpus_indexes"] = cache
    return index


def generate(
    model: nn.Module,
    inputs: torch.Tensor | None,
    generation_config: GenerationConfig | None,
    *,
    prompt_lookup_num_tokens: int | None,
    draft: nn.Module | None,
    speculation: SpecConfig | None,
    kwargs: dict[str, Any],
):
    """Speculative generate (greedy or lossless sampling) on a transformed model; `draft` is an already
    transformed draft model. `generator=` in kwargs: the torch.Generator sampling draws from."""
    if speculation is not None and not isinstance(speculation, SpecConfig):
        raise TypeError(f"speculation= must be an ssmspec.SpecConfig, got {type(speculation).__name__}")
    kwargs = dict(kwargs)
    generator = kwargs.pop("generator", None)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator= must be a torch.Generator, got {type(generator).__name__}")
    if prompt_lookup_num_tokens is not None:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    plan = resolve(model, inputs, generation_config, kwargs)
    config = plan.config
    if len(plan.stopping) and plan.input_ids.shape[0] > 1 and not plan.eos_token_ids:
        # HF pads a stopped row only when an EOS token exists; without one it keeps generating for it
        name = "stop_strings" if config.stop_strings else "max_time" if config.max_time else "stopping_criteria"
        raise UnsupportedSettingError(
            name, f"{name} on a batch needs an eos_token_id (without one HF keeps generating for a stopped row, "
            "which speculative generate does not reproduce)",
        )  # fmt: skip
    decoding = Decoding(
        processors=plan.processors, stopping=plan.stopping, do_sample=bool(config.do_sample), generator=generator,
        streamer=plan.streamer, output_scores=plan.return_dict and bool(config.output_scores),
        output_logits=plan.return_dict and bool(config.output_logits),
    )  # fmt: skip
    lookup = config.prompt_lookup_num_tokens
    spec = speculation or SpecConfig(
        drafter="draft_model" if draft is not None else "prompt_lookup",
        num_draft_tokens=int(lookup if lookup is not None and draft is None else config.num_assistant_tokens or 5),
        max_matching_ngram_size=int(config.max_matching_ngram_size or 2),
    )
    if spec.ahead and spec.drafter == "draft_model" and decoding.do_sample:
        raise UnsupportedSettingError(
            "ahead", "SpecConfig.ahead with a draft model drafts ahead for greedy decoding only (do_sample=False)"
        )
    if spec.drafter == "draft_model" and draft is None:
        raise ValueError("SpecConfig(drafter='draft_model') needs assistant_model=")
    if spec.drafter != "draft_model" and draft is not None:
        raise ValueError(f"assistant_model= was given but SpecConfig(drafter={spec.drafter!r}) does not use it")
    index = _corpus(model, spec, plan) if spec.corpus is not None else None  # retrieval / VocabTrim corpus
    drafter: Drafter
    if spec.drafter == "draft_model":
        threshold = config.assistant_confidence_threshold
        keep = None
        if spec.draft_vocab is not None:  # VocabTrim: the corpus's most frequent tokens, the prompt's, EOS
            if isinstance(spec.draft_vocab, int):
                ids = frequent_tokens(index, spec.draft_vocab)
            else:
                ids = torch.tensor(spec.draft_vocab, dtype=torch.long)
            keep = torch.cat([ids, plan.input_ids.flatten().cpu(),
                              torch.tensor(plan.eos_token_ids + [plan.pad_token_id], dtype=torch.long)])  # fmt: skip
        drafter = DraftModelDrafter(
            draft, model.config.get_text_config().vocab_size, commit=spec.commit,
            confidence_threshold=threshold if threshold != _DEFAULT_CONFIDENCE else 0.0,
            branches=max(1, spec.tree_budget // max(spec.num_draft_tokens, 1)) if spec.tree else 1,
            sampling_tree=spec.sampling_tree, tree=spec.tree, vocab=keep,
            max_nodes=max(spec.tree_budget, spec.num_draft_tokens) + 2, max_depth=spec.num_draft_tokens,
        )  # fmt: skip
        if index is not None and spec.tree:  # RASD: the retrieval tree fused into the draft's
            retrieval = PromptLookupDrafter(spec.max_matching_ngram_size, tree=True, corpus=index)
            drafter = FusedDrafter(drafter, retrieval)
        if spec.ahead:
            drafter = DraftAheadDrafter(drafter, fanout=spec.ahead)
    elif spec.drafter == "prompt_lookup":
        drafter = PromptLookupDrafter(spec.max_matching_ngram_size, tree=spec.tree, corpus=index, recycle=spec.recycle)
        if spec.ahead:
            drafter = AheadDrafter(drafter, fanout=spec.ahead)
    else:
        drafter = NoDrafter()
    sequences, stats, _ = speculative_generate(
        model,
        plan.input_ids,
        plan.attention_mask,
        max_new_tokens=plan.max_new_tokens,
        eos_token_ids=plan.eos_token_ids,
        pad_token_id=plan.pad_token_id,
        drafter=drafter,
        tree_budget=spec.tree_budget if spec.tree else spec.num_draft_tokens,
        num_draft_tokens=spec.num_draft_tokens,
        commit=spec.commit,
        schedule=config.num_assistant_tokens_schedule if spec.drafter == "draft_model" else "constant",
        decoding=decoding,
        adaptive=spec.adaptive,
        static_shapes=spec.static_shapes
        if spec.static_shapes is not None
        else bool(getattr(model, "ssmspec_static_shapes", False)),
    )
    if not plan.return_dict:
        return sequences
    summary = asdict(stats)
    summary["mean_accepted_per_step"] = stats.mean_accepted_per_step
    return SpecGenerateOutput(sequences=sequences, scores=decoding.scores, logits=decoding.logits, spec_stats=summary)
