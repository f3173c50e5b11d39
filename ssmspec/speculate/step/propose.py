"""The propose part of a step: the drafter's tree for every row, as the step's plan allows, and everything a drafter
learns from the target between its proposals (the target's features at the last committed position for a draft
head; the target's top-k after every verified node for a drafter that recycles them)."""

from __future__ import annotations

import time

import torch

from ssmspec.speculate.drafters.base import Draft, Drafter
from ssmspec.speculate.step import Accepted, Proposal, StepPlan, Verified
from ssmspec.speculate.step.accept import top_k
from ssmspec.speculate.step.emit import Rows

# prompt positions (the last ones) whose top-k a recycling drafter is told after the prefill
PROMPT_TOPK_POSITIONS = 2048


class Proposer:
    """Asks the drafter for one tree per row within the step's plan, trimmed to what each row may still emit, with
    pad chains for finished rows that decode pads (kept scores), and tells the drafter what the target computed.

    A plain step (depth 0) does not call the drafter (a drafter that prepares its next proposal while the target
    verifies, Saguaro's, still is called); its shadow draft (StepPlan.shadow) is drafted one level deep and timed.

    Args:
        drafter: the call's drafter (`set_decoding` and `start` are called by `start`).
    """

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        # it drafts from the target's features (its runner then captures them: ssmspec.hf.features)
        self.history = bool(drafter.target_history)  # every committed position's features (an MTP layer)
        self.wants_features = bool(drafter.target_features) or self.history
        self.topk = int(drafter.target_topk)
        # the prompt's last positions whose logits or features the drafter reads after the prefill (0: all of them)
        self.prompt_positions = 0 if self.history else PROMPT_TOPK_POSITIONS if self.topk else 1
        self.calls_every_step = bool(drafter.works_ahead)
        # the target's features at the last step's commit, not yet handed to the drafter: (features [B, N, H], the
        # committed node per row, the rows to tell); deferred to the next drafting call, so a run of plain steps (a
        # batch where speculation does not pay) pays for none of it
        self._features: tuple | None = None
        self.step_draft = None  # the drafter's next chains drafted in the target's greedy step (set at `start`)

    def start(self, runner, rows: Rows, attention_mask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """After the prefill: the drafter sees the prompt (and, a recycling drafter, the target's top-k after every
        prompt token; a feature drafter, the prefill's last features). Returns the last position's logits [B, V]
        (`logits` holds every position's where `topk` asked for them)."""
        drafter, b = self.drafter, rows.batch
        drafter.set_decoding(rows.decoding)
        drafter.start(rows.input_ids, attention_mask)
        self.step_draft = drafter.step_draft()
        if drafter.target_features:
            self._features = (runner.features, [-1] * b, range(b))
        if self.history:  # the features of every real prompt position (the prefill computed them all)
            real = attention_mask.bool().to(runner.features.device)
            for r in range(b):
                drafter.observe_history(r, runner.features[r][real[r, -runner.features.shape[1] :]])
        if not self.topk:
            return logits
        ids_k, probs_k = top_k(logits[:, -PROMPT_TOPK_POSITIONS:], self.topk)
        ids_k, probs_k = ids_k.tolist(), probs_k.tolist()
        offset = logits.shape[1] - len(ids_k[0])
        mask = attention_mask.bool()
        for r in range(b):
            real = mask[r, offset:].tolist()
            tokens = [t for t, m in zip(rows.prompts[r][offset:], real) if m]
            drafter.observe_prompt(r, tokens, [(i, p) for i, p, m in zip(ids_k[r], probs_k[r], real) if m])
        return logits[:, -1]

    def propose(self, plan: StepPlan, rows: Rows) -> Proposal:
        """Every row's tree for this step (see the class docstring)."""
        contexts, depth = rows.contexts, max(plan.depth, 0)
        shadow, shadow_seconds = None, 0.0
        if plan.shadow:
            t0 = time.perf_counter()
            self._hand_features(contexts, 1)
            shadow = self.drafter.propose(contexts, plan.shadow, 1)
            shadow_seconds = time.perf_counter() - t0
        if depth == 0 and not self.calls_every_step:
            proposed: list = [([int(c[-1])], [-1]) for c in contexts]
        else:
            self._hand_features(contexts, depth)
            proposed = self.drafter.propose(contexts, plan.budget, depth)
        trees, qs, pads = [], [], {}
        remaining = rows.remaining
        for r, d in enumerate(proposed):
            if rows.done[r]:
                k = min(depth, rows.max_new_tokens - len(rows.kept[r]) - 1) if rows.keeps_scores else -1
                root = rows.ids(r)[-1] if rows.keeps_scores else contexts[r][-1]
                trees.append(([root] + [rows.pad] * max(k, 0), list(range(-1, max(k, 0)))))
                qs.append(None)
                if k >= 0:
                    pads[r] = k
                continue
            tokens, parents, index = trim(d[0], d[1], remaining[r] - 1)
            trees.append((tokens, parents))
            q = d[2] if len(d) > 2 else None
            qs.append({index[node]: dist for node, dist in q.items() if node in index} if q else None)
        proposal = Proposal(trees, qs, pads, depth, shadow, shadow_seconds)
        if plan.cap is not None:
            proposal = proposal.capped(plan.cap)
        if self.calls_every_step:  # a drafter that prepares the next proposal now (Saguaro's)
            self._hand_features()
        if depth or self.calls_every_step:  # (a plain step asks the others nothing)
            self.drafter.ahead(contexts, [None if rows.done[r] else t for r, t in enumerate(proposal.trees)],
                               plan.budget, depth)  # fmt: skip
        return proposal

    def observe(self, verified: Verified, accepted: Accepted, rows: Rows) -> None:
        """After the target's verdict, before the rows emit it: a recycling drafter learns the target's top-k after
        every node of its draft; a feature drafter will be handed the features at each row's accepted node."""
        tree, proposal = verified.tree, verified.proposal
        if accepted.tops is not None:
            for r in range(rows.batch):
                if verified.active[r] and r not in proposal.pads:
                    nodes = [tree.index_of(r, n) for n in range(len(proposal.trees[r][0]))]
                    tops = [(accepted.tops[0][r][i], accepted.tops[1][r][i]) for i in nodes]
                    self.drafter.observe(r, rows.contexts[r], proposal.trees[r], tops, accepted.tokens[r])
        told = [r for r in range(rows.batch) if verified.active[r] and r not in proposal.pads]
        if self.drafter.target_features:  # (plain steps in a row need only the last)
            self._features = (verified.features, list(accepted.last), told)
        if self.history:  # the features along each row's accepted path (root first)
            for r in told:
                path = tree.path_nodes(r, accepted.last[r])
                self.drafter.observe_history(r, verified.features[r, torch.tensor(path, device=tree.tokens.device)])

    def observe_path(self, features: torch.Tensor | None, counts: list[int], rows: list[int]) -> None:
        """`observe` after a step whose paths were accepted on the device (`ModelRunner.decode`, `.verify_greedy`):
        `features` [B, W, H] the target's along each row's accepted path (root first), `counts` per row the path's
        nodes, `rows` the rows that took part."""
        if self.drafter.target_features:
            self._features = (features, [c - 1 for c in counts], rows)
        if self.history:
            for r in rows:
                self.drafter.observe_history(r, features[r, : counts[r]])

    def observe_drafted(self, chains: list[list[int]] | None, rows: Rows) -> None:
        """After a greedy step that drafted the next chains in its graph (`step_draft`; None: it did not): the drafter
        is handed them with the rows' contexts."""
        if chains is not None:
            self.drafter.observe_drafted(chains, rows.contexts)

    def _hand_features(self, contexts=None, depth: int = 0) -> None:
        """Hand the drafter the target's features at each row's last committed position (one gather, a view per
        row), where some are pending and the chains the last step drafted (`observe_drafted`) do not serve a proposal
        `depth` deep for `contexts`."""
        if self._features is None or contexts is not None and self.drafter.has_drafted(contexts, depth):
            return
        feats, cut, rows = self._features
        self._features = None
        at = feats[torch.arange(len(cut), device=feats.device), torch.tensor(cut, device=feats.device)].unbind(0)
        for r in rows:
            self.drafter.observe_features(r, at[r])


def trim(tokens: list[int], parents: list[int], max_depth: int) -> tuple[list[int], list[int], dict[int, int]]:
    """Drop drafted nodes deeper than max_depth (no use drafting past max_new_tokens); returns the kept tokens,
    their parents and where each kept node went."""
    if len(tokens) == 1:  # a root alone (a plain decoding step, most steps at large batches): nothing to trim
        return [tokens[0]], [-1], {0: 0}
    depth = [0] * len(tokens)
    keep = [0]
    new_index = {0: 0}
    for t in range(1, len(tokens)):
        depth[t] = depth[parents[t]] + 1
        if depth[t] <= max_depth and parents[t] in new_index:
            new_index[t] = len(keep)
            keep.append(t)
    return [tokens[t] for t in keep], [-1] + [new_index[parents[t]] for t in keep[1:]], new_index


__all__ = ["PROMPT_TOPK_POSITIONS", "Draft", "Proposer", "trim"]
