"""Token recycling and calibrated best-first trees for context drafters.

Token recycling (Luo et al., 2024, "Turning Trash into Treasure"): every step the target computes logits for
every node it verifies, accepted or not, and throws them away after picking the argmax. Their top-k is a
free, context-aware guess of what follows that token: `SuccessorTable` keeps, per (previous token, token)
and per token, the target's latest top-k successors with their probabilities, and proposes them as drafts.

Calibrated best-first trees: the n-gram votes (a share of the votes at each branch) and the recycled
probabilities are evidence of different quality. `Calibration` learns online, per bucket of (vote share,
target probability), how often a drafted node whose parent was accepted is accepted too, and `best_first`
grows the tree by the product of those estimates along each path under the node budget (EAGLE-2 / Sequoia:
the expected accepted length is the sum over nodes of their path probabilities, so the best tree of B nodes
takes the B likeliest paths' nodes). A chain follows the likeliest child instead. Drafts only change speed:
the verifier keeps the target's own tokens whatever is proposed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

# bucket edges of the two pieces of evidence a candidate has: its share of the n-gram votes at its branch and
# the target's probability for it after its parent's token (recycled); 0 = no such evidence
SHARE_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95)
PROB_EDGES = (0.0, 0.05, 0.15, 0.3, 0.5, 0.7, 0.9)


def _bucket(x: float, edges: Sequence[float]) -> int:
    """Index of the last edge <= x (x in [0, 1])."""
    i = 0
    while i + 1 < len(edges) and x >= edges[i + 1]:
        i += 1
    return i


class SuccessorTable:
    """The target's top-k successors of tokens it processed, keyed by (previous token, token) and by token
    alone (the fallback); the latest observation replaces older ones.

    Args:
        k: successors kept per key.
    """

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"token recycling keeps k >= 1 successors per token, got {k}")
        self.k = int(k)
        self._pairs: dict[tuple[int, int], list[tuple[int, float]]] = {}
        self._tokens: dict[int, list[tuple[int, float]]] = {}

    def learn(self, prev: int | None, token: int, ids: Sequence[int], probs: Sequence[float]) -> None:
        """After `token` (preceded by `prev`; None at the start of a context) the target ranked `ids` first,
        with probabilities `probs`."""
        top = list(zip((int(i) for i in ids[: self.k]), (float(p) for p in probs[: self.k])))
        self._tokens[token] = top
        if prev is not None:
            self._pairs[(prev, token)] = top

    def knows(self, prev: int | None, token: int) -> bool:
        """Whether successors of `token` after `prev` (of `token` alone, for no `prev`) were learned."""
        return (prev, token) in self._pairs if prev is not None else token in self._tokens

    def successors(self, prev: int | None, token: int) -> list[tuple[int, float]]:
        """What the target ranked first after `token` (following `prev` where that pair was seen), best first."""
        if prev is not None:
            top = self._pairs.get((prev, token))
            if top is not None:
                return top
        return self._tokens.get(token, [])


class Calibration:
    """Online acceptance rate of drafted nodes per bucket of evidence (vote share, target probability), over
    the nodes the target tested (their parent was accepted), with a prior of `prior_weight` nodes at a guess
    from the evidence itself."""

    def __init__(self, prior_weight: float = 2.0) -> None:
        self.prior_weight = prior_weight
        self._counts: dict[tuple[int, int], list[float]] = {}

    @staticmethod
    def feature(share: float, prob: float) -> tuple[int, int]:
        """The bucket of a candidate's evidence."""
        return _bucket(share, SHARE_EDGES), _bucket(prob, PROB_EDGES)

    def estimate(self, feature: tuple[int, int]) -> float:
        """The chance that a node with this evidence is accepted once its parent is."""
        accepted, tested = self._counts.get(feature, (0.0, 0.0))
        guess = max(0.8 * SHARE_EDGES[feature[0]], PROB_EDGES[feature[1]], 0.05)
        return (accepted + self.prior_weight * guess) / (tested + self.prior_weight)

    def update(self, feature: tuple[int, int], accepted: bool) -> None:
        """A node with this evidence was tested; whether the target accepted it."""
        counts = self._counts.setdefault(feature, [0.0, 0.0])
        counts[0] += float(accepted)
        counts[1] += 1.0


class Trie:
    """Weighted continuations merged into a trie: node 0 is the root; `weight[n]` sums the votes through n."""

    def __init__(self, root: int, continuations: Sequence[tuple[Sequence[int], float]]) -> None:
        self.tokens, self.parents, self.weight, self.depth = [root], [-1], [0.0], [0]
        self.children: dict[tuple[int, int], int] = {}
        self.kids: dict[int, list[int]] = {}
        for seq, w in continuations:
            cur = 0
            for tok in seq:
                key = (cur, int(tok))
                if key not in self.children:
                    node = self.children[key] = len(self.tokens)
                    self.tokens.append(int(tok))
                    self.parents.append(cur)
                    self.weight.append(0.0)
                    self.depth.append(self.depth[cur] + 1)
                    self.kids.setdefault(cur, []).append(node)
                cur = self.children[key]
                self.weight[cur] += w
        self.weight[0] = sum(w for _, w in continuations)


def best_first(
    prev: int | None, trie: Trie, table: SuccessorTable | None, calibration: Calibration, max_nodes: int,
    max_depth: int, chain: bool,
) -> tuple[list[int], list[int], list[tuple[int, ...]], list[tuple[int, int]], list[float]]:  # fmt: skip
    """The draft of at most `max_nodes` nodes, `max_depth` deep, whose nodes have the highest estimated path
    probabilities; candidates after a node are the trie's children (with their vote shares) and the target's
    recycled successors of the node's token (with their probabilities), merged by token. `prev`: the token
    before the root (the context's second to last). Returns (tokens, parents, each node's token path from
    the root, each node's evidence bucket, each node's estimated log path probability); node 0 is the root,
    the others come in the order they were chosen (so every prefix is a tree)."""
    root = trie.tokens[0]
    tokens, parents, logp, depth = [root], [-1], [0.0], [0]
    paths: list[tuple[int, ...]] = [()]
    features: list[tuple[int, int]] = [(0, 0)]
    prev_of = [prev]  # the token before each node's token
    trie_node = [0]  # the trie node each draft node stands on (-1: off the trie)
    heap: list[tuple[float, int, int, int, tuple[int, int], int]] = []
    counter = 0

    def expand(n: int) -> None:
        nonlocal counter
        if depth[n] >= max_depth:
            return
        cands: dict[int, list] = {}  # token -> [share, prob, trie node]
        at = trie_node[n]
        if at >= 0 and at in trie.kids:
            total = sum(trie.weight[k] for k in trie.kids[at])
            for k in trie.kids[at]:
                cands[trie.tokens[k]] = [trie.weight[k] / total, 0.0, k]
        if table is not None:
            for tok, p in table.successors(prev_of[n], tokens[n]):
                if tok in cands:
                    cands[tok][1] = p
                else:
                    cands[tok] = [0.0, p, -1]
        for tok, (share, p, k) in cands.items():
            feature = Calibration.feature(share, p)
            counter += 1
            heapq.heappush(heap, (-(logp[n] + math.log(calibration.estimate(feature))), counter, n, tok, feature, k))

    expand(0)
    while heap and len(tokens) <= max_nodes:
        neg, _, parent, tok, feature, k = heapq.heappop(heap)
        if chain and parent != len(tokens) - 1:
            continue  # a chain only extends its last node
        tokens.append(tok)
        parents.append(parent)
        logp.append(-neg)
        depth.append(depth[parent] + 1)
        paths.append((*paths[parent], tok))
        features.append(feature)
        prev_of.append(tokens[parent])
        trie_node.append(k)
        expand(len(tokens) - 1)
    return tokens, parents, paths, features, logp


def goodput_size(logp: Sequence[float], cost: Callable[[int], float]) -> int:
    """How many nodes of a best-first draft (root included; `logp`: each node's log path probability, root
    first) maximise the expected tokens of the step (1 + the drafted nodes' path probabilities) per unit of
    its cost (`cost(n)`: verifying n nodes, relative to a decode step). 1: no drafts, plain decoding."""
    best, size, expected = 1.0 / cost(1), 1, 1.0
    for n in range(1, len(logp)):
        expected += math.exp(logp[n])
        goodput = expected / cost(n + 1)
        if goodput > best * 1.0001:  # ties go to the smaller tree
            best, size = goodput, n + 1
    return size
