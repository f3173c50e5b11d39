"""Memory over a long batched run: the embedded target generates `--tokens` tokens per row for a batch of different
held-out prompts with ssmspec's default call; the process's resident memory is sampled every step (a streamer), and
the growth after the warm-up (`--warmup` tokens per row) is reported with the largest verify step's buffers.

    python benchmarks/memory.py --batch 8 --tokens 10000 --json ../docs/data/memory.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

import ssmspec
from ssmspec import models
from ssmspec.bench import batch_prompts

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """The process's resident set (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class MemorySampler(BaseStreamer):
    """Samples resident memory whenever generate hands out tokens (once per step), with the tokens per row so far."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int]] = []
        self.columns = -1  # the first put is the prompt

    def put(self, value) -> None:
        self.columns += 1 if value.dim() == 1 or value.shape[-1] == 1 else value.shape[-1]
        self.samples.append((self.columns, resident_bytes()))

    def end(self) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=10000)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--json")
    args = p.parse_args()
    ref, tok = models.load("mamba2-target")
    target = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.stack(batch_prompts(tok, args.batch, args.prompt_tokens))
    ssmspec.calibrate(target, ids, max_new_tokens=16)  # one-time costs: the calibration, allocator pools
    sampler = MemorySampler()
    t0 = time.perf_counter()
    # no EOS: every row runs the whole length (the embedded model would end some rows early)
    out = target.generate(ids, max_new_tokens=args.tokens, eos_token_id=None, streamer=sampler,
                          return_dict_in_generate=True)  # fmt: skip
    seconds = time.perf_counter() - t0
    after = [rss for col, rss in sampler.samples if col >= args.warmup]
    at_warmup = after[0]
    result = {
        "setup": f"embedded mamba2-target, CPU {torch.get_num_threads()} threads, float32, batch {args.batch} of "
        f"different held-out prompts x {args.prompt_tokens} tokens, {args.tokens} new tokens per row, ssmspec's "
        "default call; resident memory sampled every step",
        "tokens_per_row": out.sequences.shape[1] - ids.shape[1],
        "seconds": seconds,
        "rss_at_warmup_mib": at_warmup / 2**20,
        "rss_max_after_warmup_mib": max(after) / 2**20,
        "rss_end_mib": after[-1] / 2**20,
        "growth_after_warmup": max(after) / at_warmup - 1,
        "max_verify_bytes": out.spec_stats["max_verify_bytes"],
        "mean_accepted_per_step": out.spec_stats["mean_accepted_per_step"],
        "samples": [(c, round(r / 2**20, 1)) for c, r in sampler.samples[:: max(1, len(sampler.samples) // 200)]],
    }
    print(f"{result['setup']}\n{result['tokens_per_row']} tokens per row in {seconds:.0f} s; resident memory "
          f"{result['rss_at_warmup_mib']:.0f} MiB after {args.warmup} tokens, at most "
          f"{result['rss_max_after_warmup_mib']:.0f} MiB after ({100 * result['growth_after_warmup']:+.1f}%); the "
          f"largest verify step held {result['max_verify_bytes'] / 2**20:.2f} MiB of buffers")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
