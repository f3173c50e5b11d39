"""Timing helper shared by the benchmark scripts: median wall time, synchronising CUDA when used."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int, *, warmup: int = 0) -> float:
    """Median seconds of `repeats` calls of fn (after `warmup` untimed calls)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def provenance(command: str | None = None) -> dict[str, str]:
    """How a data file was measured (ssmspec.bench.provenance: date, machine, versions, revision, command)."""
    from ssmspec.bench import provenance as measured

    return measured(command)
