"""The one place where generate's settings become a speculation plan: which SpecConfig a call runs (the
defaults, chosen by the benchmarks; docs: Benchmarks, "The default configuration") and which drafter it makes.

A call with `speculation=SpecConfig(...)` runs that config. Otherwise HF's own kwargs say what to draft with:
`assistant_model=` a draft model (depth `num_assistant_tokens` when set), `prompt_lookup_num_tokens=k` n-grams k
deep, and nothing at all the default n-gram drafting; drafter "auto" (the default) is the model's draft head fused
with n-gram lookup where an eager model has a head (HEAD_GREEDY, HEAD_SAMPLING), else n-gram lookup. Each then gets
the sizes its drafter's sweep on held-out text without a corpus measured fastest (on a given model another
configuration may measure faster: docs: Benchmarks): a tree with adaptive depth (plain decode steps where drafts are
not accepted); a draft model under HF's heuristic schedule
(`num_assistant_tokens_schedule`) drafts HF's chains, sized by that schedule.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from transformers import GenerationConfig

from ssmspec.hf.instance import Agreement
from ssmspec.hf.mtp import MTPModule
from ssmspec.speculate.config import MAX_DRAFT_NODES, SpecConfig
from ssmspec.speculate.drafters import (
    AheadDrafter,
    DraftAheadDrafter,
    Drafter,
    DraftModelDrafter,
    FusedDrafter,
    NoDrafter,
    PromptLookupDrafter,
)  # fmt: skip
from ssmspec.speculate.drafters.head import DraftHead, HeadDrafter
from ssmspec.speculate.drafters.mtp import MTPDrafter
from ssmspec.speculate.retrieval import SuffixIndex, frequent_tokens

# sizes a SpecConfig leaves None (`sized`): n-gram lookup's NGRAM; a draft model drafts shallower trees (its proposals
# cost a forward per level): 4 deep, 3 nodes per level
DRAFT_MODEL_DEPTH = 4
DRAFT_MODEL_NODES_PER_LEVEL = 3
# a model with a draft head (drafter "auto" -> "draft_head", fused with prompt lookup), the sizes its sweep on held-out
# code with the embedded target measured fastest (docs: Benchmarks, "Draft heads"): greedy, a wider tree than n-grams
# alone (the head adds its own branches); sampling, a shallower one (its drafts are accepted with the target's
# probability)
HEAD_GREEDY = SpecConfig(tree_budget=24, num_draft_tokens=8)
# (a chain: measured as a 12-node budget, whose fused half left the head one branch a level; given the whole budget
# when sampling, three branches at the root were no faster: 1.35x and 1.42x HF's sampling at temperatures 0.7 and 1.0
# against the chain's 1.41x and 1.50x in one side-by-side run, 1.48x and 1.37x against 1.37x and 1.44x in another; in
# docs/data/e2e_defaults.json a 12-node tree 4 deep ran at 1.53x at temperature 0.7 against the default's 1.39x)
HEAD_SAMPLING = SpecConfig(tree_budget=4, num_draft_tokens=4)
# a checkpoint's MTP layer (drafter "mtp", or "auto" on a model whose MTP layer is small: ssmspec.speculate.plan), the
# sizes its sweep on the embedded Nemotron-H measured fastest (docs/data/mtp.json): greedy, the head's tree (each of its
# levels costs a forward of the layer: fewer rounds, MTPDrafter.rounds); sampling, 3 branches at the root, 3 deep (the
# layer fed its own outputs is accepted less at every level: a 4th level was accepted 0.25 of the times it was reached,
# and 4 deep ran 1.24x HF's sampling against 1.34x for 3)
MTP_GREEDY = HEAD_GREEDY
MTP_SAMPLING = SpecConfig(tree_budget=9, num_draft_tokens=3)
# a draft head on a model whose steps are compiled whole on a CPU, greedy: the head's argmax chain, each depth one
# compiled call (drafters.head.CompiledChains: on the 19.6M Nemotron-H 100 us for one level, 231 us for three, against
# 2.1 ms for three levels called op by op), up to 3 deep as the adaptive depth chooses. On that model (2-core CPU, 8
# held-out prompts, 128 new tokens, alternated in one process): 537 tok/s against 428 for compiled plain decoding, 453
# up to 4 deep, 488 with n-gram trees
HEAD_CHAIN = SpecConfig(tree=False, tree_budget=3, num_draft_tokens=3)
NGRAM = SpecConfig(tree_budget=16, num_draft_tokens=8)  # n-gram lookup (and the corpus): SpecConfig's documented sizes
# n-gram lookup on a model whose steps are compiled whole on a CPU, greedy, one prompt: chains 4 deep, adaptive, instead
# of NGRAM's trees (a tree of 9 to 17 nodes is verified padded to its bucket, at 2-3x a plain step there). Over compiled
# plain decoding (2-core CPU, 12 held-out prompts of 128 tokens, 128 new tokens, best of 3 alternated in one process):
# the 3M target 0.98x (NGRAM 0.95x), the embedded Bamba 1.20x (1.10x), the 19.6M Nemotron-H (asked for n-grams: its
# default is its head's chains) 1.16x (1.07x), the worst prompt 0.91-0.93x (0.83-0.86x); with 64-token prompts 1.15x,
# 1.17x, 1.15x (1.04x, 1.12x, 1.00x). A batch keeps the trees: 4 prompts of the 3M target, 64 new tokens, chains 0.90x
# and trees 0.97x
NGRAM_CHAIN = SpecConfig(tree=False, tree_budget=4, num_draft_tokens=4)


def head_sizes(sampling: bool, mtp: bool, compiled: bool = False) -> SpecConfig:
    """The sizes a draft head's sweep measured fastest (HEAD_GREEDY / HEAD_SAMPLING; greedy on a model compiled whole,
    `compiled`: HEAD_CHAIN) or an MTP layer (`mtp`: MTP_GREEDY / MTP_SAMPLING), greedy or `sampling`."""
    if mtp:
        return MTP_SAMPLING if sampling else MTP_GREEDY
    if compiled and not sampling:
        return HEAD_CHAIN
    return HEAD_SAMPLING if sampling else HEAD_GREEDY


def sized(spec: SpecConfig, sampling: bool = False, mtp: bool = False) -> SpecConfig:
    """`spec` with the sizes it leaves None (num_draft_tokens, tree_budget) set to the ones its drafter's size sweep
    measured fastest (a draft head: HEAD_GREEDY / HEAD_SAMPLING as `sampling`; an MTP layer, drafter "mtp" or a head
    that is one (`mtp`): MTP_GREEDY / MTP_SAMPLING; a draft model: DRAFT_MODEL_DEPTH deep, DRAFT_MODEL_NODES_PER_LEVEL
    nodes a level; anything else, n-gram lookup's NGRAM); sizes given are kept."""
    if spec.num_draft_tokens is not None and spec.tree_budget is not None:
        return spec
    if spec.drafter in ("draft_head", "mtp"):
        base = head_sizes(sampling, mtp=spec.drafter == "mtp" or mtp)
        depth, budget = base.num_draft_tokens, base.tree_budget
    elif spec.drafter == "draft_model":
        depth, budget = DRAFT_MODEL_DEPTH, min(MAX_DRAFT_NODES, DRAFT_MODEL_NODES_PER_LEVEL * DRAFT_MODEL_DEPTH)
    else:
        depth, budget = NGRAM.num_draft_tokens, NGRAM.tree_budget
    return replace(spec, num_draft_tokens=spec.num_draft_tokens if spec.num_draft_tokens is not None else depth,
                   tree_budget=spec.tree_budget if spec.tree_budget is not None else budget)  # fmt: skip


def spec_for(
    speculation: SpecConfig | None, config: GenerationConfig, draft: nn.Module | None, trees: bool = True,
    head: bool = False, sampling: bool = False, user_set: frozenset[str] = frozenset(), head_kind: str = "draft_head",
    compiled: bool = False, whole: bool = False,
) -> SpecConfig:  # fmt: skip
    """The SpecConfig a generate call runs: `speculation` if given, else the default for its HF kwargs, its drafter
    "auto" resolved (the call's draft model `draft`; else the model's draft head where `head` says "auto" drafts
    with it, as `head_kind` ("draft_head" or "mtp": an MTP layer); `sampling`: the call samples) and its `tree` None
    resolved to `trees` (whether the model verifies trees on this call: chains where its probe found trees inexact).
    `user_set`: the GenerationConfig fields the call sets (hf.generation.Plan.user_set); `compiled`: the model's
    steps are compiled whole (a draft head's default: its compiled chains, HEAD_CHAIN); `whole`: a call of one prompt
    on a model whose steps are compiled whole on a CPU (n-gram lookup's greedy default: its chains, NGRAM_CHAIN).
    """
    mtp = head_kind == "mtp"
    spec = speculation
    if spec is None:
        spec = _default(config, draft, head, sampling, user_set, mtp, compiled, whole)
    if spec.drafter == "auto":  # the call's draft model, else the model's draft head, else n-gram lookup
        if draft is not None:
            spec = replace(spec, drafter="draft_model")
        else:  # (recycling and drafting ahead: lookup's)
            spec = replace(spec, drafter=head_kind if head and not spec.recycle and not spec.ahead else "prompt_lookup")
    spec = sized(spec, sampling, mtp)
    return spec if spec.tree is not None else replace(spec, tree=trees)


def _default(
    config: GenerationConfig, draft: nn.Module | None, head: bool = False, sampling: bool = False,
    user_set: frozenset[str] = frozenset(), mtp: bool = False, compiled: bool = False, whole: bool = False,
) -> SpecConfig:  # fmt: skip
    ngram = int(config.max_matching_ngram_size or SpecConfig.max_matching_ngram_size)
    if draft is not None:
        depth = hf_depth(config, "num_assistant_tokens") if "num_assistant_tokens" in user_set else DRAFT_MODEL_DEPTH
        if (config.num_assistant_tokens_schedule or "constant") != "constant":
            # HF's heuristic schedule sizes each chain from the last step's outcome: it is the depth policy asked for
            return SpecConfig(drafter="draft_model", num_draft_tokens=depth, max_matching_ngram_size=ngram,
                              tree=False, adaptive=False)  # fmt: skip
        return SpecConfig(drafter="draft_model", num_draft_tokens=depth, max_matching_ngram_size=ngram,
                          tree_budget=min(MAX_DRAFT_NODES, DRAFT_MODEL_NODES_PER_LEVEL * depth))  # fmt: skip
    default = head_sizes(sampling, mtp, compiled) if head else (NGRAM_CHAIN if whole and not sampling else NGRAM)
    if config.prompt_lookup_num_tokens is None:
        return replace(default, max_matching_ngram_size=ngram)
    lookup = hf_depth(config, "prompt_lookup_num_tokens")
    per_level = default.tree_budget / max(default.num_draft_tokens, 1)  # the default tree's shape, k deep
    return replace(default, num_draft_tokens=lookup, tree_budget=min(MAX_DRAFT_NODES, round(per_level * lookup)),
                   max_matching_ngram_size=ngram)  # fmt: skip


def hf_depth(config: GenerationConfig, name: str) -> int:
    """A draft depth HF's generate takes (`prompt_lookup_num_tokens`, `num_assistant_tokens`): a positive int, named
    where it is not (ValueError); HF drafts no deeper than the tokens left, and neither does a step here: taken up to
    MAX_DRAFT_NODES."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int (draft tokens per step), got {value!r}")
    return min(value, MAX_DRAFT_NODES)


def build_drafter(
    spec: SpecConfig, *, draft: nn.Module | None, index: SuffixIndex | None, vocab_size: int,
    prompt_ids: torch.Tensor, special_ids: list[int], confidence: float, target: nn.Module | None = None,
    head: DraftHead | None = None, agreement: Agreement | None = None,
) -> Drafter:  # fmt: skip
    """The drafter `spec` asks for. `draft`: the transformed draft model (drafter "draft_model"); `index`: the
    corpus's index or None; `prompt_ids` and `special_ids` (EOS, pad) stay in a VocabTrim vocabulary;
    `confidence`: HF's assistant_confidence_threshold (0: off); `target` and its draft `head` (drafter
    "draft_head"); `agreement`: the target's (tensor parallelism: a draft model's timed choices are every process's)."""
    if spec.tree is None:  # (spec_for resolves it per model; a spec built by hand: a tree)
        spec = replace(spec, tree=True)
    # (spec_for sizes it for the call; a spec built by hand: its drafter's greedy sizes)
    spec = sized(spec, mtp=isinstance(head, MTPModule))
    if spec.drafter == "none":
        return NoDrafter()
    if spec.drafter in ("draft_head", "mtp"):
        branches = max(1, spec.tree_budget // max(spec.num_draft_tokens, 1)) if spec.tree else 1
        kind = MTPDrafter if isinstance(head, MTPModule) else HeadDrafter
        drafter = kind(head, target, tree=spec.tree, sampling_tree=spec.sampling_tree, branches=branches)
        if not spec.tree:
            return drafter
        # the head's tree fused with prompt lookup's (context, and the corpus if any), as RASD fuses a retrieval
        # tree into a draft model's: n-grams add what the head does not foresee (repeated code), at the cost of
        # a lookup (measured faster than the head alone, greedy and sampling: docs, "Draft heads"); a greedy step
        # whose n-gram trees reach its depth runs no head level (`retrieval_first`)
        lookup = PromptLookupDrafter(spec.max_matching_ngram_size, tree=True, corpus=index)
        return FusedDrafter(drafter, lookup, retrieval_first=True)
    if spec.drafter == "prompt_lookup":
        drafter: Drafter = PromptLookupDrafter(spec.max_matching_ngram_size, tree=spec.tree, corpus=index,
                                               recycle=spec.recycle)  # fmt: skip
        return AheadDrafter(drafter, fanout=spec.ahead) if spec.ahead else drafter
    keep = None
    if spec.draft_vocab is not None:  # VocabTrim: the corpus's most frequent tokens (or the given ids), prompt, EOS
        ids = frequent_tokens(index, spec.draft_vocab) if isinstance(spec.draft_vocab, int) else torch.tensor(
            spec.draft_vocab, dtype=torch.long)  # fmt: skip
        keep = torch.cat([ids, prompt_ids.flatten().cpu(), torch.tensor(special_ids, dtype=torch.long)])
    drafter = DraftModelDrafter(
        draft, vocab_size, commit=spec.commit, confidence_threshold=confidence,
        agreement=agreement,
        branches=max(1, spec.tree_budget // max(spec.num_draft_tokens, 1)) if spec.tree else 1,
        sampling_tree=spec.sampling_tree, tree=spec.tree, vocab=keep,
        max_nodes=max(spec.tree_budget, spec.num_draft_tokens) + 2, max_depth=spec.num_draft_tokens,
    )  # fmt: skip
    if index is not None and spec.tree:  # RASD: the retrieval tree fused into the draft's
        drafter = FusedDrafter(drafter, PromptLookupDrafter(spec.max_matching_ngram_size, tree=True, corpus=index))
    return DraftAheadDrafter(drafter, fanout=spec.ahead) if spec.ahead else drafter
