"""Where a compiled step's time goes on a CPU, side by side in one run: the embedded target's plain decoding and its
verify steps after `ssmspec.transform(model, compile=True)` (each step captured and compiled whole) against the same
model compiled by Dynamo (`model.compile(backend="ssmspec")`, the compiled forward ssmspec used before captured
steps), on held-out prompts. Reported: tokens/s of plain decoding through `generate` (all outputs compared with HF
greedy); the captured plain step's compiled function called in a loop (the step alone) and replayed (its outputs
copied out); what the loop spends per token beside the replay; the eager prefill per call; and per tree size, the
greedy step (verified, accepted and committed in one graph, one read) and the verify step with its commit that a
sampled call takes, each in greedy plain steps as plain decoding takes them (one replay and one read).

    python benchmarks/compiled_step.py --json docs/data/compiled_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _timing import provenance

import ssmspec
from ssmspec import models
from ssmspec.bench import held_out_prompts, write_json
from ssmspec.compile import graphs
from ssmspec.speculate.runner import ModelRunner
from ssmspec.tree import TokenTree


def per_token(model, prompts, wants, new: int, spec) -> tuple[float, int]:
    """Seconds per generated token over the prompts, and how many outputs equal HF's."""
    seconds, tokens, same = 0.0, 0, 0
    for p, want in zip(prompts, wants):
        t0 = time.perf_counter()
        out = model.generate(p, max_new_tokens=new, speculation=spec)
        seconds += time.perf_counter() - t0
        tokens += out.shape[1] - p.shape[1]
        same += int(torch.equal(out, want))
    return seconds / tokens, same


def best_ms(fn, calls: int = 50, rounds: int = 15) -> float:
    """The median over `rounds` of the mean milliseconds of `calls` calls of fn."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(2)
    ref, tok = models.load("mamba2-target")
    ref.eval()
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens)
    new = args.max_new_tokens
    with torch.no_grad():
        wants = [ref.generate(q, max_new_tokens=new, do_sample=False) for q in prompts]
    plain = ssmspec.SpecConfig(drafter="none")
    dynamo = ssmspec.transform(models.load("mamba2-target")[0].eval(),
                               compile={"options": {"cpp_wrapper": True}, "progress": False})  # fmt: skip
    captured = ssmspec.transform(models.load("mamba2-target")[0].eval(), compile={"progress": False})
    rates: dict[str, list[float]] = {"dynamo": [], "captured": []}
    same = {"dynamo": 0, "captured": 0}
    replay_share: list[float] = []
    original = graphs.StepGraph.replay
    spent = [0.0]

    def timed_replay(self):
        t0 = time.perf_counter()
        out = original(self)
        spent[0] += time.perf_counter() - t0
        return out

    for _ in range(args.rounds):
        for name, model in (("dynamo", dynamo), ("captured", captured)):
            spent[0] = 0.0
            graphs.StepGraph.replay = timed_replay
            try:
                seconds, ok = per_token(model, prompts, wants, new, plain)
            finally:
                graphs.StepGraph.replay = original
            rates[name].append(seconds)
            same[name] += ok
            if name == "captured":
                replay_share.append(spent[0] / (seconds * new * len(prompts)))
    # the captured plain step alone, and the verify steps of the default call's buckets, on a runner of the model
    runner = ModelRunner(captured, static_shapes=True, max_depth=8, max_nodes=17, graphs=True, capacity=256)
    with torch.no_grad():
        runner.prefill(prompts[0], torch.ones_like(prompts[0]))
        root = TokenTree.chain(prompts[0][:, -1:])
        runner.verify(root)
        runner.commit(torch.zeros(1, dtype=torch.long))
        step = runner.captured[(1, 1)].graph
        bare = best_ms(lambda: step.compiled(*step.inputs))
        replay = best_ms(step.replay)
        prefill = statistics.median(
            [best_ms(lambda: runner.prefill(prompts[0], torch.ones_like(prompts[0])), calls=1, rounds=1)
             for _ in range(5)]
        )  # fmt: skip
        timed = {}  # (kind, n) -> the step's function, rolled back after each call
        for n in (1, 2, 4, 8, 16):
            tree = runner.prepare(TokenTree.chain(prompts[0][:, -n:]))
            snap = runner.snapshot()

            def verify_commit(tree=tree, snap=snap):
                runner.verify(tree)
                runner.commit(torch.zeros(1, dtype=torch.long))
                runner.restore(snap)

            def plain(tree=tree, snap=snap):  # a greedy plain step as plain decoding runs it: a replay, one read
                runner.decode(tree.tokens[:, 0]).tolist()
                runner.restore(snap)

            def greedy(tree=tree, snap=snap):  # a greedy step of a drafted tree: one replay (accept, commit), one read
                runner.verify_greedy(tree)
                runner.restore(snap)

            verify_commit()  # (captures and compiles this bucket where the warm-up did not)
            timed[("verify", n)] = plain if n == 1 else verify_commit
            if n > 1:
                greedy()
                timed[("greedy", n)] = greedy
        timed[("restore", 0)] = lambda: runner.restore(snap)
        # every step timed in turn, round after round (a burst of the machine's load falls on all sizes alike), each
        # round a mean over 10 calls; the median of the rounds
        rounds: dict[tuple, list[float]] = {key: [] for key in timed}
        for _ in range(15):
            for key, fn in timed.items():
                rounds[key].append(best_ms(fn, calls=10, rounds=1))
        ms = {key: statistics.median(v) for key, v in rounds.items()}
        restore = ms[("restore", 0)]
        costs = {n: ms[("verify", n)] for n in (1, 2, 4, 8, 16)}
        greedy_costs = {n: ms[("greedy", n)] for n in (2, 4, 8, 16)}
    compiler = captured.__dict__["_ssmspec_step_compiler"]
    result = {
        "setup": f"embedded mamba2-target, CPU, 2 threads, float32, batch 1, {len(prompts)} held-out prompts x "
        f"{args.prompt_tokens} tokens, {new} new tokens, plain decoding (SpecConfig(drafter='none')), {args.rounds} "
        "rounds alternating the two compiled models; step timings: medians of 15 rounds, each step timed in turn "
        "(a mean over 10 calls each)",
        **provenance("python benchmarks/compiled_step.py " + " ".join(sys.argv[1:])),
        "plain_tokens_per_s": {
            "dynamo": 1 / statistics.median(rates["dynamo"]),
            "captured": 1 / statistics.median(rates["captured"]),
        },
        "identical": {k: f"{v}/{len(prompts) * args.rounds}" for k, v in same.items()},
        "captured_over_dynamo": statistics.median(rates["dynamo"]) / statistics.median(rates["captured"]),
        "generate_ms_per_token": statistics.median(rates["captured"]) * 1e3,
        "replay_share_of_generate": statistics.median(replay_share),
        "plain_step_compiled_ms": bare,
        "plain_step_replay_ms": replay,
        "prefill_ms": prefill,
        "verify_commit_over_plain": {str(n): (c - restore) / (costs[1] - restore) for n, c in costs.items()},
        "greedy_step_over_plain": {str(n): (c - restore) / (costs[1] - restore) for n, c in greedy_costs.items()},
        "graphs_compiled": compiler.compilations,
        "compile_seconds": compiler.compile_seconds,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
