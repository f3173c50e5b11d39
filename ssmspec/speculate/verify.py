"""Greedy tree verification: walk from the root while the target's argmax matches a child."""

from __future__ import annotations

import torch

from ssmspec.tree import TokenTree


def greedy_verify(tree: TokenTree, logits: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """Returns (last accepted node per row [B], emitted tokens per row: accepted drafts then the bonus token).

    A child is accepted when it is acceptable and its token equals argmax(logits[parent]); siblings are
    searched in node order, so the correct branch need not be the first child.
    """
    target = logits.argmax(-1).tolist()  # [B, N]
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    ok = tree.acceptable.tolist()
    last, emitted = [], []
    for b in range(tree.batch_size):
        children: dict[int, list[int]] = {}
        for t in range(1, tree.num_nodes):
            if ok[b][t]:
                children.setdefault(parents[b][t], []).append(t)
        cur, out = 0, []
        while True:
            want = target[b][cur]
            out.append(want)
            nxt = next((c for c in children.get(cur, ()) if tokens[b][c] == want), None)
            if nxt is None:
                break
            cur = nxt
        last.append(cur)
        emitted.append(out)
    return torch.tensor(last, dtype=torch.long, device=tree.tokens.device), emitted
