"""Helpers shared by the reference tree ops: compute dtypes and level-by-level tree evaluation."""

from __future__ import annotations

from collections.abc import Callable

import torch


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """At least float32, float64 when any input is float64: recurrences never run in half precision."""
    dt = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dt = torch.promote_types(dt, t.dtype)
    return dt


def gather_nodes(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x: [B, N, *rest], idx: [B, M] -> [B, M, *rest]."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return x[rows, idx]


def levelwise_states(
    h0: torch.Tensor,
    parents: torch.Tensor,
    depth: torch.Tensor,
    step: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Node states of a recurrence h_t = step(h_parent(t))_t, evaluated one tree level at a time.

    h0: [B, *S] committed state; parents/depth: [B, N]; step maps parent states [B, N, *S] to the
    states of every node [B, N, *S] (each node applying its own inputs). Returns [B, N, *S].
    """
    b, n = parents.shape
    states = h0.unsqueeze(1).expand(b, n, *h0.shape[1:]).clone()
    max_depth = int(depth.max()) if n else 0
    par = parents.clamp(min=0)
    shape = (b, n) + (1,) * (h0.ndim - 1)
    for d in range(max_depth + 1):
        prev = h0.unsqueeze(1).expand_as(states) if d == 0 else gather_nodes(states, par)
        new = step(prev)
        states = torch.where((depth == d).view(shape), new, states)
    return states
