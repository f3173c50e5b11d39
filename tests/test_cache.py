"""SpecCache: verification never touches committed state; discard and snapshot/restore roll back exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import ssmspec
from ssmspec.speculate.runner import ModelRunner
from ssmspec.testing.strategies import cached_tiny_model
from ssmspec.tree import TokenTree


def _states(cache):
    """Every committed state: conv and recurrent states, and the K/V of each row's committed slots (the slots of
    static K/V buffers beyond them hold whatever a step wrote there, never read)."""
    out = []
    for layer in cache.layers:
        for name in ("conv_states", "recurrent_states"):
            out += [t.clone() for t in getattr(layer, name, {}).values() if t is not None]
    for index in cache.attention_layers():
        for row in range(cache.n_real.shape[0]):
            out += [t.clone() for t in cache.committed_kv(index, row)]
    return out


@pytest.mark.parametrize("family", ["mamba", "bamba", "qwen3_next", "lfm2"])
def test_verify_then_discard_or_restore_is_a_no_op(family):
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model(family)))
    runner = ModelRunner(model)
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    runner.prefill(ids, torch.ones_like(ids))
    before = _states(runner.cache)
    tree = TokenTree.from_lists([[5, 6, 7, 8], [9, 10]], [[-1, 0, 0, 1], [-1, 0]])
    logits = runner.verify(tree)
    assert logits.shape[:2] == (2, 4)
    runner.discard()
    for a, b in zip(before, _states(runner.cache)):
        assert torch.equal(a, b)
    snap = runner.snapshot()
    runner.verify(tree)
    runner.commit(torch.tensor([3, 1]))
    runner.restore(snap)
    for a, b in zip(before, _states(runner.cache)):
        assert torch.equal(a, b)


def test_commit_strategy_is_validated():
    with pytest.raises(ValueError, match="commit strategy"):
        ssmspec.SpecCache(cached_tiny_model("mamba2").config, commit="nope")


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_layer_by_layer_replay_equals_batched_replay(family, monkeypatch):
    """Commit replays small SSD states in one batched call and big ones layer by layer: same result."""
    import ssmspec.ops.ssd as ssd_module

    ref = cached_tiny_model(family)
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    want = ref.generate(ids, max_new_tokens=10, do_sample=False)
    model = ssmspec.transform(copy.deepcopy(ref))
    spec = ssmspec.SpecConfig(tree=True, num_draft_tokens=3)
    batched = model.generate(ids, max_new_tokens=10, speculation=spec)
    monkeypatch.setattr(ssd_module, "BATCH_REPLAY_MAX_STATE", 0)
    assert torch.equal(model.generate(ids, max_new_tokens=10, speculation=spec), batched)
    assert torch.equal(batched, want)


@pytest.mark.parametrize("family", ["bamba", "lfm3"])
@pytest.mark.parametrize("static_kv", [None, False])
def test_batched_attention_slots_stay_bounded(family, static_kv):
    """Rows accept different lengths every step; the slots of rejected drafts used to stay forever (bamba-hybrid,
    batch 4 x 3,000 tokens: up to 5,395 slots per row for at most 3,730 real). After every commit each row holds
    exactly its own tokens: in HF's layout right-aligned, no wider than the longest row; in static K/V buffers (the
    default in eager mode: grown in place) at its own slots, the attention reading no further than the longest row's
    and the buffers never grown past what the call asked for."""
    import random

    from ssmspec.hf import layers as hf_layers

    model = ssmspec.transform(copy.deepcopy(cached_tiny_model(family, 2)))
    runner = ModelRunner(model, decode_single_nodes=False, static_kv=static_kv, capacity=240)
    ids = torch.randint(3, 96, (4, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[2, :3], mask[2, :3] = 0, 0
    runner.prefill(ids, mask)
    rng = random.Random(0)
    for _ in range(30):
        parents = [[-1] + [rng.randrange(t) for t in range(1, rng.randint(1, 7))] for _ in range(4)]
        tree = runner.prepare(TokenTree.from_lists([[5] * len(p) for p in parents], parents))
        runner.verify(tree)
        last = torch.tensor([rng.randrange(len(p)) for p in parents])
        runner.commit(last)
        cache = runner.cache
        # each row: its prompt's pads + its real tokens, as in HF's own cache for that row; nothing else
        assert (cache.block - cache.n_real).tolist() == [0, 0, 3, 0]
        if cache.static_kv:
            assert cache.visible(0) == int(cache.block.max()) and cache.valid.shape[1] == 9 + 240
            assert cache.valid.sum(1).tolist() == cache.n_real.tolist()
            assert all(hf_layers.kv_width(cache.layers[a.index]) == 9 + 240 for a in cache.attention)
            continue
        assert cache.valid.shape[1] == int(cache.block.max())
        assert cache.valid.sum(1).tolist() == [min(n, cache.valid.shape[1]) for n in cache.n_real.tolist()]
        for a in cache.attention:
            width = hf_layers.kv_width(cache.layers[a.index])
            assert width == (cache.valid.shape[1] if a.window is None else min(a.window - 1, cache.valid.shape[1]))


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_the_single_node_path_is_measured_once_and_leaves_the_cache_as_it_was(family):
    """decode_single_nodes=None: the first one-node step times HF's decode path against the tree path on the
    runner's own cache (each trial rolled back), remembers the choice on the model, and steps exactly."""
    ref = cached_tiny_model(family)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    outs = {}
    for choice in (None, True, False):
        runner = ModelRunner(model, decode_single_nodes=choice)
        runner.prefill(ids, torch.ones_like(ids))
        before = _states(runner.cache)
        if choice is None:
            path = runner.single_node_path(repeats=1)
            assert isinstance(path, bool) and runner.decode_single_nodes is None
            assert model.__dict__["_ssmspec_single_node_path"] == {(1, runner.dtype, "cpu", False): path}
            for a, b in zip(before, _states(runner.cache)):
                assert torch.equal(a, b)
        steps = []
        for token in (11, 12, 13):
            steps.append(runner.verify(TokenTree.chain(torch.tensor([[token]]))))
            runner.commit(torch.tensor([0]))
        assert runner.decode_single_nodes == (path if choice is None else choice)
        outs[choice] = torch.cat(steps, 1)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[None], outs[path])


@pytest.mark.parametrize("family", ["mamba2", "bamba", "zamba", "falcon_h1", "lfm2", "qwen3_next", "mamba"])
def test_one_node_steps_verified_in_place_equal_recorded_commits(family):
    """A one-node tree is always accepted: verified in place (SSD and conv windows advanced as the forward runs,
    nothing recorded for them) it leaves the same logits and committed states as the tree path's records and
    commit, between and after branching steps, on a left-padded batch (float64); such a step cannot be
    discarded, and `tree_path()` still gives a discardable one."""
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model(family)))
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    recorded, in_place = (ModelRunner(model, decode_single_nodes=False) for _ in range(2))
    recorded.in_place_single_nodes = False
    assert in_place.in_place_single_nodes
    for runner in (recorded, in_place):
        runner.prefill(ids, mask)
    branching = TokenTree.from_lists([[5, 6, 7, 8], [9, 10]], [[-1, 0, 0, 1], [-1, 0]])
    steps = [([[11], [12]], None), ([[13], [14]], None), (branching, [3, 1]), ([[15], [16]], None)]
    records = 0
    for tokens, last in steps:
        tree = tokens if last is not None else TokenTree.chain(torch.tensor(tokens))
        out = []
        for runner in (recorded, in_place):
            out.append(runner.verify(runner.prepare(tree)))
            if runner is in_place and last is None:
                records += len(runner._pending[1].records)
            runner.commit(torch.tensor(last or [0, 0]))
        torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-10)
    for a, b in zip(_states(recorded.cache), _states(in_place.cache)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
    if family in ("mamba2", "bamba", "falcon_h1"):  # SSD and conv layers only record nothing (attention: no state)
        assert records == 0
    before = _states(in_place.cache)
    with in_place.tree_path():
        in_place.verify(TokenTree.chain(torch.tensor([[17], [18]])))
        in_place.discard()
    for a, b in zip(before, _states(in_place.cache)):
        assert torch.equal(a, b)
    in_place.verify(TokenTree.chain(torch.tensor([[17], [18]])))
    with pytest.raises(RuntimeError, match="cannot be discarded"):
        in_place.discard()


def test_a_state_updated_twice_in_one_forward_is_refused_recorded_or_in_place():
    """A mixer that calls a seam twice per forward on one state would read, the second time, what the first wrote
    (in place) or leave two records: refused either way, naming the seam."""
    from ssmspec.errors import UnsupportedModelError

    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2")))
    runner = ModelRunner(model)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(4))
    runner.prefill(ids, torch.ones_like(ids))
    for in_place in (True, False):
        with runner.cache.verifying(TokenTree.chain(torch.tensor([[7]])), in_place=in_place) as verification:
            verification.claim("layer 0", "mamba_chunk_scan_combined", 0, 0, False, None)
            verification.claim("layer 0", "update_conv_state", 0, 0, True, None)  # another state: fine
            with pytest.raises(UnsupportedModelError, match="mamba_chunk_scan_combined` more than once"):
                verification.claim("layer 0", "mamba_chunk_scan_combined", 0, 0, False, None)
        verification.discard()


def test_kv_slots_are_written_and_moved_in_place():
    """write_slots and move_slots against a loop over rows: each row's slots written, the accepted nodes moved down
    (every path entry read before any is written), in place: the caller's own tensor holds the result (nothing is
    returned)."""
    from ssmspec.verification import move_slots, write_slots

    torch.manual_seed(0)
    buf = torch.randn(2, 3, 10, 4)
    want = buf.clone()
    slots = torch.tensor([[4, 5, 6], [1, 2, 3]])
    new = torch.randn(2, 3, 3, 4)
    for b in range(2):
        want[b, :, slots[b]] = new[b]
    assert write_slots(buf, slots, new) is None
    assert torch.equal(buf, want)
    block, path = torch.tensor([4, 1]), torch.tensor([[0, 2], [1, 0]])  # row 1 swaps its first two nodes
    moved = want.clone()
    for b in range(2):
        moved[b, :, block[b] + torch.arange(2)] = want[b, :, block[b] + path[b]]
    move_slots([buf], block, path)
    assert torch.equal(buf, moved)
