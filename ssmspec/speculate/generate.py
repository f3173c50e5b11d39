"""HF-style speculative `generate` for transformed models, and the tree-verification probe.

Importing this module registers both with ssmspec.transform (which sits below the decoding loop).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.utils import ModelOutput

from ssmspec import transform as _transform
from ssmspec.errors import UnsupportedModelError
from ssmspec.speculate.config import SpecConfig
from ssmspec.speculate.drafters import DraftModelDrafter, NoDrafter, PromptLookupDrafter
from ssmspec.speculate.engine import eos_and_pad, speculative_generate
from ssmspec.speculate.runner import ModelRunner
from ssmspec.tree import TokenTree

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
class SpecGenerateOutput(ModelOutput):
    """`generate(..., return_dict_in_generate=True)` output: sequences plus speculation statistics."""

    sequences: torch.Tensor | None = None
    spec_stats: dict[str, Any] | None = None


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
        speculation is given, or when the model was transformed with a default SpecConfig."""
        if prompt_lookup_num_tokens is None and assistant_model is None and speculation is None:
            speculation = getattr(self, "ssmspec_config", None)
            if speculation is None:
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
    eos, pad = eos_and_pad(gc)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
        if gc.pad_token_id is not None and gc.pad_token_id not in eos and bool((input_ids == gc.pad_token_id).any()):
            attention_mask = (input_ids != gc.pad_token_id).long()
    if attention_mask.shape != input_ids.shape:
        raise ValueError("attention_mask must have the shape of input_ids")
    if gc.max_new_tokens is not None:
        max_new = int(gc.max_new_tokens)
    else:
        max_new = int(gc.max_length) - input_ids.shape[1]
    if gc.max_new_tokens is not None and max_new <= 0:
        raise ValueError(f"`max_new_tokens` must be greater than 0, but is {max_new}.")
    if max_new <= 0:
        raise ValueError(
            f"Input length of input_ids is {input_ids.shape[1]}, but `max_length` is set to {gc.max_length}: "
            "nothing to generate; set `max_new_tokens` instead."
        )

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
        pad_token_id=pad,
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


def probe_tree_verification(model: nn.Module) -> None:
    """Prefill 3 tokens, verify a 3-node tree and commit, so that a mixer ssmspec cannot verify fails at
    transform time with UnsupportedModelError instead of during generation."""
    vocab = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device
    ids = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab]], device=device)
    runner = ModelRunner(model)
    try:
        runner.prefill(ids, torch.ones_like(ids))
        tree = TokenTree(
            torch.tensor([[4 % vocab, 5 % vocab, 6 % vocab]], device=device), torch.tensor([[-1, 0, 0]], device=device)
        )
        runner.verify(tree)
        runner.commit(torch.tensor([2], device=device))
    except UnsupportedModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure means this model cannot be verified as is
        raise UnsupportedModelError(
            type(model).__name__, f"tree verification probe failed: {type(exc).__name__}: {exc}"
        ) from exc


if SpecGenerationMixin not in _transform.GENERATE_MIXINS:
    _transform.GENERATE_MIXINS.append(SpecGenerationMixin)
    _transform.POST_TRANSFORM_CHECKS.append(probe_tree_verification)
