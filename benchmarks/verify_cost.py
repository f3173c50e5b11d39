"""Verification cost curve: time(verify an N-node tree + commit) / time(one HF decode step), side by side.

`--model random`: a random-init Mamba2 of `--layers`/`--hidden` (the ratio depends on shapes, not weights);
`--model mamba2-target` or `bamba-hybrid`: an embedded trained model. Chains and random trees of N nodes
(N = 1 uses HF's own decode path, as ssmspec does); the commit keeps a path of about half the tree's depth.
HF decode and verify + commit are timed alternately; medians. Prints one line per (N, shape).

    python benchmarks/verify_cost.py --model random --layers 24 --hidden 768
    python benchmarks/verify_cost.py --model mamba2-target --json cost.json --plot docs/images/verify_cost_embedded.png
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from _plot import write_outputs
from _timing import median_time
from transformers import DynamicCache, Mamba2Config, Mamba2ForCausalLM

import ssmspec
from ssmspec import models
from ssmspec.speculate.runner import ModelRunner, cache_kwarg
from ssmspec.tree import TokenTree

NODES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
SNAKES_AND_LADDERS = (6, 1.47)  # 6 tokens verified for 1.47x one step (GPU), ANCHORS.md


def mamba2(layers: int, hidden: int, dtype: torch.dtype) -> Mamba2ForCausalLM:
    """A random-init Mamba2 of the given depth and width (head_dim 64, state 128, expand 2)."""
    torch.manual_seed(0)
    cfg = Mamba2Config(
        vocab_size=32000,
        hidden_size=hidden,
        num_hidden_layers=layers,
        state_size=128,
        head_dim=64,
        num_heads=2 * hidden // 64,
        n_groups=1,
        expand=2,
        chunk_size=256,
    )
    return Mamba2ForCausalLM(cfg).to(dtype).eval()


def random_tree(n: int, seed: int, vocab: int) -> TokenTree:
    """A random tree: each node hangs under one of the three nodes before it (bushy but deep)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, t - 3), t, (1,), generator=g)) for t in range(1, n)]
    return TokenTree(torch.randint(3, vocab, (1, n), generator=g), torch.tensor([parents]))


def hf_decode_step(ref: torch.nn.Module, ids: torch.Tensor):
    """Prefill an HF cache with `ids` on the untransformed model; returns one decode step as a closure."""
    kwarg = cache_kwarg(ref)
    cache = DynamicCache(config=ref.config)
    ref(ids, use_cache=True, **{kwarg: cache})
    step = ids[:, -1:]
    return lambda: ref(step, use_cache=True, **{kwarg: cache})


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    """(untransformed model, description)."""
    if args.model == "random":
        dtype = getattr(torch, args.dtype)
        return mamba2(args.layers, args.hidden, dtype), (
            f"random-init Mamba2, {args.layers} layers, d_model {args.hidden}, {args.dtype}"
        )
    model, _ = models.load(args.model)
    n = sum(p.numel() for p in model.parameters())
    return model.float(), f"embedded {args.model} ({n / 1e6:.1f}M parameters), float32"


@torch.no_grad()
def measure(args: argparse.Namespace) -> dict:
    """Run the curve; returns {"model", "rows": [{nodes, shape, decode_ms, verify_ms, ratio}]}."""
    torch.set_num_threads(args.threads)
    ref, desc = load(args)
    model = ssmspec.transform(copy.deepcopy(ref))
    vocab = ref.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (1, args.prompt), generator=g)
    decode = hf_decode_step(ref, ids)
    runner = ModelRunner(model, commit=args.commit)
    runner.prefill(ids, torch.ones_like(ids))
    desc += f", CPU {torch.get_num_threads()} threads, commit={args.commit}"
    print(desc + f"; medians of {args.repeats}, decode and verify + commit timed alternately")
    print(f"{'nodes':>5} {'shape':>6} {'HF decode ms':>13} {'verify+commit ms':>17} {'ratio':>6}")
    decode()
    rows = []
    for n in args.nodes:
        for shape in ("chain", "tree"):
            if shape == "tree" and n < 3:
                continue
            if shape == "chain":
                tree = TokenTree.chain(torch.randint(3, vocab, (1, n), generator=g))
            else:
                tree = random_tree(n, n, vocab)
            last = torch.tensor([int(tree.depth[0].argmax()) // 2 if n > 1 else 0])

            def verify() -> None:  # the committed state drifts from step to step; costs do not depend on it
                runner.verify(tree)
                runner.commit(last)

            verify()
            t_dec, t_ver = [], []
            for _ in range(args.repeats):
                t_dec.append(median_time(decode, 1))
                t_ver.append(median_time(verify, 1))
            d, v = statistics.median(t_dec), statistics.median(t_ver)
            rows.append({"nodes": n, "shape": shape, "decode_ms": d * 1e3, "verify_ms": v * 1e3, "ratio": v / d})
            print(f"{n:>5} {shape:>6} {d * 1e3:>13.2f} {v * 1e3:>17.2f} {v / d:>6.2f}")
    return {"model": desc, "rows": rows}


def plot(result: dict, path: str) -> None:
    """Ratio vs N for chains and trees, with the Snakes and Ladders anchor."""
    from _plot import line_plot

    series = {}
    for shape in ("chain", "tree"):
        rows = [r for r in result["rows"] if r["shape"] == shape]
        series[f"{shape} (verify + commit)"] = ([r["nodes"] for r in rows], [r["ratio"] for r in rows])
    line_plot(
        path,
        series,
        title=f"Verification cost / one HF decode step\n{result['model']}",
        xlabel="nodes verified (N)",
        ylabel="time ratio",
        logx=True,
        hline=1.0,
        points={"Snakes and Ladders, 6 tokens (GPU)": SNAKES_AND_LADDERS},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random", choices=["random", *models.available()])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--nodes", type=int, nargs="+", default=NODES)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--commit", default="replay", choices=["replay", "materialize"])
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--plot", help="write a PNG of the curve (needs matplotlib)")
    args = p.parse_args()
    result = measure(args)
    write_outputs(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
