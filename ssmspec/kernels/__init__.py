"""Triton kernels for the tree ops (one file per op family, same interfaces as ssmspec.ops).

`KERNELS` maps each reference op (torch.ops.ssmspec.*) to its triton_op (torch.ops.ssmspec_kernels.*).
On CUDA, `enable_eager_kernels()` makes a measured choice (`select.SELECTOR`, policy "auto") the CUDA
implementation of every reference op: per argument signature, the kernel runs only where it was measured
faster than the reference. The `ssmspec` backend's `kernels=True` lowers to the kernels unconditionally.
On CPU they run only under TRITON_INTERPRET=1 (tests). `cpu_linear` is a C++ kernel for the products of a few rows
that a captured CPU step calls (built on first use; not imported here).
"""

from __future__ import annotations

import inspect

import torch

from ssmspec.kernels.commit import conv_window, gather_states
from ssmspec.kernels.conv import tree_causal_conv1d
from ssmspec.kernels.delta_rule import tree_delta_rule
from ssmspec.kernels.select import SELECTOR, KernelSelector
from ssmspec.kernels.selective_scan import tree_selective_scan
from ssmspec.kernels.ssd import ssd_state_at, tree_ssd
from ssmspec.ops import KERNEL_POLICIES as POLICIES
from ssmspec.ops._common import reference_impl

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
    """Give every reference op a CUDA implementation that dispatches through `SELECTOR`, so eager calls on
    CUDA tensors (the commit after each step, uncompiled verification, reference ops left in a compiled
    graph) run the kernel where the running model's policy says so (ssmspec.ops.kernel_policy: "reference"
    for models not compiled with the backend, so registering changes nothing for them). CPU calls are
    unchanged. Idempotent."""
    global _EAGER_ENABLED
    if _EAGER_ENABLED:
        return
    for ref, kernel in KERNELS.items():
        name = f"{ref.namespace}::{ref._opname}"
        torch.library.register_kernel(name, "cuda", _dispatcher(name, reference_impl(ref), kernel))
    _EAGER_ENABLED = True


def kernel_supports(args) -> bool:
    """Whether the kernels take these arguments: not float64 on a GPU (Triton's float64 support there is
    partial; a float64 tree SSD fails to compile on an H100), so float64 CUDA calls run the reference, by
    design. (The CPU interpreter runs float64, which the kernel tests use for exact comparisons.)"""
    return not any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 and a.is_cuda for a in args)


def _dispatcher(name, reference, kernel):
    sig = inspect.signature(reference)
    n_params = len(sig.parameters)

    def run(*args, **kwargs):
        if kwargs or len(args) != n_params:  # binding only where needed: this runs on every op call
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        if not kernel_supports(args):
            return reference(*args)
        return SELECTOR.run(name, reference, kernel, args)

    return run


__all__ = [
    "KERNELS",
    "POLICIES",
    "SELECTOR",
    "KernelSelector",
    "enable_eager_kernels",
    "kernel_supports",
    "conv_window",
    "gather_states",
    "ssd_state_at",
    "tree_causal_conv1d",
    "tree_delta_rule",
    "tree_selective_scan",
    "tree_ssd",
]
