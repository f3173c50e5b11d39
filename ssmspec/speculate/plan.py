"""One generate call, decided: `plan_call` turns what `model.generate(...)` was given (HF's arguments and generation
config, `SpecConfig`, the draft model or head, what `transform` found and how the model was compiled) into one
immutable `CallPlan`. Every choice a call makes is taken here, with the reason for it, and every refusal of a
setting is raised here before anything runs; the engine, its runner and its policy read the plan's `LoopSettings`,
not the model's attributes. `ssmspec plan` (and `ssmspec.explain`) print a plan without running it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from ssmspec.compiled import CompiledAs, compiled_as
from ssmspec.errors import (
    GENERIC_GRAPHS,
    UnsupportedModelError,
    UnsupportedSettingError,
    batches_inexact,
    trees_inexact,
)  # fmt: skip
from ssmspec.hf.generation import Plan, resolve
from ssmspec.hf.mtp import MTPModule, size_share
from ssmspec.speculate import calibration as calibrations
from ssmspec.speculate.config import SpecConfig
from ssmspec.speculate.decoding import Decoding
from ssmspec.speculate.defaults import build_drafter, spec_for
from ssmspec.speculate.drafters import Drafter
from ssmspec.speculate.drafters.head import DraftHead
from ssmspec.speculate.generic import CHAINS_ONLY, ONE_PROMPT, ROW_BY_ROW
from ssmspec.speculate.retrieval import corpus_index

# drafter "auto" drafts greedily with the model's head (a trained draft head, or a checkpoint's MTP layer: one layer of
# dozens in released checkpoints) where it holds at most this share of the model's parameters: each drafted level runs
# it once, so a head that is a large share costs that share of a step per level. Fused with n-gram lookup that drafts
# alone where its trees reach the step's depth (drafters.FusedDrafter's `retrieval_first`), the embedded 3M target's
# head (13%) pays: greedy, 128 new tokens, against n-gram trees alone, held-out code / prose / random-token prompts,
# 1.57x / 1.68x / 1.57x ssmspec's plain decoding against 1.57x / 1.38x / 1.40x (fused on every step it had lost on
# code: 2.02x HF against 2.19x); the 19.6M Nemotron-H's head holds 8%, its MTP layer 9%. A sampled call drafts with a
# trained draft head whatever its share: n-gram drafts are seldom accepted by sampled tokens (the 3M target at
# temperature 0.7: 1.06 tokens a step without the head, 1.78 with it; docs/data/e2e_defaults.json)
HEAD_MAX_SHARE = 0.15


@dataclass(frozen=True)
class LoopSettings:
    """How one call's loop runs, as its plan decided: the engine, the runner it opens and the
    policy read these and nothing else of the call's settings.

    `tree_budget` nodes per row and step at most, `num_draft_tokens` deep at most (0 for both: plain decoding);
    `commit` how the accepted path is committed (SpecConfig.commit); `schedule` HF's draft-depth schedule ("constant"
    or "heuristic"); `adaptive` prices each step's depth (0: a plain step); `generic` verifies through HF's own
    forward instead of the seams; `static_shapes` pads trees to fixed buckets; `graphs` captures each step once and
    replays it; `verify_memory` caps a verify step's buffers (bytes); `decode_single_nodes` takes HF's decode path
    (True) or the tree path (False) for one-node steps, None: as measured; `compiled`: how the target was compiled,
    as the plan found it (what its runner compiles or captures; None: the runner reads it from the model)."""

    tree_budget: int = 0
    num_draft_tokens: int = 0
    commit: str = "replay"
    schedule: str = "constant"
    adaptive: bool = False
    generic: bool = False
    static_shapes: bool = False
    graphs: bool = False
    verify_memory: int | None = None
    decode_single_nodes: bool | None = None
    compiled: CompiledAs | None = None


class NotSpeculated(Exception):
    """A call without speculation kwargs that speculation cannot run as asked (a refused setting, a batch the
    probe found inexact): raised before anything ran, so that the caller runs HF's own generate instead."""


@dataclass(frozen=True)
class CallPlan:
    """What one generate call will run, and why.

    `call`: HF's call resolved (token ids, mask, processors, stopping criteria, EOS and pad: hf.generation.Plan);
    `spec`: the speculation config it runs (drafter and sizes resolved); `settings`: how the loop runs (path, sizes,
    policy, captured steps); `inference`: an eager call runs under `torch.inference_mode` (a compiled model or a
    captured step under `no_grad`, as its graphs were made); `reasons`: (choice, why) for each decision, in order."""

    call: Plan
    spec: SpecConfig
    settings: LoopSettings
    inference: bool
    reasons: tuple[tuple[str, str], ...]

    def decoding(self) -> Decoding:
        """A fresh Decoding for running this plan (it collects the call's scores and logits)."""
        call, config = self.call, self.call.config
        return Decoding(
            processors=call.processors, stopping=call.stopping, do_sample=bool(config.do_sample),
            generator=call.generator, streamer=call.streamer,
            output_scores=call.return_dict and bool(config.output_scores),
            output_logits=call.return_dict and bool(config.output_logits),
        )  # fmt: skip

    def describe(self) -> str:
        """The plan as lines of text: each choice and why (for users and bug reports)."""
        width = max(len(what) for what, _ in self.reasons)
        return "\n".join(f"{what:<{width}}  {why}" for what, why in self.reasons)


def plan_call(
    model: nn.Module, inputs: torch.Tensor | None, generation_config: GenerationConfig | None, *,
    prompt_lookup_num_tokens: int | None = None, draft: nn.Module | None = None,
    speculation: SpecConfig | None = None, kwargs: dict[str, Any] | None = None, fallback: bool = False,
    generic_exact: Callable[[bool], bool] = lambda batch: False, head: DraftHead | MTPModule | None = None,
) -> CallPlan:  # fmt: skip
    """The plan of `model.generate(inputs, generation_config, **kwargs)` on a transformed model: `draft` an already
    transformed draft model, `head` the model's draft head or MTP layer; with `fallback` (no speculation was asked
    for) what speculation would refuse raises NotSpeculated instead. Raises every refusal of the call."""
    if speculation is not None and not isinstance(speculation, SpecConfig):
        raise TypeError(
            "speculation= must be an ssmspec.SpecConfig, True (the defaults, refusing what they cannot apply), False "
            f"(HF's own generate) or None (the model's default call), got {type(speculation).__name__}"
        )
    kwargs = dict(kwargs or {})
    if prompt_lookup_num_tokens is not None:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    reasons: list[tuple[str, str]] = []
    with _refusals(fallback):
        call = _resolve(model, inputs, generation_config, kwargs)
    rows, sampling = call.input_ids.shape[0], bool(call.config.do_sample)
    reasons.append(("call", f"{type(model).__name__}, {rows} prompt{'s' if rows > 1 else ''}, up to "
                    f"{call.max_new_tokens} new tokens, {'sampling' if sampling else 'greedy'}"))  # fmt: skip
    spec = _spec(model, call, speculation, draft, head, reasons)
    with _refusals(fallback):
        generic = _generic(model, spec, call, generic_exact, fallback, reasons)
    _check_drafter(spec, call, draft, head)
    return CallPlan(call, spec, *_settings(model, spec, call, draft, generic, reasons), tuple(reasons))


def drafter_for(plan: CallPlan, model: nn.Module, draft: nn.Module | None, head: Any) -> Drafter:
    """The drafter the plan's config asks for (the corpus's index built or loaded once per model, kept on it)."""
    spec, call = plan.spec, plan.call
    index = None
    if spec.corpus is not None:
        cache = model.__dict__.get("_ssmspec_corpus_indexes", {})
        index = corpus_index(spec.corpus, call.tokenizer, int(model.config.get_text_config().vocab_size), cache)
        model.__dict__["_ssmspec_corpus_indexes"] = cache  # (kept only once built: a refused corpus leaves none)
    return build_drafter(
        spec, draft=draft, index=index, agreement=call.agreement,
        vocab_size=model.config.get_text_config().vocab_size, prompt_ids=call.input_ids,
        special_ids=call.eos_token_ids + [call.pad_token_id],
        confidence=call.config.assistant_confidence_threshold if "assistant_confidence_threshold" in call.user_set
        else 0.0, target=model, head=head,
    )  # fmt: skip


@contextmanager
def _refusals(fallback: bool) -> Iterator[None]:
    """Within it, a refusal becomes NotSpeculated where the call asked for no speculation (`fallback`)."""
    try:
        yield
    except (UnsupportedModelError, UnsupportedSettingError) as e:
        if fallback:
            raise NotSpeculated(str(e)) from e
        raise


def _resolve(model: nn.Module, inputs: torch.Tensor | None, generation_config, kwargs: dict) -> Plan:
    """HF's call resolved (hf.generation.resolve), and stopping criteria on a batch without an EOS token refused."""
    call = resolve(model, inputs, generation_config, kwargs)
    config = call.config
    if len(call.stopping) and call.input_ids.shape[0] > 1 and not call.eos_token_ids:
        # HF pads a stopped row only when an EOS token exists; without one it keeps generating for it
        name = "stop_strings" if config.stop_strings else "max_time" if config.max_time else "stopping_criteria"
        raise UnsupportedSettingError(
            name, f"{name} on a batch needs an eos_token_id (without one HF keeps generating for a stopped "
            "row, which speculative generate does not reproduce)",
        )  # fmt: skip
    return call


def _spec(model: nn.Module, call: Plan, speculation: SpecConfig | None, draft, head, reasons: list) -> SpecConfig:
    """The SpecConfig the call runs (defaults.spec_for), and why its drafter and sizes."""
    info = getattr(model, "ssmspec_info", None)
    chains = bool(call.model_inputs) or getattr(info, "path", "seams") == "generic"
    # drafter "auto" drafts with the model's head on an eager target. On a model compiled by Dynamo, and when sampling
    # or with an MTP layer on one compiled whole, n-grams (on the Dynamo-compiled embedded target n-grams measured 1.24x
    # ssmspec's compiled plain decoding at batch 1, the head's trees 1.13-1.15x; at batch 4, 1.08x against 0.96x; docs:
    # Benchmarks). Greedy on a model compiled whole, a draft head drafts its argmax chains, each one compiled call
    # (defaults.HEAD_CHAIN). A head drafts where it is small against the model (HEAD_MAX_SHARE; sampling: a trained
    # draft head whatever its size): the embedded Nemotron-H's MTP layer holds 9% of its parameters, and its default
    # call drafts with it (docs/data/mtp.json)
    found, sampling = compiled_as(model), bool(call.config.do_sample)
    compiled = found.compiled
    # a sampled call on steps compiled whole on a CPU verifies and commits in two graphs with the host accepting
    # between them, unlike a greedy call's one graph, and its depths are priced by the greedy steps the calibration
    # times: its default decodes plainly (held-out code, temperature 0.7, 8 prompts alternated in one process: the
    # default with n-grams 0.83x plain decoding on the 3M target and 0.92x on the 19.6M Nemotron-H, whose head's
    # chains and trees ran at 0.81-0.90x; docs: Sampling)
    whole = found.step_compiler is not None
    plain_sampled = (speculation is None and draft is None and sampling and whole
                     and call.config.prompt_lookup_num_tokens is None)  # fmt: skip
    head_chains = whole and isinstance(head, DraftHead) and not sampling
    # (n-gram lookup's greedy default there, for one prompt: its chains, defaults.NGRAM_CHAIN)
    ngram_chains = whole and not sampling and call.input_ids.shape[0] == 1
    small = head is not None and (
        size_share(head, model) <= HEAD_MAX_SHARE or (sampling and isinstance(head, DraftHead))
    )
    spec = spec_for(SpecConfig(drafter="none") if plain_sampled else speculation, call.config, draft,
                    trees=(info is None or bool(info.trees)) and not chains,
                    head=small and (not compiled or head_chains), sampling=sampling, user_set=call.user_set,
                    head_kind="mtp" if isinstance(head, MTPModule) else "draft_head",
                    compiled=head_chains, whole=ngram_chains)  # fmt: skip
    asked = speculation is not None and speculation.drafter != "auto"
    if asked:
        why = "asked for (SpecConfig.drafter)"
    elif plain_sampled:
        why = (
            "a sampled call on steps compiled whole decodes plainly (its drafted steps, verified and committed "
            "apart, measured slower than plain decoding)"
        )
    elif draft is not None:
        why = "assistant_model= was given"
    elif spec.drafter == "draft_head" and not spec.tree and head_chains:
        why = "the model's draft head: its argmax chains, each one compiled call (the model's steps are compiled whole)"
    elif spec.drafter in ("draft_head", "mtp"):
        why = f"the model's {'MTP layer' if spec.drafter == 'mtp' else 'draft head'}, fused with n-gram lookup"
    elif head is not None and compiled and not head_chains:
        why = "a compiled model drafts with n-grams here (its head's trees measured slower there)"
    elif head is not None and not small:
        kind = "MTP layer" if isinstance(head, MTPModule) else "draft head"
        why = f"the model's {kind} holds over {HEAD_MAX_SHARE:.0%} of its parameters: n-gram lookup"
    else:
        why = "n-gram lookup over the prompt and the output"
        why += " (the model has no draft head)" if head is None else ""
    reasons.append(("drafter", f"{spec.drafter}: {why}"))
    if spec.drafter != "none":
        if speculation is not None and (speculation.tree_budget, speculation.num_draft_tokens) != (None, None):
            source = "as given"
        elif speculation is None and draft is None and call.config.prompt_lookup_num_tokens is not None:
            source = "prompt_lookup_num_tokens deep, the default's shape (nodes per level)"
        elif draft is not None and "num_assistant_tokens" in call.user_set:
            source = "num_assistant_tokens deep"
        elif ngram_chains and speculation is None and spec.drafter == "prompt_lookup" and not spec.tree:
            source = "n-gram lookup's default on steps compiled whole: chains, from their size sweep"
        else:
            source = "the drafter's default, from its size sweep" + (", sampling" if sampling else "")
        shape = f"a tree of up to {spec.tree_budget} nodes" if spec.tree else f"a chain of {spec.num_draft_tokens}"
        reasons.append(("sizes", f"{shape}, {spec.num_draft_tokens} deep ({source})"))
        if not spec.tree and info is not None and not info.trees:
            reasons.append(("trees", f"chains only: {info.limits['trees']}"))
    return spec


def _generic(
    model: nn.Module, spec: SpecConfig, call: Plan, exact: Callable[[bool], bool], fallback: bool, reasons: list,
) -> bool:  # fmt: skip
    """Whether the call verifies through the generic path (HF's forward) rather than the seams: `spec.path`, or
    for "auto" what transform found (`info.path`), or a prompt with inputs besides token ids (a multimodal
    prompt's pixel values: HF's forward takes them, the seams' prefill does not). Refused where it cannot run:
    not exact for the model (`exact(batch)`: its generic probes, for one prompt or a batch: several rows or left
    padding), trees, a batch of prompts with inputs besides token ids; on the seams, trees or a batch where the
    probe found them inexact. A batch of token ids runs row by row (one
    forward per row and step): without speculation kwargs (`fallback`) HF's own batched loop runs it instead."""
    info, inputs, mask = getattr(model, "ssmspec_info", None), call.model_inputs, call.attention_mask
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
        if spec.tree and spec.drafter != "none" and info is not None and not info.trees:
            raise UnsupportedModelError(name, trees_inexact(info.limits["trees"]))
        if batch > 1 and info is not None and not info.batches:
            raise UnsupportedModelError(name, batches_inexact(info.limits["batches"]))
        reasons.append(("path", "seams: ssmspec's tree-aware mixers verify whole trees and batches"))
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
    if spec.path == "generic":
        why = "asked for (SpecConfig.path)"
    elif inputs:
        why = "the prompt has inputs besides token ids"
    else:
        why = f"found at transform: {info.limits.get('seams', 'the seams do not cover this model')}"
    reasons.append(("path", f"generic: HF's own forward verifies ({why})"))
    return True


def _check_drafter(spec: SpecConfig, call: Plan, draft: nn.Module | None, head: Any) -> None:
    """Refuse a drafter the call cannot run: drafting ahead where it would change output or disagree between
    processes, a draft model, head or MTP layer asked for without one (or given and not used)."""
    if spec.ahead and spec.drafter == "draft_model" and call.config.do_sample:
        raise UnsupportedSettingError(
            "ahead", "SpecConfig.ahead with a draft model drafts ahead for greedy decoding only (do_sample=False)"
        )
    if spec.ahead and call.tensor_parallel > 1:
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


def _settings(
    model: nn.Module, spec: SpecConfig, call: Plan, draft: nn.Module | None, generic: bool, reasons: list
) -> tuple[LoopSettings, bool]:
    """The loop's settings and whether it runs under inference mode, with why (captured steps, static shapes, the
    policy)."""
    drafts = spec.drafter != "none"
    # captured steps: asked for, or by default on a model compiled for them where the seams verify
    found = compiled_as(model)
    graphs = spec.graphs if spec.graphs is not None else found.graphs and not generic
    if graphs and generic:
        raise UnsupportedModelError(type(model).__name__, GENERIC_GRAPHS)
    static = graphs or (spec.static_shapes if spec.static_shapes is not None else found.static_shapes)
    # an eager call runs under inference mode: no autograd bookkeeping on any op (version counters, view tracking),
    # which an overhead-bound step pays for on every op (the embedded Nemotron-H's 4-node verify step: 7.1 ms against
    # 8.1 under no_grad). A compiled model or a captured step keeps no_grad, as its graphs were made and are guarded
    # under it; what the call returns is copied out as ordinary tensors
    compiled = found.compiled
    inference = not graphs and not compiled and compiled_as(draft).call is None
    schedule = call.config.num_assistant_tokens_schedule if spec.drafter == "draft_model" else "constant"
    settings = LoopSettings(
        # (plain decoding drafts nothing: its runner is sized for one-node steps, and nothing larger is measured)
        tree_budget=(spec.tree_budget if spec.tree else spec.num_draft_tokens) if drafts else 0,
        num_draft_tokens=spec.num_draft_tokens if drafts else 0, commit=spec.commit, schedule=schedule or "constant",
        adaptive=spec.adaptive and drafts, generic=generic, static_shapes=static, graphs=graphs,
        verify_memory=spec.verify_memory, compiled=found,
    )  # fmt: skip
    if not drafts:
        policy = "plain decoding: one token a step"
    elif settings.adaptive:
        path = "generic" if generic else "seams"
        kept = calibrations.kept(model, call.input_ids.shape[0], call.input_ids.device, path)
        state = "complete" if kept is not None and kept.complete else "measured by this call or the next ones"
        policy = f"adaptive: each step's depth priced with the model's calibration ({state}); 0 is a plain step"
    else:
        policy = f"fixed depth, schedule {settings.schedule}"
    reasons.append(("policy", policy))
    how = ("captured and compiled whole, replayed" if graphs and compiled else "captured, replayed" if graphs
           else "compiled, static shapes" if static else "compiled" if compiled else "eager")  # fmt: skip
    mode = "inference_mode" if inference else "no_grad"
    reasons.append(("steps", f"{how} ({mode}); commit {spec.commit}"))
    return settings, inference
