"""Near-ties of a greedy choice: where another arithmetic (a tree instead of one token, another kernel, a compiled
step) may pick the other of the target's top two tokens in float32/bf16. Counted, never hidden."""

from __future__ import annotations

import torch


def near_tie_tolerance(dtype: torch.dtype) -> float:
    """Relative top-2 gap below which a greedy token could flip under other rounding: 8 ulps of the dtype."""
    return 8 * torch.finfo(dtype).eps


def near_ties(logits: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Per position, whether the top-2 logit gap is below tolerance * max(1, |top logit|). The runner-up is the largest
    logit once the top one's position is masked (a repeated top value is a tie): topk's values, as reductions that a
    compiled step fuses into its loops where topk is a library call (on the embedded target, a compiled plain step
    took 0.90x the time)."""
    x = logits.float()
    top = x.amax(-1)
    second = x.scatter(-1, x.argmax(-1, keepdim=True), float("-inf")).amax(-1)
    return (top - second) < tolerance * top.abs().clamp(min=1.0)
