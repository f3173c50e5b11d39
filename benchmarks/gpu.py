"""The GPU benchmark: one command, bounded to ~8 minutes on an H100, everything measured side by side in one
run, printed as ratios and written to docs/data/gpu.json (`--smoke`: tiny shapes on CPU, the Triton
interpreter, to check the script itself; writes nothing unless --json is given).

1. tree SSD kernel vs its reference op, vs unrolling every root-to-leaf path (one chain SSD per leaf), vs N
   single-token state updates (HF's selective_state_update seam; mamba-ssm's kernel when installed);
2. verify(N) + commit / decode for N = 1, 6, 16, 64 on a 1.3B-class random-init Mamba2 (48 layers, d_model
   2048) in bf16: eager; under CUDA graphs (each side's step captured once with torch.cuda.graph and replayed:
   static shapes, the commit over a fixed path length with paths computed on the device, no host read);
   compiled (backend="ssmspec" against HF's decode under torch.compile); compiled and captured;
3. end to end on the embedded target and bamba-hybrid (float32, held-out prompts): HF greedy eager and
   compiled, ssmspec autoregressive eager and compiled, chain and tree n-gram and retrieval-tree speculation
   compiled; outputs compared with HF greedy and near-ties counted; `speedup_vs_best_ar` divides by the
   fastest plain decoder (HF or ssmspec, eager or compiled);
4. every supported family's tiny model in bf16 on CUDA under backend="ssmspec": generates without crashing,
   with speculation, compared with HF greedy (near-ties counted), one process per family.
5. (`--sections profile`) one compiled call of each kind under torch.profiler: per step, wall and device-busy
   time, kernel launches, CUDA-graph replays, host waits and device-to-host copies, and the costliest ops.

A section that fails is recorded (its error in the JSON) and the others still run; the JSON is rewritten
after every mode, method and family. A device call that cannot run every section within its time limit runs
them in separate calls (`--sections`), and `--merge` puts their JSON files together into docs/data/gpu.json.

    python benchmarks/gpu.py                       # on an H100/H200 -> docs/data/gpu.json
    python benchmarks/gpu.py --sections verify e2e --json /tmp/part.json
    python benchmarks/gpu.py --merge /tmp/part.json /tmp/other.json   # -> docs/data/gpu.json
    python benchmarks/gpu.py --smoke --json out.json
    python benchmarks/gpu.py --quick               # one short call -> docs/data/gpu_quick.json
    python benchmarks/gpu.py --sections profile --json /tmp/profile.json   # where a compiled step's time goes
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from _timing import median_time, provenance  # noqa: E402
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


def inductor_without_scans(gm, example_inputs):
    """Inductor with the graph's cumsums opaque (ATen's kernel): the workaround the ssmspec backend applies by
    itself for torch 2.11's split-scan codegen bug, which plain torch.compile hits on HF's bf16 Mamba2."""
    from torch._inductor.compile_fx import compile_fx

    from ssmspec.compile.passes import opaque_cumsums

    opaque_cumsums(gm)
    return compile_fx(gm, example_inputs)


def compile_both(ref, model, smoke: bool, hf_backend="inductor") -> None:
    """HF's model with torch.compile, ssmspec's with the ssmspec backend; `smoke` (checking the script on a
    CPU): without Inductor's code generation, which costs minutes there and is tested elsewhere."""
    ref.compile(backend="eager" if smoke else hf_backend)
    model.compile(backend="ssmspec", options={"inductor": False} if smoke else None)


def failure(e: BaseException) -> str:
    """A failed mode, method or section as the JSON records it (its traceback printed to the log)."""
    traceback.print_exc()
    return f"{type(e).__name__}: {e}"[:2000]


def cuda_graph(fn):
    """fn captured once as a CUDA graph (after warm-up calls on a side stream); returns its replay. The
    replay runs the captured kernels only: the same GPU work as fn, without the Python and launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def verify_section(device: str, dtype: torch.dtype, layers: int, hidden: int, nodes: list[int], repeats: int,
                   smoke: bool = False, modes: list[str] | None = None, out: dict | None = None,
                   save=lambda: None) -> dict:  # fmt: skip
    """verify(N) + commit over one HF decode step, both sides alike: eager; eager kernels replayed as CUDA
    graphs ("graphs"); compiled; compiled and replayed as CUDA graphs ("graphs (compiled)")."""
    print(f"\n2. verify(N)/decode, Mamba2 random-init, {layers} layers, d_model {hidden}, {dtype}")
    ref, model = mamba2_pair(device, dtype, layers, hidden)
    ids = torch.randint(3, 1000, (1, 256), device=device)
    out = {} if out is None else out
    for key in ("eager", "graphs", "compiled", "graphs (compiled)", "decode_ms", "verify_ms", "errors"):
        out.setdefault(key, {})
    cuda = device == "cuda"
    every = ["eager"] + (["graphs"] if cuda else []) + ["compiled"] + (["graphs (compiled)"] if cuda else [])
    for mode in [m for m in every if modes is None or m in modes]:
        if mode == "compiled" or (mode == "graphs (compiled)" and modes is not None and "compiled" not in modes):
            torch._dynamo.reset()
            # HF's side with opaque cumsums: plain torch.compile crashes on its bf16 Mamba2 path in torch 2.11
            compile_both(ref, model, smoke, hf_backend=inductor_without_scans)
        graphed = mode.startswith("graphs")
        try:
            with torch.no_grad():
                decode_fn = hf_decode_step(ref, ids)
                decode = median_time(cuda_graph(decode_fn) if graphed else decode_fn, repeats, warmup=2)
                out["decode_ms"][mode] = decode * 1e3
                # static shapes: the commit runs a fixed number of masked steps and computes paths on the device
                runner = ModelRunner(model, static_shapes=True)
                runner.prefill(ids, torch.ones_like(ids))
                for n in nodes:
                    tree = random_tree(n, 4, device)
                    runner.max_nodes, runner.max_depth = n, int(tree.depth.max())
                    last = torch.tensor([int(tree.depth[0].argmax())], device=device)

                    def step(tree=tree, last=last):
                        runner.verify(tree)
                        runner.commit(last)

                    t0 = time.perf_counter()
                    fn = cuda_graph(step) if graphed else step
                    t = median_time(fn, repeats, warmup=2)
                    out[mode][str(n)] = t / decode
                    out["verify_ms"].setdefault(mode, {})[str(n)] = t * 1e3
                    print(f"  {mode:<22} N={n:<3} decode {decode * 1e3:7.2f} ms   verify+commit {t * 1e3:7.2f} ms   "
                          f"ratio {t / decode:6.2f}   ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - recorded, the other modes and sections still run
            out["errors"][mode] = failure(e)
            print(f"  {mode}: FAILED {out['errors'][mode][:400]}")
        save()
    return out


def e2e_section(
    device: str,
    names: list[str],
    prompts: int,
    new_tokens: int,
    smoke: bool = False,
    out: dict | None = None,
    save=lambda: None,
) -> dict:
    """Tokens/s end to end, side by side; every output compared with HF greedy, near-ties counted. Rows go
    into `out` as they are measured (`save` after each), so a run cut short keeps what it measured."""
    print(f"\n3. end to end, {prompts} held-out prompts x {new_tokens} tokens, float32, {device}")
    out = {} if out is None else out
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
        # the n-gram rows as named (drafter "auto" would draft with the embedded target's head)
        spec = functools.partial(ssmspec.SpecConfig, drafter="prompt_lookup")
        methods = {
            "HF greedy": (ref, {"do_sample": False}),
            "HF greedy (compiled)": (compiled_ref, {"do_sample": False}),
            "ssmspec autoregressive (eager)": (eager, {"speculation": spec(drafter="none")}),
            "ssmspec autoregressive (compiled)": (compiled, {"speculation": spec(drafter="none")}),
            "tree n-gram + corpus, 8 nodes (compiled)": (compiled, {"speculation": spec(
                tree=True, num_draft_tokens=8, tree_budget=8, corpus=corpus)}),
            "chain n-gram (compiled)": (compiled, {"speculation": spec(num_draft_tokens=8)}),
            "tree n-gram (compiled)": (compiled, {"speculation": spec(tree=True, num_draft_tokens=8)}),
            "tree n-gram + corpus, 8 nodes (eager)": (eager, {"speculation": spec(
                tree=True, num_draft_tokens=8, tree_budget=8, corpus=corpus)}),
        }  # fmt: skip
        if not smoke:  # CUDA graphs through Inductor (cudagraph trees), where a user would ask for them
            graphed_ref = copy.deepcopy(ref)
            graphed_ref.compile(mode="reduce-overhead")
            graphed = ssmspec.transform(copy.deepcopy(ref))
            graphed.compile(backend="ssmspec", mode="reduce-overhead")
            methods["HF greedy (compiled, reduce-overhead)"] = (graphed_ref, {"do_sample": False})
            methods["ssmspec autoregressive (compiled, reduce-overhead)"] = (
                graphed, {"speculation": spec(drafter="none")})  # fmt: skip
            methods["tree n-gram + corpus, 8 nodes (compiled, reduce-overhead)"] = (graphed, {"speculation": spec(
                tree=True, num_draft_tokens=8, tree_budget=8, corpus=corpus)})  # fmt: skip
            # token recycling: wide trees, where the verification's cost is nearly flat in the node count
            recycled = spec(tree=True, num_draft_tokens=8, tree_budget=16, corpus=corpus, recycle=4)
            methods["tree n-gram + corpus + recycling, 16 nodes (compiled)"] = (compiled, {"speculation": recycled})
            methods["tree n-gram + corpus + recycling, 16 nodes (compiled, reduce-overhead)"] = (
                graphed, {"speculation": recycled})  # fmt: skip
        want = [ref.generate(p, max_new_tokens=new_tokens, do_sample=False) for p in batch]
        rows = out[name] = {}
        for method, (model, kwargs) in methods.items():
            try:
                measured = timed_generates(model, kwargs, batch, want, new_tokens, device)
            except Exception as e:  # noqa: BLE001 - recorded, the other methods still run
                rows[method] = {"error": failure(e)}
                print(f"  {name:<14} {method:<34} FAILED {rows[method]['error'][:400]}")
                continue
            rows[method] = {k: measured[k] for k in ("tokens_per_s", "identical", "near_ties")}
            print(f"  {name:<14} {method:<34} {rows[method]['tokens_per_s']:8.1f} tok/s", flush=True)
            save()
        for method, row in speedups(rows).items():
            print(
                f"  {name:<14} {method:<34} {row['tokens_per_s']:8.1f} tok/s  x{row['speedup_vs_hf'] or 0:.2f} HF  "
                f"x{row['speedup_vs_best_ar'] or 0:.2f} best AR  identical {row['identical']}  "
                f"near-ties {row['near_ties']}"
            )
        save()
    return out


def timed_generates(model, kwargs: dict, batch: list, want: list, new_tokens: int, device: str) -> dict:
    """Every prompt of `batch` generated once untimed (the compiled graphs of each tree-size bucket and commit width, a
    compiled model's first call's calibration), then once timed; each timed output compared with HF greedy's (`want`).
    Returns tokens_per_s, identical, near_ties, tokens_per_step (1 without speculation) and the Dynamo graphs compiled
    during the timed calls."""
    from ssmspec.compile.backend import STATS

    speculative = "speculation" in kwargs
    kwargs = {**kwargs, "return_dict_in_generate": True} if speculative else kwargs
    for p in batch:
        model.generate(p, max_new_tokens=new_tokens, **kwargs)
    graphs = STATS.graphs
    if device == "cuda":
        torch.cuda.synchronize()
    start, same, ties, tokens, per_step = time.perf_counter(), True, 0, 0, []
    for p, w in zip(batch, want):
        got = model.generate(p, max_new_tokens=new_tokens, **kwargs)
        seq = got.sequences if speculative else got
        same &= torch.equal(seq, w)
        if speculative:
            ties += got.spec_stats["near_ties"]
            per_step.append(got.spec_stats["mean_accepted_per_step"])
        tokens += seq.shape[1] - p.shape[1]
    if device == "cuda":
        torch.cuda.synchronize()
    return {"tokens_per_s": tokens / (time.perf_counter() - start), "identical": same, "near_ties": ties,
            "graphs_compiled_while_timed": STATS.graphs - graphs,
            "tokens_per_step": sum(per_step) / len(per_step) if per_step else 1.0}  # fmt: skip


def compiled_copy(ref, smoke: bool):
    """`transform(compile=True)` on a copy of `ref`, as a user calls it (`smoke`: Inductor off, to test the script)."""
    return ssmspec.transform(copy.deepcopy(ref), compile={"progress": False, **({"options": {"inductor": False}}
                                                                                 if smoke else {})})  # fmt: skip


def quick_section(device: str, prompts: int, new_tokens: int, smoke: bool = False, out: dict | None = None,
                  save=lambda: None) -> dict:  # fmt: skip
    """The embedded target end to end as a user calls it (float32, held-out code, batch 1), side by side: HF greedy
    eager and compiled; ssmspec plain, default (its draft head) and n-gram calls, eager and on
    `transform(compile=True)` (on CUDA: Inductor and ssmspec's captured steps); the warm-up's seconds, and the Dynamo
    graphs compiled during the timed calls (none expected)."""
    print(f"\nquick: embedded target, {prompts} held-out prompts x {new_tokens} tokens, float32, {device}")
    out = {} if out is None else out
    ref, tok = models.load("mamba2-target")
    ref = ref.to(device)
    batch = [p.to(device) for p in held_out_prompts(tok, prompts, 128)]
    want = [ref.generate(p, max_new_tokens=new_tokens, do_sample=False) for p in batch]
    eager = ssmspec.transform(copy.deepcopy(ref))
    t0 = time.perf_counter()
    compiled = compiled_copy(ref, smoke)
    out["warmup_s"] = time.perf_counter() - t0
    out["compiled"] = compiled._compiled_call_impl is not None
    out["captured_steps"] = bool(getattr(compiled, "ssmspec_graphs", False))
    print(f"  transform(compile=True): {out['warmup_s']:.0f} s, compiled {out['compiled']}, "
          f"captured steps {out['captured_steps']}")  # fmt: skip
    compiled_ref = copy.deepcopy(ref)
    compiled_ref.compile(backend="eager" if smoke else "inductor")
    spec = ssmspec.SpecConfig
    methods = {
        "HF greedy": (ref, {"do_sample": False}),
        "HF greedy (compiled)": (compiled_ref, {"do_sample": False}),
        "ssmspec plain (eager)": (eager, {"speculation": spec(drafter="none")}),
        "ssmspec default (eager)": (eager, {"speculation": True}),
        "ssmspec n-gram (eager)": (eager, {"speculation": spec(drafter="prompt_lookup")}),
        "ssmspec plain (compiled)": (compiled, {"speculation": spec(drafter="none")}),
        "ssmspec default (compiled)": (compiled, {"speculation": True}),
        "ssmspec n-gram (compiled)": (compiled, {"speculation": spec(drafter="prompt_lookup")}),
        "ssmspec head (compiled)": (compiled, {"speculation": spec(drafter="draft_head")}),
    }
    rows = out.setdefault("rows", {})
    for method, (model, kwargs) in methods.items():
        try:
            rows[method] = timed_generates(model, kwargs, batch, want, new_tokens, device)
        except Exception as e:  # noqa: BLE001 - recorded, the other rows still run
            rows[method] = {"error": failure(e)}
            print(f"  {method:<28} FAILED {rows[method]['error'][:400]}")
            save()
            continue
        print(f"  {method:<28} {rows[method]['tokens_per_s']:8.1f} tok/s  identical {rows[method]['identical']}  "
              f"{rows[method]['tokens_per_step']:.2f} tokens/step", flush=True)  # fmt: skip
        save()
    timed = {k: v for k, v in rows.items() if "tokens_per_s" in v}
    hf = timed.get("HF greedy", {}).get("tokens_per_s")
    best = max((v["tokens_per_s"] for k, v in timed.items() if k.startswith("HF") or "plain" in k), default=None)
    hf_compiled = timed.get("HF greedy (compiled)", {}).get("tokens_per_s")
    for method, row in timed.items():
        row["speedup_vs_hf"] = row["tokens_per_s"] / hf if hf else None
        row["speedup_vs_hf_compiled"] = row["tokens_per_s"] / hf_compiled if hf_compiled else None
        row["speedup_vs_best_plain"] = row["tokens_per_s"] / best if best else None
        print(f"  {method:<28} x{row['speedup_vs_hf'] or 0:.2f} HF  x{row['speedup_vs_hf_compiled'] or 0:.2f} HF "
              f"compiled  x{row['speedup_vs_best_plain'] or 0:.2f} best plain")  # fmt: skip
    save()
    return out


# profiler event names (torch internals: named here) counted per call
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
_HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_section(device: str, new_tokens: int, smoke: bool = False, out: dict | None = None,
                    save=lambda: None) -> dict:  # fmt: skip
    """One call of the embedded target's compiled plain decoding, default call and draft-head call under
    torch.profiler (CUDA activity on a GPU): wall and device-busy ms per step, kernel launches and CUDA-graph
    replays per step, host waits and device-to-host copies per step, and the ops with the most host and device
    time: where a step's time goes between the replayed graphs."""
    print(f"\nprofile: embedded target, one held-out prompt x {new_tokens} tokens, compiled, {device}")
    out = {} if out is None else out
    ref, tok = models.load("mamba2-target")
    ref = ref.to(device)
    prompt = held_out_prompts(tok, 1, 128)[0].to(device)
    model = compiled_copy(ref, smoke)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    spec = ssmspec.SpecConfig
    for name, speculation in (("plain", spec(drafter="none")), ("default", True), ("head", spec(drafter="draft_head"))):
        try:
            kwargs = {"max_new_tokens": new_tokens, "speculation": speculation, "return_dict_in_generate": True}
            model.generate(prompt, **kwargs)  # (first use of a bucket or commit width: captured here, not timed)
            if device == "cuda":
                torch.cuda.synchronize()
            with torch.profiler.profile(activities=activities) as prof:
                start = time.perf_counter()
                got = model.generate(prompt, **kwargs)
                if device == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - start
            events = prof.key_averages()
            steps = max(1, got.spec_stats["verify_steps"])
            on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]

            def count(names, events=events):
                return sum(e.count for e in events if e.key in names)

            out[name] = {
                "steps": steps,
                "tokens_per_step": got.spec_stats["mean_accepted_per_step"],
                "wall_ms_per_step": wall * 1e3 / steps,
                "device_busy_ms_per_step": sum(e.self_device_time_total for e in on_device) / 1e3 / steps,
                "kernel_launches_per_step": count(_LAUNCHES) / steps,
                "graph_replays_per_step": count(("cudaGraphLaunch",)) / steps,
                "host_waits_per_step": count(_HOST_WAITS) / steps,
                "device_to_host_copies_per_step": sum(e.count for e in events if "DtoH" in e.key) / steps,
                "top_host_ops": [[e.key, e.count, round(e.self_cpu_time_total / steps, 1)]
                                 for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]],
                "top_device_ops": [[e.key, e.count, round(e.self_device_time_total / steps, 1)]
                                   for e in sorted(on_device, key=lambda e: -e.self_device_time_total)[:15]],
            }  # fmt: skip
            row = out[name]
            print(f"  {name:<8} {row['wall_ms_per_step']:.3f} ms/step"
                  f" (device busy {row['device_busy_ms_per_step']:.3f})"
                  f"  {row['tokens_per_step']:.2f} tokens/step  launches {row['kernel_launches_per_step']:.1f}"
                  f"  graph replays {row['graph_replays_per_step']:.1f}  host waits {row['host_waits_per_step']:.1f}"
                  f"  DtoH {row['device_to_host_copies_per_step']:.1f}")  # fmt: skip
            print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))
        except Exception as e:  # noqa: BLE001 - recorded, the other calls still run
            out[name] = {"error": failure(e)}
            print(f"  {name:<8} FAILED {out[name]['error'][:400]}")
        save()
    return out


def speedups(rows: dict) -> dict:
    """Fill each timed row's speed-ups over HF greedy and over the best plain decoder a user has (HF or ssmspec
    without drafts, eager or compiled, among the rows measured); returns the timed rows."""
    timed = {k: v for k, v in rows.items() if "tokens_per_s" in v}
    hf = timed.get("HF greedy", {}).get("tokens_per_s")
    best_ar = max(
        (v["tokens_per_s"] for k, v in timed.items() if k.startswith(("HF greedy", "ssmspec autoregressive"))),
        default=None,
    )
    for row in timed.values():
        row["speedup_vs_hf"] = row["tokens_per_s"] / hf if hf else None
        row["speedup_vs_best_ar"] = row["tokens_per_s"] / best_ar if best_ar else None
    return timed


def merge(paths: list[str]) -> dict:
    """Section JSON files of one machine (separate device calls) as one result: sections, verify modes, e2e
    models and families are combined (a later file's entry replaces an earlier one's); each file's device must
    match; the sources are listed under "runs"."""
    result: dict = {"runs": []}
    for path in paths:
        part = json.loads(Path(path).read_text())
        if result.get("device", part["device"]) != part["device"]:
            sys.exit(f"{path}: measured on {part['device']}, not {result['device']}")
        result["device"], result["torch"] = part["device"], part["torch"]
        result["runs"].append({"file": Path(path).name, "seconds": part.get("seconds"),
                               "sections": [k for k in SECTIONS.values() if k in part]})  # fmt: skip
        for key in SECTIONS.values():
            if key not in part:
                continue
            if key in ("kernels", "quick", "profile"):
                result[key] = part[key]
            elif key == "verify_over_decode":
                into = result.setdefault(key, {})
                for mode, values in part[key].items():
                    into.setdefault(mode, {}).update(values)
                for mode in [m for m in into.get("errors", {}) if into.get(m)]:  # measured by a later run
                    into["errors"].pop(mode)
            else:
                for name, rows in part[key].items():
                    result.setdefault(key, {}).setdefault(name, {}).update(rows)
    for rows in result.get("e2e", {}).values():
        speedups(rows)
    return result


def family_check(family: str, device: str, dtype: torch.dtype, new_tokens: int = 24) -> dict:
    """One family's tiny model under backend="ssmspec" (Inductor on): speculative generate vs HF greedy."""
    from ssmspec.compile.backend import STATS
    from ssmspec.testing.configs import build_tiny_model

    t0 = time.perf_counter()
    ref = build_tiny_model(family, dtype=dtype).to(device)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]], device=device)
    want = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    model = ssmspec.transform(copy.deepcopy(ref))
    model.compile(backend="ssmspec", options={"inductor": False} if device == "cpu" else None)
    trees = bool(getattr(model.ssmspec_info, "trees", False))
    got = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=None, return_dict_in_generate=True,
                         speculation=ssmspec.SpecConfig(tree=trees, num_draft_tokens=4))  # fmt: skip
    same = got.sequences.shape == want.shape and torch.equal(got.sequences, want)
    first = None if same else int((got.sequences[0, : want.shape[1]] != want[0, : got.sequences.shape[1]]).nonzero()[0])
    return {"ok": True, "identical": same, "first_difference": first, "near_ties": got.spec_stats["near_ties"],
            "inductor_fallbacks": STATS.fallbacks, "tree": trees, "seconds": time.perf_counter() - t0}  # fmt: skip


def families_section(
    smoke: bool,
    workers: int = 6,
    timeout: float = 240,
    out: dict | None = None,
    save=lambda: None,
    only: list[str] | None = None,
) -> dict:
    """family_check for every supported family, one fresh process each (a crash stays in its process)."""
    from ssmspec.testing.configs import SUPPORTED_FAMILIES

    families = SUPPORTED_FAMILIES[:1] if smoke else [f for f in SUPPORTED_FAMILIES if only is None or f in only]
    print(f"\n4. {len(families)} families, bf16, backend='ssmspec', {'cpu (smoke)' if smoke else 'cuda'}")

    def run(family: str) -> tuple[str, dict]:
        cmd = [sys.executable, __file__, "--family", family] + (["--smoke"] if smoke else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return family, {"ok": False, "error": f"timed out after {timeout:.0f} s"}
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode == 0 and lines:
            return family, json.loads(lines[-1])
        return family, {"ok": False, "error": (proc.stderr or proc.stdout)[-2000:]}

    out = {} if out is None else out
    with ThreadPoolExecutor(workers) as pool:
        for done in as_completed([pool.submit(run, f) for f in families]):
            family, row = done.result()
            out[family] = row
            save()
            summary = (f"identical {row['identical']}  near-ties {row['near_ties']}  fallbacks "
                       f"{row['inductor_fallbacks']}  {row['seconds']:.0f} s" if row["ok"]
                       else "FAILED " + row["error"][-300:])  # fmt: skip
            print(f"  {family:<18} {summary}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter), to test the script")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), help="default: all, or with --quick quick and "
                   "verify")  # fmt: skip
    p.add_argument("--json", help="where to write the results (default on CUDA: docs/data/gpu.json)")
    p.add_argument("--family", help=argparse.SUPPRESS)  # the per-family child process of section 4
    p.add_argument("--verify-modes", nargs="+", help="verify section: only these modes (eager, graphs, compiled, "
                   "'graphs (compiled)')")  # fmt: skip
    p.add_argument("--merge", nargs="+", help="merge these section JSON files into --json (default docs/data/gpu.json)")
    p.add_argument("--models", nargs="+", default=["mamba2-target", "bamba-hybrid"], help="e2e section's models")
    p.add_argument("--families", nargs="+", help="families section: only these families")
    p.add_argument("--workers", type=int, default=6, help="families section: processes at a time")
    p.add_argument("--quick", action="store_true", help="one short device call: the embedded target end to end "
                   "(eager and compile=True, with and without its head) and the 1.3B-class Mamba2's decode and "
                   "verify(6) / verify(16) ms, compiled and captured (docs/data/gpu_quick.json)")  # fmt: skip
    args = p.parse_args()
    if args.quick:
        args.sections = args.sections or ["quick", "verify"]
        args.verify_modes = args.verify_modes or ["graphs (compiled)"]
    args.sections = args.sections or list(SECTIONS)
    if args.merge:
        out = Path(args.json or ROOT / "docs" / "data" / "gpu.json")
        out.write_text(json.dumps(merge(args.merge), indent=1))
        print(f"wrote {out}")
        return
    if args.family:
        device = "cpu" if args.smoke else "cuda"
        print(json.dumps(family_check(args.family, device, torch.bfloat16)))
        return
    t0 = time.perf_counter()
    result = {}

    def save() -> None:
        result["seconds"] = time.perf_counter() - t0
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    if args.smoke:
        device = "cpu"
        sections = {
            "kernels": lambda: kernel_section(device, torch.float32, 2, 4, 8, [6], 1),
            "verify": lambda: verify_section(
                device,
                torch.float32,
                2,
                64,
                [1, 6],
                1,
                True,
                args.verify_modes,
                result.setdefault("verify_over_decode", {}),
                save,
            ),
            "e2e": lambda: e2e_section(device, ["mamba2-target"], 1, 8, True, result.setdefault("e2e", {}), save),
            "quick": lambda: quick_section(device, 1, 8, True, result.setdefault("quick", {}), save),
            "profile": lambda: profile_section(device, 8, True, result.setdefault("profile", {}), save),
            "families": lambda: families_section(
                True, 1, out=result.setdefault("families", {}), save=save, only=args.families
            ),
        }
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu.py needs CUDA (use --smoke to check the script on CPU)")
        device = "cuda"
        sections = {
            "kernels": lambda: kernel_section(device, torch.bfloat16, 64, 64, 128, [6, 16, 64], args.repeats),
            "verify": lambda: verify_section(
                device,
                torch.bfloat16,
                48,
                2048,
                [1, 6, 16] if args.quick else [1, 6, 16, 64],
                10 if args.quick else args.repeats,
                False,
                args.verify_modes,
                result.setdefault("verify_over_decode", {}),
                save,
            ),
            "e2e": lambda: e2e_section(device, args.models, 6, 128, False, result.setdefault("e2e", {}), save),
            "quick": lambda: quick_section(device, 4, 128, False, result.setdefault("quick", {}), save),
            "profile": lambda: profile_section(device, 64, False, result.setdefault("profile", {}), save),
            "families": lambda: families_section(
                False, args.workers, out=result.setdefault("families", {}), save=save, only=args.families
            ),
        }
        args.json = args.json or str(ROOT / "docs" / "data" / ("gpu_quick.json" if args.quick else "gpu.json"))
    result.update(provenance(" ".join(["python", "benchmarks/gpu.py", *sys.argv[1:]])))
    result["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    result["torch"] = torch.__version__
    for name in args.sections:
        key = SECTIONS[name]
        try:
            result[key] = sections[name]()
        except Exception as e:  # noqa: BLE001 - recorded, the other sections still run
            result[key] = {"error": failure(e)}
        save()
    if args.json:
        print(f"\nwrote {args.json} ({result['seconds']:.0f} s)")


# section name -> its key in the JSON
SECTIONS = {
    "kernels": "kernels",
    "verify": "verify_over_decode",
    "e2e": "e2e",
    "families": "families",
    "quick": "quick",
    "profile": "profile",
}


if __name__ == "__main__":
    main()
