"""RASD: a draft model's tree fused with a retrieval tree."""

from __future__ import annotations

import math

import torch

from ssmspec.speculate.drafters.base import Draft, Wrapper, depth_of
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

    With `retrieval_first` (a draft head or MTP layer: ssmspec.speculate.defaults.build_drafter), a greedy step asks
    retrieval first, and where every row's retrieved tree already reaches the step's depth, that is the step's draft
    and the draft is not run: its levels cost a forward each and add branches to a path repeated text already
    spells out; where retrieval falls short (and on every sampled step), both draft and are fused as above. Greedy,
    128 new tokens, 2-core CPU, against ssmspec's plain decoding, alternated in one process (held-out code / prose /
    random-token prompts): the embedded 19.6M Nemotron-H's head 2.18x / 2.88x / 1.99x against 2.09x / 2.38x / 1.96x
    fused every step; the embedded Nemotron-H's MTP layer 1.96x / 2.15x / 2.34x against 1.74x / 1.76x / 1.98x; the 3M
    target's head 1.57x / 1.68x / 1.57x against its n-gram trees alone at 1.57x / 1.38x / 1.40x.

    Args:
        draft: the draft model's drafter.
        retrieval: a PromptLookupDrafter (with a corpus) in tree mode.
        draft_share: the draft model's share of the node budget.
        prune_below: the draft probability under which a retrieved branch is pruned (0: no pruning).
        retrieval_first: greedy steps draft with `draft` only where retrieval does not reach the step's depth.
    """

    def __init__(
        self, draft: DraftModelDrafter | HeadDrafter, retrieval: PromptLookupDrafter, draft_share: float = 0.5,
        prune_below: float = 0.01, retrieval_first: bool = False,
    ) -> None:  # fmt: skip
        self.draft = draft
        self.retrieval = retrieval
        self.inner = (draft, retrieval)
        self.draft_share = draft_share
        self.prune_below = prune_below
        self.retrieval_first = retrieval_first
        self.pruned = 0  # retrieved branches pruned in this generate call
        self.retrieved_only = 0  # greedy steps retrieval drafted alone (`retrieval_first`) in this generate call

    def start(self, input_ids, attention_mask):
        self.pruned = 0
        self.retrieved_only = 0
        super().start(input_ids, attention_mask)

    def finish(self, stats) -> None:
        super().finish(stats)
        stats.drafter["pruned"] = self.pruned
        if self.retrieval_first:
            stats.drafter["retrieved_only"] = self.retrieved_only

    def propose(self, contexts, max_nodes, max_depth):
        if self.decoding is not None and self.decoding.do_sample:
            # a sampled tree's every node but its leaves carries a q, and retrieved nodes never go under those: they
            # can only continue a leaf above max_depth, so the draft gets the whole budget (its half left the
            # MTP layer of the embedded Nemotron-H one branch at the root instead of three: 2.4 tokens a step
            # against 2.85)
            share = max_nodes
        else:
            share = max(1, int(round(max_nodes * self.draft_share))) if max_nodes > 1 else max_nodes
            if self.retrieval_first and max_depth > 0:
                retrieved = self.retrieval.propose(contexts, max_nodes, max_depth)
                if all(depth_of(parents) >= max_depth for _, parents, *_ in retrieved):
                    self.retrieved_only += 1
                    return retrieved
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
