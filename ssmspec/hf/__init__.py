"""Every coupling to transformers internals, in one place: kernel seams (seams.py), the HF Cache that verifies
trees (cache.py) and its layer internals (layers.py), attention masks (masks.py), generate's settings
(generation.py), and the version guard below. Submodules are imported where used.
"""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version

TESTED = (Version("5.23"), Version("5.24"))  # [lowest, first untested)


def check_version(version: str = transformers.__version__) -> bool:
    """Whether this transformers version is one ssmspec was tested against; warns once if not."""
    v = Version(Version(version).base_version)
    ok = TESTED[0] <= v < TESTED[1]
    if not ok:
        warnings.warn(
            f"ssmspec was tested with transformers >={TESTED[0]},<{TESTED[1]}; found {version}. Tree verification "
            "is still checked against HF's own forward at transform time, so an incompatibility is refused, not run.",
            stacklevel=2,
        )
    return ok


check_version()
