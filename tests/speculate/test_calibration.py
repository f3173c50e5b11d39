"""Calibration (ssmspec.speculate.calibration): bounded per call, accumulated across calls, completed before the first
step where decisions must not follow this call's timing, kept on disk per model and machine."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

import ssmspec
from ssmspec import SpecConfig
from ssmspec.speculate import calibration
from ssmspec.testing.strategies import cached_tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])


class _Clock:
    """A fake perf_counter: time passes only where a fake forward says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeRunner:
    """Verifies chains in `cost[n]` fake seconds (n nodes); nothing to roll back; one process."""

    n_real = torch.zeros(1, dtype=torch.long)
    agreement = SimpleNamespace(seconds=list, sharded=False)
    packed_sizes = None
    # (the runner contract's choices, ssmspec.speculate.step.Runner: none of them here)
    graphs = fuse_single_nodes = chooses_packing = chooses_single_node_path = prepack = False

    def __init__(self, clock: _Clock, cost: dict[int, float]) -> None:
        self.clock, self.cost, self.runs = clock, cost, []

    def prepare(self, tree):
        return tree

    def verify(self, tree):
        self.runs.append(tree.num_nodes)
        self.clock.now += self.cost[tree.num_nodes]

    def snapshot(self):
        return None

    def restore(self, snap):
        pass

    def commit(self, last):
        pass

    def discard(self):
        pass


def test_measuring_between_steps_spends_at_most_its_share_of_the_steps_time(monkeypatch):
    """Each step earns SHARE of its seconds; a measurement runs only where what it is expected to take fits what is
    earned and not yet spent, the most useful first (a plain step, the largest tree, the sizes between); short calls
    add up, and the calibration completes after enough steps."""
    clock = _Clock()
    monkeypatch.setattr(calibration.time, "perf_counter", clock)
    cost = {1: 1.0, 2: 1.2, 4: 1.3, 8: 1.6}
    runner = _FakeRunner(clock, cost)
    cal = calibration.Calibration(batch=1)
    cal.want([1, 2, 4, 8])
    spent, steps = 0.0, 0.0
    for _ in range(5):  # steps of 2 s: 0.8 s earned, nothing affordable yet (a plain step is expected to take 2 s)
        steps += 2.0
        spent += cal.measure_between_steps(runner, 2.0)
    assert spent == 0.0 and runner.runs == []
    while not cal.complete:
        steps += 2.0
        spent += cal.measure_between_steps(runner, 2.0)
        assert spent <= calibration.SHARE * steps + 1e-9  # never ahead of what the steps earned
    assert runner.runs[:4] == [1, 8, 4, 2]  # the warm-up round: a plain step, the largest tree, then the others
    assert len(runner.runs) == 4 * (1 + calibration.REPEATS)
    assert cal.curve() == pytest.approx(cost) and cal.decode_seconds() == pytest.approx(1.0)
    assert spent == pytest.approx(cal.spent) and cal.measure_between_steps(runner, 2.0) == 0.0


def test_until_measured_sizes_are_priced_by_the_prior_then_by_what_was_measured(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(calibration.time, "perf_counter", clock)
    runner = _FakeRunner(clock, {1: 1.0, 2: 1.2, 4: 1.3, 8: 1.6})
    cal = calibration.Calibration(batch=4)
    cal.want([1, 2, 4, 8])
    slope = calibration.PRIOR_SLOPE * 4**0.6
    assert cal.decode_seconds() is None and cal.curve() == pytest.approx({n: 1 + slope * (n - 1) for n in (1, 2, 4, 8)})
    cal.measure(runner, budget=4.9)  # warm-up runs of a plain step and the largest tree, then their timed runs
    assert runner.runs == [1, 8, 4, 2]
    cal.measure(runner, budget=2.7)
    assert cal.decode_seconds() == pytest.approx(1.0) and cal.curve()[8] == pytest.approx(1.6)
    assert cal.curve()[4] == pytest.approx(1.0 + 0.6 * 3 / 7)  # interpolated until measured


def test_a_greedy_call_measures_a_share_of_its_steps_and_reports_it():
    """The first call on a fresh model measures at most a share of its steps (between them, reported in spec_stats),
    gives HF's tokens, and the calls after it go on until the calibration is complete."""
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    want = ref.generate(IDS, max_new_tokens=40, do_sample=False)
    calls = []
    for _ in range(300):
        out = model.generate(IDS, max_new_tokens=40, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want)
        calls.append(out.spec_stats)
        if out.spec_stats["calibrated"]:
            break
    assert calls[-1]["calibrated"] and not calls[0]["calibrated"]
    assert all(c["calibration_seconds"] >= 0 for c in calls) and sum(c["calibration_seconds"] for c in calls) > 0
    out = model.generate(IDS, max_new_tokens=40, return_dict_in_generate=True)
    assert out.spec_stats["calibration_seconds"] == 0.0 and out.spec_stats["calibrated"]


def test_a_sampling_call_completes_the_calibration_before_its_first_step():
    """A seeded sampling call draws the same tokens on every call only if nothing this call measures moves its
    decisions: it completes the calibration first (once per model and machine), then samples."""
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2")))
    runs = []
    for _ in range(2):
        out = model.generate(IDS, do_sample=True, max_new_tokens=16, generator=torch.Generator().manual_seed(2),
                             return_dict_in_generate=True)  # fmt: skip
        runs.append(out)
    assert runs[0].spec_stats["calibrated"] and runs[0].spec_stats["calibration_seconds"] > 0
    assert runs[1].spec_stats["calibration_seconds"] == 0.0
    assert torch.equal(runs[0].sequences, runs[1].sequences)


def test_calibrate_completes_it_on_demand_and_the_disk_keeps_it_for_the_next_process(tmp_path, monkeypatch):
    """`ssmspec.calibrate` measures everything at once; the calibration is written to the cache directory per model
    and machine, and a freshly transformed copy (as in a new process) starts from it and measures nothing. Another
    dtype is another calibration; an unreadable file is measured again; "off" keeps nothing."""
    monkeypatch.setenv(calibration.CALIBRATION_DIR, str(tmp_path))
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    first = ssmspec.transform(copy.deepcopy(ref))
    ssmspec.calibrate(first, IDS, max_new_tokens=4)
    assert first._ssmspec_calibration[(1, "cpu")].complete
    (file,) = (tmp_path / "calibration").glob("*.json")
    entry = json.loads(file.read_text())["entries"]
    assert list(entry) == [json.dumps([1, "cpu"])]
    fresh = ssmspec.transform(copy.deepcopy(ref))
    out = fresh.generate(IDS, max_new_tokens=24, return_dict_in_generate=True)
    assert out.spec_stats["calibrated"] and out.spec_stats["calibration_seconds"] == 0.0
    assert fresh._ssmspec_calibration[(1, "cpu")].curve() == first._ssmspec_calibration[(1, "cpu")].curve()
    other = ssmspec.transform(copy.deepcopy(ref).double())  # another dtype: not this calibration
    assert not other.generate(IDS, max_new_tokens=4, return_dict_in_generate=True).spec_stats["calibrated"]
    file.write_text("{not json")
    broken = ssmspec.transform(copy.deepcopy(ref))
    assert not broken.generate(IDS, max_new_tokens=4, return_dict_in_generate=True).spec_stats["calibrated"]
    monkeypatch.setenv(calibration.CALIBRATION_DIR, "off")
    assert calibration.directory() is None
    with pytest.raises(TypeError, match="transformed"):
        ssmspec.calibrate(ref, IDS)


def test_a_fixed_calibration_is_used_as_given_and_never_measured():
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2")))
    fixed = calibration.fixed(model, 1, {2: 1.5, 32: 3.0}, decode_seconds=0.002)
    out = model.generate(IDS, max_new_tokens=24, speculation=SpecConfig(num_draft_tokens=4, tree_budget=8),
                         return_dict_in_generate=True)  # fmt: skip
    assert out.spec_stats["calibrated"] and out.spec_stats["calibration_seconds"] == 0.0
    assert model._ssmspec_calibration[(1, "cpu")] is fixed
    assert fixed.curve() == {1: 1.0, 2: 1.5, 32: 3.0} and fixed.decode_seconds() == 0.002


def test_a_models_calibration_is_read_through_the_public_accessor(tmp_path, monkeypatch):
    """`ssmspec.calibration_of(model, batch, device)` is the calibration a call of that batch size kept on the model
    (what its steps were priced with), None before any call, and one of its own per batch size."""
    monkeypatch.setenv(calibration.CALIBRATION_DIR, str(tmp_path))
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2")))
    assert ssmspec.calibration_of(model) is None
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    ssmspec.calibrate(model, ids, max_new_tokens=8, speculation=SpecConfig(drafter="prompt_lookup", tree_budget=4))
    kept = ssmspec.calibration_of(model, batch=1, device="cpu")
    assert kept is model.__dict__["_ssmspec_calibration"][(1, "cpu")] and kept.complete
    assert sorted(kept.curve()) == sorted(kept.sizes) and kept.decode_seconds() > 0
    assert ssmspec.calibration_of(model, batch=2) is None
    fixed = calibration.fixed(model, 2, {1: 1.0, 4: 1.5})
    assert ssmspec.calibration_of(model, batch=2, device=torch.device("cpu")) is fixed
    generic = calibration.fixed(model, 1, {1: 1.0, 4: 2.0}, path="generic")
    assert ssmspec.calibration_of(model, path="generic") is generic and ssmspec.calibration_of(model) is kept
