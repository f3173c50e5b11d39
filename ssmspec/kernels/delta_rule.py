"""Triton tree gated delta rule / KDA: one program per (row, head, value block) walks the nodes in
topological order from each node's parent state (kept in the node-state buffer), with q/k L2 norm, the
1/sqrt(K) query scale, per-head (GDN) or per-key-channel (KDA) decay and grouped k heads fused.
Same interface as ssmspec.ops.delta_rule.tree_delta_rule."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ssmspec.kernels._common import block, kernel_op
from ssmspec.kernels.ssd import _tl_dtype
from ssmspec.ops._common import compute_dtype


@triton.jit
def _tree_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, par_ptr, st_ptr, o_ptr,
    N, K, V, HPK,
    sqb, sqn, sqh, sqk, skb, skn, skh, skk, svb, svn, svh, svv, sgb, sgn, sgh, sgk, sbb, sbn, sbh,
    shb, shh, shk, shv, spb, spn, ssb, ssn, ssh, ssk, ssv, sob, son, soh, sov,
    L2: tl.constexpr, HAS_H0: tl.constexpr, CD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kk = tl.arange(0, BK)
    hk = h // HPK
    km, vm = kk < K, vv < V
    m2 = km[:, None] & vm[None, :]
    if HAS_H0:
        root = tl.load(h0_ptr + b * shb + h * shh + kk[:, None] * shk + vv[None, :] * shv, mask=m2, other=0.0).to(CD)
    else:
        root = tl.zeros([BK, BV], dtype=CD)
    sqrt_k = tl.sqrt(tl.zeros([BK], dtype=CD) + K)  # sqrt(K) in the compute dtype (a float argument: float32)
    for t in range(0, N):
        par = tl.load(par_ptr + b * spb + t * spn)
        prev = tl.load(st_ptr + b * ssb + tl.maximum(par, 0) * ssn + h * ssh + kk[:, None] * ssk + vv[None, :] * ssv,
                       mask=m2, other=0.0)  # fmt: skip
        S = tl.where(par < 0, root, prev)
        q = tl.load(q_ptr + b * sqb + t * sqn + hk * sqh + kk * sqk, mask=km, other=0.0).to(CD)
        k = tl.load(k_ptr + b * skb + t * skn + hk * skh + kk * skk, mask=km, other=0.0).to(CD)
        v = tl.load(v_ptr + b * svb + t * svn + h * svh + vv * svv, mask=vm, other=0.0).to(CD)
        if L2:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q / sqrt_k
        g = tl.load(g_ptr + b * sgb + t * sgn + h * sgh + kk * sgk, mask=km, other=0.0).to(CD)
        beta = tl.load(beta_ptr + b * sbb + t * sbn + h * sbh).to(CD)
        S = S * tl.exp(g)[:, None]
        kv = tl.sum(S * k[:, None], axis=0)
        delta = (v - kv) * beta
        S = S + k[:, None] * delta[None, :]
        tl.store(st_ptr + b * ssb + t * ssn + h * ssh + kk[:, None] * ssk + vv[None, :] * ssv, S, mask=m2)
        tl.debug_barrier()  # the node's state is read back by its children
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + b * sob + t * son + h * soh + vv * sov, o.to(o_ptr.dtype.element_ty), mask=vm)


@kernel_op(torch.ops.ssmspec.tree_delta_rule.default)
def tree_delta_rule(q, k, v, g, beta, h0, parents, depth, use_qk_l2norm, return_states):
    """Triton version of ssmspec::tree_delta_rule."""
    b, n, hk, kd = k.shape
    h, vd = v.shape[2], v.shape[3]
    cd = compute_dtype(q, k, v, g, beta, h0)
    states = q.new_empty(b, n, h, kd, vd, dtype=cd)
    o = q.new_empty(b, n, h, vd)
    gs = (*g.stride(), 0) if g.ndim == 3 else g.stride()  # GDN: one decay per head, broadcast over K
    h0s = h0.stride() if h0 is not None else (0, 0, 0, 0)
    bv = min(block(vd), 64)
    wrap_triton(_tree_delta_kernel)[(b, h, triton.cdiv(vd, bv))](
        q, k, v, g, beta, h0 if h0 is not None else q, parents, states, o,
        n, kd, vd, h // hk,
        *q.stride(), *k.stride(), *v.stride(), *gs, *beta.stride(), *h0s, *parents.stride(), *states.stride(),
        *o.stride(),
        L2=use_qk_l2norm, HAS_H0=h0 is not None, CD=_tl_dtype(cd), BK=block(kd), BV=bv,
    )  # fmt: skip
    return o, (states if return_states else q.new_empty(0, dtype=cd))
