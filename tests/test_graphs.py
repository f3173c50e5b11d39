"""Captured verify steps (SpecConfig.graphs, ssmspec.compile.graphs), tested on CPU with the op tape that stands in
for CUDA graphs: a replay runs the recorded ops on the captured tensors and no Python, so a step that would be wrong
as a CUDA graph (a tensor replaced instead of updated, a host value baked in) is wrong here too."""

from __future__ import annotations

import copy

import pytest
import torch

import ssmspec
from ssmspec import SpecConfig
from ssmspec.compile.graphs import StepGraph
from ssmspec.errors import CaptureError, UnsupportedModelError
from ssmspec.hf import cache as hf_cache
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.runner import bucket
from ssmspec.static import capturing
from ssmspec.testing.configs import _MOE_FAMILIES, SUPPORTED_FAMILIES
from ssmspec.testing.drafters import OracleDrafter
from ssmspec.testing.strategies import cached_tiny_model

# the families whose trees are verified on static K/V buffers (Inkling's read positions from cache slots: refused)
CAPTURED = [f for f in SUPPORTED_FAMILIES if f not in ("inkling", "inkling2")]


class Varying(OracleDrafter):
    """The reference continuation, right for a random number of tokens, with a random number of nodes and sometimes a
    wrong sibling first: every step a different tree, so replays see trees their capture did not."""

    def propose(self, contexts, max_nodes, max_depth):
        self.right_prefix = self.rng.randint(0, max_depth)
        self.distractors = self.rng.randint(0, 1)
        return super().propose(contexts, self.rng.randint(0, max_nodes), max_depth)


def _model(family: str):
    ref = cached_tiny_model(family, dtype=torch.float64)
    if family in _MOE_FAMILIES:  # HF's eager experts read the host (which experts a batch routes to)
        ref = copy.deepcopy(ref)
        ref.set_experts_implementation("batched_mm")
    return ref


def _speculate(model, ids, want, tokens, graphs=True):
    return speculative_generate(
        model, ids, torch.ones_like(ids), max_new_tokens=tokens, eos_token_ids=[], pad_token_id=0,
        drafter=Varying([w.tolist() for w in want], vocab_size=96, seed=0), tree_budget=7, num_draft_tokens=4,
        static_shapes=True, graphs=graphs,
    )  # fmt: skip


IDS = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


@pytest.mark.parametrize("family", CAPTURED)
def test_captured_steps_equal_hf_greedy(family):
    """Every family (float64, a batch of two, a different tree each step): each bucket's verify step captured once,
    replayed for every later step of that bucket, output identical to HF greedy."""
    ref = _model(family)
    want = ref.generate(IDS, max_new_tokens=40, do_sample=False, eos_token_id=None)
    out, stats, runner = _speculate(ssmspec.transform(copy.deepcopy(ref)), IDS, want, 40)
    assert torch.equal(out, want)
    buckets = {bucket(n, 8) for n in stats.tree_nodes_per_step}
    assert len(runner.captured) == len(buckets)
    # each bucket's verify step, and the commit of each bucket committed twice or more
    commits = sum(entry.commit is not None for entry in runner.captured.values())
    assert runner.captures == len(buckets) + commits and commits >= 2
    assert sum(entry.graph.replays for entry in runner.captured.values()) == len(stats.tree_nodes_per_step) - len(
        buckets
    )
    assert max(entry.graph.replays for entry in runner.captured.values()) >= 3


def test_a_layout_replaced_between_steps_breaks_replays(monkeypatch):
    """The tape replays ops, not Python: a cache that replaced its layout tensors after each commit (as eager
    verification does) would leave the captured steps reading the first step's, and the output goes wrong. The
    in-place layout is what makes them right."""
    ref = _model("bamba")
    want = ref.generate(IDS, max_new_tokens=40, do_sample=False, eos_token_id=None)
    advance = hf_cache.SpecCache.advance_static

    def replacing(self, *args):
        self.in_place_layout = False
        return advance(self, *args)

    monkeypatch.setattr(hf_cache.SpecCache, "advance_static", replacing)
    out, _, _ = _speculate(ssmspec.transform(copy.deepcopy(ref)), IDS, want, 40)
    assert not torch.equal(out, want)


def test_step_graph_replays_ops_on_its_tensors():
    x, state = torch.arange(4.0), torch.zeros(4)
    seen = []

    def step():
        seen.append(capturing())
        state.add_(x)
        return (x * 2).sum()

    graph = StepGraph(torch.device("cpu"))
    out = graph.capture(step)
    assert seen == [True] and not capturing() and float(out) == 12.0
    x.copy_(torch.ones(4))
    assert graph.replay() is out and float(out) == 8.0  # the capture's output tensor, refreshed
    assert seen == [True]  # Python did not run again
    assert state.tolist() == [1.0, 2.0, 3.0, 4.0]  # the in-place update replayed on the same tensor
    with pytest.raises(RuntimeError, match="already captured"):
        graph.capture(step)


def test_a_host_read_is_refused_naming_the_op_and_the_caller():
    def step():
        return torch.ones(2) * torch.tensor(3.0).item()

    with pytest.raises(CaptureError, match=r"_local_scalar_dense.*test_graphs\.py:\d+ \(step\)"):
        StepGraph(torch.device("cpu")).capture(step)


def test_eager_experts_are_refused_with_advice():
    ref = cached_tiny_model("jamba", dtype=torch.float64)
    want = ref.generate(IDS, max_new_tokens=8, do_sample=False, eos_token_id=None)
    with pytest.raises(CaptureError, match=r"JambaForCausalLM: .*integrations/moe\.py.*set_experts_implementation"):
        _speculate(ssmspec.transform(copy.deepcopy(ref)), IDS, want, 8)


def test_generate_with_graphs_greedy_and_sampling():
    """Through `generate`: greedy identical to HF's; sampling (fixed draft sizes) draws the same tokens from the same
    seed as the uncaptured call, whose losslessness the sampling tests prove."""
    ref = cached_tiny_model("bamba", dtype=torch.float64)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = IDS[:1]
    want = ref.generate(ids, max_new_tokens=24, do_sample=False)
    out = model.generate(ids, max_new_tokens=24, speculation=SpecConfig(graphs=True), return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    drawn = []
    for graphs in (False, True):
        torch.manual_seed(3)
        spec = SpecConfig(drafter="prompt_lookup", graphs=graphs, adaptive=False)
        drawn.append(model.generate(ids, max_new_tokens=24, do_sample=True, temperature=0.7, speculation=spec))
    assert torch.equal(drawn[0], drawn[1])


def test_refusals_leave_nothing_behind():
    with pytest.raises(ValueError, match="static_shapes=False"):
        SpecConfig(graphs=True, static_shapes=False)
    with pytest.raises(ValueError, match="generic path"):
        SpecConfig(graphs=True, path="generic")
    with pytest.raises(TypeError, match="graphs must be a bool or None"):
        SpecConfig(graphs=1)
    ref = cached_tiny_model("inkling", dtype=torch.float64)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = IDS[:1]
    with pytest.raises(UnsupportedModelError, match="positions from cache slots"):
        model.generate(ids, max_new_tokens=8, speculation=SpecConfig(graphs=True, tree=False))
    want = ref.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=8, speculation=SpecConfig(tree=False)), want)


def test_a_padded_batch_with_eos_and_scores():
    """Left-padded rows, one stopping at EOS while the others go on (its pads decoded by the captured steps), scores
    kept across replays (each step's are copied out of the graph's outputs)."""
    ref = cached_tiny_model("bamba", dtype=torch.float64)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor(
        [[0, 0, 0, 5, 6, 7, 8, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 9, 8, 7, 9, 8, 7, 9, 8, 7, 9]]
    )
    mask = (ids != 0).long()
    mask[1] = 1
    free = ref.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0)
    eos = int(free[0, 11 + 8])  # a token row 0 emits mid-way: EOS for this call
    kw = {"max_new_tokens": 30, "eos_token_id": eos, "pad_token_id": 0, "output_scores": True,
          "return_dict_in_generate": True}  # fmt: skip
    want = ref.generate(ids, attention_mask=mask, do_sample=False, **kw)
    assert (want.sequences[:, -1] == 0).any()  # a row stopped early and decodes pads
    got = model.generate(ids, attention_mask=mask, speculation=SpecConfig(graphs=True), **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores)
    for a, b in zip(got.scores, want.scores):  # (float32 scores of float64 logits: one rounding apart at most)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
