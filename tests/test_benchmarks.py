"""The GPU benchmark command runs end to end (on a CPU: tiny shapes, the Triton interpreter) and writes the
JSON the docs' GPU page reads."""

from __future__ import annotations

import json
import os
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
    quick = data["quick"]  # `--quick`'s section: the embedded target as a user calls it
    assert quick["compiled"] and not quick["captured_steps"]  # (captured steps: a compiled model on CUDA)
    assert {"date", "revision", "command"} <= set(data)
    assert len(quick["rows"]) == 9 and all(row["identical"] for row in quick["rows"].values())
    assert all(row["graphs_compiled_while_timed"] == 0 for row in quick["rows"].values())
    profile = data["profile"]  # one call of each kind under the profiler (no CUDA here: nothing launched)
    assert set(profile) == {"plain", "default", "head"} and not any("error" in row for row in profile.values())
    assert profile["plain"]["tokens_per_step"] == 1.0 and profile["head"]["tokens_per_step"] > 1.0
    assert all(row["wall_ms_per_step"] > 0 and row["top_host_ops"] for row in profile.values())


def test_generic_path_benchmarks_run_and_agree_with_hf(tmp_path):
    """benchmarks/generic.py (end to end, every output checked against HF's) and verify_cost.py on a model
    without seams (its generic path) run at tiny shapes and write their JSON."""
    out = tmp_path / "generic.json"
    args = ["--layers", "6", "--hidden", "64", "--new", "12", "--repeats", "1", "--batch", "2", "--json", str(out)]
    subprocess.run([sys.executable, "generic.py", *args], cwd=ROOT / "benchmarks", check=True, timeout=600,
                   capture_output=True)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert {(r["model"], r["prompt"]) for r in rows} == {
        *((m, p) for m in ("rwkv", "xlstm") for p in ("repeat", "random")),
        ("xlstm", "repeat x2"),  # RWKV: no batches
    }
    assert all(r["exact"] and r["default_speedup"] > 0 for r in rows)
    cost = tmp_path / "cost.json"
    subprocess.run([sys.executable, "verify_cost.py", "--family", "rwkv", "--layers", "2", "--hidden", "64", "--nodes",
                    "1", "4", "--repeats", "1", "--generic", "--json", str(cost)], cwd=ROOT / "benchmarks", check=True,
                   timeout=600, capture_output=True)  # fmt: skip
    rows = json.loads(cost.read_text())["rows"]  # RWKV's tree form: trees too, the chain form beside its chains
    assert [(r["nodes"], r["shape"]) for r in rows] == [(1, "chain"), (4, "chain"), (4, "tree")]
    assert all(("ratio_generic" in r) == (r["shape"] == "chain") for r in rows)


def test_model_size_benchmark_runs_and_writes_what_the_docs_read(tmp_path):
    """benchmarks/model_size.py at tiny sizes: the embedded target's default call against plain decoding (greedy
    outputs asserted HF's inside the script), a random model's cost-only point, and the fields the docs table and
    plots read (docs/hooks.py `_model_size`)."""
    out = tmp_path / "model_size.json"
    args = ["--models", "mamba2-target", "--prompts", "1", "--max-new-tokens", "8", "--repeats", "1",
            "--random-models", "2x64", "--json", str(out)]  # fmt: skip
    subprocess.run([sys.executable, "model_size.py", *args], cwd=ROOT / "benchmarks", check=True, timeout=900,
                   capture_output=True, env={**os.environ, "SSMSPEC_CACHE": "off"})  # fmt: skip
    data = json.loads(out.read_text())
    assert {"date", "revision", "command", "machine", "torch", "transformers"} <= set(data)
    target, random = data["rows"]
    assert target["model"] == "mamba2-target" and target["variant"] == "default"
    assert target["draft_head"] == "DraftHead"  # (the head saved beside the checkpoint)
    for case in ("greedy", "sampling T 0.7", "random prompts, greedy"):
        row = target[case]
        assert row["speedup"] > 0 and row["accepted_per_step"] >= 1 and 0 <= row["drafted_steps"] <= 1
    assert random["cost_only"] and random["model"] == "random mamba2 2x64"
    for r in (target, random):
        assert r["curve"]["1"] == 1.0 and r["plain_step_ms"] > 0
        assert list(r["curve"].values()) == sorted(r["curve"].values())  # (a calibration's curve never decreases)
    assert random["projected_greedy_speedup"] > 0 and "mamba2-target" in random["projected_from"]
