"""Adaptive speculation: the depth follows acceptance and cost (0 = plain decoding when drafts fail), and the
output stays exactly HF's."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

import ssmspec
from ssmspec import SpecConfig
from ssmspec.speculate import adaptive, calibration, policy
from ssmspec.speculate.adaptive import Acceptance, best_depth, depth_gains, expected_tokens, rerun_cost, step_cost
from ssmspec.speculate.engine import speculative_generate
from ssmspec.testing.drafters import OracleDrafter, RandomDrafter
from ssmspec.testing.strategies import cached_tiny_model

COST = {1: 1.0, 2: 1.2, 4: 1.4, 8: 1.8, 16: 2.6}


def _choose_depth(*args, **kwargs) -> int:
    """The depth the engine picks from the acceptance model alone (no measurement overriding it)."""
    return best_depth(depth_gains(*args, **kwargs))


def test_depth_follows_acceptance_and_cost():
    assert _choose_depth([0.05], COST, 8, 1.0) == 0  # drafts fail: plain decoding
    assert _choose_depth([0.95], COST, 8, 1.0) == 8  # drafts succeed: as deep as allowed
    mid = _choose_depth([0.6], COST, 8, 1.0)
    assert 0 < mid < 8
    assert _choose_depth([0.6], {n: 1.0 for n in COST}, 8, 1.0) == 8  # free verification: always deepest
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert step_cost(COST, 3) == pytest.approx(1.3) and step_cost(COST, 32) == pytest.approx(4.2)
    # the generic path feeds the accepted prefix again after a rejection: priced, it drafts no deeper
    assert rerun_cost(1.0, 4, COST, 5) == 0.0 and rerun_cost(0.0, 4, COST, 4) == pytest.approx(1.5 - 1.4)
    assert rerun_cost(0.5, 2, COST, 2) == pytest.approx(0.5 * (1.3 - 1.2) + 0.25 * (1.4 - 1.2))
    assert _choose_depth([0.6], COST, 8, 1.0, reruns=True) <= mid
    knee = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.3, 16: 4.0}  # cheap up to 8 tokens, dear after: a carried prefix costs
    assert _choose_depth([0.7], knee, 8, 1.0) == 7 and _choose_depth([0.7], knee, 8, 1.0, reruns=True) == 4
    assert _choose_depth([0.999], COST, 8, 1.0, reruns=True) == 8
    # a row's rates follow its steps: after ten rejected drafts it decodes plainly, after ten accepted ones it drafts
    # as deep as allowed
    acc = Acceptance(1)
    for _ in range(10):
        acc.update(0, 4, 0)
    assert acc.rate(0) < 0.1 and _choose_depth([acc.survival(0, 4)], COST, 4, 1.0) == 0
    for _ in range(10):
        acc.update(0, 4, 4)
    assert acc.rate(0) > 0.8 and min(acc.level_rates(0, 4)) > 0.8
    assert _choose_depth([acc.survival(0, 4)], COST, 4, 1.0) == 4
    # a survival (P(at least j accepted)) prices a chain as the rate does where every level has that rate
    assert expected_tokens([0.5, 0.25], 2) == expected_tokens(0.5, 2)
    assert depth_gains([[0.5**j for j in range(1, 9)]], COST, 8, 1.0) == pytest.approx(depth_gains([0.5], COST, 8, 1.0))
    assert rerun_cost([0.5, 0.25], 2, COST, 2) == pytest.approx(rerun_cost(0.5, 2, COST, 2))


def test_acceptance_is_measured_level_by_level():
    """Drafts are accepted in runs: a draft that got past its first token goes on more often than first tokens are
    accepted. A row whose 6-deep drafts are rejected at once or accepted whole, half and half, gains 4 tokens a step:
    its first level is at 0.5 and deeper levels near 1. One rate per token (6 accepted of 7 tried) prices the chain
    at 4.6 tokens and a one-token draft at 1.86, not 1.5. Level by level the chain is priced at 3.4: the deeper
    levels, reached every other step, hold about 2.5 of the decayed trials, and each is pulled toward the prior by
    one more (0.86 for a level never rejected)."""
    acc = Acceptance(1)
    for step in range(40):
        acc.update(0, 6, 6 if step % 2 else 0)
    rates = acc.level_rates(0, 6)
    assert 0.3 < rates[0] < 0.7 and min(rates[1:]) > 0.85
    assert 3.2 < expected_tokens(acc.survival(0, 6), 6) <= 4.0
    assert expected_tokens(acc.survival(0, 1), 1) == pytest.approx(1.5, abs=0.2)
    assert expected_tokens(6 / 7, 6) > 4.5 and expected_tokens(6 / 7, 1) > 1.8  # one rate for every token
    # a level never reached is its prior's; a profile (a list) is a prior per level, its last for deeper levels
    assert Acceptance(1, prior=[0.9, 0.7]).level_rates(0, 3) == pytest.approx([0.9, 0.7, 0.7])
    # the call's profile: every level's rate over all of it (the next call's prior)
    profile = acc.profile()
    assert len(profile) == 6 and 0.3 < profile[0] < 0.7 and min(profile[1:]) > 0.85
    # rows pull toward the rates over all rows: a row with nothing measured takes the others'
    two = Acceptance(2)
    for _ in range(20):
        two.update(0, 4, 4)
    assert two.rate(1) > 0.8 and two.rate(1) < two.rate(0)
    # a plain step ages a row's own counts toward those rates (the run it was in may be over)
    lone = Acceptance(2)
    for _ in range(10):
        lone.update(0, 4, 0)
        lone.update(1, 4, 4)
    low = lone.rate(0)
    for _ in range(30):
        lone.elapse(0)
    assert lone.rate(0) > low + 0.2
    assert Acceptance(1).update(0, 0, 0) is None and Acceptance(1).level_rates(0, 2) == [0.5, 0.5]
    # one row: the batch's progress is the row's tokens
    assert lone.progress_survival([1], [0], 6) == pytest.approx(lone.survival(1, 6))


def test_one_row_is_pulled_toward_its_prior_once():
    """At batch 1 the rates over all rows are the row's own counts: pulled toward them, the row counted its steps
    twice, and two misses at a first level of prior 0.7 read 0.17 instead of about 0.35 (the 19.6M Nemotron-H's
    compiled default then decoded plainly where its head's chains paid: 1.02x against 1.23x ssmspec's plain
    decoding on held-out code). One row's rate is its counts pulled once toward the prior, as a batch's rates over
    all rows are."""
    acc = Acceptance(1, prior=0.7)
    acc.update(0, 3, 0)
    acc.update(0, 3, 0)
    trials = acc.decay + 1.0  # the first miss decayed once by the second
    w = Acceptance.ONE_ROW_WEIGHT
    assert acc.rate(0) == pytest.approx((0 + w * 0.7) / (trials + w)) and acc.rate(0) > 0.2
    # levels not reached yet keep their prior
    assert acc.level_rates(0, 3)[1:] == pytest.approx([0.7, 0.7])
    # with more rows a row is still pulled toward the rates over all of them
    two = Acceptance(2, prior=0.7)
    two.update(0, 3, 0)
    two.update(1, 3, 3)
    assert two.rate(0) < two._pooled(1)[0] < two.rate(1)


def test_a_few_failures_do_not_collapse_the_next_calls_deeper_levels():
    """A call's profile is the next call's prior. One that tried a third level seven times without success, weighed
    like a row's own counts, handed 0.11 on to that level and every deeper one; the next calls then drafted two
    levels deep and never measured the third again (held-out code: 1.20x ssmspec's plain decoding, 1.41x without).
    Now the call's prior counts as PROFILE_WEIGHT trials in its profile, and no level's prior falls below FLOOR times
    the level above's."""
    acc = Acceptance(1)  # a fresh prior: 0.5 per level
    for step in range(30):
        acc.update(0, 3, 2 if step < 7 else 1)  # levels 1 and 2 accepted; the third tried 7 times, never accepted
    profile = acc.profile()
    assert profile[2] >= 0.25  # weighed like a row's counts: (0 + 2 * 0.5) / (7 + 2) = 0.11
    assert profile[2] == pytest.approx((0 + Acceptance.PROFILE_WEIGHT * 0.5) / (7 + Acceptance.PROFILE_WEIGHT))
    # a profile that did collapse (the earlier code wrote these) is floored: the third level gets drafted again
    rates = Acceptance(1, prior=[0.78, 0.7, 0.11]).level_rates(0, 5)
    assert rates[:2] == pytest.approx([0.78, 0.7])
    assert rates[2:] == pytest.approx([Acceptance.FLOOR * 0.7] * 3)
    # profiles measured on held-out code are left as they are (their levels do not fall that fast)
    for healthy in ([0.84, 0.70, 0.62, 0.65, 0.78, 0.85], [0.28, 0.69, 0.75, 0.82, 0.88, 0.92]):
        assert Acceptance(1, prior=healthy).level_rates(0, 6) == pytest.approx(healthy)


def test_a_collapsed_profile_recovers_on_the_embedded_model():
    """End to end: the adaptive policy starting from a collapsed profile on a held-out prompt of repeated code (where
    the head's trees accept about 8 tokens a step) drafts deep again in that call; the earlier code stayed near 3
    tokens a step."""
    from ssmspec import bench, models

    ref, tok = models.load("mamba2-target")
    target = ssmspec.transform(ref)
    ids = bench.held_out_prompts(tok, 12, 96)[5]
    head = SpecConfig(drafter="draft_head")  # (the default's greedy drafter where the head is small)
    target.generate(ids, max_new_tokens=8, speculation=head)  # the cost curve and the profile's key
    (key,) = target._ssmspec_acceptance
    target._ssmspec_acceptance[key] = [0.65, 0.67, 0.11]
    out = target.generate(ids, max_new_tokens=128, return_dict_in_generate=True, speculation=head)
    assert out.spec_stats["mean_accepted_per_step"] > 5.0
    assert len(target._ssmspec_acceptance[key]) > 3


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_adaptive_output_is_hfs_and_depth_adapts(family, monkeypatch):
    ref = cached_tiny_model(family)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [0, 0, 0, 0, 9, 10, 11, 9, 10, 11, 9, 10]])
    mask = (ids != 0).long()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    for tree in (False, True):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=40,
                             speculation=SpecConfig(tree=tree, adaptive=True, num_draft_tokens=6))  # fmt: skip
        assert torch.equal(got, want)
    rows = [want[r][mask[r].bool().tolist() + [True] * 40].tolist() for r in range(2)]
    common = dict(max_new_tokens=40, eos_token_ids=[2], pad_token_id=0, tree_budget=6, num_draft_tokens=6)
    measured = model._ssmspec_calibration[(2, "cpu")].curve()  # measured (in part) by the generate calls above
    assert measured[1] == 1.0 and all(
        measured[a] <= measured[b] for a, b in zip(sorted(measured), sorted(measured)[1:])
    )
    # a fixed calibration (curve and a plain step's seconds) and no measured goodput: the decisions below are the
    # acceptance model's, whatever the timing (the measured plain step's seconds moved the overhead's prior once, and
    # a loaded machine drafted a level shallower: `assert 4 >= 5`)
    calibration.fixed(model, 2, COST, decode_seconds=0.01)
    monkeypatch.setattr(policy, "Goodput", Unmeasured)
    wrong, stats_wrong, _ = speculative_generate(model, ids, mask, drafter=RandomDrafter(96, chain=True),
                                                 adaptive=True, **common)  # fmt: skip
    right, stats_right, _ = speculative_generate(model, ids, mask, drafter=OracleDrafter(rows, vocab_size=96),
                                                 adaptive=True, **common)  # fmt: skip
    assert torch.equal(wrong, want[:, : wrong.shape[1]]) and torch.equal(right, want[:, : right.shape[1]])
    # random drafts: after a few failures the steps are plain decoding; an oracle: steps go deeper as its drafts pass
    # (two rows priced by their joint progress: a level both must pass, from the fresh prior of 0.5 per level)
    assert sum(n == 1 for n in stats_wrong.tree_nodes_per_step) > 0.7 * stats_wrong.verify_steps
    assert stats_right.mean_accepted_per_step > 3
    deep = stats_right.tree_nodes_per_step
    assert max(deep) >= 5 and max(deep[len(deep) // 2 :]) > max(deep[:2])
    assert set(model._ssmspec_calibration) == {(2, "cpu")}  # one calibration for this batch size


class Unmeasured(adaptive.Goodput):
    """Goodput that no timing moves (as when sampling)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "measured": False})


def test_adaptive_sampling_stays_lossless_by_construction():
    """The depth only changes which drafts are verified; sampling verification is unchanged (and its
    distribution tests cover every depth). Here: it runs and reproduces with a seed."""
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    spec = SpecConfig(adaptive=True)
    runs = [model.generate(ids, do_sample=True, max_new_tokens=20, speculation=spec,
                           generator=torch.Generator().manual_seed(3)) for _ in range(2)]  # fmt: skip
    assert torch.equal(runs[0], runs[1])


def test_the_calibrated_curve_is_non_decreasing_and_covers_only_what_calls_verify():
    """Sizes between measured ones are interpolated, beyond them priced on the prior's slope, and more nodes never cost
    less (timing noise aside); a call asks for the sizes its largest tree reaches, a later call with larger trees adds
    its own."""
    cal = calibration.Calibration(batch=1)
    cal.want([1, 2, 4, 8, 16])
    cal.best = {("node", None, None): 1.0, ("size", 2, None): 1.3, ("size", 8, None): 1.4}
    curve = cal.curve()
    assert curve[1] == 1.0 and curve[2] == pytest.approx(1.3) and curve[8] == pytest.approx(1.4)
    assert curve[4] == pytest.approx(1.3 + 0.1 * 2 / 6)
    assert curve[16] == pytest.approx(1.4 + 8 * calibration.PRIOR_SLOPE)
    cal.best[("size", 8, None)] = 1.1  # faster than 2 nodes (noise): never priced below it
    assert cal.curve()[8] == pytest.approx(1.3)  # (16 nodes: on the prior's slope from what 8 measured, floored)
    assert cal.curve()[16] == pytest.approx(max(1.3, 1.1 + 8 * calibration.PRIOR_SLOPE))
    assert calibration.Calibration(batch=4).curve()[1] == 1.0 and not calibration.Calibration().complete
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    model.generate(ids, max_new_tokens=6, speculation=SpecConfig(num_draft_tokens=2, tree_budget=3))
    assert sorted(model._ssmspec_calibration[(1, "cpu")].sizes) == [1, 2, 4]  # its largest tree: 4 nodes
    model.generate(ids, max_new_tokens=6, speculation=SpecConfig(num_draft_tokens=4, tree_budget=8))
    assert sorted(model._ssmspec_calibration[(1, "cpu")].sizes) == [1, 2, 4, 8, 9]  # extended to 9 nodes


class _FakeRunner:
    """A runner for `measure_cost` that only keeps time (subclasses say how long a verify takes): one row, nothing
    to roll back."""

    n_real = torch.zeros(1, dtype=torch.long)
    agreement = SimpleNamespace(seconds=list)  # one process: the times as measured
    # (the runner contract's choices, ssmspec.speculate.step.Runner: none of them here)
    graphs = fuse_single_nodes = chooses_packing = chooses_single_node_path = prepack = False

    def prepare(self, tree):
        return tree

    def choose(self, *, packed_sizes=..., single_node_path=...):  # (the calibration's choices, as ModelRunner's)
        if packed_sizes is not ...:
            self.packed_sizes = packed_sizes
        if single_node_path is not ...:
            self.decode_single_nodes = single_node_path

    def snapshot(self):
        return None

    def restore(self, snap):
        pass

    def commit(self, tokens):
        pass

    def discard(self):
        pass


def test_cost_measurement_survives_a_burst_of_load(monkeypatch):
    """Other processes' load only adds time: the curve keeps each size's fastest run, the sizes taking turns,
    so a burst that covers several consecutive runs (all the repeats of one size, timed one size after the
    other) does not make drafting look dear."""

    true_cost = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5}
    clock = {"now": 0.0, "runs": 0}

    class FakeRunner(_FakeRunner):
        def verify(self, tree):
            clock["runs"] += 1
            burst = 3.0 if 6 <= clock["runs"] < 12 else 0.0  # six runs in a row under load
            clock["now"] += true_cost[tree.num_nodes] + burst

    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock["now"])
    curve = calibration.measure_cost(FakeRunner(), sizes=sorted(true_cost))
    assert curve == pytest.approx(true_cost)
    assert clock["runs"] == 4 * (1 + calibration.REPEATS)  # a warm-up round and the timed rounds


def test_cost_measurement_prices_with_the_times_every_process_agreed_on(monkeypatch):
    """Under tensor parallelism the curve is made of the slowest process's times (`runner.agreement`), so every
    process prices depths alike: here another process measured 4-node trees three times dearer."""
    clock = {"now": 0.0}
    cost = {1: 1.0, 2: 1.1, 4: 1.2}

    class FakeRunner(_FakeRunner):
        def verify(self, tree):
            clock["now"] += cost[tree.num_nodes]

    agreed = []

    def slowest(values):  # what the all-reduce would return: this process's times, the other's for 4 nodes
        agreed.append(list(values))
        return [v * 3 if v == pytest.approx(cost[4]) else v for v in values]

    runner = FakeRunner()
    runner.agreement = SimpleNamespace(seconds=slowest)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock["now"])
    curve = calibration.measure_cost(runner, sizes=[1, 2, 4])
    assert len(agreed) == 1  # one collective for the whole curve
    assert curve == pytest.approx({1: 1.0, 2: 1.1, 4: 3.6})


def test_every_adaptive_step_times_through_the_agreement(monkeypatch):
    """Each step of the adaptive policy (and the one-node path's measurement) reads its seconds through the runner's
    `Agreement`, once per step: the policy's choices follow the agreed times, the same on every process."""
    from ssmspec.hf import instance

    calls = {"seconds": 0}

    class Counting(instance.Agreement):
        def seconds(self, values):
            calls["seconds"] += 1
            return super().seconds(values)

    monkeypatch.setattr(instance, "Agreement", Counting)
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2")))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    out = model.generate(ids, max_new_tokens=12, return_dict_in_generate=True)
    steps = out.spec_stats["verify_steps"]
    calls["seconds"] = 0
    out = model.generate(ids, max_new_tokens=12, return_dict_in_generate=True)  # curve and path measured already
    assert calls["seconds"] == out.spec_stats["verify_steps"] and steps > 0


def test_cost_measurement_chooses_packed_linears_or_f_linear_per_size(monkeypatch):
    """Whether oneDNN's packed weights or F.linear is faster depends on the CPU: where the runner may choose, every
    size is timed both ways, the faster kept per size (`runner.packed_sizes`) and priced in the curve."""
    from ssmspec import linear

    packed = {1: 1.2, 2: 1.25, 4: 1.3, 8: 1.4}  # packed: dearer for few rows, cheaper for many
    plain = {1: 1.0, 2: 1.1, 4: 1.5, 8: 2.0}
    clock = {"now": 0.0}

    class FakeRunner(_FakeRunner):
        prepack, chooses_packing, packed_sizes = True, True, None  # (a runner works out whether it may choose)

        def verify(self, tree):
            n = tree.num_nodes
            clock["now"] += (packed if linear.packs(self.packed_sizes, n, self.prepack) else plain)[n]

    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock["now"])
    runner = FakeRunner()
    curve = calibration.measure_cost(runner, sizes=[1, 2, 4, 8])
    assert runner.packed_sizes == {1: False, 2: False, 4: True, 8: True}
    assert curve == pytest.approx({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.4})
    # a size between measured ones takes the next measured size's choice; beyond them (a prefill), the default
    assert not linear.packs(runner.packed_sizes, 2, True) and linear.packs(runner.packed_sizes, 3, False)
    assert linear.packs(runner.packed_sizes, 96, True) and not linear.packs(runner.packed_sizes, 96, False)
    runner.prepack = runner.chooses_packing = False  # a model without packed linears: one way only
    runner.packed_sizes = None
    assert calibration.measure_cost(runner, sizes=[1, 2, 4, 8]) == pytest.approx(plain) and runner.packed_sizes is None


def test_a_model_with_packed_linears_keeps_the_measured_choice_and_hfs_output(monkeypatch):
    """On a model whose linears pack, calls measure packed against F.linear per tree size (also without the adaptive
    depth), a share of each call's time, keep the choice on the model as it is measured, and the output stays HF's;
    once complete, every verify step runs with it."""
    from ssmspec import linear
    from ssmspec.speculate.generic import GenericRunner
    from ssmspec.speculate.runner import ModelRunner

    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)  # the tiny model's weights pack
    monkeypatch.setattr(linear, "PACK_MIN_BYTES_ROWS", 0)
    ref = copy.deepcopy(cached_tiny_model("mamba2")).float()
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    spec = SpecConfig(adaptive=False, num_draft_tokens=4, tree_budget=4)
    for _ in range(200):
        out = model.generate(ids, max_new_tokens=12, speculation=spec, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want)
        if out.spec_stats["calibrated"]:
            break
    cal = model._ssmspec_calibration[(1, "cpu")]
    assert cal.complete and cal.ways == (True, False) and cal.paths == (True, False)
    chosen = cal.packed_sizes()
    assert sorted(chosen) == [1, 2, 4, 5] and all(isinstance(v, bool) for v in chosen.values())
    seen = []
    monkeypatch.setattr(ModelRunner, "_call", lambda self, *a, real=ModelRunner._call, **kw: (
        seen.append(self.packed_sizes) or real(self, *a, **kw)))  # fmt: skip
    out = model.generate(ids, max_new_tokens=12, speculation=spec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want) and out.spec_stats["calibration_seconds"] == 0
    # used for every verify step (the prefill, before it, runs on the default: packed)
    assert seen[0] is None and len(seen) > 1 and all(s == chosen for s in seen[1:])
    assert not adaptive_chooses(GenericRunner(cached_tiny_model("xlstm")))  # no packed linears there


def adaptive_chooses(runner) -> bool:
    from ssmspec.speculate.calibration import chooses_packing

    return chooses_packing(runner)


def test_goodput_bar_is_the_loops_own_plain_steps():
    # plain steps of this loop take 12 ms (a bare decode forward 10 ms): speculation gaining 1.15 tokens per row in
    # 12.5 ms beats them by more than the margin, though not the bare forward
    g = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010)
    for _ in range(4):
        g.record(1, 0.012, tokens=10, rows=10)
    for _ in range(2 * adaptive.Goodput.WINDOW):
        g.record(4, 0.0125, tokens=115, rows=100)
    assert not g.plain and g.backoff == 4
    # no plain step yet: losing to the bare forward measures the real bar first (not a loss: the back-off stays)
    g2 = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010)
    for _ in range(adaptive.Goodput.WINDOW + 1):
        g2.record(4, 0.0125, tokens=115, rows=100)
    assert g2.forced == 2 and g2.backoff == 4
    for _ in range(2):
        g2.record(1, 0.012, tokens=10, rows=10)
    g2.record(4, 0.0125, tokens=115, rows=100)
    assert not g2.plain and g2.backoff == 4


def test_goodput_bar_ignores_the_first_plain_step_and_one_slow_step():
    g = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010)
    g.record(1, 0.030, tokens=10, rows=10)  # the loop's first step warms it up: not part of the bar
    assert g.plain_rate is None and g.plain_seconds is None
    for seconds in (0.012, 0.012, 0.040, 0.012):  # one slow step among them (another process): the median holds
        g.record(1, seconds, tokens=10, rows=10)
    assert g.plain_seconds == pytest.approx(0.012) and g.plain_rate == pytest.approx(1 / 0.012)


def test_goodput_of_compiled_steps_prices_against_the_loops_faster_plain_steps():
    # a compiled step timed alone by the calibration took 10 ms; the loop's plain steps take 5 ms: a 4-node step of the
    # curve's 12 ms forward costs 2.4 plain steps (an eager loop keeps the calibrated base where its steps are faster)
    for loop_base, cost in ((True, 2.4), (False, 1.2)):
        g = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010, loop_base=loop_base)
        assert g.cost(4) == pytest.approx((0.012 + g.spec_overhead(4)) / 0.010)  # before any plain step: calibrated
        for _ in range(4):
            g.record(1, 0.005, tokens=1)
        g.overhead = adaptive.StepOverhead(0.0, 0.0)
        assert g.seconds == pytest.approx(0.005 if loop_base else 0.010)
        assert g.cost(4) == pytest.approx(cost)


def test_goodput_of_compiled_steps_judges_against_plain_steps_taken_back_to_back():
    # plain steps taken back to back take 5 ms; one taken between drafted steps (priced and planned) 10 ms. Drafts
    # gaining 1.5 tokens in 9 ms beat the second, not the first: steps compiled whole are judged against the first
    def judge(loop_base: bool) -> bool:
        g = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010, loop_base=loop_base)
        for _ in range(4):
            g.record(1, 0.005, tokens=1, run=True)
        for _ in range(8):
            g.record(1, 0.010, tokens=1)
        assert g.plain_seconds == pytest.approx(0.005 if loop_base else 0.010)
        for _ in range(2 * adaptive.Goodput.WINDOW):
            g.record(4, 0.009, tokens=1.5)
        return g.plain

    assert judge(loop_base=True)  # backs off
    assert not judge(loop_base=False)
    # where no plain step ran back to back, the bar is the others'
    g = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010, loop_base=True)
    for _ in range(3):
        g.record(1, 0.010, tokens=1)
    assert g.plain_seconds == pytest.approx(0.010)


def test_compiled_steps_plain_step_is_kept_for_the_next_greedy_call():
    # a call's back-to-back plain steps (5 ms) are kept with the acceptance profiles; the next call prices with them
    # before it measures its own, and its first judgement's bar is them rather than the calibrated 10 ms
    profiles: dict = {}
    goodput = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010, loop_base=True)
    depth = policy.AdaptiveDepth(Acceptance(1), goodput, tree_budget=8, num_draft_tokens=4, profiles=profiles,
                                 profile_key="k")  # fmt: skip
    depth.observe_plain(5, 0.025, [0])
    depth.finish()
    assert profiles[(policy.PLAIN_STEP, 1)] == pytest.approx(0.005) and "k" in profiles
    g = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010, loop_base=True, plain_prior=0.005)
    assert g.seconds == pytest.approx(0.005)
    for _ in range(adaptive.Goodput.WINDOW + 1):  # 1.5 tokens in 9 ms: beats 10 ms a token, not 5
        g.record(4, 0.009, tokens=1.5)
    assert g.plain and not g.winning
    eager = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010, plain_prior=0.005)  # (steps not compiled whole)
    assert eager.seconds == pytest.approx(0.010)


def test_compiled_steps_shadow_draft_costs_its_planned_steps_excess():
    # a shadow draft's step took 1.1 ms where a step of a plain run takes 0.8: on steps compiled whole it cost 0.3 ms
    # (its pricing and planning with it), not the 0.05 ms of drafting alone; the plain steps then pay for it at
    # SHADOW_SHARE of their time before the next one
    from ssmspec.speculate.step import StepReport

    for loop_base, cost in ((True, 0.0003), (False, 0.00005)):
        goodput = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.001, loop_base=loop_base)
        depth = policy.AdaptiveDepth(Acceptance(1), goodput, tree_budget=8, num_draft_tokens=4)
        depth.observe_plain(5, 0.004, [0])
        report = StepReport.plain({0: 3})
        report.shadow, report.shadow_seconds = True, 0.00005
        depth.observe(report, 0.0011)
        assert depth.shadow_cost == pytest.approx(cost)


def test_goodput_refreshes_the_bar_where_speculation_wins_narrowly():
    def run(tokens_per_row: float) -> list[bool]:
        g = adaptive.Goodput({1: 1.0, 4: 1.2}, decode_seconds=0.010)
        for _ in range(3):
            g.record(1, 0.010, tokens=10, rows=10)
        forced = []
        for _ in range(3 * adaptive.Goodput.REFRESH_EVERY):
            if g.plain:
                g.record(1, 0.010, tokens=10, rows=10)
                forced.append(True)
            else:
                g.record(4, 0.010, tokens=round(tokens_per_row * 100), rows=100)
                forced.append(False)
        return forced

    narrow = run(1.1)  # 1.1x plain: one plain step every REFRESH_EVERY speculative steps keeps the bar measured
    assert 2 <= sum(narrow) <= 3
    assert sum(run(2.0)) == 0  # 2x: no need


def test_step_overhead_fits_a_fixed_part_and_a_part_per_drafted_node():
    fit = adaptive.StepOverhead(fixed=0.001, slope=30e-6)
    assert fit(100) == pytest.approx(0.001 + 100 * 30e-6)  # the prior until a step is measured
    for x in (8, 64, 16, 96, 24, 8, 48):  # steps of different sizes: 1.5 ms + 35 us per drafted node-row
        fit.add(x, 0.0015 + 35e-6 * x)
    a, b = fit.fit()
    assert a == pytest.approx(0.0015, rel=0.1) and b == pytest.approx(35e-6, rel=0.1)
    same = adaptive.StepOverhead(fixed=0.001, slope=30e-6)
    for _ in range(10):  # all of one size: the sizes cannot tell the parts apart; the slope stays the prior's
        same.add(32, 0.004)
    a, b = same.fit()
    assert b == pytest.approx(30e-6) and same(32) == pytest.approx(0.004)


def test_goodput_prices_a_steps_overhead_and_one_stall_does_not_price_speculation_out():
    g = adaptive.Goodput({1: 1.0, 4: 1.5}, decode_seconds=0.010, batch=10)
    prior = g.cost(4)
    assert prior > 1.5 and g.cost(1) == 1.0  # the forward plus the prior's overhead
    g.record(4, 0.100, tokens=30, rows=10)  # the first speculative step also set the drafter up: not counted
    assert g.cost(4) == prior
    g.record(4, 0.020, tokens=30, rows=10)  # 5 ms beyond the curve's 15 ms forward: drafting and bookkeeping
    assert g.cost(4) == pytest.approx(2.0)
    g.record(4, 1.0, tokens=30, rows=10)  # a stall (another process, the collector): counted as 3x the 5 ms expected
    decay = g.overhead.decay
    assert g.spec_overhead(4) == pytest.approx((decay * 0.005 + 3 * 0.005) / (decay + 1))


def test_a_batch_is_priced_by_how_much_nearer_its_end_a_step_brings_it():
    """`progress_survival` is the chance a step brings the batch's end more than j tokens nearer (what
    `batch_progress` measures): rows that keep pace must all pass a level together, a row ahead of the last one
    needs fewer; checked against steps drawn from the rows' survivals."""
    from ssmspec.speculate.step.emit import batch_progress

    acc = Acceptance(3, prior=[0.8, 0.7, 0.9, 0.9])
    for _ in range(6):
        acc.update(0, 4, 4)
        acc.update(1, 4, 1)
    survivals = [acc.survival(r, 4) for r in range(3)]
    # three rows level: each level passed by all three
    level = acc.progress_survival([0, 1, 2], [0, 0, 0], 4)
    assert level == pytest.approx([survivals[0][j] * survivals[1][j] * survivals[2][j] for j in range(4)])
    # row 1 two tokens ahead: it holds the batch up only from the third token on, and then two levels less deep
    ahead = acc.progress_survival([0, 1, 2], [0, 2, 0], 4)
    assert ahead[:2] == pytest.approx([survivals[0][j] * survivals[2][j] for j in range(2)])
    assert ahead[2] == pytest.approx(survivals[0][2] * survivals[2][2] * survivals[1][0])
    assert acc.progress_survival([0, 1, 2], [0, 9, 9], 4) == pytest.approx(survivals[0])  # far ahead: no matter
    assert min(a - b for a, b in zip(ahead, level)) >= 0
    # the expectation is what batch_progress measures on steps drawn from the rows' survivals
    g = torch.Generator().manual_seed(0)
    max_new, generated_before = 40, [10, 12, 10]
    remaining = [max_new - n for n in generated_before]
    behind = [max(remaining) - n for n in remaining]
    total, draws = 0, 20000
    for _ in range(draws):
        gained = []
        for s in survivals:
            u = float(torch.rand((), generator=g))
            gained.append(1 + sum(1 for p in s if u < p))  # accepted = how many levels' survivals exceed u
        generated = [[0] * (n + k) for n, k in zip(generated_before, gained)]
        total += batch_progress(remaining, [False] * 3, generated, [False] * 3, max_new, [[0] * k for k in gained])
    expected = 1 + sum(acc.progress_survival([0, 1, 2], behind, 4))
    assert total / draws == pytest.approx(expected, abs=0.03)
    # the rows' mean survival (the earlier measure) overprices a batch whose rows keep pace
    mean = [sum(s[j] for s in survivals) / 3 for j in range(4)]
    assert 1 + sum(mean) > expected + 0.5


def test_shadow_drafts_spend_a_bounded_share_of_plain_decoding(monkeypatch):
    """Plain steps chosen for failing drafts still draft one level now and then (a shadow draft, to notice when drafts
    start to succeed): at most SHADOW_SHARE of the plain steps' time, however dear a draft is."""
    import time

    class Slow(RandomDrafter):  # random chains as deep as asked (they fail), 5 ms each: many plain steps' worth
        calls = 0

        def propose(self, contexts, max_nodes, max_depth):
            Slow.calls += 1
            time.sleep(0.005)
            depth = min(max_nodes, max_depth)
            return [
                ([int(c[-1]), *(self.rng.randrange(96) for _ in range(depth))], list(range(-1, depth)))
                for c in contexts
            ]

    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    want = ref.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None)
    calibration.fixed(model, 1, COST)  # a fixed curve: the depths do not depend on timing
    shadows, default = {}, policy.SHADOW_SHARE
    for share in (default, 1.0):
        monkeypatch.setattr(policy, "SHADOW_SHARE", share)
        Slow.calls = 0
        out, stats, _ = speculative_generate(
            model, ids, torch.ones_like(ids), max_new_tokens=60, eos_token_ids=[], pad_token_id=0,
            drafter=Slow(96, chain=True), tree_budget=4, num_draft_tokens=4, adaptive=True,
        )  # fmt: skip
        assert torch.equal(out, want)
        shadows[share] = Slow.calls - sum(n > 1 for n in stats.tree_nodes_per_step)
    # a plain step of the tiny model takes a few ms: 1% of them buys one 5 ms shadow in more steps than the call has
    assert shadows[default] <= 2
    assert shadows[1.0] >= 5  # without the budget: the geometric schedule alone (4, 8, ... steps apart)


def test_far_from_paying_the_policy_prices_every_few_steps(monkeypatch):
    """Where the acceptance model prices every depth far below plain decoding (a batch of rows that rarely accept),
    the next REPRICE_EVERY steps decode plainly without pricing, and each further pricing in a row that finds it far
    doubles the pause (up to REPRICE_FAR_MAX); a shadow draft that hit is priced at once (one that missed only lowers
    the rates)."""

    priced, shadows = [], []
    gains, choose = policy.depth_gains, policy.AdaptiveDepth.choose
    monkeypatch.setattr(policy, "depth_gains", lambda *a, **k: priced.append(1) or gains(*a, **k))

    def counting(self, *a):
        out = choose(self, *a)
        shadows.append(out[2] > 0)
        return out

    monkeypatch.setattr(policy.AdaptiveDepth, "choose", counting)
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.randint(3, 90, (4, 8), generator=torch.Generator().manual_seed(1))
    want = ref.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    calibration.fixed(model, 4, COST)  # a fixed curve: the depths do not depend on timing
    model._ssmspec_acceptance = {}
    counts = {}
    for far_max in (policy.REPRICE_EVERY, policy.REPRICE_FAR_MAX):  # without the doubling, then with it
        monkeypatch.setattr(policy, "REPRICE_FAR_MAX", far_max)
        priced.clear(), shadows.clear()
        out, stats, _ = speculative_generate(
            model, ids, torch.ones_like(ids), max_new_tokens=40, eos_token_ids=[], pad_token_id=0,
            drafter=RandomDrafter(96, chain=True), tree_budget=4, num_draft_tokens=4, adaptive=True,
        )  # fmt: skip
        assert torch.equal(out, want)
        assert sum(n > 1 for n in stats.tree_nodes_per_step) == 0  # 0.5 per level for each of 4 rows: never tried
        counts[far_max] = len(priced), sum(shadows)
    steps = stats.verify_steps
    undoubled, doubled = counts[policy.REPRICE_EVERY], counts[policy.REPRICE_FAR_MAX]
    assert steps // policy.REPRICE_EVERY <= undoubled[0] <= steps // policy.REPRICE_EVERY + undoubled[1] + 1
    # 4, 8, 16, 32 steps apart (the random drafter's shadows miss: none repriced at once)
    assert doubled[0] <= 4 and doubled[0] < undoubled[0]
    # nothing far, and pricing cheap against a step: every step priced
    priced.clear()
    monkeypatch.setattr(policy, "FAR_FROM_PAYING", 0.0)
    monkeypatch.setattr(policy, "PRICING_SHARE", 1e9)
    speculative_generate(
        model, ids, torch.ones_like(ids), max_new_tokens=40, eos_token_ids=[], pad_token_id=0,
        drafter=RandomDrafter(96, chain=True), tree_budget=4, num_draft_tokens=4, adaptive=True,
    )  # fmt: skip
    assert len(priced) == steps
    # pricing dear against a step (a compiled small model's): a plain decision holds for up to REPRICE_MAX steps, a
    # shadow draft that hit still priced at once; the output HF's
    priced.clear()
    monkeypatch.setattr(policy, "PRICING_SHARE", 1e-12)
    out, stats, _ = speculative_generate(
        model, ids, torch.ones_like(ids), max_new_tokens=40, eos_token_ids=[], pad_token_id=0,
        drafter=RandomDrafter(96, chain=True), tree_budget=4, num_draft_tokens=4, adaptive=True,
    )  # fmt: skip
    assert torch.equal(out, want) and stats.verify_steps == steps
    assert 0 < len(priced) < steps // 2


def test_a_shadow_draft_that_hit_is_priced_at_once():
    from ssmspec.speculate.step import Proposal, StepReport

    depth = policy.AdaptiveDepth(Acceptance(1), adaptive.Goodput(COST, 0.004), tree_budget=8, num_draft_tokens=4)
    depth.steps, depth.reprice_at = 5, 20
    for token, repriced in ((7, False), (9, True)):  # the shadow drafted 9: a miss, then a hit
        proposal = Proposal(trees=None, qs=None, pads=None, depth=0, shadow=[([3, 9], [-1, 0])], shadow_seconds=1e-4)
        report = StepReport.plain({0: token}, proposal)
        assert report.shadow_hits == {0: repriced}
        depth.observe(report, 0.004)
        assert (depth.reprice_at == 0) == repriced


def test_goodput_under_sampling_follows_no_timing():
    """Seeded sampling draws the same tokens on every run: which depths are verified decides which random numbers
    are drawn, so nothing this call measures may move them."""
    g = adaptive.Goodput({1: 1.0, 4: 1.5}, decode_seconds=0.010, batch=4, measured=False)
    before = [g.cost(n) for n in (1, 2, 4)]
    for _ in range(10):
        g.record(1, 0.010, tokens=4, rows=4)
        g.record(4, 0.500, tokens=4, rows=4)  # speculation far slower than plain decoding
    assert not g.plain and [g.cost(n) for n in (1, 2, 4)] == before


def test_goodput_backs_off_where_speculating_measured_slower_than_plain_decoding():
    g = adaptive.Goodput({1: 1.0, 4: 1.5, 8: 2.0}, decode_seconds=0.010)
    # 4-node steps of 30 ms gaining 1.2 tokens per row: below 1 per 10 ms (the first one warms up: not counted)
    for _ in range(g.WINDOW + 1):
        assert not g.plain and g.keeps_speculating(1.0)  # a first try: the model calls it close
        g.record(4, 0.030, tokens=12, rows=10)
    assert g.forced == 2 and g.backoff == 4  # losing to a bare forward: two plain steps measure the real bar first
    for _ in range(2):
        g.record(1, 0.010, tokens=10, rows=10)
    assert not g.plain and g.plain_rate == pytest.approx(100)  # the first plain step warmed up; the second counts
    g.record(4, 0.030, tokens=12, rows=10)  # judged against the real bar at once
    assert g.forced == 4 and g.backoff == 8  # losing: backs off for 4 plain steps, the next back-off doubles
    assert not g.winning and g.plain
    for _ in range(4):
        g.record(1, 0.010, tokens=10, rows=10)
    assert not g.plain and g.retry_due and g.keeps_speculating(1.0)  # then a retry, where the model calls it close
    assert not g.keeps_speculating(0.5)  # ... and none where it prices speculation as a clear loss
    for _ in range(g.WINDOW):  # the retry gets a window of its own before it is judged
        assert not g.plain
        g.record(4, 0.030, tokens=12, rows=10)
    assert g.forced == 8 and g.backoff == 16  # losing again: twice as long
    retries = 0
    while not g.winning:  # winning steps (3 tokens per row in 16 ms): they outweigh the losing ones after a while
        while g.plain:
            g.record(1, 0.010, tokens=10, rows=10)
        for _ in range(g.WINDOW):
            g.record(4, 0.016, tokens=30, rows=10)
        retries += 1
    assert retries <= 3 and not g.plain and g.backoff == 4 and g.keeps_speculating(0.5)


def test_goodput_judges_heavy_tailed_steps_by_a_long_memory_and_their_spread():
    """A step's tokens are heavy-tailed at batch 1 (a tree rejected at its first node, or accepted several deep).
    Speculation winning by 25% on average, in runs of three rejected trees and three accepted ones, never backs off;
    judged on the last two steps' mean it backs off again and again. Steps that lose alike back off at once."""

    def back_offs(tokens, decay: float = adaptive.Goodput.LONG_DECAY, confidence: float = 1.0) -> int:
        g = adaptive.Goodput({1: 1.0, 8: 1.5}, decode_seconds=0.010)
        g.LONG_DECAY, g.CONFIDENCE = decay, confidence
        for _ in range(3):
            g.record(1, 0.010, tokens=1, rows=1)
        count = 0
        for step in range(60):
            if g.plain:
                g.record(1, 0.010, tokens=1, rows=1)
                continue
            g.record(8, 0.020, tokens=tokens(step), rows=1)
            count += g.forced >= g.FIRST_BACKOFF  # a back-off (not the refresh: one plain step now and then)
        return count

    def runs(step: int) -> int:  # 2.5 tokens per 20 ms: 1.25x plain decoding
        return 1 if step % 6 < 3 else 4

    assert back_offs(runs) == 0
    assert back_offs(runs, decay=0.5, confidence=0.0) >= 3
    assert back_offs(lambda step: 1) >= 3  # 0.5x plain decoding, every step alike


def test_goodput_notices_when_speculation_stops_paying():
    """Where a call's drafts stop being accepted (its repeated part is over), speculation that won for a while backs
    off within a few dozen steps: the long memory that rides out heavy-tailed steps forgets it won."""
    g = adaptive.Goodput({1: 1.0, 8: 1.5}, decode_seconds=0.010)
    for _ in range(3):
        g.record(1, 0.010, tokens=1, rows=1)
    for _ in range(20):
        g.record(8, 0.015, tokens=3, rows=1)  # 2x plain decoding
    assert g.winning and not g.plain and g.keeps_speculating(0.5)
    steps = 0
    while not g.plain:  # then 1 token in 15 ms: 0.67x
        g.record(8, 0.015, tokens=1, rows=1)
        steps += 1
        assert steps < 60
    assert steps > 5


def test_batch_progress_is_how_much_nearer_its_end_a_step_brought_the_batch():
    from ssmspec.speculate.step.emit import batch_progress

    def step(generated_before, gained, done=None, max_new=10):
        remaining = [max_new - n for n in generated_before]
        before = [False] * len(gained)
        generated = [[0] * (n + k) for n, k in zip(generated_before, gained)]
        return batch_progress(remaining, before, generated, done or before, max_new, [[0] * k for k in gained])

    assert step([3, 3, 3], [1, 4, 2]) == 1  # the batch waits for its slowest row
    assert step([3, 5], [4, 1]) == 3  # the row that was behind passed the other: 7 -> 4 left at most
    assert step([3, 5], [2, 1], done=[True, False]) == 2  # a row that stopped (EOS) ends no sooner for the other
    assert step([3, 3], [5, 5], done=[True, True], max_new=8) == 5  # the batch's last step


def test_acceptance_profile_carries_to_the_next_greedy_call_not_to_sampling(monkeypatch):
    """A greedy call leaves each level's acceptance on the model as the next call's prior (per drafter and tree shape,
    as the cost curves are kept); a sampling call neither reads nor writes it: a seed draws the same tokens whatever
    ran before."""
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])
    spec = SpecConfig(adaptive=True, num_draft_tokens=4, tree_budget=8)
    priors = []
    real = policy.Acceptance

    def spy(rows, prior=0.5):
        priors.append(prior)
        return real(rows, prior=prior)

    monkeypatch.setattr(policy, "Acceptance", spy)
    want = ref.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=24, speculation=spec), want)
    (key, profile), *others = model._ssmspec_acceptance.items()
    assert not others and key == ("PromptLookupDrafter", 8, 4) and all(0.0 < p <= 1.0 for p in profile)
    assert torch.equal(model.generate(ids, max_new_tokens=24, speculation=spec), want)
    assert priors[0] == 0.5 and priors[1] == profile != [0.5]  # the second call started from the first's profile
    seeded = [
        model.generate(
            ids, max_new_tokens=24, do_sample=True, speculation=spec, generator=torch.Generator().manual_seed(5)
        )
        for _ in range(2)
    ]
    assert priors[2:] == [0.5, 0.5] and torch.equal(seeded[0], seeded[1])
    assert len(model._ssmspec_acceptance) == 1


def test_plain_steps_age_a_rows_counts_when_they_are_next_read():
    """`elapse` only counts a row's plain steps; its counts take PLAIN_DECAY per step where they are next read or
    updated (a batch of 32 decoding plainly aged every row's levels every step). The rates are those of aging at
    once, over any mix of steps."""
    import random

    class AtOnce(Acceptance):  # the eager form: every plain step ages the row's counts then and there
        def elapse(self, row):
            for counts in (self.success[row], self.trials[row]):
                for j in range(len(counts)):
                    counts[j] *= self.PLAIN_DECAY

    rng = random.Random(0)
    for _ in range(50):
        rows = rng.randint(1, 4)
        lazy, eager = Acceptance(rows, prior=[0.8, 0.6]), AtOnce(rows, prior=[0.8, 0.6])
        for _ in range(rng.randint(1, 60)):
            r, what = rng.randrange(rows), rng.random()
            if what < 0.5:
                for acc in (lazy, eager):
                    acc.elapse(r)
            elif what < 0.8:
                drafted = rng.randint(0, 5)
                accepted = rng.randint(0, drafted)
                for acc in (lazy, eager):
                    acc.update(r, drafted, accepted)
            else:
                depth = rng.randint(1, 6)
                assert lazy.survival(r, depth) == pytest.approx(eager.survival(r, depth), rel=1e-12)
        behind = [rng.randint(0, 3) for _ in range(rows)]
        assert lazy.progress_survival(range(rows), behind, 5) == pytest.approx(
            eager.progress_survival(range(rows), behind, 5), rel=1e-12
        )
        assert lazy.profile() == eager.profile()


@pytest.mark.parametrize("case", ["pause", "shadow unpaid", "due before paid", "backing off"])
def test_a_plain_run_leaves_the_policy_as_its_steps_one_by_one(case):
    """`AdaptiveDepth.plain_run` counts the steps `choose` would decode plainly without pricing or a shadow draft (a
    pause in pricing up to the next shadow draft, a shadow due, or falling due, before the steps paid for it, a
    back-off), and `observe_plain`
    of them leaves the policy as choosing and observing each would: the same counts, the rows' acceptance aged as far,
    the same plain steps timed, the same shadow budget."""
    from ssmspec.speculate.step import StepReport

    def depth():
        goodput = adaptive.Goodput(COST, decode_seconds=0.004, batch=2)
        out = policy.AdaptiveDepth(Acceptance(2), goodput, tree_budget=8, num_draft_tokens=4)
        out.steps, out.plain_steps, out.reprice_at = 10, 6, 40
        out.next_shadow = {"shadow unpaid": 7, "due before paid": 9}.get(case, 30)
        out.shadow_cost, out.shadow_budget = (1e-3 if case in ("shadow unpaid", "due before paid") else 1e-5), 0.0
        out.acceptance.update(0, 3, 1)
        for _ in range(3):  # (plain steps measured: the bar and its pace)
            goodput.record(1, 0.004, 1)
        if case == "backing off":
            goodput.forced = 7
        return out

    one_by_one, run = depth(), depth()
    ahead = run.plain_run()
    # the back-off's steps; the steps before the shadow is due; the steps that pay for it (1% of 4 ms each)
    paid = math.ceil(1e-3 / (0.01 * 0.004))
    assert ahead == {"pause": 30 - 6 - 1, "shadow unpaid": paid, "due before paid": paid, "backing off": 7}[case]
    for _ in range(ahead):
        chosen, _, shadow = one_by_one.choose(None, 4, 8)  # (unpriced: `rows` is never read)
        assert chosen == 0 and shadow == 0
        one_by_one.observe(StepReport.plain({0: 5, 1: 6}), 0.004)
    run.observe_plain(ahead, 0.004 * ahead, [0, 1])
    for a, b in ((one_by_one, run), (one_by_one.goodput, run.goodput), (one_by_one.acceptance, run.acceptance)):
        same = ("steps", "plain_steps", "next_shadow", "reprice_at", "shadow_budget", "forced", "retry_due", "_aging")
        for name in same:
            if hasattr(a, name):
                assert getattr(a, name) == pytest.approx(getattr(b, name)), name
    assert list(one_by_one.goodput._plain) == pytest.approx(list(run.goodput._plain))
    assert one_by_one.acceptance.level_rates(0, 3) == pytest.approx(run.acceptance.level_rates(0, 3))
    if case == "pause":  # the step after the run drafts a shadow (paid for by then), as `plain_run` foresaw
        assert run.plain_run() == 0 and one_by_one.choose(None, 4, 8)[2] > 0


@pytest.mark.parametrize("loop_base", [True, False])
def test_a_plain_run_recorded_at_once_is_its_steps_recorded_one_by_one(loop_base):
    """`Goodput.record_run` (a back-to-back run of plain steps) leaves the goodput as recording each step would: the
    long memory's sums, the back-off's count and its retry, the plain steps and the bar's samples (the call's first
    plain step not among them)."""
    for forced, steps, first in ((0, 5, True), (3, 5, False), (9, 5, False), (5, 5, True), (2, 20, False)):
        one, run = (adaptive.Goodput(COST, 0.004, loop_base=loop_base) for _ in range(2))
        for g in (one, run):
            g._sums = [1.0, 2.0, 3.0, 4.0, 5.0]
            g.forced = forced
            if not first:
                g.record(1, 0.005, 1, run=True)
        for _ in range(steps):
            one.record(1, 0.012 / steps, 1, run=True)
        run.record_run(steps, 0.012)
        for name in ("forced", "retry_due", "plain_steps", "since_plain"):
            assert getattr(one, name) == getattr(run, name), name
        assert run._sums == pytest.approx(one._sums, rel=1e-12)
        assert list(run._runs) == pytest.approx(list(one._runs)) and list(run._plain) == pytest.approx(list(one._plain))
        assert run.plain_seconds == pytest.approx(one.plain_seconds)


def test_a_step_padded_to_its_bucket_is_priced_at_the_buckets_forward():
    """With static shapes a tree is verified at the node count it is padded to: a 3-node chain in a 4-node bucket costs
    the 4-node forward (not the 2-4 interpolation, which made it look cheaper than the 4-node chain that drafts a token
    more for the same step); without `padded`, sizes between measured ones are interpolated."""
    from ssmspec.speculate.adaptive import Goodput
    from ssmspec.speculate.runner import bucket

    curve = {1: 1.0, 2: 1.2, 4: 2.0, 8: 3.0}
    padded = Goodput(curve, None, padded=bucket)
    assert padded.cost(3) == padded.cost(4) == 2.0 and padded.cost(5) == 3.0 and padded.cost(2) == 1.2
    assert Goodput(curve, None).cost(3) == pytest.approx(1.6)
    timed = Goodput(curve, 1e-3, padded=bucket)  # (with the step's overhead: per drafted node, on the nodes drafted)
    assert timed.cost(3) < timed.cost(4) and timed.cost(3) - timed.cost(4) == pytest.approx(
        (timed.spec_overhead(3) - timed.spec_overhead(4)) / timed.seconds
    )


def test_a_greedy_call_prices_its_first_drafted_steps_with_the_overhead_the_call_before_measured():
    """On steps compiled whole, and eager at a batch, what a drafted step took beyond its forward is kept on the model
    per batch size and drafter (`STEP_OVERHEAD`) and is the next greedy call's prior (`Goodput.overhead_prior`): a
    call priced from PRIOR_FIXED alone tried drafts its steps then showed to cost more. A sampled call's pricing
    follows no timing, and an eager loop's at batch 1 is as it was: both keep PRIOR_FIXED."""
    from ssmspec.compile.lower import StepCompiler
    from ssmspec.speculate.adaptive import Goodput

    curve = {1: 1.0, 2: 1.2, 4: 2.0}
    fresh = Goodput(curve, 1e-3, loop_base=True)
    assert fresh.overhead.fit() == pytest.approx((Goodput.PRIOR_FIXED * 1e-3, Goodput.PRIOR_SLOPE))
    assert Goodput(curve, 1e-3, overhead_prior=(2e-3, 1e-4)).overhead.fit() == fresh.overhead.fit()  # (eager)
    assert Goodput(curve, 1e-3, batch=4, overhead_prior=(2e-3, 1e-4)).overhead.fit() == (2e-3, 1e-4)  # (a batch)
    assert Goodput(curve, 1e-3, batch=4, measured=False, overhead_prior=(2e-3, 1e-4)).overhead.fit() == pytest.approx(
        fresh.overhead.fit()
    )
    carried = Goodput(curve, 1e-3, loop_base=True, overhead_prior=(2e-3, 1e-4))
    assert carried.overhead.fit() == (2e-3, 1e-4) and carried.cost(4) > fresh.cost(4)
    carried.recalibrate(curve, 1e-3)  # (the calibration's base does not replace a measured prior)
    assert carried.overhead.fit() == (2e-3, 1e-4)
    sampled = Goodput(curve, 1e-3, measured=False, loop_base=True, overhead_prior=(2e-3, 1e-4))
    assert sampled.overhead.fit() == fresh.overhead.fit()

    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))  # (its steps recorded and replayed as compiled ones, op by op)
    model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    want = ref.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)

    def call():  # (the reference's own tokens drafted: every step drafts)
        return speculative_generate(
            model, ids, torch.ones_like(ids), max_new_tokens=40, eos_token_ids=[], pad_token_id=0,
            drafter=OracleDrafter([w.tolist() for w in want], vocab_size=96), tree_budget=4, num_draft_tokens=4,
            adaptive=True, static_shapes=True, graphs=True,
        )  # fmt: skip

    calibration.fixed(model, 1, COST, decode_seconds=1e-4)  # (a forward's seconds: the overhead is the rest)
    call()
    kept = [(k, v) for k, v in model.__dict__["_ssmspec_acceptance"].items() if k[0] == policy.STEP_OVERHEAD]
    assert len(kept) == 1 and kept[0][0][1] == 1 and all(x >= 0 for x in kept[0][1])
    priors = []
    init = adaptive.Goodput.__init__

    def recording(self, *args, **kwargs):
        priors.append(kwargs.get("overhead_prior"))
        init(self, *args, **kwargs)

    adaptive.Goodput.__init__ = recording
    try:
        assert torch.equal(call()[0], want)
    finally:
        adaptive.Goodput.__init__ = init
    assert priors == [kept[0][1]]


def test_on_steps_compiled_whole_the_next_call_starts_pricing_as_far_apart_as_the_last_one_ended(monkeypatch):
    """On steps compiled whole, how many pricings in a row had found drafts far from paying when a greedy call ended is
    kept on the model (FAR_PRICED): the next call's pauses start that far apart, so it prices less often than the
    first; an eager loop keeps nothing and prices as it did. The outputs are HF's."""
    from ssmspec.compile.lower import StepCompiler

    priced = []
    gains = policy.depth_gains
    monkeypatch.setattr(policy, "depth_gains", lambda *a, **k: priced.append(1) or gains(*a, **k))
    ref = cached_tiny_model("mamba2")
    ids = torch.randint(3, 90, (1, 8), generator=torch.Generator().manual_seed(1))
    want = ref.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None)
    counts = {}
    for compiled in (True, False):
        model = ssmspec.transform(copy.deepcopy(ref))
        if compiled:  # (its steps recorded and replayed as compiled ones, op by op)
            model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
        calibration.fixed(model, 1, {1: 1.0, 2: 3.0, 4: 5.0})  # (far from paying, whatever is measured)
        model._ssmspec_acceptance = {}
        counts[compiled] = []
        for _ in range(2):
            priced.clear()
            out, stats, _ = speculative_generate(
                model, ids, torch.ones_like(ids), max_new_tokens=60, eos_token_ids=[], pad_token_id=0,
                drafter=RandomDrafter(96, chain=True), tree_budget=4, num_draft_tokens=4, adaptive=True,
                static_shapes=compiled, graphs=compiled,
            )  # fmt: skip
            assert torch.equal(out, want) and max(stats.tree_nodes_per_step) == 1
            counts[compiled].append(len(priced))
        kept = {k[0] for k in model._ssmspec_acceptance if isinstance(k, tuple)}
        assert (policy.FAR_PRICED in kept) == compiled
    assert counts[True][1] < counts[True][0]
    assert counts[False][1] == counts[False][0]


def test_on_steps_compiled_whole_a_priced_speculative_depth_holds_for_the_next_steps():
    """On steps compiled whole (`Goodput.loop_base`) a priced speculative depth holds for PRICE_HOLD steps: the later
    ones take its size (within their own limits) without pricing; a back-off ends the hold. An eager loop prices every
    step."""
    from ssmspec.speculate.adaptive import Goodput

    rows = SimpleNamespace(batch=1, done=[False], remaining=[100])
    for compiled in (True, False):
        goodput = Goodput({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3}, 1e-3, loop_base=compiled)
        depth = policy.AdaptiveDepth(Acceptance(1, prior=0.9), goodput, tree_budget=4, num_draft_tokens=4)
        priced = []
        price = depth._priced
        depth._priced = lambda r, d: priced.append(d) or price(r, d)
        chosen = [depth.choose(rows, 4, 4) for _ in range(2 * policy.PRICE_HOLD)]
        assert chosen[0][0] > 0 and all(c == chosen[0] for c in chosen)
        assert len(priced) == (2 if compiled else 2 * policy.PRICE_HOLD)
        if compiled:  # (a held size within the step's own limits: a row's last tokens)
            depth.choose(rows, 4, 4)
            assert depth.choose(rows, 1, 1)[:2] == (1, 1) and len(priced) == 3
    goodput = Goodput({1: 1.0, 2: 1.05, 4: 1.1}, 1e-3, loop_base=True)
    depth = policy.AdaptiveDepth(Acceptance(1, prior=0.9), goodput, tree_budget=4, num_draft_tokens=4)
    assert depth.choose(rows, 4, 4)[0] > 0
    goodput.forced = 4  # (a back-off: plain steps, the hold ended)
    assert depth.choose(rows, 4, 4)[0] == 0 and depth.held_for == 0


@pytest.mark.parametrize("do_sample", [False, True])
def test_an_eager_call_takes_the_plain_steps_the_policy_decided_ahead_without_planning_each(monkeypatch, do_sample):
    """Where drafts are far from paying (a batch whose rows rarely accept), an eager call takes the plain steps the
    policy decides ahead (`StepPolicy.plain_run`) without planning or observing each, as a compiled one does: planned
    steps and run steps add up to the call's, most steps are in runs, and the output is HF's greedy output (a row
    stopping at EOS inside a run), or the seeded sampled output of the same call planning every step."""
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(3))
    eos = int(ref.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)[0, ids.shape[1] + 23])
    kwargs = dict(max_new_tokens=40, eos_token_id=eos, pad_token_id=0, do_sample=do_sample)
    calibration.fixed(model, 2, {1: 1.0, 2: 3.0, 4: 5.0, 8: 9.0})  # (drafts far from paying, whatever is measured)
    model._ssmspec_acceptance = {}
    drafter = RandomDrafter(96, chain=True)
    monkeypatch.setattr("ssmspec.speculate.plan.build_drafter", lambda *a, **k: drafter)
    spec = SpecConfig(drafter="prompt_lookup", adaptive=True, tree=False, num_draft_tokens=4)
    plans, runs = [], []
    plan, observe_plain = policy.StepPolicy.plan, policy.StepPolicy.observe_plain
    monkeypatch.setattr(policy.StepPolicy, "plan", lambda self, rows: plans.append(1) or plan(self, rows))
    monkeypatch.setattr(policy.StepPolicy, "observe_plain",
                        lambda self, n, *a: runs.append(n) or observe_plain(self, n, *a))  # fmt: skip

    def call():
        generator = torch.Generator().manual_seed(0) if do_sample else None
        return model.generate(ids, **kwargs, speculation=spec, generator=generator, return_dict_in_generate=True)

    out = call()
    steps = out.spec_stats["verify_steps"]
    assert max(out.spec_stats["tree_nodes_per_step"]) == 1  # (never drafted)
    assert len(plans) + sum(runs) == steps and sum(runs) > steps // 2 and max(runs) >= 4
    if not do_sample:  # (row 0 stops at its EOS, 23 tokens in)
        assert torch.equal(out.sequences, ref.generate(ids, **kwargs))
        return
    monkeypatch.setattr(policy.StepPolicy, "plain_run", lambda self, rows: 0)  # every step planned
    runs.clear()
    again = call()
    assert not runs and torch.equal(again.sequences, out.sequences)
