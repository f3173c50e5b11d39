"""Train the embedded default models on an offline real-text corpus: the Python standard library's source.

Reproducible (fixed seeds, fixed step counts, deterministic file split) and CPU-only: a byte-level BPE
tokenizer (2048 tokens), a Mamba2 target, a smaller Mamba2 draft and a Bamba hybrid (Mamba2 + attention).
Weights are saved in fp16 safetensors under ssmspec/models/<name>/ with the tokenizer in HF format, loadable
with the usual from_pretrained calls; held-out bits per byte go to ssmspec/models/report.json.

    python benchmarks/train_tiny.py                 # about 35 minutes on 2 CPU cores
    python benchmarks/train_tiny.py --steps-scale 0.05 --out /tmp/models   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import BambaConfig, BambaForCausalLM, Mamba2Config, Mamba2ForCausalLM, PreTrainedTokenizerFast

from ssmspec.models import corpus_files

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>"]  # ids 0, 1, 2: the convention used across ssmspec's tests
VOCAB = 2048
SEQ = 256


def train_tokenizer(files: list[Path], out: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train([str(p) for p in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2])  # fmt: skip
    fast.save_pretrained(out)
    return fast


def encode(tok: PreTrainedTokenizerFast, files: list[Path]) -> tuple[torch.Tensor, int]:
    ids, nbytes = [], 0
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        nbytes += len(text.encode("utf-8"))
        ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids, dtype=torch.long), nbytes


def configs() -> dict[str, tuple[type, object, int]]:
    """name -> (model class, config, training steps)."""
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=VOCAB, tie_word_embeddings=True)
    target = Mamba2Config(hidden_size=256, num_hidden_layers=6, state_size=32, head_dim=32, num_heads=16,
                          n_groups=1, expand=2, chunk_size=64, **ids)  # fmt: skip
    draft = Mamba2Config(hidden_size=128, num_hidden_layers=2, state_size=32, head_dim=32, num_heads=8,
                         n_groups=1, expand=2, chunk_size=64, **ids)  # fmt: skip
    hybrid = BambaConfig(hidden_size=192, num_hidden_layers=4, intermediate_size=384, num_attention_heads=6,
                         num_key_value_heads=2, mamba_n_heads=12, mamba_d_head=32, mamba_d_state=32,
                         mamba_n_groups=1, mamba_chunk_size=64, attn_layer_indices=[2],
                         max_position_embeddings=4096, **ids)  # fmt: skip
    return {
        "mamba2-target": (Mamba2ForCausalLM, target, 520),
        "mamba2-draft": (Mamba2ForCausalLM, draft, 700),
        "bamba-hybrid": (BambaForCausalLM, hybrid, 520),
    }


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, ids: torch.Tensor, nbytes: int) -> float:
    """Held-out bits per byte: summed next-token NLL over non-overlapping windows / ln 2 / bytes."""
    model.eval()
    nll = 0.0
    for start in range(0, len(ids) - 1, SEQ):
        x = ids[start : start + SEQ + 1][None]
        if x.shape[1] < 2:
            break
        logits = model(x[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
    return nll / math.log(2) / nbytes


def train(name, cls, cfg, steps, data, batch, lr, seed) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = cls(cfg).float().train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    t0, losses = time.time(), []
    for step in range(steps):
        starts = [rng.randrange(0, len(data) - SEQ - 1) for _ in range(batch)]
        x = torch.stack([data[s : s + SEQ + 1] for s in starts])
        logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"{name} step {step}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)  # fmt: skip
    return model, {"params": params, "steps": steps, "batch": batch, "seq": SEQ, "train_seconds": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "ssmspec" / "models"))
    p.add_argument("--steps-scale", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--only", nargs="*", help="train only these models")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    train_files, held_files = corpus_files()
    tok = train_tokenizer(train_files, out / "tokenizer")
    data, _ = encode(tok, train_files)
    held, held_bytes = encode(tok, held_files)
    print(f"corpus: {len(train_files)} files, {len(data)} tokens; held out: {len(held_files)} files, "
          f"{len(held)} tokens, {held_bytes} bytes", flush=True)  # fmt: skip
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    report["corpus"] = {"train_files": len(train_files), "train_tokens": len(data), "held_out_files": len(held_files),
                        "held_out_bytes": held_bytes, "source": "Python standard library top-level *.py"}  # fmt: skip
    for name, (cls, cfg, steps) in configs().items():
        if args.only and name not in args.only:
            continue
        model, info = train(name, cls, cfg, max(1, int(steps * args.steps_scale)), data, args.batch, args.lr, 0)
        info["held_out_bits_per_byte"] = bits_per_byte(model, held, held_bytes)
        print(f"{name}: {info}", flush=True)
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
        model.generation_config.bos_token_id = 1
        model.half().save_pretrained(out / name, safe_serialization=True)
        tok.save_pretrained(out / name)
        report[name] = info
        report_path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
