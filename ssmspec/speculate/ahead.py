"""Saguaro (speculative speculative decoding) for context drafters: while the target verifies step T, a background
thread drafts step T+1 for the verification outcomes it expects most (accepted path x bonus token), so that on a
hit the next tree is ready and the step spends no time drafting.

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

from ssmspec.speculate.drafters import Drafter, PromptLookupDrafter


class AheadDrafter(Drafter):
    """Saguaro around a PromptLookupDrafter (n-gram and retrieval drafts; see the module docstring).

    Counters (added to SpecStats.drafter by `finish`): `proposals` (row drafts asked for), `hits` (ready from
    the thread), `hit_rate`, `prepared` (drafts made ahead), `saved_s` (hits x the main thread's mean drafting
    time on a miss: the drafting latency removed from the step), `waited_s` (the main thread blocked on an
    unfinished thread), `thread_s` (the thread's busy time).

    Args:
        base: the drafter whose proposals are prepared ahead.
        fanout: outcomes prepared per row and step.

    Raises:
        TypeError: a base drafter other than PromptLookupDrafter (a draft model's state cannot be forked in
            a background thread).
        ValueError: fanout < 1.
    """

    def __init__(self, base: PromptLookupDrafter, fanout: int = 8) -> None:
        if not isinstance(base, PromptLookupDrafter):
            raise TypeError(
                "ahead drafting (Saguaro) prepares context drafts (prompt lookup, retrieval); got "
                f"{type(base).__name__}"
            )
        if fanout < 1:
            raise ValueError(f"ahead drafting needs fanout >= 1, got {fanout}")
        self.base = base
        self.fanout = int(fanout)
        self._pool: ThreadPoolExecutor | None = None
        self._reset()

    def _reset(self) -> None:
        self._job: Future | None = None
        self._ready: dict[int, tuple] = {}  # row -> (context, its length, params, {emitted tokens: weighted draft})
        self._weighted: dict[int, tuple] = {}  # row -> the weighted draft proposed last
        self._verified: dict[int, tuple] = {}  # row -> (tokens, parents, context length) verified last
        self._accepted, self._rejected = 1.0, 1.0  # per-token acceptance, Beta(1, 1) prior
        self.counters = {"proposals": 0, "hits": 0, "prepared": 0, "miss_s": 0.0, "waited_s": 0.0, "thread_s": 0.0}

    def set_decoding(self, decoding) -> None:
        super().set_decoding(decoding)
        self.base.set_decoding(decoding)

    def start(self, input_ids, attention_mask):
        self._join()
        self._reset()
        self.base.start(input_ids, attention_mask)

    def _join(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            t0 = time.perf_counter()
            try:
                job.result()
            finally:
                self.counters["waited_s"] += time.perf_counter() - t0

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
        node = 0
        for tok in ctx[n:]:
            child = next((c for c in range(node + 1, len(tokens)) if parents[c] == node and tokens[c] == tok), None)
            if child is None:
                break
            node = child
            self._accepted += 1
        if any(p == node for p in parents):  # it stopped before a drafted child: a rejection
            self._rejected += 1

    def ahead(self, contexts, drafts, max_nodes, max_depth):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ssmspec-ahead")
        rows = []
        for r, (ctx, d) in enumerate(zip(contexts, drafts)):
            if d is None:  # a finished row
                continue
            self._verified[r] = (d[0], d[1], len(ctx))
            index = self.base.row_index(r, ctx)  # synced here; the thread only reads it
            rows.append((r, ctx, len(ctx), index, d[0], d[1], self._weighted.get(r)))
        alpha = self._accepted / (self._accepted + self._rejected)
        self._job = self._pool.submit(self._prepare, rows, max_nodes, max_depth, alpha)

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

    def finish(self, stats) -> None:
        try:
            self._join()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        c = self.counters
        misses = c["proposals"] - c["hits"]
        stats.drafter.update(
            proposals=c["proposals"], hits=c["hits"], hit_rate=c["hits"] / max(c["proposals"], 1),
            prepared=c["prepared"], saved_s=c["hits"] * c["miss_s"] / max(misses, 1), waited_s=c["waited_s"],
            thread_s=c["thread_s"],
        )  # fmt: skip


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
