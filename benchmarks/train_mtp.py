"""Train an embedded Nemotron-H hybrid with its multi-token-prediction (MTP) layer, as Nemotron 3 checkpoints ship
one, on the same tokenizer as the other embedded models and the Python standard library's source: `nemotron-mtp`
(2.2M parameters, the library's top-level modules) or `nemotron-medium` (20M parameters, float32 weights over
twice this CPU's 32 MiB last-level cache so that its decode step reads them from memory as real models' steps do;
trained on the whole library).

The target (Mamba2, attention and MLP blocks) and its MTP layer (an attention block and a MoE block, the
`mtp_layers_block_type` Nemotron 3 publishes) are trained together, as DeepSeek-V3 trains its MTP modules: the
target's next-token loss plus 0.3 x the MTP layer's loss on the token after next, from the target's features and
the next token's embedding (ssmspec.hf.mtp). The checkpoint is saved as a real one: `save_pretrained`'s weights
with the MTP tensors added under `mtp.*` in the published per-expert names, which transformers drops on load and
`ssmspec.transform` finds. Held-out bits per byte and the MTP layer's held-out top-1 accuracy go to
ssmspec/models/report.json.

    python benchmarks/train_mtp.py                  # nemotron-mtp: about 11 minutes on 2 CPU cores
    python benchmarks/train_mtp.py --size medium    # nemotron-medium: about an hour on 2 CPU cores
    python benchmarks/train_mtp.py --steps 20 --out /tmp/models   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from train_tiny import SEQ, bits_per_byte, encode
from transformers import NemotronHConfig, NemotronHForCausalLM, PreTrainedTokenizerFast

from ssmspec.hf import mtp as hf_mtp
from ssmspec.models import ROOT, corpus_files
from ssmspec.testing.mtp import per_expert

MTP_WEIGHT = 0.3
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=2048, tie_word_embeddings=True)


def nemotron_h(blocks: list[str], **sizes) -> NemotronHConfig:
    """A Nemotron-H of these blocks and sizes with one MTP layer (an attention and a MoE block), the settings both
    embedded Nemotron-H models share."""
    return NemotronHConfig(
        layers_block_type=blocks, num_key_value_heads=2, mamba_head_dim=64, n_groups=1, expand=2, conv_kernel=4,
        chunk_size=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, num_nextn_predict_layers=1,
        mtp_layers_block_type=["full_attention", "moe"], max_position_embeddings=4096, **IDS, **sizes,
    )  # fmt: skip


def small() -> NemotronHConfig:
    """A 2.2M-parameter Nemotron-H of 20 blocks (10 Mamba2, 8 MLP, 2 attention, the pattern of the released models)
    with one MTP layer (attention and MoE blocks, 0.2M parameters: under a tenth of the model, as in released
    checkpoints, where one MTP layer sits beside dozens of blocks)."""
    blocks = ["linear_attention", "mlp"] * 10
    blocks[5] = blocks[13] = "full_attention"
    return nemotron_h(blocks, hidden_size=128, num_attention_heads=4, head_dim=32, intermediate_size=256,
                      mamba_num_heads=4, ssm_state_size=32, moe_intermediate_size=96,
                      moe_shared_expert_intermediate_size=96)  # fmt: skip


def medium() -> NemotronHConfig:
    """A 20M-parameter Nemotron-H of 14 blocks in the released models' order (Mamba2 blocks each followed by an MLP,
    an attention block after every third Mamba2 block) with one MTP layer (attention and MoE, under a tenth of the
    model)."""
    blocks = ["linear_attention", "mlp"] * 6
    blocks[5:5] = ["full_attention"]
    blocks[12:12] = ["full_attention"]
    return nemotron_h(blocks, hidden_size=512, num_attention_heads=8, head_dim=64, intermediate_size=1024,
                      mamba_num_heads=16, ssm_state_size=64, moe_intermediate_size=128,
                      moe_shared_expert_intermediate_size=128)  # fmt: skip


# --size -> (name, config, training steps, learning rate, whole library as the corpus)
SIZES = {"small": ("nemotron-mtp", small, 600, 3e-3, False), "medium": ("nemotron-medium", medium, 480, 1.5e-3, True)}


def causal(n: int) -> torch.Tensor:
    return torch.full((1, 1, n, n), torch.finfo(torch.float32).min).triu(1)


def losses(model, mtp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the target's next-token loss, the MTP layer's loss on the token after next, its top-1 hits) on x [B, T+1]."""
    features = model.base_model(x[:, :-1]).last_hidden_state  # after the final norm: the LM head's input
    logits = model.lm_head(features)
    main = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    n = x.shape[1] - 2
    embedded = model.get_input_embeddings()(x[:, 1:-1])
    positions = torch.arange(n)[None].expand(x.shape[0], n)
    out = mtp(features[:, :-1], embedded, positions, causal(n), None)
    mtp_logits = model.lm_head(out)
    mtp_loss = torch.nn.functional.cross_entropy(mtp_logits.flatten(0, 1), x[:, 2:].flatten())
    hits = (mtp_logits.argmax(-1) == x[:, 2:]).float().mean()
    return main, mtp_loss, hits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--out", default=str(ROOT))
    p.add_argument("--steps", type=int, help="training steps (default: the size's)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, help="peak learning rate (default: the size's)")
    args = p.parse_args()
    name, config, steps, lr, recursive = SIZES[args.size]
    args.steps, args.lr = args.steps or steps, args.lr or lr
    out = Path(args.out)
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)
    tok = PreTrainedTokenizerFast.from_pretrained(ROOT / "tokenizer")
    train_files, held_files = corpus_files(recursive)
    data, _ = encode(tok, train_files)
    held, held_bytes = encode(tok, held_files)
    torch.manual_seed(0)
    rng = random.Random(0)
    model = NemotronHForCausalLM(config()).float().train()
    model.set_experts_implementation("eager")
    mtp = hf_mtp.NemotronHMTP(model, list(model.config.mtp_layers_block_type)).float().train()
    mtp.apply(model._init_weights)  # (built outside the model: its experts' parameters start uninitialised)
    params = list(model.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    t0, seen = time.time(), []
    for step in range(args.steps):
        starts = [rng.randrange(0, len(data) - SEQ - 1) for _ in range(args.batch)]
        x = torch.stack([data[s : s + SEQ + 1] for s in starts])
        main_loss, mtp_loss, hits = losses(model, mtp, x)
        (main_loss + MTP_WEIGHT * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        seen.append((main_loss.item(), mtp_loss.item(), hits.item()))
        if step % 50 == 0 or step == args.steps - 1:
            last = seen[-50:]
            print(f"step {step}/{args.steps} loss {sum(s[0] for s in last) / len(last):.3f} mtp "
                  f"{sum(s[1] for s in last) / len(last):.3f} top-1 {sum(s[2] for s in last) / len(last):.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)  # fmt: skip
    train_seconds = time.time() - t0
    model.eval()
    mtp.eval()
    with torch.no_grad():
        windows = [held[s : s + SEQ + 1] for s in range(0, len(held) - SEQ - 1, SEQ)]
        mtp_hits = sum(losses(model, mtp, w[None])[2].item() for w in windows) / len(windows)
    mtp.family = "nemotron_h"
    info = {
        "params": sum(p.numel() for p in model.parameters()), "mtp_params": sum(p.numel() for p in mtp.parameters()),
        "steps": args.steps, "batch": args.batch, "seq": SEQ, "mtp_loss_weight": MTP_WEIGHT,
        "train_seconds": train_seconds, "held_out_bits_per_byte": bits_per_byte(model, held, held_bytes),
        "held_out_mtp_top1": mtp_hits, "layers_block_type": model.config.layers_block_type,
        "mtp_layers_block_type": model.config.mtp_layers_block_type, "lr": args.lr,
        "corpus": {"files": len(train_files), "tokens": len(data), "held_out_files": len(held_files),
                   "source": "Python standard library, " + ("whole" if recursive else "top-level") + " *.py",
                   "whole_library": recursive},
    }  # fmt: skip
    print(f"{name}: {info}", flush=True)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    model.generation_config.bos_token_id = 1
    where = out / name
    model.half().save_pretrained(where, safe_serialization=True)
    tok.save_pretrained(where)
    from safetensors.torch import load_file, save_file

    weights = where / "model.safetensors"
    state = per_expert(hf_mtp.mtp_state(mtp.half()))  # the published names: experts one by one
    save_file({**load_file(str(weights)), **state}, str(weights), metadata={"format": "pt"})
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    report[name] = info
    report_path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
