"""The frequency-weighted n-gram drafter: weights, heaviest chain, best-B subtree, budgets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ssmspec.speculate.drafters import Drafter, PromptLookupDrafter
from ssmspec.speculate.drafters.ngram import _weighted_draft
from ssmspec.speculate.retrieval import ContextIndex


def test_longer_matches_weigh_more_and_come_first():
    # tail (7, 1): "1" occurs at 1 (preceded by 7: a 2-gram match) and at 4 (preceded by 9: 1-gram only)
    ctx = [7, 1, 2, 9, 1, 3, 7, 1]
    conts = PromptLookupDrafter(max_matching_ngram_size=2, ngram_weight=4.0).continuations(ctx, depth=2)
    assert conts == [([2, 9], 4.0), ([3, 7], 1.0)]


def test_chain_follows_heaviest_child_and_tree_keeps_heaviest_nodes():
    conts = [([5, 6, 7], 1.0), ([5, 8], 1.0), ([5, 8, 9], 1.0), ([4], 0.5)]
    # trie weights: 5:3, 6:1, 7:1, 8:2, 9:1, 4:0.5
    assert _weighted_draft(0, conts, max_nodes=3, chain=True) == ([0, 5, 8, 9], [-1, 0, 1, 2])
    tokens, parents = _weighted_draft(0, conts, max_nodes=3, chain=False)
    assert sorted(tokens[1:]) == [5, 6, 8]  # 5 (3), 8 (2), then the shallowest of the weight-1 nodes
    assert parents == [-1, 0, 1, 1]
    assert _weighted_draft(0, conts, max_nodes=1, chain=True) == ([0, 5], [-1, 0])
    assert _weighted_draft(0, [], max_nodes=4, chain=False) == ([0], [-1])


@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=60),
    st.integers(1, 12),
    st.integers(1, 8),
    st.integers(1, 4),
    st.booleans(),
)
def test_drafts_are_valid_trees_within_budget(ctx, budget, depth, ngram, tree):
    ((tokens, parents),) = PromptLookupDrafter(ngram, tree=tree).propose([ctx], budget, depth)
    assert tokens[0] == ctx[-1] and parents[0] == -1
    assert len(tokens) <= budget + 1
    node_depth = [0]
    for t in range(1, len(tokens)):
        assert 0 <= parents[t] < t
        node_depth.append(node_depth[parents[t]] + 1)
        assert (parents[t], tokens[t]) not in {(parents[u], tokens[u]) for u in range(1, t)}  # no duplicate child
    assert max(node_depth) <= depth
    if not tree:
        assert parents == list(range(-1, len(tokens) - 1))
    # every drafted path really occurs in the context right after an occurrence of its root token
    for t in range(1, len(tokens)):
        path, u = [], t
        while u > 0:
            path.append(tokens[u])
            u = parents[u]
        path.reverse()
        assert any(ctx[e] == ctx[-1] and ctx[e + 1 : e + 1 + len(path)] == path for e in range(len(ctx) - 1))


def _scan(ctx, max_ngram, limit):
    """The plain scan an index must reproduce: every earlier occurrence of the last token, with the length of
    the tail match (up to max_ngram), longest first, then latest."""
    n = len(ctx)
    found = []
    for end in range(n - 1):
        if ctx[end] != ctx[-1]:
            continue
        m = 1
        while m < max_ngram and end - m >= 0 and ctx[end - m] == ctx[n - 1 - m]:
            m += 1
        found.append((m, end))
    return sorted(found, key=lambda f: (-f[0], -f[1]))[:limit]


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=80),
    st.lists(st.integers(1, 6), min_size=1, max_size=8),
    st.integers(0, 5),
    st.integers(1, 4),
    st.integers(1, 20),
)
def test_context_index_grows_incrementally_and_equals_a_scan(ctx, cuts, extra, max_ngram, limit):
    """Synced step by step as a context grows (the engine's appends), the index finds what a scan finds, also
    for a context with unindexed tokens after the indexed ones (Saguaro's hypothetical continuations)."""
    index = ContextIndex(max_ngram)
    grown: list[int] = []
    pos = 0
    for c in cuts + [len(ctx)]:
        grown.extend(ctx[pos : pos + c])  # the same list object, appended to
        pos += c
        index.sync(grown)
        assert index.tokens == grown
        assert index.matches(grown, limit) == _scan(grown, max_ngram, limit)
        hypothetical = grown + ctx[:extra]
        assert index.matches(hypothetical, limit) == _scan(hypothetical, max_ngram, limit)
        assert index.tokens == grown  # looking up a hypothetical context indexes nothing


def test_context_index_rebuilds_for_an_unrelated_context():
    index = ContextIndex(2)
    index.sync([1, 2, 3, 1, 2])
    index.sync([4, 2, 3, 1, 2, 9])  # not a continuation of what was indexed
    assert index.tokens == [4, 2, 3, 1, 2, 9]
    assert index.matches([4, 2, 3, 1, 2, 9, 2], 4) == _scan([4, 2, 3, 1, 2, 9, 2], 2, 4)
    drafter = PromptLookupDrafter(2, tree=True)
    first = drafter.propose([[1, 2, 3, 1, 2]], 4, 3)
    assert drafter.propose([[7, 7, 3, 1, 2]], 4, 3) == PromptLookupDrafter(2, tree=True).propose(
        [[7, 7, 3, 1, 2]], 4, 3
    )
    assert first == PromptLookupDrafter(2, tree=True).propose([[1, 2, 3, 1, 2]], 4, 3)


def test_context_index_holds_a_fixed_number_of_collected_containers_and_finds_ends_latest_first():
    """A row's index lives through a whole generate call: containers Python's garbage collector tracks, one per
    n-gram, made full collections run during batched calls (150-180 ms each at batch 32); its hash chains keep a few
    whatever the sequence's length, and still list every end of an n-gram, latest first."""
    import gc
    import random

    rng = random.Random(0)
    toks = [rng.randrange(12) for _ in range(3000)]
    index = ContextIndex(3)
    index.extend(toks)

    def tracked(obj, seen):  # the GC-tracked containers reachable from obj
        if id(obj) in seen or not gc.is_tracked(obj):
            return
        seen.add(id(obj))
        for ref in gc.get_referents(obj):
            tracked(ref, seen)

    gc.collect()  # a tuple of ints (an n-gram key) is untracked at the first collection it meets
    seen: set[int] = set()
    tracked(index.__dict__, seen)
    assert len(seen) <= 3 * 3 + 4  # per n a dict and a list, the token list, the instance dict (3000 tokens)
    for ngram in ([5], [5, 7], [1, 2, 3], toks[-3:]):
        m = len(ngram)
        want = [i for i in range(len(toks) - 1, m - 2, -1) if toks[i - m + 1 : i + 1] == ngram]
        assert list(index.ends(ngram)) == want and want
    assert list(index.ends([1, 2, 3, 4])) == [] and list(index.ends([])) == []


class _Recording(Drafter):
    """Records every hook the engine calls; asks for the target's features, history and top-3."""

    target_features = True
    target_history = True
    target_topk = 3

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.scored: list = []  # (no dynamic tree: FusedDrafter prunes nothing)

    def propose(self, contexts, max_nodes, max_depth):
        self.calls.append("propose")
        return [([c[-1]], [-1]) for c in contexts]

    def set_decoding(self, decoding) -> None:
        super().set_decoding(decoding)
        self.calls.append("set_decoding")

    def start(self, input_ids, attention_mask) -> None:
        self.calls.append("start")

    def ahead(self, contexts, drafts, max_nodes, max_depth) -> None:
        self.calls.append("ahead")

    def finish(self, stats) -> None:
        self.calls.append("finish")

    def observe_features(self, row, feature) -> None:
        self.calls.append("observe_features")

    def observe_history(self, row, features) -> None:
        self.calls.append("observe_history")

    def observe_prompt(self, row, tokens, tops) -> None:
        self.calls.append(f"observe_prompt:{len(tops[0][0])}")

    def observe(self, row, context, draft, tops, emitted) -> None:
        self.calls.append(f"observe:{len(tops[0][0])}")


def test_wrappers_pass_every_hook_on_to_the_drafters_they_wrap():
    """A wrapper (fused, drafting ahead) cannot forget a hook: every hook of the interface (base.HOOKS) is either
    its own or `Wrapper`'s, which hands it to each wrapped drafter that asks for it (the flags: any of theirs)."""
    import torch

    from ssmspec.speculate.decoding import Decoding
    from ssmspec.speculate.drafters import AheadDrafter, DraftAheadDrafter, FusedDrafter
    from ssmspec.speculate.drafters.base import FLAGS, HOOKS, Wrapper
    from ssmspec.speculate.engine import SpecStats
    from ssmspec.speculate.step.propose import Proposer

    for kind in (FusedDrafter, AheadDrafter, DraftAheadDrafter):
        assert issubclass(kind, Wrapper)
        for name in (*HOOKS, *FLAGS):
            assert getattr(kind, name) is not getattr(Drafter, name), (kind.__name__, name)
    inner = _Recording()
    fused = FusedDrafter(inner, PromptLookupDrafter(2, tree=True))
    assert fused.target_features and fused.target_history and fused.target_topk == 3
    # a plain step asks a drafter nothing unless one it wraps works on every step (Saguaro's)
    assert not fused.works_ahead and not Proposer(fused).calls_every_step
    saguaro = FusedDrafter(_Recording(), AheadDrafter(PromptLookupDrafter(2, tree=True), fanout=2))
    assert saguaro.works_ahead and Proposer(saguaro).calls_every_step
    ids = torch.tensor([[1, 2, 3]])
    fused.set_decoding(Decoding())
    fused.start(ids, torch.ones_like(ids))
    draft = fused.propose([[1, 2, 3]], 4, 2)[0]
    fused.ahead([[1, 2, 3]], [draft], 4, 2)
    fused.observe_features(0, torch.zeros(4))
    fused.observe_history(0, torch.zeros(1, 4))
    tops = [([5, 6, 7, 8], [0.4, 0.3, 0.2, 0.1])]
    fused.observe_prompt(0, [1], tops)
    fused.observe(0, [1, 2, 3], draft, tops, [4])
    fused.finish(SpecStats())
    assert inner.calls == ["set_decoding", "start", "propose", "ahead", "observe_features", "observe_history",
                           "observe_prompt:3", "observe:3", "finish"]  # fmt: skip
