"""The verify part of a step: one forward of the target over every row's tree (ssmspec.speculate.runner), the logits
of every node processed as HF's processors would (per node, with its own ids), a step that runs out of memory retried
with half the nodes."""

from __future__ import annotations

import torch

from ssmspec.speculate.step import Proposal, Verified
from ssmspec.speculate.step.emit import Rows


class Verifier:
    """Verifies proposals on a runner (ModelRunner or GenericRunner): builds the batch of trees on the host, prepares
    it for the runner (padding, level alignment, one transfer) and runs the forward; the committed state is untouched
    until the runner's commit.

    A verify step that raises torch.OutOfMemoryError is retried with half the nodes per row (down to a plain decode
    step, which is raised), counted in `stats.out_of_memory`; the cap that fitted is reported (Verified.cap). Where a
    step verifies more nodes than any before, the buffers it holds are measured (Verified.held_bytes,
    `stats.max_verify_bytes`).
    """

    def __init__(self, runner, stats) -> None:
        self.runner = runner
        self.stats = stats
        self.measured_nodes = 1  # the largest step's nodes per row whose buffers were measured

    def verify(self, proposal: Proposal, rows: Rows) -> Verified:
        runner, cap = self.runner, None
        while True:
            tree = runner.prepare(proposal.trees)  # built and prepared on the host, then one transfer to its device
            try:
                logits = runner.verify(tree)
                break
            except torch.OutOfMemoryError:
                # nothing smaller than a plain decode step; the generic path's row-by-row forwards change HF's cache
                # in place, so an interrupted one cannot be retried (the seams' cache discards it)
                if tree.num_nodes <= 1 or not runner.retries_out_of_memory:
                    raise
                self.stats.out_of_memory += 1
                cap = max(1, proposal.nodes // 2)
                proposal = proposal.capped(cap)
        held = None
        if tree.num_nodes > self.measured_nodes:
            # a verify's buffers grow with its nodes: measured where a step verifies more than any before (the largest
            # step holds the most; walking every record each step cost 0.07 ms of a 10 ms step)
            self.measured_nodes = tree.num_nodes
            held = runner.verify_bytes()
            self.stats.max_verify_bytes = max(self.stats.max_verify_bytes, held)
        qs = proposal.qs
        if tree.origin is not None:
            qs = [{tree.index_of(r, n): v for n, v in q.items()} if q else None for r, q in enumerate(qs)]
        raw = logits.float()
        decoding = rows.decoding
        scores = decoding.score_tree(tree, raw, rows.score_bases(proposal)) if decoding.processes else raw
        active = [not d for d in rows.done]
        feats = runner.features if runner.capture_features else None
        return Verified(proposal, tree, raw, scores, qs, active, feats, held, cap)
