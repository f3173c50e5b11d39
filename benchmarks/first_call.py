"""The first call on a freshly transformed model against the same call once the model is calibrated, side by side in
one run: the embedded target's default call (its draft head), `--tokens` new tokens per row on held-out prompts, per
batch size. Reported per batch size: the first call, the second, a calibrated call (`ssmspec.calibrate` first), the
first call of a fresh copy that finds the calibration on disk (as a later process does), and the seconds each call
spent measuring (spec_stats["calibration_seconds"]). Outputs are asserted identical to HF greedy.

    python benchmarks/first_call.py --json docs/data/first_call.json
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

import torch
from _timing import provenance

import ssmspec
from ssmspec import models
from ssmspec.bench import batch_prompts, write_json
from ssmspec.speculate import calibration


def timed(model, ids, new: int):
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, eos_token_id=None, return_dict_in_generate=True)
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3, help="fresh models per batch size (the median is reported)")
    p.add_argument("--json")
    args = p.parse_args()
    ref, tok = models.load("mamba2-target")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for batch in args.batch:
            ids = torch.stack(batch_prompts(tok, batch, args.prompt_tokens))
            want = ref.generate(ids, max_new_tokens=args.tokens, eos_token_id=None, do_sample=False)
            runs = []
            for repeat in range(args.repeats):
                os.environ[calibration.CALIBRATION_DIR] = "off"  # a first call: nothing on disk
                model = ssmspec.transform(copy.deepcopy(ref))
                first, out1 = timed(model, ids, args.tokens)
                second, out2 = timed(model, ids, args.tokens)
                os.environ[calibration.CALIBRATION_DIR] = f"{cache}/{batch}-{repeat}"
                ssmspec.calibrate(model, ids, max_new_tokens=args.tokens, eos_token_id=None)
                calibrated, out3 = timed(model, ids, args.tokens)
                fresh = ssmspec.transform(copy.deepcopy(ref))  # a later process: the calibration on disk
                from_disk, out4 = timed(fresh, ids, args.tokens)
                for out in (out1, out2, out3, out4):
                    assert torch.equal(out.sequences, want)
                runs.append({
                    "first_s": first, "second_s": second, "calibrated_s": calibrated, "from_disk_s": from_disk,
                    "first_calibration_s": out1.spec_stats["calibration_seconds"],
                    "second_calibration_s": out2.spec_stats["calibration_seconds"],
                    "from_disk_calibration_s": out4.spec_stats["calibration_seconds"],
                })  # fmt: skip
            row = {"batch": batch, **{k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}}
            row["first_over_calibrated"] = row["first_s"] / row["calibrated_s"]
            row["from_disk_over_calibrated"] = row["from_disk_s"] / row["calibrated_s"]
            row["first_calibration_share"] = row["first_calibration_s"] / row["first_s"]
            rows.append(row)
            print(f"batch {batch:>2}: first call {row['first_s']:.2f} s ({100 * row['first_calibration_share']:.1f}% "
                  f"measuring), second {row['second_s']:.2f} s, calibrated {row['calibrated_s']:.2f} s, a fresh copy "
                  f"with the calibration on disk {row['from_disk_s']:.2f} s: first / calibrated "
                  f"{row['first_over_calibrated']:.2f}x, from disk / calibrated "
                  f"{row['from_disk_over_calibrated']:.2f}x",
                  flush=True)  # fmt: skip
    if args.json:
        setup = (f"embedded mamba2-target with its draft head, CPU {torch.get_num_threads()} threads, float32, "
                 f"batches of different held-out prompts x {args.prompt_tokens} tokens, {args.tokens} new tokens per "
                 f"row, the default call, medians of {args.repeats} fresh models")  # fmt: skip
        batches = " ".join(map(str, args.batch))
        command = f"python benchmarks/first_call.py --batch {batches} --tokens {args.tokens}"
        result = {"setup": setup, **provenance(command), "rows": rows}
        write_json(result, args.json)


if __name__ == "__main__":
    main()
