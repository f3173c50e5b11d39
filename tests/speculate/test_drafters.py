"""The frequency-weighted n-gram drafter: weights, heaviest chain, best-B subtree, budgets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ssmspec.speculate.drafters import PromptLookupDrafter, _weighted_draft


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
