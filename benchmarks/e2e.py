"""End-to-end tokens/s on the embedded target over held-out real code (see ssmspec/bench.py), side by side:
HF greedy, ssmspec autoregressive, chain n-gram, chain draft model, tree n-gram; outputs asserted identical.

    python benchmarks/e2e.py --prompts 8 --max-new-tokens 128 [--json out.json]     # = ssmspec bench
"""

from __future__ import annotations

import argparse

import torch

from ssmspec.bench import add_arguments, report, run


def main() -> None:
    args = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args()
    torch.set_num_threads(2)
    report(run(args), args)


if __name__ == "__main__":
    main()
