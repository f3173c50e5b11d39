"""Eager vs torch.compile(backend="ssmspec") on the CPU, side by side in one run: prefill, a one-token step
and a 16-node tree verification (each with its commit), for a random-init Mamba2 and a random-init hybrid
(Bamba). On CPU the tree ops keep their reference path and Inductor compiles the rest of each graph.

    python benchmarks/compile_bench.py --layers 12 --hidden 768
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _timing import median_time
from transformers import BambaConfig, BambaForCausalLM, Mamba2Config, Mamba2ForCausalLM

import ssmspec
from ssmspec.bench import write_json
from ssmspec.speculate.runner import ModelRunner
from ssmspec.tree import TokenTree


def build(kind: str, layers: int, hidden: int) -> torch.nn.Module:
    """Random-init Mamba2 or Bamba (attention every 4th layer), float32."""
    torch.manual_seed(0)
    common = dict(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers)
    if kind == "mamba2":
        cfg = Mamba2Config(**common, state_size=128, head_dim=64, num_heads=2 * hidden // 64, n_groups=1, expand=2)
        return Mamba2ForCausalLM(cfg).eval()
    cfg = BambaConfig(
        **common,
        intermediate_size=2 * hidden,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        mamba_n_heads=2 * hidden // 64,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        attn_layer_indices=list(range(3, layers, 4)),
    )
    return BambaForCausalLM(
        cfg,
    ).eval()


@torch.no_grad()
def measure(model, prompt: torch.Tensor, repeats: int) -> dict[str, float]:
    runner = ModelRunner(model)
    out = {"prefill": median_time(lambda: runner.prefill(prompt, torch.ones_like(prompt)), repeats)}
    one = TokenTree.chain(prompt[:, :1])
    g = torch.Generator().manual_seed(0)
    parents = [-1] + [int(torch.randint(max(0, t - 3), t, (1,), generator=g)) for t in range(1, 16)]
    tree = TokenTree(torch.randint(3, 1000, (1, 16), generator=g), torch.tensor([parents]))

    def step(t, last):
        def run():
            runner.verify(t)
            runner.commit(torch.tensor([last]))

        return run

    out["1-token step"] = median_time(step(one, 0), repeats)
    out["16-node verify"] = median_time(step(tree, int(tree.depth[0].argmax())), repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models", nargs="+", default=["mamba2", "bamba"])
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    prompt = torch.randint(3, 1000, (1, args.prompt))
    setup = (
        f"CPU, {torch.get_num_threads()} threads, float32, random-init {args.layers} layers, d_model {args.hidden}, "
        f"prompt {args.prompt}; medians of {args.repeats} after warm-up (compile time excluded)"
    )
    print(setup)
    rows = []
    print(f"{'model':>7} {'what':>15} {'eager ms':>9} {'compiled ms':>12} {'eager/compiled':>15}")
    for kind in args.models:
        eager = ssmspec.transform(build(kind, args.layers, args.hidden))
        compiled = ssmspec.transform(copy.deepcopy(eager))
        compiled.compile(backend="ssmspec")
        t0 = time.perf_counter()
        measure(compiled, prompt, 2)  # warm-up: compiles every shape used below
        compile_s = time.perf_counter() - t0
        e = measure(eager, prompt, args.repeats)
        c = measure(compiled, prompt, args.repeats)
        for what in e:
            print(f"{kind:>7} {what:>15} {e[what] * 1e3:>9.1f} {c[what] * 1e3:>12.1f} {e[what] / c[what]:>15.2f}")
            rows.append({"model": kind, "what": what, "eager_ms": e[what] * 1e3, "compiled_ms": c[what] * 1e3,
                         "eager_over_compiled": e[what] / c[what], "compile_and_warmup_s": compile_s})  # fmt: skip
        print(f"{kind:>7} {'(compile+warm-up s)':>15} {compile_s:>9.0f}")
    if args.json:
        write_json({"setup": setup, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
