"""The GPU benchmark command runs end to end (on a CPU: tiny shapes, the Triton interpreter) and writes the
JSON the docs' GPU page reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_benchmark_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, "gpu.py", "--smoke", "--json", str(out)], cwd=ROOT / "benchmarks", check=True,
                   timeout=900, capture_output=True)  # fmt: skip
    data = json.loads(out.read_text())
    assert {"device", "torch", "kernels", "verify_over_decode", "e2e", "families"} <= set(data)
    verify = data["verify_over_decode"]
    assert {"eager", "compiled", "graphs", "graphs (compiled)"} <= set(verify)
    assert verify["errors"] == {} and set(verify["eager"]) == set(verify["compiled"]) == {"1", "6"}
    assert all(row["ok"] and row["identical"] for row in data["families"].values()) and data["families"]
    rows = data["e2e"]["mamba2-target"]
    assert all(row["identical"] for row in rows.values())
    for row in rows.values():
        assert {"tokens_per_s", "speedup_vs_hf", "speedup_vs_best_ar", "identical", "near_ties"} <= set(row)
