"""Shared Triton helpers: numerically careful softplus/log1p, block sizes."""

from __future__ import annotations

import triton
import triton.language as tl


def block(n: int, minimum: int = 16) -> int:
    """Power-of-two block covering n (at least `minimum`: tl.dot needs 16 on GPUs)."""
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def log1p(u):
    """log(1 + u) accurate for small u (Kahan's trick), in any float precision."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))


@triton.jit
def softplus(x):
    """torch.nn.functional.softplus with its default threshold 20."""
    return tl.where(x > 20.0, x, log1p(tl.exp(tl.minimum(x, 20.0))))
