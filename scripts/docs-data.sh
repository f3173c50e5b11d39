#!/usr/bin/env bash
# Refreshes the docs data the families tables are rendered from (docs/data/families.json): runs the
# float64 and float32 property suites (Hypothesis profile `ci` unless HYPOTHESIS_PROFILE is set) with the
# family report pointed at the committed file. Run it after adding a family; commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
export SSMSPEC_FAMILY_REPORT="$PWD/docs/data/families.json"
rm -f "$SSMSPEC_FAMILY_REPORT"
python -m pytest -q -W ignore::DeprecationWarning tests/property
python -c "import json; d=json.load(open('$SSMSPEC_FAMILY_REPORT')); print(f'{len(d)} families in docs/data/families.json')"
