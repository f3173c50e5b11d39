"""Tree gated delta rule (Qwen3-Next, Qwen3.5, OLMo hybrid) and KDA (Kimi linear): reference op.

    S_t = exp(g_t) * S_parent;  S_t += k_t ((v_t - S_t^T k_t) beta_t)^T;  o_t = S_t^T q_t
with g per head (GDN) or per head and key channel (KDA). Not diagonal, so evaluated level by level.
Seam adapter for `chunk_gated_delta_rule` and `chunk_kda`; commit: replay along the accepted path or gather.
"""

from __future__ import annotations

from typing import Any

import torch

from ssmspec.ops._common import (
    Record,
    SeamCall,
    chain_structure,
    commit_materialized,
    commits,
    compute_dtype,
    eager_fast_path,
    gather_nodes,
    levelwise_states,
    reference_op,
    seam_adapter,
)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@reference_op("tree_delta_rule", traceable=False)
def tree_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor | None,
    parents: torch.Tensor,
    depth: torch.Tensor,
    use_qk_l2norm: bool,
    return_states: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k [B,N,Hk,K], v [B,N,H,V], g [B,N,H] or [B,N,H,K] (log decay), beta [B,N,H], h0 [B,H,K,V].
    Returns o [B,N,H,V] in q's dtype and node states [B,N,H,K,V] (or empty)."""
    cd = compute_dtype(q, k, v, g, beta, h0)
    hk, h = k.shape[2], v.shape[2]
    qc, kc, vc, gc, bc = (t.to(cd) for t in (q, k, v, g, beta))
    if hk != h:
        qc = qc.repeat_interleave(h // hk, dim=2)
        kc = kc.repeat_interleave(h // hk, dim=2)
    if use_qk_l2norm:
        qc, kc = _l2norm(qc), _l2norm(kc)
    qc = qc * (qc.shape[-1] ** -0.5)
    decay = gc.exp()
    decay = decay[..., None, None] if decay.ndim == 3 else decay[..., None]  # [B,N,H,1|K,1]
    b = q.shape[0]
    start = h0.to(cd) if h0 is not None else q.new_zeros(b, h, k.shape[-1], v.shape[-1], dtype=cd)

    def step(prev: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        kt, vt, bt = gather_nodes(kc, idx), gather_nodes(vc, idx), gather_nodes(bc, idx)
        s = prev * gather_nodes(decay, idx)
        kv_mem = (s * kt[..., None]).sum(-2)
        delta = (vt - kv_mem) * bt[..., None]
        return s + kt[..., None] * delta[..., None, :]

    states = levelwise_states(start, parents, depth, step)
    o = (states * qc[..., None]).sum(-2).to(q.dtype)
    return o, (states if return_states else q.new_empty(0, dtype=cd))


@tree_delta_rule.register_fake
def _(q, k, v, g, beta, h0, parents, depth, use_qk_l2norm, return_states):
    cd = compute_dtype(q, k, v, g, beta, h0)
    b, n, h, dv = v.shape
    states = q.new_empty(b, n, h, k.shape[-1], dv, dtype=cd) if return_states else q.new_empty(0, dtype=cd)
    return q.new_empty(b, n, h, dv), states


_tree_delta = eager_fast_path(tree_delta_rule)


@seam_adapter(
    "chunk_gated_delta_rule",
    "chunk_kda",
    understands=("query", "key", "value", "g", "beta", "output_final_state", "use_qk_l2norm_in_kernel"),
    ignores=("chunk_size",),
)
def verify_delta_rule(call: SeamCall, a: dict[str, Any]):
    """Gated delta rule / KDA on the tree; records the replay inputs (or every node's state)."""
    keep = call.commit_strategy == "materialize"
    q, k, v, g, beta = a["query"], a["key"], a["value"], a["g"], a["beta"]
    seam = "chunk_gated_delta_rule"
    h0 = call.committed_state(seam, (q.shape[0], v.shape[2], k.shape[3], v.shape[3]))
    l2 = bool(a.get("use_qk_l2norm_in_kernel", False))
    tree = call.tree
    o, states = _tree_delta(q, k, v, g, beta, h0, tree.parents, tree.depth, l2, keep)
    if keep:
        call.record(seam, "delta_rule", states=states)
    else:
        call.record(seam, "delta_rule", q=q, k=k, v=v, g=g, beta=beta, h0=h0, l2=l2)
    return o, (h0 if a.get("output_final_state", False) else None)


@commits("delta_rule")
def commit_delta_rule(items: list[tuple[torch.Tensor, Record]], path, lengths, last: torch.Tensor) -> None:
    """Replay: run the recurrence on each row's accepted path (a chain) from the committed state."""
    rows = torch.arange(path.shape[0], device=path.device)
    chain_parents, chain_depth = chain_structure(*path.shape, path.device)
    for target, rec in commit_materialized(items, last):
        a = rec.replay
        q, k, v, g, beta = (gather_nodes(a[n], path) for n in ("q", "k", "v", "g", "beta"))
        states = _tree_delta(q, k, v, g, beta, a["h0"], chain_parents, chain_depth, a["l2"], True)[1]
        target.copy_(states[rows, lengths - 1].to(target.dtype))
