"""ssmspec: exact speculative decoding (chains and trees) for Hugging Face SSM and hybrid models."""

from ssmspec import backend as _backend  # noqa: F401  (registers the "ssmspec" torch.compile backend)
from ssmspec.cache import SpecCache
from ssmspec.errors import InvalidTreeError, SSMSpecError, UnsupportedModelError, VocabMismatchError
from ssmspec.speculate import generate as _generate  # noqa: F401  (registers speculative generate)
from ssmspec.speculate.config import SpecConfig
from ssmspec.transform import transform
from ssmspec.tree import TokenTree

__version__ = "0.1.0"

__all__ = [
    "InvalidTreeError",
    "SSMSpecError",
    "SpecCache",
    "SpecConfig",
    "TokenTree",
    "UnsupportedModelError",
    "VocabMismatchError",
    "transform",
]
