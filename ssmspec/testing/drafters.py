"""Adversarial drafters for property tests: random trees, an oracle, and an oracle that goes wrong.

Verification must return the target's greedy tokens whatever the drafter proposes; these drafters make
acceptance lengths, branch positions and rejections vary so that every commit path gets exercised.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ssmspec.speculate.drafters import Draft, Drafter


class RandomDrafter(Drafter):
    """Random tokens in random tree shapes, or random chains (mostly rejected: exercises 'accept nothing').

    Args:
        vocab_size: tokens are drawn from range(vocab_size).
        seed: the drafter's own random generator seed.
        chain: draft chains only (for models that verify chains only).
    """

    def __init__(self, vocab_size: int, seed: int = 0, chain: bool = False) -> None:
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.chain = chain

    def propose(self, contexts, max_nodes, max_depth):
        out = []
        for ctx in contexts:
            tokens, parents, depth = [int(ctx[-1])], [-1], [0]
            for _ in range(self.rng.randint(0, max_nodes) if max_depth > 0 else 0):
                cands = [t for t in range(len(tokens)) if depth[t] < max_depth]
                if not cands or (self.chain and depth[-1] >= max_depth):
                    break
                p = len(tokens) - 1 if self.chain else self.rng.choice(cands)
                tokens.append(self.rng.randrange(self.vocab_size))
                parents.append(p)
                depth.append(depth[p] + 1)
            out.append((tokens, parents))
        return out


class OracleDrafter(Drafter):
    """Knows the reference greedy sequence of every row (real tokens, no padding) and proposes its
    continuation as a chain inside a tree.

    Args:
        reference: per row, the reference's real tokens (prompt and greedy output).
        vocab_size: wrong tokens are drawn from range(vocab_size).
        right_prefix: how many drafted tokens are right before the chain goes wrong (None = always right).
        distractors: wrong siblings placed BEFORE the right child at each level, so the correct branch is
            not the first child.
        seed: the random generator that picks wrong tokens.
    """

    def __init__(
        self,
        reference: Sequence[Sequence[int]],
        *,
        vocab_size: int,
        right_prefix: int | None = None,
        distractors: int = 0,
        seed: int = 0,
    ) -> None:
        self.reference = [list(r) for r in reference]
        self.vocab_size = vocab_size
        self.right_prefix = right_prefix
        self.distractors = distractors
        self.rng = random.Random(seed)

    def _wrong(self, right: int) -> int:
        tok = self.rng.randrange(self.vocab_size - 1)
        return tok if tok < right else tok + 1

    def propose(self, contexts, max_nodes, max_depth) -> list[Draft]:
        out = []
        for b, ctx in enumerate(contexts):
            ref = self.reference[b]
            pos = len(ctx)  # index in ref of the first token to draft (ctx is a prefix of ref)
            tokens, parents = [int(ctx[-1])], [-1]
            cur = 0
            for i in range(max_depth):
                if pos + i >= len(ref) or len(tokens) >= max_nodes + 1:
                    break
                right = ref[pos + i]
                tok = right if self.right_prefix is None or i < self.right_prefix else self._wrong(right)
                for _ in range(self.distractors):
                    if len(tokens) >= max_nodes:
                        break
                    tokens.append(self._wrong(right))
                    parents.append(cur)
                tokens.append(tok)
                parents.append(cur)
                cur = len(tokens) - 1
            out.append((tokens, parents))
        return out
