"""Synthetic MTP checkpoints for the property suite: a tiny model of a family saved with `save_pretrained`, its
checkpoint given `mtp.*` tensors in that family's published layout (ssmspec.hf.mtp; random weights, per-expert
MoE names as released checkpoints store them), so that `from_pretrained` + `transform` go the real way: transformers
drops the tensors on load, ssmspec finds them in the checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ssmspec.hf import mtp as hf_mtp
from ssmspec.testing.configs import build_tiny_model

# the families whose MTP layout ssmspec builds, as ssmspec.testing.configs names them
MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h")


def random_mtp(model: nn.Module, seed: int = 0, std: float = 0.2) -> hf_mtp.MTPModule:
    """An MTP module of `model`'s family with random weights (norms near their identity)."""
    family = hf_mtp.family_of(model)
    torch.manual_seed(seed)
    if family in hf_mtp.QWEN:
        module: hf_mtp.MTPModule = hf_mtp.QwenMTP(model, *hf_mtp.QWEN[family])
    else:
        module = hf_mtp.NemotronHMTP(model, list(model.config.get_text_config().mtp_layers_block_type))
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.05 + (0.0 if _zero_centered(module, name) else 1.0))
            else:
                p.normal_(0.0, std)
    module.family = family
    return module.to(next(model.parameters()).dtype).eval()


def _zero_centered(module: nn.Module, name: str) -> bool:
    norm = module.get_submodule(name.rsplit(".", 1)[0])
    return type(norm).__name__.startswith("Qwen")


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert parameters (`...experts.gate_up_proj` [E, 2I, H], `...experts.{proj}` [E, out, in]) written as
    released checkpoints store them: `...experts.{e}.{gate,up,down}_proj.weight`."""
    out = {}
    for k, v in state.items():
        m = re.match(r"^(?P<pre>.*\.experts)\.(?P<proj>\w+)$", k)
        if not m:
            out[k] = v
            continue
        parts = {"gate_proj": v.chunk(2, dim=1)[0], "up_proj": v.chunk(2, dim=1)[1]} if m["proj"] == "gate_up_proj" \
            else {m["proj"]: v}  # fmt: skip
        for proj, w in parts.items():
            for e in range(w.shape[0]):
                out[f"{m['pre']}.{e}.{proj}.weight"] = w[e].contiguous()
    return out


def write_checkpoint(
    family: str, directory: str | Path, *, dtype: torch.dtype = torch.float64, seed: int = 0, variant: int = 0,
    mtp_seed: int = 1, drop: tuple[str, ...] = (), vocab_size: int = 96,
) -> Path:  # fmt: skip
    """Save a tiny `family` model to `directory` with random MTP tensors in its checkpoint (`mtp.*` names; `drop`:
    names left out, for refusal tests). Load it with `AutoModelForCausalLM.from_pretrained(directory)`."""
    from safetensors.torch import load_file, save_file

    model = build_tiny_model(family, dtype=dtype, seed=seed, seed_variant=variant, vocab_size=vocab_size)
    if family == "nemotron_h":
        model.config.num_nextn_predict_layers = 1
    out = Path(directory)
    model.save_pretrained(out)
    state = per_expert(hf_mtp.mtp_state(random_mtp(model, seed=mtp_seed)))
    state = {k: v for k, v in state.items() if k not in drop}
    weights = out / "model.safetensors"
    save_file({**load_file(str(weights)), **state}, str(weights), metadata={"format": "pt"})
    return out


__all__ = ["MTP_FAMILIES", "per_expert", "random_mtp", "write_checkpoint"]
