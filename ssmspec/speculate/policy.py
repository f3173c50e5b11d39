"""The step policy: how deep and wide each step drafts, asked once before every step (`plan`) and told once after it
what the step measured (`observe`).

It owns every decision the loop takes about a step's size: the depth limit (HF's heuristic schedule for a draft
model: +2 after a step that accepted every drafted token, -1 otherwise), the node budget, the memory cap
(SpecConfig.verify_memory, an out-of-memory retry) and, with adaptive speculation, each step's depth for the best
expected tokens per unit of cost (`AdaptiveDepth`: ssmspec.speculate.adaptive's acceptance and goodput models priced
with the model's calibration, ssmspec.speculate.calibration), plain steps where speculation does not pay, and the
shadow drafts that follow acceptance while it does not.
"""

from __future__ import annotations

import math
import time

from torch import nn

from ssmspec.speculate import calibration as calibrations
from ssmspec.speculate.adaptive import Acceptance, Goodput, best_depth, depth_gains
from ssmspec.speculate.calibration import Calibration
from ssmspec.speculate.decoding import Decoding
from ssmspec.speculate.drafters import Drafter
from ssmspec.speculate.plan import LoopSettings
from ssmspec.speculate.step import Runner, StepPlan, StepReport
from ssmspec.speculate.step.emit import Rows

# a plain step chosen for low acceptance drafts one token in the shadow every this many steps, to follow the rates
SHADOW_EVERY = 4
SHADOW_MAX = 32
# ... and spends at most this share of the plain steps' time on them (at batch 32 on the embedded target a shadow
# draft cost about 5 ms against a 10-13 ms plain step: every 4 steps, about 10% of the time)
SHADOW_SHARE = 0.01
# where the acceptance model prices every depth below this fraction of plain decoding's rate (and nothing measured
# says otherwise), the next REPRICE_EVERY steps decode plainly without pricing: at batch 8-32, where speculation does
# not pay on the embedded target, pricing every step cost about 1% of a call (8 ms of 640 at batch 8). Each further
# pricing in a row that finds it far doubles the pause, up to REPRICE_FAR_MAX: between shadow drafts (one that hit is
# priced at once) a plain step changes the rates only by aging them, and on the compiled embedded target, which never
# drafted on held-out code, pricing every 4 steps and the policy's bookkeeping per step made the default 0.93x its
# plain decoding
FAR_FROM_PAYING = 0.85
REPRICE_EVERY = 4
REPRICE_FAR_MAX = 32
# pricing a step (tens to a few hundred microseconds of Python) takes at most this share of the plain steps' time: where
# plain steps are that cheap (a compiled 3M model's, about 0.4 ms against 30-150 us of pricing), a plain decision
# holds for the steps that pay for it, up to REPRICE_MAX (a shadow draft that hit still reprices at once). In one run
# at 5% the compiled embedded target's default call ran at 0.95x its plain decoding on held-out code (drafting
# nothing), at 1% 0.99x
PRICING_SHARE = 0.01
REPRICE_MAX = 16
# on steps compiled whole, a speculative depth priced holds for this many steps (the later ones not priced, their
# size the priced one's, within each step's limits; a back-off still ends it): pricing is tens of microseconds of
# Python, and host work between two compiled steps slows the second (on the embedded target a 1 ms pause before a
# replay made it 30% slower). Compiled Nemotron-H medium, default call, 6 held-out prompts alternated in one process,
# three runs: 1.33x, 1.32x and 1.31x compiled plain held for 4 steps, against 1.30x, 1.26x and 1.25x priced every step
PRICE_HOLD = 4
# a depth is priced by the nodes per level the drafter has been drafting (decayed by LEVEL_DECAY per speculative step),
# not by the budget's: a drafter fills a large budget only where it finds that many candidates (n-gram trees of the
# embedded target held 1-2 nodes per level at budgets of 16 to 256), and priced at the budget's 32 nodes per level a
# budget of 256 drafted 1.7 tokens a step against 2.5 at 16. Before any step: the default tree's 2 nodes per level
LEVEL_NODES = 2.0
LEVEL_DECAY = 0.9
# ... and a drafter is asked for at most this many nodes per level of the depth chosen, whatever the budget (n-gram
# trees 16 to 32 nodes per level wide, the budget's shape at 128 and 256 nodes, were as fast as 2 to 4 at best)
WIDEST = 4.0
# what the seconds of a plain step taken back to back are kept under among the acceptance profiles (per batch size)
PLAIN_STEP = "plain step"
# ... and what a drafted step took beyond its forward (`Goodput.overhead_prior`), per batch size and drafter
STEP_OVERHEAD = "step overhead"
# ... and on steps compiled whole, how many pricings in a row had found every depth far from paying when the call
# ended: the next call's pauses start there (the compiled embedded target, whose n-gram trees never paid on held-out
# code, priced at steps 0, 4, 12 and 28 of every call before its pauses reached REPRICE_FAR_MAX)
FAR_PRICED = "far from paying"


class StepPolicy:
    """Each step's depth, node budget and memory cap (see the module docstring).

    Args:
        tree_budget: drafted nodes per row at most.
        num_draft_tokens: draft depth at most (the heuristic schedule may go deeper, its budget growing with it).
        schedule: "constant", or HF's "heuristic" / "heuristic_transient" depth schedule.
        static_shapes: the depth stays within `num_draft_tokens` (one compiled commit length).
        verify_memory: bytes a verify step's buffers may hold, all rows (None: no budget).
        batch: the call's rows.
        adaptive: the adaptive depth choice, or None (every step drafts to the limit).
        calibration: the model's calibration, measured further between steps (at most calibration.SHARE of the
            steps' time), or None.
        runner: the runner it measures on (with `calibration`).
    """

    def __init__(
        self, *, tree_budget: int, num_draft_tokens: int, schedule: str = "constant", static_shapes: bool = False,
        verify_memory: int | None = None, batch: int = 1, adaptive: AdaptiveDepth | None = None,
        calibration: Calibration | None = None, runner=None,
    ) -> None:  # fmt: skip
        self.tree_budget = tree_budget
        self.num_draft_tokens = num_draft_tokens
        self.schedule = schedule
        self.static_shapes = static_shapes
        self.verify_memory = verify_memory
        self.batch = batch
        self.adaptive = adaptive
        self.calibration = calibration
        self.runner = runner
        self.calibration_seconds = 0.0  # this call's measuring (spec_stats["calibration_seconds"])
        self.depth_limit = num_draft_tokens
        self.cap: int | None = None  # nodes per row (root included) a verify step may hold: memory (budget or OOM)
        self.bytes_per_node = 0.0  # verify buffers per row and node, as the largest step measured
        self._started = 0.0

    @classmethod
    def for_call(
        cls, model: nn.Module, runner: Runner, drafter: Drafter, decoding: Decoding, settings: LoopSettings
    ) -> StepPolicy:
        """The policy of one generate call on `model` (its runner prefilled), as its `settings` say: with `adaptive`,
        priced with the model's calibration (ssmspec.speculate.calibration) and the acceptance the last greedy call
        with this drafter and tree shape measured (`AdaptiveDepth`). The calibration also chooses the runner's one-node
        path and linears per tree size; it is measured further between steps, or completed now by a call that samples,
        a sharded model or a compiled model warming up (`calibration.complete_before`)."""
        calibration = calibrations.for_runner(model, runner)
        adaptive, tree_budget, num_draft_tokens = settings.adaptive, settings.tree_budget, settings.num_draft_tokens
        if not (adaptive or calibration.ways != (None,) or calibration.paths != (None,)):
            calibration = None  # nothing this call would use it for
        spent = 0.0
        if calibration is not None:
            if calibrations.complete_before(model, runner, decoding.do_sample) and not calibration.complete:
                spent = calibration.measure(runner)
                calibrations.save(model, runner, calibration)
            calibration.apply(runner)
        depth = None
        if adaptive:
            depth = AdaptiveDepth.for_call(model, runner, drafter, decoding, calibration, tree_budget=tree_budget,
                                           num_draft_tokens=num_draft_tokens)  # fmt: skip
        policy = cls(tree_budget=tree_budget, num_draft_tokens=num_draft_tokens, schedule=settings.schedule,
                     static_shapes=settings.static_shapes, verify_memory=settings.verify_memory,
                     batch=int(runner.n_real.shape[0]),
                     adaptive=depth, calibration=calibration, runner=runner)  # fmt: skip
        policy.calibration_seconds = spent
        if calibration is not None and calibration.out_of_memory is not None:  # a size measured did not fit
            policy.cap = max(1, calibration.out_of_memory // 2)
        return policy

    def plan(self, rows: Rows) -> StepPlan:
        """The next step's plan (its clock starts here: the step's time, pricing included, ends at `observe`)."""
        self._started = time.perf_counter()
        depth = min(self.depth_limit, max(rows.remaining) - 1)
        # the heuristic schedule may go deeper than num_draft_tokens (as HF's): the budget grows with it, so a chain's
        # nodes follow its depth
        budget = self.tree_budget + max(0, depth - self.num_draft_tokens)
        shadow = 0
        if self.adaptive is not None:
            depth, budget, shadow = self.adaptive.choose(rows, depth, budget)
        return StepPlan(depth=depth, budget=budget, cap=self.cap, shadow=shadow)

    def observe(self, report: StepReport) -> None:
        """What the step just taken measured: its time (from `plan`), its acceptance, its buffers."""
        elapsed = time.perf_counter() - self._started
        if report.cap is not None:
            self.cap = report.cap
        if report.held_bytes is not None:
            self.bytes_per_node = report.held_bytes / (self.batch * report.nodes)
        if self.verify_memory is not None and self.bytes_per_node > 0:
            fits = max(1, int(self.verify_memory // (self.bytes_per_node * self.batch)))
            self.cap = fits if self.cap is None else min(self.cap, fits)
        if self.adaptive is not None:
            self.adaptive.observe(report, elapsed)
        if self.schedule != "constant":
            self.depth_limit = self.depth_limit + 2 if report.all_accepted else max(1, self.depth_limit - 1)
            if self.static_shapes:
                self.depth_limit = min(self.depth_limit, self.num_draft_tokens)
        self._calibrate(elapsed)

    def plain_run(self, rows: Rows) -> int:
        """How many of the next steps are plain whatever they measure: no pricing due, no shadow draft, no back-off
        ending (0: plan each). The engine may take them back to back and report them together (`observe_plain`): on
        the compiled embedded target a plain step is about 0.4 ms, and planning and observing each one took 7% of
        it."""
        if self.adaptive is None or self.schedule != "constant":
            return 0
        # (every step of the run but a call's last would plan a depth above 0: the shadow schedule counts those)
        return max(0, min(self.adaptive.plain_run(), max(rows.remaining) - 1))

    def observe_plain(self, steps: int, seconds: float, rows: list[int]) -> None:
        """`steps` plain steps of a `plain_run` took `seconds` together (`rows`: the rows that took part): the
        policy's state as if each had been planned and observed."""
        if steps <= 0:
            return
        self.adaptive.observe_plain(steps, seconds, rows)
        self._calibrate(seconds)

    def _calibrate(self, last_step: float) -> None:
        """Measure the calibration further between steps (within calibration.SHARE of the steps' time) and price with
        what it measured from the next step on."""
        if self.calibration is None:
            return
        spent = self.calibration.measure_between_steps(self.runner, last_step, cap=self.cap)
        self.calibration_seconds += spent
        if self.calibration.out_of_memory is not None:  # a size it measured did not fit: the steps stay below it
            fits = max(1, self.calibration.out_of_memory // 2)
            self.cap = fits if self.cap is None else min(self.cap, fits)
        if spent and self.adaptive is not None:
            self.adaptive.recalibrate(self.calibration)

    def finish(self, stats) -> None:
        """After the call's last step: what it measured is kept for the next call (the calibration on disk too), and
        `stats` told what measuring took and whether the calibration is complete."""
        if self.adaptive is not None:
            self.adaptive.finish()
        if self.calibration is not None:
            if self.calibration_seconds:
                calibrations.save(self.runner.model, self.runner, self.calibration)
            stats.calibration_seconds = self.calibration_seconds
            stats.calibrated = self.calibration.complete


class AdaptiveDepth:
    """Adaptive speculation: each step's depth (0: plain decoding) for the best expected tokens per unit of step
    cost, from each row's acceptance so far (`Acceptance`) and what steps cost (`Goodput`: the calibration's curve
    plus what steps measured beyond their forward); speculation backs off where it measured slower than plain
    decoding, and plain steps chosen for low acceptance still draft one level now and then (shadow drafts) to notice
    when drafts start to pay.

    Args:
        acceptance: the rows' acceptance model (its prior: the last greedy call's profile).
        goodput: the measured side (what steps cost, whether speculating has paid).
        tree_budget: drafted nodes per row at most.
        num_draft_tokens: draft depth at most.
        prices: choose depths (False: a drafter that sizes its own trees by `goodput.cost`; the policy then only
            backs off).
        reruns: the runner feeds a partial commit's prefix again (the generic path's chains: priced).
        profiles: where the acceptance profile is kept for the next call (a dict on the model), under `profile_key`;
            None: not kept (sampling).
        agreement: the runner's (tensor parallelism: the slowest process's times), or None.
    """

    def __init__(
        self, acceptance: Acceptance, goodput: Goodput, *, tree_budget: int, num_draft_tokens: int,
        prices: bool = True, reruns: bool = False, profiles: dict | None = None, profile_key=None, agreement=None,
    ) -> None:  # fmt: skip
        self.acceptance = acceptance
        self.goodput = goodput
        self.tree_budget = tree_budget
        self.prices = prices
        self.reruns = reruns
        self.profiles = profiles
        self.profile_key = profile_key
        self.agreement = agreement
        self.per_depth = max(1.0, tree_budget / max(num_draft_tokens, 1))  # the budget's nodes per level
        self.level_nodes = min(self.per_depth, LEVEL_NODES)  # what drafts held per level (LEVEL_NODES)
        self.steps = 0
        self.reprice_at = 0  # the step from which depths are priced again (it pauses while far from speculating)
        self.far = 0  # pricings in a row that found every depth far from paying (each doubles the pause)
        self.plain_steps = 0  # plain steps chosen in a row (low acceptance), and their shadow drafts' schedule
        self.next_shadow, self.shadows = 1, 0
        # seconds shadow drafts may still spend (SHADOW_SHARE of the plain steps' time), and what the last one took
        self.shadow_budget, self.shadow_cost = 0.0, 0.0
        # a priced speculative (depth, budget) the next steps take without pricing (PRICE_HOLD), and how many more
        self.held: tuple[int, int] = (0, 0)
        self.held_for = 0

    @classmethod
    def for_call(
        cls, model: nn.Module, runner: Runner, drafter: Drafter, decoding: Decoding, calibration: Calibration, *,
        tree_budget: int, num_draft_tokens: int,
    ) -> AdaptiveDepth:  # fmt: skip
        """The adaptive depth of one call: each level's acceptance starts from what the last call with this drafter
        and tree shape measured on this model (kept on the model, as the calibration is; a fresh model: 0.5); not when
        sampling, where a seed draws the same tokens whatever ran before (the depths decide which random numbers are
        drawn), and no decision then follows this call's timing either (`Goodput(measured=False)`)."""
        batch = int(runner.n_real.shape[0])
        sampling = decoding.do_sample
        profiles = None if sampling else model.__dict__.setdefault("_ssmspec_acceptance", {})
        key = (drafter_kind(drafter), tree_budget, num_draft_tokens)
        acceptance = Acceptance(batch, prior=(profiles or {}).get(key, 0.5))
        # every step is timed: the cost of n nodes is the calibrated curve at the bucket n is padded to plus what a
        # step measured beyond its forward (drafting, bookkeeping), and speculation backs off where it measured slower
        # than plain decoding
        # (steps compiled whole: priced against the loop's plain steps, from the last greedy call's until measured)
        loop_base = bool(runner.fuse_single_nodes)
        goodput = Goodput(
            calibration.curve(),
            calibration.decode_seconds(),
            batch=batch,
            measured=not sampling,
            loop_base=loop_base,
            plain_prior=(profiles or {}).get((PLAIN_STEP, batch)),
            padded=runner.padded_size if runner.static_shapes else None,
            overhead_prior=(profiles or {}).get((STEP_OVERHEAD, batch, key)),
        )
        # a drafter with calibrated per-node estimates sizes each tree itself; depth and budget then stay at their
        # maximum
        sized = drafter.size_by_goodput(goodput.cost)
        depth = cls(acceptance, goodput, tree_budget=tree_budget, num_draft_tokens=num_draft_tokens, prices=not sized,
                    reruns=bool(runner.reruns), profiles=profiles, profile_key=key,
                    agreement=runner.agreement)  # fmt: skip
        if loop_base and profiles:
            depth.far = profiles.get((FAR_PRICED, batch, key), 0)
        return depth

    def choose(self, rows: Rows, depth: int, budget: int) -> tuple[int, int, int]:
        """(depth, budget, shadow nodes) of the next step, within `depth` and `budget`."""
        if self.goodput.plain:
            self.held_for = 0
            return 0, budget, 0  # speculation measured slower than plain decoding: back off
        if not self.prices:
            return depth, budget, 0
        if self.held_for > 0:  # a priced speculative step's size, held (PRICE_HOLD)
            self.held_for -= 1
            return min(self.held[0], depth), min(self.held[1], budget), 0
        chosen = self._priced(rows, max(depth, 0))
        shadow = 0
        if chosen == 0 and depth > 0:
            # plain decoding: the drafter's first level still tells how accurate it is now (a shadow draft costs a
            # drafting call: SHADOW_EVERY plain steps apart, twice as far after every SHADOW_EVERY of them in a run of
            # plain steps, up to SHADOW_MAX, and at most SHADOW_SHARE of the plain steps' time)
            self.plain_steps += 1
            affordable = self.shadow_budget >= self.shadow_cost or not self.goodput.measured
            if self.plain_steps >= self.next_shadow and affordable:
                shadow = max(1, min(self.tree_budget, int(round(min(self.per_depth, WIDEST)))))
                self.shadows += 1
                spacing = min(SHADOW_MAX, SHADOW_EVERY * 2 ** (self.shadows // SHADOW_EVERY))
                self.next_shadow = self.plain_steps + spacing
        elif chosen > 0:
            self.plain_steps, self.next_shadow, self.shadows = 0, 1, 0
        width = min(self.per_depth, WIDEST)
        nodes = max(1, min(self.tree_budget, int(round(width * chosen))))
        if chosen > 0 and self.goodput.loop_base and self.goodput.measured:
            self.held, self.held_for = (chosen, nodes), PRICE_HOLD - 1
        return chosen, nodes, shadow

    def _priced(self, rows: Rows, depth: int) -> int:
        """The depth (0..depth) of the most expected progress per unit of cost. The batch ends with its last row, and a
        row that finished early holds its slot idle until then, so a depth is priced by how much nearer it brings
        that end (`Acceptance.progress_survival`: each unfinished row by how far it is ahead of the row with the most
        left; at batch 8 on the embedded target, speculating for the mean row measured 0.94x HF greedy: the rows
        that accepted less finished 20 steps after the others)."""
        if self.steps < self.reprice_at:
            return 0  # priced far from paying a few steps ago: acceptance moves slowly, plain until repriced
        started = time.perf_counter()
        remaining = rows.remaining
        unfinished = [r for r in range(rows.batch) if not rows.done[r]]
        most = max(remaining[r] for r in unfinished)
        behind = [most - remaining[r] for r in unfinished]
        rates = [self.acceptance.progress_survival(unfinished, behind, depth)]
        gains = depth_gains(rates, self.goodput.cost, depth, self.level_nodes, reruns=self.reruns)
        chosen = best_depth(gains)
        best = max(gains[1:], default=0.0)
        if chosen == 0 and len(gains) > 1 and self.goodput.keeps_speculating(best):
            chosen = best_depth(gains, 1)  # measured winning, a back-off's retry, or a first try
        elif chosen == 0 and best < FAR_FROM_PAYING:  # (nothing measured could make it speculate)
            self.reprice_at = self.steps + min(REPRICE_FAR_MAX, REPRICE_EVERY * 2**self.far)
            self.far += 1
            return chosen
        elif chosen == 0 and self.goodput.measured and self.goodput.plain_seconds:  # (timed calls only: greedy)
            # pricing costs more than PRICING_SHARE of a plain step: the next ones decode plainly until they paid for it
            spent = time.perf_counter() - started
            self.reprice_at = self.steps + min(REPRICE_MAX, int(spent / (PRICING_SHARE * self.goodput.plain_seconds)))
        self.far = 0
        return chosen

    def observe(self, report: StepReport, elapsed: float) -> None:
        """A step's acceptance per row and its time, judged by how much nearer its end it brought the batch (under
        tensor parallelism the slowest process's times, so every process takes the same decisions)."""
        self.steps += 1
        levels = [(report.sizes[r], d) for r, d in report.drafted.items() if d > 0]
        if report.depth > 0 and levels:
            observed = sum(n for n, _ in levels) / sum(d for _, d in levels)
            self.level_nodes = min(self.per_depth, LEVEL_DECAY * self.level_nodes + (1 - LEVEL_DECAY) * observed)
        if self.prices:
            for r, drafted in report.drafted.items():
                if report.depth > 0:
                    self.acceptance.update(r, drafted, report.accepted[r])
                elif r in report.shadow_hits:
                    self.acceptance.update(r, 1, int(report.shadow_hits[r]))
                    if report.shadow_hits[r]:  # news that may make drafting pay: priced again next step (a miss
                        self.reprice_at = 0  # only lowers the rates of a policy already decoding plainly)
                else:
                    self.acceptance.elapse(r)
        times = [elapsed, report.shadow_seconds]
        elapsed, shadow_seconds = self.agreement.seconds(times) if self.agreement is not None else times
        seconds = elapsed - shadow_seconds
        if report.shadow:
            self.shadow_cost = self._shadow_cost(elapsed, shadow_seconds)
            self.shadow_budget -= self.shadow_cost
        self.goodput.record(report.nodes, seconds, report.progress)
        if report.nodes <= 1:
            self._earn_shadow(seconds)

    def _shadow_cost(self, elapsed: float, shadow_seconds: float) -> float:
        """What a shadow draft cost: its drafting, and on steps compiled whole all that its planned step (`elapsed`)
        took beyond a plain step of a back-to-back run (pricing, the draft, the replay after them): on the embedded
        target 0.2-0.3 ms against 0.8 for a step of a run, where the drafting alone was a fraction of it, and ten
        shadow drafts a 128-token call planned a step in four."""
        run = self.goodput.run_seconds
        return max(shadow_seconds, elapsed - run) if run else shadow_seconds

    def plain_run(self) -> int:
        """The next steps `choose` decodes plainly without pricing them or drafting a shadow: a back-off's (`Goodput`)
        or a pause in pricing's (`_priced`), up to the step before the next shadow draft is due and paid for."""
        if self.goodput.plain:
            return self.goodput.forced
        if not self.prices or self.steps >= self.reprice_at:
            return 0
        shadow = self.next_shadow - self.plain_steps - 1  # plain steps before a shadow draft is due
        if self.goodput.measured:
            # ... and before the plain steps paid for it (`choose`): the steps that earn it at the recent pace, all in
            # one run (a run that ended where the draft fell due, or one step short of its price, left the compiled
            # embedded target planning a step alone that drafted nothing)
            step = self.goodput.plain_seconds
            owed = self.shadow_cost - self.shadow_budget
            shadow = max(shadow, math.ceil(owed / (SHADOW_SHARE * step)) if step and owed > 0 else 0)
        return max(0, min(self.reprice_at - self.steps, shadow))

    def observe_plain(self, steps: int, seconds: float, rows: list[int]) -> None:
        """`steps` plain steps of a `plain_run` took `seconds` together: as `choose` then `observe` of each (the
        same counts, the rows' acceptance aged, each step timed as their mean)."""
        if not self.goodput.plain:
            self.plain_steps += steps  # (as `choose` counts a plain step it chose)
        self.steps += steps
        if self.prices:
            for r in rows:
                self.acceptance.elapse(r, steps)
        if self.agreement is not None:  # (every process agrees on the run's time, as on each step's)
            seconds = self.agreement.seconds([seconds, 0.0])[0]
        self.goodput.record_run(steps, seconds)
        self._earn_shadow(seconds)

    def _earn_shadow(self, seconds: float) -> None:
        """Plain steps of `seconds` (together) pay SHADOW_SHARE of their time toward the next shadow draft, which waits
        until they paid for the last one's cost (kept at most twice that)."""
        self.shadow_budget = min(self.shadow_budget + SHADOW_SHARE * seconds, 2 * self.shadow_cost)

    def recalibrate(self, calibration: Calibration) -> None:
        """Price with what the calibration measured since the last step."""
        self.goodput.recalibrate(calibration.curve(), calibration.decode_seconds())

    def finish(self) -> None:
        """Keep the call's acceptance profile as the next greedy call's prior, what its drafted steps took beyond
        their forwards (`Goodput.overhead_prior`: read on steps compiled whole and at a batch), and on steps compiled
        whole the plain step's seconds its loop measured back to back (`Goodput.plain_prior`) and how far from paying
        its last pricings found drafts (FAR_PRICED)."""
        if self.profiles is not None:
            self.profiles[self.profile_key] = self.acceptance.profile()
            if self.goodput.run_seconds:
                self.profiles[(PLAIN_STEP, self.goodput.batch)] = self.goodput.run_seconds
            if self.goodput.overhead.sums[0] > 0:  # (measured on this call's drafted steps)
                self.profiles[(STEP_OVERHEAD, self.goodput.batch, self.profile_key)] = self.goodput.overhead.fit()
            if self.goodput.loop_base:
                self.profiles[(FAR_PRICED, self.goodput.batch, self.profile_key)] = self.far


def drafter_kind(drafter: Drafter) -> str:
    """What an acceptance profile is kept under: the drafter's class and those of the drafters it wraps."""
    inner = [getattr(drafter, name, None) for name in ("draft", "retrieval", "base")]
    return "/".join([type(drafter).__name__] + [drafter_kind(d) for d in inner if isinstance(d, Drafter)])
