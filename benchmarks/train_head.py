"""Train the draft head (EAGLE style, ssmspec.speculate.drafters.head) of an embedded model on its own outputs over
its training corpus (the Python standard library's source, the split the model was trained on), and save it beside
the model's checkpoint, where `ssmspec.transform` finds it. The training is `ssmspec train-head`'s
(ssmspec.speculate.head_training.train_head); reproducible (fixed seed, fixed steps) and CPU-only; reports how well
the head predicts the model's next distribution on the held-out files.

    python benchmarks/train_head.py                        # mamba2-target: about 6 minutes on 2 CPU cores
    python benchmarks/train_head.py --target nemotron-medium   # about 25 minutes on 2 CPU cores
    python benchmarks/train_head.py --steps 200 --tokens 50000 --out /tmp/head   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ssmspec import models
from ssmspec.speculate.head_training import collect, train_head


@torch.no_grad()
def agreement(model, head, data: dict, temperature: float = 0.7, top_p: float = 0.95) -> dict:
    """On held-out positions: the chance that one token sampled from the head's processed distribution is
    accepted by speculative sampling (1 - total variation to the target's, temperature and top-p both sides), one
    and two levels deep, and how often the head's argmax is the target's (greedy)."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    warp = [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)]

    def dist(logits):  # HF's warpers take [positions, vocab]
        logits = logits.reshape(-1, logits.shape[-1])
        for w in warp:
            logits = w(None, logits)
        return logits.softmax(-1)

    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    feats, tokens = data["features"].float(), data["tokens"]
    target = lm_head(feats)  # the target's own logits at every position (its LM head on its features)
    out, f = {}, feats[:, :-2]
    for depth in (1, 2):
        f = head(f, embed(tokens[:, depth : tokens.shape[1] - 2 + depth]))
        q, p = lm_head(f), target[:, depth : tokens.shape[1] - 2 + depth]
        out[f"accept_depth{depth}"] = round(float(torch.minimum(dist(p), dist(q)).sum(-1).mean()), 3)
        out[f"argmax_depth{depth}"] = round(float((q.argmax(-1) == p.argmax(-1)).float().mean()), 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="mamba2-target", choices=models.NAMES)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--tokens", type=int, default=600_000, help="training positions (target forwards over them)")
    p.add_argument("--out", help="where to save (default: beside the target)")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = models.load(args.target)
    model = model.float().eval()
    # the files the target was trained on (a model trained on the whole library: its split of it)
    train, held = models.corpus_files(models.report()[args.target].get("corpus", {}).get("whole_library", False))
    t0 = time.perf_counter()
    data = collect(model, (tok(f.read_text(errors="ignore")).input_ids for f in train), max_tokens=args.tokens,
                   progress=True)  # fmt: skip
    head = train_head(model, data, steps=args.steps, progress=True)
    out = args.out or str(models.path(args.target))
    head.save(out, target=args.target)  # kept even if the evaluation below fails; rewritten with its results
    test = collect(model, (tok(f.read_text(errors="ignore")).input_ids for f in held), max_tokens=40_000)
    quality = agreement(model, head, test)
    about = {"target": args.target, "trained_on": f"{data['tokens'].numel()} positions of the target's training split",
             **head.trained, "held_out": quality, "total_seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    head.half().save(out, **about)
    print(json.dumps(about, indent=2))


if __name__ == "__main__":
    main()
