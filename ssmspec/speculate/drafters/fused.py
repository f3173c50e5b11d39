"""RASD: a draft model's tree fused with a retrieval tree."""

from __future__ import annotations

import math

import torch

from ssmspec.speculate.drafters.base import Draft, Wrapper
from ssmspec.speculate.drafters.draft_model import DraftModelDrafter
from ssmspec.speculate.drafters.head import HeadDrafter
from ssmspec.speculate.drafters.ngram import PromptLookupDrafter


class FusedDrafter(Wrapper):
    """RASD-style fusion of a draft model's (or a draft head's) tree with a retrieval tree: both drafters propose for
    every row, the retrieval tree is pruned with the draft model's probabilities, and what is left is merged into
    the draft's tree by longest-prefix matching (a retrieved path that starts like a drafted one continues it; the
    rest branch off), within one node budget, so both are verified in one pass. The draft model gets `draft_share`
    of the budget; the retrieval tree fills the rest (nodes the two agree on are counted once).

    Pruning: wherever a retrieved token would branch off a node whose children the draft model scored (the
    root, and the inner nodes of its dynamic tree), it is dropped with its subtree when the draft gives it a
    probability below `prune_below`, and the budget goes to the next retrieved candidates (the retrieval
    tree is asked for twice the budget). Retrieval still adds what the draft did not consider likely enough
    to draft, but not what the draft rules out. When sampling, retrieved nodes stay deterministic proposals
    next to the draft's sampled ones, only where they do not collide with a sampled node's parent (a node's
    children are either all sampled or all deterministic, which the verifier requires).

    Args:
        draft: the draft model's drafter.
        retrieval: a PromptLookupDrafter (with a corpus) in tree mode.
        draft_share: the draft model's share of the node budget.
        prune_below: the draft probability under which a retrieved branch is pruned (0: no pruning).
    """

    def __init__(
        self, draft: DraftModelDrafter | HeadDrafter, retrieval: PromptLookupDrafter, draft_share: float = 0.5,
        prune_below: float = 0.01,
    ) -> None:  # fmt: skip
        self.draft = draft
        self.retrieval = retrieval
        self.inner = (draft, retrieval)
        self.draft_share = draft_share
        self.prune_below = prune_below
        self.pruned = 0  # retrieved branches pruned in this generate call

    def start(self, input_ids, attention_mask):
        self.pruned = 0
        super().start(input_ids, attention_mask)

    def finish(self, stats) -> None:
        super().finish(stats)
        stats.drafter["pruned"] = self.pruned

    def propose(self, contexts, max_nodes, max_depth):
        if self.decoding is not None and self.decoding.do_sample:
            # a sampled tree's every node but its leaves carries a q, and retrieved nodes never go under those: they
            # can only continue a leaf above max_depth, so the draft gets the whole budget (its half left the
            # MTP layer of the embedded Nemotron-H one branch at the root instead of three: 2.4 tokens a step
            # against 2.85)
            share = max_nodes
        else:
            share = max(1, int(round(max_nodes * self.draft_share))) if max_nodes > 1 else max_nodes
        drafted = self.draft.propose(contexts, share, max_depth)
        if share == max_nodes and all(len(d[0]) - 1 >= max_nodes for d in drafted):
            return drafted  # (nothing left for retrieval to fill)
        prune = self.prune_below > 0 and bool(self.draft.scored)
        retrieved = self.retrieval.propose(contexts, 2 * max_nodes if prune else max_nodes, max_depth)
        return [
            _merge(d, e, max_nodes, self._pruner(self.draft.scored[r]) if prune else None)
            for r, (d, e) in enumerate(zip(drafted, retrieved))
        ]

    # ------------------------------------------------------------------ Saguaro (ssmspec.speculate.drafters.ahead)
    def save_state(self) -> tuple:
        """The draft model's state (`DraftModelDrafter.save_state`) and the pruning count; retrieval keeps no
        state of its own (its indexes follow the contexts)."""
        return self.draft.save_state(), self.pruned

    def load_state(self, state: tuple) -> None:
        self.draft.load_state(state[0])
        self.pruned = state[1]

    def node_logits(self, contexts, drafts) -> list[dict]:
        """The draft model's logits after every node of the fused drafts (see DraftModelDrafter.node_logits)."""
        return self.draft.node_logits(contexts, drafts)

    def frozen(self):
        """Propose without extending the retrieval's context indexes (PromptLookupDrafter.frozen)."""
        return self.retrieval.frozen()

    def _pruner(self, scored: dict[int, torch.Tensor]):
        """keep(node, token) for `_merge`: False where the draft scored `node`'s children and gives `token` a
        probability below `prune_below`; a token outside a trimmed draft vocabulary (logit -inf) is kept, as
        the draft says nothing about it."""
        probs: dict[int, torch.Tensor] = {}

        def keep(node: int, token: int) -> bool:
            logits = scored.get(node)
            if logits is None or not math.isfinite(float(logits[token])):
                return True
            if node not in probs:
                probs[node] = logits.float().softmax(-1)
            if float(probs[node][token]) >= self.prune_below:
                return True
            self.pruned += 1
            return False

        return keep


def _merge(base: tuple, extra: Draft, max_nodes: int, keep=None) -> tuple:
    """`extra`'s nodes merged into `base` (prefix-matched, in `extra`'s order) up to `max_nodes` drafted
    nodes; extra nodes never go under a node whose children were sampled (those carry a q). `keep(node,
    token)`: whether a new child `token` may branch off base node `node` (None: always); a refused node's
    subtree is dropped with it."""
    tokens, parents = list(base[0]), list(base[1])
    qs = base[2] if len(base) > 2 else None
    child = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents)) if p >= 0}
    where = {0: 0}  # extra node -> merged node
    for j in range(1, len(extra[0])):
        parent = where.get(extra[1][j])
        if parent is None:
            continue
        key = (parent, extra[0][j])
        if key in child:
            where[j] = child[key]
        elif (
            len(tokens) - 1 < max_nodes
            and not (qs and parent in qs)
            and (keep is None or parent >= len(base[0]) or keep(parent, extra[0][j]))
        ):
            tokens.append(extra[0][j])
            parents.append(parent)
            child[key] = where[j] = len(tokens) - 1
    return (tokens, parents, qs) if qs is not None else (tokens, parents)
