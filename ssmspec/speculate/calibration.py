"""Calibration: what a verify step costs on the running model, measured on it (the verify-cost curve, relative to
a decode step, and which linears pay per tree size), kept on the model per batch size and device (each model has
its own; nothing process-wide). The adaptive policy (ssmspec.speculate.policy) prices depths with it."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from ssmspec import linear as packed_linear
from ssmspec.tree import TokenTree

# the tree sizes whose verify cost is measured (up to the largest a call can verify)
COST_SIZES = (1, 2, 4, 8, 16, 32)


def merge_curves(old: dict[int, float], new: dict[int, float]) -> dict[int, float]:
    """A cost curve with the sizes of `new` added to `old` (both relative to a decode step), kept
    non-decreasing in the size."""
    merged, floor = {}, 0.0
    for n in sorted({**old, **new}):
        floor = max(floor, new.get(n, old.get(n, 0.0)))
        merged[n] = floor
    return merged


def chooses_packing(runner) -> bool:
    """Whether `runner`'s forwards may run its model's linears packed or not per tree size (ssmspec.linear.packs):
    an eager runner on a CPU model with packed linears big enough to pack."""
    if not getattr(runner, "prepack", False) or getattr(runner, "static_shapes", False):
        return False
    return runner.device.type == "cpu" and packed_linear.packs_any(runner.model)


def measure_cost(runner, sizes: Sequence[int] = COST_SIZES, repeats: int = 5) -> dict[int, float]:
    """Verify cost of n-node chains relative to a decode step, timed on the runner's prefilled cache (each
    tree is verified and discarded, the decode step rolled back: nothing changes). The sizes take turns, one
    warm-up round then `repeats` timed rounds, and each keeps its fastest run: load from other processes only
    ever adds time, and taking turns spreads a burst of it over every size instead of one (a median of runs
    size after size, measured under two test workers on two cores, once priced 2 nodes above 1.5 decode steps
    and turned speculation off for a whole call).

    Where the runner may choose (`chooses_packing`), every size is timed with the model's linears on their packed
    weights and on F.linear, the faster kept for that size in `runner.packed_sizes` and in the curve: which is
    faster depends on the CPU (on an AMD EPYC packed weights made 2-16 rows cost what one does; on a Xeon with a
    260 MiB L3, F.linear was faster for 1-3 rows and, on the embedded model, for 1-16)."""
    cache = runner.cache
    batch = cache.n_real.shape[0]
    device = cache.n_real.device
    trees = {n: runner.prepare(TokenTree.chain(torch.zeros(batch, n, dtype=torch.long, device=device))) for n in sizes}
    modes = (True, False) if chooses_packing(runner) else (None,)
    chosen = dict(getattr(runner, "packed_sizes", None) or {})
    times = {(n, mode): float("inf") for n in sizes for mode in modes}
    for round_ in range(repeats + 1):
        for n, mode in times:
            if mode is not None:
                runner.packed_sizes = {n: mode}
            snap = runner.snapshot() if n == 1 else None  # one node: HF's decode path, rolled back
            t0 = time.perf_counter()
            runner.verify(trees[n])
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if snap is None:
                runner.discard()
            else:
                runner.commit(torch.zeros(batch, dtype=torch.long, device=device))
                runner.restore(snap)
            if round_:  # the first round warms up (and compiles)
                times[n, mode] = min(times[n, mode], elapsed)
    keys = list(times)  # (tensor parallelism: every process prices with the slowest one's times)
    times = dict(zip(keys, runner.agreement.seconds([times[k] for k in keys]), strict=True))
    best = {n: min(modes, key=lambda mode: times[n, mode]) for n in sizes}
    runner.decode_seconds = times[sizes[0], best[sizes[0]]]  # the base of the curve, in seconds (Goodput)
    if modes != (None,):
        runner.packed_sizes = {**chosen, **best}
    curve, floor = {}, 0.0
    for n in sizes:  # more nodes never cost less (timing noise aside): keep the curve non-decreasing
        floor = max(floor, times[n, best[n]] / times[sizes[0], best[sizes[0]]])
        curve[n] = floor
    return curve


def cost_curve(model: nn.Module, runner) -> dict[int, float]:
    """The model's verify-cost curve (relative to a decode step) for this batch size, measured once per model up
    to the largest tree the call verifies (extended when a later call verifies larger ones) and kept on the
    model (so each model has its own; nothing process-wide)."""
    curves = model.__dict__.setdefault("_ssmspec_cost_curves", {})
    seconds = model.__dict__.setdefault("_ssmspec_decode_seconds", {})
    packing = model.__dict__.setdefault("_ssmspec_packing", {})  # per curve: packed linears or F.linear per size
    key = curve_key(runner)
    if chooses_packing(runner):
        runner.packed_sizes = dict(packing.get(key, {})) or None
    # the sizes this call can verify (powers of two up to its largest padded tree): a compiled model compiles a
    # graph per size measured, so sizes no tree of this call reaches are left to a call that needs them
    largest = runner.padded_size(runner.max_nodes) if runner.max_nodes else COST_SIZES[-1]
    sizes = [n for n in COST_SIZES if n < largest] + [largest]
    curve = curves.get(key, {})
    missing = [n for n in sizes if n > max(curve, default=0)]  # sizes within the curve are interpolated
    if missing:
        curves[key] = curve = merge_curves(curve, measure_cost(runner, sorted({1, *missing})))
        seconds[key] = runner.decode_seconds
        if runner.__dict__.get("packed_sizes"):
            packing[key] = dict(runner.packed_sizes)
    return curve


def curve_key(runner) -> tuple:
    """What a cost curve (and its timing) is kept under on the model: batch size and device; HF's forward on the
    generic path has curves of its own."""
    key = (runner.cache.n_real.shape[0], runner.cache.n_real.device.type)
    return (*key, runner.path) if getattr(runner, "path", "seams") == "generic" else key


def cost_seconds(model: nn.Module, runner) -> float | None:
    """A decode step's forward in seconds, as measured with the model's cost curve for this runner's batch (the
    curve's base, `cost_curve`)."""
    return model.__dict__.get("_ssmspec_decode_seconds", {}).get(curve_key(runner))  # None: a curve without timing
