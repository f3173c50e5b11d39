"""GPU kernel benchmarks (needs CUDA; `--smoke` runs tiny shapes on CPU under TRITON_INTERPRET=1 to check
the script itself). Everything is measured side by side in one run and printed as ratios:

1. tree SSD kernel vs its reference op (the choice ssmspec measures per shape), vs unrolling every
   root-to-leaf path (one chain SSD per leaf, the reference masked form on the gathered chain) vs N calls
   of a single-token state update (HF's selective_state_update seam; mamba-ssm's kernel when installed);
2. verification cost of 6/16/64-node trees relative to one decode step, 1.3B-class random-init Mamba2
   (48 layers, d_model 2048) in bf16, compiled with backend="ssmspec";
3. commit cost (replay along a path, conv window) relative to one decode step;
4. the kernel-or-reference choices the backend's default policy ("auto") measured during 2./3.

    python benchmarks/gpu_kernels.py            # on an H100/H200
    python benchmarks/gpu_kernels.py --smoke    # CPU, tiny, interpreter
"""

from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from _timing import median_time  # noqa: E402
from transformers import Mamba2Config, Mamba2ForCausalLM  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update  # noqa: E402
from verify_cost import hf_decode_step  # noqa: E402

import ssmspec  # noqa: E402
from ssmspec import kernels as K  # noqa: E402
from ssmspec.ops._common import reference_impl  # noqa: E402
from ssmspec.speculate.runner import ModelRunner  # noqa: E402
from ssmspec.tree import TokenTree  # noqa: E402


def random_tree(n: int, branching: int, device: str, seed: int = 0) -> TokenTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, t - branching), t, (1,), generator=g)) for t in range(1, n)]
    return TokenTree(torch.zeros(1, n, dtype=torch.long, device=device), torch.tensor([parents], device=device))


def kernel_section(device: str, dtype: torch.dtype, heads: int, p: int, s: int, nodes: list[int], repeats: int):
    print(f"\n1. tree SSD: {heads} heads x {p} head dim, state {s}, {dtype}, batch 1")
    print(f"{'nodes':>5} {'kernel ms':>10} {'reference ms':>13} {'unrolled paths ms':>18} {'N single-token ms':>18} "
          f"{'x reference':>12} {'x unrolled':>11} {'x single':>9}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
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


def model_section(device: str, dtype: torch.dtype, layers: int, hidden: int, nodes: list[int], repeats: int):
    print(f"\n2./3. Mamba2 random-init, {layers} layers, d_model {hidden}, {dtype}, backend='ssmspec'")
    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=50288, hidden_size=hidden, num_hidden_layers=layers, state_size=128,
                       head_dim=64, num_heads=2 * hidden // 64, n_groups=1, expand=2)  # fmt: skip
    ref = Mamba2ForCausalLM(cfg).to(device, dtype).eval()
    model = ssmspec.transform(Mamba2ForCausalLM(cfg).to(device, dtype).eval())
    model.load_state_dict(ref.state_dict())
    model.compile(backend="ssmspec")
    ids = torch.randint(3, 1000, (1, 256), device=device)
    with torch.no_grad():
        decode = median_time(hf_decode_step(ref, ids), repeats, warmup=1)
        runner = ModelRunner(model)
        runner.prefill(ids, torch.ones_like(ids))
        print(f"HF decode step: {decode * 1e3:.2f} ms")
        print(f"{'nodes':>5} {'verify ms':>10} {'commit ms':>10} {'verify/decode':>14} {'commit/decode':>14}")
        for n in nodes:
            tree = random_tree(n, 4, device)
            last = torch.tensor([int(tree.depth[0].argmax())], device=device)
            snap = runner.snapshot()

            def verify():
                runner.verify(tree)
                runner.discard()

            def commit():
                runner.verify(tree)
                runner.commit(last)
                runner.restore(snap)

            tv = median_time(verify, repeats, warmup=1)
            tc = max(median_time(commit, repeats, warmup=1) - tv, 0.0)
            print(f"{n:>5} {tv * 1e3:>10.2f} {tc * 1e3:>10.2f} {tv / decode:>14.2f} {tc / decode:>14.2f}")
    print("\n4. kernel choices measured by the default policy (op, kernel used, kernel ms, reference ms):")
    for row in K.SELECTOR.summary():
        print(f"  {row['op']:<32} {'kernel' if row['kernel'] else 'reference':<9} {row['kernel_ms']:>9.3f} "
              f"{row['reference_ms']:>9.3f}  {row['signature'][:2]}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter), to test the script")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if args.smoke:
        kernel_section("cpu", torch.float32, 2, 4, 8, [6, 16], 1)
        model_section("cpu", torch.float32, 2, 64, [6], 1)
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels.py needs CUDA (use --smoke to check the script on CPU)")
    kernel_section("cuda", torch.bfloat16, 64, 64, 128, [6, 16, 64, 128, 256], args.repeats)
    model_section("cuda", torch.bfloat16, 48, 2048, [1, 6, 16, 64], args.repeats)


if __name__ == "__main__":
    main()
