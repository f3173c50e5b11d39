"""Training a draft head (ssmspec.speculate.drafters.head) for one target, on the target's own outputs.

The target runs over the training text once (plain forwards, chunks of `seq_len` tokens); at every position its
feature (ssmspec.hf.features), the token, and the `topk` most likely next tokens with their log-probabilities are
kept. The head then learns, at every position t and for `unroll` steps fed its own predictions (as it drafts),
f_hat(t+1) = head(f_hat(t), e(x_(t+1))) with f_hat(t) = f(t):
    loss = cross-entropy(target's distribution of token t+2 on its top-k, the LM head's softmax of f_hat(t+1))
           + 0.1 smooth-L1(f_hat(t+1), f(t+1)),
the target's LM head and embedding frozen (EAGLE's objective, distilled on the target's distribution rather than on
the text's tokens: a head that predicts the target's next distribution is what speculative sampling accepts).

    head = train_head(model, [tokenizer(text).input_ids for text in texts], steps=3000)
    head.save(checkpoint_dir, trained_on="...")    # ssmspec.transform(model) then finds it there
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ssmspec.hf import features as hf_features
from ssmspec.hf import instance as hf_instance
from ssmspec.speculate.drafters.head import DraftHead


@torch.no_grad()
def collect(
    model: nn.Module, sequences: Iterable[Sequence[int] | torch.Tensor], *, seq_len: int = 256, topk: int = 64,
    max_tokens: int | None = None, progress: bool = False,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The target's features, tokens and top-k next-token log-probabilities over `sequences`, cut into chunks of
    `seq_len` tokens (shorter remainders dropped), up to `max_tokens`. Returns {"features": [C, L, H] float16,
    "tokens": [C, L] long, "top_ids": [C, L, K] long, "top_logp": [C, L, K] float16}."""
    from tqdm.auto import tqdm

    device = hf_instance.input_device(model)
    out: dict[str, list] = {"features": [], "tokens": [], "top_ids": [], "top_logp": []}
    seen = 0
    bar = tqdm(total=max_tokens, desc="target features", unit="tok", disable=not progress)
    was_training = model.training
    model.eval()
    try:
        for seq in sequences:
            ids = torch.as_tensor(seq, dtype=torch.long).flatten()
            for start in range(0, ids.numel() - seq_len + 1, seq_len):
                chunk = ids[start : start + seq_len][None].to(device)
                with hf_features.capturing(model) as capture:
                    logits = model(input_ids=chunk, use_cache=False).logits
                feats = hf_features.positions(capture, logits)
                logp = logits.float().log_softmax(-1)
                top_logp, top_ids = logp.topk(min(topk, logp.shape[-1]), dim=-1)
                out["features"].append(feats[0].half().cpu())
                out["tokens"].append(chunk[0].cpu())
                out["top_ids"].append(top_ids[0].cpu())
                out["top_logp"].append(top_logp[0].half().cpu())
                seen += seq_len
                bar.update(seq_len)
                if max_tokens is not None and seen >= max_tokens:
                    break
            if max_tokens is not None and seen >= max_tokens:
                break
    finally:
        model.train(was_training)
        bar.close()
    if not out["tokens"]:
        raise ValueError(f"no sequence holds {seq_len} tokens: nothing to train a draft head on")
    return {k: torch.stack(v) for k, v in out.items()}


def head_loss(
    head: DraftHead, embed: nn.Module, lm_head: nn.Module, data: dict[str, torch.Tensor], chunks: torch.Tensor,
    starts: torch.Tensor, unroll: int,
) -> torch.Tensor:  # fmt: skip
    """The training loss (module docstring) at positions `starts` of chunks `chunks`, `unroll` steps deep."""
    f = data["features"][chunks, starts].float()
    loss = f.new_zeros(())
    device = hf_instance.execution_device(embed)
    for u in range(unroll):
        at = starts + u + 1  # the token fed, whose feature is predicted
        f = head(f, embed(data["tokens"][chunks, at].to(device)).float())
        logq = F.log_softmax(lm_head(f.to(lm_head.weight.dtype)).float(), dim=-1)
        p = data["top_logp"][chunks, at].float().softmax(-1)  # the target's next distribution, on its top-k
        loss = loss - (p * logq.gather(-1, data["top_ids"][chunks, at])).sum(-1).mean()
        loss = loss + 0.1 * F.smooth_l1_loss(f, data["features"][chunks, at].float())
    return loss / unroll


def train_head(
    model: nn.Module, sequences: Iterable[Sequence[int] | torch.Tensor] | dict[str, torch.Tensor], *,
    steps: int = 3000, batch_size: int = 1024, lr: float = 2e-3, inner_size: int | None = None, unroll: int = 2,
    seq_len: int = 256, topk: int = 64, max_tokens: int | None = None, seed: int = 0, progress: bool = False,
) -> DraftHead:  # fmt: skip
    """A draft head for `model` trained on its outputs over `sequences` (token ids; or what `collect` returned).
    AdamW with a one-cycle schedule, `steps` batches of `batch_size` positions drawn at random (seeded); the
    model is not changed. Returns the head in float32, in eval mode."""
    from tqdm.auto import tqdm

    data = sequences if isinstance(sequences, dict) else collect(
        model, sequences, seq_len=seq_len, topk=topk, max_tokens=max_tokens, progress=progress)  # fmt: skip
    chunks, length = data["tokens"].shape
    if length < unroll + 1:
        raise ValueError(f"chunks of {length} tokens are too short for {unroll} unrolled steps")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = DraftHead.for_model(model, inner_size).float().train()
    embed, lm_head = model.get_input_embeddings(), hf_features.lm_head(model)
    frozen = [(p, p.requires_grad) for p in (*embed.parameters(), *lm_head.parameters())]
    for p, _ in frozen:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1))
    bar = tqdm(range(steps), desc="draft head", disable=not progress)
    t0, last = time.perf_counter(), math.nan
    try:
        for _ in bar:
            rows = torch.randint(0, chunks, (batch_size,), generator=gen)
            starts = torch.randint(0, length - unroll, (batch_size,), generator=gen)
            loss = head_loss(head, embed, lm_head, data, rows, starts, unroll)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            last = float(loss.detach())
            bar.set_postfix(loss=f"{last:.3f}")
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    head.trained = {"steps": steps, "positions": chunks * length, "final_loss": last,
                    "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    return head.eval()
