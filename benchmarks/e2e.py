"""End-to-end tokens/s on the embedded target over real code (see ssmspec/bench.py), side by side:
HF greedy, ssmspec autoregressive, n-gram chains and trees (with and without a retrieval corpus), draft-model chains,
dynamic trees, VocabTrim and RASD; outputs asserted identical. --prompt-set third-party: installed packages' sources;
prose / random: text where drafts rarely pay.
With --sampling, speculative sampling (chain/tree x n-gram/draft model) vs HF sampling at each temperature.

    python benchmarks/e2e.py --prompts 12 --max-new-tokens 128 [--json out.json] [--plot e2e.png]   # = ssmspec bench
"""

from __future__ import annotations

import argparse

import torch

from ssmspec.bench import add_arguments, refuse_unused_options, report, report_batched, run, run_batched, run_sampling


def main() -> None:
    p = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--plot", help="write a bar chart of the speed-ups over HF greedy (PNG, needs matplotlib)")
    args = p.parse_args()
    try:
        refuse_unused_options(args)
    except ValueError as exc:
        p.error(str(exc))
    torch.set_num_threads(2)
    if args.batch:  # batched throughput, as `ssmspec bench --batch`
        report_batched(run_batched(args), args)
        return
    result = run(args)
    if args.sampling:
        result["sampling"] = run_sampling(args)
    report(result, args)
    if args.plot:
        plot(result, args.plot)


def plot(result: dict, path: str) -> None:
    """Bar chart of each method's speed-up over HF greedy."""
    from _plot import bar_plot

    bar_plot(
        path,
        {name: row["speedup_vs_hf"] for name, row in result["methods"].items()},
        title="End-to-end tokens/s relative to HF generate (greedy)\n" + result["setup"].split(";")[0],
        ylabel="speed-up vs HF greedy",
        hline=1.0,
    )


if __name__ == "__main__":
    main()
