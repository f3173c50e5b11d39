#!/usr/bin/env bash
# Installs ssmspec and its test dependencies into the current Python (idempotent, quiet).
# torch is installed first, at the version the tests run, so that ssmspec's range does not pull another build.
# Which build that is depends on the index pip reads: PyPI's Linux wheel is the CUDA one; a CPU-only machine
# installs the CPU wheel first (README: the CPU install).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" 2>&1 | grep -v -E "^WARNING|Location '" || true
python -m pip install -q -e ".[test]" 2>&1 | grep -v -E "^WARNING|Location '" || true
python -c "import ssmspec, torch, transformers; print(f'ssmspec {ssmspec.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
