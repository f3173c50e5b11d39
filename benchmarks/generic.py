"""The generic path end to end: HF greedy against ssmspec's default call and an 8-deep n-gram chain on models
without kernel seams (random-init RWKV and xLSTM of `--layers` x `--hidden`), side by side in one run.

Random-init models either repeat themselves (drafts accepted whole) or never (drafts all rejected): the two
prompts per model, a repeated motif and random tokens, show both ends; the default's adaptive policy must keep
the second at plain-decoding speed. `--batch B`: also a batch of B repeated motifs where the probe allows the model's
batches, against HF's batched greedy: the default call there is HF's own batched loop, the chain runs row by row.
Best of `--repeats` after one warm-up call (on a transformed model, `ssmspec.calibrate`: its calibration completed);
every output is checked
token for token against HF's.

    python benchmarks/generic.py --json docs/data/generic.json
"""

from __future__ import annotations

import argparse
import copy

import torch
from _plot import write_outputs
from verify_cost import rwkv, xlstm

import ssmspec
from ssmspec.bench import best_time

BUILDERS = {"rwkv": rwkv, "xlstm": xlstm}


def _best(fn, repeats: int, warm=None) -> tuple[float, object]:
    return best_time(fn, repeats, warm or fn)  # (a warm-up first: fn itself where not given)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--new", type=int, default=96, help="new tokens per call")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="rows of the batched prompt (1: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    chain = ssmspec.SpecConfig(tree=False, adaptive=False)
    rows = []
    print(f"{'model':>6} {'prompt':>10} {'HF (s)':>7} {'default':>8} {'acc/step':>8} {'chain 8':>8} {'acc/step':>8}")
    for family in args.families:
        ref = BUILDERS[family](args.layers, args.hidden, torch.float32)
        model = ssmspec.transform(copy.deepcopy(ref))
        assert model.ssmspec_info.path == "generic", model.ssmspec_info.path
        g = torch.Generator().manual_seed(0)
        prompts = {"repeat": torch.randint(3, 32000, (1, 12), generator=g).repeat(1, 4),
                   "random": torch.randint(3, 32000, (1, 48), generator=g)}  # fmt: skip
        if args.batch > 1 and model.ssmspec_info.batches:
            prompts[f"repeat x{args.batch}"] = torch.randint(3, 32000, (args.batch, 12), generator=g).repeat(1, 4)
        for kind, ids in prompts.items():
            t_hf, want = _best(lambda: ref.generate(ids, max_new_tokens=args.new, do_sample=False), args.repeats)
            default = {"max_new_tokens": args.new}
            chained = {"max_new_tokens": args.new, "speculation": chain}
            t_def, out = _best(lambda: model.generate(ids, return_dict_in_generate=True, **default), args.repeats,
                               lambda: ssmspec.calibrate(model, ids, **default))  # fmt: skip
            t_ch, out_ch = _best(lambda: model.generate(ids, return_dict_in_generate=True, **chained), args.repeats,
                                 lambda: ssmspec.calibrate(model, ids, **chained))  # fmt: skip
            exact = torch.equal(out.sequences, want) and torch.equal(out_ch.sequences, want)
            # a default call on a batch is HF's own generate (no spec_stats)
            accepted = getattr(out, "spec_stats", {}).get("mean_accepted_per_step")
            row = {"model": family, "prompt": kind, "hf_s": t_hf, "default_speedup": t_hf / t_def,
                   "default_accepted_per_step": accepted, "chain_speedup": t_hf / t_ch,
                   "chain_accepted_per_step": out_ch.spec_stats["mean_accepted_per_step"], "exact": exact}  # fmt: skip
            rows.append(row)
            print(f"{family:>6} {kind:>10} {t_hf:>7.2f} {row['default_speedup']:>7.2f}x "
                  f"{'HF' if accepted is None else f'{accepted:.2f}':>8} {row['chain_speedup']:>7.2f}x "
                  f"{row['chain_accepted_per_step']:>8.2f}{'' if exact else '  NOT EXACT'}", flush=True)  # fmt: skip
    desc = (f"random-init {args.layers} x {args.hidden}, float32, CPU {args.threads} threads, {args.new} new tokens, "
            f"best of {args.repeats}")  # fmt: skip
    print(desc)
    write_outputs({"setup": desc, "rows": rows}, args.json, None, None)


if __name__ == "__main__":
    main()
