"""Tree vs chain speculation at equal node budget, on the embedded target over held-out real code.

For each budget B: chain n-gram with B drafted nodes vs tree n-gram with at most B drafted nodes (depth up
to B), plus ssmspec autoregressive decoding as the baseline; every output asserted identical to HF greedy.
Prints tokens/s, speed-up over autoregressive and accepted tokens per step, side by side in one run.

    python benchmarks/tree_vs_chain.py --budgets 2 4 8 16 32 --recycle 4 --json tvc.json \
        --plot docs/images/tree_vs_chain.png
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _plot import write_outputs

import ssmspec
from ssmspec import models
from ssmspec.bench import held_out_prompts

STREE = {"chain": 1.34, "tree": 1.45}  # STree's speed-ups over autoregressive, 8B hybrid, RTX 3090 (ANCHORS.md)


@torch.no_grad()
def measure(args: argparse.Namespace) -> dict:
    """Run every (budget, shape); returns {"setup", "autoregressive_tok_s", "rows"}."""
    torch.set_num_threads(args.threads)
    ref, tok = models.load("mamba2-target")
    target = ssmspec.transform(copy.deepcopy(ref))
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens)
    want = [ref.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False) for ids in prompts]
    tokens = sum(w.shape[1] - p.shape[1] for w, p in zip(want, prompts))
    configs = {("autoregressive", 0): ssmspec.SpecConfig(drafter="none")}
    for b in args.budgets:
        configs[("chain", b)] = ssmspec.SpecConfig(drafter="prompt_lookup", num_draft_tokens=b)
        configs[("tree", b)] = ssmspec.SpecConfig(drafter="prompt_lookup", num_draft_tokens=b, tree=True, tree_budget=b)
        if args.recycle:  # token recycling: the target's own top-k successors beside the n-gram votes
            configs[("chain + recycling", b)] = ssmspec.SpecConfig(
                drafter="prompt_lookup", num_draft_tokens=b, recycle=args.recycle
            )
            configs[("tree + recycling", b)] = ssmspec.SpecConfig(
                drafter="prompt_lookup", num_draft_tokens=b, tree=True, tree_budget=b, recycle=args.recycle
            )
    for spec in configs.values():  # warm-up: one-time costs must not land on the first method timed
        ssmspec.calibrate(target, prompts[0], max_new_tokens=8, speculation=spec)
    secs = dict.fromkeys(configs, 0.0)
    acc = {k: [] for k in configs}
    for _ in range(args.rounds):  # rounds interleave the methods, so drifts of the machine hit all alike
        for key, spec in configs.items():
            for ids, w in zip(prompts, want):
                t0 = time.perf_counter()
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, speculation=spec,
                                      return_dict_in_generate=True)  # fmt: skip
                secs[key] += time.perf_counter() - t0
                if not torch.equal(out.sequences, w):
                    raise AssertionError(f"{key}: output differs from HF greedy")
                acc[key].append(out.spec_stats["mean_accepted_per_step"])
    ar = secs[("autoregressive", 0)]
    rows = []
    for (shape, b), s in secs.items():
        rows.append({"shape": shape, "budget": b, "tokens_per_s": tokens * args.rounds / s, "speedup_vs_ar": ar / s,
                     "mean_accepted_per_step": sum(acc[(shape, b)]) / len(acc[(shape, b)])})  # fmt: skip
    setup = (f"embedded mamba2-target, float32, CPU {torch.get_num_threads()} threads, {len(prompts)} held-out "
             f"prompts x {args.max_new_tokens} tokens, {args.rounds} rounds")  # fmt: skip
    return {"setup": setup, "autoregressive_tok_s": tokens * args.rounds / ar, "rows": rows}


def report(result: dict) -> None:
    print(result["setup"] + "; outputs identical to HF greedy")
    print(f"autoregressive: {result['autoregressive_tok_s']:.1f} tok/s")
    print(f"{'budget':>6} {'chain tok/s':>12} {'x AR':>5} {'acc/step':>8}   {'tree tok/s':>11} {'x AR':>5} "
          f"{'acc/step':>8}  {'tree/chain':>10}")  # fmt: skip
    by = {(r["shape"], r["budget"]): r for r in result["rows"]}
    for suffix in ("", " + recycling"):
        if not any(r["shape"] == "chain" + suffix for r in result["rows"]):
            continue
        if suffix:
            print("with token recycling:")
        for b in sorted({r["budget"] for r in result["rows"] if r["budget"]}):
            c, t = by[("chain" + suffix, b)], by[("tree" + suffix, b)]
            print(f"{b:>6} {c['tokens_per_s']:>12.1f} {c['speedup_vs_ar']:>5.2f} {c['mean_accepted_per_step']:>8.2f}   "
                  f"{t['tokens_per_s']:>11.1f} {t['speedup_vs_ar']:>5.2f} {t['mean_accepted_per_step']:>8.2f}  "
                  f"{t['tokens_per_s'] / c['tokens_per_s']:>10.2f}")  # fmt: skip


def plot(result: dict, path: str) -> None:
    from _plot import line_plot

    series = {}
    for shape in ("chain", "tree", "chain + recycling", "tree + recycling"):
        rows = [r for r in result["rows"] if r["shape"] == shape]
        if rows:
            series[f"{shape} (n-gram)"] = ([r["budget"] for r in rows], [r["speedup_vs_ar"] for r in rows])
    line_plot(
        path,
        series,
        title=f"Speed-up over autoregressive at equal node budget\n{result['setup']}",
        xlabel="drafted nodes per step (budget)",
        ylabel="speed-up vs ssmspec autoregressive",
        logx=True,
        hline=1.0,
        # STree reports one speed-up per method, at no stated node budget: levels, not points at a budget
        levels={f"STree {k}, 8B hybrid on a GPU (budget not reported)": v for k, v in STREE.items()},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--recycle", type=int, default=0, help="also chains and trees with token recycling (top-k kept)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    result = measure(args)
    report(result)
    write_outputs(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
