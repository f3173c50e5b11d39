"""Triton commit kernels: the new conv window (last S inputs along each row's accepted path, committed
columns filling the rest) and the materialize gather. Same interfaces as ssmspec.ops.conv.conv_window and
ssmspec.ops.gather_states."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ssmspec.kernels._common import kernel_op


@triton.jit
def _conv_window_kernel(
    c_ptr, n_ptr, path_ptr, len_ptr, out_ptr, C, S,
    scb, scc, scs, snb, snc, snn, spb, spm, sob, soc, sos, BC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    j = tl.program_id(1)  # output column
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    cm = c < C
    pos = j - S + tl.load(len_ptr + b)  # index into the path; < 0 means a committed column
    node = tl.load(path_ptr + b * spb + tl.maximum(pos, 0) * spm)
    on_path = (c * 0 + pos) >= 0  # a block-shaped mask
    from_nodes = tl.load(n_ptr + b * snb + c * snc + node * snn, mask=cm & on_path, other=0.0)
    from_committed = tl.load(c_ptr + b * scb + c * scc + (S + tl.minimum(pos, -1)) * scs, mask=cm & ~on_path,
                             other=0.0)  # fmt: skip
    val = tl.where(on_path, from_nodes.to(out_ptr.dtype.element_ty), from_committed)
    tl.store(out_ptr + b * sob + c * soc + j * sos, val, mask=cm)


@kernel_op(torch.ops.ssmspec.conv_window.default)
def conv_window(committed, nodes, path, lengths):
    """Triton version of ssmspec::conv_window."""
    b, c, s = committed.shape
    out = torch.empty_like(committed)
    bc = min(triton.next_power_of_2(c), 128)
    wrap_triton(_conv_window_kernel)[(b, s, triton.cdiv(c, bc))](
        committed, nodes, path, lengths, out, c, s,
        *committed.stride(), *nodes.stride(), *path.stride(), *out.stride(), BC=bc,
    )  # fmt: skip
    return out


@triton.jit
def _gather_kernel(src_ptr, last_ptr, out_ptr, inner, ssb, ssn, sob, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inner
    node = tl.load(last_ptr + b)
    tl.store(out_ptr + b * sob + offs, tl.load(src_ptr + b * ssb + node * ssn + offs, mask=m), mask=m)


@kernel_op(torch.ops.ssmspec.gather_states.default)
def gather_states(states, last):
    """Triton version of ssmspec::gather_states (materialize commit)."""
    states = states.contiguous()
    b, n = states.shape[:2]
    inner = states[0, 0].numel()
    out = states.new_empty(b, *states.shape[2:])
    blk = min(triton.next_power_of_2(inner), 1024)
    wrap_triton(_gather_kernel)[(b, triton.cdiv(inner, blk))](
        states, last, out, inner, states.stride(0), states.stride(1), out.stride(0), BLOCK=blk
    )
    return out
