"""TokenTree: validation errors, derived depth / ancestors / paths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ssmspec import InvalidTreeError, TokenTree
from ssmspec.testing.strategies import trees


def test_rejects_malformed_trees():
    with pytest.raises(InvalidTreeError, match="at least its root"):
        TokenTree(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(InvalidTreeError, match="parents\\[:, 0\\] must be -1"):
        TokenTree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[0, 0]]))
    with pytest.raises(InvalidTreeError, match="earlier node"):
        TokenTree(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 2, 0]]))  # parent after child
    with pytest.raises(InvalidTreeError, match="earlier node"):
        TokenTree(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 1, 1]]))  # self loop / cycle
    with pytest.raises(InvalidTreeError, match="as many parents"):
        TokenTree.from_lists([[1, 2]], [[-1]])
    with pytest.raises(InvalidTreeError, match=r"\[batch, nodes\]"):
        TokenTree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([-1, 0]))


def test_from_lists_pads_with_unacceptable_nodes():
    tree = TokenTree.from_lists([[5, 6, 7], [8]], [[-1, 0, 1], [-1]], pad_token_id=0)
    assert tree.tokens.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert tree.acceptable.tolist() == [[True, True, True], [True, False, False]]
    assert tree.depth.tolist() == [[0, 1, 2], [0, 1, 2]]  # padding continues the row as a chain
    assert tree.depth_is_index


@given(tree=trees(batch_size=2, max_nodes=12))
def test_derived_structure(tree):
    b, n = tree.tokens.shape
    for r in range(b):
        for t in range(n):
            # ancestors by walking parents
            chain, cur = [], t
            while cur >= 0:
                chain.append(cur)
                cur = int(tree.parents[r, cur])
            assert int(tree.depth[r, t]) == len(chain) - 1
            assert set(tree.ancestor_mask[r, t].nonzero().flatten().tolist()) == set(chain)
            anc = tree.ancestors(4)[r, t].tolist()
            assert tree._ancestors_tensor(4)[r, t].tolist() == anc  # the form used under torch.compile
            want = chain[:4] + [-(i + 1) for i in range(max(0, 4 - len(chain)))]
            assert anc == want
    last = torch.randint(0, n, (b,))
    path, lengths = tree.paths(last)
    for r in range(b):
        got = path[r, : lengths[r]].tolist()
        chain, cur = [], int(last[r])
        while cur >= 0:
            chain.append(cur)
            cur = int(tree.parents[r, cur])
        assert got == chain[::-1]


@given(tree=trees(batch_size=3, max_nodes=12), data=st.data())
def test_static_width_paths_equal_the_walked_paths(tree, data):
    """With a fixed width the paths are computed on the device (no host read of `last`: CUDA graphs, compiled
    steps); they equal the walked paths, padded with the last node (or cut) to the width."""
    b, n = tree.tokens.shape
    last = torch.tensor([data.draw(st.integers(0, n - 1)) for _ in range(b)])
    width = data.draw(st.integers(int(tree.depth[torch.arange(b), last].max()) + 1, n + 2))
    for path, lengths in (tree.paths(last, width), tree._static_paths(last, min(width, n))):
        assert path.shape == (b, min(width, n)) and path.dtype == torch.long
        for r in range(b):
            walked = tree.path_nodes(r, int(last[r]))
            assert int(lengths[r]) == len(walked)
            assert path[r].tolist() == (walked + [walked[-1]] * n)[: min(width, n)]


@given(tree=trees(batch_size=3, max_nodes=10))
def test_moving_a_tree_is_one_packed_transfer_of_every_field(tree):
    """`TokenTree.to` sends every tensor in one flat transfer (non-blocking from pinned memory on CUDA) and
    carries the host-side structure along: the copy equals the original field by field, dtypes included."""
    transfers = []
    moved = tree._moved(lambda flat: transfers.append(flat) or flat.clone())
    assert len(transfers) == 1
    for name in ("tokens", "parents", "acceptable", "depth", "ancestor_mask"):
        a, b = getattr(tree, name), getattr(moved, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert moved._parents_list == tree._parents_list and moved._tokens_list == tree._tokens_list
    assert torch.equal(moved.ancestors(3), tree.ancestors(3))
    assert tree.to(tree.tokens.device) is tree


@given(st.integers(1, 6))
def test_chain(n):
    tree = TokenTree.chain(torch.arange(n)[None])
    assert tree.depth.tolist() == [list(range(n))]


def test_one_node_trees_are_roots_as_the_general_construction_derives_them():
    """A plain decoding step's tree (a root per row) skips the per-row derivation: the same structure, the same
    checks, the same paths and verification as any tree."""
    from ssmspec.speculate.step.accept import greedy_accept

    roots = TokenTree.from_lists([[5], [7], [9]], [[-1], [-1], [-1]])
    padded = TokenTree.from_lists([[5, 1], [7], [9]], [[-1, 0], [-1], [-1]])  # the general path, 2 nodes per row
    assert roots.tokens.tolist() == [[5], [7], [9]] and roots.parents.tolist() == [[-1]] * 3
    assert roots.depth.tolist() == padded.depth[:, :1].tolist() and roots.depth.dtype == torch.long
    assert roots.ancestor_mask.tolist() == padded.ancestor_mask[:, :1, :1].tolist()
    assert roots.acceptable.tolist() == [[True]] * 3 and roots.depth_is_index
    path, lengths = roots.paths(torch.tensor([0, 0, 0]))
    assert path.tolist() == [[0]] * 3 and lengths.tolist() == [1, 1, 1]
    last, emitted = greedy_accept(roots, None, target=[[4], [6], [8]])
    assert last.tolist() == [0, 0, 0] and emitted == [[4], [6], [8]]
    logits = torch.zeros(3, 1, 10)
    logits[0, 0, 3] = logits[1, 0, 2] = logits[2, 0, 2] = logits[2, 0, 7] = 1.0  # row 2: a tie, the first wins
    assert greedy_accept(roots, logits)[1] == [[3], [2], [2]]
    with pytest.raises(InvalidTreeError, match="root"):
        TokenTree.from_lists([[5], [7]], [[-1], [0]])
    with pytest.raises(InvalidTreeError, match="as many parents"):
        TokenTree.from_lists([[5], [7]], [[-1], [-1, 0]])
    with pytest.raises(InvalidTreeError, match="at least its root"):
        TokenTree.from_lists([[5], []], [[-1], []])


def test_derived_makes_each_form_once_per_tree():
    tree = TokenTree.from_lists([[5, 6, 7], [8, 9]], [[-1, 0, 0], [-1, 0]])
    made = []

    def make():
        made.append(1)
        return torch.ones(1)

    first = tree.derived(("form", 1), make)
    assert tree.derived(("form", 1), make) is first and len(made) == 1
    tree.derived(("form", 2), make)
    assert len(made) == 2
    moved = tree._moved(lambda flat: flat.clone())  # a moved tree derives its own (its tensors are elsewhere)
    moved.derived(("form", 1), make)
    assert len(made) == 3


def test_a_verify_step_derives_the_tree_ops_masks_once_for_all_layers():
    """The tree SSD's masks and the tree conv's tap rows are made once per verify step (one tree), not per layer,
    and give the outputs of the ops that derive them per call (the reference ops)."""
    import copy

    import ssmspec
    from ssmspec.ops import conv as conv_ops
    from ssmspec.ops import ssd as ssd_ops
    from ssmspec.speculate.runner import ModelRunner
    from ssmspec.testing.configs import build_tiny_model

    model = ssmspec.transform(copy.deepcopy(build_tiny_model("mamba2", dtype=torch.float64)))
    assert model.config.num_hidden_layers > 1
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    tree = TokenTree.from_lists([[4, 9, 11, 12], [6, 7, 8]], [[-1, 0, 0, 1], [-1, 0, 1]])
    runner = ModelRunner(model)
    runner.prefill(ids, torch.ones_like(ids))
    calls = {"ssd": 0, "conv": 0}
    masks, taps = ssd_ops.ssd_masks, conv_ops.tap_index

    def count(kind, fn):
        def wrapped(*args):
            calls[kind] += 1
            return fn(*args)

        return wrapped

    snap = runner.snapshot()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ssd_ops, "ssd_masks", count("ssd", masks))
        mp.setattr(conv_ops, "tap_index", count("conv", taps))
        fast = runner.verify(runner.prepare(tree))
    runner.discard()
    assert calls == {"ssd": 1, "conv": 1}
    # the SSD masks (float64), the conv's taps and the nearest ancestors they were made from, one of each
    assert sorted(key[0] for key in tree._derived_tensors) == ["ancestors", "conv_taps", "ssd_masks"]
    # the same step through the ops themselves (the reference path every layer derives its own masks on)
    runner.restore(snap)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ssd_ops, "eager_reference", lambda x: False)
        mp.setattr(conv_ops, "eager_reference", lambda x: False)
        slow = runner.verify(
            runner.prepare(TokenTree.from_lists([[4, 9, 11, 12], [6, 7, 8]], [[-1, 0, 0, 1], [-1, 0, 1]]))
        )
    runner.discard()
    assert torch.equal(fast, slow)


@given(tree=trees(batch_size=3, max_nodes=12, vocab_size=3), data=st.data())
def test_the_device_greedy_walk_accepts_what_the_host_walk_accepts(tree, data):
    """`greedy_last` (tensor ops: a compiled step accepts on the device) against `greedy_accept`'s host walk, on trees
    with repeated sibling tokens (a vocabulary of 3), padding nodes and targets that mostly follow some child."""
    from ssmspec.speculate.step.accept import greedy_accept

    tree = tree.padded(tree.num_nodes + data.draw(st.integers(0, 3)))
    children = [[[c for c in range(tree.num_nodes) if p[c] == t] for t in range(tree.num_nodes)]
                for p in tree._parents_list]  # fmt: skip
    target = [[tree._tokens_list[b][data.draw(st.sampled_from(kids))] if kids and data.draw(st.booleans())
               else data.draw(st.integers(0, 2)) for kids in children[b]] for b in range(tree.batch_size)]  # fmt: skip
    want, _ = greedy_accept(tree, None, target=target)
    assert tree.greedy_last(torch.tensor(target)).tolist() == want.tolist()


def test_refilling_a_batch_of_chains_in_place_is_building_it_anew():
    """`refill_chains` writes other chains (any lengths up to the tree's nodes) into a batch of chains where it is:
    its tensors keep their addresses and equal those `from_lists` builds for the chains padded to its nodes; a tree that
    is not a batch of chains, or a chain too long, is refused."""
    tree = TokenTree.from_lists([[1, 2, 3, 4], [5, 6]], [[-1, 0, 1, 2], [-1, 0]])
    where = [t.data_ptr() for t in tree.tensors()]
    for chains in ([[7, 8], [9, 10, 11, 12]], [[3], [4, 5, 6]], [[1, 2, 3, 4], [5, 6, 7, 8]]):
        tree.refill_chains(chains)
        want = TokenTree.from_lists(chains, [list(range(-1, len(c) - 1)) for c in chains], num_nodes=4)
        assert [t.data_ptr() for t in tree.tensors()] == where
        for got, new in zip(tree.tensors(), want.tensors()):
            assert torch.equal(got, new)
        assert tree._tokens_list == want.tokens.tolist() and tree._acceptable_list == want.acceptable.tolist()
    with pytest.raises(InvalidTreeError, match="chain of 5 nodes"):
        tree.refill_chains([[1, 2, 3, 4, 5], [1]])
    with pytest.raises(InvalidTreeError, match="not a batch of chains"):
        TokenTree.from_lists([[1, 2, 3]], [[-1, 0, 0]]).refill_chains([[1, 2, 3]])
