"""Chunked prefill from an initial state (reference): a prompt continued from a committed state.

A chain is a tree, so each chunk is one tree op call on a chain (its arguments by name: the op's signature is
declared once, on the op); the state is carried across chunks by the
replay-commit form (`ssd_state_at` for SSD, the chain's last node state for the level-wise recurrences).
Memory per chunk is O(chunk^2) for SSD and O(chunk * state) for the others.
"""

from __future__ import annotations

import torch

from ssmspec.ops._common import chain_structure
from ssmspec.ops.delta_rule import tree_delta_rule
from ssmspec.ops.selective_scan import tree_selective_scan
from ssmspec.ops.ssd import ssd_state_at, tree_ssd


def _chunks(length: int, chunk_size: int, batch: int, device: torch.device):
    """Yield (slice, parents, depth, ancestor mask) of each chunk, every chunk a chain."""
    for start in range(0, length, chunk_size):
        n = min(chunk_size, length - start)
        parents, depth = chain_structure(batch, n, device)
        anc = (depth[0, None, :] <= depth[0, :, None]).expand(batch, n, n)
        yield slice(start, start + n), parents, depth, anc


def ssd_chunked_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    Bm: torch.Tensor,
    Cm: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    h0: torch.Tensor | None,
    *,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 SSD over a [B, L, H, P] sequence from state h0, chunk by chunk. Returns (y, final state)."""
    b, length = x.shape[:2]
    ys, state = [], h0
    lo, hi = dt_limit
    for sl, _, _, anc in _chunks(length, chunk_size, b, x.device):
        common = dict(x=x[:, sl], dt=dt[:, sl], A=A, Bm=Bm[:, sl], dt_bias=dt_bias, h0=state, dt_softplus=dt_softplus,
                      dt_min=lo, dt_max=hi)  # fmt: skip
        y, _ = tree_ssd(**common, Cm=Cm[:, sl], D=D, ancestor_mask=anc, return_states=False)
        ys.append(y)
        state = ssd_state_at(**common, path_mask=anc[:, -1])
    return torch.cat(ys, dim=1), state


def selective_scan_chunked_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    Bm: torch.Tensor,
    Cm: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    h0: torch.Tensor | None,
    *,
    dt_softplus: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba1 selective scan over [B, D, L] from state h0 (which HF's fallback cannot take), chunk by chunk."""
    b, length = x.shape[0], x.shape[-1]
    ys, state = [], h0
    for sl, parents, depth, _ in _chunks(length, chunk_size, b, x.device):
        y, states = tree_selective_scan(
            x=x[..., sl], dt=dt[..., sl], A=A, Bm=Bm[..., sl], Cm=Cm[..., sl], D=D,
            z=z[..., sl] if z is not None else None, dt_bias=dt_bias, h0=state, parents=parents, depth=depth,
            dt_softplus=dt_softplus, return_states=True,
        )  # fmt: skip
        ys.append(y)
        state = states[:, -1]
    return torch.cat(ys, dim=-1), state


def delta_rule_chunked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor | None,
    *,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule / KDA over [B, L, H, *] from state h0, chunk by chunk."""
    b, length = q.shape[:2]
    ys, state = [], h0
    for sl, parents, depth, _ in _chunks(length, chunk_size, b, q.device):
        y, states = tree_delta_rule(
            q=q[:, sl], k=k[:, sl], v=v[:, sl], g=g[:, sl], beta=beta[:, sl], h0=state, parents=parents, depth=depth,
            use_qk_l2norm=use_qk_l2norm, return_states=True,
        )  # fmt: skip
        ys.append(y)
        state = states[:, -1]
    return torch.cat(ys, dim=1), state
