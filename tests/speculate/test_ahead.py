"""Saguaro (SpecConfig(ahead=...)): drafts prepared in a background thread are exactly the drafts the drafter
would have proposed, hits happen where the outcome is predictable, outputs equal HF greedy (and sampling draws
the same tokens as without it), the thread is gone after generate, and wrong settings are refused by name."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import ssmspec
from ssmspec.speculate.drafters import NoDrafter, PromptLookupDrafter
from ssmspec.speculate.drafters.ahead import AheadDrafter
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.retrieval import SuffixIndex
from ssmspec.testing.distribution import tiny_sampling_setup
from ssmspec.testing.strategies import cached_tiny_model


class Checked(AheadDrafter):
    """Every proposal compared with a fresh drafter's proposal for the same context (no index, no thread)."""

    def __init__(self, base, fanout):
        super().__init__(base, fanout)
        self.compared = 0

    def propose(self, contexts, max_nodes, max_depth):
        out = super().propose(contexts, max_nodes, max_depth)
        for ctx, draft in zip(contexts, out):
            assert tuple(draft) == tuple(self.base.draft(list(ctx), max_nodes, max_depth)), ctx
            self.compared += 1
        return out


@pytest.mark.parametrize("family,tree,corpus", [("jamba", True, False), ("mamba2", False, True)])
def test_ahead_drafts_equal_the_drafters_and_outputs_equal_hf(family, tree, corpus):
    """jamba's tiny model repeats itself (context drafts), mamba2's does not: a corpus holds its output."""
    ref = cached_tiny_model(family, dtype=torch.float64)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4]])
    want = ref.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    index = SuffixIndex.from_sequences([want[0].tolist()[4:], want[1].tolist()[2:]]) if corpus else None
    drafter = Checked(PromptLookupDrafter(2, tree=tree, corpus=index), fanout=4)
    out, stats, _ = speculative_generate(
        ssmspec.transform(copy.deepcopy(ref)), ids, torch.ones_like(ids), max_new_tokens=40, eos_token_ids=[],
        pad_token_id=0, drafter=drafter, tree_budget=6, num_draft_tokens=4,
    )  # fmt: skip
    assert torch.equal(out, want)
    counters = stats.drafter
    assert drafter.compared == counters["proposals"] > 0
    assert counters["hits"] > 0, counters  # the hit path ran (and its drafts were checked above)
    assert counters["prepared"] >= counters["hits"] and 0 < counters["hit_rate"] <= 1
    assert counters["thread_s"] > 0 and counters["saved_s"] >= 0
    assert not [t for t in threading.enumerate() if t.name.startswith("ssmspec-ahead")]


def test_generate_with_ahead_equals_hf_and_reports_counters():
    ref = cached_tiny_model("bamba", dtype=torch.float64)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])
    want = ref.generate(ids, max_new_tokens=30, do_sample=False)
    model = ssmspec.transform(copy.deepcopy(ref))
    # a fixed depth: the adaptive one chooses plain steps from a cost curve timed on the machine, and asks the
    # drafter for a one-token shadow proposal on each (more proposals than verify steps, by the machine's load)
    out = model.generate(
        ids, max_new_tokens=30, return_dict_in_generate=True,
        speculation=ssmspec.SpecConfig(num_draft_tokens=4, tree=True, tree_budget=6, ahead=3, adaptive=False),
    )  # fmt: skip
    assert torch.equal(out.sequences, want)
    assert out.spec_stats["drafter"]["proposals"] == out.spec_stats["verify_steps"]


def test_sampling_with_ahead_draws_what_sampling_without_it_draws():
    """Ahead drafting returns the drafter's own drafts, so the same generator state gives the same tokens: the
    distribution is the one the prompt-lookup sampling tests prove equal to HF's."""
    target, _, prompt = tiny_sampling_setup()
    model = ssmspec.transform(copy.deepcopy(target))
    runs = []
    for ahead in (0, 3):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        # a fixed depth: an adaptive one follows the machine's timing, which no two runs share
        spec = ssmspec.SpecConfig(num_draft_tokens=3, tree=True, tree_budget=5, ahead=ahead, adaptive=False)
        runs.append(
            model.generate(
                prompt.repeat(4, 1),
                do_sample=True,
                max_new_tokens=12,
                generator=gen,
                speculation=spec,
                eos_token_id=None,
            )
        )
    assert torch.equal(runs[0], runs[1])


def test_ahead_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="ahead"):
        ssmspec.SpecConfig(drafter="none", ahead=2)
    with pytest.raises(ValueError, match="ahead"):
        ssmspec.SpecConfig(ahead=-1)
    with pytest.raises(TypeError, match="ahead"):
        ssmspec.SpecConfig(ahead=1.5)
    with pytest.raises(TypeError, match="NoDrafter"):
        AheadDrafter(NoDrafter())
    with pytest.raises(ValueError, match="fanout"):
        AheadDrafter(PromptLookupDrafter(2), fanout=0)


def test_a_failing_step_still_stops_the_thread(monkeypatch):
    ref = cached_tiny_model("mamba2", dtype=torch.float64)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    drafter = AheadDrafter(PromptLookupDrafter(2, tree=True), fanout=2)
    calls = {"n": 0}
    real = PromptLookupDrafter.continuations

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 6:
            raise RuntimeError("drafting failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PromptLookupDrafter, "continuations", failing)
    with pytest.raises(RuntimeError, match="drafting failed"):
        speculative_generate(
            model, ids, torch.ones_like(ids), max_new_tokens=30, eos_token_ids=[], pad_token_id=0, drafter=drafter,
            tree_budget=4, num_draft_tokens=3,
        )  # fmt: skip
    assert drafter._pool is None
    assert not [t for t in threading.enumerate() if t.name.startswith("ssmspec-ahead")]
