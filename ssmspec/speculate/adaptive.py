"""Adaptive speculation (SmartSpec style): choose each step's draft depth, including 0 (plain decoding), to
maximise expected goodput = expected tokens per step / step cost. Acceptance is tracked online per row; the
step cost of verifying n nodes, relative to one decode step, is measured on the running model once.

Under a per-token acceptance rate a, a chain of depth k yields 1 + a + ... + a^k tokens in expectation (the
accepted drafts and the bonus token); a tree gives at least that. With a low rate the best depth is 0: the
step is plain decoding and costs nothing extra.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ssmspec import linear as packed_linear
from ssmspec.tree import TokenTree


class Acceptance:
    """Per-row acceptance rate of drafted tokens, an exponentially decayed success ratio with a weak prior."""

    def __init__(self, rows: int, prior: float = 0.5, weight: float = 2.0, decay: float = 0.8) -> None:
        self.success = [prior * weight] * rows
        self.trials = [weight] * rows
        self.decay = decay

    def update(self, row: int, drafted: int, accepted: int) -> None:
        """A step drafted `drafted` tokens deep for `row` and `accepted` of them were accepted."""
        if drafted <= 0:
            return
        self.success[row] = self.decay * self.success[row] + accepted
        self.trials[row] = self.decay * self.trials[row] + accepted + (1 if accepted < drafted else 0)

    def rate(self, row: int) -> float:
        return self.success[row] / max(self.trials[row], 1e-9)


def expected_tokens(rate: float, depth: int) -> float:
    """Expected tokens of one step (accepted drafts + bonus) for a chain of `depth` at acceptance `rate`."""
    return sum(rate**i for i in range(depth + 1))


def rerun_cost(rate: float, depth: int, cost: dict[int, float] | Callable[[int], float], nodes: int) -> float:
    """Expected extra cost of an `nodes`-node chain step of `depth` on a path whose partial commits feed the
    accepted prefix again, in the next step's forward (ssmspec.speculate.generic): with probability
    1 - rate^depth a draft is rejected, and the root and the accepted drafts (j of them with probability
    rate^j (1 - rate)) lengthen the next forward by j + 1 tokens."""
    base = step_cost(cost, nodes)
    return sum(rate**j * (1 - rate) * (step_cost(cost, nodes + j + 1) - base) for j in range(depth))


def depth_gains(
    rates: Sequence[float],
    cost: dict[int, float] | Callable[[int], float],
    max_depth: int,
    nodes_per_depth: float,
    reruns: bool = False,
) -> list[float]:
    """Per depth 0..max_depth, the expected tokens per unit of step cost summed over rows, relative to plain decoding
    (depth 0: 1.0); a depth-k step verifies about 1 + nodes_per_depth * k nodes (`reruns`: plus `rerun_cost`)."""
    gains = []
    powers = [1.0] * len(rates)  # rate ** k per row
    tokens = 0.0  # sum over rows of expected_tokens(rate, k), grown one depth at a time (a batch of 32: 0.25 ms)
    for k in range(max_depth + 1):
        tokens += sum(powers)
        powers = [p * r for p, r in zip(powers, rates)]
        n = 1 + int(round(nodes_per_depth * k))
        rerun = sum(rerun_cost(r, k, cost, n) for r in rates) / max(len(rates), 1) if reruns else 0.0
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


# the tree sizes whose verify cost is measured (up to the largest a call can verify)
COST_SIZES = (1, 2, 4, 8, 16, 32)


def merge_curves(old: dict[int, float], new: dict[int, float]) -> dict[int, float]:
    """A cost curve with the sizes of `new` added to `old` (both relative to a decode step), kept
    non-decreasing in the size."""
    merged, floor = {}, 0.0
    for n in sorted({**old, **new}):
        floor = max(floor, new.get(n, old.get(n, 0.0)))
        merged[n] = floor
    return merged


def chooses_packing(runner) -> bool:
    """Whether `runner`'s forwards may run its model's linears packed or not per tree size (ssmspec.linear.packs):
    an eager runner on a CPU model with packed linears big enough to pack."""
    if not getattr(runner, "prepack", False) or getattr(runner, "static_shapes", False):
        return False
    return runner.device.type == "cpu" and packed_linear.packs_any(runner.model)


def measure_cost(runner, sizes: Sequence[int] = COST_SIZES, repeats: int = 5) -> dict[int, float]:
    """Verify cost of n-node chains relative to a decode step, timed on the runner's prefilled cache (each
    tree is verified and discarded, the decode step rolled back: nothing changes). The sizes take turns, one
    warm-up round then `repeats` timed rounds, and each keeps its fastest run: load from other processes only
    ever adds time, and taking turns spreads a burst of it over every size instead of one (a median of runs
    size after size, measured under two test workers on two cores, once priced 2 nodes above 1.5 decode steps
    and turned speculation off for a whole call).

    Where the runner may choose (`chooses_packing`), every size is timed with the model's linears on their packed
    weights and on F.linear, the faster kept for that size in `runner.packed_sizes` and in the curve: which is
    faster depends on the CPU (on an AMD EPYC packed weights made 2-16 rows cost what one does; on a Xeon with a
    260 MiB L3, F.linear was faster for 1-3 rows and, on the embedded model, for 1-16)."""
    cache = runner.cache
    batch = cache.n_real.shape[0]
    device = cache.n_real.device
    trees = {n: runner.prepare(TokenTree.chain(torch.zeros(batch, n, dtype=torch.long, device=device))) for n in sizes}
    modes = (True, False) if chooses_packing(runner) else (None,)
    chosen = dict(getattr(runner, "packed_sizes", None) or {})
    times = {(n, mode): float("inf") for n in sizes for mode in modes}
    for round_ in range(repeats + 1):
        for n, mode in times:
            if mode is not None:
                runner.packed_sizes = {n: mode}
            snap = runner.snapshot() if n == 1 else None  # one node: HF's decode path, rolled back
            t0 = time.perf_counter()
            runner.verify(trees[n])
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if snap is None:
                runner.discard()
            else:
                runner.commit(torch.zeros(batch, dtype=torch.long, device=device))
                runner.restore(snap)
            if round_:  # the first round warms up (and compiles)
                times[n, mode] = min(times[n, mode], elapsed)
    best = {n: min(modes, key=lambda mode: times[n, mode]) for n in sizes}
    runner.decode_seconds = times[sizes[0], best[sizes[0]]]  # the base of the curve, in seconds (Goodput)
    if modes != (None,):
        runner.packed_sizes = {**chosen, **best}
    curve, floor = {}, 0.0
    for n in sizes:  # more nodes never cost less (timing noise aside): keep the curve non-decreasing
        floor = max(floor, times[n, best[n]] / times[sizes[0], best[sizes[0]]])
        curve[n] = floor
    return curve


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
    depths and drafters' own sizing weigh it). And the tokens a speculative step gained per second are compared with
    a plain step's (the median of the loop's recent plain steps, its first aside), over a window of recent
    speculative steps sized by the rows they gain for (`window_steps`): where speculating did not beat it by MARGIN,
    the next `backoff` steps decode plainly (no drafting at all), and the back-off doubles each time a retry clearly
    loses again (up to MAX_BACKOFF): throughput never stays below plain decoding for long. Where speculation wins by
    less than REFRESH_MARGIN, a plain step every REFRESH_EVERY speculative ones keeps that bar measured.

    Args:
        curve: the verify-cost curve (nodes -> cost relative to a decode step).
        decode_seconds: a decode step's forward in seconds (the curve's base), as measured.
        batch: the batch's rows (a step's drafted nodes are its nodes beyond the root times the rows).
        measured: False: `record` changes nothing (sampling: seeded draws must not depend on the machine's load).
    """

    MAX_BACKOFF = 64
    PRIOR_FIXED = 0.3  # the fixed overhead's prior, in decode steps
    PRIOR_SLOPE = 30e-6  # seconds per drafted node and row (the embedded target on a 2-core Xeon: 30-35 us)
    PLAIN_SAMPLES = 8
    MARGIN = 1.05
    REFRESH_MARGIN = 1.2
    REFRESH_EVERY = 16
    FIRST_BACKOFF = 4
    WINDOW = 3  # speculative steps a judgement needs at least
    ROW_STEPS = 16  # ... and at least this many rows' steps together (batch 1: 16 steps; batch 8: 3)

    def __init__(
        self,
        curve: dict[int, float],
        decode_seconds: float | None,
        batch: int = 1,
        measured: bool = True,
    ) -> None:
        self.curve = curve
        self.measured = measured
        self.decode_seconds = decode_seconds or 0.0  # 0: unknown (a curve given without its timing)
        self.batch = batch
        # what speculative steps take beyond their forward (the first one, which also sets the drafter up, aside)
        self.overhead = StepOverhead(self.PRIOR_FIXED * self.decode_seconds, self.PRIOR_SLOPE)
        self.spec_steps = 0
        self.plain_steps = 0
        self.since_plain = 0  # speculative steps since the last plain one
        self._plain: collections.deque = collections.deque(maxlen=self.PLAIN_SAMPLES)  # (seconds, rate)
        self.plain_seconds: float | None = None  # seconds a plain step takes, all in
        self.spec_rate: float | None = None  # tokens per row and second of speculative steps (rows `record` is given)
        self.plain_rate: float | None = None  # ... and of plain steps
        self.forced = 0  # plain steps still to take before speculating again
        self.winning = False  # the last judgement found speculation beating plain decoding
        self._unjudged = 0  # speculative steps since the last judgement (`winning` stands for a window's steps)
        self._judged_window = 0  # the steps that judgement summed
        self.retry_due = False  # a back-off ended and no speculative step has run since
        self.backoff = self.FIRST_BACKOFF
        # the speculative steps since the last back-off (tokens, seconds, rows), the last `window_steps` of them judged
        self._spec: collections.deque = collections.deque(maxlen=self.ROW_STEPS)

    def window_steps(self, rows: int) -> int:
        """The speculative steps a judgement sums over: ROW_STEPS rows' steps, at least WINDOW steps. A step's tokens
        per row vary most at batch 1 (a tree is rejected at its first node or accepted several deep: 1 or 4 tokens
        in about the same time), where three steps in a row rejected early are common even where speculation wins
        by 20-30% on average (an exponential average over about three steps backed off on them); a batch's steps
        average their rows."""
        return max(self.WINDOW, min(self.ROW_STEPS, -(-self.ROW_STEPS // max(rows, 1))))

    @property
    def seconds(self) -> float:
        """A decode step's forward in seconds: the curve's base as measured, or where plain steps ran, what they
        took (the measured base runs on a warm cache, alone; the running loop's steps take longer)."""
        return max(self.decode_seconds, self.plain_seconds or 0.0) or 1.0

    def spec_overhead(self, nodes: int) -> float:
        """Seconds a speculative step verifying `nodes` nodes per row takes beyond its forward (`StepOverhead`)."""
        return self.overhead((nodes - 1) * self.batch)

    def cost(self, nodes: int) -> float:
        """A step verifying `nodes` nodes per row, relative to a plain step of this loop (`seconds`), drafting and
        bookkeeping included."""
        if nodes <= 1:
            return 1.0
        if not self.decode_seconds:  # a curve without its timing: the forward alone
            return step_cost(self.curve, nodes)
        return (step_cost(self.curve, nodes) * self.decode_seconds + self.spec_overhead(nodes)) / self.seconds

    def record(self, nodes: int, seconds: float, tokens: int, rows: int) -> None:
        """A step verified `nodes` nodes per row (1: a plain step) in `seconds` and gained `tokens` over `rows` rows
        (the engine passes the rows the batch waits for, `engine.critical_rows`)."""
        if not self.measured:  # priced by the prior alone, never backing off: decisions that no timing moves
            return
        rate = tokens / max(seconds * rows, 1e-12)  # tokens per row and second
        if nodes <= 1:
            if self.forced == 1:
                self.retry_due = True
            self.forced = max(0, self.forced - 1)
            self.plain_steps += 1
            self.since_plain = 0
            # the first one warms the loop up; the others' median: single steps on this 2-core machine vary by 30%
            # (two slow first steps at batch 16, 9-10 ms against 7.3, once set a bar that let speculation at 0.9x
            # plain decoding run for a whole call)
            if self.plain_steps > 1:
                self._plain.append((seconds, rate))
                self.plain_seconds = statistics.median(t for t, _ in self._plain)
                self.plain_rate = statistics.median(r for _, r in self._plain)
            return
        self.spec_steps += 1
        self.retry_due = False
        if self.spec_steps == 1:  # it also set the drafter up (its first calls): neither its time nor its rate counts
            return
        if self.decode_seconds:
            excess = seconds - step_cost(self.curve, nodes) * self.decode_seconds
            # a stall (another process, the collector) counts as at most 3x what the model expects
            self.overhead.add((nodes - 1) * self.batch, min(excess, 3 * self.spec_overhead(nodes)))
        if self._spec:  # a stall counts as at most 3x the window's mean step: it must not price speculation out
            seconds = min(seconds, 3 * sum(s for _, s, _ in self._spec) / len(self._spec))
        self._spec.append((tokens, seconds, rows))
        self.since_plain += 1
        self._unjudged += 1
        window = self.window_steps(rows)
        if len(self._spec) < window:  # a judgement needs a window of steps since the last back-off
            return
        recent = list(self._spec)[-window:]
        self._unjudged, self._judged_window = 0, window
        self.spec_rate = sum(t for t, _, _ in recent) / max(sum(s * r for _, s, r in recent), 1e-12)
        # the bar: the plain steps this loop took (the same loop around the same forward: what plain decoding
        # gives, HF's loop included, within a few percent). Before any, speculation that does not beat a bare decode
        # forward (stricter: no loop around it) first measures the real bar, two plain steps (the first one warms
        # up), without counting as a loss: once a plain step took 3.1 ms at batch 1 (a bare forward 2.96), the
        # bare bar backed off from trees that won by 20% on average
        if self.plain_rate is None:
            self.winning = not (self.decode_seconds and self.spec_rate < self.MARGIN / self.decode_seconds)
            if not self.winning:
                self.forced = 2
            return
        bar = self.plain_rate
        self.winning = self.spec_rate >= self.MARGIN * bar
        # speculation has to beat the bar by MARGIN: where it only breaks even, single steps' noise (10-30% on this
        # machine) decides, and every retry of a losing tree costs more than a tie gains
        if not self.winning:
            # back off (a retry then gets a window of its own); the next back-off doubles only after a clear loss:
            # where speculation ties plain decoding (within MARGIN either way) noise decides, and a few unlucky
            # retries in a row must not turn it off for the rest of a call
            self.forced = self.backoff
            if self.spec_rate < bar / self.MARGIN:
                self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
            self._spec.clear()
        else:
            self.backoff = self.FIRST_BACKOFF
            # winning narrowly: one plain step now and then keeps the bar current (it is otherwise measured only
            # where speculation loses)
            if self.spec_rate < self.REFRESH_MARGIN * bar and self.since_plain >= self.REFRESH_EVERY:
                self.forced = 1

    def keeps_speculating(self, predicted: float) -> bool:
        """Whether to speculate where the acceptance model would decode plainly (`predicted`: its best expected gain
        over plain decoding): speculation measured winning (the measurement, not the model, decides whether it
        pays; the model sizes the tree), a back-off just ended (its retry), or nothing was judged yet and the model
        calls it close (within MARGIN). Plain steps refresh no acceptance rate (only rare shadow drafts), so where
        the model alone decided, its prior's 0.98 at batch 1 or a dip in the rates after a few early rejections
        ended speculation for a whole call (8 held-out windows at batch 1: the default 1.9x HF greedy where
        speculating always, with the largest tree, gave 2.1x)."""
        if not self.measured:
            return False
        return self.measured_winning or self.retry_due or (self.spec_rate is None and predicted * self.MARGIN >= 1.0)

    @property
    def measured_winning(self) -> bool:
        """The last judgement found speculation winning and still stands: for as many speculative steps as it summed.
        Where the rows a batch waits for shrink (its last rows), the window grows (batch 4 to 1: 4 steps to 16) and
        no judgement comes for a while; one made on four rows' steps stood for 13 single-row steps that lost
        (compiled, batch 4: 0.84-0.90x plain decoding). Until the next judgement the model decides."""
        return self.winning and self._unjudged < self._judged_window

    @property
    def plain(self) -> bool:
        """Whether the next step decodes plainly (speculation measured slower, backing off)."""
        return self.forced > 0
