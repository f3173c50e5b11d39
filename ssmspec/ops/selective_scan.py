"""Tree selective scan (Mamba1, Jamba, Falcon-Mamba: diagonal A per channel and state): reference op.

The decay exp(dt_t[d] A[d, n]) depends on the state index, so the C.B factorisation of SSD does not hold:
node states are computed from the parent's state one tree level at a time. Seam adapter for
`selective_scan_fn`; commit: replay (the recurrence re-run along the accepted path) or materialize (gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ssmspec.ops._common import (
    Record,
    SeamCall,
    commit_materialized,
    commits,
    compute_dtype,
    eager_fast_path,
    gather_nodes,
    levelwise_states,
    reference_op,
    seam_adapter,
)


@reference_op("tree_selective_scan", traceable=False)
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
    y = y.to(x.dtype).contiguous()  # the fake's layout: Inductor checks real strides against it
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


_tree_scan = eager_fast_path(tree_selective_scan)


@seam_adapter(
    "selective_scan_fn",
    understands=("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state"),
    ignores=("use_mambapy", "use_associative_scan"),  # backend switches of the same scan
)
def verify_selective_scan(call: SeamCall, a: dict[str, Any]):
    """Mamba1 selective scan on the tree; records the replay inputs (or every node's state)."""
    keep = call.commit_strategy == "materialize"
    x, dt, A, Bm, Cm = a["hidden_states"], a["dt"], a["A"], a["B"], a["C"]
    seam = "selective_scan_fn"
    h0 = call.committed_state(seam, (x.shape[0], x.shape[1], A.shape[-1]))
    bias, sp = a.get("delta_bias"), bool(a.get("delta_softplus", False))
    tree = call.tree
    y, states = _tree_scan(x, dt, A, Bm, Cm, a.get("D"), a.get("z"), bias, h0, tree.parents, tree.depth, sp, keep)
    if keep:
        call.record(seam, "selective_scan", states=states)
    else:
        call.record(seam, "selective_scan", x=x, dt=dt, A=A, Bm=Bm, Cm=Cm, dt_bias=bias, h0=h0, dt_softplus=sp)
    return (y, h0) if a.get("return_last_state", False) else y


def _along(x: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """x [B, C, N] -> [B, C, M]: the nodes of each row's path, along the last dim."""
    return torch.gather(x, 2, path[:, None, :].expand(x.shape[0], x.shape[1], path.shape[1]))


def replay_chains(x, dt, A, Bm, dt_bias, h0, lengths, dt_softplus: bool) -> torch.Tensor:
    """The state after each row's chain of `lengths[b]` nodes, for R stacked records at once: x/dt [R, B, D, M],
    A [R, D, S], Bm [R, B, S, M], dt_bias [R, D] or None, h0 [R, B, D, S]; returns [R, B, D, S] in the compute
    dtype. Each node's update is the tree scan's own (the same products in the same order), so a replayed state
    equals the verified node's up to the last bit of `exp` (vectorised and scalar paths round apart)."""
    cd = compute_dtype(x, dt, Bm, h0)
    dtc = dt.to(cd)
    if dt_bias is not None:
        dtc = dtc + dt_bias.to(cd)[:, None, :, None]
    if dt_softplus:
        dtc = F.softplus(dtc)
    a, bm, xc = A.to(cd)[:, None], Bm.to(cd), x.to(cd)
    h = h0.to(cd)
    for m in range(x.shape[-1]):
        step = dtc[..., m, None]  # [R, B, D, 1]
        new = torch.exp(step * a) * h + step * bm[:, :, None, :, m] * xc[..., m, None]
        h = torch.where((m < lengths).view(1, -1, 1, 1), new, h)
    return h


@commits("selective_scan")
def commit_selective_scan(items: list[tuple[torch.Tensor, Record]], path, lengths, last: torch.Tensor) -> None:
    """Replay: run the scan on each row's accepted path (a chain) from the committed state and keep its last
    state; the records of every layer (and head) alike in shape replayed together, stacked."""
    groups: dict[tuple, list[tuple[torch.Tensor, dict]]] = {}
    for target, rec in commit_materialized(items, last):
        a = rec.replay
        key = tuple(
            (k, v.shape, v.dtype, v.device) if isinstance(v, torch.Tensor) else (k, v) for k, v in sorted(a.items())
        )
        groups.setdefault(key, []).append((target, a))
    for group in groups.values():
        replays = [a for _, a in group]

        def stack(name: str, along: bool = False) -> torch.Tensor:
            return torch.stack([_along(a[name], path) if along else a[name] for a in replays])

        first = replays[0]
        h0 = (
            torch.stack([a["h0"] for a in replays])
            if first["h0"] is not None
            else first["x"].new_zeros(len(replays), first["x"].shape[0], first["x"].shape[1], first["A"].shape[-1])
        )
        bias = None if first["dt_bias"] is None else stack("dt_bias")
        states = replay_chains(stack("x", True), stack("dt", True), stack("A"), stack("Bm", True), bias, h0, lengths,
                               first["dt_softplus"])  # fmt: skip
        for (target, _), state in zip(group, states):
            target.copy_(state.to(target.dtype))
