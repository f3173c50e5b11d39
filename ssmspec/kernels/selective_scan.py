"""Triton tree selective scan (Mamba1): one program per (row, channel block) walks the nodes in
topological order, loading each node's parent state from the node-state buffer (the recurrence is
diagonal per channel and state). Same interface as ssmspec.ops.selective_scan.tree_selective_scan."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ssmspec.kernels._common import block, kernel_op, softplus
from ssmspec.kernels.ssd import _tl_dtype
from ssmspec.ops._common import compute_dtype


@triton.jit
def _tree_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, h0_ptr, par_ptr, st_ptr, y_ptr,
    Dm, N, S,
    sxb, sxd, sxn, sdb, sdd, sdn, sAd, sAs, sBb, sBs, sBn, sCb, sCs, sCn, szb, szd, szn,
    shb, shd, shs, spb, spn, ssb, ssn, ssd, sss, syb, syd, syn,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
    SOFTPLUS: tl.constexpr, CD: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    s = tl.arange(0, BS)
    dm, sm = d < Dm, s < S
    m2 = dm[:, None] & sm[None, :]
    A = tl.load(A_ptr + d[:, None] * sAd + s[None, :] * sAs, mask=m2, other=0.0).to(CD)
    if HAS_H0:
        h_root = tl.load(h0_ptr + b * shb + d[:, None] * shd + s[None, :] * shs, mask=m2, other=0.0).to(CD)
    else:
        h_root = tl.zeros([BD, BS], dtype=CD)
    for t in range(0, N):
        par = tl.load(par_ptr + b * spb + t * spn)
        prev = tl.load(st_ptr + b * ssb + tl.maximum(par, 0) * ssn + d[:, None] * ssd + s[None, :] * sss, mask=m2,
                       other=0.0)  # fmt: skip
        h = tl.where(par < 0, h_root, prev)
        dt = tl.load(dt_ptr + b * sdb + d * sdd + t * sdn, mask=dm, other=0.0).to(CD)
        if HAS_BIAS:
            dt += tl.load(dtb_ptr + d, mask=dm, other=0.0).to(CD)
        if SOFTPLUS:
            dt = softplus(dt)
        x = tl.load(x_ptr + b * sxb + d * sxd + t * sxn, mask=dm, other=0.0).to(CD)
        Bt = tl.load(B_ptr + b * sBb + s * sBs + t * sBn, mask=sm, other=0.0).to(CD)
        Ct = tl.load(C_ptr + b * sCb + s * sCs + t * sCn, mask=sm, other=0.0).to(CD)
        h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * Bt[None, :]
        tl.store(st_ptr + b * ssb + t * ssn + d[:, None] * ssd + s[None, :] * sss, h, mask=m2)
        tl.debug_barrier()  # the node's state is read back by its children
        y = tl.sum(h * Ct[None, :], axis=1)
        if HAS_D:
            y += x * tl.load(D_ptr + d, mask=dm, other=0.0).to(CD)
        if HAS_Z:
            z = tl.load(z_ptr + b * szb + d * szd + t * szn, mask=dm, other=0.0).to(CD)
            y = y * (z / (1.0 + tl.exp(-z)))
        tl.store(y_ptr + b * syb + d * syd + t * syn, y.to(y_ptr.dtype.element_ty), mask=dm)


@kernel_op(torch.ops.ssmspec.tree_selective_scan.default)
def tree_selective_scan(x, dt, A, Bm, Cm, D, z, dt_bias, h0, parents, depth, dt_softplus, return_states):  # noqa: N803
    """Triton version of ssmspec::tree_selective_scan."""
    b, d, n = x.shape
    s = A.shape[-1]
    cd = compute_dtype(x, dt, Bm, Cm, h0)
    states = x.new_empty(b, n, d, s, dtype=cd)
    y = x.new_empty(x.shape)  # contiguous, as the reference and its fake (x is often a time-major view)
    bd = min(block(d), 64)
    zs = z.stride() if z is not None else (0, 0, 0)
    h0s = h0.stride() if h0 is not None else (0, 0, 0)
    wrap_triton(_tree_scan_kernel)[(b, triton.cdiv(d, bd))](
        x, dt, A, Bm, Cm, D if D is not None else A, z if z is not None else x, dt_bias if dt_bias is not None else A,
        h0 if h0 is not None else x, parents, states, y,
        d, n, s,
        *x.stride(), *dt.stride(), *A.stride(), *Bm.stride(), *Cm.stride(), *zs, *h0s, *parents.stride(),
        *states.stride(), *y.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, HAS_H0=h0 is not None,
        SOFTPLUS=dt_softplus, CD=_tl_dtype(cd), BD=bd, BS=block(s),
    )  # fmt: skip
    return y, (states if return_states else x.new_empty(0, dtype=cd))
