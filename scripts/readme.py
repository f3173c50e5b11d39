"""Regenerate the README's generated blocks from the data and the code, or check them.

    python scripts/readme.py            # rewrite the speed table (docs/data) and the families line (the code)
    python scripts/readme.py --check    # fail where a block is out of date or the README breaks the docs' rules

The blocks are rendered by docs/hooks.py, as the docs are; `mkdocs build` checks both blocks before building, and
tests/test_docs_build.py checks the speed table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def hooks():
    """docs/hooks.py as a module (it is not a package)."""
    spec = importlib.util.spec_from_file_location("ssmspec_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    docs = hooks()
    if argv == ["--check"]:
        try:
            docs.check_readme()
        except ValueError as exc:
            print(f"readme: {exc}", file=sys.stderr)
            return 1
        print("README.md is up to date")
        return 0
    docs.write_readme()
    docs.check_readme()
    print("README.md rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
