"""Adaptive speculation (SmartSpec style): choose each step's draft depth, including 0 (plain decoding), to
maximise expected goodput = expected tokens per step / step cost. Acceptance is tracked online per row; the
step cost of verifying n nodes, relative to one decode step, is measured on the running model once.

Where a draft's j-th token is accepted with probability s_j (its survival, measured level by level: `Acceptance`), a
chain of depth k yields 1 + s_1 + ... + s_k tokens in expectation (the accepted drafts and the bonus token); under
one rate a per token, s_j = a^j. With a low rate the best depth is 0: the step is plain decoding and costs nothing
extra.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence


class Acceptance:
    """Per-row acceptance of drafted tokens, level by level: the rate at which a draft's j-th token is accepted where
    the j - 1 before it were. Drafts are not accepted at one rate per token: a row's acceptance comes in runs
    (repeated code, a phrase a head foresees), so a draft that got past its first tokens goes on more often than the
    first were accepted (the embedded target on held-out code, 16 prompts: the draft head's trees 0.84, 0.70, 0.62,
    0.65, 0.78, 0.85 per level; prompt lookup's 0.28, 0.69, 0.75, 0.82, 0.88, 0.92). One rate per row priced deep
    trees from their first level: after three early rejections it called a tree that then gained 2.7 tokens a step a
    loss, and the call decoded plainly. Each level's rate is a decayed success ratio per row, pulled toward that
    level's rate over all rows (batch 1: the row's own), itself pulled toward a weak prior.
    """

    PLAIN_DECAY = 0.93  # per plain step (one token), about what a speculative step's `decay` is per token
    # pseudo-trials the call's prior counts for in its profile (the next call's prior): a level a call tried a few
    # times stays near what the calls before it measured. Weighed like the rows' own counts (2), a call that tried a
    # third level 7 times without success handed 0.11 on to every deeper level, the next calls drafted too shallow
    # to correct it, and the default gained 1.20x ssmspec's plain decoding on the held-out prompts instead of 1.41x
    PROFILE_WEIGHT = 8.0
    FLOOR = 0.75  # a level's prior is at least this times the level above's (`_priors`)
    # a lone row's counts are pulled once toward the priors with this many pseudo-trials (`level_rates`): two misses
    # at a first level of prior 0.7 read 0.25 (0.17 pulled twice, toward the pooled counts that were its own), a level
    # accepted whenever reached 0.86 after 40 steps. On the compiled 19.6M Nemotron-H (11 held-out prompts, alternated
    # in one process) the default ran at 1.23-1.27x ssmspec's plain decoding against 1.02x pulled twice; 1 and 2
    # pseudo-trials measured alike there and on the eager 3M target (1.10-1.11x)
    ONE_ROW_WEIGHT = 1.0

    def __init__(
        self, rows: int, prior: float | Sequence[float] = 0.5, weight: float = 2.0, decay: float = 0.8
    ) -> None:
        self.priors = [float(prior)] if isinstance(prior, (int, float)) else [float(p) for p in prior] or [0.5]
        self.weight = weight
        self.decay = decay
        self.success: list[list[float]] = [[] for _ in range(rows)]  # per row and level (level j at index j - 1)
        self.trials: list[list[float]] = [[] for _ in range(rows)]
        self._aging = [0] * rows  # per row, plain steps not yet applied to its counts (`elapse`)
        # every row's counts together, decayed per row's update so that they span as many steps as one row's
        self.pooled_success: list[float] = []
        self.pooled_trials: list[float] = []
        self._pooled_decay = decay ** (1.0 / max(rows, 1))
        self.total_success: list[float] = []  # ... and over the whole call, undecayed (`profile`)
        self.total_trials: list[float] = []

    def update(self, row: int, drafted: int, accepted: int) -> None:
        """A step drafted `drafted` tokens deep for `row` and `accepted` of them were accepted: levels 1..accepted
        succeeded, level accepted + 1 failed (if drafted), deeper levels were not reached."""
        if drafted <= 0:
            return
        self._age(row)
        reached = min(drafted, accepted + 1)
        for counts, totals, decay in (
            (self.success[row], self.trials[row], self.decay),
            (self.pooled_success, self.pooled_trials, self._pooled_decay),
            (self.total_success, self.total_trials, 1.0),
        ):
            while len(totals) < reached:
                counts.append(0.0)
                totals.append(0.0)
            for j in range(len(totals)):
                counts[j] *= decay
                totals[j] *= decay
                if j < reached:
                    totals[j] += 1.0
                    counts[j] += 1.0 if j < accepted else 0.0

    def elapse(self, row: int, steps: int = 1) -> None:
        """`row` decoded a token plainly (`steps` of them, in as many plain steps): its own counts age by PLAIN_DECAY
        a step, toward the rates over all rows and calls. A row's acceptance comes in runs, and a plain step tells
        nothing about the run it is in now: where a few early rejections priced speculation out, the counts that did
        so would otherwise stand for the rest of the call (held-out code at batch 1: 92 plain steps in a row on a
        prompt where trees gained 2.7 tokens a step). Counted here, applied where the row's counts are next read
        (`_age`): a batch of 32 rows decoding plainly aged every row's levels on every step (5 ms of a 1.6 s call)."""
        self._aging[row] += steps

    def _age(self, row: int) -> None:
        """Apply the plain steps `elapse` counted for `row`: its counts times PLAIN_DECAY per step."""
        steps = self._aging[row]
        if steps:
            self._aging[row] = 0
            factor = self.PLAIN_DECAY**steps
            for counts in (self.success[row], self.trials[row]):
                for j in range(len(counts)):
                    counts[j] *= factor

    def _pulled(
        self, success: list[float], trials: list[float], toward: Sequence[float], weight: float | None = None
    ) -> list[float]:
        """Each level's success ratio in these counts pulled toward its target in `toward` (one per level asked for;
        a level without counts: its target) with `weight` pseudo-trials (default: the rows' `weight`)."""
        w, known = self.weight if weight is None else weight, min(len(toward), len(trials))
        return [(success[j] + w * toward[j]) / (trials[j] + w) for j in range(known)] + list(toward[known:])

    def _priors(self, levels: int) -> list[float]:
        """Levels 1..`levels`' priors (a list of priors shorter than the levels: its last for the deeper ones), each at
        least FLOOR times the one above it. Drafts are accepted in runs, so a level is accepted about as often as the
        one above it or more (held-out code: 0.84, 0.70, 0.62, ... for the draft head); a level priced far below it
        is never drafted, so never measured again: a profile whose third level read 0.11 (seven failures in one
        call) kept every later call two levels deep."""
        out = self._floored(list(self.priors[:levels]), range(1, min(levels, len(self.priors))))
        return out + out[-1:] * (levels - len(out))

    def _floored(self, rates: list[float], levels: Iterable[int]) -> list[float]:
        """`rates` with each of `levels` (ascending, not the first) at least FLOOR times the level above's, in place."""
        for j in levels:
            rates[j] = max(rates[j], self.FLOOR * rates[j - 1])
        return rates

    def _pooled(self, depth: int) -> list[float]:
        """Each level's rate over all rows (1..depth), pulled toward its prior; a level no row has reached yet in this
        call at least FLOOR times the level above's (as the priors: `_priors`), so that the level gets drafted and
        measured once the levels above it prove better than their priors said."""
        rates = self._pulled(self.pooled_success, self.pooled_trials, self._priors(depth))
        return self._floored(rates, _unreached(self.pooled_trials, depth))

    def level_rates(self, row: int, depth: int, pooled: list[float] | None = None) -> list[float]:
        """The rates of levels 1..depth for `row` (each given the levels before it were accepted), pulled toward the
        rates over all rows; `pooled`: those (`_pooled`), where a caller asks for many rows."""
        self._age(row)
        if len(self.success) == 1:
            # one row: the pooled counts are its own, and pulled toward them it was shrunk twice (two misses at a
            # first level of prior 0.7 read 0.17): its counts pulled once toward the priors, with ONE_ROW_WEIGHT
            rates = self._pulled(self.success[row], self.trials[row], self._priors(depth), self.ONE_ROW_WEIGHT)
            return self._floored(rates, _unreached(self.trials[row], depth))
        pooled = self._pooled(depth) if pooled is None else pooled
        return self._pulled(self.success[row], self.trials[row], pooled[:depth])

    def survival(self, row: int, depth: int, pooled: list[float] | None = None) -> list[float]:
        """P(at least j drafted tokens accepted) for j = 1..depth: the chance a chain `depth` deep gets past each."""
        out, p = [], 1.0
        for r in self.level_rates(row, depth, pooled):
            p *= r
            out.append(p)
        return out

    def progress_survival(self, rows: Sequence[int], behind: Sequence[int], depth: int) -> list[float]:
        """P(a step drafting `depth` deep brings the batch's end more than j tokens nearer) for j = 1..depth: what
        `depth_gains` prices a batch by (`step.emit.batch_progress` is what a step is then measured by). A batch ends
        with its last row: the end comes j + 1 tokens nearer only where every unfinished row gains enough, and a row
        `behind[i]` tokens nearer its own end than the row with the most left needs j + 1 - behind[i]. Rows taken
        as independent: the product over `rows` of each one's survival j - behind[i] levels deep (1 where that is
        below 1). The rows' mean survival, which this replaced, priced rows that keep pace as one row: four rows
        each passing a level at 0.8 pass it together at 0.41, and at batch 4 the model's tries drafted 25-node trees
        that moved the batch 2 tokens a step at 3.4x a plain step's time."""
        pooled = self._pooled(depth)
        out = [1.0] * depth
        for r, gap in zip(rows, behind):
            if gap >= depth:  # this far ahead of the last row, it holds the batch up at no depth drafted
                continue
            for i, p in enumerate(self.survival(r, depth - gap, pooled)):
                out[gap + i] *= p
        return out

    def profile(self) -> list[float]:
        """Every level's rate over all rows and all of this call's steps, pulled toward the call's prior with
        PROFILE_WEIGHT pseudo-trials (the prior where a level was never reached): the prior of the next call with the
        same drafter on the same model."""
        levels = max(len(self.total_trials), len(self.priors))
        return self._pulled(self.total_success, self.total_trials, self._priors(levels), self.PROFILE_WEIGHT)

    def rate(self, row: int) -> float:
        """The first level's rate: how often `row`'s next token is among the draft's first."""
        return self.level_rates(row, 1)[0]


def _unreached(trials: Sequence[float], depth: int) -> Iterator[int]:
    """Levels 2..depth (as indices 1..depth - 1) these counts hold less than one trial of: not reached yet."""
    return (j for j in range(1, depth) if j >= len(trials) or trials[j] < 1.0)


def survival_of(rates: float | Sequence[float], depth: int) -> list[float]:
    """P(at least j drafted tokens accepted) for j = 1..depth: a survival as given (its first `depth`), or of a draft
    whose every token is accepted at one rate (rate^j)."""
    if isinstance(rates, (int, float)):
        return [rates**j for j in range(1, depth + 1)]
    return list(rates[:depth])


def expected_tokens(survival: float | Sequence[float], depth: int) -> float:
    """Expected tokens of one step (accepted drafts + bonus) for a chain of `depth`, given its survival (or a rate
    for every token)."""
    return 1.0 + sum(survival_of(survival, depth))


def rerun_cost(
    survival: float | Sequence[float], depth: int, cost: dict[int, float] | Callable[[int], float], nodes: int
) -> float:
    """Expected extra cost of an `nodes`-node chain step of `depth` on a path whose partial commits feed the
    accepted prefix again, in the next step's forward (ssmspec.speculate.generic): where a draft is rejected after
    j accepted tokens (probability survival[j] - survival[j + 1]), the root and those j lengthen the next forward
    by j + 1 tokens. `survival`: a rate for every token, or P(at least j accepted) for j = 1..depth."""
    s = [1.0, *survival_of(survival, depth)]
    base = step_cost(cost, nodes)
    return sum((s[j] - s[j + 1]) * (step_cost(cost, nodes + j + 1) - base) for j in range(depth))


def depth_gains(
    rates: Sequence[float | Sequence[float]],
    cost: dict[int, float] | Callable[[int], float],
    max_depth: int,
    nodes_per_depth: float,
    reruns: bool = False,
) -> list[float]:
    """Per depth 0..max_depth, the expected tokens per unit of step cost summed over rows, relative to plain decoding
    (depth 0: 1.0); a depth-k step verifies about 1 + nodes_per_depth * k nodes (`reruns`: plus `rerun_cost`).
    `rates`: per row a rate for every token, or its survival (`Acceptance.survival`, at least max_depth long)."""
    survival = [survival_of(r, max_depth) for r in rates]
    gains = []
    tokens = 0.0  # sum over rows of expected_tokens at depth k, grown one depth at a time (a batch of 32: 0.25 ms)
    for k in range(max_depth + 1):
        tokens += sum(s[k - 1] for s in survival) if k else len(survival)
        n = 1 + int(round(nodes_per_depth * k))
        rerun = sum(rerun_cost(s, k, cost, n) for s in survival) / max(len(survival), 1) if reruns else 0.0
        gains.append(tokens / (step_cost(cost, n) + rerun))
    plain = gains[0] or 1.0
    return [g / plain for g in gains]


def best_depth(gains: Sequence[float], least: int = 0) -> int:
    """The depth (at least `least`) of the highest gain; ties go to the shallower (cheaper) depth."""
    best, best_depth = -1.0, least
    for k in range(least, len(gains)):
        if gains[k] > best * 1.0001:
            best, best_depth = gains[k], k
    return best_depth


def step_cost(cost: dict[int, float] | Callable[[int], float], nodes: int) -> float:
    """Relative cost of verifying `nodes` nodes, interpolated (linearly) in the measured curve (or the price a
    callable gives: Goodput.cost)."""
    if callable(cost):
        return cost(nodes)
    sizes = sorted(cost)
    if nodes <= sizes[0]:
        return cost[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if nodes <= hi:
            return cost[lo] + (cost[hi] - cost[lo]) * (nodes - lo) / (hi - lo)
    lo, hi = sizes[-2], sizes[-1]
    return cost[hi] + (cost[hi] - cost[lo]) * (nodes - hi) / (hi - lo)


class StepOverhead:
    """Seconds a speculative step takes beyond its forward, fitted as a + b x over the recent steps, x the drafted
    nodes over all rows ((nodes - 1) x batch): a fixed part a (a draft head's calls, the loop) and a part b per
    drafted node and row (n-gram lookups, tree building and walks, commits). On the embedded target (this 2-core
    Xeon) a was 1.5 ms at batch 4 and 2.3 at 16, b 30-35 us at both: a constant overhead priced 25-node trees at
    batch 4 a third too cheap, one in proportion to the forward priced batch 1's trees too dear (its forward
    hardly grows with the tree). Decayed least squares; the slope is pulled toward the prior where the recent
    steps' sizes hardly differ (their spread is what tells the two parts apart).

    Args:
        fixed: the prior's fixed part (seconds), until a step is measured.
        slope: the prior's seconds per drafted node and row.
        decay: weight of the past.
    """

    RIDGE = 0.25  # the prior slope weighs as much as sizes spread by half their mean

    def __init__(self, fixed: float, slope: float, decay: float = 0.9) -> None:
        self.prior = (fixed, slope)
        self.decay = decay
        self.sums = [0.0] * 5  # weight, x, y, x^2, x y
        self._fit: tuple[float, float] | None = None  # the fit of these sums (a depth choice asks it ~10 times)

    def add(self, x: float, y: float) -> None:
        """A step with `x` drafted node-rows took `y` seconds beyond its forward."""
        self.sums = [self.decay * v + new for v, new in zip(self.sums, (1.0, x, y, x * x, x * y))]
        self._fit = None

    def fit(self) -> tuple[float, float]:
        """(a, b): the fixed seconds and the seconds per drafted node-row."""
        w, sx, sy, sxx, sxy = self.sums
        if w <= 0:
            return self.prior
        mx, my = sx / w, sy / w
        ridge = self.RIDGE * w * mx * mx
        spread, covar = sxx - w * mx * mx, sxy - w * mx * my
        slope = max(0.0, (covar + ridge * self.prior[1]) / (spread + ridge) if spread + ridge > 0 else self.prior[1])
        fixed = my - slope * mx
        if fixed < 0:  # all of it per node
            return 0.0, max(my, 0.0) / mx if mx > 0 else 0.0
        return fixed, slope

    def __call__(self, x: float) -> float:
        if self._fit is None:
            self._fit = self.fit()
        fixed, slope = self._fit
        return fixed + slope * x


class Goodput:
    """The measured side of adaptive speculation: what a step really costs, drafting and the host's bookkeeping
    included, and whether speculating has paid (SmartSpec's goodput, measured rather than modelled).

    The verify-cost curve prices the target's forward alone. A speculative step also drafts (a draft head's or draft
    model's forwards, n-gram lookups per row), walks the tree and commits; at a large batch that overhead decides
    whether speculation pays (on the embedded target, batch 32, one level of drafting cost about 5 ms against a
    10-13 ms plain step). Every step is timed; a speculative step's time beyond the curve's forward is its overhead,
    fitted as a fixed part and a part per drafted node and row (`StepOverhead`; `cost` adds it to the curve, so
    depths and drafters' own sizing weigh it).

    And the tokens speculative steps gained per second, summed over the call with a long memory (LONG_DECAY per
    step, plain steps included), are compared with a plain step's (the median of the loop's recent plain steps, its
    first aside) after every speculative step from the WINDOW-th on. Where speculating has not beaten it, the next
    `backoff` steps decode plainly (no drafting at all) and the back-off doubles up to MAX_BACKOFF; where it has, it
    goes on whatever the acceptance model says, which then only sizes the trees. A step's tokens are heavy-tailed (a
    tree rejected at its first node, or accepted eight deep in repeated code), so a few steps judge it badly:
    windows of 16 steps at batch 1 backed off from calls where always speculating measured 1.56x plain decoding, and
    the default reached 1.40x. Where speculation wins by less than REFRESH_MARGIN, a plain step every REFRESH_EVERY
    speculative ones keeps the bar measured.

    Args:
        curve: the verify-cost curve (nodes -> cost relative to a decode step).
        decode_seconds: a decode step's forward in seconds (the curve's base), as measured.
        batch: the batch's rows (a step's drafted nodes are its nodes beyond the root times the rows).
        measured: False: `record` changes nothing (sampling: seeded draws must not depend on the machine's load).
        loop_base: steps compiled whole: price relative to the loop's own plain steps once measured, even where they
            are faster than the calibrated one (`seconds`), and judge speculation against the plain steps the loop
            took back to back (`record(run=True)`) once there are any.
        plain_prior: (with `loop_base`) a plain step's seconds as the last greedy call's loop took them back to back,
            the base until this call's are measured (`AdaptiveDepth` keeps it on the model).
        padded: the node count a tree of n nodes is verified with (static shapes: its bucket, whose forward it costs;
            a 3-node chain in a 4-node bucket, priced between the 2- and 4-node forwards, looked cheaper than the
            4-node chain beside it, which drafts a token more for the same step); None: n.
        overhead_prior: (with `measured`, and `loop_base` or a batch) the overhead's fit (fixed seconds, seconds per
            drafted node and row) as the last greedy call with this drafter at this batch size measured it
            (`AdaptiveDepth` keeps it on the model), the prior until this call's steps are measured. From PRIOR_FIXED
            alone every call priced its first drafted steps as the calibration's forwards timed alone, where a call's
            greedy steps on the compiled 3M target took 1.5 to 2.5 plain steps more: each call's first tries, with
            n-grams on held-out code, lost them. Eager, at batch 4 a step drafted by the embedded target's head took
            2.2 plain steps (its head's levels: 5 ms beyond a 5 ms forward) and every call lost its first tries
            again (default / plain decoding, held-out code and prose, batches 4-16: 0.92-1.00x, carried 0.96-1.03x);
            at batch 1 the carried fit made the next calls try less where trying paid (1.16x against 1.22x).
    """

    MAX_BACKOFF = 64
    FIRST_BACKOFF = 4
    LONG_DECAY = 1 - 1 / 64  # the weight a step's tokens and seconds lose per later step
    PRIOR_FIXED = 0.3  # the fixed overhead's prior, in decode steps
    PRIOR_SLOPE = 30e-6  # seconds per drafted node and row (the embedded target on a 2-core Xeon: 30-35 us)
    PLAIN_SAMPLES = 8
    MARGIN = 1.05  # how close to plain decoding the model must price a try, and how much a first try must beat a bare
    # decode forward by, before any plain step measured the bar
    REFRESH_MARGIN = 1.2
    REFRESH_EVERY = 16
    WINDOW = 3  # speculative steps (beyond the first) before the first judgement
    CONFIDENCE = 1.0  # standard errors of the measured rate below the bar that judge speculation losing
    RECENT = 16  # speculative steps whose mean bounds a stall

    def __init__(
        self,
        curve: dict[int, float],
        decode_seconds: float | None,
        batch: int = 1,
        measured: bool = True,
        loop_base: bool = False,
        plain_prior: float | None = None,
        padded: Callable[[int], int] | None = None,
        overhead_prior: tuple[float, float] | None = None,
    ) -> None:
        self.curve = curve
        self.padded = padded
        self.measured = measured
        self.loop_base = loop_base
        self.plain_prior = plain_prior if loop_base else None
        self.decode_seconds = decode_seconds or 0.0  # 0: unknown (a curve given without its timing)
        self.batch = batch
        # what speculative steps take beyond their forward (the first one, which also sets the drafter up, aside)
        # the overhead's prior as a call before measured it (steps compiled whole and a batch, where it was measured to
        # matter)
        self.carried = measured and (loop_base or batch > 1) and overhead_prior is not None
        prior = overhead_prior if self.carried else (self.PRIOR_FIXED * self.decode_seconds, self.PRIOR_SLOPE)
        self.overhead = StepOverhead(*prior)
        self.spec_steps = 0
        self.plain_steps = 0
        self.since_plain = 0  # speculative steps since the last plain one
        self._plain: collections.deque = collections.deque(maxlen=self.PLAIN_SAMPLES)  # (seconds, rate)
        self._runs: collections.deque = collections.deque(maxlen=self.PLAIN_SAMPLES)  # ... of back-to-back runs
        self._plain_medians: tuple[float, float] | None = None  # of `_plain`, computed where read (None: stale)
        self.spec_rate: float | None = None  # tokens per row and second of speculative steps, long memory
        self.forced = 0  # plain steps still to take before speculating again
        self.winning = False  # the last judgement found speculation beating plain decoding
        self.retry_due = False  # a back-off ended and no speculative step has run since
        self.backoff = self.FIRST_BACKOFF
        # speculative steps' tokens x and row-seconds t (sums of x, t, x^2, t^2, x t), decayed by LONG_DECAY per step
        self._sums = [0.0] * 5
        self._counted = 0  # speculative steps in those sums
        self._recent: collections.deque = collections.deque(maxlen=self.RECENT)  # recent speculative steps' seconds

    def recalibrate(self, curve: dict[int, float], decode_seconds: float | None) -> None:
        """Price with what the calibration measured since (between steps: ssmspec.speculate.calibration)."""
        self.curve = curve
        if decode_seconds and not self.decode_seconds and not self.carried:  # the prior is in plain steps: known now
            self.overhead.prior = (self.PRIOR_FIXED * decode_seconds, self.PRIOR_SLOPE)
            self.overhead._fit = None
        self.decode_seconds = decode_seconds or 0.0

    def _medians(self) -> tuple[float, float] | None:
        # steps compiled whole: the plain steps taken back to back where there are any. One taken between drafted
        # steps, priced and planned, is slower (the embedded Bamba: 0.9-1.0 ms a step back to back, 1.9-2.8 ms between
        # drafted steps of 8 to 17 nodes): judged against those, drafts that gained half a token a step "won"
        # whole calls at 0.75x plain decoding
        samples = self._runs if self.loop_base and self._runs else self._plain
        if self._plain_medians is None and samples:
            self._plain_medians = (statistics.median(t for t, _ in samples),
                                   statistics.median(r for _, r in samples))  # fmt: skip
        return self._plain_medians

    @property
    def plain_seconds(self) -> float | None:
        """Seconds a plain step takes, all in (the median of the recent ones; None before any counted)."""
        medians = self._medians()
        return medians[0] if medians else None

    @property
    def run_seconds(self) -> float | None:
        """(`loop_base`) Seconds a plain step took back to back (the median of the recent ones; None before any)."""
        return self.plain_seconds if self.loop_base and self._runs else None

    @property
    def plain_rate(self) -> float | None:
        """Tokens per row and second of plain steps (the median of the recent ones; None before any counted)."""
        medians = self._medians()
        return medians[1] if medians else None

    @property
    def seconds(self) -> float:
        """A decode step's forward in seconds: the curve's base as measured, or where plain steps ran, what they
        took (the measured base runs on a warm cache, alone; an eager loop's steps take longer). With `loop_base`,
        what the loop's plain steps took (or the last call's, `plain_prior`), even where less: a compiled step timed
        alone, between roll-backs, found the cores' threads asleep (the embedded 3M target: 1.2-1.5 ms against
        0.7-0.8 ms taken back to back in a call), and priced against it a verify step of 2 nodes cost 1.5 plain steps
        where it took 2.3 in the call: a dozen drafted tries a call made the compiled default 0.86x its plain
        decoding."""
        loop = self.plain_seconds or self.plain_prior  # (plain_prior: None without loop_base)
        if self.loop_base and loop:
            return loop
        return max(self.decode_seconds, self.plain_seconds or 0.0) or 1.0

    def spec_overhead(self, nodes: int) -> float:
        """Seconds a speculative step verifying `nodes` nodes per row takes beyond its forward (`StepOverhead`)."""
        return self.overhead((nodes - 1) * self.batch)

    def _forward(self, nodes: int) -> float:
        """The curve's cost of verifying `nodes` nodes (at the size they are padded to)."""
        return step_cost(self.curve, self.padded(nodes) if self.padded is not None else nodes)

    def cost(self, nodes: int) -> float:
        """A step verifying `nodes` nodes per row, relative to a plain step of this loop (`seconds`), drafting and
        bookkeeping included."""
        if nodes <= 1:
            return 1.0
        forward = self._forward(nodes)
        if not self.decode_seconds:  # a curve without its timing: the forward alone
            return forward
        return (forward * self.decode_seconds + self.spec_overhead(nodes)) / self.seconds

    def record(self, nodes: int, seconds: float, tokens: float, rows: int = 1, run: bool = False) -> None:
        """A step verified `nodes` nodes per row (1: a plain step) in `seconds` and gained `tokens` over `rows` rows
        (the engine passes the batch's progress, the tokens its slowest row gained: `step.emit.batch_progress`);
        `run`: a plain step of a back-to-back run (`AdaptiveDepth.observe_plain`)."""
        if not self.measured:  # priced by the prior alone, never backing off: decisions that no timing moves
            return
        rate = tokens / max(seconds * rows, 1e-12)  # tokens per row and second
        if nodes <= 1:
            self._plain_steps(1, seconds, rate, run)
            return
        self._sums = [self.LONG_DECAY * v for v in self._sums]
        self.spec_steps += 1
        self.retry_due = False
        if self.spec_steps == 1:  # it also set the drafter up (its first calls): neither its time nor its rate counts
            return
        if self.decode_seconds:
            excess = seconds - self._forward(nodes) * self.decode_seconds
            # a stall (another process, the collector) counts as at most 3x what the model expects
            self.overhead.add((nodes - 1) * self.batch, min(excess, 3 * self.spec_overhead(nodes)))
        if self._recent:  # a stall counts as at most 3x the recent steps' mean: it must not price speculation out
            seconds = min(seconds, 3 * sum(self._recent) / len(self._recent))
        self._recent.append(seconds)
        row_seconds = seconds * rows
        for i, v in enumerate((tokens, row_seconds, tokens * tokens, row_seconds * row_seconds, tokens * row_seconds)):
            self._sums[i] += v
        self._counted += 1
        self.since_plain += 1
        if self._counted < self.WINDOW:
            return
        x, t, xx, tt, xt = self._sums
        self.spec_rate = spec = x / max(t, 1e-12)
        # the rate's standard error (a ratio of sums: the delta method over the weighted steps)
        spread = math.sqrt(max(xx - 2 * spec * xt + spec * spec * tt, 0.0)) / max(t, 1e-12)
        # the bar: the plain steps this loop took (the same loop around the same forward: what plain decoding
        # gives, HF's loop included, within a few percent). Before any, speculation that does not beat a bare decode
        # forward (stricter: no loop around it) first measures the real bar, two plain steps (the first one warms
        # up), without counting as a loss: once a plain step took 3.1 ms at batch 1 (a bare forward 2.96), the
        # bare bar backed off from trees that won by 20% on average
        if self.plain_rate is None:
            # without a decode step's timing (a curve given without it) there is no bar at all: measured first too.
            # (Steps compiled whole: the last call's plain steps, where known, rather than the slower calibrated one)
            base = self.plain_prior or self.decode_seconds
            self.winning = bool(base) and spec >= self.MARGIN / base
            if not self.winning:
                self.forced = 2
            return
        bar = self.plain_rate
        # losing only where the rate is below the bar by more than CONFIDENCE standard errors: a step's tokens are
        # heavy-tailed, and where speculation loses, its steps' gains are alike and the error soon small (a rejected
        # draft gains one token a step, every step)
        self.winning = spec + self.CONFIDENCE * spread >= bar
        if not self.winning:
            self.forced = self.backoff
            self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
            self._counted = 0  # the retry gets a window of its own before it is judged (with what came before)
        else:
            self.backoff = self.FIRST_BACKOFF
            # winning narrowly: one plain step now and then keeps the bar current (it is otherwise measured only
            # where speculation loses)
            if self.spec_rate < self.REFRESH_MARGIN * bar and self.since_plain >= self.REFRESH_EVERY:
                self.forced = 1

    def record_run(self, steps: int, seconds: float) -> None:
        """`steps` plain steps of a back-to-back run took `seconds` together: as `steps` calls of `record(1, seconds /
        steps, 1, run=True)`, in one (on the compiled embedded target a call recorded per step cost 1% of its plain
        decoding)."""
        if not self.measured or steps <= 0:
            return
        each = seconds / steps
        self._plain_steps(steps, each, 1 / max(each, 1e-12), run=True)

    def _plain_steps(self, steps: int, seconds: float, rate: float, run: bool) -> None:
        """`steps` plain steps of `seconds` and `rate` each (`record`, `record_run`): the long memory aged, the back-off
        counted down, the bar's samples taken."""
        self._sums = [self.LONG_DECAY**steps * v for v in self._sums]
        if 0 < self.forced <= steps:
            self.retry_due = True
        self.forced = max(0, self.forced - steps)
        # the first one warms the loop up; the others' median: single steps on this 2-core machine vary by 30% (two
        # slow first steps at batch 16, 9-10 ms against 7.3, once set a bar that let speculation at 0.9x plain decoding
        # run for a whole call)
        counted = steps - (self.plain_steps == 0)
        self.plain_steps += steps
        self.since_plain = 0
        if counted > 0:
            samples = self._runs if run and self.loop_base else self._plain
            samples.extend([(seconds, rate)] * min(counted, self.PLAIN_SAMPLES))
            self._plain_medians = None  # (computed where read: pricing reads them far less often)

    def keeps_speculating(self, predicted: float) -> bool:
        """Whether to speculate where the acceptance model would decode plainly (`predicted`: its best expected gain
        over plain decoding): speculation was judged not to lose (the measurement then decides; the model only sizes
        the tree), or it is still to be judged, a first try or a back-off's retry, and the model calls it close
        (within MARGIN). Plain steps refresh no acceptance rate (only rare shadow drafts), so where the model alone
        decided once speculation had run, a few early rejections ended it for most of a call (8 held-out windows at
        batch 1: the default 1.40x ssmspec's plain decoding, always speculating 1.56x); a try the model prices as a
        clear loss is not made (batch 32: a try of three steps cost as much as nine plain ones)."""
        if not self.measured:
            return False
        return self.winning or ((self.retry_due or self._counted < self.WINDOW) and predicted * self.MARGIN >= 1.0)

    @property
    def plain(self) -> bool:
        """Whether the next step decodes plainly (speculation measured slower, backing off)."""
        return self.forced > 0
