"""Tree gated delta rule (Qwen3-Next, Qwen3.5, OLMo hybrid) and KDA (Kimi linear): reference op.

    S_t = exp(g_t) * S_parent;  S_t += k_t ((v_t - S_t^T k_t) beta_t)^T;  o_t = S_t^T q_t
with g per head (GDN) or per head and key channel (KDA). Not diagonal, so evaluated level by level.
"""

from __future__ import annotations

import torch

from ssmspec.ops._common import compute_dtype, gather_nodes, levelwise_states, reference_op


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@reference_op("tree_delta_rule")
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
