"""Speculative sampling, measured and proven, written for the docs:

- speed: speculative sampling (chain / tree x n-gram / draft model) against HF's sampling at each temperature
  on the embedded target over the held-out prompts (ssmspec.bench.run_sampling) -> docs/data/sampling.json;
- distribution: the chi-square matrix of tests/speculate/test_sampling.py (ssmspec.testing.distribution) with
  more samples -> docs/data/sampling_tests.json.

    python benchmarks/sampling.py [--samples 20000] [--prompts 12 --max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

import ssmspec
from ssmspec.bench import add_arguments, report_sampling, run_sampling, write_json
from ssmspec.testing.distribution import (
    DRAFTS,
    WARPS,
    case_kwargs,
    sampling_p_value,
    tiny_sampling_head,
    tiny_sampling_setup,
)

DATA = Path(__file__).resolve().parent.parent / "docs" / "data"


def distribution_tests(samples: int) -> dict:
    """p-values (and acceptance) of every case of the distribution-test matrix."""
    target, draft, prompt = tiny_sampling_setup()
    # (the draft-head cases draft with a head trained briefly for the target, as the test suite's do)
    model = ssmspec.transform(copy.deepcopy(target), draft_head=tiny_sampling_head(target))
    rows = []
    for drafter in DRAFTS:
        for warp in WARPS:
            t0 = time.perf_counter()
            p, stats = sampling_p_value(target, model, prompt, samples=samples, **case_kwargs(drafter, warp, draft))
            rows.append({"drafter": drafter, "warpers": warp, "samples_per_side": samples, "p_value": p,
                         "accepted_per_row_step": stats["accepted_tokens"] / max(stats["row_steps"], 1),
                         "seconds": time.perf_counter() - t0})  # fmt: skip
            print(rows[-1], flush=True)
    setup = (f"tiny float64 Mamba2 (16-token vocabulary), joint of the first 3 sampled tokens, two-sample "
             f"chi-square vs HF generate(do_sample=True), {samples} samples per side; pass: p > 1e-3")  # fmt: skip
    return {"setup": setup, "rows": rows}


def main() -> None:
    p = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--samples", type=int, default=20000, help="samples per side for the distribution tests")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-tests", action="store_true")
    args = p.parse_args()
    if args.batch or args.device != "cpu":
        p.error("--batch and --device: batched throughput is `ssmspec bench --batch`")
    torch.set_num_threads(2)
    if not args.skip_tests:
        write_json(distribution_tests(args.samples), DATA / "sampling_tests.json")
    if not args.skip_speed:
        result = run_sampling(args)
        report_sampling(result)
        write_json(result, DATA / "sampling.json")


if __name__ == "__main__":
    main()
