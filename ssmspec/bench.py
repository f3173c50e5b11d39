"""End-to-end benchmark behind `ssmspec bench` and benchmarks/e2e.py: tokens/s on the embedded target over
held-out real code, side by side in one run — HF generate greedy, ssmspec autoregressive (no drafts), chain
speculation (n-gram; draft model), tree speculation (n-gram). Every output is asserted identical to HF
greedy. With `--sampling`, also speculative sampling against HF's sampling at each temperature. Prompts: the
first tokens of each held-out standard-library file (left out of training).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import ssmspec
from ssmspec import models
from ssmspec.models import corpus_files


def held_out_prompts(tok, count: int, prompt_tokens: int) -> list[torch.Tensor]:
    """The first `prompt_tokens` tokens of each held-out file (deterministic order)."""
    _, held = corpus_files()
    prompts = []
    for path in held:
        ids = tok(path.read_text(encoding="utf-8", errors="replace"), return_tensors="pt")["input_ids"]
        if ids.shape[1] >= prompt_tokens:
            prompts.append(ids[:, :prompt_tokens])
        if len(prompts) == count:
            break
    return prompts


def run(args: argparse.Namespace, progress: bool = True) -> dict:
    ref, tok = models.load("mamba2-target")
    target = ssmspec.transform(copy.deepcopy(ref))
    draft, _ = models.load("mamba2-draft")
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens)
    methods = {
        "ssmspec autoregressive": dict(speculation=ssmspec.SpecConfig(drafter="none")),
        "chain n-gram": dict(speculation=ssmspec.SpecConfig(num_draft_tokens=args.draft_tokens)),
        "chain draft model": dict(assistant_model=draft, num_assistant_tokens=min(args.draft_tokens, 4)),
        "tree n-gram": dict(
            speculation=ssmspec.SpecConfig(num_draft_tokens=args.draft_tokens, tree=True, tree_budget=args.tree_budget)
        ),  # fmt: skip
        "tree n-gram adaptive": dict(
            speculation=ssmspec.SpecConfig(
                num_draft_tokens=args.draft_tokens, tree=True, tree_budget=args.tree_budget, adaptive=True
            )
        ),  # fmt: skip
    }
    # warm-up: first calls pay one-time costs (allocator, lazy imports) that must not land on one method
    ref.generate(prompts[0], max_new_tokens=8, do_sample=False)
    for kw in methods.values():
        target.generate(prompts[0], max_new_tokens=8, **kw)
    totals = {"HF greedy": 0.0, **dict.fromkeys(methods, 0.0)}
    accepted = {m: [] for m in methods}
    tokens = 0
    for i, ids in enumerate(tqdm(prompts, desc="prompts", disable=not progress)):
        t0 = time.perf_counter()
        want = ref.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        totals["HF greedy"] += time.perf_counter() - t0
        tokens += want.shape[1] - ids.shape[1]
        for name, kw in methods.items():
            t0 = time.perf_counter()
            out = target.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True, **kw)
            totals[name] += time.perf_counter() - t0
            if not torch.equal(out.sequences, want):
                raise AssertionError(f"{name}: output differs from HF greedy on prompt {i}")
            accepted[name].append(out.spec_stats["mean_accepted_per_step"])
    setup = (f"embedded mamba2-target, CPU {torch.get_num_threads()} threads, float32, {len(prompts)} held-out "
             f"prompts x {args.max_new_tokens} new tokens, {tokens} generated tokens; "
             "all outputs identical to HF greedy")  # fmt: skip
    result = {"setup": setup, "tokens": tokens, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "methods": {}}  # fmt: skip
    for name, secs in totals.items():
        row = {"tokens_per_s": tokens / secs, "speedup_vs_hf": totals["HF greedy"] / secs}
        if name in accepted:
            row["mean_accepted_per_step"] = sum(accepted[name]) / len(accepted[name])
            row["speedup_vs_ssmspec_ar"] = totals["ssmspec autoregressive"] / secs
        result["methods"][name] = row
    return result


def run_sampling(args: argparse.Namespace, progress: bool = True) -> dict:
    """Speculative sampling side by side with HF's sampling, per temperature: tokens/s, speed-up and accepted
    tokens per step for chain / tree x n-gram / draft model. Outputs are random, so they are not compared
    here (tests/speculate/test_sampling.py proves the distributions equal); every method samples with HF's
    default warpers (top-k 50) at the same temperature and seeds."""
    ref, tok = models.load("mamba2-target")
    target = ssmspec.transform(copy.deepcopy(ref))
    draft, _ = models.load("mamba2-draft")
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens)
    k, budget = args.draft_tokens, args.tree_budget
    methods = {
        "chain n-gram": dict(speculation=ssmspec.SpecConfig(num_draft_tokens=k)),
        "tree n-gram": dict(speculation=ssmspec.SpecConfig(num_draft_tokens=k, tree=True, tree_budget=budget)),
        "tree n-gram adaptive": dict(
            speculation=ssmspec.SpecConfig(num_draft_tokens=k, tree=True, tree_budget=budget, adaptive=True)
        ),
        "chain draft model": dict(
            assistant_model=draft, speculation=ssmspec.SpecConfig(drafter="draft_model", num_draft_tokens=4)
        ),
        "tree draft model": dict(
            assistant_model=draft,
            speculation=ssmspec.SpecConfig(drafter="draft_model", num_draft_tokens=4, tree=True, tree_budget=12),
        ),
    }  # fmt: skip
    ref.generate(prompts[0], max_new_tokens=8, do_sample=True)
    for kw in methods.values():
        target.generate(prompts[0], max_new_tokens=8, do_sample=True, **kw)
    result = {"setup": f"embedded mamba2-target, CPU {torch.get_num_threads()} threads, float32, {len(prompts)} "
              f"held-out prompts x {args.max_new_tokens} new tokens, do_sample=True (top-k 50), seeded",
              "temperatures": {}}  # fmt: skip
    for temperature in args.temperatures:
        secs = {"HF sampling": 0.0, **dict.fromkeys(methods, 0.0)}
        made = dict.fromkeys(secs, 0)
        accepted = {m: [] for m in methods}
        for i, ids in enumerate(tqdm(prompts, desc=f"T={temperature}", disable=not progress)):
            torch.manual_seed(i)
            t0 = time.perf_counter()
            out = ref.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=temperature)
            secs["HF sampling"] += time.perf_counter() - t0
            made["HF sampling"] += out.shape[1] - ids.shape[1]
            for name, kw in methods.items():
                gen = torch.Generator().manual_seed(i)
                t0 = time.perf_counter()
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=temperature,
                                      generator=gen, return_dict_in_generate=True, **kw)  # fmt: skip
                secs[name] += time.perf_counter() - t0
                made[name] += out.sequences.shape[1] - ids.shape[1]
                accepted[name].append(out.spec_stats["mean_accepted_per_step"])
        base = made["HF sampling"] / secs["HF sampling"]
        rows = {}
        for name in secs:
            rate = made[name] / secs[name]
            rows[name] = {"tokens_per_s": rate, "speedup_vs_hf": rate / base}
            if name in accepted:
                rows[name]["mean_accepted_per_step"] = sum(accepted[name]) / len(accepted[name])
        result["temperatures"][str(temperature)] = rows
    result["rows"] = [{"temperature": t, "method": name, **row} for t, rows in result["temperatures"].items()
                      for name, row in rows.items()]  # fmt: skip
    return result


def report_sampling(result: dict) -> None:
    """Print the sampling tables."""
    print(result["setup"])
    for temperature, rows in result["temperatures"].items():
        print(f"temperature {temperature}")
        print(f"{'method':>24} {'tok/s':>8} {'vs HF':>6} {'accepted/step':>14}")
        for name, row in rows.items():
            print(f"{name:>24} {row['tokens_per_s']:>8.1f} {row['speedup_vs_hf']:>6.2f} "
                  f"{row.get('mean_accepted_per_step', float('nan')):>14.2f}")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options (shared by the script and the `ssmspec bench` command)."""
    p.add_argument("--prompts", type=int, default=12, help="held-out files to use (12: all of them)")
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=8)
    p.add_argument("--tree-budget", type=int, default=16)
    p.add_argument("--sampling", action="store_true", help="also benchmark speculative sampling vs HF sampling")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    p.add_argument("--json", help="also write the results to this file (JSON)")
    return p


def report(result: dict, args: argparse.Namespace) -> None:
    """Print the table; write JSON when asked."""
    print(result["setup"])
    print(f"{'method':>24} {'tok/s':>8} {'vs HF':>6} {'vs AR':>6} {'accepted/step':>14}")
    for name, row in result["methods"].items():
        print(f"{name:>24} {row['tokens_per_s']:>8.1f} {row['speedup_vs_hf']:>6.2f} "
              f"{row.get('speedup_vs_ssmspec_ar', float('nan')):>6.2f} "
              f"{row.get('mean_accepted_per_step', float('nan')):>14.2f}")  # fmt: skip
    if "sampling" in result:
        report_sampling(result["sampling"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
