"""Saguaro (speculative speculative decoding): while the target verifies step T, a background thread drafts step T+1
for the verification outcomes it expects most (accepted path x bonus token), so that on a hit the next tree is ready
and the step spends no time drafting. `AheadDrafter` does it for context drafters (below); `DraftAheadDrafter` for
draft models, whose state it saves before and after each prepared proposal.

An outcome's chance is estimated from the drafter's own votes: a drafted node is reached with its parent's chance
times the measured per-token acceptance times the node's share of its parent's votes; the target stops there
with what is left after its children; the bonus token after a node is voted on by the node's own context,
without the node's drafted children (a child the target agreed with would have been accepted instead). The
`fanout` likeliest (node, bonus) pairs per row are drafted, which puts the fan-out on the early positions where
acceptance usually stops.

A hit returns exactly the draft the drafter would have proposed for that context (same index, same votes), so
drafts and outputs are unchanged; only where the drafting time is spent moves. The thread only reads the
drafter's indices; the main thread changes them only after joining it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ssmspec.errors import UnsupportedSettingError
from ssmspec.speculate.drafters.base import Drafter, Wrapper, accepted_path
from ssmspec.speculate.drafters.draft_model import DraftModelDrafter
from ssmspec.speculate.drafters.fused import FusedDrafter
from ssmspec.speculate.drafters.ngram import PromptLookupDrafter
from ssmspec.speculate.recycling import Calibration

# the counters every Saguaro drafter keeps (`finish` reports them, derived ones included, and any others as they are)
_REPORTED = ("proposals", "hits", "prepared", "miss_s", "waited_s", "thread_s")


class _Background(Wrapper):
    """What both Saguaro drafters share: the drafter they wrap, one background job per step (joined at the next
    proposal), and the counters `finish` reports.

    Args:
        base: the wrapped drafter.
        fanout: outcomes prepared per step (at most).
        thread_name: the background thread's name prefix.
        thread_per_step: end the thread after each step's job (a thread that ran torch ops keeps an OpenMP
            team of its own while it lives, which slows the verifying thread's ops).
    """

    works_ahead = True  # (each step's `ahead` starts the next step's job)

    def __init__(self, base: Drafter, fanout: int, thread_name: str, thread_per_step: bool = False) -> None:
        if fanout < 1:
            raise ValueError(f"ahead drafting needs fanout >= 1, got {fanout}")
        self.base = base
        self.inner = (base,)
        self.fanout = int(fanout)
        self._thread_name = thread_name
        self._thread_per_step = thread_per_step
        self._pool: ThreadPoolExecutor | None = None
        self._reset()

    def _reset(self) -> None:
        self._job: Future | None = None
        self.counters = {"proposals": 0, "hits": 0, "prepared": 0, "miss_s": 0.0, "waited_s": 0.0, "thread_s": 0.0}

    def start(self, input_ids, attention_mask):
        self._join()
        self._reset()
        super().start(input_ids, attention_mask)

    def _submit(self, fn, *args) -> None:
        """Run this step's background job."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._thread_name)
        # the job runs in the caller's inference mode (thread-local: the tensors it updates were made under it)
        self._job = self._pool.submit(_in_mode(fn, torch.is_inference_mode_enabled()), *args)

    def _join(self) -> None:
        """Wait for the step's job (counted as `waited_s`); with `thread_per_step`, let its thread end."""
        job, self._job = self._job, None
        if job is not None:
            t0 = time.perf_counter()
            try:
                job.result()
            finally:
                if self._thread_per_step:
                    self._close()
                self.counters["waited_s"] += time.perf_counter() - t0

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def finish(self, stats) -> None:
        try:
            self._join()
        finally:
            self._close()
            super().finish(stats)
        c = self.counters
        misses = c["proposals"] - c["hits"]
        stats.drafter.update(
            proposals=c["proposals"], hits=c["hits"], hit_rate=c["hits"] / max(c["proposals"], 1),
            prepared=c["prepared"], saved_s=c["hits"] * c["miss_s"] / max(misses, 1), waited_s=c["waited_s"],
            thread_s=c["thread_s"], **{k: v for k, v in c.items() if k not in _REPORTED},
        )  # fmt: skip


class AheadDrafter(_Background):
    """Saguaro around a PromptLookupDrafter (n-gram and retrieval drafts; see the module docstring).

    Counters (added to SpecStats.drafter by `finish`): `proposals` (row drafts asked for), `hits` (ready from
    the thread), `hit_rate`, `prepared` (drafts made ahead), `saved_s` (hits x the main thread's mean drafting
    time on a miss: the drafting latency removed from the step), `waited_s` (the main thread blocked on an
    unfinished thread), `thread_s` (the thread's busy time).

    Args:
        base: the drafter whose proposals are prepared ahead.
        fanout: outcomes prepared per row and step.

    Raises:
        TypeError: a base drafter other than PromptLookupDrafter (a draft model: DraftAheadDrafter).
        ValueError: fanout < 1.
    """

    def __init__(self, base: PromptLookupDrafter, fanout: int = 8) -> None:
        if not isinstance(base, PromptLookupDrafter):
            raise TypeError(
                "ahead drafting (Saguaro) prepares context drafts (prompt lookup, retrieval); got "
                f"{type(base).__name__}"
            )
        super().__init__(base, fanout, "ssmspec-ahead")

    def _reset(self) -> None:
        super()._reset()
        self._ready: dict[int, tuple] = {}  # row -> (context, its length, params, {emitted tokens: weighted draft})
        self._weighted: dict[int, tuple] = {}  # row -> the weighted draft proposed last
        self._verified: dict[int, tuple] = {}  # row -> (tokens, parents, context length) verified last
        self._accepted, self._rejected = 1.0, 1.0  # per-token acceptance, Beta(1, 1) prior

    def propose(self, contexts, max_nodes, max_depth):
        self._join()
        out = []
        for r, ctx in enumerate(contexts):
            self._learn(r, ctx)
            weighted = None
            ready = self._ready.get(r)
            if ready is not None and ready[0] is ctx and ready[2] == (max_nodes, max_depth) and len(ctx) > ready[1]:
                weighted = ready[3].get(tuple(ctx[ready[1] :]))
            self.counters["proposals"] += 1
            if weighted is None:
                t0 = time.perf_counter()
                weighted = self.base.draft(ctx, max_nodes, max_depth, self.base.row_index(r, ctx), with_weights=True)
                self.counters["miss_s"] += time.perf_counter() - t0
            else:
                self.counters["hits"] += 1
            self._weighted[r] = weighted
            out.append(weighted[:2])
        self._ready = {}
        return out

    def _learn(self, row: int, ctx: Sequence[int]) -> None:
        """Count what the target accepted of the row's last verified draft (walk its tree along the emitted
        tokens): the per-token acceptance that weighs the outcomes."""
        last = self._verified.pop(row, None)
        if last is None:
            return
        tokens, parents, n = last
        path, kids = accepted_path(tokens, parents, ctx[n:])
        self._accepted += len(path) - 1
        if path[-1] in kids:  # it stopped before a drafted child: a rejection
            self._rejected += 1

    def ahead(self, contexts, drafts, max_nodes, max_depth):
        rows = []
        for r, (ctx, d) in enumerate(zip(contexts, drafts)):
            if d is None:  # a finished row
                continue
            self._verified[r] = (d[0], d[1], len(ctx))
            index = self.base.row_index(r, ctx)  # synced here; the thread only reads it
            rows.append((r, ctx, len(ctx), index, d[0], d[1], self._weighted.get(r)))
        alpha = self._accepted / (self._accepted + self._rejected)
        self._submit(self._prepare, rows, max_nodes, max_depth, alpha)

    def _prepare(self, rows, max_nodes: int, max_depth: int, alpha: float) -> None:
        """In the thread: the likeliest outcomes' drafts per row, stored for the next `propose`."""
        t0 = time.perf_counter()
        for r, ctx, n, index, tokens, parents, weighted in rows:
            base = index.tokens  # == ctx[:n] until the main thread joins
            paths = _paths(tokens, parents)
            weights = _path_weights(weighted, tokens, parents, paths)
            reach, onward = [1.0] * len(tokens), [0.0] * len(tokens)
            for i in range(1, len(tokens)):
                p = parents[i]
                step = alpha * min(1.0, weights.get(paths[i], 0.0) / max(weights.get(paths[p], 0.0), 1e-9))
                reach[i] = reach[p] * step
                onward[p] += step
            stop = [reach[i] * max(0.0, 1.0 - onward[i]) for i in range(len(tokens))]
            nodes = sorted(range(len(tokens)), key=lambda i: -stop[i])[: self.fanout]
            outcomes = []
            for i in nodes:
                if stop[i] <= 0:
                    continue
                context = base + list(paths[i])
                votes: dict[int, float] = {}
                for cont, w in self.base.continuations(context, 1, index):
                    votes[cont[0]] = votes.get(cont[0], 0.0) + w
                for c in range(i + 1, len(tokens)):
                    if parents[c] == i:
                        votes.pop(tokens[c], None)
                total = sum(votes.values())
                outcomes += [(stop[i] * w / total, paths[i] + (x,)) for x, w in votes.items()]
                time.sleep(0)  # hand the GIL back to the verifying thread between lookups
            outcomes.sort(key=lambda o: -o[0])
            prepared = {}
            for _, emitted in outcomes[: self.fanout]:
                prepared[emitted] = self.base.draft(
                    base + list(emitted), max_nodes, max_depth, index, with_weights=True
                )
                time.sleep(0)
            self._ready[r] = (ctx, n, (max_nodes, max_depth), prepared)
            self.counters["prepared"] += len(prepared)
        self.counters["thread_s"] += time.perf_counter() - t0


class DraftAheadDrafter(_Background):
    """Saguaro around a draft model's drafter (chains, DySpec dynamic trees, VocabTrim, RASD fusion; greedy
    decoding): while the target verifies step T, a background thread prepares step T+1 for the `fanout`
    likeliest outcomes, each a full proposal of the draft from the state that outcome would leave.

    An outcome is the accepted path to a node n and the bonus token x after it. Its chance is estimated from
    the draft's own distributions q (one draft forward over the verified tree gives q after every node): a
    drafted child is accepted with the rate measured online for its bucket of q (ssmspec.speculate.recycling's
    Calibration: a greedy target accepts the draft's top token far more often than q says), n is reached with
    the product of those rates along its path, the target stops there with what is left after n's children,
    and x ~ q after n without those children. Hypothesis i takes every row's i-th likeliest outcome;
    the thread saves the draft's state before it (the state the main thread left) and after each prepared
    proposal. A hit (every active row's context is that of hypothesis i) loads the state after proposal i and
    returns its drafts: exactly what the draft would have proposed, so drafts and outputs are unchanged; a miss
    returns to the state before and proposes as usual. The thread owns the draft (and reads the retrieval
    indexes, frozen) until the main thread joins it, at the next proposal.

    On a GPU the thread's launches overlap the verifying thread's (the draft's kernels share the device's
    stream); on a CPU both threads share the cores and Python's lock.

    The thread prepares only as many hypotheses as fit in the target's verification (measured as it runs: the
    time from `ahead` to the next proposal, against the thread's time per step and per hypothesis), so that the
    next proposal does not wait for it; where not even one fits, it rests (every 16th step it tries one, to
    measure again): a draft that costs more than the target's verification gains nothing from drafting ahead.

    Counters (SpecStats.drafter): `proposals`, `hits`, `hit_rate` (steps whose drafts were ready), `prepared`
    (proposals made ahead), `skipped` (steps it rested), `saved_s` (hits x the main thread's mean drafting time
    on a miss), `waited_s` (blocked on an unfinished thread), `thread_s` (the thread's busy time).

    Args:
        base: the draft model's drafter (DraftModelDrafter, or FusedDrafter for RASD).
        fanout: hypotheses prepared per step (at most).
        fit: prepare only what fits in the target's verification (see above); False: always `fanout`.

    Raises:
        TypeError: another kind of drafter.
        ValueError: fanout < 1.
    """

    def __init__(self, base: DraftModelDrafter | FusedDrafter, fanout: int = 2, fit: bool = True) -> None:
        if not isinstance(base, DraftModelDrafter | FusedDrafter):
            raise TypeError(f"draft-model ahead drafting wraps a draft model's drafter; got {type(base).__name__}")
        self.fit = fit
        super().__init__(base, fanout, "ssmspec-draft-ahead", thread_per_step=True)

    def _reset(self) -> None:
        super()._reset()
        self._ready: tuple | None = None  # (params, state before, [(tails per row, drafts, state after)])
        self.calibration = Calibration()  # acceptance of drafted nodes per bucket of the draft's q
        self._verified: tuple | None = None  # (contexts' lengths, drafts, {row: {node: q}}) of the last step
        # what fits: the main thread's time from `ahead` to the next proposal (the target's verification), the
        # thread's fixed time per step (the draft's distributions) and per hypothesis; moving averages
        self._times = {"verify": None, "fixed": None, "hypothesis": None}
        self._ahead_at: float | None = None
        self._steps = 0
        self.counters["skipped"] = 0

    def _time(self, key: str, seconds: float) -> None:
        old = self._times[key]
        self._times[key] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def _fit(self) -> int:
        """Hypotheses the thread can prepare while the target verifies (it must not make the next proposal wait):
        at most `fanout`, 0 when not even one fits (then every 16th step tries one, to measure again)."""
        t = self._times
        if not self.fit:
            return self.fanout
        if None in t.values():
            return 1
        fits = int((t["verify"] - t["fixed"]) / max(t["hypothesis"], 1e-9))
        return max(0, min(self.fanout, fits)) or int(self._steps % 16 == 0)

    def set_decoding(self, decoding) -> None:
        if decoding.do_sample:
            raise UnsupportedSettingError(
                "ahead", "drafting ahead with a draft model is for greedy decoding (do_sample=False)"
            )
        super().set_decoding(decoding)

    def propose(self, contexts, max_nodes, max_depth):
        if self._ahead_at is not None:
            self._time("verify", time.perf_counter() - self._ahead_at)
            self._ahead_at = None
        self._join()
        self._learn(contexts)
        ready, self._ready = self._ready, None
        active = [self._verified is None or self._verified[1][r] is not None for r in range(len(contexts))]
        self.counters["proposals"] += 1
        if ready is not None:
            params, before, prepared = ready
            for tails, drafts, after in prepared if params == (max_nodes, max_depth) else ():
                if all(not a or list(ctx[len(ctx) - len(t) :]) == t and len(ctx) == n + len(t)
                       for ctx, t, n, a in zip(contexts, tails, self._verified[0], active)):  # fmt: skip
                    self.base.load_state(after)
                    self.counters["hits"] += 1
                    return drafts
            self.base.load_state(before)  # the thread moved the draft: back to where the main thread left it
        t0 = time.perf_counter()
        out = self.base.propose(contexts, max_nodes, max_depth)
        self.counters["miss_s"] += time.perf_counter() - t0
        return out

    def _learn(self, contexts) -> None:
        """Calibrate: which of the last verified draft's tested nodes (children of accepted nodes; walked along
        the emitted tokens) the target accepted, per bucket of the draft's q for them."""
        if self._verified is None:
            return
        lengths, drafts, qs = self._verified
        for r, d in enumerate(drafts):
            if d is None or r not in qs:
                continue
            tokens = d[0]
            path, kids = accepted_path(tokens, d[1], contexts[r][lengths[r] :])
            for i, node in enumerate(path):  # the children of every accepted node were tested
                for c in kids.get(node, ()) if node in qs[r] else ():
                    feature = Calibration.feature(0.0, float(qs[r][node][tokens[c]]))
                    self.calibration.update(feature, i + 1 < len(path) and c == path[i + 1])

    def ahead(self, contexts, drafts, max_nodes, max_depth):
        self._steps += 1
        self._verified = ([len(c) for c in contexts], list(drafts), {})
        fanout = self._fit()
        self._ahead_at = time.perf_counter()
        if not fanout:
            self.counters["skipped"] += 1
            return
        snapshot = [list(c) for c in contexts]  # the engine appends to its lists while the target verifies
        before = self.base.save_state()
        # a thread per step (`thread_per_step`): a live thread that ran torch ops keeps its own OpenMP team, which
        # slowed the verifying thread's ops by a quarter on a 2-core CPU; starting one costs ~0.1 ms
        self._submit(self._prepare, snapshot, list(drafts), max_nodes, max_depth, before, fanout)
        self._ahead_at = time.perf_counter()

    def _prepare(self, contexts, drafts, max_nodes: int, max_depth: int, before: tuple, fanout: int) -> None:
        """In the thread: the draft's distributions over the verified trees, the likeliest outcomes per row, and
        one proposal per hypothesis (at most `fanout`), each from the state before it."""
        t0 = time.perf_counter()
        try:
            logits = self.base.node_logits(contexts, drafts)
            qs = {r: {n: x.float().softmax(-1) for n, x in per.items()} for r, per in enumerate(logits) if per}
            self._verified[2].update(qs)
            outcomes = [
                _likeliest(d, qs[r], self.calibration, fanout) if d is not None and r in qs else [()]
                for r, d in enumerate(drafts)
            ]  # fmt: skip
            self._time("fixed", time.perf_counter() - t0)
            prepared = []
            for i in range(fanout):
                if any(len(o) <= i and d is not None for o, d in zip(outcomes, drafts)):
                    break  # a row has no i-th outcome: hypothesis i cannot be a hit
                tails = [list(o[i]) if d is not None else [] for o, d in zip(outcomes, drafts)]
                t1 = time.perf_counter()
                self.base.load_state(before)
                with self.base.frozen():
                    proposal = self.base.propose([c + t for c, t in zip(contexts, tails)], max_nodes, max_depth)
                prepared.append((tails, proposal, self.base.save_state()))
                self.counters["prepared"] += 1
                self._time("hypothesis", time.perf_counter() - t1)
            self._ready = ((max_nodes, max_depth), before, prepared)
        finally:
            self.counters["thread_s"] += time.perf_counter() - t0


def _likeliest(draft, qs: dict, calibration: Calibration, count: int) -> list[tuple[int, ...]]:
    """The `count` likeliest (accepted path, bonus token) outcomes of verifying `draft`, as the emitted tokens,
    from the draft's distributions `qs` after its nodes and the acceptance rates per bucket of q (see
    DraftAheadDrafter)."""
    tokens, parents = draft[0], draft[1]
    paths = _paths(tokens, parents)
    _, kids = accepted_path(tokens, parents, ())
    reach = [1.0] * len(tokens)
    scored = []
    for n in range(len(tokens)):
        q = qs.get(n)
        if q is None:
            continue
        children = kids.get(n, [])
        taken = [float(q[tokens[c]]) for c in children]
        passes = [calibration.estimate(Calibration.feature(0.0, p)) for p in taken]
        for c, a in zip(children, passes):
            reach[c] = reach[n] * a
        rest = 1.0 - sum(taken)
        stop = reach[n] * max(0.0, 1.0 - sum(passes))
        if stop <= 0 or rest <= 0:
            continue
        excluded = q.clone()
        if children:
            excluded[[tokens[c] for c in children]] = 0
        top_p, top_x = excluded.topk(min(count, excluded.shape[-1]))
        scored += [(stop * p / rest, paths[n] + (x,)) for p, x in zip(top_p.tolist(), top_x.tolist()) if p > 0]
    scored.sort(key=lambda o: -o[0])
    return [o[1] for o in scored[:count]]


def _paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Each node's path of tokens below the root (the root's: empty)."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (tokens[i],))
    return paths


def _path_weights(
    weighted: tuple | None, tokens: list[int], parents: list[int], paths: list[tuple[int, ...]]
) -> dict[tuple[int, ...], float]:
    """A weighted draft's node weights keyed by path; the verified draft (`tokens`, `parents`, its `paths`) is
    that draft or a trimmed copy of it, whose paths are reused when it is the draft itself."""
    if weighted is None:
        return {}
    w_tokens, w_parents, weights = weighted
    same = w_tokens == tokens and w_parents == parents
    return dict(zip(paths if same else _paths(w_tokens, w_parents), weights))


def _in_mode(fn, inference: bool):
    """`fn` run under inference mode where `inference`, else under no_grad."""

    def run(*args):
        with torch.inference_mode() if inference else torch.no_grad():
            return fn(*args)

    return run
