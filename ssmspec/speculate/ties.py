"""Near-ties of a greedy choice: where another arithmetic (a tree instead of one token, another kernel, a compiled
step) may pick the other of the target's top two tokens in float32/bf16. Counted, never hidden."""

from __future__ import annotations

import torch


def near_tie_tolerance(dtype: torch.dtype) -> float:
    """Relative top-2 gap below which a greedy token could flip under other rounding: 8 ulps of the dtype."""
    return 8 * torch.finfo(dtype).eps


def near_ties(logits: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Per position, whether the top-2 logit gap is below tolerance * max(1, |top logit|)."""
    top = logits.float().topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]) < tolerance * top[..., 0].abs().clamp(min=1.0)
