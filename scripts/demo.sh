#!/usr/bin/env bash
# The main job: set up, then greedy vs speculative generation on the default model (no network needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python -m ssmspec demo "$@"
