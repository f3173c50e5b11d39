"""Coupling to transformers for the multi-token-prediction (MTP) layers hybrid checkpoints ship and transformers
drops on load (`_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`): reading their tensors from a checkpoint and
building each family's MTP module from its published layout, with the family's own decoder-layer and norm classes.

An MTP step maps the target's feature h_i (its last hidden state after the final norm, the LM head's input) at
position i and the embedding of token i+1 to a hidden state whose logits under the target's LM head predict token
i+2: `x = proj(cat(norm_e(e), norm_h(h)))`, the family's decoder layer(s) at position i (attention over the MTP's
own K/V of earlier positions), a final norm. Its output is fed back as the next step's h (the engines' recursion
for k > 1 with one layer). The embedding, LM head and rotary embedding are the target's, shared, not copied.

Layouts (names as in the checkpoint, after its `mtp.` prefix; the layouts vLLM and SGLang load):
- Qwen3-Next, Qwen3.5 (dense and MoE): `fc` [H, 2H] over [embedding; hidden], `pre_fc_norm_embedding`,
  `pre_fc_norm_hidden`, `layers.0` (a full-attention decoder layer of the family), `norm`.
- Nemotron-H: `layers.{i}` one block per `mtp_layers_block_type` entry, the first holding the fusion
  (`enorm`, `hnorm`, `eh_proj` over [embedding; hidden]), the last the end norm (`final_layernorm`).

Private transformers API used here: the families' decoder-layer, block and RMSNorm classes and their forward
signatures, the attention layers' call `past_key_values.update(k, v, layer_idx)`, the base models' `rotary_emb`.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssmspec.errors import UnsupportedModelError
from ssmspec.hf.instance import execution_device

# an MTP tensor's name in a checkpoint: top-level `mtp.`, or under the language model of a multimodal checkpoint
MTP_KEY = re.compile(r"^(?:model\.language_model\.|language_model\.|model\.)?mtp\.(?P<name>.+)$")
# where save_pretrained of a transformed model writes its MTP tensors (found again by `read_mtp` on load)
MTP_FILE = "mtp.safetensors"
# families whose checkpoints ship MTP layers in a layout ssmspec does not build, and why
REFUSED = {
    "inkling": "Inkling's MTP is a chain of per-depth heads, each a decoder layer with short convolutions and its own "
    "attention and convolution caches (not built by ssmspec)",
    "olmo_hybrid": "OLMo-Hybrid has no published MTP layout",
}


def checkpoint_dir(model: nn.Module) -> Path | None:
    """The local directory `model` was loaded from (its config's `_name_or_path`), or None."""
    where = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    return Path(where) if where and Path(where).is_dir() else None


def _files(where: Path) -> list[Path]:
    if where.is_file():
        return [where]
    index = where / "model.safetensors.index.json"
    if index.exists():  # the index's shards, and the MTP file a transformed model's save_pretrained writes
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [where / s for s in shards] + ([where / MTP_FILE] if (where / MTP_FILE).exists() else [])
    return sorted(where.glob("*.safetensors"))


def read_mtp(where: str | Path) -> dict[str, torch.Tensor]:
    """The MTP tensors of a checkpoint directory (its safetensors index or files) or of one safetensors file, named
    without their `mtp.` prefix; empty where it has none."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in _files(Path(where)):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if m := MTP_KEY.match(key):
                    tensors[m["name"]] = f.get_tensor(key)
    return tensors


def _modeling(model: nn.Module):
    """The transformers modeling module of `model`'s family (through a transformed class too)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.models."):
            return sys.modules[cls.__module__]
    raise UnsupportedModelError(type(model).__name__, "MTP layers are built for transformers' own model classes")


def _base(model: nn.Module) -> nn.Module:
    base = model.base_model
    return getattr(base, "language_model", base)


def _layer_config(config, **overrides: Any):
    """A copy of the target's (text) config for the MTP's own layers, with SDPA or eager attention as the target's."""
    cfg = copy.deepcopy(config)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    if getattr(cfg, "_attn_implementation", None) not in ("eager", "sdpa"):
        cfg._attn_implementation = "sdpa"
    return cfg


def _merge_experts(tensors: dict[str, torch.Tensor], fused_gate_up: bool) -> dict[str, torch.Tensor]:
    """Per-expert weights (`...experts.{e}.{proj}.weight`) stacked into transformers' fused expert parameters
    (`...experts.{proj}` [E, out, in]; gate and up concatenated into `gate_up_proj` where `fused_gate_up`)."""
    per = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for k, v in tensors.items():
        if m := per.match(k):
            groups.setdefault((m["pre"], m["proj"]), {})[int(m["e"])] = v
        else:
            out[k] = v
    for (pre, proj), by_e in groups.items():
        if sorted(by_e) != list(range(len(by_e))):
            raise UnsupportedModelError("MTP", f"experts of {pre}.{proj} are not numbered 0..{len(by_e) - 1}")
        out[f"{pre}.{proj}"] = torch.stack([by_e[e] for e in range(len(by_e))])
    if fused_gate_up:
        for k in [k for k in out if k.endswith(".experts.gate_proj")]:
            pre = k[: -len("gate_proj")]
            if pre + "up_proj" in out:
                out[pre + "gate_up_proj"] = torch.cat([out.pop(k), out.pop(pre + "up_proj")], dim=1)
    return out


def _layer_count(tensors: Iterable[str]) -> int:
    return len({int(m[1]) for k in tensors if (m := re.match(r"^layers\.(\d+)\.", k))})


class MTPModule(nn.Module):
    """One family's MTP step (module docstring): `forward(hidden, embedded, position_ids, attention_mask, cache)`
    -> the output hidden [B, Q, H] (the LM head's input, and the next step's hidden). Its state dict holds exactly
    the checkpoint's MTP tensors (names after `mtp.`)."""

    family: str = ""

    def __init__(self, rotary: nn.Module | None) -> None:
        super().__init__()
        self.__dict__["rotary"] = rotary  # the target's (not a submodule: the state dict stays the MTP's)

    def fuse(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def blocks(self, x, position_ids, attention_mask, cache) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, hidden, embedded, position_ids, attention_mask, cache) -> torch.Tensor:
        return self.blocks(self.fuse(hidden, embedded), position_ids, attention_mask, cache)


class QwenMTP(MTPModule):
    """Qwen3-Next / Qwen3.5 (dense, MoE): `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.0` (a
    full-attention decoder layer of the family, MoE or dense MLP as its config makes layer 0), `norm`."""

    def __init__(self, model: nn.Module, layer_cls: str, norm_cls: str, mrope: bool, moe: bool | None = None) -> None:
        config = model.config.get_text_config()
        super().__init__(_base(model).rotary_emb)
        mod, h, eps = _modeling(model), config.hidden_size, config.rms_norm_eps
        cfg = _layer_config(config, layer_types=["full_attention"], num_hidden_layers=1)
        if hasattr(cfg, "mlp_only_layers"):  # (Qwen3-Next) layer 0 gets the MLP kind the checkpoint holds
            moe = bool(getattr(cfg, "num_experts", 0)) if moe is None else moe
            cfg.mlp_only_layers, cfg.decoder_sparse_step = ([] if moe else [0]), 1
        norm = getattr(mod, norm_cls)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm(h, eps=eps)
        self.pre_fc_norm_hidden = norm(h, eps=eps)
        self.layers = nn.ModuleList([getattr(mod, layer_cls)(cfg, 0)])
        self.norm = norm(h, eps=eps)
        self.mrope = mrope

    def fuse(self, hidden, embedded):
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def blocks(self, x, position_ids, attention_mask, cache):
        rotary_ids = position_ids[None].expand(3, *position_ids.shape) if self.mrope else position_ids
        embeddings = self.rotary(x, rotary_ids)
        for layer in self.layers:
            x = layer(x, position_embeddings=embeddings, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=cache)  # fmt: skip
            x = x[0] if isinstance(x, tuple) else x
        return self.norm(x)


class NemotronHMTP(MTPModule):
    """Nemotron-H: `layers.{i}`, one NemotronHBlock per `mtp_layers_block_type` entry (attention without positions,
    MoE, ...), the first with the fusion (`enorm`, `hnorm`, `eh_proj`), the last with `final_layernorm`."""

    def __init__(self, model: nn.Module, types: list[str]) -> None:
        config = model.config.get_text_config()
        super().__init__(None)
        mod, h, eps = _modeling(model), config.hidden_size, config.layer_norm_epsilon
        cfg = _layer_config(config, layer_types=list(types))
        self.layers = nn.ModuleList([mod.NemotronHBlock(cfg, i) for i in range(len(types))])
        first, last = self.layers[0], self.layers[-1]
        first.add_module("enorm", mod.NemotronHRMSNorm(h, eps=eps))
        first.add_module("hnorm", mod.NemotronHRMSNorm(h, eps=eps))
        first.add_module("eh_proj", nn.Linear(2 * h, h, bias=False))
        last.add_module("final_layernorm", mod.NemotronHRMSNorm(h, eps=eps))

    def fuse(self, hidden, embedded):
        first = self.layers[0]
        return first.eh_proj(torch.cat([first.enorm(embedded), first.hnorm(hidden)], dim=-1))

    def blocks(self, x, position_ids, attention_mask, cache):
        for block in self.layers:
            x = block(x, past_key_values=cache, attention_mask=attention_mask, position_ids=position_ids)
            x = x[0] if isinstance(x, tuple) else x
        return self.layers[-1].final_layernorm(x)


QWEN = {
    "qwen3_next": ("Qwen3NextDecoderLayer", "Qwen3NextRMSNorm", False),
    "qwen3_5_text": ("Qwen3_5DecoderLayer", "Qwen3_5RMSNorm", True),
    "qwen3_5_moe_text": ("Qwen3_5MoeDecoderLayer", "Qwen3_5MoeRMSNorm", True),
}
FAMILIES = (*QWEN, "nemotron_h")
# the Nemotron-H block types an MTP layer may hold here (a Mamba2 block would need a recurrent cache of its own)
NEMOTRON_BLOCKS = frozenset({"full_attention", "moe", "mlp"})


def family_of(model: nn.Module) -> str:
    """The model's (text) model type, as the MTP layouts are keyed."""
    return str(model.config.get_text_config().model_type)


def build(model: nn.Module, tensors: dict[str, torch.Tensor]) -> MTPModule:
    """The model's MTP module with `tensors` (names after `mtp.`) loaded, in the target's dtype, where its LM head
    computes. UnsupportedModelError naming the family, the missing or unexpected tensors, or the layer count."""
    family = family_of(model)
    name = type(model).__name__
    if family in REFUSED:
        raise UnsupportedModelError(name, f"its MTP layers cannot be drafted with: {REFUSED[family]}")
    if family not in FAMILIES:
        raise UnsupportedModelError(name, f"no MTP layout is known for model type {family!r} (known: {FAMILIES})")
    layers = _layer_count(tensors)
    if family in QWEN:
        if layers != 1:
            raise UnsupportedModelError(name, f"its checkpoint has {layers} MTP layers: ssmspec drafts with exactly 1")
        module: MTPModule = QwenMTP(model, *QWEN[family], moe=any(k.startswith("layers.0.mlp.gate.") for k in tensors))
    else:
        types = list(model.config.get_text_config().mtp_layers_block_type or [])
        if layers != len(types):
            raise UnsupportedModelError(
                name, f"its checkpoint has {layers} MTP blocks, its config's mtp_layers_block_type names {len(types)}"
            )
        if other := sorted(set(types) - NEMOTRON_BLOCKS):
            raise UnsupportedModelError(
                name, f"its MTP blocks include {other}: ssmspec builds {sorted(NEMOTRON_BLOCKS)} blocks (no recurrent "
                "state in the MTP layer)",
            )  # fmt: skip
        module = NemotronHMTP(model, types)
    module.family = family
    state = _merge_experts(tensors, fused_gate_up=family in QWEN)
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        parts = ([f"missing mtp.{', mtp.'.join(missing[:8])}"] if missing else []) + (
            [f"unexpected mtp.{', mtp.'.join(unexpected[:8])}"] if unexpected else [])  # fmt: skip
        raise UnsupportedModelError(
            name,
            f"its MTP tensors are not the {family} layout: {'; '.join(parts)} (transform(model, "
            "draft_head=None) leaves them out)",
        )
    wrong = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if wrong:
        shapes = ", ".join(f"mtp.{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}" for k in wrong[:4])
        raise UnsupportedModelError(name, f"its MTP tensors do not fit the model: {shapes}")
    head = model.get_output_embeddings()
    module.load_state_dict(state)
    if head.weight.dtype == torch.float64:  # HF's grouped_mm experts take no float64: its eager experts do
        for cfg in {id(m.config): m.config for m in module.modules() if hasattr(m, "config")}.values():
            if getattr(cfg, "_experts_implementation", None) == "grouped_mm":
                cfg._experts_implementation = "eager"
    # where the LM head computes (an offloaded head's weights sit on the meta device between forwards)
    return module.to(device=execution_device(head), dtype=head.weight.dtype).eval()


def size_share(module: nn.Module, model: nn.Module) -> float:
    """A head's (an MTP layer's, a draft head's) parameters as a share of the model's (what one drafted level costs
    against a decode step, roughly: the head runs once per level, the model's every layer once per step)."""
    return sum(p.numel() for p in module.parameters()) / max(1, sum(p.numel() for p in model.parameters()))


def mtp_state(module: MTPModule) -> dict[str, torch.Tensor]:
    """The module's tensors as a checkpoint stores them (`mtp.` names; fused experts as transformers holds them)."""
    return {f"mtp.{k}": v.detach().contiguous().cpu() for k, v in module.state_dict().items()}


__all__ = ["FAMILIES", "MTP_FILE", "MTP_KEY", "MTPModule", "REFUSED", "build", "checkpoint_dir", "family_of",
           "mtp_state", "read_mtp", "size_share"]  # fmt: skip
