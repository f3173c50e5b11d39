"""Triton kernels for the tree ops (one file per op family, same interfaces as ssmspec.ops).

`KERNELS` maps each reference op (torch.ops.ssmspec.*) to its triton_op (torch.ops.ssmspec_kernels.*); the
`ssmspec` torch.compile backend swaps them on CUDA. On CPU they run only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch

from ssmspec.kernels.commit import conv_window, gather_states
from ssmspec.kernels.conv import tree_causal_conv1d
from ssmspec.kernels.delta_rule import tree_delta_rule
from ssmspec.kernels.selective_scan import tree_selective_scan
from ssmspec.kernels.ssd import ssd_state_at, tree_ssd

KERNELS = {
    torch.ops.ssmspec.tree_causal_conv1d.default: torch.ops.ssmspec_kernels.tree_causal_conv1d.default,
    torch.ops.ssmspec.tree_ssd.default: torch.ops.ssmspec_kernels.tree_ssd.default,
    torch.ops.ssmspec.ssd_state_at.default: torch.ops.ssmspec_kernels.ssd_state_at.default,
    torch.ops.ssmspec.tree_selective_scan.default: torch.ops.ssmspec_kernels.tree_selective_scan.default,
    torch.ops.ssmspec.tree_delta_rule.default: torch.ops.ssmspec_kernels.tree_delta_rule.default,
    torch.ops.ssmspec.conv_window.default: torch.ops.ssmspec_kernels.conv_window.default,
    torch.ops.ssmspec.gather_states.default: torch.ops.ssmspec_kernels.gather_states.default,
}

_EAGER_ENABLED = False


def enable_eager_kernels() -> None:
    """Make the Triton kernels the CUDA implementation of the reference ops, so that eager calls on CUDA
    tensors (the commit after each step, uncompiled verification) use them too. CPU calls are unchanged."""
    global _EAGER_ENABLED
    if _EAGER_ENABLED:
        return
    for ref, kernel in KERNELS.items():
        name = f"{ref.namespace}::{ref._opname}"
        torch.library.register_kernel(name, "cuda", _call(kernel))
    _EAGER_ENABLED = True


def _call(kernel):
    def run(*args, **kwargs):
        return kernel(*args, **kwargs)

    return run


__all__ = [
    "KERNELS",
    "enable_eager_kernels",
    "conv_window",
    "gather_states",
    "ssd_state_at",
    "tree_causal_conv1d",
    "tree_delta_rule",
    "tree_selective_scan",
    "tree_ssd",
]
