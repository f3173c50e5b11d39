"""Triton tree causal conv1d: ancestor gather + committed-state fill + bias + activation, one program per
(row, node, channel block). Same interface as ssmspec.ops.conv.tree_causal_conv1d."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ssmspec.kernels._common import kernel_op
from ssmspec.kernels.ssd import _tl_dtype
from ssmspec.ops._common import compute_dtype
from ssmspec.ops.conv import _check_activation, _check_state


@triton.jit
def _tree_conv_kernel(
    x_ptr, w_ptr, b_ptr, anc_ptr, out_ptr,
    C, N, S, K,
    sxb, sxc, sxt, swc, swk, sab, san, sak, sob, soc, son,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n = tl.program_id(1)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    cm = c < C
    acc = tl.zeros([BC], dtype=ACC)  # at least float32: half-precision inputs accumulate in float32
    for j in range(0, K):
        pos = tl.load(anc_ptr + b * sab + n * san + j * sak) + S  # index into [committed | nodes]
        xv = tl.load(x_ptr + b * sxb + c * sxc + pos * sxt, mask=cm, other=0.0).to(ACC)
        wv = tl.load(w_ptr + c * swc + (K - 1 - j) * swk, mask=cm, other=0.0).to(ACC)
        acc += xv * wv
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cm, other=0.0).to(ACC)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * sob + c * soc + n * son, acc.to(out_ptr.dtype.element_ty), mask=cm)


@kernel_op(torch.ops.ssmspec.tree_causal_conv1d.default)
def tree_causal_conv1d(x_ext, weight, bias, ancestors, activation):
    """Triton version of ssmspec::tree_causal_conv1d (x_ext [B,C,S+N], weight [C,K], ancestors [B,N,K])."""
    act = activation or None
    _check_activation(act)
    b, c, total = x_ext.shape
    n, k = ancestors.shape[1], ancestors.shape[2]
    s = total - n
    _check_state(s, k)
    out = x_ext.new_empty(b, n, c).transpose(1, 2)  # time-major, as the reference
    bc = min(triton.next_power_of_2(c), 128)
    grid = (b, n, triton.cdiv(c, bc))
    wrap_triton(_tree_conv_kernel)[grid](
        x_ext, weight, bias if bias is not None else weight, ancestors, out,
        c, n, s, k,
        *x_ext.stride(), *weight.stride(), *ancestors.stride(), *out.stride(),
        HAS_BIAS=bias is not None, SILU=act in ("silu", "swish"), BC=bc,
        ACC=_tl_dtype(compute_dtype(x_ext, weight)),
    )  # fmt: skip
    return out
