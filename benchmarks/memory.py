"""Memory over a long batched run, side by side: HF's greedy generate, ssmspec's plain decoding and ssmspec's default
call each generate `--tokens` tokens per row for a batch of different held-out prompts (no EOS: every row runs the
whole length), each in a process of its own (resident memory is per process), `--rounds` times taking turns (a
process's growth depends on what its allocator holds free: it varies by several MiB from one process to the next).
Reported per run:
the growth of the peak resident set (Linux VmHWM, reset just before the call) over the resident set before the call,
after a short warm-up call of the same kind, its median over the rounds compared; the default call also reports its
largest verify step's buffers.

    python benchmarks/memory.py --model bamba-hybrid --batch 8 --tokens 6000 --json docs/data/memory.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

RUNS = ("hf", "plain", "default")


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(args: argparse.Namespace) -> dict:
    """One run in this process: warm up, then the long call, its peak resident growth measured."""
    import torch

    import ssmspec
    from ssmspec import models
    from ssmspec.bench import batch_prompts

    ref, tok = models.load(args.model)
    ids = torch.stack(batch_prompts(tok, args.batch, args.prompt_tokens))
    mask = torch.ones_like(ids)
    if args.run == "hf":
        model, kw = ref, {"do_sample": False}
    else:
        model = ssmspec.transform(copy.deepcopy(ref))
        kw = {"speculation": ssmspec.SpecConfig(drafter="none")} if args.run == "plain" else {}
    warm = ssmspec.calibrate if args.run != "hf" else lambda m, i, **k: m.generate(i, **k)
    warm(model, ids, attention_mask=mask, max_new_tokens=64, eos_token_id=None, **kw)  # one-time costs
    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak resident set (VmHWM) to the current one
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, eos_token_id=None,
                         return_dict_in_generate=True, **kw)  # fmt: skip
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    stats = getattr(out, "spec_stats", None) or {}
    return {"run": args.run, "seconds": seconds, "tokens_per_row": out.sequences.shape[1] - ids.shape[1],
            "rss_before_mib": before / 2**20, "peak_growth_mib": (peak - before) / 2**20,
            "max_verify_bytes": stats.get("max_verify_bytes"),
            "mean_accepted_per_step": stats.get("mean_accepted_per_step")}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bamba-hybrid", help="an embedded model (ssmspec.models)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3, help="processes per run, taking turns")
    p.add_argument("--run", choices=RUNS, help="(one run in this process: what the driver starts)")
    p.add_argument("--json")
    args = p.parse_args()
    if args.run:
        print(json.dumps(one(args)))
        return
    rounds: dict[str, list[dict]] = {run: [] for run in RUNS}
    for _ in range(args.rounds):
        for run in RUNS:
            cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch), "--tokens",
                   str(args.tokens), "--prompt-tokens", str(args.prompt_tokens), "--run", run]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            rounds[run].append(r)
            print(f"{run:>8}: {r['seconds']:.1f} s, peak resident growth {r['peak_growth_mib']:+.1f} MiB "
                  f"(resident before {r['rss_before_mib']:.0f} MiB)", flush=True)  # fmt: skip
    rows = {}
    for run, rs in rounds.items():
        growth = sorted(r["peak_growth_mib"] for r in rs)
        median = sorted(rs, key=lambda r: r["peak_growth_mib"])[len(rs) // 2]
        rows[run] = {"run": run, "seconds": median["seconds"], "peak_growth_mib": median["peak_growth_mib"],
                     "least_mib": growth[0], "most_mib": growth[-1], "rss_before_mib": median["rss_before_mib"],
                     "max_verify_bytes": median["max_verify_bytes"]}  # fmt: skip
    plain, spec = rows["hf"]["peak_growth_mib"], rows["default"]["peak_growth_mib"]
    bound = 1.25 * plain + 10
    print(f"medians: default / HF plain: {spec / max(plain, 1e-9):.2f}x ({spec:+.1f} against {plain:+.1f} MiB; the "
          f"bound 1.25x + 10 MiB is {bound:.1f} MiB: {'within' if spec <= bound else 'OVER'})")  # fmt: skip
    if args.json:
        from ssmspec.bench import provenance, write_json

        result = {"setup": f"embedded {args.model}, float32, CPU, batch {args.batch} of different held-out prompts x "
                  f"{args.prompt_tokens} tokens, {args.tokens} new tokens per row, no EOS; peak resident growth "
                  "(VmHWM reset before the call) over the resident set before it, after a warm-up call",
                  **provenance(f"python benchmarks/memory.py --model {args.model} --batch {args.batch} "
                               f"--tokens {args.tokens} --rounds {args.rounds}"), "rows": list(rows.values()),
                  "bound_mib": bound}  # fmt: skip
        write_json(result, args.json)


if __name__ == "__main__":
    main()
