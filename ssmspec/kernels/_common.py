"""Shared Triton helpers: numerically careful softplus/log1p, block sizes, and `kernel_op`, which registers a kernel
with its reference op's schema."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from ssmspec.ops._common import reference_impl


def kernel_op(reference: torch._ops.OpOverload) -> Callable[[Callable], Callable]:
    """Register a function as the Triton kernel of a reference op (ssmspec.ops): `ssmspec_kernels::<name>` with the
    reference's own argument and return types, so that an op's signature is declared once, on the reference (which
    its fake and the prefill path use too). The kernel takes the same arguments by the same names in the same order:
    a difference is a TypeError at import."""
    typed = reference_impl(reference)
    names = list(inspect.signature(typed).parameters)

    def register(fn: Callable) -> Callable:
        params = list(inspect.signature(fn).parameters)
        if params != names:
            raise TypeError(f"kernel of {reference._schema.name}: takes {params}, the reference op takes {names}")
        fn.__annotations__ = dict(typed.__annotations__)  # (triton_op infers the schema from them)
        return triton_op(f"ssmspec_kernels::{reference._opname}", fn, mutates_args=())

    return register


def block(n: int, minimum: int = 16) -> int:
    """Power-of-two block covering n (at least `minimum`: tl.dot needs 16 on GPUs)."""
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def dot(a, b, F64: tl.constexpr):
    """a @ b in IEEE precision: tl.dot, or for float64 (`F64`) a broadcast product summed, since Triton cannot lower
    every float64 MMA (on Hopper: `Currently fp64 don't support largeK MMA`); float64 is an exactness dtype, not a
    speed one."""
    if F64:
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def log1p(u):
    """log(1 + u) accurate for small u (Kahan's trick), in any float precision."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))


@triton.jit
def softplus(x):
    """torch.nn.functional.softplus with its default threshold 20."""
    return tl.where(x > 20.0, x, log1p(tl.exp(tl.minimum(x, 20.0))))
