"""The speculative decoding loop: prefill, then per step `propose` -> `verify` -> `accept` -> `commit`, then emit,
each a part with typed inputs and outputs (ssmspec.speculate.step), the step's size asked of one policy object
(ssmspec.speculate.policy); greedy or lossless sampling, HF's processors per node; stops exactly where HF generate()
stops."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ssmspec.errors import GENERIC_GRAPHS, UnsupportedModelError
from ssmspec.speculate.decoding import Decoding
from ssmspec.speculate.drafters import Drafter
from ssmspec.speculate.generic import GenericRunner
from ssmspec.speculate.plan import LoopSettings
from ssmspec.speculate.policy import StepPolicy
from ssmspec.speculate.runner import ModelRunner
from ssmspec.speculate.step import Proposal, StepPlan, StepReport
from ssmspec.speculate.step.accept import accept
from ssmspec.speculate.step.emit import Rows
from ssmspec.speculate.step.propose import Proposer
from ssmspec.speculate.step.verify import Verifier
from ssmspec.speculate.ties import near_tie_tolerance, near_ties


@dataclass
class SpecStats:
    """Counters of one generate call (all rows together)."""

    verify_steps: int = 0
    accepted_tokens: int = 0  # drafted tokens accepted, summed over rows
    emitted_tokens: int = 0  # tokens appended to the outputs (accepted + bonus, after EOS/max truncation)
    tree_nodes_per_step: list[int] = field(default_factory=list)  # nodes per row verified, per step (max over rows)
    row_steps: int = 0  # verify steps counted per active row
    # emitted tokens whose top-2 logit gap was below near_tie_tolerance * max(1, |top logit|): where another
    # arithmetic (a tree vs one token, another kernel) may pick the other token in float32/bf16
    near_ties: int = 0
    near_tie_tolerance: float = 0.0
    max_verify_bytes: int = 0  # the largest verify step's buffers (records, node states, tree K/V), all rows
    out_of_memory: int = 0  # verify steps that ran out of memory and were retried with a smaller tree
    # seconds this call spent measuring the model's calibration (ssmspec.speculate.calibration), and whether it is
    # complete (for this batch size and device) after the call
    calibration_seconds: float = 0.0
    calibrated: bool = False
    drafter: dict[str, float] = field(default_factory=dict)  # the drafter's own counters (Saguaro: hits, ...)

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens gained per verify step and row: accepted drafts + the bonus token."""
        return (self.accepted_tokens + self.row_steps) / max(self.row_steps, 1)


def eos_and_pad(generation_config) -> tuple[list[int], int]:
    """EOS ids as a list and the pad id, resolved as HF generate does (no pad token: the first EOS, else 0)."""
    eos = generation_config.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    pad = generation_config.pad_token_id
    return eos, int(pad) if pad is not None else (eos[0] if eos else 0)


def speculative_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    drafter: Drafter,
    settings: LoopSettings | None = None,
    decoding: Decoding | None = None,
    model_inputs: dict | None = None,
    **fields: Any,
) -> tuple[torch.Tensor, SpecStats, ModelRunner | GenericRunner]:
    """Speculative decoding, greedy or (with `decoding.do_sample`) lossless sampling. Returns (sequences
    [B, L + T] as HF generate, stats, the target's runner holding the final committed cache); with
    `decoding.output_scores`/`output_logits` the per-token tensors are left in `decoding.scores`/`.logits`.

    `settings` (LoopSettings: a call's plan decides them, ssmspec.speculate.plan) say how the loop runs: each step
    drafts at most `tree_budget` nodes per row, at most `num_draft_tokens` deep; the "heuristic" schedule adapts the
    depth as HF's assisted generation does (+2 after a step that accepted every drafted token, -1 otherwise);
    `static_shapes` pads trees to power-of-two node counts (or to the largest possible tree, where smaller) and
    commits fixed-length paths, so a compiled verify step never recompiles; `graphs` captures each bucket's step once
    and replays it (ssmspec.compile.graphs); `adaptive` picks each step's depth (0: plain decoding) for the best
    expected tokens per unit of cost (ssmspec.speculate.adaptive); `verify_memory` (bytes) cuts trees to the nodes
    per row whose verify buffers fit, as measured on earlier steps (a verify step that runs out of memory is retried
    with half the nodes); `generic` verifies through HF's own forward (ssmspec.speculate.generic: chains, a batch row
    by row), whose prefill also takes `model_inputs` (a multimodal prompt's pixel values, grids, token types).
    A call by hand (tests, the certifier) may give the settings' fields as keyword arguments instead.
    `decoding` carries HF's logits processors (applied per node), stopping criteria (checked after every emitted
    token) and streamer."""
    settings = _settings(settings, fields)
    decoding = decoding if decoding is not None else Decoding()
    proposer = Proposer(drafter)
    runner = open_runner(model, settings, max_new_tokens=max_new_tokens, capture_features=proposer.wants_features)
    stats = SpecStats(near_tie_tolerance=near_tie_tolerance(runner.dtype))
    if max_new_tokens <= 0:
        return input_ids.clone(), stats, runner
    rows = Rows(input_ids, attention_mask, decoding, eos_token_ids, pad_token_id, max_new_tokens, stats)
    extra = {"model_inputs": model_inputs} if model_inputs else {}  # only the generic path takes them
    logits = runner.prefill(input_ids, attention_mask, all_positions=proposer.topk > 0, keep=proposer.prompt_positions,
                            **extra)  # fmt: skip
    logits = proposer.start(runner, rows, attention_mask, logits)
    if isinstance(runner, ModelRunner):  # (a greedy step compiled whole drafts the drafter's next chain in its graph)
        runner.step_draft = proposer.step_draft
    rows.first(logits, None if decoding.do_sample else near_ties(logits, stats.near_tie_tolerance))
    policy = StepPolicy.for_call(model, runner, drafter, decoding, settings)
    verifier = Verifier(runner, stats)
    # greedy steps on a model whose steps are compiled, for a drafter that needs of the target no more than its tokens
    # and features: a plain step is one replay and one read of the argmax (the fused one-node step, `plain_step`),
    # nothing built per token, and a call that drafts nothing takes them back to back (the first step captures it the
    # general way); a drafted tree is one replay and one read of the accepted tokens (`greedy_step`)
    lean = (not decoding.do_sample and not decoding.processes and not decoding.keeps_scores
            and isinstance(runner, ModelRunner) and runner.fuse_single_nodes and not proposer.topk
            and not proposer.calls_every_step)  # fmt: skip
    chosen = None
    try:
        while not rows.finished:
            if lean and settings.num_draft_tokens == 0:
                chosen = plain_step(runner, rows, chosen)
                if chosen is not None:
                    continue
            plan = policy.plan(rows)
            proposal = None
            if lean and settings.num_draft_tokens and plan.depth == 0:  # (drafting none: tried above)
                active = [r for r in range(rows.batch) if not rows.done[r]]
                proposal = proposer.propose(plan, rows) if plan.shadow else None  # (the shadow's draft)
                chosen = plain_step(runner, rows, chosen, proposer)
                if chosen is not None:
                    policy.observe(StepReport.plain({r: rows.generated[r][-1] for r in active}, proposal))
                    # the steps the policy would take plainly anyway, back to back, reported together
                    chosen = plain_run(policy, rows, lambda t: plain_step(runner, rows, t, proposer), chosen)
                    continue
            chosen = None  # (a general step: the next plain step reads its input from the rows)
            proposal = proposal or proposer.propose(plan, rows)
            if lean and settings.verify_memory is None and not proposal.pads and proposal.nodes > 1:
                policy.observe(greedy_step(runner, rows, proposal, proposer))  # (accepted, committed in its graph)
                continue
            if lean and settings.num_draft_tokens and not proposal.pads and proposal.nodes == 1:  # drafted nothing
                active = [not d for d in rows.done]
                chosen = plain_step(runner, rows, None, proposer)
                if chosen is not None:
                    emitted = [[g[-1]] for g in rows.generated]
                    policy.observe(StepReport.of_rows(proposal, 1, active, emitted, 1))
                    continue
            policy.observe(general_step(runner, rows, proposal, proposer, verifier, decoding, stats))
            if not lean and plan.depth == 0 and not plan.shadow and not proposer.calls_every_step:
                # the plain steps the policy would take anyway (a batch where speculation does not pay), taken back
                # to back without planning or observing each: at batch 4 on the embedded target planning and
                # observing every step took 8 ms of a 600 ms call, in runs 4
                plain = StepPlan(depth=0, budget=1, cap=policy.cap, shadow=0)
                plain_run(policy, rows, lambda _: general_step(
                    runner, rows, proposer.propose(plain, rows), proposer, verifier, decoding, stats))  # fmt: skip
    finally:  # the drafter's thread and counters, also when a step fails
        drafter.finish(stats)
    policy.finish(stats)
    sequences = rows.result(runner)
    runner.release()  # (its buffers and captured steps, for the model's next call)
    return sequences, stats, runner


def general_step(
    runner, rows: Rows, proposal: Proposal, proposer: Proposer, verifier: Verifier, decoding: Decoding,
    stats: SpecStats,
) -> StepReport:  # fmt: skip
    """One step the general way: the proposal verified, accepted (greedy or sampled, HF's processors per node), the
    drafter told the verdict, each row's accepted path committed and emitted; returns the step's report."""
    verified = verifier.verify(proposal, rows)
    accepted = accept(verified, decoding, stats.near_tie_tolerance, proposer.topk)
    proposer.observe(verified, accepted, rows)  # the drafter learns from the target's verdict
    kept = rows.keep(verified, accepted)  # each row's accepted path, cut where it stops
    runner.commit(torch.tensor(kept.cut, dtype=torch.long), kept.hold)  # (on the host: uploaded as needed)
    rows.emit(kept, verified, accepted)
    return StepReport.of(verified, accepted, kept)


def plain_step(
    runner: ModelRunner, rows: Rows, tokens: torch.Tensor | None = None, proposer: Proposer | None = None
) -> torch.Tensor | None:
    """One greedy plain step as one replay of the runner's fused one-node step (`ModelRunner.decode`) and one read of
    its argmax and near-tie per row, emitted (`Rows.emit_greedy`); `proposer`'s drafter, where it drafts from the
    target's features, is told them. `tokens` [B]: the rows' inputs where known on the device (the last step's choice),
    else read from the rows. Returns the tokens chosen (on the device: the next step's input; a row that has stopped
    decodes on, unread, as in a batch's general step), or None where that step is not captured yet (nothing done)."""
    picks = runner.decode(tokens if tokens is not None else torch.tensor([g[-1] for g in rows.generated]))
    if picks is None:
        return None
    chosen, ties = picks.tolist()
    if proposer is not None and proposer.wants_features:
        proposer.observe_path(runner.features, [1] * rows.batch, [r for r in range(rows.batch) if not rows.done[r]])
    rows.emit_greedy([[c] for c in chosen], [[t] for t in ties])
    return picks[0].clone()  # (a measurement between steps may replay the step before the next one reads it)


def plain_run(policy: StepPolicy, rows: Rows, step: Callable[[Any], Any], tokens: Any = None) -> Any:
    """The plain steps the policy has decided ahead (`StepPolicy.plain_run`), taken back to back and reported together
    (`StepPolicy.observe_plain`): each `step(tokens)` takes one and returns the next one's input (steps compiled
    whole: `plain_step`'s tokens on the device; an eager `general_step` reads its input from the rows); returns the last
    one's."""
    ahead = policy.plain_run(rows)
    if not ahead:
        return tokens
    active = [r for r in range(rows.batch) if not rows.done[r]]
    started, taken = time.perf_counter(), 0
    while taken < ahead and not rows.finished:
        tokens = step(tokens)
        taken += 1
    policy.observe_plain(taken, time.perf_counter() - started, active)
    return tokens


def greedy_step(runner: ModelRunner, rows: Rows, proposal: Proposal, proposer: Proposer) -> StepReport:
    """One greedy step of drafted trees as one replay of the runner's greedy step for their bucket
    (`ModelRunner.verify_greedy`: verified, accepted and committed in one compiled graph) and one read of each row's
    accepted tokens, emitted (`Rows.emit_greedy`), the drafter told what it learns (`Proposer.observe_path`); returns
    the step's report for the policy."""
    # chains refill the captured chain's tokens in place (no tree built); the drafter's next chain, where it drafts in
    # the step's graph, comes back with this step's tokens
    chains = proposal.chains
    tree = [tokens for tokens, _ in proposal.trees] if chains else runner.prepare(proposal.trees)
    active = [not d for d in rows.done]
    tokens, ties = runner.verify_greedy(tree)
    if proposer.wants_features:
        proposer.observe_path(runner.features, [len(t) for t in tokens], [r for r, a in enumerate(active) if a])
    progress = rows.emit_greedy(tokens, ties, proposal.nodes)
    proposer.observe_drafted(runner.drafted, rows)
    nodes = runner.padded_size(proposal.nodes) if chains else tree.num_nodes
    return StepReport.of_rows(proposal, nodes, active, tokens, progress)


def open_runner(
    model: nn.Module, settings: LoopSettings, *, max_new_tokens: int, capture_features: bool
) -> ModelRunner | GenericRunner:
    """The target's runner for one call: the seams' (ModelRunner) or HF's own forward (GenericRunner, where
    `settings.generic`), sized for the call's largest tree and length; `capture_features`: its forwards keep the
    target's features for a drafter that drafts from them; `settings.graphs`: its steps captured and replayed (the
    seams' runner only)."""
    if settings.generic and settings.graphs:
        raise UnsupportedModelError(type(model).__name__, GENERIC_GRAPHS)
    extra = {} if settings.generic else {"graphs": settings.graphs, "compiled": settings.compiled}
    widest = max(settings.tree_budget, settings.num_draft_tokens)
    return (GenericRunner if settings.generic else ModelRunner)(
        model, commit=settings.commit, decode_single_nodes=settings.decode_single_nodes,
        static_shapes=settings.static_shapes, max_depth=settings.num_draft_tokens, max_nodes=widest + 1,
        capacity=max_new_tokens + widest + 2, capture_features=capture_features, **extra,
    )  # fmt: skip


def _settings(settings: LoopSettings | None, fields: dict[str, Any]) -> LoopSettings:
    """The call's loop settings: `settings`, or LoopSettings of the keyword fields a call by hand gave (an unknown one
    is LoopSettings' TypeError, naming it); no draft deeper than the tree's nodes (a chain's budget is its depth)."""
    if settings is not None and fields:
        raise TypeError(f"speculative_generate: settings= with {', '.join(sorted(fields))} as well; give one")
    settings = settings if settings is not None else LoopSettings(**fields)
    return dataclasses.replace(settings, num_draft_tokens=max(0, min(settings.num_draft_tokens, settings.tree_budget)))
