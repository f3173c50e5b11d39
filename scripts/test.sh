#!/usr/bin/env bash
# The test suite: set up, lint, pytest (Hypothesis profile `ci` unless HYPOTHESIS_PROFILE is set), build the docs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m ruff check ssmspec tests benchmarks
python -m ruff format --check --quiet ssmspec tests benchmarks
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# the property suite records what it checked per family; the docs' family table is rendered from it
export SSMSPEC_FAMILY_REPORT="${SSMSPEC_FAMILY_REPORT:-$PWD/build/family-report.json}"
rm -f "$SSMSPEC_FAMILY_REPORT"
# two worker processes (pytest-xdist; SSMSPEC_TEST_WORKERS to change, 0: one process), each test file in one
# worker (the property suites' per-family report is written by the file's last test)
python -m pytest -q -W ignore::DeprecationWarning -n "${SSMSPEC_TEST_WORKERS:-2}" --dist loadfile "$@"
# the docs site (offline, strict: a broken link or a missing page fails)
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet
