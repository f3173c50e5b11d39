"""The op families: per recurrence, its torch.library reference op (+ fake), its seam adapter and its commit.

Importing this package imports every family module (`ops/<family>.py`), which registers its seam adapters
in `ADAPTERS` and its commit in `COMMITS`; a new family is one new file here (plus its kernel and a test).
"""

import importlib
import pkgutil

from ssmspec.ops._common import (
    ADAPTERS,
    COMMITS,
    KERNEL_POLICIES,
    Record,
    SeamAdapter,
    SeamCall,
    gather_states,
    kernel_policy,
    traceable_reference,
    using_kernel_policy,
)

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

from ssmspec.ops.conv import conv_window, tree_causal_conv1d  # noqa: E402
from ssmspec.ops.delta_rule import tree_delta_rule  # noqa: E402
from ssmspec.ops.selective_scan import tree_selective_scan  # noqa: E402
from ssmspec.ops.ssd import ssd_state_at, tree_ssd  # noqa: E402

__all__ = [
    "ADAPTERS",
    "COMMITS",
    "KERNEL_POLICIES",
    "Record",
    "SeamAdapter",
    "SeamCall",
    "conv_window",
    "gather_states",
    "kernel_policy",
    "traceable_reference",
    "using_kernel_policy",
    "ssd_state_at",
    "tree_causal_conv1d",
    "tree_delta_rule",
    "tree_selective_scan",
    "tree_ssd",
]
