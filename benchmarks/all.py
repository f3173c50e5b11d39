"""Regenerate the docs' data: every file in docs/data/, the command that writes it and the revision it must be
newer than (its cut-off: the last change to what it measures). The docs build reads this table and fails on a
data file without provenance, and shows, on the page, a file measured on code older than its cut-off.

    python benchmarks/all.py --list             # every file: recorded revision, cut-off, fresh or stale
    python benchmarks/all.py                    # rerun every stale file this machine can measure, in order
    python benchmarks/all.py --only e2e batched # rerun these (fresh or not)

The files are measured one after another, never beside each other: they time side by side in one process and
need the machine to themselves. A file that needs a CUDA GPU is skipped on a machine without one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"

# the keys every data file records of how it was measured (ssmspec.bench.provenance writes them): the docs build fails
# on a file that lacks one
PROVENANCE = ("date", "machine", "torch", "transformers", "revision", "command")

# cut-offs: the last commit that changed what a group of files measures
LOOP = "2c6ed4e"  # the speculative call (drafter auto: a head of up to 15% of the model, its tree fused with n-grams,
# which a greedy step asks first and verifies alone where they reach its depth; a plain step asks the drafter nothing;
# the prefill runs the LM head on the last prompt position unless the drafter reads more)
# the speculative call at a batch: its drafted steps priced first with the overhead the last call at that batch size
# measured, and the batched benchmark's repeats run in alternating order (the files that time calls at a batch)
BATCHED = "92e5950"
VERIFY = "27d6b4b"  # the runner's verify step (one capture and bucket lookup per step)
SAMPLING = "9306ed9"  # what a sampled call draws: the drafters' distributions and the acceptance
TRACED = "113270f"  # the captured CUDA step and the GPU benchmark's sections
# what `transform(model, compile=True)` runs on a CPU: its steps compiled whole, their float32 products of 5 to 32 rows,
# and of a weight of 2^19 elements or more from one row, in ssmspec's C++ kernel (8 sums in flight, reduced 4 at a time;
# built beside the first steps' compilation) and the others of 2 to 4 fused one-row products, each small verify step one
# OpenMP region (sums over nodes, running cumsums, the tree SSD node-major), each step's C++ wrapper built at -O1 apart
# from its kernels, its intermediates pooled (Inductor's memory planning) and its near-tie check fused, the wrapper's
# kernel-only buffers raw pointers into those pools, attention K/V written in place, a draft head's next chain drafted
# in the greedy step's own graph (the chains it did not draft compiled apart), chains refilled in place, a step that
# drafted nothing a plain step's replay, and the default call's policy on those steps, which prices a step at its
# bucket's forward, holds a priced depth for a few steps and judges drafts against the loop's plain steps, a lone row's
# acceptance pulled once toward its prior, the step overhead and how far apart its pricings had grown carried from call
# to call, its plain runs lasting until a shadow draft is due and paid for, and the warm-up's steps compiled side by
# side in worker processes (the files that time those calls and the warm-up; `ssmspec bench --compiled` times the
# forward compiled by Dynamo, without the kernel); the drafter the default takes there (a head of up to 15% of the
# model: the 3M target's own head chains); and how llama.cpp is timed beside them (llama-bench once a round, its fastest
# kept)
COMPILED_CPU = "2c6ed4e"
# each cut-off's commit date: what a checkout without the history (a shallow clone) compares a file's date with
DATES = {LOOP: "2026-12-04", BATCHED: "2026-12-04", VERIFY: "2026-11-28", SAMPLING: "2026-11-28",
         TRACED: "2026-11-23", COMPILED_CPU: "2026-12-04"}  # fmt: skip


@dataclass(frozen=True)
class DataFile:
    """One file in docs/data: the command that writes it, its cut-off revision, and what it needs to run."""

    command: str
    cutoff: str
    why: str
    needs: str = "cpu"  # "cuda": a CUDA GPU; "llama.cpp": a llama.cpp build (benchmarks/llamacpp.py --work)


def _bench(name: str, options: str, cutoff: str = LOOP) -> DataFile:
    return DataFile(f"ssmspec bench {options} --json docs/data/{name}.json", cutoff, "the speculative call")


def _verify(name: str, options: str, cutoff: str = VERIFY) -> DataFile:
    return DataFile(f"python benchmarks/verify_cost.py {options} --json docs/data/{name}.json", cutoff,
                    "the verify step's cost")  # fmt: skip


_DEFAULTS = '--methods "HF greedy" "ssmspec default" "ssmspec default without a draft head" "ssmspec autoregressive"'
_E2E = "python benchmarks/e2e.py --prompts 12 --max-new-tokens 128 --repeats 1 --compiled"

FILES: dict[str, DataFile] = {
    "e2e": DataFile(f"{_E2E} --json docs/data/e2e.json", LOOP, "every drafter's call"),
    "e2e_third_party": DataFile(
        f"{_E2E} --prompt-set third-party --json docs/data/e2e_third_party.json", LOOP, "every drafter's call"
    ),  # fmt: skip
    "e2e_defaults": _bench(
        "e2e_defaults",
        '--sampling --temperatures 0.7 1.0 --methods "HF greedy" "ssmspec default" "ssmspec default without a draft '
        'head" "ssmspec autoregressive" "tree draft head + n-gram" "chain n-gram" "tree n-gram adaptive" "ssmspec '
        'default, draft model"',
    ),
    "e2e_compiled_default": _bench(
        "e2e_compiled_default",
        '--compiled --repeats 2 --methods "HF greedy" "HF greedy (compiled)" "HF greedy (compiled, C++ wrapper)" '
        '"ssmspec default" "ssmspec autoregressive" "ssmspec default (compiled)" "ssmspec autoregressive (compiled)" '
        '"tree n-gram + corpus (8 nodes, compiled)"',
    ),
    "e2e_prose": _bench("e2e_prose", f"--prompt-set prose --prompts 8 --repeats 2 {_DEFAULTS}"),
    "e2e_random": _bench("e2e_random", f"--prompt-set random --prompts 8 --repeats 2 {_DEFAULTS}"),
    "e2e_third_party_default": _bench("e2e_third_party_default", f"--prompt-set third-party --repeats 2 {_DEFAULTS}"),
    "batched": _bench("batched", "--batch 1 4 8 16 32 --repeats 3", BATCHED),
    "batched_prose": _bench("batched_prose", "--batch 1 4 8 16 32 --prompt-set prose --repeats 2", BATCHED),
    "batched_compiled": _bench("batched_compiled", "--batch 1 4 8 16 32 --compiled --repeats 2", BATCHED),
    "sampling": DataFile("python benchmarks/sampling.py --skip-tests", LOOP, "the sampled call"),
    "sampling_tests": DataFile(
        "python benchmarks/sampling.py --skip-speed --samples 5000", SAMPLING, "the sampled distribution"
    ),
    "tree_vs_chain": DataFile(
        "python benchmarks/tree_vs_chain.py --budgets 2 4 8 16 32 --recycle 4 --rounds 2 "
        "--json docs/data/tree_vs_chain.json",
        LOOP,
        "trees against chains",
    ),  # fmt: skip
    "generic": DataFile("python benchmarks/generic.py --json docs/data/generic.json", LOOP, "the generic path"),
    "first_call": DataFile(
        "python benchmarks/first_call.py --batch 1 16 --tokens 128 --json docs/data/first_call.json",
        BATCHED,
        "a first call",
    ),  # fmt: skip
    "memory": DataFile(
        "python benchmarks/memory.py --model bamba-hybrid --batch 8 --tokens 6000 --rounds 3 --json "
        "docs/data/memory.json",
        BATCHED,
        "a long call's memory",
    ),  # fmt: skip
    "model_size": DataFile(
        "python benchmarks/model_size.py --json docs/data/model_size.json", LOOP, "the default by model size"
    ),
    "mtp": DataFile("python benchmarks/mtp.py", LOOP, "MTP drafting"),
    "compile_bench": DataFile(
        "python benchmarks/compile_bench.py --json docs/data/compile_bench.json", VERIFY, "the compiled verify step"
    ),  # fmt: skip
    "compiled_step": DataFile(
        "python benchmarks/compiled_step.py --json docs/data/compiled_step.json", COMPILED_CPU, "the compiled step"
    ),  # fmt: skip
    "llamacpp": DataFile(
        "python benchmarks/llamacpp.py --prompts 4 --rounds 3 --work /tmp/llama --cold-start --json "
        "docs/data/llamacpp.json",
        COMPILED_CPU,
        "llama.cpp beside ssmspec",
        "llama.cpp",
    ),  # fmt: skip
    "llamacpp_medium": DataFile(
        "python benchmarks/llamacpp.py --models nemotron-medium --work /tmp/llama --json "
        "docs/data/llamacpp_medium.json",
        COMPILED_CPU,
        "llama.cpp beside ssmspec",
        "llama.cpp",
    ),  # fmt: skip
    "verify_cost_embedded": _verify("verify_cost_embedded", "--model mamba2-target"),
    "verify_cost_mamba2_24x768": _verify("verify_cost_mamba2_24x768", "--nodes 1 2 3 4 6 8 12 16 24 32"),
    "verify_cost_materialize": _verify("verify_cost_materialize", "--commit materialize --nodes 1 6 16"),
    "verify_cost_compiled_24x768": _verify("verify_cost_compiled_24x768", "--mode compiled --nodes 1 2 8 16"),
    "verify_cost_bamba_24x768": _verify("verify_cost_bamba_24x768", "--family bamba --nodes 1 2 4 8 16"),
    "verify_cost_zamba_12x768": _verify("verify_cost_zamba_12x768", "--family zamba --layers 12"),
    "verify_cost_rwkv_12x768": _verify(
        "verify_cost_rwkv_12x768", "--family rwkv --layers 12 --nodes 1 2 4 8 16 --generic"
    ),
    "verify_cost_xlstm_12x768": _verify(
        "verify_cost_xlstm_12x768", "--family xlstm --layers 12 --nodes 1 2 4 8 16 --generic"
    ),
    "verify_cost_minimax_12x768": _verify(
        "verify_cost_minimax_12x768", "--family minimax --layers 12 --nodes 1 2 4 8 16 --generic"
    ),
    "verify_cost_zaya_12x768": _verify(
        "verify_cost_zaya_12x768", "--family zaya --layers 12 --nodes 1 2 4 8 16 --generic"
    ),
    "verify_cost_recurrent_gemma_12x768": _verify(
        "verify_cost_recurrent_gemma_12x768", "--family recurrent_gemma --layers 12 --nodes 1 2 4 8 16"
    ),  # fmt: skip
    "families": DataFile("bash scripts/docs-data.sh", LOOP, "the property suites' per-family report"),
    "gpu": DataFile("python benchmarks/gpu.py --json docs/data/gpu.json", TRACED, "the GPU", "cuda"),
    "gpu_quick": DataFile(
        "python benchmarks/gpu.py --sections quick --json docs/data/gpu_quick.json", TRACED, "the GPU", "cuda"
    ),
    "batched_gpu": DataFile(
        "ssmspec bench --batch 1 4 8 16 32 --device cuda --repeats 2 --json docs/data/batched_gpu.json",
        LOOP,
        "batches on a GPU",
        "cuda",
    ),  # fmt: skip
}


def recorded(name: str) -> dict:
    """The provenance docs/data/NAME.json records ({} for none); families.json keeps it under "_provenance"."""
    data = json.loads((DATA / f"{name}.json").read_text())
    data = data.get("_provenance", data) if isinstance(data, dict) else {}
    return {k: data[k] for k in PROVENANCE if data.get(k)}


def missing(name: str) -> list[str]:
    """The provenance keys docs/data/NAME.json lacks."""
    return [k for k in PROVENANCE if k not in recorded(name)]


def includes(revision: str, cutoff: str, *, root: Path = ROOT) -> bool | None:
    """Whether code at `revision` includes commit `cutoff` (git ancestry); None where git cannot tell."""
    base = revision.split("+", 1)[0]
    try:
        done = subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor", cutoff, base],
                              capture_output=True, text=True)  # fmt: skip
    except OSError:
        return None
    return {0: True, 1: False}.get(done.returncode)


def older_than_cutoff(name: str, found: dict) -> bool:
    """Whether docs/data/NAME.json, of provenance `found`, was measured on code without its cut-off commit (git
    ancestry; where the history is not at hand, its date before the cut-off's)."""
    cutoff = FILES[name].cutoff
    included = includes(str(found.get("revision", "")), cutoff)
    if included is None:  # (no history: the cut-off's recorded date)
        included = str(found.get("date", "")) >= DATES[cutoff]
    return not included


def stale(name: str) -> bool:
    """Whether docs/data/NAME.json lacks provenance or was measured on code older than its cut-off."""
    return bool(missing(name)) or older_than_cutoff(name, recorded(name))


def can_run(entry: DataFile) -> bool:
    """Whether this machine can measure the file (a CUDA GPU, a llama.cpp build where needed)."""
    if entry.needs == "cuda":
        import torch

        return torch.cuda.is_available()
    if entry.needs == "llama.cpp":  # (a build benchmarks/llamacpp.py made under its --work folder, /tmp/llama)
        return any(Path("/tmp/llama").glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-bench"))
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list every file, its provenance and cut-off, and stop")
    p.add_argument("--only", nargs="+", choices=sorted(FILES), help="rerun these files (fresh or not)")
    args = p.parse_args()
    unknown = sorted({path.stem for path in DATA.glob("*.json")} - set(FILES))
    if unknown:
        sys.exit(f"docs/data has files benchmarks/all.py does not list: {', '.join(unknown)}")
    if args.list:
        for name, entry in FILES.items():
            found = recorded(name)
            state = "stale" if stale(name) else "fresh"
            print(f"{name:36} {state:6} {found.get('revision', '-'):>20} cut-off {entry.cutoff} ({entry.why})")
        return
    names = args.only or [name for name in FILES if stale(name)]
    for name in names:
        entry = FILES[name]
        if not can_run(entry):
            print(f"skip {name}: needs {entry.needs}", flush=True)
            continue
        print(f"== {name}: {entry.command}", flush=True)
        start = time.perf_counter()
        subprocess.run(entry.command, shell=True, cwd=ROOT, check=True)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
