#!/usr/bin/env bash
# The checks that need a GPU, in one command: the CUDA tests (`pytest -m gpu`), the quick benchmark's end-to-end
# rows (benchmarks/gpu.py --sections quick) and a profile of the compiled calls (--sections profile). Each part runs
# in its own process with its own time limit, so that a crash or a hang in one leaves the others' results; logs and
# JSON go to $OUT (default build/gpu).
#   bash scripts/gpu.sh                      # everything
#   bash scripts/gpu.sh tests quick          # some parts (tests, quick, profile, verify, families)
# Time limits in seconds: GPU_TESTS_S (300), GPU_QUICK_S (360: the compiled warm-ups take about 165 s on empty
# compile caches on an H200), GPU_PROFILE_S (150), GPU_VERIFY_S (300), GPU_FAMILIES_S (400).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests quick profile)
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    python -c "import torch, transformers, triton, ssmspec; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__, 'ssmspec', ssmspec.__file__)" 2>&1
    git rev-parse --short HEAD 2>/dev/null
} | tee "$OUT/env.txt"
run() {  # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    # SIGINT first: pytest then prints its summary of failures and writes its XML; what is still running 20 s later
    # is killed
    timeout -s INT -k 20 "$seconds" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc ($((SECONDS - start)) s of $seconds; 124: out of time)" | tee -a "$OUT/summary.txt"
    grep -v "falling back" "$OUT/$name.log" | tail -25
}
for part in "${parts[@]}"; do
    case "$part" in
        tests) run tests "${GPU_TESTS_S:-300}" python -m pytest -q -p no:cacheprovider -m gpu -rfE \
                   -n "${GPU_TEST_WORKERS:-8}" --junitxml="$OUT/tests.xml" ;;
        quick) run quick "${GPU_QUICK_S:-360}" python benchmarks/gpu.py --sections quick --json "$OUT/gpu_quick.json" ;;
        profile) run profile "${GPU_PROFILE_S:-150}" python benchmarks/gpu.py --sections profile \
                     --json "$OUT/gpu_profile.json" ;;
        verify) run verify "${GPU_VERIFY_S:-300}" python benchmarks/gpu.py --quick --sections verify \
                    --json "$OUT/gpu_verify.json" ;;
        families) run families "${GPU_FAMILIES_S:-400}" python benchmarks/gpu.py --sections families \
                      --json "$OUT/gpu_families.json" ;;
        *) echo "unknown part: $part (tests, quick, profile, verify, families)" >&2; exit 2 ;;
    esac
done
