"""Draft-model trees (DySpec dynamic trees) and VocabTrim: tree shape, exactness against HF greedy, the
user's draft left unchanged, sampling distribution, and the settings' errors."""

from __future__ import annotations

import copy

import pytest
import torch

import ssmspec
from ssmspec.speculate.drafters import DraftModelDrafter, TrimmedHead, trim_vocab
from ssmspec.speculate.drafters.fused import _merge
from ssmspec.speculate.retrieval import SuffixIndex, frequent_tokens
from ssmspec.testing.distribution import sampling_p_value, tiny_sampling_setup
from ssmspec.testing.strategies import cached_tiny_model
from ssmspec.transform import prepare_draft


def _contexts():
    return [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 10, 11, 12, 13, 9]]


@pytest.mark.parametrize("budget,depth", [(1, 1), (6, 3), (12, 4), (5, 8)])
def test_dynamic_tree_shape(budget, depth):
    """At most `budget` drafted nodes, depth at most `depth`, parents before children, and every node's
    path probability no larger than its parent's (best-first growth keeps a tree)."""
    draft = prepare_draft(cached_tiny_model("mamba2", 0, torch.float64, 5))
    drafter = DraftModelDrafter(draft, 96, tree=True, min_path_prob=0.0)
    ids = torch.tensor([c[:-1] + [0] * 0 for c in _contexts()][:1])
    for ctxs in ([_contexts()[0]],):
        drafter.start(ids, torch.ones_like(ids))
        ((tokens, parents),) = drafter.propose(ctxs, budget, depth)
        assert tokens[0] == ctxs[0][-1] and parents[0] == -1
        assert 1 <= len(tokens) - 1 <= budget
        d = [0]
        for i, p in enumerate(parents[1:], 1):
            assert 0 <= p < i
            d.append(d[p] + 1)
        assert max(d) <= depth
        if budget > depth:
            assert len(set(parents[1:])) < len(parents) - 1  # it branched somewhere


def test_dynamic_tree_follows_confidence():
    """A high minimum path probability keeps the tree small (the draft is unsure), a zero one fills the budget."""
    draft = prepare_draft(cached_tiny_model("mamba2", 0, torch.float64, 5))
    ids = torch.tensor([_contexts()[0][:-1]])
    sizes = {}
    for floor in (0.0, 0.5):
        drafter = DraftModelDrafter(draft, 96, tree=True, min_path_prob=floor)
        drafter.start(ids, torch.ones_like(ids))
        sizes[floor] = len(drafter.propose([_contexts()[0]], 12, 4)[0][0]) - 1
    assert sizes[0.0] == 12 and sizes[0.5] < 12


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_dynamic_trees_and_vocab_trim_are_exact(family):
    """generate(assistant_model=, SpecConfig(tree=True[, draft_vocab])) equals HF greedy, on a batch of 2."""
    ref = cached_tiny_model(family, dtype=torch.float64)
    draft = cached_tiny_model("mamba2", 0, torch.float64, 5)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6], [0, 0, 7, 8, 9, 7, 8, 9]])
    mask = (ids != 0).long()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
                        pad_token_id=0)  # fmt: skip
    corpus = SuffixIndex.from_sequences([want[0].tolist(), list(range(96))])
    for spec in (
        ssmspec.SpecConfig(drafter="draft_model", tree=True, tree_budget=8, num_draft_tokens=3),
        ssmspec.SpecConfig(
            drafter="draft_model", tree=True, tree_budget=8, num_draft_tokens=3, corpus=corpus, draft_vocab=20
        ),
        ssmspec.SpecConfig(drafter="draft_model", num_draft_tokens=3, corpus=corpus, draft_vocab=5),
        ssmspec.SpecConfig(drafter="draft_model", tree=True, tree_budget=8, num_draft_tokens=3, corpus=corpus),  # RASD
        ssmspec.SpecConfig(drafter="draft_model", tree=True, num_draft_tokens=3, draft_vocab=[1, 2, 3]),
    ):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None, pad_token_id=0,
                             assistant_model=draft, speculation=spec)  # fmt: skip
        assert torch.equal(out, want), spec
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in before.items())
    assert not isinstance(draft.get_output_embeddings(), TrimmedHead)


def test_trimmed_head_proposes_kept_ids_only():
    draft = prepare_draft(cached_tiny_model("mamba2", 0, torch.float64, 5))
    keep = torch.tensor([3, 17, 40, 41, 90])
    trimmed = trim_vocab(draft, keep)
    assert draft.get_output_embeddings() is not trimmed.get_output_embeddings()
    x = torch.randn(2, 4, draft.config.hidden_size, dtype=torch.float64)
    full = draft.get_output_embeddings()(x)
    small = trimmed.get_output_embeddings()(x)
    assert small.shape == full.shape
    torch.testing.assert_close(small[..., keep], full[..., keep], rtol=1e-12, atol=1e-12)  # BLAS order may differ
    others = torch.ones(full.shape[-1], dtype=torch.bool)
    others[keep] = False
    assert bool(torch.isneginf(small[..., others]).all())
    drafter = DraftModelDrafter(draft, 96, tree=True, vocab=keep)
    ids = torch.tensor([[5, 6, 7, 8]])
    drafter.start(ids, torch.ones_like(ids))
    tokens, _ = drafter.propose([[5, 6, 7, 8, 5]], 8, 3)[0]
    assert len(tokens) > 1 and set(tokens[1:]) <= set(keep.tolist())
    with pytest.raises(ValueError, match="subset"):
        trim_vocab(draft, torch.tensor([96]))


def test_frequent_tokens_counts_the_corpus():
    index = SuffixIndex.from_sequences([[4, 4, 4, 2, 2, 9], [2, 4, 7]])
    assert frequent_tokens(index, 2).tolist() == [4, 2]
    assert frequent_tokens(index, 10).tolist() == [4, 2, 7, 9]


def test_draft_vocab_settings_are_checked():
    with pytest.raises(ValueError, match="corpus="):
        ssmspec.SpecConfig(drafter="draft_model", draft_vocab=8)
    with pytest.raises(ValueError, match="draft model"):
        ssmspec.SpecConfig(draft_vocab=8, corpus=["x"])
    with pytest.raises(ValueError, match=">= 1"):
        ssmspec.SpecConfig(drafter="draft_model", draft_vocab=0, corpus=["x"])
    with pytest.raises(TypeError, match="draft_vocab"):
        ssmspec.SpecConfig(drafter="draft_model", draft_vocab=True, corpus=["x"])
    with pytest.raises(ValueError, match="token ids"):
        ssmspec.SpecConfig(drafter="draft_model", draft_vocab=[3, -1])
    assert ssmspec.SpecConfig(drafter="draft_model", draft_vocab=[3, 4]).draft_vocab == (3, 4)  # no corpus needed


def test_trimmed_draft_sampling_matches_hf_sampling():
    """VocabTrim under speculative sampling: the draft's q is zero outside the kept ids; rejection sampling
    stays lossless (chi-square against HF's sampling)."""
    target, draft, prompt = tiny_sampling_setup()
    corpus = SuffixIndex.from_sequences([prompt[0].tolist()])
    spec = ssmspec.transform(copy.deepcopy(target))
    p, stats = sampling_p_value(
        target, spec, prompt, samples=3000, do_sample=True, temperature=1.0, top_k=0, assistant_model=draft,
        speculation=ssmspec.SpecConfig(drafter="draft_model", num_draft_tokens=3, corpus=corpus, draft_vocab=6,
                                       tree=False, adaptive=False),
    )  # fmt: skip
    assert 0 < stats["accepted_tokens"] < stats["row_steps"] * 3, stats
    assert p > 1e-3, p


def test_merge_matches_prefixes_and_respects_budget_and_sampled_nodes():
    base = ([1, 5, 6, 7], [-1, 0, 1, 0])  # root 1: children 5 (-> 6) and 7
    extra = ([1, 5, 6, 9, 8, 4], [-1, 0, 1, 2, 0, 4])  # 1 -> 5 -> 6 -> 9, 1 -> 8 -> 4
    tokens, parents = _merge(base, extra, max_nodes=10)
    assert tokens == [1, 5, 6, 7, 9, 8, 4] and parents == [-1, 0, 1, 0, 2, 0, 5]
    assert _merge(base, extra, max_nodes=4) == ([1, 5, 6, 7, 9], [-1, 0, 1, 0, 2])
    q = torch.full((10,), 0.1)
    sampled = ([1, 5, 6, 7], [-1, 0, 1, 0], {0: q, 1: q})  # the root's and node 1's children were sampled
    tokens, parents, qs = _merge(sampled, extra, max_nodes=10)
    assert tokens == [1, 5, 6, 7, 9] and parents == [-1, 0, 1, 0, 2] and qs is sampled[2]


def test_fused_sampling_matches_hf_sampling():
    """RASD fusion under speculative sampling: sampled draft nodes and deterministic retrieved ones in one
    tree; the chi-square test against HF's sampling must pass."""
    target, draft, prompt = tiny_sampling_setup()
    greedy = target.generate(prompt, do_sample=False, max_new_tokens=8, eos_token_id=None)[0].tolist()
    corpus = SuffixIndex.from_sequences([greedy, greedy[4:]])
    spec = ssmspec.transform(copy.deepcopy(target))
    p, stats = sampling_p_value(
        target, spec, prompt, samples=3000, do_sample=True, temperature=1.0, top_k=0, assistant_model=draft,
        speculation=ssmspec.SpecConfig(drafter="draft_model", tree=True, tree_budget=6, num_draft_tokens=3,
                                       corpus=corpus, adaptive=False),
    )  # fmt: skip
    assert 0 < stats["accepted_tokens"] < stats["row_steps"] * 3, stats
    assert p > 1e-3, p


def test_merge_drops_what_keep_refuses_with_its_subtree():
    base = ([1, 5, 6, 7], [-1, 0, 1, 0])
    extra = ([1, 5, 6, 9, 8, 4, 3], [-1, 0, 1, 2, 0, 4, 0])  # 1 -> 5 -> 6 -> 9, 1 -> 8 -> 4, 1 -> 3
    refused = []

    def keep(node, token):
        refused.append((node, token))
        return token != 8

    tokens, parents = _merge(base, extra, max_nodes=10, keep=keep)
    assert tokens == [1, 5, 6, 7, 9, 3] and parents == [-1, 0, 1, 0, 2, 0]  # 8 and its child 4 are gone
    assert (0, 8) in refused and (0, 5) not in refused  # only new branches are asked about


class _StubDraft:
    """A draft drafter with a fixed tree and fixed scored logits (root: token 5 likely, 9 unlikely, 3 outside a
    trimmed vocabulary)."""

    def __init__(self):
        self.scored = []

    def set_decoding(self, decoding):
        pass

    def finish(self, stats):
        pass

    def start(self, input_ids, attention_mask):
        pass

    def propose(self, contexts, max_nodes, max_depth):
        logits = torch.full((12,), 0.0)
        logits[5], logits[9], logits[3] = 10.0, -10.0, -float("inf")
        self.scored = [{0: logits} for _ in contexts]
        return [([ctx[-1], 5], [-1, 0]) for ctx in contexts]


@pytest.mark.parametrize("prune_below", [0.0, 0.01])
def test_fused_drafter_prunes_retrieved_branches_the_draft_rules_out(prune_below):
    from ssmspec.speculate.drafters import FusedDrafter, PromptLookupDrafter
    from ssmspec.speculate.engine import SpecStats

    # the corpus continues "2" with 9 1 1 (twice: the heaviest), 3 1 and 5 6
    corpus = SuffixIndex.from_sequences([[2, 9, 1, 1], [2, 9, 1, 1], [2, 3, 1], [2, 5, 6]])
    fused = FusedDrafter(_StubDraft(), PromptLookupDrafter(2, tree=True, corpus=corpus), prune_below=prune_below)
    fused.start(None, None)
    ((tokens, parents),) = fused.propose([[0, 2]], 6, 3)
    children = {t for t, p in zip(tokens, parents) if p == 0}
    assert 5 in children and 3 in children  # the draft's own token; a token outside the draft's vocabulary
    assert (9 in children) == (prune_below == 0)  # the retrieval's favourite, which the draft rules out
    if prune_below:
        assert 6 in tokens  # the freed budget takes the retrieved continuation of the draft's token
    stats = SpecStats()
    fused.finish(stats)
    assert stats.drafter["pruned"] == (1 if prune_below else 0)


class _SampledStub(_StubDraft):
    """A sampling draft's tree: `max_nodes` nodes, a chain as deep as asked and the rest as the root's children (a q
    at the root and node 1); records the budget it was given."""

    def __init__(self):
        super().__init__()
        self.budgets = []

    def propose(self, contexts, max_nodes, max_depth):
        self.budgets.append(max_nodes)
        q = torch.full((12,), 1 / 12)
        # a chain of max_depth under the root, the rest of the budget as the root's further children
        tokens, parents = [None, 5], [-1, 0]
        for d in range(1, max_depth):
            tokens.append(6 + d)
            parents.append(len(tokens) - 2)
        tokens += [1 + i for i in range(max_nodes - (len(tokens) - 1))]
        parents += [0] * (len(tokens) - len(parents))
        return [([ctx[-1], *tokens[1:]], list(parents), {0: q, 1: q}) for ctx in contexts]


@pytest.mark.parametrize("do_sample", [False, True])
def test_fused_drafter_gives_a_sampled_draft_the_whole_budget(do_sample):
    """Retrieved nodes never go under a node whose children were sampled, and a sampled tree is as deep as the step: a
    sampling call's budget goes to the draft alone (greedy: `draft_share` of it), and the merged tree keeps it."""
    from ssmspec.speculate.decoding import Decoding
    from ssmspec.speculate.drafters import FusedDrafter, PromptLookupDrafter

    corpus = SuffixIndex.from_sequences([[2, 9, 1, 1], [2, 3, 1], [2, 5, 6]])
    draft = _SampledStub()
    fused = FusedDrafter(draft, PromptLookupDrafter(2, tree=True, corpus=corpus), prune_below=0.0)
    fused.set_decoding(Decoding(do_sample=do_sample))
    fused.start(None, None)
    ((tokens, parents, qs),) = fused.propose([[0, 2]], 8, 3)
    assert draft.budgets == [8 if do_sample else 4]
    assert len(tokens) - 1 <= 8
    if do_sample:  # the draft's tree as drafted, its 8 nodes
        assert (tokens[1:], parents) == ([5, 7, 8, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 0, 0, 0, 0, 0])


class _CountingStub(_StubDraft):
    """`_StubDraft` that counts its proposals."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def propose(self, contexts, max_nodes, max_depth):
        self.calls += 1
        return super().propose(contexts, max_nodes, max_depth)


@pytest.mark.parametrize("do_sample", [False, True])
def test_retrieval_first_runs_the_draft_only_where_retrieval_falls_short_of_the_depth(do_sample):
    """With `retrieval_first`, a greedy step whose retrieved trees reach its depth in every row is retrieval's tree
    alone, the draft not run; where a row's retrieval is shallower (or a sampled step) both draft and are fused."""
    from ssmspec.speculate.decoding import Decoding
    from ssmspec.speculate.drafters import FusedDrafter, PromptLookupDrafter
    from ssmspec.speculate.engine import SpecStats

    # "2" continues 9 1 1 (3 deep); "4" continues 7 only (1 deep)
    corpus = SuffixIndex.from_sequences([[2, 9, 1, 1], [0, 4, 7]])
    draft = _CountingStub()
    fused = FusedDrafter(draft, PromptLookupDrafter(2, tree=True, corpus=corpus), prune_below=0.0,
                         retrieval_first=True)  # fmt: skip
    fused.set_decoding(Decoding(do_sample=do_sample))
    fused.start(None, None)
    alone = PromptLookupDrafter(2, tree=True, corpus=corpus)
    alone.start(None, None)
    deep = fused.propose([[0, 2]], 6, 3)
    if do_sample:
        assert draft.calls == 1
    else:
        assert draft.calls == 0 and deep == alone.propose([[0, 2]], 6, 3)  # retrieval's own tree, 3 deep
    draft.calls = 0
    ((tokens, parents, *_),) = fused.propose([[0, 4]], 6, 3)  # retrieval reaches depth 1 of 3: the draft runs
    assert draft.calls == 1 and 5 in {t for t, p in zip(tokens, parents) if p == 0} and 7 in tokens
    draft.calls = 0
    fused.propose([[0, 2], [0, 4]], 6, 3)  # one row short: the draft runs for the batch
    assert draft.calls == 1
    stats = SpecStats()
    fused.finish(stats)
    assert stats.drafter["retrieved_only"] == (0 if do_sample else 1)
