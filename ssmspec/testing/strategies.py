"""Public Hypothesis strategies: tiny models per family, prompts, token trees and drafters.

Users testing a new architecture combine these with `check_model`; ssmspec's own property suite
(tests/property/) is built from the same pieces.
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from ssmspec.speculate.drafters import Drafter, DraftModelDrafter, FusedDrafter, NoDrafter, PromptLookupDrafter
from ssmspec.speculate.drafters.ahead import AheadDrafter, DraftAheadDrafter
from ssmspec.speculate.retrieval import SuffixIndex
from ssmspec.testing.configs import SUPPORTED_FAMILIES, build_tiny_model
from ssmspec.testing.drafters import OracleDrafter, RandomDrafter
from ssmspec.transform import TransformInfo, prepare_draft, transform
from ssmspec.tree import TokenTree

DrafterFactory = Callable[[list[list[int]]], Drafter]


@functools.lru_cache(maxsize=64)
def cached_tiny_model(family: str, variant: int = 0, dtype: torch.dtype = torch.float64, seed: int = 0):
    """build_tiny_model, memoised: property tests draw many examples per model (check_model copies it).

    Args:
        family: one of SUPPORTED_FAMILIES (or UNSUPPORTED_FAMILIES, to test refusals).
        variant: the structural variant.
        dtype: the model's dtype.
        seed: the weights' seed.
    """
    return build_tiny_model(family, dtype=dtype, seed=seed, seed_variant=variant)


@functools.lru_cache(maxsize=64)
def capabilities(family: str, variant: int = 0, dtype: torch.dtype = torch.float64, seed: int = 0) -> TransformInfo:
    """What transform's probe established for a tiny model (trees, batches, limits), memoised.

    Args:
        family: one of SUPPORTED_FAMILIES.
        variant: the structural variant.
        dtype: the model's dtype.
        seed: the weights' seed.
    """
    return transform(copy.deepcopy(cached_tiny_model(family, variant, dtype, seed))).ssmspec_info


def families() -> st.SearchStrategy[str]:
    """One of the supported model families."""
    return st.sampled_from(SUPPORTED_FAMILIES)


def tiny_models(family: str | None = None, dtype: torch.dtype = torch.float64) -> st.SearchStrategy:
    """A tiny random-init causal LM of the family (or any family), in a few structural variants.

    Args:
        family: one of SUPPORTED_FAMILIES; None draws the family too.
        dtype: the model's dtype.
    """
    fam = st.just(family) if family else families()
    return st.builds(lambda f, v: cached_tiny_model(f, v, dtype), fam, st.integers(0, 2))


@st.composite
def prompts(draw, vocab_size: int, max_batch: int = 3, max_len: int = 10, allow_all_padding: bool = False):
    """(input_ids, attention_mask): a left-padded batch; tokens avoid 0-2 (pad/bos/eos) except padding.
    Prompts often repeat a motif so that prompt lookup finds matches.

    Args:
        vocab_size: tokens are drawn below it.
        max_batch: rows at most.
        max_len: prompt length at most.
        allow_all_padding: whether a row may be all padding.
    """
    b = draw(st.integers(1, max_batch))
    length = draw(st.integers(1, max_len))
    rows, masks = [], []
    for _ in range(b):
        real = draw(st.integers(0 if allow_all_padding else 1, length))
        if draw(st.booleans()) and real >= 2:
            motif = draw(st.lists(st.integers(3, vocab_size - 1), min_size=1, max_size=3))
            toks = (motif * length)[:real]
        else:
            toks = draw(st.lists(st.integers(3, vocab_size - 1), min_size=real, max_size=real))
        rows.append([0] * (length - real) + toks)
        masks.append([0] * (length - real) + [1] * real)
    return torch.tensor(rows), torch.tensor(masks)


@st.composite
def trees(draw, batch_size: int = 1, max_nodes: int = 16, vocab_size: int = 96) -> TokenTree:
    """A batch of random token trees (topological order, node 0 the root), rows of different sizes.

    Args:
        batch_size: rows.
        max_nodes: nodes per row at most (root included).
        vocab_size: tokens are drawn below it.
    """
    tokens, parents = [], []
    for _ in range(batch_size):
        n = draw(st.integers(1, max_nodes))
        tokens.append(draw(st.lists(st.integers(0, vocab_size - 1), min_size=n, max_size=n)))
        parents.append([-1] + [draw(st.integers(0, t - 1)) for t in range(1, n)])
    return TokenTree.from_lists(tokens, parents)


def drafter_factories(vocab_size: int, trees: bool = True) -> st.SearchStrategy[tuple[str, DrafterFactory]]:
    """(description, factory(reference_rows) -> Drafter), adversarial ones included: no drafts, random
    tokens, an oracle that is always right, one right for a prefix then wrong, correct branches that are
    not the first child, prompt lookup chains and trees (with and without a retrieval corpus, with Saguaro's
    background drafting, with token recycling), draft models (SSM, hybrid, short-conv; chains, dynamic trees, trimmed
    vocabularies), RASD (a draft's dynamic tree fused with a pruned retrieval tree) and Saguaro with a draft model.

    Args:
        vocab_size: the target's vocabulary size.
        trees: False draws chain drafters only (for models whose probe found trees inexact).
    """
    seeds = st.integers(0, 2**16)
    if not trees:
        return _chain_drafters(vocab_size, seeds)

    def draft_model(args: tuple[str, bool, int]) -> tuple[str, DrafterFactory]:
        return _draft_model(args[0], vocab_size, args[1], args[2])

    return st.one_of(
        st.just(("none", lambda ref: NoDrafter())),
        seeds.map(lambda s: (f"random(seed={s})", lambda ref: RandomDrafter(vocab_size, seed=s))),
        st.integers(0, 2).map(
            lambda d: (f"oracle(distractors={d})", lambda ref: OracleDrafter(ref, vocab_size=vocab_size, distractors=d))
        ),
        st.tuples(st.integers(0, 4), st.integers(0, 2), seeds).map(
            lambda a: (
                f"oracle(right_prefix={a[0]}, distractors={a[1]})",
                lambda ref: OracleDrafter(ref, vocab_size=vocab_size, right_prefix=a[0], distractors=a[1], seed=a[2]),
            )
        ),
        st.tuples(st.integers(1, 3), st.booleans()).map(
            lambda a: (f"prompt_lookup(n={a[0]}, tree={a[1]})", lambda ref: PromptLookupDrafter(a[0], tree=a[1]))
        ),
        st.tuples(st.integers(1, 3), st.booleans(), seeds).map(lambda a: _retrieval(vocab_size, *a)),
        st.tuples(st.integers(1, 3), st.booleans(), seeds, st.integers(1, 4)).map(lambda a: _ahead(vocab_size, *a)),
        st.tuples(st.integers(1, 3), st.booleans(), st.integers(1, 8), st.sampled_from([None, *range(4)])).map(
            lambda a: _recycling(vocab_size, *a)
        ),
        st.tuples(
            st.sampled_from(["mamba2", "lfm2", "qwen3_next"]), st.booleans(), st.sampled_from([0, vocab_size // 2])
        ).map(draft_model),  # fmt: skip
        st.tuples(st.sampled_from(["mamba2", "lfm2"]), seeds).map(lambda a: _rasd(a[0], vocab_size, a[1])),
        st.tuples(st.sampled_from(["chain", "tree", "rasd"]), st.integers(1, 3), seeds).map(
            lambda a: _draft_ahead(vocab_size, *a)
        ),
    )


def _noisy_corpus(ref: list[list[int]], vocab_size: int, seed: int) -> SuffixIndex:
    """The reference rows with about a fifth of their tokens replaced, plus a random document, indexed: retrieved
    continuations are right for a while, then wrong."""
    rng = random.Random(seed)
    docs = [[t if rng.random() > 0.2 else rng.randrange(vocab_size) for t in row] for row in ref]
    docs.append([rng.randrange(vocab_size) for _ in range(64)])
    return SuffixIndex.from_sequences(docs)


def _retrieval(vocab_size: int, n: int, tree: bool, seed: int) -> tuple[str, DrafterFactory]:
    """Prompt lookup with a retrieval corpus (`_noisy_corpus`)."""

    def factory(ref: list[list[int]]) -> Drafter:
        return PromptLookupDrafter(n, tree=tree, corpus=_noisy_corpus(ref, vocab_size, seed))

    return f"retrieval(n={n}, tree={tree}, seed={seed})", factory


def _ahead(vocab_size: int, n: int, tree: bool, seed: int, fanout: int) -> tuple[str, DrafterFactory]:
    """Retrieval drafting with Saguaro: the next step drafted in a background thread for `fanout` outcomes."""

    def factory(ref: list[list[int]]) -> Drafter:
        return AheadDrafter(PromptLookupDrafter(n, tree=tree, corpus=_noisy_corpus(ref, vocab_size, seed)), fanout)

    return f"ahead(retrieval(n={n}, tree={tree}, seed={seed}), fanout={fanout})", factory


def _recycling(vocab_size: int, n: int, tree: bool, k: int, seed: int | None) -> tuple[str, DrafterFactory]:
    """Prompt lookup with token recycling (the target's top-k successors, calibrated best-first drafts), with a
    retrieval corpus (`_noisy_corpus`) unless `seed` is None."""

    def factory(ref: list[list[int]]) -> Drafter:
        corpus = None if seed is None else _noisy_corpus(ref, vocab_size, seed)
        return PromptLookupDrafter(n, tree=tree, corpus=corpus, recycle=k)

    return f"recycling(n={n}, tree={tree}, k={k}, corpus seed={seed})", factory


def _rasd(family: str, vocab_size: int, seed: int) -> tuple[str, DrafterFactory]:
    """RASD: a tiny draft's dynamic tree fused with a pruned retrieval tree (`_noisy_corpus`)."""
    draft = cached_tiny_model(family, 0, torch.float64, 5)

    def factory(ref: list[list[int]]) -> Drafter:
        retrieval = PromptLookupDrafter(2, tree=True, corpus=_noisy_corpus(ref, vocab_size, seed))
        return FusedDrafter(DraftModelDrafter(prepare_draft(draft), vocab_size, tree=True), retrieval)

    return f"rasd({family}, seed={seed})", factory


def _draft_ahead(vocab_size: int, kind: str, fanout: int, seed: int) -> tuple[str, DrafterFactory]:
    """Saguaro with a tiny mamba2 draft: a chain, a dynamic tree or RASD (`_noisy_corpus`), `fanout` hypotheses."""
    draft = cached_tiny_model("mamba2", 0, torch.float64, 5)

    def factory(ref: list[list[int]]) -> Drafter:
        base = DraftModelDrafter(prepare_draft(draft), vocab_size, tree=kind != "chain")
        if kind == "rasd":
            base = FusedDrafter(base, PromptLookupDrafter(2, tree=True, corpus=_noisy_corpus(ref, vocab_size, seed)))
        return DraftAheadDrafter(base, fanout)

    return f"draft_ahead({kind}, fanout={fanout}, seed={seed})", factory


def _draft_model(family: str, vocab_size: int, tree: bool = False, trim: int = 0) -> tuple[str, DrafterFactory]:
    """A tiny draft of `family`: a greedy chain, or a dynamic tree (DySpec); with `trim`, VocabTrim to that
    many ids (the smallest ones: an arbitrary subset, the target's choices need not be in it)."""
    draft = cached_tiny_model(family, 0, torch.float64, 5)
    keep = torch.arange(trim) if trim else None
    return f"draft_model({family}, tree={tree}, trim={trim})", lambda ref: DraftModelDrafter(
        prepare_draft(draft), vocab_size, tree=tree, vocab=keep
    )


def _chain_drafters(vocab_size: int, seeds) -> st.SearchStrategy[tuple[str, DrafterFactory]]:
    return st.one_of(
        st.just(("none", lambda ref: NoDrafter())),
        seeds.map(lambda s: (f"random(seed={s}, chain)", lambda ref: RandomDrafter(vocab_size, seed=s, chain=True))),
        st.just(("oracle(distractors=0)", lambda ref: OracleDrafter(ref, vocab_size=vocab_size))),
        st.tuples(st.integers(0, 4), seeds).map(
            lambda a: (
                f"oracle(right_prefix={a[0]}, distractors=0)",
                lambda ref: OracleDrafter(ref, vocab_size=vocab_size, right_prefix=a[0], seed=a[1]),
            )
        ),
        st.integers(1, 3).map(lambda n: (f"prompt_lookup(n={n}, tree=False)", lambda ref: PromptLookupDrafter(n))),
        st.tuples(st.integers(1, 3), seeds).map(lambda a: _retrieval(vocab_size, a[0], False, a[1])),
        st.tuples(st.integers(1, 3), seeds, st.integers(1, 4)).map(lambda a: _ahead(vocab_size, a[0], False, *a[1:])),
        st.tuples(st.integers(1, 3), st.integers(1, 8), st.sampled_from([None, 0])).map(
            lambda a: _recycling(vocab_size, a[0], False, *a[1:])
        ),
        st.tuples(st.sampled_from(["mamba2", "lfm2", "qwen3_next"]), st.sampled_from([0, vocab_size // 2])).map(
            lambda a: _draft_model(a[0], vocab_size, trim=a[1])
        ),
        st.tuples(st.integers(1, 3), seeds).map(lambda a: _draft_ahead(vocab_size, "chain", *a)),
    )
