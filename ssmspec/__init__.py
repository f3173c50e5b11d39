"""ssmspec: exact speculative decoding (chains and trees) for Hugging Face SSM and hybrid models."""

from ssmspec import models  # noqa: F401  (ssmspec.models.load(...) after `import ssmspec`)
from ssmspec._version import __version__  # noqa: F401  (ssmspec.__version__)
from ssmspec.compile import backend as _backend  # noqa: F401  (registers the "ssmspec" torch.compile backend)
from ssmspec.errors import (
    CaptureError,
    InvalidTreeError,
    SSMSpecError,
    UnsupportedModelError,
    UnsupportedSettingError,
    VocabMismatchError,
)
from ssmspec.hf.cache import SpecCache
from ssmspec.speculate.calibration import kept as calibration_of
from ssmspec.speculate.config import SpecConfig
from ssmspec.speculate.retrieval import SuffixIndex
from ssmspec.transform import calibrate, explain, transform
from ssmspec.tree import TokenTree

__all__ = [
    "CaptureError",
    "InvalidTreeError",
    "SSMSpecError",
    "SpecCache",
    "SpecConfig",
    "SuffixIndex",
    "TokenTree",
    "UnsupportedModelError",
    "UnsupportedSettingError",
    "VocabMismatchError",
    "calibrate",
    "calibration_of",
    "explain",
    "models",
    "transform",
]
