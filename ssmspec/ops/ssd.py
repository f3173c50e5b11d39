"""Tree SSD (Mamba2 and its hybrids: scalar decay per head): reference op in the masked (STree) form.

    dt_t = clamp(softplus(dt_raw + dt_bias)), L_t = sum_{s on root->t} dt_s A_h
    y_t  = exp(L_t) C_t h0 + sum_{s on root->t} (C_t . B_s) exp(L_t - L_s) dt_s x_s + D x_t

which is one SSD chunk with the causal mask replaced by the tree's ancestor mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from ssmspec.ops._common import compute_dtype, reference_op


def _prepare(x, dt, A, Bm, Cm, dt_bias, dt_softplus, dt_min, dt_max):
    cd = compute_dtype(x, dt, Bm, Cm)
    h, g = x.shape[2], Bm.shape[2]
    dt = dt.to(cd)
    if dt_bias is not None:  # [H], or [B, H] when commit batches several layers
        dt = dt + (dt_bias.to(cd)[:, None] if dt_bias.ndim == 2 else dt_bias.to(cd))
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_min, max=dt_max)
    Bh = repeat(Bm.to(cd), "b n g s -> b n (g r) s", r=h // g)
    Ch = repeat(Cm.to(cd), "b n g s -> b n (g r) s", r=h // g)
    dA = dt * (A.to(cd)[:, None] if A.ndim == 2 else A.to(cd))  # [B, N, H]
    return cd, x.to(cd), dt, Bh, Ch, dA


@reference_op("tree_ssd")
def tree_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    Bm: torch.Tensor,
    Cm: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    h0: torch.Tensor | None,
    ancestor_mask: torch.Tensor,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    return_states: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B,N,H,P], dt [B,N,H], A [H], Bm/Cm [B,N,G,S], D [H] or [H,P], dt_bias [H], h0 [B,H,P,S],
    ancestor_mask [B,N,N]. Returns y [B,N,H,P] (compute dtype) and node states [B,N,H,P,S] (or empty)."""
    cd, xc, dtc, Bh, Ch, dA = _prepare(x, dt, A, Bm, Cm, dt_bias, dt_softplus, dt_min, dt_max)
    # head-major layout so that every contraction is a plain batched matmul over (batch, head)
    xh, Chh, Bhh = (t.transpose(1, 2) for t in (xc, Ch, Bh))  # [B, H, N, P|S]
    dAh, dth = dA.transpose(1, 2), dtc.transpose(1, 2)  # [B, H, N]
    anc = ancestor_mask[:, None]  # [B, 1, t, s]
    L = (dAh[:, :, None, :] * anc.to(cd)).sum(-1)  # [B, H, t]: decay summed over t's ancestors
    # decay from s to t (exclusive of s), only where s is an ancestor of t
    seg = (L[..., :, None] - L[..., None, :]).masked_fill(~anc, float("-inf"))  # [B, H, t, s]
    w = torch.exp(seg) * torch.matmul(Chh, Bhh.transpose(-1, -2)) * dth[:, :, None, :]
    yh = torch.matmul(w, xh)  # [B, H, t, P]
    if h0 is not None:
        yh = yh + torch.exp(L)[..., None] * torch.matmul(Chh, h0.to(cd).transpose(-1, -2))
    y = yh.transpose(1, 2)
    if D is not None:
        Dc = D.to(cd)
        y = y + (Dc[:, None] if Dc.ndim == 1 else Dc) * xc
    y = y.contiguous()  # callers .view() the output (FalconH1Mixer does)
    if not return_states:
        return y, x.new_empty(0, dtype=cd)
    decay = torch.exp(seg) * dth[:, :, None, :]  # [B, H, t, s]
    xB = (xh[..., :, None] * Bhh[..., None, :]).flatten(-2)  # [B, H, s, P*S]
    states = torch.matmul(decay, xB).unflatten(-1, (xh.shape[-1], Bhh.shape[-1]))  # [B, H, t, P, S]
    if h0 is not None:
        states = states + torch.exp(L)[..., None, None] * h0.to(cd)[:, :, None]
    return y, states.transpose(1, 2).contiguous()


@tree_ssd.register_fake
def _(x, dt, A, Bm, Cm, D, dt_bias, h0, ancestor_mask, dt_softplus, dt_min, dt_max, return_states):
    cd = compute_dtype(x, dt, Bm, Cm)
    y = x.new_empty(x.shape, dtype=cd)
    if not return_states:
        return y, x.new_empty(0, dtype=cd)
    return y, x.new_empty((*x.shape, Bm.shape[-1]), dtype=cd)


@reference_op("ssd_state_at")
def ssd_state_at(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    Bm: torch.Tensor,
    dt_bias: torch.Tensor | None,
    h0: torch.Tensor | None,
    path_mask: torch.Tensor,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    """Replay commit for SSD: the state after the nodes marked in path_mask [B, N] (one root-to-node path
    per row), h = exp(L) h0 + sum_{s on path} exp(L - L_s) dt_s x_s B_s^T. Returns [B, H, P, S].
    A and dt_bias may be [B, H] (one row per (layer, row) when commit batches all layers in one call)."""
    cd, xc, dtc, Bh, _, dA = _prepare(x, dt, A, Bm, Bm, dt_bias, dt_softplus, dt_min, dt_max)
    m = path_mask.to(cd)[..., None]  # [B, N, 1]
    L_s = torch.cumsum(dA * m, dim=1)  # decay accumulated along the path up to and including s
    L = L_s[:, -1]  # [B, H]
    w = torch.exp(L[:, None] - L_s) * dtc * m  # [B, N, H]
    state = torch.matmul((xc * w[..., None]).permute(0, 2, 3, 1), Bh.transpose(1, 2))  # [B, H, P, S]
    if h0 is not None:
        state = state + torch.exp(L)[..., None, None] * h0.to(cd)
    return state


@ssd_state_at.register_fake
def _(x, dt, A, Bm, dt_bias, h0, path_mask, dt_softplus, dt_min, dt_max):
    cd = compute_dtype(x, dt, Bm)
    return x.new_empty((x.shape[0], x.shape[2], x.shape[3], Bm.shape[-1]), dtype=cd)


def ssd_states_ref(x, dt, A, Bm, Cm, dt_bias, h0, parents, dt_softplus=True, dt_min=0.0, dt_max=float("inf")):
    """Sequential per-node reference (h_t = exp(dt_t A) h_parent + dt_t x_t B_t^T); used to test the masked form."""
    cd, xc, dtc, Bh, Ch, dA = _prepare(x, dt, A, Bm, Cm, dt_bias, dt_softplus, dt_min, dt_max)
    b, n, h, p = x.shape
    s = Bm.shape[-1]
    states = []
    rows = torch.arange(b)
    for t in range(n):
        prev = (
            (h0.to(cd) if h0 is not None else xc.new_zeros(b, h, p, s))
            if t == 0
            else (torch.stack(states, 1)[rows, parents[:, t]])
        )
        new = torch.exp(dA[:, t])[:, :, None, None] * prev + rearrange(
            dtc[:, t, :, None, None] * xc[:, t, :, :, None] * Bh[:, t, :, None, :], "b h p s -> b h p s"
        )
        states.append(new)
    return torch.stack(states, 1)
