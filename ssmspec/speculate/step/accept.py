"""The accept part of a step: which drafted nodes each row keeps, greedy (walk while the target's argmax matches a
child) or by lossless speculative sampling (recursive rejection sampling over siblings), read from the verified
logits in one transfer (`accept`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ssmspec.speculate.decoding import Decoding
from ssmspec.speculate.step import Accepted, Verified
from ssmspec.speculate.ties import near_ties
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


def greedy_accept(
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


def sample_accept(
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


def accept(verified: Verified, decoding: Decoding, tolerance: float, topk: int = 0) -> Accepted:
    """Each row's accepted path and emitted tokens (greedy: the target's argmax; sampling: recursive rejection
    sampling with `decoding.generator`), the near-ties of the target's logits per node (greedy; `tolerance`:
    `near_tie_tolerance`) and, for a drafter that recycles them, the target's `topk` next tokens after every node.
    Greedy reads the device once: argmax, near-ties and top-k together."""
    tree, logits, scores = verified.tree, verified.logits, verified.scores
    if decoding.do_sample:
        last, emitted = sample_accept(tree, scores, verified.qs, decoding.generator, verified.active)
        tops = tuple(x.tolist() for x in top_k(logits, topk)) if topk else None
        return Accepted(last.tolist(), emitted, None, tops)
    ties_now = near_ties(logits, tolerance).long()
    tops = None
    if topk:
        ids_k, probs_k = top_k(logits, topk)
        picked = torch.cat([scores.argmax(-1)[..., None].double(), ties_now[..., None].double(), ids_k.double(),
                            probs_k.double()], -1).tolist()  # [B][N][2 + 2k]  # fmt: skip
        target = [[int(node[0]) for node in row] for row in picked]
        ties = [[bool(node[1]) for node in row] for row in picked]
        tops = ([[[int(i) for i in node[2 : 2 + topk]] for node in row] for row in picked],
                [[node[2 + topk :] for node in row] for row in picked])  # fmt: skip
    else:
        target, flags = torch.stack([scores.argmax(-1), ties_now]).tolist()
        ties = [[bool(f) for f in row] for row in flags]
    last, emitted = greedy_accept(tree, None, target=target)
    return Accepted(last.tolist(), emitted, ties, tops)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely next tokens per position and their probabilities (softmax of the raw logits)."""
    logits = logits.float()
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return ids, (values - logits.logsumexp(-1, keepdim=True)).exp()
