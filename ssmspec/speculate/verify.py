"""Tree verification: greedy (walk while the target's argmax matches a child) and lossless speculative sampling
(recursive rejection sampling over siblings)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ssmspec.tree import TokenTree

Walk = Callable[[int, dict[int, list[int]], list[int]], tuple[int, list[int]]]


def walk_rows(tree: TokenTree, walk: Walk, rows: Sequence[bool] | None = None) -> tuple[torch.Tensor, list[list[int]]]:
    """The loop every verifier shares: per row, `walk(row, children, tokens)` returns (last accepted node,
    emitted tokens), where `children[node]` lists the node's acceptable children in node order and `tokens`
    is the row's node tokens. Rows where `rows` is False are skipped (last node 0, nothing emitted).

    Returns:
        (last accepted node per row [B], on the host, emitted tokens per row).
    """
    tokens, parents, ok = tree._tokens_list, tree._parents_list, tree._acceptable_list
    last, emitted = [], []
    for b in range(tree.batch_size):
        if rows is not None and not rows[b]:
            last.append(0)
            emitted.append([])
            continue
        kids: dict[int, list[int]] = {}
        for t in range(1, tree.num_nodes):
            if ok[b][t]:
                kids.setdefault(parents[b][t], []).append(t)
        node, out = walk(b, kids, tokens[b])
        last.append(node)
        emitted.append(out)
    return torch.tensor(last, dtype=torch.long), emitted


def greedy_verify(
    tree: TokenTree, logits: torch.Tensor | None, target: list[list[int]] | None = None
) -> tuple[torch.Tensor, list[list[int]]]:
    """Returns (last accepted node per row [B], on the host, emitted tokens per row: accepted drafts then the
    bonus token).

    A child is accepted when it is acceptable and its token equals argmax(logits[parent]); siblings are
    searched in node order, so the correct branch need not be the first child. `target`: that argmax per row
    and node, already read from the device (the engine reads it with the near-ties, in one transfer).
    """
    if target is None:
        target = logits.argmax(-1).tolist()  # [B, N]
    if tree.num_nodes == 1:  # roots only (a plain decoding step): every row emits the target's choice at its root
        return torch.zeros(tree.batch_size, dtype=torch.long), [[row[0]] for row in target]

    def walk(b: int, kids: dict[int, list[int]], tokens: list[int]) -> tuple[int, list[int]]:
        cur, out = 0, []
        while True:
            want = target[b][cur]
            out.append(want)
            nxt = next((c for c in kids.get(cur, ()) if tokens[c] == want), None)
            if nxt is None:
                return cur, out
            cur = nxt

    return walk_rows(tree, walk)


def sample_verify(
    tree: TokenTree,
    scores: torch.Tensor,
    q: list[dict[int, torch.Tensor] | None],
    generator: torch.Generator | None = None,
    rows: list[bool] | None = None,
) -> tuple[torch.Tensor, list[list[int]]]:
    """Lossless speculative sampling over a tree; returns (last accepted node per row [B], emitted tokens per
    row: accepted drafts then one token sampled from what is left of the target's distribution).

    At each node, p = softmax(processed target scores). Children whose parent has no draft distribution in
    `q[row]` were proposed deterministically: sampling x ~ p and following the child with token x is the
    multi-candidate rule (accept c_i with probability p(c_i) of what is left, then drop it). Children drawn
    from a draft distribution q[row][parent] (several siblings: drawn without replacement, in order) go through
    recursive rejection sampling: accept c with min(1, p(c)/q(c)); on rejection p <- norm((p - q)+) and c is
    removed from q. If no child is accepted, the token is sampled from the final p. The output is distributed
    exactly as sampling from the target token by token. Rows where `rows` is False are skipped (last 0).
    """
    probs = scores.double().softmax(-1)

    def walk(b: int, kids: dict[int, list[int]], tokens: list[int]) -> tuple[int, list[int]]:
        drafts = q[b] or {}
        cur, out = 0, []
        while True:
            p = probs[b, cur]
            nxt = None
            if cur in kids and cur not in drafts:
                x = int(torch.multinomial(p, 1, generator=generator))
                nxt = next((c for c in kids[cur] if tokens[c] == x), None)
                out.append(x)
                if nxt is None:
                    return cur, out
                cur = nxt
                continue
            if cur in kids:
                qd = drafts[cur].to(p).clone()
                for c in kids[cur]:
                    x = tokens[c]
                    if qd[x] <= 0:  # not drawn from this distribution: never acceptable under it
                        continue
                    u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
                    if u * qd[x] < p[x]:
                        nxt = c
                        break
                    residual = (p - qd).clamp(min=0)
                    total = residual.sum()
                    if total > 0:  # zero only when p == q, where the draft was accepted surely
                        p = residual / total
                    qd[x] = 0
                    qd = qd / qd.sum().clamp(min=torch.finfo(qd.dtype).tiny)
            if nxt is not None:
                out.append(tokens[nxt])
                cur = nxt
                continue
            out.append(int(torch.multinomial(p, 1, generator=generator)))
            return cur, out

    return walk_rows(tree, walk, rows)
