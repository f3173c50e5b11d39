"""Saguaro with a draft model (DraftAheadDrafter): every proposal, hit or miss, equals the proposal of a twin
drafter that drafts each step itself; outputs equal HF greedy for chains, dynamic trees, VocabTrim and RASD;
hits happen where the outcome is predictable; sampling is refused; the thread never outlives generate."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import ssmspec
from ssmspec.errors import UnsupportedSettingError
from ssmspec.speculate.drafters import DraftModelDrafter, FusedDrafter, PromptLookupDrafter
from ssmspec.speculate.drafters.ahead import DraftAheadDrafter
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.retrieval import SuffixIndex
from ssmspec.testing.strategies import cached_tiny_model
from ssmspec.transform import prepare_draft


class Checked(DraftAheadDrafter):
    """Compares every proposal with the twin's, which proposes from the same contexts without drafting ahead."""

    def __init__(self, base, twin, fanout):
        super().__init__(base, fanout, fit=False)  # every step prepares: the hits and misses to compare
        self.twin, self.compared = twin, 0

    def set_decoding(self, decoding):
        super().set_decoding(decoding)
        self.twin.set_decoding(decoding)

    def start(self, input_ids, attention_mask):
        super().start(input_ids, attention_mask)
        self.twin.start(input_ids, attention_mask)

    def propose(self, contexts, max_nodes, max_depth):
        got = super().propose(contexts, max_nodes, max_depth)
        want = self.twin.propose(contexts, max_nodes, max_depth)
        assert [d[:2] for d in got] == [d[:2] for d in want]
        self.compared += 1
        return got


def _drafter(kind: str, draft, vocab: int, corpus=None):
    if kind == "chain":
        return DraftModelDrafter(prepare_draft(draft), vocab)
    if kind == "tree":
        return DraftModelDrafter(prepare_draft(draft), vocab, tree=True)
    if kind == "trimmed":
        return DraftModelDrafter(prepare_draft(draft), vocab, tree=True, vocab=torch.arange(vocab // 2))
    retrieval = PromptLookupDrafter(2, tree=True, corpus=corpus)
    return FusedDrafter(DraftModelDrafter(prepare_draft(draft), vocab, tree=True), retrieval)


@pytest.mark.parametrize("kind", ["chain", "tree", "trimmed", "rasd"])
@pytest.mark.parametrize("draft_family", ["mamba2", "lfm2"])
def test_every_proposal_is_the_drafts_own_and_output_is_hf_greedy(kind, draft_family):
    ref = cached_tiny_model("mamba2")
    vocab = ref.config.vocab_size
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 0, 9, 10, 11, 9, 10, 11, 9, 10]])
    mask = (ids != 0).long()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                        pad_token_id=0)  # fmt: skip
    corpus = SuffixIndex.from_sequences([w.tolist() for w in want]) if kind == "rasd" else None
    draft = cached_tiny_model(draft_family, 0, torch.float64, 5)
    drafter = Checked(_drafter(kind, draft, vocab, corpus), _drafter(kind, draft, vocab, corpus), fanout=2)
    out, stats, _ = speculative_generate(
        ssmspec.transform(copy.deepcopy(ref)), ids, mask, max_new_tokens=24, eos_token_ids=[], pad_token_id=0,
        drafter=drafter, tree_budget=6, num_draft_tokens=3,
    )  # fmt: skip
    assert torch.equal(out, want)
    assert drafter.compared == stats.verify_steps and stats.drafter["prepared"] > 0


def test_a_draft_that_agrees_with_the_target_hits():
    """The target as its own draft: the likeliest outcome (everything accepted, the draft's next token) is the
    real one once the calibration has seen the target accept what a random tiny model gives small q, so many
    drafts are ready (chains: most; a dynamic tree's many small steps: about half; misses: the first steps, the
    last ones, whose depth shrinks, and a tree's unsure branches), and they are still exactly the twin's."""
    ref = cached_tiny_model("mamba2")
    vocab = ref.config.vocab_size
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    want = ref.generate(ids, max_new_tokens=80, do_sample=False, eos_token_id=None)
    for kind in ("chain", "tree"):
        drafter = Checked(_drafter(kind, ref, vocab), _drafter(kind, ref, vocab), fanout=1)
        out, stats, _ = speculative_generate(
            ssmspec.transform(copy.deepcopy(ref)), ids, torch.ones_like(ids), max_new_tokens=80, eos_token_ids=[],
            pad_token_id=0, drafter=drafter, tree_budget=4, num_draft_tokens=4,
        )  # fmt: skip
        assert torch.equal(out, want)
        assert stats.drafter["hit_rate"] >= 0.4 and stats.drafter["hits"] >= 8, (kind, stats.drafter)


def test_generate_with_a_draft_model_ahead():
    ref = cached_tiny_model("mamba2")
    draft = cached_tiny_model("mamba2", 0, torch.float64, 5)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    want = ref.generate(ids, max_new_tokens=20, do_sample=False)
    model = ssmspec.transform(copy.deepcopy(ref))
    spec = ssmspec.SpecConfig(
        drafter="draft_model", tree=True, tree_budget=6, num_draft_tokens=3, ahead=2, adaptive=False
    )
    out = model.generate(ids, max_new_tokens=20, assistant_model=draft, speculation=spec,
                         return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, want)
    assert out.spec_stats["drafter"]["prepared"] > 0 and "hit_rate" in out.spec_stats["drafter"]
    with pytest.raises(UnsupportedSettingError, match="ahead"):
        model.generate(ids, max_new_tokens=5, assistant_model=draft, speculation=spec, do_sample=True)
    with pytest.raises(TypeError, match="draft model"):
        DraftAheadDrafter(PromptLookupDrafter(2))
    with pytest.raises(ValueError, match="fanout"):
        DraftAheadDrafter(DraftModelDrafter(prepare_draft(draft), ref.config.vocab_size), fanout=0)


def test_the_thread_prepares_only_what_fits_in_the_verification(monkeypatch):
    """A hypothesis that takes longer than the target's verification would make the next proposal wait: the
    thread then rests (trying one every 16th step); with time to spare it prepares up to `fanout`."""
    ref = cached_tiny_model("mamba2")
    draft = cached_tiny_model("mamba2", 0, torch.float64, 5)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    want = ref.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    prepared = {}
    for speed, slower in {"slow draft": 50.0, "fast draft": 0.001}.items():
        drafter = DraftAheadDrafter(DraftModelDrafter(prepare_draft(draft), ref.config.vocab_size), fanout=3)
        real = drafter._time
        # the thread's times, scaled: a draft `slower` times as slow as it is (the verification's as measured)
        monkeypatch.setattr(drafter, "_time", lambda key, s, real=real, k=slower: real(key, s * (k if key != "verify"
                                                                                               else 1.0)))  # fmt: skip
        out, stats, _ = speculative_generate(
            ssmspec.transform(copy.deepcopy(ref)), ids, torch.ones_like(ids), max_new_tokens=40, eos_token_ids=[],
            pad_token_id=0, drafter=drafter, tree_budget=4, num_draft_tokens=4,
        )  # fmt: skip
        assert torch.equal(out, want)
        prepared[speed] = stats.drafter
    slow, fast = prepared["slow draft"], prepared["fast draft"]
    assert slow["skipped"] >= slow["proposals"] - 3 and slow["prepared"] <= 3
    assert fast["skipped"] == 0 and fast["prepared"] >= 3 * (fast["proposals"] - 2)


def test_a_failing_step_still_stops_the_draft_thread(monkeypatch):
    ref = cached_tiny_model("mamba2")
    draft = cached_tiny_model("mamba2", 0, torch.float64, 5)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    drafter = DraftAheadDrafter(DraftModelDrafter(prepare_draft(draft), ref.config.vocab_size, tree=True), 2, False)
    calls = {"n": 0}
    real = DraftModelDrafter.node_logits

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("drafting failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DraftModelDrafter, "node_logits", failing)
    with pytest.raises(RuntimeError, match="drafting failed"):
        speculative_generate(
            ssmspec.transform(copy.deepcopy(ref)), ids, torch.ones_like(ids), max_new_tokens=30, eos_token_ids=[],
            pad_token_id=0, drafter=drafter, tree_budget=4, num_draft_tokens=3,
        )  # fmt: skip
    assert drafter._pool is None
    assert not [t for t in threading.enumerate() if t.name.startswith("ssmspec-draft-ahead")]
