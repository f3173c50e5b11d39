"""Drafters: propose a token tree per row from the context (prompt + emitted tokens, root last).

`propose(contexts, max_nodes, max_depth)` returns one (tokens, parents) pair per row with node 0 = the
root (contexts[b][-1]) and parents[t] < t. Drafts never change the output, only the speed: verification
keeps exactly the target's greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ssmspec.errors import VocabMismatchError
from ssmspec.speculate.runner import ModelRunner
from ssmspec.transform import transform
from ssmspec.tree import TokenTree

Draft = tuple[list[int], list[int]]


class Drafter:
    """Base class: subclasses implement `propose`; `start` sees the prompt once per generate call."""

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Called once before the first proposal."""

    def propose(self, contexts: Sequence[Sequence[int]], max_nodes: int, max_depth: int) -> list[Draft]:
        """One tree per row (root included)."""
        raise NotImplementedError


class NoDrafter(Drafter):
    """Proposes nothing: plain greedy decoding through the tree path (ssmspec's own autoregressive decode)."""

    def propose(self, contexts, max_nodes, max_depth):
        return [([ctx[-1]], [-1]) for ctx in contexts]


def _trie(root: int, continuations: Sequence[Sequence[int]], max_nodes: int) -> Draft:
    """Merge continuations (in priority order) into a trie under the root, at most max_nodes drafted nodes."""
    tokens, parents = [root], [-1]
    children: dict[tuple[int, int], int] = {}
    for seq in continuations:
        cur = 0
        for tok in seq:
            key = (cur, int(tok))
            if key not in children:
                if len(tokens) - 1 >= max_nodes:
                    break
                children[key] = len(tokens)
                tokens.append(int(tok))
                parents.append(cur)
            cur = children[key]
    return tokens, parents


class PromptLookupDrafter(Drafter):
    """N-gram prompt lookup (as HF's prompt_lookup_num_tokens): match the last n tokens earlier in the
    context and propose what followed. In tree mode several matches are merged into a trie."""

    def __init__(self, max_matching_ngram_size: int = 2, tree: bool = False, max_matches: int = 8) -> None:
        self.max_ngram = max_matching_ngram_size
        self.tree = tree
        self.max_matches = max_matches

    def continuations(self, ctx: Sequence[int], depth: int) -> list[list[int]]:
        """Continuations after earlier occurrences of the context's last n-gram, longest n first, latest first."""
        found: list[list[int]] = []
        n_ctx = len(ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), 0, -1):
            tail = list(ctx[n_ctx - n :])
            for start in range(n_ctx - n - 1, -1, -1):
                if list(ctx[start : start + n]) == tail:
                    cont = list(ctx[start + n : start + n + depth])
                    if cont and cont not in found:
                        found.append(cont)
                        if not self.tree or len(found) >= self.max_matches:
                            return found
            if found and not self.tree:
                return found
        return found

    def propose(self, contexts, max_nodes, max_depth):
        out = []
        for ctx in contexts:
            conts = self.continuations(ctx, max_depth) if max_depth > 0 and max_nodes > 0 else []
            out.append(_trie(int(ctx[-1]), conts[:1] if not self.tree else conts, max_nodes))
        return out


class DraftModelDrafter(Drafter):
    """A smaller causal LM drafts a chain greedily. The draft is itself transformed, so an SSM draft rolls
    its state back exactly (snapshot/restore around drafting, catch-up through tree verification)."""

    def __init__(self, draft_model: nn.Module, target_vocab_size: int, strategy: str = "replay") -> None:
        draft_vocab = getattr(draft_model.config.get_text_config(), "vocab_size", None)
        if draft_vocab != target_vocab_size:
            raise VocabMismatchError(
                f"draft model vocab_size {draft_vocab} != target vocab_size {target_vocab_size}; the draft must "
                "share the target's tokenizer"
            )
        self.runner = ModelRunner(transform(draft_model), strategy=strategy)
        self.processed: list[int] = []

    def start(self, input_ids, attention_mask):
        self.runner.prefill(input_ids, attention_mask)
        self.processed = attention_mask.sum(-1).tolist()
        self._device = input_ids.device

    def propose(self, contexts, max_nodes, max_depth):
        depth = min(max_nodes, max_depth)
        if depth <= 0:
            return [([int(c[-1])], [-1]) for c in contexts]
        dev = self._device
        # 1. catch up: feed each row's unprocessed tokens (root last) as a chain and commit them
        # a finished row stops growing; re-feeding its last token only disturbs that row's (unused) draft state
        pending = [list(ctx[self.processed[b] :]) or [ctx[-1]] for b, ctx in enumerate(contexts)]
        tree = TokenTree.from_lists(pending, [list(range(-1, len(p) - 1)) for p in pending], device=dev)
        logits = self.runner.verify(tree)
        last = torch.tensor([len(p) - 1 for p in pending], device=dev)
        self.runner.commit(last)
        self.processed = [len(ctx) for ctx in contexts]
        nxt = logits[torch.arange(len(pending), device=dev), last].argmax(-1)
        drafts = [[int(t)] for t in nxt]
        # 2. draft greedily, then roll back
        snap = self.runner.snapshot()
        for _ in range(depth - 1):
            logits = self.runner.verify(TokenTree.chain(nxt[:, None]))
            self.runner.commit(torch.zeros_like(nxt))
            nxt = logits[:, 0].argmax(-1)
            for b, t in enumerate(nxt.tolist()):
                drafts[b].append(t)
        self.runner.restore(snap)
        return [([int(ctx[-1])] + d, list(range(-1, len(d)))) for ctx, d in zip(contexts, drafts)]
