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
python - "$SSMSPEC_FAMILY_REPORT" <<'EOF'
import json, sys
from ssmspec.bench import provenance
from ssmspec.testing.report import PROVENANCE
path = sys.argv[1]
report = json.load(open(path))
report[PROVENANCE] = provenance("bash scripts/docs-data.sh")
open(path, "w").write(json.dumps(report, indent=1, sort_keys=True))
print(f"{len(report) - 1} families in docs/data/families.json")
EOF
