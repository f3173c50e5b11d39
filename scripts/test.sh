#!/usr/bin/env bash
# The test suite: set up, lint, pytest (Hypothesis profile `ci` unless HYPOTHESIS_PROFILE is set), build the docs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m ruff check ssmspec tests benchmarks
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# the property suite records what it checked per family; the docs' family table is rendered from it
export SSMSPEC_FAMILY_REPORT="${SSMSPEC_FAMILY_REPORT:-$PWD/build/family-report.json}"
rm -f "$SSMSPEC_FAMILY_REPORT"
python -m pytest -q -W ignore::DeprecationWarning "$@"
# the docs site (offline, strict: a broken link or a missing page fails)
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet
