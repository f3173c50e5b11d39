"""Verification cost curve: time(verify an N-node tree + commit) / time(one HF decode step), side by side.

`--model random`: a random-init model of `--layers` / `--hidden` (the ratio depends on shapes, not weights): a
Mamba2 (`--family mamba2`), a Bamba-style hybrid with one attention layer in six (`--family bamba`), or a Zamba v1
(`--family zamba`: one scan per Mamba head, the shared attention block every third layer);
`--model mamba2-target` or `bamba-hybrid`: an embedded trained model. Chains and random trees of N nodes
(N = 1 uses HF's own decode path, as ssmspec does); the commit keeps a path of about half the tree's depth.
Per repeat, HF's decode step on the untransformed model, ssmspec's own decode step (the transformed model's
one-node step, as plain decoding through ssmspec runs it), the verify and the commit are timed one after the
other; medians. `ratio` = (verify + commit) / HF decode, `ratio_own` = the same over ssmspec's decode step.

`--mode compiled`: HF's side is `model.compile()` and ssmspec's `model.compile(backend="ssmspec")`, both with
Inductor's C++ wrapper (the fastest compiled configuration on CPU, ssmspec.bench.COMPILE_OPTIONS); ssmspec
verifies with static shapes, as a compiled model does in `generate`. Compiling takes minutes on 2 cores.
`--generic`: the generic path (ssmspec.speculate.generic: HF's own forward with a snapshot of its cache, the
accepted prefix fed again) timed beside the seams in the same repeats, on chains (columns `generic`, `g.ratio`). A
model without seams (`--family rwkv | xlstm | minimax | zaya | recurrent_gemma`) runs the generic path only, through
its recurrence modules' tree forms (ssmspec.hf.tree_modules: chains and trees in one forward of HF's code, each node
computed after its own path; the commit writes the accepted node's state into the cache). With `--generic`, the
chain form (a snapshot of the cache, the accepted prefix carried) is timed beside it; its commit keeps half the
chain, so the next verify feeds that prefix ahead of its own chain: `generic` is timed in that steady state (the
chain plus the n // 2 + 1 tokens the previous step carried), its restore included.
`--profile`: where a step goes (torch.profiler): for HF's decode, ssmspec's decode, verify(2) and verify(8)
(+ commit), the top operations by self time and the share of the step outside them (Python and dispatch).

    python benchmarks/verify_cost.py --model random --layers 24 --hidden 768
    python benchmarks/verify_cost.py --family bamba --nodes 1 2 8 16
    python benchmarks/verify_cost.py --mode compiled --nodes 1 2 8 16
    python benchmarks/verify_cost.py --family bamba --generic --nodes 1 2 4 8 16
    python benchmarks/verify_cost.py --profile --json profile.json
    python benchmarks/verify_cost.py --model mamba2-target --json cost.json --plot docs/images/verify_cost_embedded.png
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _plot import write_outputs
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    DynamicCache,
    Mamba2Config,
    Mamba2ForCausalLM,
    MiniMaxConfig,
    MiniMaxForCausalLM,
    RecurrentGemmaConfig,
    RecurrentGemmaForCausalLM,
    RwkvConfig,
    RwkvForCausalLM,
    ZambaConfig,
    ZambaForCausalLM,
    ZayaConfig,
    ZayaForCausalLM,
    xLSTMConfig,
    xLSTMForCausalLM,
)

import ssmspec
from ssmspec import models
from ssmspec.bench import COMPILE_OPTIONS
from ssmspec.hf.generic import HFState
from ssmspec.speculate.calibration import chooses_packing, measure_cost
from ssmspec.speculate.generic import GenericRunner
from ssmspec.speculate.runner import ModelRunner, cache_kwarg
from ssmspec.tree import TokenTree

NODES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
SNAKES_AND_LADDERS = (6, 1.47)  # 6 tokens verified for 1.47x one step (GPU), ANCHORS.md
PROFILED = (("HF decode", 0), ("ssmspec decode", 1), ("verify(2) + commit", 2), ("verify(8) + commit", 8))


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


def bamba(layers: int, hidden: int, dtype: torch.dtype) -> BambaForCausalLM:
    """A random-init Bamba-style hybrid: Mamba2 mixers as `mamba2` above, every sixth layer attention (GQA,
    head dim 64), a SwiGLU MLP of 8/3 x hidden in every layer."""
    torch.manual_seed(0)
    cfg = BambaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=8 * hidden // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        attn_layer_indices=list(range(5, layers, 6)),
        mamba_n_heads=2 * hidden // 64,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_expand=2,
        mamba_chunk_size=256,
        attn_implementation="sdpa",
    )
    return BambaForCausalLM(cfg).to(dtype).eval()


def rwkv(layers: int, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init RWKV (no kernel seam: the generic path), feed-forward 4 x hidden."""
    torch.manual_seed(0)
    cfg = RwkvConfig(vocab_size=32000, hidden_size=hidden, attention_hidden_size=hidden, intermediate_size=4 * hidden,
                     num_hidden_layers=layers, context_length=4096)  # fmt: skip
    return RwkvForCausalLM(cfg).to(dtype).eval()


def zamba(layers: int, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init Zamba v1 (one selective scan per Mamba head, on a slice of the state): Mamba layers, the shared
    attention block every third layer (HF's weight tying needs two such layers: `layers` >= 6)."""
    torch.manual_seed(0)
    types = ["hybrid" if i % 3 == 2 else "mamba" for i in range(layers)]
    cfg = ZambaConfig(vocab_size=32000, hidden_size=hidden, attention_hidden_size=2 * hidden,
                      intermediate_size=3 * hidden, num_hidden_layers=layers, layers_block_type=types,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, n_mamba_heads=2,
                      mamba_d_state=16)  # fmt: skip
    return ZambaForCausalLM(cfg).to(dtype).eval()


def xlstm(layers: int, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init xLSTM (mLSTM blocks, no kernel seam: the generic path), heads of 192 (HF sizes its cache for
    q/k/v widths rounded up to 64, its blocks do not round: full-width q/k/v keep the two equal)."""
    torch.manual_seed(0)
    cfg = xLSTMConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_heads=max(1, hidden // 192),
                      qk_dim_factor=1.0, v_dim_factor=1.0,
                      chunk_size=64, autocast_kernel_dtype="float32", inference_state_dtype="float32")  # fmt: skip
    return xLSTMForCausalLM(cfg).to(dtype).eval()


def minimax(layers: int, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init MiniMax (lightning attention, softmax attention every 4th layer, 4 experts of 2 x hidden, 2
    per token; no kernel seam: the generic path), heads of 64."""
    torch.manual_seed(0)
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    cfg = MiniMaxConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64,
                        num_local_experts=4, num_experts_per_tok=2, layer_types=types,
                        attn_implementation="sdpa")  # fmt: skip
    return MiniMaxForCausalLM(cfg).to(dtype).eval()


def zaya(layers: int, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init ZAYA (compressed convolutional attention in every layer, 4 experts of 2 x hidden, 1 per token;
    no kernel seam: the generic path), heads of 64, 2 query heads per key/value head."""
    torch.manual_seed(0)
    cfg = ZayaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                     num_key_value_heads=hidden // 128, head_dim=64, moe_intermediate_size=2 * hidden, num_experts=4,
                     num_experts_per_tok=1, attn_implementation="sdpa")  # fmt: skip
    return ZayaForCausalLM(cfg).to(dtype).eval()


def recurrent_gemma(layers: int, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init RecurrentGemma (Griffin: two RG-LRU recurrent blocks, then a sliding-window attention layer of
    window 2048; no kernel seam, its state on its modules: the generic path), RG-LRU width = hidden, heads of 128,
    one key/value head, MLP 3 x hidden."""
    torch.manual_seed(0)
    cfg = RecurrentGemmaConfig(vocab_size=32000, hidden_size=hidden, lru_width=hidden, intermediate_size=6 * hidden,
                               num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=1,
                               attention_window_size=2048, block_types=("recurrent", "recurrent", "attention"),
                               attn_implementation="sdpa")  # fmt: skip
    return RecurrentGemmaForCausalLM(cfg).to(dtype).eval()


def random_tree(n: int, seed: int, vocab: int) -> TokenTree:
    """A random tree: each node hangs under one of the three nodes before it (bushy but deep)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, t - 3), t, (1,), generator=g)) for t in range(1, n)]
    return TokenTree(torch.randint(3, vocab, (1, n), generator=g), torch.tensor([parents]))


def hf_decode_step(ref: torch.nn.Module, ids: torch.Tensor):
    """Prefill an HF cache with `ids` on the untransformed model; returns one decode step as a closure (a model
    with a cache of its own, RWKV's state: as HF's generate loop drives it, ssmspec.hf.generic)."""
    if ref.config.model_type in ("rwkv", "zamba", "xlstm", "minimax", "zaya", "recurrent_gemma"):
        state = HFState(ref, ids, torch.ones_like(ids))
        state.forward()
        return lambda: state.forward(ids[:, -1:])
    kwarg = cache_kwarg(ref)
    cache = DynamicCache(config=ref.config)
    ref(ids, use_cache=True, **{kwarg: cache})
    step = ids[:, -1:]
    return lambda: ref(step, use_cache=True, **{kwarg: cache})


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    """(untransformed model, description)."""
    if args.model == "random":
        dtype = getattr(torch, args.dtype)
        build = {"mamba2": mamba2, "bamba": bamba, "rwkv": rwkv, "zamba": zamba, "xlstm": xlstm,
                 "minimax": minimax, "zaya": zaya, "recurrent_gemma": recurrent_gemma}[args.family]  # fmt: skip
        what = {"mamba2": "Mamba2", "bamba": "Bamba hybrid (attention every 6th layer)", "rwkv": "RWKV",
                "zamba": "Zamba v1 (shared attention every 3rd layer)", "xlstm": "xLSTM",
                "minimax": "MiniMax (softmax attention every 4th layer, 4 experts)",
                "zaya": "ZAYA (4 experts, 1 per token)",
                "recurrent_gemma": "RecurrentGemma (attention every 3rd layer)"}[args.family]  # fmt: skip
        return build(args.layers, args.hidden, dtype), (
            f"random-init {what}, {args.layers} layers, d_model {args.hidden}, {args.dtype}"
        )
    model, _ = models.load(args.model)
    n = sum(p.numel() for p in model.parameters())
    return model.float(), f"embedded {args.model} ({n / 1e6:.1f}M parameters), float32"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Bench:
    """The two models side by side: HF's decode step, and ssmspec's runner (decode, verify, commit)."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.set_num_threads(args.threads)
        self.ref, desc = load(args)
        self.model = ssmspec.transform(copy.deepcopy(self.ref))
        self.compiled = args.mode == "compiled"
        if self.compiled:
            self.ref.compile(options=COMPILE_OPTIONS)
            self.model.compile(backend="ssmspec", options=COMPILE_OPTIONS)
        self.vocab = self.ref.config.get_text_config().vocab_size
        self.g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, self.vocab, (1, args.prompt), generator=self.g)
        self.decode = hf_decode_step(self.ref, ids)
        depth = max(args.nodes)
        if self.model.ssmspec_info.path == "generic":  # no seams: the generic path is the only one
            self.runner = GenericRunner(self.model)
        else:
            self.runner = ModelRunner(self.model, commit=args.commit, static_shapes=self.compiled, max_depth=depth,
                                      max_nodes=depth + 1)  # fmt: skip
        self.runner.prefill(ids, torch.ones_like(ids))
        packing = ""
        if chooses_packing(self.runner) and args.packing == "measured":  # what generate does: the faster per size
            measure_cost(self.runner, sorted({1, *args.nodes}))
            packed = sorted(n for n, p in self.runner.packed_sizes.items() if p)
            packing = f", packed linears measured per size: packed at {packed or 'none'}"
        elif chooses_packing(self.runner):
            self.runner.packed_sizes = dict.fromkeys(args.nodes, args.packing == "on")
            packing = f", packed linears {args.packing}"
        self.generic = None
        # beside: the chain form (not where HF's multi-token forward is inexact: RecurrentGemma's drops its conv state)
        chains = "chains" not in self.model.ssmspec_info.limits
        if args.generic and chains and (isinstance(self.runner, ModelRunner) or self.runner.trees):
            self.generic = GenericRunner(self.model, trees=False)
            self.generic.prefill(ids, torch.ones_like(ids))
        self.root = TokenTree.chain(ids[:, -1:])
        self.desc = desc + f", CPU {torch.get_num_threads()} threads, commit={args.commit}, {args.mode}{packing}"

    def tree(self, n: int, shape: str) -> tuple[TokenTree, torch.Tensor]:
        """A chain or random tree of n nodes and the node whose path the commit keeps."""
        if shape == "chain":
            tree = TokenTree.chain(torch.randint(3, self.vocab, (1, n), generator=self.g))
        else:
            tree = random_tree(n, n, self.vocab)
        return tree, torch.tensor([int(tree.depth[0].argmax()) // 2 if n > 1 else 0])

    def own_decode(self) -> None:
        """ssmspec's decode step: a one-node tree (HF's decode path on the transformed model, nothing to commit)."""
        self.runner.verify(self.root)
        self.runner.commit(torch.tensor([0]))

    def step(self, tree: TokenTree, last: torch.Tensor, runner=None) -> tuple[float, float]:
        """(verify seconds, commit seconds) on `runner` (default: the seams'); the committed state drifts from step
        to step, costs do not."""
        runner = runner or self.runner
        t_verify = _timed(lambda: runner.verify(tree))
        return t_verify, _timed(lambda: runner.commit(last))


@torch.no_grad()
def measure(args: argparse.Namespace, bench: Bench) -> dict:
    """Run the curve; returns {"model", "mode", "rows": [{nodes, shape, decode_ms, verify_ms, commit_ms, ratio,
    own_decode_ms, ratio_own}]}."""
    print(bench.desc + f"; medians of {args.repeats}, each repeat times every side once")
    extra = f" {'generic':>8} {'g.ratio':>7}" if bench.generic else ""
    print(f"{'nodes':>5} {'shape':>6} {'HF decode':>10} {'own decode':>10} {'verify':>8} {'commit':>8} {'ratio':>6} "
          f"{'vs own':>6}{extra}   (ms)")  # fmt: skip
    rows = []
    for n in args.nodes:
        for shape in ("chain", "tree"):
            if shape == "tree" and (n < 3 or not getattr(bench.runner, "trees", True)):
                continue
            tree, last = bench.tree(n, shape)
            t0 = time.perf_counter()
            for _ in range(2):  # warm-up (compiles this bucket in compiled mode)
                bench.decode(), bench.own_decode(), bench.step(tree, last)
            warm = time.perf_counter() - t0
            generic = bench.generic if shape == "chain" else None
            dec, own, ver, com, gen = [], [], [], [], []
            for _ in range(args.repeats):
                dec.append(_timed(bench.decode))
                if isinstance(bench.runner, GenericRunner):  # a decode step after the carry is fed (untimed)
                    bench.runner.flush()
                own.append(_timed(bench.own_decode))
                if isinstance(bench.runner, GenericRunner):  # a partial commit's prefix rides the timed verify
                    bench.step(tree, last)
                v, c = bench.step(tree, last)
                ver.append(v)
                com.append(c)
                if generic is not None:
                    gen.append(sum(bench.step(tree, last, generic)))
            d, o, v, c = (statistics.median(t) * 1e3 for t in (dec, own, ver, com))
            row = {"nodes": n, "shape": shape, "decode_ms": d, "verify_ms": v, "commit_ms": c, "ratio": (v + c) / d,
                   "own_decode_ms": o, "ratio_own": (v + c) / o}  # fmt: skip
            extra = ""
            if gen:
                row["generic_ms"] = statistics.median(gen) * 1e3
                row["ratio_generic"] = row["generic_ms"] / d
                extra = f" {row['generic_ms']:>8.2f} {row['ratio_generic']:>7.2f}"
            rows.append(row)
            note = f"   (warm-up {warm:.0f} s)" if warm > 5 else ""
            print(f"{n:>5} {shape:>6} {d:>10.2f} {o:>10.2f} {v:>8.2f} {c:>8.2f} {row['ratio']:>6.2f} "
                  f"{row['ratio_own']:>6.2f}{extra}{note}", flush=True)  # fmt: skip
    return {"model": bench.desc, "mode": args.mode, "rows": rows}


@torch.no_grad()
def profile(args: argparse.Namespace, bench: Bench, steps: int = 10, top: int = 12) -> dict:
    """Where a step goes: per profiled step kind, wall time, the operations' self time (top `top`), and the share
    of the step outside any operation (Python, dispatch and waiting)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = {}
    for name, n in PROFILED:
        if n == 0:
            fn = bench.decode
        elif n == 1:
            fn = bench.own_decode
        else:
            tree, last = bench.tree(n, "chain")
            fn = lambda tree=tree, last=last: bench.step(tree, last)  # noqa: E731
        for _ in range(3):
            fn()
        wall = statistics.median(_timed(fn) for _ in range(steps)) * 1e3
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            profiled = (time.perf_counter() - t0) / steps * 1e3
        ops = [k for k in prof.key_averages() if k.self_cpu_time_total > 0]
        op_ms = sum(k.self_cpu_time_total for k in ops) / steps / 1e3
        ops.sort(key=lambda k: -k.self_cpu_time_total)
        rows = [{"op": k.key, "ms": k.self_cpu_time_total / steps / 1e3, "calls": k.count // steps} for k in ops[:top]]
        share = max(0.0, 1 - op_ms / profiled)
        out[name] = {"wall_ms": wall, "profiled_ms": profiled, "ops_ms": op_ms, "outside_ops_share": share,
                     "op_calls": sum(k.count for k in ops) // steps, "top": rows}  # fmt: skip
        print(f"\n== {name}: {wall:.2f} ms per step ({profiled:.2f} ms under the profiler), operations {op_ms:.2f} ms "
              f"in {out[name]['op_calls']} calls, outside them (Python, dispatch) {share:.0%}")  # fmt: skip
        print(f"   {'operation (self time)':<34} {'ms/step':>8} {'calls':>6}")
        for r in rows:
            print(f"   {r['op'][:34]:<34} {r['ms']:>8.2f} {r['calls']:>6}")
    return out


def plot(result: dict, path: str) -> None:
    """Ratio vs N for chains and trees, with the Snakes and Ladders anchor."""
    from _plot import line_plot

    series = {}
    for shape in ("chain", "tree"):
        rows = [r for r in result["rows"] if r["shape"] == shape]
        series[f"{shape} (verify + commit) / HF decode"] = ([r["nodes"] for r in rows], [r["ratio"] for r in rows])
    rows = [r for r in result["rows"] if r["shape"] == "chain"]
    series["chain / ssmspec decode"] = ([r["nodes"] for r in rows], [r["ratio_own"] for r in rows])
    line_plot(
        path,
        series,
        title=f"Verification cost / one decode step\n{result['model']}",
        xlabel="nodes verified (N)",
        ylabel="time ratio",
        logx=True,
        hline=1.0,
        points={"Snakes and Ladders, 6 tokens (GPU)": SNAKES_AND_LADDERS},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random", choices=["random", *models.available()])
    p.add_argument(
        "--family",
        default="mamba2",
        choices=["mamba2", "bamba", "rwkv", "zamba", "xlstm", "minimax", "zaya", "recurrent_gemma"],
        help="the random model's family (rwkv, xlstm, minimax, zaya, recurrent_gemma: no seams, the generic path; "
        "zamba: Zamba v1, per-head scans)",
    )
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--nodes", type=int, nargs="+", default=NODES)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--commit", default="replay", choices=["replay", "materialize"])
    p.add_argument("--mode", default="eager", choices=["eager", "compiled"])
    p.add_argument("--generic", action="store_true", help="time the generic path (HF's forward) beside the seams")
    p.add_argument("--profile", action="store_true", help="profile decode, verify(2) and verify(8) instead")
    p.add_argument("--packing", choices=["measured", "on", "off"], default="measured",
                   help="eager CPU: the linears on oneDNN's packed weights or F.linear per tree size as generate "
                   "measures it (default), or always / never packed")  # fmt: skip
    p.add_argument("--json", help="write the rows (or the profile) to this file")
    p.add_argument("--plot", help="write a PNG of the curve (needs matplotlib)")
    args = p.parse_args()
    if args.profile:
        args.nodes = [8]
    bench = Bench(args)
    if args.profile:
        result = {"model": bench.desc, "mode": args.mode, "profile": profile(args, bench)}
        write_outputs(result, args.json, None, plot)
        return
    result = measure(args, bench)
    write_outputs(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
