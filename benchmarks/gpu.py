"""The GPU benchmark: one command, bounded to ~8 minutes on an H100, everything measured side by side in one
run, printed as ratios and written to docs/data/gpu.json (`--smoke`: tiny shapes on CPU, the Triton
interpreter, to check the script itself; writes nothing unless --json is given).

1. tree SSD kernel vs its reference op, vs unrolling every root-to-leaf path (one chain SSD per leaf), vs N
   single-token state updates (HF's selective_state_update seam; mamba-ssm's kernel when installed);
2. verify(N) / decode for N = 1, 6, 16, 64 on a 1.3B-class random-init Mamba2 (48 layers, d_model 2048) in
   bf16: eager, and compiled with backend="ssmspec" against HF's decode compiled with torch.compile;
   verification under CUDA graphs is not supported yet: "graphs" stays empty;
3. end to end on the embedded target and bamba-hybrid (float32, held-out prompts): HF greedy eager and
   compiled, ssmspec autoregressive eager and compiled, chain and tree n-gram and retrieval-tree speculation
   compiled; outputs compared with HF greedy and near-ties counted; `speedup_vs_best_ar` divides by the
   fastest plain decoder (HF or ssmspec, eager or compiled).

    python benchmarks/gpu.py                       # on an H100/H200 -> docs/data/gpu.json
    python benchmarks/gpu.py --smoke --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from _timing import median_time  # noqa: E402
from transformers import Mamba2Config, Mamba2ForCausalLM  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update  # noqa: E402
from verify_cost import hf_decode_step  # noqa: E402

import ssmspec  # noqa: E402
from ssmspec import kernels as K  # noqa: E402
from ssmspec import models  # noqa: E402
from ssmspec.bench import held_out_prompts, training_index  # noqa: E402
from ssmspec.ops._common import reference_impl  # noqa: E402
from ssmspec.speculate.runner import ModelRunner  # noqa: E402
from ssmspec.tree import TokenTree  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def random_tree(n: int, branching: int, device: str, seed: int = 0) -> TokenTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, t - branching), t, (1,), generator=g)) for t in range(1, n)]
    return TokenTree(torch.zeros(1, n, dtype=torch.long, device=device), torch.tensor([parents], device=device))


def kernel_section(
    device: str, dtype: torch.dtype, heads: int, p: int, s: int, nodes: list[int], repeats: int
) -> list[dict]:
    print(f"\n1. tree SSD: {heads} heads x {p} head dim, state {s}, {dtype}, batch 1")
    print(f"{'nodes':>5} {'kernel ms':>10} {'reference ms':>13} {'unrolled paths ms':>18} {'N single-token ms':>18} "
          f"{'x reference':>12} {'x unrolled':>11} {'x single':>9}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in nodes:
        tree = random_tree(n, 3, device)
        x = torch.randn(1, n, heads, p, generator=g).to(device, dtype)
        dt = torch.randn(1, n, heads, generator=g).to(device, dtype)
        A = (-torch.rand(heads, generator=g) - 0.5).to(device, torch.float32)
        Bm = torch.randn(1, n, 1, s, generator=g).to(device, dtype)
        Cm = torch.randn(1, n, 1, s, generator=g).to(device, dtype)
        D, bias = torch.ones(heads, device=device), torch.zeros(heads, device=device)
        h0 = torch.randn(1, heads, p, s, generator=g).to(device, torch.float32)
        anc = tree.ancestor_mask

        def kernel():
            K.tree_ssd(x, dt, A, Bm, Cm, D, bias, h0, anc, True, 0.0, float("inf"), False)

        def reference():
            reference_impl("ssmspec::tree_ssd")(x, dt, A, Bm, Cm, D, bias, h0, anc, True, 0.0, float("inf"), False)

        leaves = [t for t in range(n) if t not in set(tree.parents[0].tolist())]
        paths = [tree.paths(torch.tensor([leaf], device=device))[0] for leaf in leaves]

        def unrolled():  # one chain SSD per root-to-leaf path
            for path in paths:
                m = path.shape[1]
                chain = TokenTree.chain(torch.zeros(1, m, dtype=torch.long, device=device))
                sel = [t[:, path[0]] for t in (x, dt, Bm, Cm)]
                K.tree_ssd(sel[0], sel[1], A, sel[2], sel[3], D, bias, h0, chain.ancestor_mask, True, 0.0,
                           float("inf"), False)  # fmt: skip

        xs = x[0].float()
        dts = dt[0].float()[..., None].expand(-1, -1, p)
        As = A[:, None, None].expand(-1, p, s)

        def single():  # N separate single-token steps from each node's parent (states copied per node)
            state = h0.clone()
            for t in range(n):
                st = state.clone()
                mamba2_selective_state_update(
                    st, xs[t][None], dts[t][None], As, Bm[0, t][None].float(), Cm[0, t][None].float(),
                    D[:, None].expand(-1, p), dt_bias=bias[:, None].expand(-1, p), dt_softplus=True,
                )  # fmt: skip

        tk, tr, tu, ts = (median_time(f, repeats, warmup=1) for f in (kernel, reference, unrolled, single))
        print(f"{n:>5} {tk * 1e3:>10.3f} {tr * 1e3:>13.3f} {tu * 1e3:>18.3f} {ts * 1e3:>18.3f} {tr / tk:>12.2f} "
              f"{tu / tk:>11.2f} {ts / tk:>9.2f}")  # fmt: skip
        rows.append({"nodes": n, "kernel_ms": tk * 1e3, "reference_ms": tr * 1e3, "unrolled_ms": tu * 1e3,
                     "single_token_ms": ts * 1e3})  # fmt: skip
    return rows


def mamba2_pair(device: str, dtype: torch.dtype, layers: int, hidden: int):
    """(HF model, transformed copy with the same weights) of a random-init Mamba2."""
    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=50288, hidden_size=hidden, num_hidden_layers=layers, state_size=128,
                       head_dim=64, num_heads=2 * hidden // 64, n_groups=1, expand=2)  # fmt: skip
    ref = Mamba2ForCausalLM(cfg).to(device, dtype).eval()
    return ref, ssmspec.transform(copy.deepcopy(ref))


def compile_both(ref, model, smoke: bool) -> None:
    """HF's model with torch.compile, ssmspec's with the ssmspec backend; `smoke` (checking the script on a
    CPU): without Inductor's code generation, which costs minutes there and is tested elsewhere."""
    ref.compile(backend="eager" if smoke else "inductor")
    model.compile(backend="ssmspec", options={"inductor": False} if smoke else None)


def verify_section(device: str, dtype: torch.dtype, layers: int, hidden: int, nodes: list[int], repeats: int,
                   smoke: bool = False) -> dict:  # fmt: skip
    """verify(N) + commit over one HF decode step, eager and compiled (both sides)."""
    print(f"\n2. verify(N)/decode, Mamba2 random-init, {layers} layers, d_model {hidden}, {dtype}")
    ref, model = mamba2_pair(device, dtype, layers, hidden)
    ids = torch.randint(3, 1000, (1, 256), device=device)
    out = {"eager": {}, "compiled": {}, "graphs": {}}
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            torch._dynamo.reset()
            compile_both(ref, model, smoke)
        with torch.no_grad():
            decode = median_time(hf_decode_step(ref, ids), repeats, warmup=2)
            runner = ModelRunner(model)
            runner.prefill(ids, torch.ones_like(ids))
            for n in nodes:
                tree = random_tree(n, 4, device)
                last = torch.tensor([int(tree.depth[0].argmax())], device=device)
                snap = runner.snapshot()

                def step(tree=tree, last=last, snap=snap):
                    runner.verify(tree)
                    runner.commit(last)
                    runner.restore(snap)

                ratio = median_time(step, repeats, warmup=2) / decode
                out[mode][str(n)] = ratio
                print(f"  {mode:<9} N={n:<3} decode {decode * 1e3:7.2f} ms   verify+commit / decode {ratio:6.2f}")
    return out


def e2e_section(device: str, names: list[str], prompts: int, new_tokens: int, smoke: bool = False) -> dict:
    """Tokens/s end to end, side by side; every output compared with HF greedy, near-ties counted."""
    print(f"\n3. end to end, {prompts} held-out prompts x {new_tokens} tokens, float32, {device}")
    out = {}
    for name in names:
        ref, tok = models.load(name)
        ref = ref.to(device)
        batch = [p.to(device) for p in held_out_prompts(tok, prompts, 96)]
        eager = ssmspec.transform(copy.deepcopy(ref))
        compiled = ssmspec.transform(copy.deepcopy(ref))
        compiled_ref = copy.deepcopy(ref)
        torch._dynamo.reset()
        compile_both(compiled_ref, compiled, smoke)
        corpus = training_index(tok)
        spec = ssmspec.SpecConfig
        methods = {
            "HF greedy": (ref, {"do_sample": False}),
            "HF greedy (compiled)": (compiled_ref, {"do_sample": False}),
            "ssmspec autoregressive (eager)": (eager, {"speculation": spec(drafter="none")}),
            "ssmspec autoregressive (compiled)": (compiled, {"speculation": spec(drafter="none")}),
            "chain n-gram (compiled)": (compiled, {"speculation": spec(num_draft_tokens=8)}),
            "tree n-gram (compiled)": (compiled, {"speculation": spec(tree=True, num_draft_tokens=8)}),
            "tree n-gram + corpus, 8 nodes (compiled)": (compiled, {"speculation": spec(
                tree=True, num_draft_tokens=8, tree_budget=8, corpus=corpus)}),
        }  # fmt: skip
        want = [ref.generate(p, max_new_tokens=new_tokens, do_sample=False) for p in batch]
        rows = {}
        for method, (model, kwargs) in methods.items():
            spec = "speculation" in kwargs
            if spec:
                kwargs = {**kwargs, "return_dict_in_generate": True}
            for p in batch[:2]:  # warm-up (compilation, tree-size buckets) outside the timing
                model.generate(p, max_new_tokens=new_tokens, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            t0, same, ties, tokens = time.perf_counter(), True, 0, 0
            for p, w in zip(batch, want):
                got = model.generate(p, max_new_tokens=new_tokens, **kwargs)
                seq = got.sequences if spec else got
                same &= torch.equal(seq, w)
                ties += got.spec_stats["near_ties"] if spec else 0
                tokens += seq.shape[1] - p.shape[1]
            if device == "cuda":
                torch.cuda.synchronize()
            rows[method] = {"tokens_per_s": tokens / (time.perf_counter() - t0), "identical": same,
                            "near_ties": ties}  # fmt: skip
        hf = rows["HF greedy"]["tokens_per_s"]
        # the best plain decoder a user has: HF or ssmspec without drafts, eager or compiled
        best_ar = max(
            v["tokens_per_s"] for k, v in rows.items() if k.startswith(("HF greedy", "ssmspec autoregressive"))
        )
        for method, row in rows.items():
            row["speedup_vs_hf"] = row["tokens_per_s"] / hf
            row["speedup_vs_best_ar"] = row["tokens_per_s"] / best_ar
            print(
                f"  {name:<14} {method:<34} {row['tokens_per_s']:8.1f} tok/s  x{row['speedup_vs_hf']:.2f} HF  "
                f"x{row['speedup_vs_best_ar']:.2f} best AR  identical {row['identical']}  near-ties {row['near_ties']}"
            )
        out[name] = rows
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter), to test the script")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="where to write the results (default on CUDA: docs/data/gpu.json)")
    args = p.parse_args()
    t0 = time.perf_counter()
    if args.smoke:
        device = "cpu"
        result = {"kernels": kernel_section(device, torch.float32, 2, 4, 8, [6], 1),
                  "verify_over_decode": verify_section(device, torch.float32, 2, 64, [1, 6], 1, smoke=True),
                  "e2e": e2e_section(device, ["mamba2-target"], 1, 8, smoke=True)}  # fmt: skip
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu.py needs CUDA (use --smoke to check the script on CPU)")
        device = "cuda"
        result = {"kernels": kernel_section(device, torch.bfloat16, 64, 64, 128, [6, 16, 64], args.repeats),
                  "verify_over_decode": verify_section(device, torch.bfloat16, 48, 2048, [1, 6, 16, 64],
                                                       args.repeats),
                  "e2e": e2e_section(device, ["mamba2-target", "bamba-hybrid"], 6, 128)}  # fmt: skip
        args.json = args.json or str(ROOT / "docs" / "data" / "gpu.json")
    result["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    result["torch"] = torch.__version__
    result["seconds"] = time.perf_counter() - t0
    result["notes"] = {"graphs": "verification under CUDA graphs is not supported yet: no ratios under CUDA graphs"}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.json} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
