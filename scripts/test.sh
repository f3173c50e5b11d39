#!/usr/bin/env bash
# The test suite: set up, lint, then pytest (Hypothesis profile `ci` unless HYPOTHESIS_PROFILE is set).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m ruff check ssmspec tests benchmarks
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
exec python -m pytest -q -W ignore::DeprecationWarning "$@"
