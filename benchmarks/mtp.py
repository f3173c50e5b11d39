"""The embedded Nemotron-H hybrid drafting with the MTP layer its checkpoint ships (benchmarks/train_mtp.py), on the
held-out standard-library files, eager, batch 1: how often a sampled MTP draft one level deep is accepted, and
speculation against HF's own greedy decoding and sampling, side by side in one process (calls alternated, every
greedy output checked identical to HF's), for the default call (drafter "auto": the MTP layer fused with n-gram
lookup where the layer is small against the model, as here) and for `SpecConfig(drafter="mtp")` (its own defaults);
HF is also timed inside torch.inference_mode() (the stronger baseline: HF's generate runs under no_grad), and
ssmspec's own plain decoding (`SpecConfig(drafter="none")`, the best plain decoder on this CPU) beside them.
Writes docs/data/mtp.json.

    python benchmarks/mtp.py                  # about 9 minutes on 2 CPU cores
    python benchmarks/mtp.py --prompts 2 --tokens 32 --out /tmp/mtp.json   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from pathlib import Path

import torch
from _timing import provenance

import ssmspec
from ssmspec import models
from ssmspec.bench import held_out_prompts, write_json
from ssmspec.hf.mtp import size_share

ROOT = Path(__file__).resolve().parents[1]


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=2, help="passes over the prompts (calls alternated in each)")
    p.add_argument("--out", default=str(ROOT / "docs" / "data" / "mtp.json"))
    args = p.parse_args()
    torch.set_num_threads(2)
    ref, tok = models.load("nemotron-mtp")
    model = ssmspec.transform(copy.deepcopy(ref))
    head = model.ssmspec_draft_head
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens, "held-out")
    n = args.tokens
    sample = {"do_sample": True, "temperature": args.temperature, "top_k": 0}
    one_level = ssmspec.SpecConfig(drafter="mtp", tree=False, num_draft_tokens=1, adaptive=False)
    mtp = ssmspec.SpecConfig(drafter="mtp")
    plain = ssmspec.SpecConfig(drafter="none")  # ssmspec's own plain decoding: the best baseline on this CPU
    calls = {  # name -> (HF's or ssmspec's, generate kwargs); "_inference": HF's call inside torch.inference_mode()
        "hf_greedy": (ref, {"do_sample": False}), "hf_greedy_inference": (ref, {"do_sample": False}),
        "default_greedy": (model, {}), "mtp_greedy": (model, {"speculation": mtp}),
        "hf_sampling": (ref, sample), "hf_sampling_inference": (ref, sample),
        "default_sampling": (model, sample), "mtp_sampling": (model, {"speculation": mtp, **sample}),
        "plain_greedy": (model, {"do_sample": False, "speculation": plain}),
        "plain_sampling": (model, {"speculation": plain, **sample}),
    }  # fmt: skip

    def call(name, who, ids, kw):
        with torch.inference_mode() if name.endswith("_inference") else contextlib.nullcontext():
            return who.generate(ids, max_new_tokens=n, **kw)

    for p_ in prompts[:2]:  # warm-up (and the first call's calibration) of every call timed below
        for name, (who, kw) in calls.items():
            call(name, who, p_, kw)
    times = dict.fromkeys(calls, 0.0)
    steps = {name: [0, 0] for name in calls if not name.startswith("hf")}
    accepted = drafted = identical = 0
    default_mtp = False
    passes = [(i, ids) for _ in range(args.repeats) for i, ids in enumerate(prompts)]
    for k, (i, ids) in enumerate(passes):
        want = None
        for name, (who, kw) in calls.items():
            torch.manual_seed(i)
            extra = {} if who is ref else {"generator": torch.Generator().manual_seed(i),
                                           "return_dict_in_generate": True}  # fmt: skip
            t, out = timed(lambda: call(name, who, ids, {**kw, **extra}))
            times[name] += t
            if name == "hf_greedy":
                want = out
            elif who is model:
                if name == "default_greedy":
                    default_mtp = "mtp" in out.spec_stats["drafter"]
                steps[name][0] += out.spec_stats["emitted_tokens"]
                steps[name][1] += out.spec_stats["verify_steps"]
                if name.endswith("greedy"):
                    identical += int(torch.equal(out.sequences, want))
        print(f"prompt {i}: { ({name: round(v, 2) for name, v in times.items()}) }", flush=True)
        if k >= len(prompts):  # (the one-level acceptance: once per prompt, its draws fixed by the seed)
            continue
        out = model.generate(ids, max_new_tokens=n, speculation=one_level, generator=torch.Generator().manual_seed(i),
                             return_dict_in_generate=True, **sample)  # fmt: skip
        accepted += out.spec_stats["accepted_tokens"]
        drafted += sum(nodes - 1 for nodes in out.spec_stats["tree_nodes_per_step"])

    def summary(name: str, base: str) -> dict:
        return {"speedup_vs_hf": times[base] / times[name],
                "speedup_vs_hf_inference_mode": times[f"{base}_inference"] / times[name],
                "tokens_per_step": steps[name][0] / max(steps[name][1], 1)}  # fmt: skip

    result = {
        "setup": f"embedded nemotron-mtp (Nemotron-H with its MTP layer), CPU {torch.get_num_threads()} threads, "
        f"float32, eager, batch 1, {len(prompts)} held-out prompts x {args.prompt_tokens} tokens ({args.repeats} "
        f"passes), {n} new tokens, "
        f"sampling at temperature {args.temperature} (top_k 0)",
        **provenance("python benchmarks/mtp.py"),
        "mtp": head.family,
        "mtp_share": size_share(head, model),
        "default_drafts_with_mtp": default_mtp,
        "acceptance_one_level_sampled": accepted / max(drafted, 1),
        "greedy_identical": f"{identical}/{3 * len(passes)}",
        "default_greedy": summary("default_greedy", "hf_greedy"),
        "mtp_greedy": summary("mtp_greedy", "hf_greedy"),
        "default_sampling": summary("default_sampling", "hf_sampling"),
        "mtp_sampling": summary("mtp_sampling", "hf_sampling"),
        "plain_greedy": summary("plain_greedy", "hf_greedy"),
        "plain_sampling": summary("plain_sampling", "hf_sampling"),
        "default_greedy_vs_plain": times["plain_greedy"] / times["default_greedy"],
        "default_sampling_vs_plain": times["plain_sampling"] / times["default_sampling"],
        "seconds": times,
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
