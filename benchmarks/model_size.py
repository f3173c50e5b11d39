"""Speculation against model size: the default call (`model.generate(ids)`, nothing tuned) over ssmspec's own plain
decoding (`SpecConfig(drafter="none")`, the fastest plain decoder a user has) on the embedded 3M target and the
20M Nemotron-H (whose float32 weights are over twice this CPU's last-level cache: its step reads them from memory),
greedy and sampled, with the tokens accepted per step and the verify cost curve (verify(k) / a plain step, as the
model's calibration measured it) that explain each point; plus cost-only points for random-init 130M-class models
(no acceptance to measure: their curve, and the speed-up a step accepting what the medium model's default accepted
would give at that curve, drafting not counted: a bound).

Side by side in one process: per prompt, HF greedy once (the reference), then the plain and the default call
alternated, each the best of `--repeats`; greedy outputs asserted identical to HF's. Sampled calls draw with the
same seed per prompt on both sides (speculative sampling is lossless in distribution, not in its draws: the
outputs are not compared; tests/speculate/test_sampling.py proves the distributions equal). Random-token prompts
measure what the default costs where drafts are never accepted. Every model is calibrated first
(`ssmspec.calibrate`), as a server would at start-up.

    python benchmarks/model_size.py --json docs/data/model_size.json --plot docs/images/model_size.png
    python benchmarks/model_size.py --models mamba2-target --prompts 2 --max-new-tokens 16 --random-models  # smoke
"""

from __future__ import annotations

import argparse
import copy

import torch
from _plot import _pyplot, _title, write_outputs
from _timing import provenance

import ssmspec
from ssmspec import models
from ssmspec.bench import best_time, held_out_prompts
from ssmspec.hf import mtp as hf_mtp

PLAIN = ssmspec.SpecConfig(drafter="none")
CURVE_SIZES = (1, 2, 4, 8, 16, 32)


def _mamba2(layers: int, hidden: int) -> torch.nn.Module:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(hidden_size=hidden, num_hidden_layers=layers, state_size=128, head_dim=64,
                          num_heads=2 * hidden // 64, n_groups=1, expand=2, chunk_size=64, vocab_size=50280,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    return Mamba2ForCausalLM(config).float().eval()


def calibrated_curve(model, ids: torch.Tensor) -> dict:
    """Complete the model's calibration for batch-1 calls of up to 32 drafted nodes and read it: {"curve": {k:
    verify(k) / plain step}, "plain_step_ms"}."""
    spec = ssmspec.SpecConfig(drafter="prompt_lookup", tree=True, tree_budget=32, num_draft_tokens=16)
    ssmspec.calibrate(model, ids, max_new_tokens=4, speculation=spec)
    calibration = ssmspec.calibration_of(model, batch=1, device="cpu")
    curve = calibration.curve()
    return {"curve": {k: round(curve[k], 3) for k in CURVE_SIZES if k in curve},
            "plain_step_ms": round(1e3 * calibration.decode_seconds(), 3)}  # fmt: skip


def measure(name: str, args, mtp: bool = False) -> dict:
    """One embedded model's point: greedy, sampled and random-prompt speed-ups of the default call over plain
    decoding (totals over the prompts), accepted tokens per step, its drafter, and its cost curve. `mtp`: the model
    drafting with the MTP layer its checkpoint ships instead of the draft head saved beside it (both measured)."""
    ref, tok = models.load(name)
    model = copy.deepcopy(ref)
    head = hf_mtp.build(model, hf_mtp.read_mtp(models.path(name))) if mtp else "auto"
    model = ssmspec.transform(model, draft_head=head)
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens)
    noise = held_out_prompts(tok, args.prompts, args.prompt_tokens, "random")
    n = args.max_new_tokens
    params = sum(p.numel() for p in ref.parameters())
    head = model.__dict__.get("ssmspec_draft_head")  # what transform found beside the checkpoint (or its MTP layer)
    row = {"model": name, "variant": "MTP layer" if mtp else "default", "params": params,
           "weight_mib_fp32": round(4 * params / 2**20, 1),
           "draft_head": type(head).__name__ if head is not None else None,
           **calibrated_curve(model, prompts[0])}  # fmt: skip
    model.generate(prompts[0], max_new_tokens=8)  # warm-up: allocator, lazy imports, the head's first call
    model.generate(prompts[0], max_new_tokens=8, speculation=PLAIN)
    cases = [("greedy", prompts, {"do_sample": False})]
    cases += [(f"sampling T {t}", prompts, {"do_sample": True, "temperature": t, "top_p": 0.95})
              for t in args.temperatures]  # fmt: skip
    cases += [("random prompts, greedy", noise, {"do_sample": False})] if args.random_prompts else []
    for case, ids_list, kw in cases:
        secs, made = {"plain": 0.0, "default": 0.0}, {"plain": 0, "default": 0}
        accepted, drafted = [], []
        worst = float("inf")
        for i, ids in enumerate(ids_list):
            want = ref.generate(ids, max_new_tokens=n, **kw) if not kw["do_sample"] else None
            best, tokens = {"plain": float("inf"), "default": float("inf")}, {}
            for _ in range(args.repeats):
                for side, extra in (("plain", {"speculation": PLAIN}), ("default", {})):
                    gen = torch.Generator().manual_seed(i) if kw["do_sample"] else None
                    seconds, out = best_time(
                        lambda: model.generate(
                            ids, max_new_tokens=n, generator=gen, return_dict_in_generate=True, **kw, **extra
                        ),
                        1,
                    )
                    best[side] = min(best[side], seconds)
                    if want is not None and not torch.equal(out.sequences, want):
                        raise AssertionError(f"{name}, {case}, prompt {i}: the {side} call differs from HF greedy")
                    tokens[side] = out.sequences.shape[1] - ids.shape[1]  # (a seed draws the same each repeat)
                    if side == "default":
                        accepted.append(out.spec_stats["mean_accepted_per_step"])
                        drafted += out.spec_stats["tree_nodes_per_step"]
            rate = {side: tokens[side] / best[side] for side in best}
            worst = min(worst, rate["default"] / rate["plain"])
            for side in secs:
                secs[side] += best[side]
                made[side] += tokens[side]
        rate = {side: made[side] / secs[side] for side in secs}
        drafting = [k for k in drafted if k > 1]  # steps that verified drafts (the others decoded plainly)
        row[case] = {"speedup": round(rate["default"] / rate["plain"], 3), "worst_prompt": round(worst, 3),
                     "plain_tokens_per_s": round(rate["plain"], 1),
                     "accepted_per_step": round(sum(accepted) / len(accepted), 2),
                     "drafted_steps": round(len(drafting) / max(len(drafted), 1), 3),
                     "nodes_per_drafted_step": round(sum(drafting) / max(len(drafting), 1), 1)}  # fmt: skip
        print(f"{name}: {case}: {row[case]}", flush=True)
    return row


def cost_only(label: str, build, reference: dict | None) -> dict:
    """A random-init model's cost curve, and the speed-up a step accepting what `reference` (the medium model's
    greedy default) accepted would give at that curve: tokens per step / the cost of the nodes it verified."""
    ref = build()
    model = ssmspec.transform(ref)
    ids = torch.randint(3, ref.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    row = {"model": label, "params": sum(p.numel() for p in ref.parameters()), "cost_only": True,
           **calibrated_curve(model, ids)}  # fmt: skip
    row["weight_mib_fp32"] = round(4 * row["params"] / 2**20, 1)
    if reference is not None:  # an upper bound: drafting and the host's bookkeeping are not counted
        greedy = reference["greedy"]
        tokens, nodes = greedy["accepted_per_step"], greedy["nodes_per_drafted_step"]
        bucket = min((k for k in row["curve"] if k >= nodes), default=max(row["curve"]))  # (a step pads to it)
        row["projected_greedy_speedup"] = round(tokens / row["curve"][bucket], 3)
        row["projected_from"] = (f"{reference['model']}'s {tokens} tokens a step from trees of {nodes} nodes, at "
                                 f"this model's verify({bucket}); drafting not counted: a bound")  # fmt: skip
    print(f"{label}: {row}", flush=True)
    return row


def plot(result: dict, path: str) -> None:
    """Left: the default's speed-up over plain decoding against parameters; right: each model's cost curve."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.0), dpi=200)
    trained = [r for r in result["rows"] if r.get("variant") == "default"]
    cases = [c for c in trained[0] if isinstance(trained[0][c], dict) and "speedup" in trained[0][c]]
    for i, case in enumerate(cases):
        left.plot([r["params"] for r in trained], [r[case]["speedup"] for r in trained], marker="o", label=case,
                  color=f"C{i}")  # fmt: skip
    projected = [r for r in result["rows"] if "projected_greedy_speedup" in r]
    if projected:
        left.plot([r["params"] for r in projected], [r["projected_greedy_speedup"] for r in projected], marker="x",
                  linestyle="none", markersize=9, color="C0", label="greedy, bound from the cost curve")  # fmt: skip
    left.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    left.set_xscale("log")
    left.set_xlabel("parameters")
    left.set_ylabel("default call / ssmspec plain decoding")
    left.set_title("speed-up over the fastest plain decoder", fontsize=9)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    for r in result["rows"]:
        if r.get("variant") == "MTP layer":
            continue  # (the same model's curve)
        ks = sorted(int(k) for k in r["curve"])
        right.plot(ks, [r["curve"][k] if k in r["curve"] else r["curve"][str(k)] for k in ks], marker="o",
                   label=f"{r['model']} ({r['params'] / 1e6:.0f}M, {r['plain_step_ms']:.1f} ms plain)")  # fmt: skip
    right.set_xscale("log", base=2)
    right.set_xlabel("nodes verified (k)")
    right.set_ylabel("verify(k) / plain step")
    right.set_title("verify cost curve (calibration)", fontsize=9)
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.suptitle(_title(result["setup"]), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mamba2-target", "nemotron-medium"], choices=models.NAMES)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--temperatures", type=float, nargs="*", default=[0.7])
    p.add_argument("--no-random-prompts", dest="random_prompts", action="store_false")
    p.add_argument(
        "--random-models",
        nargs="*",
        default=["24x768"],
        metavar="LAYERSxHIDDEN",
        help="cost-only points: random-init Mamba2s (24x768: the layout of released 130M checkpoints)",
    )
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    torch.set_num_threads(2)
    rows = []
    for name in args.models:
        rows.append(measure(name, args))
        if rows[-1]["draft_head"] == "DraftHead" and hf_mtp.read_mtp(models.path(name)):  # a head and an MTP layer
            rows.append(measure(name, args, mtp=True))
    medium = next((r for r in rows if r["model"] == "nemotron-medium"), rows[-1])
    for shape in args.random_models:
        layers, hidden = (int(v) for v in shape.split("x"))
        rows.append(cost_only(f"random mamba2 {shape}", lambda: _mamba2(layers, hidden), medium))  # noqa: B023
    setup = (f"2 threads, float32, batch 1, {args.prompts} held-out prompts x {args.max_new_tokens} new tokens, "
             f"best of {args.repeats}; greedy outputs identical to HF's")  # fmt: skip
    result = {"setup": setup, **provenance("python benchmarks/model_size.py"), "rows": rows}
    write_outputs(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
