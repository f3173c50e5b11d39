"""Tree SSD (Mamba2 and its hybrids: scalar decay per head): reference op in the masked (STree) form.

    dt_t = clamp(softplus(dt_raw + dt_bias)), L_t = sum_{s on root->t} dt_s A_h
    y_t  = exp(L_t) C_t h0 + sum_{s on root->t} (C_t . B_s) exp(L_t - L_s) dt_s x_s + D x_t

which is one SSD chunk with the causal mask replaced by the tree's ancestor mask. Seam adapter for
`mamba_chunk_scan_combined`; commit: replay (`ssd_state_at` along the accepted path, all small layers in one
call) or materialize (gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from ssmspec.ops._common import (
    Record,
    SeamCall,
    commit_materialized,
    commits,
    compute_dtype,
    eager_fast_path,
    reference_op,
    seam_adapter,
)


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


_tree_ssd, _ssd_state_at = eager_fast_path(tree_ssd), eager_fast_path(ssd_state_at)
# SSD layers whose committed states are at most this many elements are replayed in one batched call (small
# models are bound by per-op overhead); larger states are replayed layer by layer, since the batched call
# would first copy every layer's state.
BATCH_REPLAY_MAX_STATE = 65536


@seam_adapter(
    "mamba_chunk_scan_combined",
    understands=(
        "hidden_states",
        "dt",
        "A",
        "B",
        "C",
        "D",
        "dt_bias",
        "dt_softplus",
        "dt_limit",
        "return_final_states",
    ),  # fmt: skip
    ignores=("chunk_size",),
)
def verify_ssd(call: SeamCall, a: dict[str, Any]):
    """Mamba2 chunk scan on the tree: outputs of every node from the committed state; records the replay
    inputs (or, for materialize, every node's state)."""
    lo, hi = a.get("dt_limit", (0.0, float("inf")))
    keep = call.commit_strategy == "materialize"
    x, dt, A, Bm, Cm = a["hidden_states"], a["dt"], a["A"], a["B"], a["C"]
    seam = "mamba_chunk_scan_combined"
    h0 = call.committed_state(seam, (x.shape[0], x.shape[2], x.shape[3], Bm.shape[-1]))
    D, bias, sp = a.get("D"), a.get("dt_bias"), bool(a.get("dt_softplus", False))
    mask = call.tree.ancestor_mask
    y, states = _tree_ssd(x, dt, A, Bm, Cm, D, bias, h0, mask, sp, float(lo), float(hi), keep)
    if keep:
        call.record(seam, "ssd", states=states)
    else:
        call.record(seam, "ssd", x=x, dt=dt, A=A, Bm=Bm, dt_bias=bias, h0=h0, ancestor_mask=mask, dt_softplus=sp,
                    dt_min=float(lo), dt_max=float(hi))  # fmt: skip
    return (y, h0) if a.get("return_final_states", False) else y


@commits("ssd")
def commit_ssd(items: list[tuple[torch.Tensor, Record]], path, lengths, last: torch.Tensor) -> None:
    """Materialized states are gathered; replayed layers of equal shapes share one ssd_state_at call."""
    groups: dict[tuple, list] = {}
    for target, rec in commit_materialized(items, last):
        key = tuple(
            (n, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (n, v) for n, v in rec.replay.items()
        )
        if target.numel() > BATCH_REPLAY_MAX_STATE:  # big states: concatenating them costs more than it saves
            key = (rec.layer, rec.state_idx)
        groups.setdefault(key, []).append((target, rec.replay))
    rows = torch.arange(last.shape[0], device=last.device)
    for group in groups.values():
        _replay(group, rows, last)


def _replay(items: list, rows: torch.Tensor, last: torch.Tensor) -> None:
    """Replay the accepted paths of several SSD layers (same shapes) in one ssd_state_at call."""
    first = items[0][1]
    b, h = first["x"].shape[0], first["x"].shape[2]

    def cat(name):
        vals = [a[name] for _, a in items]
        if vals[0] is None:
            return None
        if vals[0].ndim == 1:  # per-layer parameters -> one row per (layer, batch row)
            return torch.cat([v.expand(b, h) for v in vals])
        return torch.cat(vals)

    mask = first["ancestor_mask"][rows, last].repeat(len(items), 1)
    new = _ssd_state_at(
        cat("x"), cat("dt"), cat("A"), cat("Bm"), cat("dt_bias"), cat("h0"), mask,
        first["dt_softplus"], first["dt_min"], first["dt_max"],
    )  # fmt: skip
    for (target, _), part in zip(items, new.split(b)):
        target.copy_(part.to(target.dtype))
