"""Verify-step memory: the buffers a step holds are measured and reported, SpecConfig.verify_memory cuts trees to
what fits, and a step that runs out of memory is retried with a smaller tree; outputs stay HF's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import ssmspec
import ssmspec.speculate.plan as spec_plan
from ssmspec.speculate import calibration
from ssmspec.speculate.runner import ModelRunner
from ssmspec.testing.drafters import OracleDrafter
from ssmspec.testing.strategies import cached_tiny_model


def _run(family, monkeypatch, verify=None, **spec):
    """HF greedy and the speculative output on two prompts, every step drafting a full tree: an oracle that knows
    HF's continuation, with distractor branches. `verify`: ModelRunner.verify from after the transform on."""
    ref = cached_tiny_model(family)
    model = ssmspec.transform(copy.deepcopy(ref))
    if verify is not None:
        monkeypatch.setattr(ModelRunner, "verify", verify)
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    want = ref.generate(ids, max_new_tokens=20, do_sample=False)
    oracle = OracleDrafter([r.tolist() for r in want], vocab_size=96, distractors=2)
    monkeypatch.setattr(spec_plan, "build_drafter", lambda *a, **k: oracle)
    spec = {"adaptive": False, **spec}
    config = ssmspec.SpecConfig(drafter="prompt_lookup", tree_budget=12, num_draft_tokens=6, **spec)
    out = model.generate(ids, max_new_tokens=20, speculation=config, return_dict_in_generate=True)
    return want, out


def _room_for(nodes: int, calls: list[int]):
    """ModelRunner.verify where a tree of more than `nodes` nodes per row runs out of memory; each tree's node count
    is appended to `calls`."""
    verify = ModelRunner.verify

    def tight(self, tree):
        calls.append(tree.num_nodes)
        if tree.num_nodes > nodes:
            raise torch.OutOfMemoryError("simulated: no room for the tree's buffers")
        return verify(self, tree)

    return tight


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_verify_memory_budget_cuts_trees_and_keeps_outputs(family, monkeypatch):
    want, free = _run(family, monkeypatch)
    assert torch.equal(free.sequences, want)
    nodes = max(free.spec_stats["tree_nodes_per_step"])
    held = free.spec_stats["max_verify_bytes"]
    assert held > 0 and nodes > 3
    budget = int(held / nodes * 3)  # what 3 nodes per row hold (both rows), as the largest step measured
    want, capped = _run(family, monkeypatch, verify_memory=budget)
    assert torch.equal(capped.sequences, want)
    steps = capped.spec_stats["tree_nodes_per_step"]
    assert steps[0] > 3 and max(steps[1:]) <= 3  # the first step measures what a node holds; the rest fit
    assert 0 < capped.spec_stats["max_verify_bytes"]


def test_out_of_memory_on_a_verify_step_retries_with_a_smaller_tree(monkeypatch):
    calls = []
    tight = _room_for(4, calls)

    want, out = _run("bamba", monkeypatch, verify=tight)
    assert torch.equal(out.sequences, want)
    assert out.spec_stats["out_of_memory"] >= 1
    assert max(out.spec_stats["tree_nodes_per_step"]) <= 4  # the steps after keep the size that fitted
    # halved until it fitted (13 -> 6 -> 3 nodes), in the first step only: never tried again
    failed = [i for i, n in enumerate(calls) if n > 4]
    assert len(failed) == out.spec_stats["out_of_memory"] and failed == list(range(len(failed)))


def test_calibration_between_steps_stays_below_what_ran_out_of_memory(monkeypatch):
    """Measuring between steps (here given all the time it wants) times sizes no step has verified yet: one that runs
    out of memory is rolled back and dropped with every larger one, the call's steps stay below it, a cap a step
    found keeps the calibration below it too, and the output stays HF's."""
    calls = []
    tight = _room_for(4, calls)

    monkeypatch.setattr(calibration, "SHARE", 1e9)  # every measurement runs between the first two steps
    monkeypatch.setenv(calibration.CALIBRATION_DIR, "off")
    want, out = _run("bamba", monkeypatch, verify=tight, adaptive=True)
    assert torch.equal(out.sequences, want)
    assert max(out.spec_stats["tree_nodes_per_step"]) <= 4
    # each size too large tried once, by a step (counted: it halves) or by the calibration (which drops it and every
    # larger size), never again
    failed = [n for n in calls if n > 4]
    assert failed and len(set(failed)) == len(failed)


def test_calibration_rolls_back_a_measurement_that_runs_out_of_memory():
    rolled = []

    class Runner:
        n_real = torch.zeros(1, dtype=torch.long)
        agreement = SimpleNamespace(seconds=list)
        # (the runner contract's choices, ssmspec.speculate.step.Runner: none of them here)
        graphs = fuse_single_nodes = chooses_packing = chooses_single_node_path = prepack = False

        def prepare(self, tree):
            return tree

        def verify(self, tree):
            if tree.num_nodes > 4:
                raise torch.OutOfMemoryError("simulated")

        def discard(self):
            rolled.append("discard")

        def snapshot(self):
            return "snap"

        def restore(self, snap):
            rolled.append(snap)

        def commit(self, tokens):
            pass

    cal = calibration.Calibration(batch=1)
    cal.want([2, 4, 8, 16])
    cal.measure(Runner())
    assert cal.out_of_memory == 8 and cal.sizes == {1, 2, 4} and cal.complete
    assert all(item[0] != "size" or item[1] <= 4 for item in cal.best)
    # every run rolled back: a one-node step from its snapshot, a chain discarded, the failed ones too (16, then 8:
    # the largest size is measured first), each tried once
    runs = 1 + calibration.REPEATS
    assert rolled.count("snap") == runs and rolled.count("discard") == 2 * runs + 2


def test_out_of_memory_down_to_a_plain_step_is_raised(monkeypatch):
    def full(self, tree):
        raise torch.OutOfMemoryError("simulated: no memory at all")

    with pytest.raises(torch.OutOfMemoryError):
        _run("mamba2", monkeypatch, verify=full)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-5, ValueError), ("1GB", TypeError), (1.5, TypeError)])
def test_verify_memory_is_validated(value, error):
    with pytest.raises(error, match="verify_memory"):
        ssmspec.SpecConfig(verify_memory=value)
