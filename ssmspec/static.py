"""Whether code runs where it must keep to tensor-only paths: compiled by Dynamo, or inside a step capture (a CUDA
graph, or the CPU op tape of ssmspec.compile.graphs). The tree ops and the token tree ask it (`static`) to skip their
Python-side caches and host reads then; the capture itself lives above them, in ssmspec.compile.graphs."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode


class CaptureMode(TorchDispatchMode):
    """The dispatch mode a CPU step capture records under (ssmspec.compile.graphs' op tape derives from it)."""


def capturing() -> bool:
    """Whether the current code runs inside a step capture (CUDA stream capture or the CPU op tape): code that keeps
    Python-side caches or reads the host takes its tensor-only path then, as under torch.compile."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    return isinstance(_get_current_dispatch_mode(), CaptureMode)


def static() -> bool:
    """Whether code must keep to tensor-only paths now: compiling (Dynamo) or capturing a step."""
    return torch.compiler.is_compiling() or capturing()
