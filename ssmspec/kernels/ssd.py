"""Triton tree SSD (Mamba2): one program per (row, head, head-dim block) computes the masked form

    y_t = exp(L_t) C_t h0 + sum_{s anc t} (C_t . B_s) exp(L_t - L_s) dt_s x_s + D x_t,  L_t = sum_{s anc t} dt_s A

with dt bias, softplus and dt_limit fused, groups mapped to heads, trees up to 256 nodes in one block.
Also the replay commit ssd_state_at. Same interfaces as ssmspec.ops.ssd."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ssmspec.kernels._common import block, dot, kernel_op, softplus
from ssmspec.ops._common import compute_dtype

MAX_NODES = 256


@triton.jit
def _dt(dt_ptr, dtb_ptr, b, t, h, tm, sdb, sdn, sdh, sbb, DT_MIN: tl.constexpr, DT_MAX: tl.constexpr,
        CLAMP_MIN: tl.constexpr, CLAMP_MAX: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
        CD: tl.constexpr):  # fmt: skip
    dt = tl.load(dt_ptr + b * sdb + t * sdn + h * sdh, mask=tm, other=0.0).to(CD)
    if HAS_BIAS:
        dt += tl.load(dtb_ptr + b * sbb + h).to(CD)
    if SOFTPLUS:
        dt = softplus(dt)
    # the limits as constants of dt's dtype (a float argument is float32: 0.01 off in float64's 8th digit)
    if CLAMP_MIN:
        dt = tl.maximum(dt, tl.zeros_like(dt) + DT_MIN)
    if CLAMP_MAX:
        dt = tl.minimum(dt, tl.zeros_like(dt) + DT_MAX)
    return tl.where(tm, dt, 0.0)


@triton.jit
def _tree_ssd_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dtb_ptr, h0_ptr, anc_ptr, y_ptr,
    N, P, S, HPG,
    sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs, sCb, sCn, sCg, sCs,
    sDh, sDp, shb, shh, shp, shs, sab, sat, sas, syb, syn, syh, syp,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SOFTPLUS: tl.constexpr,
    DT_MIN: tl.constexpr, DT_MAX: tl.constexpr, CLAMP_MIN: tl.constexpr, CLAMP_MAX: tl.constexpr,
    CD: tl.constexpr, F64: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    g = h // HPG
    t = tl.arange(0, BN)
    s = tl.arange(0, BS)
    tm, pm, sm = t < N, p < P, s < S
    dt = _dt(dt_ptr, dtb_ptr, b, t, h, tm, sdb, sdn, sdh, 0, DT_MIN, DT_MAX, CLAMP_MIN, CLAMP_MAX, HAS_BIAS,
             SOFTPLUS, CD)  # fmt: skip
    dA = dt * tl.load(A_ptr + h).to(CD)
    anc = tl.load(anc_ptr + b * sab + t[:, None] * sat + t[None, :] * sas, mask=tm[:, None] & tm[None, :], other=0)
    anc = anc != 0
    L = tl.sum(tl.where(anc, dA[None, :], 0.0), axis=1)  # [BN]
    Cm = tl.load(C_ptr + b * sCb + t[:, None] * sCn + g * sCg + s[None, :] * sCs, mask=tm[:, None] & sm[None, :],
                 other=0.0).to(CD)  # fmt: skip
    Bm = tl.load(B_ptr + b * sBb + t[:, None] * sBn + g * sBg + s[None, :] * sBs, mask=tm[:, None] & sm[None, :],
                 other=0.0).to(CD)  # fmt: skip
    cb = dot(Cm, tl.trans(Bm), F64)  # [t, s]
    w = tl.where(anc, tl.exp(L[:, None] - L[None, :]), 0.0) * cb * dt[None, :]
    x = tl.load(x_ptr + b * sxb + t[:, None] * sxn + h * sxh + p[None, :] * sxp, mask=tm[:, None] & pm[None, :],
                other=0.0).to(CD)  # fmt: skip
    y = dot(w.to(CD), x, F64)
    if HAS_H0:
        h0 = tl.load(h0_ptr + b * shb + h * shh + p[:, None] * shp + s[None, :] * shs, mask=pm[:, None] & sm[None, :],
                     other=0.0).to(CD)  # fmt: skip
        y += tl.exp(L)[:, None] * dot(Cm, tl.trans(h0), F64)
    if HAS_D:
        d = tl.load(D_ptr + h * sDh + p * sDp, mask=pm, other=0.0).to(CD)
        y += d[None, :] * x
    tl.store(y_ptr + b * syb + t[:, None] * syn + h * syh + p[None, :] * syp, y.to(y_ptr.dtype.element_ty),
             mask=tm[:, None] & pm[None, :])  # fmt: skip


def _limits(dt_min: float, dt_max: float) -> dict[str, float | bool]:
    """The dt limits as the kernels' constants: finite values, and whether each side clamps at all (an infinite
    limit does not; an infinite constant would not survive Inductor's generated source)."""
    lo, hi = float(dt_min), float(dt_max)
    return {"DT_MIN": lo if math.isfinite(lo) else 0.0, "DT_MAX": hi if math.isfinite(hi) else 0.0,
            "CLAMP_MIN": lo != -math.inf, "CLAMP_MAX": hi != math.inf}  # fmt: skip


def _tl_dtype(dt: torch.dtype):
    return tl.float64 if dt == torch.float64 else tl.float32


@kernel_op(torch.ops.ssmspec.tree_ssd.default)
def tree_ssd(x, dt, A, Bm, Cm, D, dt_bias, h0, ancestor_mask, dt_softplus, dt_min, dt_max, return_states):  # noqa: N803
    """Triton version of ssmspec::tree_ssd. Node states (materialize strategy) come from the reference."""
    b, n, h, p = x.shape
    g, s = Bm.shape[2], Bm.shape[3]
    if n > MAX_NODES:
        raise ValueError(f"tree_ssd kernel: {n} nodes > {MAX_NODES}; the whole tree must fit one block")
    cd = compute_dtype(x, dt, Bm, Cm)
    y = x.new_empty(b, n, h, p, dtype=cd)
    if D is not None and D.ndim == 1:
        d_strides = (D.stride(0), 0)
    elif D is not None:
        d_strides = D.stride()
    else:
        d_strides = (0, 0)
    h0s = h0.stride() if h0 is not None else (0, 0, 0, 0)
    bp = min(block(p), 64)
    grid = (b, h, triton.cdiv(p, bp))
    wrap_triton(_tree_ssd_kernel)[grid](
        x, dt, A, Bm, Cm, D if D is not None else A, dt_bias if dt_bias is not None else A,
        h0 if h0 is not None else x, ancestor_mask, y,
        n, p, s, h // g,
        *x.stride(), *dt.stride(), *Bm.stride(), *Cm.stride(), *d_strides, *h0s, *ancestor_mask.stride(),
        *y.stride(),
        HAS_D=D is not None, HAS_BIAS=dt_bias is not None, HAS_H0=h0 is not None, SOFTPLUS=dt_softplus,
        **_limits(dt_min, dt_max), CD=_tl_dtype(cd), F64=cd == torch.float64, BN=block(n), BP=bp, BS=block(s),
    )  # fmt: skip
    if not return_states:
        return y, x.new_empty(0, dtype=cd)
    from ssmspec.ops.ssd import tree_ssd as reference

    return y, reference(x, dt, A, Bm, Cm, D, dt_bias, h0, ancestor_mask, dt_softplus, dt_min, dt_max, True)[1]


@triton.jit
def _state_at_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dtb_ptr, h0_ptr, m_ptr, out_ptr,
    N, P, S, HPG,
    sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs, shb, shh, shp, shs, smb, smn, sob, soh, sop, sos,
    sAb, sbb, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SOFTPLUS: tl.constexpr, DT_MIN: tl.constexpr,
    DT_MAX: tl.constexpr, CLAMP_MIN: tl.constexpr, CLAMP_MAX: tl.constexpr, CD: tl.constexpr, F64: tl.constexpr,
    BN: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    g = h // HPG
    t = tl.arange(0, BN)
    s = tl.arange(0, BS)
    tm, pm, sm = t < N, p < P, s < S
    on_path = (tl.load(m_ptr + b * smb + t * smn, mask=tm, other=0) != 0) & tm
    dt = _dt(dt_ptr, dtb_ptr, b, t, h, tm, sdb, sdn, sdh, sbb, DT_MIN, DT_MAX, CLAMP_MIN, CLAMP_MAX, HAS_BIAS,
             SOFTPLUS, CD)  # fmt: skip
    dt = tl.where(on_path, dt, 0.0)
    dA = dt * tl.load(A_ptr + b * sAb + h).to(CD)
    L_s = tl.cumsum(dA, axis=0)
    L = tl.sum(dA, axis=0)
    w = tl.where(on_path, tl.exp(L - L_s) * dt, 0.0)
    x = tl.load(x_ptr + b * sxb + t[:, None] * sxn + h * sxh + p[None, :] * sxp, mask=tm[:, None] & pm[None, :],
                other=0.0).to(CD)  # fmt: skip
    Bm = tl.load(B_ptr + b * sBb + t[:, None] * sBn + g * sBg + s[None, :] * sBs, mask=tm[:, None] & sm[None, :],
                 other=0.0).to(CD)  # fmt: skip
    state = dot(tl.trans(x * w[:, None]), Bm, F64)  # [P, S]
    if HAS_H0:
        h0 = tl.load(h0_ptr + b * shb + h * shh + p[:, None] * shp + s[None, :] * shs, mask=pm[:, None] & sm[None, :],
                     other=0.0).to(CD)  # fmt: skip
        state += tl.exp(L) * h0
    tl.store(out_ptr + b * sob + h * soh + p[:, None] * sop + s[None, :] * sos, state.to(out_ptr.dtype.element_ty),
             mask=pm[:, None] & sm[None, :])  # fmt: skip


@kernel_op(torch.ops.ssmspec.ssd_state_at.default)
def ssd_state_at(x, dt, A, Bm, dt_bias, h0, path_mask, dt_softplus, dt_min, dt_max):  # noqa: N803
    """Triton version of ssmspec::ssd_state_at (replay commit along one path per row; A, dt_bias [H] or
    [B, H])."""
    b, n, h, p = x.shape
    g, s = Bm.shape[2], Bm.shape[3]
    if n > MAX_NODES:
        raise ValueError(f"ssd_state_at kernel: {n} nodes > {MAX_NODES}")
    cd = compute_dtype(x, dt, Bm)
    out = x.new_empty(b, h, p, s, dtype=cd)
    bp = min(block(p), 64)
    h0s = h0.stride() if h0 is not None else (0, 0, 0, 0)
    wrap_triton(_state_at_kernel)[(b, h, triton.cdiv(p, bp))](
        x, dt, A, Bm, dt_bias if dt_bias is not None else A, h0 if h0 is not None else x, path_mask, out,
        n, p, s, h // g,
        *x.stride(), *dt.stride(), *Bm.stride(), *h0s, *path_mask.stride(), *out.stride(),
        A.stride(0) if A.ndim == 2 else 0, dt_bias.stride(0) if dt_bias is not None and dt_bias.ndim == 2 else 0,
        HAS_BIAS=dt_bias is not None, HAS_H0=h0 is not None, SOFTPLUS=dt_softplus,
        **_limits(dt_min, dt_max), CD=_tl_dtype(cd), F64=cd == torch.float64, BN=block(n), BP=bp, BS=block(s),
    )  # fmt: skip
    return out
