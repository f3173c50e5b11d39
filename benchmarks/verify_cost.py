"""Verification cost curve: time(verify an N-node tree + commit) / time(one HF decode step), side by side.

Random-init model (the ratio depends on shapes, not weights). Chains and random trees of N nodes; the
commit keeps a path of about half the tree's depth. Prints one line per N and the ratio to a decode step.

    python benchmarks/verify_cost.py --layers 24 --hidden 768 --nodes 1 6 16 64
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _timing import median_time
from transformers import DynamicCache, Mamba2Config, Mamba2ForCausalLM

import ssmspec
from ssmspec.speculate.runner import ModelRunner
from ssmspec.tree import TokenTree


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


def random_tree(n: int, seed: int) -> TokenTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, t - 3), t, (1,), generator=g)) for t in range(1, n)]
    return TokenTree(torch.randint(3, 1000, (1, n), generator=g), torch.tensor([parents]))


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--commit", default="replay", choices=["replay", "materialize"])
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    ref = mamba2(args.layers, args.hidden, dtype)
    model = ssmspec.transform(mamba2(args.layers, args.hidden, dtype))
    ids = torch.randint(3, 1000, (1, args.prompt))

    hf_cache = DynamicCache(config=ref.config)
    ref(ids, cache_params=hf_cache, use_cache=True)
    step = ids[:, -1:]

    def decode() -> None:
        ref(step, cache_params=hf_cache, use_cache=True)

    runner = ModelRunner(model, strategy=args.commit)
    runner.prefill(ids, torch.ones_like(ids))
    print(
        f"Mamba2 random-init, {args.layers} layers, d_model {args.hidden}, {args.dtype}, CPU "
        f"{torch.get_num_threads()} threads, commit={args.commit}; medians of {args.repeats}, "
        "decode and verify timed alternately"
    )
    print(f"{'nodes':>5} {'shape':>6} {'HF decode ms':>13} {'verify+commit ms':>17} {'ratio':>6}")
    decode()
    for n in args.nodes:
        for shape in ("chain", "tree"):
            if shape == "tree" and n < 3:
                continue
            tree = TokenTree.chain(torch.randint(3, 1000, (1, n))) if shape == "chain" else random_tree(n, n)
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
            print(f"{n:>5} {shape:>6} {d * 1e3:>13.1f} {v * 1e3:>17.1f} {v / d:>6.2f}")


if __name__ == "__main__":
    main()
