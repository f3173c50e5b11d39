"""HF-style speculative generate: resolve the call as HF's generate() would (ssmspec.hf.generation), pick the
drafter, run the loop, and shape the output as HF does (a tensor, or a ModelOutput with `sequences`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.utils import ModelOutput

from ssmspec.errors import UnsupportedModelError, UnsupportedSettingError
from ssmspec.hf.generation import resolve
from ssmspec.hf.mtp import MTPModule, size_share
from ssmspec.speculate.config import SpecConfig
from ssmspec.speculate.decoding import Decoding
from ssmspec.speculate.defaults import build_drafter, spec_for
from ssmspec.speculate.drafters.head import DraftHead
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.generic import CHAINS_ONLY, ONE_PROMPT, ROW_BY_ROW
from ssmspec.speculate.retrieval import SuffixIndex, corpus_index

# drafter "auto" drafts with a checkpoint's MTP layer where it holds at most this share of the model's parameters
# (released checkpoints: one layer of dozens; a layer that is a large share costs that share of a step per level)
MTP_MAX_SHARE = 0.1


class NotSpeculated(Exception):
    """A call without speculation kwargs that speculation cannot run as asked (a refused setting, a batch the
    probe found inexact): raised before anything ran, so that the caller runs HF's own generate instead."""


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


def _generic(
    model: nn.Module,
    spec: SpecConfig,
    info,
    inputs: dict,
    mask: torch.Tensor,
    exact: Callable[[bool], bool],
    fallback: bool,
) -> bool:
    """Whether the call verifies through the generic path (HF's forward) rather than the seams: `spec.path`, or
    for "auto" what transform found (`info.path`), or a prompt with inputs besides token ids (a multimodal
    prompt's pixel values: HF's forward takes them, the seams' prefill does not). Refused where it cannot run:
    not exact for the model (`exact(batch)`: its generic probes, for one prompt or a batch: `mask` with several
    rows or left padding), trees, a batch of prompts with inputs besides token ids. A batch of token ids runs row
    by row (one forward per row and step): without speculation kwargs (`fallback`) HF's own batched loop runs it
    instead."""
    found = getattr(info, "path", "seams")
    name = type(model).__name__
    batch, padded = mask.shape[0], bool((mask == 0).any())
    if inputs and spec.path == "seams":
        names = ", ".join(f"`{k}`" for k in sorted(inputs))
        raise UnsupportedSettingError(sorted(inputs)[0], f"{names} with SpecConfig(path='seams'): the seams' prefill "
                                      "takes token ids only; HF's forward takes the prompt's other inputs on the "
                                      "generic path (SpecConfig(path='generic', tree=False))")  # fmt: skip
    if spec.path == "seams" and found == "generic":
        raise UnsupportedModelError(name, f"SpecConfig(path='seams'): {info.limits['seams']}")
    generic = spec.path == "generic" or found == "generic" or bool(inputs)
    if not generic:
        return False
    if found != "generic" and not exact(False):
        raise UnsupportedModelError(name, f"the generic path{' (inputs besides token ids)' if inputs else ''}: "
                                    f"{info.limits['generic']}")  # fmt: skip
    if spec.tree and spec.drafter != "none" and not (found == "generic" and getattr(info, "generic_trees", False)):
        raise UnsupportedModelError(name, CHAINS_ONLY)
    if batch > 1 and inputs:
        raise UnsupportedModelError(name, ONE_PROMPT)
    if (batch > 1 or padded) and not exact(True):  # a padded prompt: what the batch probe checks
        what = "a batch" if batch > 1 else "a left-padded prompt"
        raise UnsupportedModelError(name, f"the generic path on {what}: {info.limits['generic_batches']}")
    if batch > 1 and fallback:
        raise NotSpeculated(ROW_BY_ROW)
    return True


def generate(
    model: nn.Module,
    inputs: torch.Tensor | None,
    generation_config: GenerationConfig | None,
    *,
    prompt_lookup_num_tokens: int | None,
    draft: nn.Module | None,
    speculation: SpecConfig | None,
    kwargs: dict[str, Any],
    fallback: bool = False,
    generic_exact: Callable[[bool], bool] = lambda batch: False,
    head: DraftHead | None = None,
):
    """Speculative generate (greedy or lossless sampling) on a transformed model; `draft` is an already
    transformed draft model. `generator=` in kwargs: the torch.Generator sampling draws from. With `fallback`
    (no speculation was asked for), what speculation would refuse raises NotSpeculated instead, before any
    work. `head`: the model's draft head (drafter "draft_head"), None where it has none."""
    if speculation is not None and not isinstance(speculation, SpecConfig):
        raise TypeError(
            "speculation= must be an ssmspec.SpecConfig, True (the defaults, refusing what they cannot apply), False "
            f"(HF's own generate) or None (the model's default call), got {type(speculation).__name__}"
        )
    kwargs = dict(kwargs)
    if prompt_lookup_num_tokens is not None:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    try:
        plan = resolve(model, inputs, generation_config, kwargs)
        config = plan.config
        if len(plan.stopping) and plan.input_ids.shape[0] > 1 and not plan.eos_token_ids:
            # HF pads a stopped row only when an EOS token exists; without one it keeps generating for it
            name = "stop_strings" if config.stop_strings else "max_time" if config.max_time else "stopping_criteria"
            raise UnsupportedSettingError(
                name, f"{name} on a batch needs an eos_token_id (without one HF keeps generating for a stopped "
                "row, which speculative generate does not reproduce)",
            )  # fmt: skip
    except UnsupportedSettingError as e:
        if fallback:
            raise NotSpeculated(str(e)) from e
        raise
    info = getattr(model, "ssmspec_info", None)
    if fallback and info is not None and not info.batches and plan.input_ids.shape[0] > 1:
        raise NotSpeculated("the probe found batches inexact for this model")
    decoding = Decoding(
        processors=plan.processors, stopping=plan.stopping, do_sample=bool(config.do_sample), generator=plan.generator,
        streamer=plan.streamer, output_scores=plan.return_dict and bool(config.output_scores),
        output_logits=plan.return_dict and bool(config.output_logits),
    )  # fmt: skip
    chains = plan.model_inputs or getattr(info, "path", "seams") == "generic"
    # drafter "auto" drafts with the model's head on an eager target; a compiled one keeps n-grams (the head's
    # features leave its graph through a break before the LM head, and its calls stay eager: on the compiled embedded
    # target n-grams measured 1.24x ssmspec's compiled plain decoding at batch 1, the head's trees 1.13-1.15x; at
    # batch 4, 1.08x against 0.96x; docs: Benchmarks). A checkpoint's MTP layer counts as a head where it is small
    # against the model (MTP_MAX_SHARE: each drafted level costs a forward of the layer; released checkpoints' layers
    # are one of dozens): the embedded Nemotron-H's holds 9% of its parameters, and its default call drafts with it
    # (docs/data/mtp.json)
    # (compiled: by Dynamo, `model.compile`, or its steps captured and compiled whole, `transform(compile=True)` on a
    # CPU, where the head's trees measured slower than n-grams too: 587 against 656 tok/s on held-out code, 707 plain)
    compiled = getattr(model, "ssmspec_compile_call", None) is not None or "_ssmspec_step_compiler" in model.__dict__
    drafts = isinstance(head, DraftHead) or (isinstance(head, MTPModule) and size_share(head, model) <= MTP_MAX_SHARE)
    spec = spec_for(speculation, config, draft, trees=(info is None or bool(info.trees)) and not chains,
                    head=drafts and not compiled, sampling=decoding.do_sample, user_set=plan.user_set,
                    head_kind="mtp" if isinstance(head, MTPModule) else "draft_head")  # fmt: skip
    try:
        generic = _generic(model, spec, info, plan.model_inputs, plan.attention_mask, generic_exact, fallback)
        if not generic and spec.tree and spec.drafter != "none" and info is not None and not info.trees:
            raise UnsupportedModelError(
                type(model).__name__, "tree verification is not exact for this model, only chains: use "
                f"SpecConfig(tree=False), or leave `tree` unset (found at transform: {info.limits['trees']})",
            )  # fmt: skip
    except (UnsupportedModelError, UnsupportedSettingError) as e:
        if fallback:
            raise NotSpeculated(str(e)) from e
        raise
    if spec.ahead and spec.drafter == "draft_model" and decoding.do_sample:
        raise UnsupportedSettingError(
            "ahead", "SpecConfig.ahead with a draft model drafts ahead for greedy decoding only (do_sample=False)"
        )
    if spec.ahead and plan.tensor_parallel > 1:
        raise UnsupportedSettingError(
            "ahead", "SpecConfig.ahead drafts in a thread while the target verifies, and what it has ready depends "
            "on timing: the processes of a tensor-parallel model would verify different trees (their forwards must "
            "match); use ahead=0"
        )  # fmt: skip
    if spec.drafter == "draft_model" and draft is None:
        raise ValueError("SpecConfig(drafter='draft_model') needs assistant_model=")
    if spec.drafter != "draft_model" and draft is not None:
        raise ValueError(f"assistant_model= was given but SpecConfig(drafter={spec.drafter!r}) does not use it")
    if spec.drafter == "draft_head" and head is None:
        raise ValueError(
            "SpecConfig(drafter='draft_head') needs a draft head: ssmspec.transform(model, draft_head=...)"
        )
    if spec.drafter == "mtp" and not isinstance(head, MTPModule):
        raise ValueError(
            "SpecConfig(drafter='mtp') needs the model's MTP layer: a checkpoint that ships `mtp.*` tensors, or "
            "ssmspec.transform(model, draft_head=PATH) with PATH holding them"
            + ("" if head is None else " (this model's draft head is an EAGLE-style head: drafter='draft_head')")
        )
    index = _corpus(model, spec, plan) if spec.corpus is not None else None
    drafter = build_drafter(
        spec, draft=draft, index=index, agreement=plan.agreement,
        vocab_size=model.config.get_text_config().vocab_size, prompt_ids=plan.input_ids,
        special_ids=plan.eos_token_ids + [plan.pad_token_id],
        confidence=config.assistant_confidence_threshold if "assistant_confidence_threshold" in plan.user_set
        else 0.0, target=model, head=head,
    )  # fmt: skip
    # captured verify steps: asked for, or by default on a model compiled for them (on CUDA) where the seams verify
    graphs = spec.graphs if spec.graphs is not None else bool(getattr(model, "ssmspec_graphs", False)) and not generic
    # an eager call runs under inference mode: no autograd bookkeeping on any op (version counters, view tracking),
    # which an overhead-bound step pays for on every op (the embedded Nemotron-H's 4-node verify step: 7.1 ms against
    # 8.1 under no_grad). A compiled model or a captured step keeps no_grad, as its graphs were made and are guarded
    # under it; what the call returns is copied out as ordinary tensors (`_ordinary`)
    inference = not graphs and not compiled and getattr(draft, "ssmspec_compile_call", None) is None
    with torch.inference_mode() if inference else torch.no_grad():
        sequences, stats, _ = speculative_generate(
            model,
            plan.input_ids,
            plan.attention_mask,
            max_new_tokens=plan.max_new_tokens,
            eos_token_ids=plan.eos_token_ids,
            pad_token_id=plan.pad_token_id,
            drafter=drafter,
            # (plain decoding drafts nothing: its runner is sized for one-node steps, and nothing larger is measured)
            tree_budget=0 if spec.drafter == "none" else spec.tree_budget if spec.tree else spec.num_draft_tokens,
            num_draft_tokens=0 if spec.drafter == "none" else spec.num_draft_tokens,
            commit=spec.commit,
            schedule=config.num_assistant_tokens_schedule if spec.drafter == "draft_model" else "constant",
            decoding=decoding,
            adaptive=spec.adaptive and spec.drafter != "none",
            generic=generic,
            model_inputs=plan.model_inputs,
            static_shapes=graphs
            or (
                spec.static_shapes
                if spec.static_shapes is not None
                else bool(getattr(model, "ssmspec_static_shapes", False))
            ),
            verify_memory=spec.verify_memory,
            graphs=graphs,
        )
    scores, logits = decoding.scores, decoding.logits
    if inference:
        sequences, scores, logits = _ordinary(sequences), _ordinary(scores), _ordinary(logits)
    if not plan.return_dict:
        return sequences
    summary = asdict(stats)
    summary["mean_accepted_per_step"] = stats.mean_accepted_per_step
    summary["path"] = "generic" if generic else "seams"
    return SpecGenerateOutput(sequences=sequences, scores=scores, logits=logits, spec_stats=summary)


def _ordinary(value):
    """Tensors made under inference mode (a tensor, or a tuple of them; None passes) as ordinary tensors: the user may
    update them in place, as HF's outputs (in place, an inference tensor refuses outside inference mode)."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_ordinary(v) for v in value)
    return value.clone() if value.is_inference() else value
