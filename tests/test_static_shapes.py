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


@pytest.mark.parametrize("family,dynamic", [("mamba2", False), ("bamba", None)])
def test_compiled_verify_never_recompiles_with_static_shapes(family, dynamic):
    """mamba2: fully static (dynamic=False). bamba (attention + SSM): its K/V grows every step, so Dynamo
    marks that length dynamic after the first step; the tree dimension stays static through the buckets."""
    ref = cached_tiny_model(family, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])
    want = ref.generate(ids, max_new_tokens=520, do_sample=False, eos_token_id=None)
    model = ssmspec.transform(copy.deepcopy(ref))
    model.compile(backend="ssmspec", fullgraph=True, dynamic=dynamic, options={"inductor": False})
    torch._dynamo.reset()
    counters.clear()
    warm = _run(model, ids, want, seed=0, steps_tokens=100, static=True)
    assert {bucket(n) for n in warm.tree_nodes_per_step} == {1, 2, 4, 8}  # every bucket compiled once
    graphs = counters["stats"]["unique_graphs"]
    # prefill (twice for automatic dynamic shapes) + one verify graph per bucket + one commit graph per path
    # width (min(DEPTH + 1, bucket) for the multi-node buckets 2, 4, 8)
    assert graphs <= 2 + 4 + 3
    steps = _run(model, ids, want, seed=1, steps_tokens=500, static=True)
    assert steps.verify_steps >= 200 and len(set(steps.tree_nodes_per_step)) >= 6
    assert counters["stats"]["unique_graphs"] == graphs, "a verify step recompiled"
    if dynamic is None:  # automatic dynamic shapes already made every size dynamic: nothing left to see
        return
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
    fixed = {min(DEPTH + 1, b) for b in (2, 4, 8)}  # one path width per bucket, whatever was accepted
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
