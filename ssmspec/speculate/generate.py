"""HF-style speculative generate: the call's plan (ssmspec.speculate.plan: resolved as HF's generate() would, its
drafter, path and loop settings chosen, refusals raised), the loop run on it, the output shaped as HF's (a tensor, or
a ModelOutput with `sequences`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.utils import ModelOutput

from ssmspec.hf.mtp import MTPModule
from ssmspec.speculate.config import SpecConfig
from ssmspec.speculate.drafters.head import DraftHead
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.plan import NotSpeculated, drafter_for, plan_call

__all__ = ["NotSpeculated", "SpecGenerateOutput", "generate"]


@dataclass
class SpecGenerateOutput(ModelOutput):
    """`generate(..., return_dict_in_generate=True)` output: sequences plus speculation statistics."""

    sequences: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    spec_stats: dict[str, Any] | None = None


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
    head: DraftHead | MTPModule | None = None,
):
    """Speculative generate (greedy or lossless sampling) on a transformed model, as its plan says
    (ssmspec.speculate.plan: every choice and refusal); `draft` is an already transformed draft model. `generator=`
    in kwargs: the torch.Generator sampling draws from. With `fallback` (no speculation was asked for), what
    speculation would refuse raises NotSpeculated instead, before any work. `head`: the model's draft head or MTP
    layer, None where it has none."""
    plan = plan_call(model, inputs, generation_config, prompt_lookup_num_tokens=prompt_lookup_num_tokens, draft=draft,
                     speculation=speculation, kwargs=kwargs, fallback=fallback, generic_exact=generic_exact,
                     head=head)  # fmt: skip
    drafter, decoding, call = drafter_for(plan, model, draft, head), plan.decoding(), plan.call
    with torch.inference_mode() if plan.inference else torch.no_grad():
        sequences, stats, _ = speculative_generate(
            model, call.input_ids, call.attention_mask, max_new_tokens=call.max_new_tokens,
            eos_token_ids=call.eos_token_ids, pad_token_id=call.pad_token_id, drafter=drafter,
            settings=plan.settings, decoding=decoding, model_inputs=call.model_inputs,
        )  # fmt: skip
    scores, logits = decoding.scores, decoding.logits
    if plan.inference:  # (copied out as ordinary tensors: the user may update them in place, as HF's outputs)
        sequences, scores, logits = _ordinary(sequences), _ordinary(scores), _ordinary(logits)
    if not call.return_dict:
        return sequences
    summary = asdict(stats)
    summary["mean_accepted_per_step"] = stats.mean_accepted_per_step
    summary["path"] = "generic" if plan.settings.generic else "seams"
    return SpecGenerateOutput(sequences=sequences, scores=scores, logits=logits, spec_stats=summary)


def _ordinary(value):
    """Tensors made under inference mode (a tensor, or a tuple of them; None passes) as ordinary tensors: the user may
    update them in place, as HF's outputs (in place, an inference tensor refuses outside inference mode)."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_ordinary(v) for v in value)
    return value.clone() if value.is_inference() else value
