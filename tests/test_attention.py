"""Attention during ssmspec's forwards (ssmspec.hf.attention, ssmspec.hf.cache): grouped key/value heads are read
without repeating them, plain forwards stay HF's, and eager K/V buffers grow in place."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa_module

import ssmspec
from ssmspec.hf import attention
from ssmspec.speculate.runner import ModelRunner
from ssmspec.testing.strategies import cached_tiny_model
from ssmspec.tree import TokenTree


class _Module(torch.nn.Module):
    num_key_value_groups = 3


@pytest.mark.parametrize("boolean", [True, False])
@pytest.mark.parametrize("limit", [attention.GROUPED_MASK_BYTES, 1])  # all groups in one call; one call each
def test_grouped_sdpa_equals_hfs_repeated_heads(boolean, limit, monkeypatch):
    """Each query head's rows attend to its key/value head's keys with the mask of its own query token: the same
    numbers as HF's SDPA over repeated heads (float64), for boolean and additive masks."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))
    allow = torch.rand(2, 1, 5, 11, generator=g) > 0.3
    allow[..., 0] = True
    mask = allow if boolean else torch.zeros(allow.shape, dtype=torch.float64).masked_fill(~allow, -1e300)
    module = _Module().eval()
    monkeypatch.setattr(attention, "GROUPED_MASK_BYTES", limit)
    want, _ = hf_sdpa_module.sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    grouped = attention.grouped_sdpa(hf_sdpa_module.sdpa_attention_forward)
    with attention.grouping():
        got, _ = grouped(module, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-12)
    calls = []
    passthrough = attention.grouped_sdpa(lambda *a, **kw: calls.append(1) or (None, None))
    passthrough(module, q, k, v, mask, scaling=0.3)  # outside ssmspec's forwards: HF's function
    with attention.grouping():
        passthrough(module, q[:, :, :1], k, v, mask[:, :, :1], scaling=0.3)  # one query token: HF's packing
    assert calls == [1, 1]


def test_verify_steps_read_grouped_heads_without_copies_and_plain_forwards_stay_hfs(monkeypatch):
    """A tree verify step on a grouped-query hybrid (Bamba: 4 query heads per key/value head in the tiny config's
    attention) never repeats the key/value heads (a full K/V copy per step and layer); HF's own forward of the same
    model still does, and the tokens are HF's."""
    ref = cached_tiny_model("bamba")
    model = ssmspec.transform(copy.deepcopy(ref))
    attn = next(m for m in model.modules() if getattr(m, "num_key_value_groups", 1) > 1)
    assert attn.config._attn_implementation == "sdpa"
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    repeats = []
    real = hf_sdpa_module.repeat_kv
    monkeypatch.setattr(hf_sdpa_module, "repeat_kv", lambda *a: repeats.append(1) or real(*a))
    out = model.generate(ids, max_new_tokens=12, speculation=ssmspec.SpecConfig(adaptive=False),
                         return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, want) and max(out.spec_stats["tree_nodes_per_step"]) > 1
    assert repeats == []
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    model(ids, attention_mask={"full_attention": mask, "linear_attention": None})  # a plain forward: HF's
    assert repeats


def test_eager_kv_buffers_grow_in_place_and_keep_every_committed_slot():
    """Eager verification writes K/V into buffers sized for the call (HF's layout concatenated them every step and
    the commit rewrote them): their addresses never change while they last; a step that would overflow them grows
    them by half, once, keeping every committed slot."""
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("bamba")))
    runner = ModelRunner(model, decode_single_nodes=False, capacity=12)
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    runner.prefill(ids, torch.ones_like(ids))
    cache = runner.cache
    assert cache.static_kv and cache.views

    def buffers():
        layers = [cache.layers[a.index] for a in cache.attention]
        return [(t.data_ptr(), t.shape[2]) for layer in layers for t in (layer.keys, layer.values)]

    first = buffers()
    assert all(width == 6 + 12 for _, width in first)
    for _ in range(4):  # 4 x 3 slots: within the 12
        tree = runner.prepare(TokenTree.from_lists([[5, 6, 7]] * 2, [[-1, 0, 1]] * 2))
        runner.verify(tree)
        runner.commit(torch.tensor([2, 2]))
        assert buffers() == first and cache.visible(0) == int(cache.block.max()) == 6 + 3 * (_ + 1)
    before = [[t.clone() for t in cache.committed_kv(a.index, r)] for a in cache.attention for r in range(2)]
    runner.verify(runner.prepare(TokenTree.from_lists([[5, 6, 7]] * 2, [[-1, 0, 1]] * 2)))  # 3 more: over 18
    runner.commit(torch.tensor([0, 0]))
    grown = buffers()
    assert all(ptr != old for (ptr, _), (old, _) in zip(grown, first)) and all(w == 27 for _, w in grown)
    after = [[t.clone() for t in cache.committed_kv(a.index, r)] for a in cache.attention for r in range(2)]
    for b, a in zip(before, after):
        assert all(torch.equal(x, y[:, : x.shape[1]]) for x, y in zip(b, a))


def test_a_finished_row_holds_its_slots_while_the_others_go_on():
    """A row that finished (EOS) computes nothing that is used any more: its K/V slots stop advancing (in eager
    buffers it took a slot a step until the batch's last row finished, and a long batch grew the buffers past what
    the call asked for); the tokens stay HF's."""
    from ssmspec.speculate.engine import speculative_generate
    from ssmspec.testing.drafters import OracleDrafter

    ref = cached_tiny_model("bamba")
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(3))
    free = ref.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    eos = int(free[0, 8 + 2])  # row 0's third token ends it
    assert eos not in free[1, 8:].tolist() + free[0, 8:10].tolist()
    want = ref.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    rows = [r.tolist() for r in free]
    out, _, runner = speculative_generate(
        model, ids, torch.ones_like(ids), max_new_tokens=30, eos_token_ids=[eos], pad_token_id=0,
        drafter=OracleDrafter(rows, vocab_size=96), tree_budget=1, num_draft_tokens=1,
    )  # fmt: skip
    assert torch.equal(out, want)
    cache = runner.cache
    assert cache.static_kv and int(cache.block[0]) <= 8 + 3  # held from the step it stopped in (15 steps before)
    assert int(cache.block[1]) >= 8 + 29 and cache.visible(0) == int(cache.block.max())
    assert int(cache.valid[0].sum()) == int(cache.n_real[0])
