"""Static-shape verification (what CUDA graphs need), tested on CPU: trees padded to power-of-two node counts
and commits over a fixed path length, so a verify step compiled with fullgraph=True compiles once per bucket
and never again over 200 steps of varying acceptance, with outputs identical to HF greedy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import ssmspec
from ssmspec.ops import _common as ops_common
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.runner import bucket
from ssmspec.testing.drafters import OracleDrafter
from ssmspec.testing.strategies import cached_tiny_model

DEPTH = 4


class Varying(OracleDrafter):
    """The reference continuation, right for a random number of tokens, with a random number of nodes (0 to
    the budget) and sometimes a wrong sibling first: acceptance and tree size change every step."""

    def propose(self, contexts, max_nodes, max_depth):
        self.right_prefix = self.rng.randint(0, max_depth)
        self.distractors = self.rng.randint(0, 1)
        return super().propose(contexts, self.rng.randint(0, max_nodes), max_depth)


def _run(model, ids, want, seed, steps_tokens, static):
    out, stats, _ = speculative_generate(
        model, ids, torch.ones_like(ids), max_new_tokens=steps_tokens, eos_token_ids=[], pad_token_id=0,
        drafter=Varying([want[0].tolist()], vocab_size=96, seed=seed), tree_budget=7, num_draft_tokens=DEPTH,
        static_shapes=static,
    )  # fmt: skip
    assert torch.equal(out, want[:, : ids.shape[1] + steps_tokens])
    return stats


@pytest.mark.parametrize("family", ["mamba2", "bamba", "lfm3"])
def test_compiled_verify_never_recompiles_with_static_shapes(family):
    """Fully static (dynamic=False): mamba2; bamba (attention + SSM) and lfm3 (full and sliding-window attention
    + short convs), whose K/V live in preallocated buffers written in place."""
    ref = cached_tiny_model(family, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])
    want = ref.generate(ids, max_new_tokens=520, do_sample=False, eos_token_id=None)
    model = ssmspec.transform(copy.deepcopy(ref))
    model.compile(backend="ssmspec", fullgraph=True, dynamic=False, options={"inductor": False})
    torch._dynamo.reset()
    counters.clear()
    warm = _run(model, ids, want, seed=0, steps_tokens=500, static=True)
    assert {bucket(n) for n in warm.tree_nodes_per_step} == {1, 2, 4, 8}  # every bucket compiled once
    graphs = counters["stats"]["unique_graphs"]
    # prefill + one verify graph per bucket + one commit graph per path width (min(DEPTH + 1, bucket) for the
    # multi-node buckets 2, 4, 8)
    assert graphs <= 1 + 4 + 3
    steps = _run(model, ids, want, seed=1, steps_tokens=500, static=True)
    assert steps.verify_steps >= 200 and len(set(steps.tree_nodes_per_step)) >= 6
    assert counters["stats"]["unique_graphs"] == graphs, "a verify step recompiled"
    # the same run without static shapes compiles a graph per tree size: the counter does see recompiles
    try:
        _run(model, ids, want, seed=1, steps_tokens=60, static=False)
    except torch._dynamo.exc.FailOnRecompileLimitHit:  # fullgraph=True: too many recompiles is an error
        return
    assert counters["stats"]["unique_graphs"] > graphs


def test_static_commits_replay_a_fixed_path_length(monkeypatch):
    """The replayed path length depends on the tree's bucket only: min(num_draft_tokens + 1, bucket)."""
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    want = ref.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None)
    widths = set()
    commits = dict(ops_common.COMMITS)

    def spy(kind):
        def commit(items, path, lengths, last):
            widths.add(path.shape[1])
            return commits[kind](items, path, lengths, last)

        return commit

    for kind in commits:
        monkeypatch.setitem(ops_common.COMMITS, kind, spy(kind))
    _run(model, ids, want, seed=2, steps_tokens=60, static=True)
    # one path width per bucket, whatever was accepted (bucket 1: one-node steps, where they take the tree path)
    fixed = {min(DEPTH + 1, b) for b in (1, 2, 4, 8)}
    assert widths <= fixed and DEPTH + 1 in widths
    widths.clear()
    _run(model, ids, want, seed=2, steps_tokens=60, static=False)
    assert not widths <= fixed  # without static shapes the width follows the longest accepted path


def test_compiling_turns_static_shapes_on():
    """Any compiled model verifies with static shapes by default (else every new tree size recompiles)."""
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2", dtype=torch.float32)))
    assert not getattr(model, "ssmspec_static_shapes", False)
    model.compile(backend="ssmspec", mode="reduce-overhead")
    assert model.ssmspec_static_shapes
    model.compile(backend="ssmspec")
    assert model.ssmspec_static_shapes
    with pytest.raises(TypeError, match="static_shapes"):
        ssmspec.SpecConfig(static_shapes="yes")


def _buffers(cache) -> dict[str, tuple[int, tuple]]:
    """Address and shape of every tensor a step reads or writes: conv/recurrent states and attention K/V."""
    from ssmspec.hf import layers as hf_layers

    out = {}
    for i, layer in enumerate(cache.layers):
        for name, states in hf_layers.state_dicts(layer).items():
            out.update({f"{i}.{name}.{k}": (t.data_ptr(), tuple(t.shape)) for k, t in states.items() if t is not None})
        if i in cache.attention_layers():
            for name, t in zip(("keys", "values"), hf_layers.kv(layer)):
                out[f"{i}.{name}"] = (t.data_ptr(), tuple(t.shape))
    return out


@pytest.mark.parametrize("family", ["bamba", "lfm3", "qwen3_next"])
def test_static_shapes_keep_every_buffer_in_place(family, monkeypatch):
    """What CUDA graphs need, checked on CPU: from the prefill on, every conv/recurrent state and every attention
    K/V buffer keeps its shape and address through the steps of varying trees (a left-padded batch, decode
    steps too), updated in place; the tokens equal HF greedy, and each row's committed K/V equal those of eager
    verification (static_shapes=False: buffers sized for the call, attention over the slots in use)."""
    from ssmspec.speculate.runner import ModelRunner

    ref = cached_tiny_model(family, dtype=torch.float64)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 0, 0, 9, 10, 11, 9, 10, 11, 9]])
    mask = (torch.arange(10) >= torch.tensor([[0], [3]])).long()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, eos_token_id=None,
                        pad_token_id=0)  # fmt: skip
    real = [w[torch.cat([m.bool(), torch.ones(60, dtype=torch.bool)])].tolist() for w, m in zip(want, mask)]
    model = ssmspec.transform(copy.deepcopy(ref))
    after_prefill = []
    prefill = ModelRunner.prefill

    def spy(runner, *args, **kwargs):
        out = prefill(runner, *args, **kwargs)
        after_prefill.append(_buffers(runner.cache))
        return out

    monkeypatch.setattr(ModelRunner, "prefill", spy)
    runners = {}
    for static in (True, False):
        out, stats, runners[static] = speculative_generate(
            model, ids, mask, max_new_tokens=60, eos_token_ids=[], pad_token_id=0,
            drafter=Varying(real, vocab_size=96, seed=3), tree_budget=7, num_draft_tokens=DEPTH,
            static_shapes=static,
        )  # fmt: skip
        assert torch.equal(out, want)
    assert stats.verify_steps >= 20 and 1 in stats.tree_nodes_per_step  # trees and decode steps
    cache = runners[True].cache
    # eager verification keeps K/V in buffers too, grown in place, its attention reading only the slots in use; a
    # model with sliding-window layers keeps HF's layout there (its window, not every slot)
    eager, windowed = runners[False].cache, any(w is not None for w in cache.windows())
    assert cache.static_kv and not cache.views and eager.static_kv != windowed and eager.views
    assert _buffers(cache) == after_prefill[0]
    for a in cache.attention:
        for row in range(2):
            for s, d in zip(cache.committed_kv(a.index, row), runners[False].cache.committed_kv(a.index, row)):
                assert s.shape == d.shape and torch.allclose(s, d, atol=1e-10)
