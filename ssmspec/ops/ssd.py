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
    eager_reference,
    in_place_commit,
    reference_op,
    seam_adapter,
    stacked,
)
from ssmspec.static import static


def _dt(dt, dt_bias, dt_softplus, dt_min, dt_max, cd):
    """dt in the compute dtype with its bias, softplus and limits; dt_bias [H], or [B, H] (one row per (layer,
    row) when commit batches several layers). The clamp is skipped where it cannot change a value (softplus is
    >= 0; no upper limit)."""
    dt = _as(dt, cd)
    if dt_bias is not None:
        dt = dt + (_as(dt_bias, cd)[:, None] if dt_bias.ndim == 2 else _as(dt_bias, cd))
    if dt_softplus:
        dt = F.softplus(dt)
    if not (dt_softplus and dt_min <= 0.0 and dt_max == float("inf")):
        dt = dt.clamp(min=dt_min, max=dt_max)
    return dt


def _prepare(x, dt, A, Bm, Cm, dt_bias, dt_softplus, dt_min, dt_max):
    cd = compute_dtype(x, dt, Bm, Cm)
    h, g = x.shape[2], Bm.shape[2]
    dt = _dt(dt, dt_bias, dt_softplus, dt_min, dt_max, cd)
    Bh = repeat(Bm.to(cd), "b n g s -> b n (g r) s", r=h // g)
    Ch = repeat(Cm.to(cd), "b n g s -> b n (g r) s", r=h // g)
    dA = dt * (A.to(cd)[:, None] if A.ndim == 2 else A.to(cd))  # [B, N, H]
    return cd, x.to(cd), dt, Bh, Ch, dA


def _by_group(t: torch.Tensor) -> torch.Tensor:
    """[B, N, G, S] -> [B * G, N, S] (a view where G == 1)."""
    b, n, g, s = t.shape
    return t.view(b, n, s) if g == 1 else t.transpose(1, 2).reshape(b * g, n, s)


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
    ancestor_mask [B,N,N]. Returns y [B,N,H,P] (compute dtype) and node states [B,N,H,P,S] (or empty).

    Few, large ops (each eager op costs microseconds, a visible share of a small tree's step): C.B and C.h0
    once per group (the heads of a group share them), the decay of every head in one [B,H,t,s] tensor, and the
    outputs accumulated head-major as [B,H,P,t] by one batched matmul onto the h0 term."""
    cd = compute_dtype(x, dt, Bm, Cm)
    return _masked_ssd(x, dt, A, Bm, Cm, D, dt_bias, h0, *ssd_masks(ancestor_mask, cd), dt_softplus, dt_min, dt_max,
                       return_states)  # fmt: skip


def ssd_masks(ancestor_mask: torch.Tensor, cd: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ancestor mask [B, t, s] in the two forms `tree_ssd` uses: in the compute dtype, transposed to [B, s, t]
    (L = dA @ it sums each node's ancestors), and negated as [B, 1, t, s] (the decays it masks to exp(-inf) = 0).
    The same for every layer of a verify step: the seam adapter makes them once per tree (`TokenTree.derived`)."""
    return ancestor_mask.to(cd).transpose(1, 2), ~ancestor_mask[:, None]


def _masked_ssd(x, dt, A, Bm, Cm, D, dt_bias, h0, anc_t, outside, dt_softplus, dt_min, dt_max, return_states):
    """`tree_ssd` given its masks (`ssd_masks`)."""
    b, n, h, p = x.shape
    g, s = Bm.shape[2], Bm.shape[3]
    r = h // g
    cd = compute_dtype(x, dt, Bm, Cm)
    xc = _as(x, cd)
    dtc = _dt(dt, dt_bias, dt_softplus, dt_min, dt_max, cd)  # [B, N, H]
    dA = dtc * _as(A, cd)
    L = torch.bmm(dA.transpose(1, 2), anc_t)  # [B, H, t]: sum over t's ancestors, t included
    # decay from s to t (exclusive of s) where s is an ancestor of t, else exp(-inf) = 0
    seg = (L[..., :, None] - L[..., None, :]).masked_fill_(outside, float("-inf")).exp_()  # [B, H, t, s]
    dts = dtc.transpose(1, 2).reshape(b, g, r, 1, n)  # dt_s
    Cg, Bg = _by_group(_as(Cm, cd)), _by_group(_as(Bm, cd))  # [B*G, N, S]
    cb = torch.bmm(Cg, Bg.transpose(1, 2)).view(b, g, 1, n, n)  # C_t . B_s, shared by the heads of a group
    decay = seg.view(b, g, r, n, n)
    w = decay * cb * dts if return_states else decay.mul_(cb).mul_(dts)  # [B, G, R, t, s]
    if static() and x.device.type == "cpu" and not return_states:
        return _node_major_outputs(xc, w.view(b, h, n, n), L, Cm, D, h0, cd), x.new_empty(0, dtype=cd)
    xt = xc.permute(0, 2, 3, 1).reshape(b * h, p, n)  # [B*H, P, s]
    wt = w.view(b * h, n, n).transpose(1, 2)
    if h0 is not None:  # exp(L_t) C_t . h0, for every head of a group from one matmul
        h0c = _as(h0, cd)
        yt = torch.bmm(h0c.reshape(b * g, r * p, s), Cg.transpose(1, 2)).view(b, h, p, n)
        yt = yt.mul_(L.exp().unsqueeze(2)).view(b * h, p, n).baddbmm_(xt, wt)
    else:
        yt = torch.bmm(xt, wt)
    yt = yt.view(b, h, p, n).permute(0, 3, 1, 2)  # [B, N, H, P] (strided)
    if D is not None:  # contiguous output: callers .view() it (FalconH1Mixer does)
        Dc = _as(D, cd)
        y = (xc * (Dc[:, None] if Dc.ndim == 1 else Dc)).add_(yt)
    else:
        y = yt.contiguous()
    if not return_states:
        return y, x.new_empty(0, dtype=cd)
    # every node's state (materialize): sum over ancestors s of exp(L_t - L_s) dt_s x_s B_s^T, plus exp(L_t) h0
    xB = xc[..., None] * Bm.to(cd).repeat_interleave(r, dim=2)[:, :, :, None, :]  # [B, s, H, P, S]
    states = torch.matmul((decay * dts).view(b, h, n, n), xB.transpose(1, 2).flatten(-2))  # [B, H, t, P*S]
    states = states.unflatten(-1, (p, s))
    if h0 is not None:
        states = states + L.exp()[..., None, None] * h0c[:, :, None]
    return y, states.transpose(1, 2).contiguous()


def _node_major_outputs(xc, w, L, Cm, D, h0, cd) -> torch.Tensor:
    """`_masked_ssd`'s outputs [B, N, H, P] computed node-major, as broadcast products summed (a step compiled whole on
    a CPU): y_t = sum_s w[t, s] x_s + exp(L_t) C_t . h0 + D x_t, where the batched matmuls' head-major [B*H, P, N]
    would leave the nodes innermost, and every loop Inductor fuses after it (the gated norm, the projection) would
    vectorize over a handful of nodes with transposes instead of over the channels. w [B, H, t, s], L [B, H, t]."""
    b, n, h, p = xc.shape
    g, s = Cm.shape[2], Cm.shape[3]
    y = (w.permute(0, 2, 1, 3)[..., None] * xc.permute(0, 2, 1, 3)[:, None]).sum(3)  # [B, t, H, P]
    if h0 is not None:
        ch0 = (_as(h0, cd).view(b, 1, g, h // g, p, s) * _as(Cm, cd).view(b, n, g, 1, 1, s)).sum(-1)
        y = y + ch0.view(b, n, h, p) * L.exp().transpose(1, 2)[..., None]
    if D is not None:
        Dc = _as(D, cd)
        y = y + xc * (Dc[:, None] if Dc.ndim == 1 else Dc)
    return y


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
    b, h, p, s = x.shape[0], x.shape[2], x.shape[3], Bm.shape[-1]
    decay, xw, Bg = replay_terms(x, dt, A, Bm, dt_bias, path_mask, dt_softplus, dt_min, dt_max)
    if h0 is None:
        return torch.bmm(xw, Bg).view(b, h, p, s)
    start = h0.to(decay.dtype) * decay[..., None, None]
    return torch.baddbmm(start.view(xw.shape[0], -1, s), xw, Bg).view(b, h, p, s)


def replay_terms(x, dt, A, Bm, dt_bias, path_mask, dt_softplus, dt_min, dt_max):
    """The replay commit as (decay [B, H], xw [B*G, R*P, N], Bg [B*G, N, S]) with state = decay * h0 + xw @ Bg
    per group of R heads: what `ssd_state_at` computes, in factors that an in-place commit applies to the
    committed state directly (two passes over it, no copy). `path_mask` None: every node is on the path (the
    inputs were gathered along it)."""
    b, n, h, p = x.shape
    g = Bm.shape[2]
    cd = compute_dtype(x, dt, Bm)
    dtc = _dt(dt, dt_bias, dt_softplus, dt_min, dt_max, cd)  # [B, N, H]
    dA = dtc * _as(A, cd)[:, None] if A.ndim == 2 else dtc * _as(A, cd)
    m = None if path_mask is None else path_mask.to(cd)[..., None]  # [B, N, 1]
    L_s = torch.cumsum(dA if m is None else dA.mul_(m), dim=1)  # decay up to and including s
    L = L_s[:, -1]  # [B, H]
    w = (L[:, None] - L_s).exp_().mul_(dtc)  # [B, N, H]
    if m is not None:
        w = w.mul_(m)
    xw = (_as(x, cd) * w[..., None]).permute(0, 2, 3, 1).reshape(b * g, (h // g) * p, n)
    return L.exp(), xw, _by_group(_as(Bm, cd))


def ssd_step_(x, dt, A, Bm, Cm, D, dt_bias, state, dt_softplus, dt_min, dt_max) -> torch.Tensor:
    """One token per row (x [B,1,H,P], dt [B,1,H], Bm/Cm [B,1,G,S]): `state` [B,H,P,S] (contiguous, in the compute
    dtype) advanced in place, h = exp(dt A) h + dt x B^T, and y = C h + D x returned [B,1,H,P] (compute dtype).
    `tree_ssd` and the replay commit of a one-node tree in one (HF's `selective_state_update`): a plain step
    needs no record and no commit. Plain PyTorch, no custom op: a compiled graph fuses it, its state write
    included."""
    b, _, h, p = x.shape
    g, s = Bm.shape[2], Bm.shape[3]
    cd = state.dtype
    xc = _as(x[:, 0], cd)  # [B, H, P]
    dtc = _dt(dt[:, 0], dt_bias, dt_softplus, dt_min, dt_max, cd)  # [B, H]
    if static():  # compiled: elementwise work and a sum, which Inductor fuses into one loop over the state
        r = h // g
        grouped = state.view(b, g, r, p, s)  # the heads of a group share B and C
        decay = (dtc * _as(A, cd)).exp().view(b, g, r, 1, 1)
        new = grouped * decay + (xc * dtc[..., None]).view(b, g, r, p, 1) * _as(Bm[:, 0], cd).view(b, g, 1, 1, s)
        grouped.copy_(new)
        y = (new * _as(Cm[:, 0], cd).view(b, g, 1, 1, s)).sum(-1).view(b, h, p)
        if D is not None:
            Dc = _as(D, cd)
            y = y + xc * (Dc[:, None] if Dc.ndim == 1 else Dc)
        return y.unsqueeze(1)
    state.mul_((dtc * _as(A, cd)).exp_()[..., None, None])
    grouped = state.view(b * g, (h // g) * p, s)  # the heads of a group share B and C
    grouped.baddbmm_((xc * dtc[..., None]).reshape(b * g, -1, 1), _as(Bm[:, 0], cd).reshape(b * g, 1, s))
    y = torch.bmm(grouped, _as(Cm[:, 0], cd).reshape(b * g, s, 1)).view(b, h, p)
    if D is not None:
        Dc = _as(D, cd)
        y = y.add_(xc * (Dc[:, None] if Dc.ndim == 1 else Dc))
    return y.unsqueeze(1)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype (no dispatched call where it already is: these run per layer and per step)."""
    return t if t.dtype == dtype else t.to(dtype)


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
    inputs (or, for materialize, every node's state). The nodes are tokens HF's generate would feed one at a time
    to its decode step (`selective_state_update`), which takes no `dt_limit`: the chunked forward's clamp of dt
    (Zamba2 and Nemotron-H clamp it to `time_step_min`) is not HF's decode semantics, so it is not applied here
    (the probe compares with HF's decode steps)."""
    lo, hi = 0.0, float("inf")
    keep = call.commit_strategy == "materialize"
    x, dt, A, Bm, Cm = a["hidden_states"], a["dt"], a["A"], a["B"], a["C"]
    seam = "mamba_chunk_scan_combined"
    h0 = call.committed_state(seam, (x.shape[0], x.shape[2], x.shape[3], Bm.shape[-1]))
    D, bias, sp = a.get("D"), a.get("dt_bias"), bool(a.get("dt_softplus", False))
    if call.in_place and h0 is not None and h0.dtype == compute_dtype(x, dt, Bm, Cm) and h0.is_contiguous():
        call.advanced(seam)  # claimed before it is written: a second call on this state in the forward is refused
        y = ssd_step_(x, dt, A, Bm, Cm, D, bias, h0, sp, float(lo), float(hi))  # the node committed as verified
        return (y, h0) if a.get("return_final_states", False) else y
    mask = call.tree.ancestor_mask
    if eager_reference(x):  # the reference op's own computation, with the tree's masks made once for all layers
        cd = compute_dtype(x, dt, Bm, Cm)
        masks = call.tree.derived(("ssd_masks", cd), lambda: ssd_masks(mask, cd))
        y, states = _masked_ssd(x, dt, A, Bm, Cm, D, bias, h0, *masks, sp, float(lo), float(hi), keep)
    else:
        y, states = _tree_ssd(x, dt, A, Bm, Cm, D, bias, h0, mask, sp, float(lo), float(hi), keep)
    if keep:
        call.record(seam, "ssd", states=states)
    else:
        call.record(seam, "ssd", x=x, dt=dt, A=A, Bm=Bm, dt_bias=bias, h0=h0, ancestor_mask=mask, dt_softplus=sp,
                    dt_min=float(lo), dt_max=float(hi))  # fmt: skip
    return (y, h0) if a.get("return_final_states", False) else y


@commits("ssd")
def commit_ssd(items: list[tuple[torch.Tensor, Record]], path, lengths, last: torch.Tensor) -> None:
    """Materialized states are gathered; replayed layers of equal shapes share one replay computation."""
    groups: dict[tuple, list] = {}
    for target, rec in commit_materialized(items, last):
        a = rec.replay
        key = (a["x"].shape, a["dt"].shape, a["Bm"].shape, a["x"].dtype, a["dt"].dtype, a["Bm"].dtype, target.shape,
               target.dtype, a["dt_bias"] is None, a["dt_softplus"], a["dt_min"], a["dt_max"])  # fmt: skip
        groups.setdefault(key, []).append((target, a))
    for group in groups.values():
        first = group[0][1]
        cd = compute_dtype(first["x"], first["dt"], first["Bm"])
        if all(t.dtype == cd and t.is_contiguous() and in_place_commit(t) for t, _ in group):
            _replay_in_place(group, path, lengths)
            continue
        rows = torch.arange(last.shape[0], device=last.device)
        if group[0][0].numel() > BATCH_REPLAY_MAX_STATE:  # big states: concatenating them costs more than it saves
            for item in group:
                _replay([item], rows, last)
        else:
            _replay(group, rows, last)


def _stack(items: list, name: str, b: int, h: int):
    """One replay input of several layers stacked along the batch ([H] parameters: one row per (layer, row))."""
    vals = [a[name] for _, a in items]
    if vals[0] is None:
        return None
    if len(vals) == 1:
        return vals[0]
    if vals[0].ndim == 1:
        stack = torch.stack(vals)  # [layers, H]
        return stack if b == 1 else stack.repeat_interleave(b, dim=0)
    return torch.cat(vals)


def _replay_in_place(items: list, path: torch.Tensor, lengths: torch.Tensor) -> None:
    """Replay the accepted paths of several SSD layers (same shapes): the factors of all layers in one
    computation over the path's nodes only, then `state *= decay; state += xw @ B` in place, on all layers'
    states at once where the cache keeps them stacked (else layer by layer)."""
    first = items[0][1]
    k, (b, h) = len(items), (first["x"].shape[0], first["x"].shape[2])
    # the path's nodes of every layer (padded paths: entries past a row's length are masked)
    full = lengths.device.type == "cpu" and not static() and min(lengths.tolist()) == path.shape[1]
    mask = None if full else torch.arange(path.shape[1], device=path.device) < lengths[:, None]  # [B, M]
    if b == 1:
        on_path = lambda t: t.index_select(1, path[0])  # noqa: E731
        mask = None if mask is None else mask.expand(k, -1)
    else:
        rows, paths = torch.arange(k * b, device=path.device)[:, None], path.repeat(k, 1)
        on_path = lambda t: t[rows, paths]  # noqa: E731
        mask = None if mask is None else mask.repeat(k, 1)
    cat = lambda name: _stack(items, name, b, h)  # noqa: E731
    decay, xw, Bg = replay_terms(
        on_path(cat("x")), on_path(cat("dt")), cat("A"), on_path(cat("Bm")), cat("dt_bias"), mask,
        first["dt_softplus"], first["dt_min"], first["dt_max"],
    )  # fmt: skip
    targets = [t for t, _ in items]
    s = targets[0].shape[-1]
    stack = stacked(targets)
    if stack is not None and stack.is_contiguous():
        stack.mul_(decay.view(k, b, h, 1, 1))
        stack.view(xw.shape[0], -1, s).baddbmm_(xw, Bg)
        return
    per = xw.shape[0] // k  # batched matrices per layer (rows x groups)
    for i, target in enumerate(targets):
        target.mul_(decay[i * b : (i + 1) * b, :, None, None])
        target.view(per, -1, s).baddbmm_(xw[i * per : (i + 1) * per], Bg[i * per : (i + 1) * per])


def _replay(items: list, rows: torch.Tensor, last: torch.Tensor) -> None:
    """Replay the accepted paths of several SSD layers (same shapes) in one ssd_state_at call."""
    first = items[0][1]
    b, h = first["x"].shape[0], first["x"].shape[2]
    cat = lambda name: _stack(items, name, b, h)  # noqa: E731
    mask = first["ancestor_mask"][rows, last].repeat(len(items), 1)
    new = _ssd_state_at(
        cat("x"), cat("dt"), cat("A"), cat("Bm"), cat("dt_bias"), cat("h0"), mask,
        first["dt_softplus"], first["dt_min"], first["dt_max"],
    )  # fmt: skip
    for (target, _), part in zip(items, new.split(b)):
        target.copy_(part.to(target.dtype))
