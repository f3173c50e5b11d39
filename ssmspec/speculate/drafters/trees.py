"""How drafters that score candidate tokens grow their trees, whatever scores them (a draft model's forward, a
draft head on the target's features): best first by path probability for greedy decoding (DySpec; EAGLE-2's
global re-ranking), sampled level by level for speculative sampling (Gumbel-top-k or stochastic beam search, each
node's children drawn from its q without replacement, q returned with the tree)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import torch

from ssmspec.speculate.decoding import Decoding
from ssmspec.speculate.drafters.base import Draft

# (trees, the new nodes per row) -> the logits [M, V] at those nodes, rows in order, each row's nodes in order
LogitsAt = Callable[[list, list], torch.Tensor]


def best_first_tree(
    contexts: Sequence[Sequence[int]], root_logits: torch.Tensor, logits_at: LogitsAt, max_nodes: int,
    max_depth: int, per_round: int, min_path_prob: float,
) -> tuple[list[Draft], int]:  # fmt: skip
    """A dynamic tree per row, rooted at `contexts[b][-1]` (its logits `root_logits[b]`), grown best-first by the
    drafter's path probability (the product of its probabilities along the root-to-node path), `per_round` nodes
    per round and row, one `logits_at` call per round over all rows; a node joins only while the row has budget
    left and its path probability reaches `min_path_prob`, so confident drafts grow deep trees, unsure ones small
    ones. Children never outscore their parent, so the nodes taken form a tree. A row whose drafter is so unsure that
    not even the root's likeliest child reaches `min_path_prob` (a flat distribution) drafts a chain of its likeliest
    tokens instead (a tree of no node would make every step a plain step). `logits_at(trees, new)` sees trees as
    (tokens, parents, depth, path probability) per row. Returns the trees and how many rows fell back to a chain."""
    b = len(contexts)
    trees = [([int(c[-1])], [-1], [0], [1.0]) for c in contexts]
    heaps: list[list] = [[] for _ in range(b)]
    new = [[0] for _ in range(b)]  # nodes whose children are not scored yet (their logits in `at`, in order)
    chain = [False] * b  # rows drafting their likeliest chain (nothing reached min_path_prob at the root)
    at = root_logits
    for round_ in range(max_nodes):
        k = 0
        probs = at.float().softmax(-1)
        top_p, top_x = probs.topk(min(per_round + 1, probs.shape[-1]), dim=-1)
        top_p, top_x = top_p.tolist(), top_x.tolist()
        for r, (tokens, parents, depth, score) in enumerate(trees):
            if round_ == 0 and score[0] * top_p[k][0] < min_path_prob:
                chain[r] = True
            for node in new[r]:
                if depth[node] < max_depth:
                    for p, x in zip(top_p[k][:1] if chain[r] else top_p[k], top_x[k]):
                        s = score[node] * p
                        if s >= min_path_prob or chain[r]:
                            heapq.heappush(heaps[r], (-s, node, x))
                k += 1
            new[r] = []
            while heaps[r] and len(new[r]) < per_round and len(tokens) <= max_nodes:
                neg, node, x = heapq.heappop(heaps[r])
                tokens.append(x)
                parents.append(node)
                depth.append(depth[node] + 1)
                score.append(-neg)
                new[r].append(len(tokens) - 1)
        if not any(new) or all(len(t[0]) > max_nodes for t in trees):
            break
        at = logits_at(trees, new)
    return [(tokens, parents) for tokens, parents, _, _ in trees], sum(chain)


def sample_tree(
    contexts: Sequence[Sequence[int]], root_logits: torch.Tensor, logits_at: LogitsAt, depth: int, width: int,
    sampling_tree: str, decoding: Decoding,
) -> list[Draft]:  # fmt: skip
    """A sampled draft tree per row, `depth` levels deep, rooted at `contexts[b][-1]` (its logits `root_logits[b]`):
    each level's children drawn by `grow_level` from the drafter's distributions q (its logits processed by the
    target's processors and warpers, `decoding`, given each node's ids, as the target's p is; `decoding`'s
    generator draws), the next level's logits from `logits_at(trees, new)` (trees as (tokens, parents, {node: q},
    frontier) per row). Returns (tokens, parents, {node: q}) per row."""
    trees = [([int(c[-1])], [-1], {}, [(0, 0.0, 0.0)]) for c in contexts]
    at = root_logits  # the drafter's logits at the frontier nodes, in frontier order (the roots first)
    with_ids = decoding.reads_ids  # the warpers alone read no ids: none are built
    for level in range(depth):
        seqs, where = [], []
        for r, (tokens, parents, _, frontier) in enumerate(trees):
            for node, _, _ in frontier:
                where.append(r)
                if with_ids:
                    path, cur = [], node
                    while cur > 0:
                        path.append(tokens[cur])
                        cur = parents[cur]
                    seqs.append(list(contexts[r]) + path[::-1])
        dists = decoding.proposal(seqs if with_ids else None, at.float(), where)
        grown = grow_level(trees, dists, width, level, decoding.generator, sampling_tree)
        if level == depth - 1 or not any(grown):
            break
        trees = [(t, p, q, f) for (t, p, q, _), f in zip(trees, grown)]
        at = logits_at(trees, [[node for node, *_ in f] for f in grown])
    return [(tokens, parents, qs) for tokens, parents, qs, _ in trees]


def grow_level(trees, dists: torch.Tensor, width: int, level: int, gen, sampling_tree: str) -> list[list]:
    """Add one level of children to every row's frontier (their distributions `dists`, in frontier order);
    returns the new frontiers. Gumbel-top-k: `width` distinct children of the root, then one sampled child
    per node. Stochastic beam search: the `width` best children of the whole level by perturbed path
    log-probability (Gumbel keys conditioned on the parent's, as in Kool et al. 2019), so each node's kept
    children are drawn from its q without replacement, in key order."""
    out, k = [], 0
    for tokens, parents, qs, frontier in trees:
        q = dists[k : k + len(frontier)]
        k += len(frontier)
        if sampling_tree == "stochastic_beam" or level == 0:  # Gumbel keys (below the root, Gumbel-top-k samples)
            logq = q.clamp(min=torch.finfo(q.dtype).tiny).log().masked_fill(q <= 0, -float("inf"))
            gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=gen, device=q.device, dtype=q.dtype)))
        if sampling_tree == "stochastic_beam":
            phi = torch.tensor([f[1] for f in frontier], device=q.device, dtype=q.dtype)[:, None] + logq
            keys = phi + gumbel
            top = torch.tensor([f[2] for f in frontier], device=q.device, dtype=q.dtype)[:, None]
            # condition each parent's children on their max being the parent's key: G~ = -log(e^-T - e^-Z + e^-G)
            z = keys.max(-1, keepdim=True).values
            u = top - keys + torch.log1p(-torch.exp((keys - z).clamp(max=0)))
            cond = top - u.clamp(min=0) - torch.log1p(torch.exp(-u.abs()))
            cond = cond.masked_fill(~torch.isfinite(keys), -float("inf"))
            flat = cond.flatten()
            best = flat.topk(min(width, int(torch.isfinite(flat).sum()))).indices.tolist()
            chosen = sorted(((i // q.shape[1], i % q.shape[1]) for i in best), key=lambda fx: (fx[0], -float(cond[fx])))
            picks = [(f, x, float(phi[f, x]), float(cond[f, x])) for f, x in chosen]
        elif level == 0:  # Gumbel-top-k at the root
            order = (logq[0] + gumbel[0]).topk(min(width, int((q[0] > 0).sum()))).indices.tolist()
            picks = [(0, x, 0.0, 0.0) for x in order]
        else:
            drawn = torch.multinomial(q, 1, generator=gen)[:, 0].tolist() if len(frontier) else []  # (one per node)
            picks = [(f, x, 0.0, 0.0) for f, x in enumerate(drawn)]
        new = []
        for f, x, phi_x, key in picks:
            node = frontier[f][0]
            qs.setdefault(node, q[f])
            tokens.append(int(x))
            parents.append(node)
            new.append((len(tokens) - 1, phi_x, key))
        out.append(new)
    return out
