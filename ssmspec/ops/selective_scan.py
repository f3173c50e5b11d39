"""Tree selective scan (Mamba1, Jamba, Falcon-Mamba: diagonal A per channel and state): reference op.

The decay exp(dt_t[d] A[d, n]) depends on the state index, so the C.B factorisation of SSD does not hold:
node states are computed from the parent's state one tree level at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmspec.ops._common import compute_dtype, gather_nodes, levelwise_states, reference_op


@reference_op("tree_selective_scan")
def tree_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    Bm: torch.Tensor,
    Cm: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    h0: torch.Tensor | None,
    parents: torch.Tensor,
    depth: torch.Tensor,
    dt_softplus: bool,
    return_states: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x/dt/z [B,D,N], A [D,S], Bm/Cm [B,S,N], D/dt_bias [D], h0 [B,D,S]. Returns y [B,D,N] in x's dtype
    and node states [B,N,D,S] in the compute dtype (or empty)."""
    cd = compute_dtype(x, dt, Bm, Cm, h0)
    dtc = dt.to(cd)
    if dt_bias is not None:
        dtc = dtc + dt_bias.to(cd)[:, None]
    if dt_softplus:
        dtc = F.softplus(dtc)
    dtc = dtc.transpose(1, 2)  # [B, N, D]
    xc = x.to(cd).transpose(1, 2)
    dA = torch.exp(dtc[..., None] * A.to(cd))  # [B, N, D, S]
    dBx = dtc[..., None] * Bm.to(cd).transpose(1, 2)[:, :, None, :] * xc[..., None]
    b, d, _ = x.shape
    start = h0.to(cd) if h0 is not None else x.new_zeros(b, d, A.shape[-1], dtype=cd)
    states = levelwise_states(
        start, parents, depth, lambda prev, idx: gather_nodes(dA, idx) * prev + gather_nodes(dBx, idx)
    )
    y = torch.matmul(states, Cm.to(cd).transpose(1, 2)[..., None])[..., 0].transpose(1, 2)  # [B, D, N]
    if D is not None:
        y = y + x.to(cd) * D.to(cd)[None, :, None]
    if z is not None:
        y = y * F.silu(z.to(cd))
    y = y.to(x.dtype)
    return y, (states if return_states else x.new_empty(0, dtype=cd))


@tree_selective_scan.register_fake
def _(x, dt, A, Bm, Cm, D, z, dt_bias, h0, parents, depth, dt_softplus, return_states):
    cd = compute_dtype(x, dt, Bm, Cm, h0)
    states = (
        x.new_empty(x.shape[0], x.shape[2], x.shape[1], A.shape[-1], dtype=cd)
        if return_states
        else x.new_empty(0, dtype=cd)
    )
    return x.new_empty(x.shape), states
