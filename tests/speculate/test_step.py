"""The parts of a speculative step, each alone (ssmspec.speculate.step, ssmspec.speculate.policy): no model runs here
(a fake runner where one is needed); the loop they make is tested end to end everywhere else."""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import pytest
import torch

from ssmspec.speculate.decoding import Decoding
from ssmspec.speculate.drafters import Drafter
from ssmspec.speculate.engine import SpecStats
from ssmspec.speculate.policy import StepPolicy
from ssmspec.speculate.step import Accepted, Proposal, StepPlan, StepReport, Verified
from ssmspec.speculate.step.accept import accept
from ssmspec.speculate.step.emit import Rows
from ssmspec.speculate.step.propose import Proposer
from ssmspec.speculate.step.verify import Verifier
from ssmspec.tree import TokenTree

V = 10


def _rows(prompts, max_new_tokens=8, eos=(9,), keep_scores=False) -> Rows:
    ids = torch.tensor(prompts)
    decoding = Decoding(output_scores=keep_scores)
    return Rows(ids, torch.ones_like(ids), decoding, list(eos), 0, max_new_tokens, SpecStats())


def _verified(trees, argmax, active=None) -> Verified:
    """A verified proposal whose target picks `argmax[row][node]` at every node (a margin of 5: no near-tie; -1: all
    logits tie, the target picks token 0)."""
    tree = TokenTree.from_lists([t for t, _ in trees], [p for _, p in trees])
    logits = torch.zeros(tree.batch_size, tree.num_nodes, V)
    for r, row in enumerate(argmax):
        for n, token in enumerate(row):
            if token >= 0:
                logits[r, n, token] = 5.0
    proposal = Proposal(list(trees), [None] * len(trees), {}, depth=3)
    return Verified(proposal, tree, logits, logits, [None] * len(trees), active or [True] * len(trees))


def test_accept_walks_each_row_along_the_targets_choices():
    # row 0: root 1 -> child 2 (the target's choice after 1) -> grandchild 3 (its choice after 2); bonus 4
    # row 1: its first child is wrong (5), the second right (6), then nothing drafted after it: bonus 7
    trees = [([1, 2, 3], [-1, 0, 1]), ([1, 5, 6], [-1, 0, 0])]
    verified = _verified(trees, [[2, 3, 4], [6, -1, 7]])
    got = accept(verified, Decoding(), tolerance=1e-6)
    assert got.last == [2, 2] and got.tokens == [[2, 3, 4], [6, 7]]
    assert got.ties == [[False] * 3, [False, True, False]]  # (row 1's node 1: every logit ties)
    with_tops = accept(verified, Decoding(), tolerance=1e-6, topk=2)
    assert with_tops.tokens == got.tokens and with_tops.tops[0][0][0][0] == 2


def test_rows_keep_a_path_cut_where_a_row_stops_and_emit_it():
    rows = _rows([[3, 4], [3, 4]])
    trees = [([1, 2, 9, 5], [-1, 0, 1, 2]), ([1, 2], [-1, 0])]
    verified = _verified(trees, [[2, 9, 5, 6], [2, 7]])
    accepted = Accepted(last=[3, 1], tokens=[[2, 9, 5, 6], [2, 7]])
    kept = rows.keep(verified, accepted)
    # row 0 stops at its EOS (9), the second token: it commits the root and node 1 (9 is node 1's output)
    assert kept.cut == [1, 1] and kept.paths == [[0, 1], [0, 1]]
    assert kept.emitted == [[2, 9], [2, 7]] and kept.stops == [True, False]
    assert rows.generated == [[], []]  # nothing appended yet
    rows.emit(kept, verified, accepted)
    assert rows.generated == [[2, 9], [2, 7]] and rows.done == [True, False]
    assert rows.contexts[1] == [3, 4, 2, 7] and rows.stats.emitted_tokens == 4 and rows.stats.verify_steps == 1
    assert kept.progress == 2  # the batch's end came as near as its slowest row's 2 tokens
    short = _rows([[3, 4]], max_new_tokens=2)
    cut = short.keep(_verified([trees[1]], [[2, 7]]), Accepted(last=[1], tokens=[[2, 7, 8]]))
    assert cut.emitted == [[2, 7]] and cut.stops == [True]  # max_new_tokens reached inside the block


def test_a_finished_row_keeps_its_pad_chain_for_hfs_scores():
    rows = _rows([[3, 4], [3, 4]], keep_scores=True)
    rows.done[1], rows.generated[1], rows.kept[1] = True, [9], [(torch.zeros(V), torch.zeros(V))]
    proposer = Proposer(_Counting())
    proposal = proposer.propose(StepPlan(depth=2, budget=2), rows)
    assert proposal.pads == {1: 2} and proposal.trees[1] == ([9, 0, 0], [-1, 0, 1])
    verified = _verified(proposal.trees, [[7, 7, 7], [0, 0, 0]], active=[True, False])
    verified.proposal = proposal
    kept = rows.keep(verified, Accepted(last=[0, 0], tokens=[[7], []]))
    assert kept.cut[1] == 2 and kept.emitted[1] == [0, 0, 0]


class _Counting(Drafter):
    def __init__(self):
        self.calls = []

    def propose(self, contexts, max_nodes, max_depth):
        self.calls.append((max_nodes, max_depth))
        time.sleep(0.001)
        return [([c[-1]] + [5] * max_nodes, list(range(-1, max_nodes))) for c in contexts]


def test_propose_asks_within_the_plan_trims_caps_and_times_a_shadow():
    rows = _rows([[3, 4]], max_new_tokens=4)
    drafter = _Counting()
    proposer = Proposer(drafter)
    plain = proposer.propose(StepPlan(depth=0, budget=8), rows)
    assert drafter.calls == [] and plain.trees == [([4], [-1])]  # a plain step asks the drafter nothing
    deep = proposer.propose(StepPlan(depth=6, budget=6), rows)
    assert deep.trees == [([4, 5, 5, 5], [-1, 0, 1, 2])]  # 3 tokens left after the root's: no deeper
    capped = proposer.propose(StepPlan(depth=6, budget=6, cap=2), rows)
    assert capped.trees == [([4, 5], [-1, 0])]
    shadow = proposer.propose(StepPlan(depth=0, budget=8, shadow=2), rows)
    assert shadow.shadow == [([4, 5, 5], [-1, 0, 1])] and shadow.shadow_seconds >= 0.001 and drafter.calls[-1] == (2, 1)


class _FakeRunner:
    """Verifies on nothing: logits of zeros; out of memory above `fits` nodes per row."""

    retries_out_of_memory, capture_features, features = True, False, None

    def __init__(self, fits: int) -> None:
        self.fits, self.tried, self.held = fits, [], 0

    def prepare(self, trees):
        return TokenTree.from_lists([t for t, _ in trees], [p for _, p in trees])

    def verify(self, tree):
        self.tried.append(tree.num_nodes)
        if tree.num_nodes > self.fits:
            raise torch.OutOfMemoryError("simulated")
        self.held = 100 * tree.num_nodes
        return torch.zeros(tree.batch_size, tree.num_nodes, V)

    def verify_bytes(self):
        return self.held


def test_verify_retries_out_of_memory_with_half_the_nodes_and_measures_what_it_holds():
    rows = _rows([[3, 4]])
    stats = rows.stats
    runner = _FakeRunner(fits=3)
    proposal = Proposal([([1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 2, 3, 4, 5])], [None], {}, depth=6)
    verified = Verifier(runner, stats).verify(proposal, rows)
    assert runner.tried == [7, 3] and verified.cap == 3 and stats.out_of_memory == 1
    assert verified.proposal.trees == [([1, 2, 3], [-1, 0, 1])] and verified.held_bytes == 300
    assert stats.max_verify_bytes == 300
    runner.fits = 0
    with pytest.raises(torch.OutOfMemoryError):  # nothing smaller than a plain step
        Verifier(runner, SpecStats()).verify(Proposal([([1], [-1])], [None], {}, depth=0), rows)


def test_the_policy_sizes_steps_by_schedule_and_memory():
    rows = _rows([[3, 4]], max_new_tokens=40)
    policy = StepPolicy(tree_budget=8, num_draft_tokens=4, schedule="heuristic", verify_memory=1000, batch=1)
    assert policy.plan(rows) == StepPlan(depth=4, budget=8)
    policy.observe(StepReport(nodes=5, all_accepted=True, held_bytes=500))  # 100 bytes a node
    plan = policy.plan(rows)
    assert plan.depth == 6 and plan.budget == 10 and plan.cap == 10  # HF's schedule: +2; what 1000 bytes hold
    policy.observe(StepReport(nodes=7, all_accepted=False, cap=4))  # an out-of-memory retry fitted 4
    assert policy.plan(rows) == StepPlan(depth=5, budget=9, cap=4)
    assert StepPolicy(tree_budget=8, num_draft_tokens=4, batch=1).plan(_rows([[3]], max_new_tokens=2)).depth == 1


def test_the_step_report_counts_the_rows_that_took_part():
    trees = [([1, 2, 3], [-1, 0, 1]), ([1], [-1]), ([1, 4], [-1, 0])]
    verified = _verified(trees, [[2, 3, 4], [0], [4, 5]], active=[True, False, True])
    verified.proposal = Proposal(trees, [None] * 3, {}, depth=2, shadow=None)
    accepted = Accepted(last=[2, 0, 1], tokens=[[2, 3, 4], [], [4, 5]])
    kept = SimpleNamespace(progress=2)
    report = StepReport.of(verified, accepted, kept)
    assert report.drafted == {0: 2, 2: 1} and report.sizes == {0: 2, 2: 1} and report.accepted == {0: 2, 2: 1}
    assert report.all_accepted and report.nodes == 3 and report.depth == 2 and report.progress == 2


@pytest.mark.parametrize("family", ["mamba2", "rwkv"])
def test_both_runners_provide_the_runner_contract(family):
    """The seams' runner and HF's forward's (GenericRunner) each have every member of `step.Runner` that the loop,
    the policy and the calibration use, with the declared kinds of values, before and after a prefill."""
    import typing

    import ssmspec
    from ssmspec.speculate.engine import open_runner
    from ssmspec.speculate.plan import LoopSettings
    from ssmspec.speculate.step import Runner
    from ssmspec.testing.strategies import cached_tiny_model

    model = ssmspec.transform(copy.deepcopy(cached_tiny_model(family)))
    generic = family == "rwkv"
    settings = LoopSettings(tree_budget=4, num_draft_tokens=2, generic=generic)
    runner = open_runner(model, settings, max_new_tokens=8, capture_features=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    runner.prefill(ids, torch.ones_like(ids))
    assert isinstance(runner, Runner)
    assert runner.path == ("generic" if generic else "seams")
    hints = typing.get_type_hints(Runner)
    for name in ("static_shapes", "graphs", "fuse_single_nodes", "reruns", "retries_out_of_memory",
                 "capture_features", "prepack", "chooses_packing", "chooses_single_node_path"):  # fmt: skip
        assert hints[name] is bool and isinstance(getattr(runner, name), bool), name
    assert runner.n_real.shape == (1,) and runner.padded_size(3) >= 3
    assert not generic or not hasattr(runner, "cache")  # (HF's forward keeps its own cache: no stand-in for one)
    missing = type("Missing", (), {"path": "seams"})()
    assert not isinstance(missing, Runner)  # (a runner without the contract's members is not one)
