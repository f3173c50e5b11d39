"""Hypothesis profiles: `ci` (fast, derandomized; the default) and `thorough` (local runs).

Select with HYPOTHESIS_PROFILE=thorough.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in the interpreter (must precede imports)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# no calibration kept on disk (ssmspec.speculate.calibration): a test's verdict may not depend on what an earlier test,
# or an earlier run on this machine, measured (the tests of the disk cache give it a directory of their own)
os.environ["SSMSPEC_CACHE"] = "off"

from hypothesis import HealthCheck, settings  # noqa: E402

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile(
    "ci", max_examples=25, derandomize=True, deadline=None, suppress_health_check=_SUPPRESS, print_blob=True
)
settings.register_profile("thorough", max_examples=60, deadline=None, suppress_health_check=_SUPPRESS, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# two threads (CI's machine has 2 cores); with pytest-xdist each of N worker processes gets its share of the cores
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
