"""Tiny, deterministic Hugging Face configs and models for SSM / hybrid families.

The configs built here are the smallest sizes that still exercise each architecture:
hidden size 32-48 (64 for xLSTM), 2-4 layers, and for hybrid families at least one attention layer
*and* at least one SSM / linear-attention / short-conv layer. MoE families use four
tiny experts with top-2 routing. Everything is built from configs only (no hub access).

``seed_variant`` deterministically varies a few structural knobs (layer count, heads,
SSM groups, ...) so property tests can cover several shapes; variant ``0`` is always
the smallest. All token ids (pad 0, bos 1, eos 2) are valid for any ``vocab_size >= 3``;
``tie_word_embeddings`` is left at each family's default.

Notes on the models returned by :func:`build_tiny_model` (transformers 5.23):

* Attention uses ``attn_implementation="sdpa"`` where supported (eager's softmax is float32 even in
  float64). MoE families get ``set_experts_implementation("eager")`` because the default ``grouped_mm`` rejects float64.
* Weights are drawn in float32 under ``torch.manual_seed(seed)`` and then cast, so the
  same seed gives the same (rounded) weights in every dtype.
* "float64" is not float64 end to end: HF RMSNorm / softmax / RoPE / SSM scans upcast to
  float32 internally, and Mamba-1/2 heads return float32 logits. Cached decoding matches a
  full forward only to ~1e-7, so compare logits with a tolerance (or compare greedy tokens).
* Bamba's default ``position_ids`` ignore the cache offset; pass ``position_ids``
  explicitly when decoding with a cache outside ``generate``.
* No supported family zero-initialises a whole weight matrix in 5.23; the re-init of
  all-zero matrices is a guard for future versions (it only fires for xLSTM's gate
  pre-activations and up-projection, which would otherwise make those paths constant).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

SUPPORTED_FAMILIES: tuple[str, ...] = (
    "mamba",
    "falcon_mamba",
    "mamba2",
    "jamba",
    "bamba",
    "zamba2",
    "falcon_h1",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
    "qwen3_5",
    "olmo_hybrid",
    "kimi_linear",
    "lfm2",
    "lfm2_moe",
)

UNSUPPORTED_FAMILIES: tuple[str, ...] = ("zamba", "rwkv", "recurrent_gemma", "xlstm")

_TOKEN_IDS: dict[str, int] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# Families whose feed-forward blocks contain routed experts (grouped_mm lacks float64).
_MOE_FAMILIES: frozenset[str] = frozenset(
    {"jamba", "granitemoehybrid", "qwen3_next", "kimi_linear", "lfm2_moe", "nemotron_h"}
)


def _pick(variant: int, *options: Any) -> Any:
    """Return ``options[variant % len(options)]`` (deterministic per-variant knob)."""
    return options[variant % len(options)]


def _mamba(v: int) -> dict[str, Any]:
    """Kwargs for Mamba-1 style configs (``mamba`` and ``falcon_mamba``)."""
    return {
        "hidden_size": _pick(v, 32, 48, 32),
        "num_hidden_layers": _pick(v, 2, 3, 2),
        "state_size": _pick(v, 8, 16, 4),
        "expand": 2,
        "conv_kernel": _pick(v, 4, 4, 3),
        "time_step_rank": "auto",
    }


def _mamba2(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Mamba2Config` (heads * head_dim == expand * hidden)."""
    heads, head_dim, groups = _pick(v, (4, 16, 1), (8, 8, 2), (4, 16, 2))
    return {
        "hidden_size": 32,
        "num_hidden_layers": _pick(v, 2, 3, 2),
        "expand": 2,
        "num_heads": heads,
        "head_dim": head_dim,
        "n_groups": groups,
        "state_size": 16,
        "conv_kernel": 4,
        "chunk_size": 16,
    }


def _jamba(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.JambaConfig` (layers: mamba + attention, MoE on odd layers)."""
    layers = _pick(v, 2, 3, 4)
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": _pick(v, 2, 4, 1),
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": "auto",
        "max_position_embeddings": 256,
    }


def _bamba(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.BambaConfig` (mamba2 layers + ``attn_layer_indices``)."""
    layers = _pick(v, 2, 3, 4)
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attn_layer_indices": _pick(v, [1], [1], [1, 3]),
        "mamba_n_heads": _pick(v, 4, 8, 4),
        "mamba_d_head": "auto",
        "mamba_n_groups": _pick(v, 1, 2, 2),
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 16,
        "max_position_embeddings": 256,
    }


def _zamba2(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Zamba2Config` (a "hybrid" layer runs the shared attention block)."""
    if v % 3 == 0:
        block_types = ["linear_attention", "hybrid"]
        mem_blocks, adapter = 1, False
    elif v % 3 == 1:
        block_types = ["linear_attention", "hybrid", "hybrid"]
        mem_blocks, adapter = 2, True
    else:
        block_types = ["hybrid", "linear_attention", "linear_attention", "hybrid"]
        mem_blocks, adapter = 1, True
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": len(block_types),
        "layers_block_type": block_types,
        "num_attention_heads": 4,
        "n_mamba_heads": _pick(v, 4, 8, 4),
        "mamba_ngroups": _pick(v, 1, 2, 2),
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "chunk_size": 16,
        "num_mem_blocks": mem_blocks,
        "use_shared_attention_adapter": adapter,
        "adapter_rank": 8,
        "use_mem_rope": _pick(v, False, True, False),
        "max_position_embeddings": 256,
    }


def _falcon_h1(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.FalconH1Config` (every layer runs attention and mamba2 in parallel)."""
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": _pick(v, 2, 3, 2),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "mamba_d_ssm": None,
        "mamba_n_heads": _pick(v, 4, 8, 4),
        "mamba_d_head": "auto",
        "mamba_n_groups": _pick(v, 1, 2, 2),
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 16,
        "mamba_rms_norm": _pick(v, False, True, True),
        "max_position_embeddings": 256,
    }


def _nemotron_h(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.NemotronHConfig` (pattern chars: M=mamba2, *=attention, E=MoE, -=MLP)."""
    pattern = _pick(v, "M*E", "ME*-", "M*M-")
    mapping = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
    heads, head_dim, groups = _pick(v, (4, 16, 1), (8, 8, 2), (4, 16, 2))
    return {
        "hidden_size": 32,
        "layers_block_type": [mapping[c] for c in pattern],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "mamba_num_heads": heads,
        "mamba_head_dim": head_dim,
        "n_groups": groups,
        "expand": 2,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "chunk_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "max_position_embeddings": 256,
    }


def _granitemoehybrid(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.GraniteMoeHybridConfig` (``layer_types`` mamba / attention)."""
    layer_types = _pick(
        v,
        ["linear_attention", "full_attention"],
        ["linear_attention", "full_attention", "linear_attention"],
        ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )
    return {
        "hidden_size": 32,
        "intermediate_size": 32,
        "shared_intermediate_size": 32,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_n_heads": _pick(v, 4, 8, 4),
        "mamba_d_head": "auto",
        "mamba_n_groups": _pick(v, 1, 2, 2),
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 16,
        "position_embedding_type": _pick(v, None, "rope", None),
        "max_position_embeddings": 256,
    }


def _gated_delta_layers(v: int) -> list[str]:
    """Layer types for gated-delta-net hybrids (both kinds present in every variant)."""
    return _pick(
        v,
        ["linear_attention", "full_attention"],
        ["linear_attention", "linear_attention", "full_attention"],
        ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )


def _qwen3_next(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Qwen3NextConfig` (gated delta net + gated attention, MoE MLPs)."""
    layer_types = _gated_delta_layers(v)
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": _pick(v, 2, 2, 4),
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "max_position_embeddings": 256,
    }


def _qwen3_5(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Qwen3_5TextConfig` (dense text-only Qwen3.5)."""
    layer_types = _gated_delta_layers(v)
    head_dim = 16
    partial = 0.25
    half_rot = int(head_dim * partial) // 2  # number of rotary frequencies (2)
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": _pick(v, 2, 2, 4),
        "linear_num_value_heads": 4,
        "max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
            "mrope_section": [half_rot - half_rot // 2, half_rot // 2, 0],
            "mrope_interleaved": True,
        },
    }


def _olmo_hybrid(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.OlmoHybridConfig` (gated delta net + full attention)."""
    layer_types = _gated_delta_layers(v)
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": _pick(v, 2, 4, 2),
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 256,
    }


def _kimi_linear(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.KimiLinearConfig` (KDA linear attention + MLA, MoE MLPs)."""
    layer_types = _gated_delta_layers(v)
    n = len(layer_types)
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": n,
        "layer_types": layer_types,
        "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1),
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "linear_head_dim": 8,
        "linear_num_heads": 4,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "model_max_length": 256,
    }


def _lfm2(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Lfm2Config` (gated short convolutions + attention)."""
    layer_types = _pick(
        v,
        ["conv", "full_attention"],
        ["conv", "full_attention", "conv"],
        ["conv", "conv", "full_attention", "conv"],
    )
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "block_auto_adjust_ff_dim": False,
        "block_multiple_of": 16,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": _pick(v, 2, 4, 1),
        "conv_L_cache": 3,
        "max_position_embeddings": 256,
    }


def _lfm2_moe(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Lfm2MoeConfig` (first layer dense, remaining layers MoE)."""
    kwargs = _lfm2(v)
    for key in ("block_auto_adjust_ff_dim", "block_multiple_of"):
        kwargs.pop(key)
    kwargs.update(
        {
            "moe_intermediate_size": 32,
            "num_dense_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        }
    )
    return kwargs


def _zamba(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.ZambaConfig` (unsupported: Zamba v1).

    Two "hybrid" layers are required: with a single one, transformers 5.23 fails in
    ``tie_weights`` (the shared-transformer tying regex has nothing to tie into).
    """
    block_types = _pick(
        v,
        ["linear_attention", "hybrid", "hybrid"],
        ["hybrid", "linear_attention", "hybrid"],
        ["linear_attention", "hybrid", "linear_attention", "hybrid"],
    )
    return {
        "hidden_size": 32,
        "attention_hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": len(block_types),
        "layers_block_type": block_types,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_mamba_heads": 2,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "max_position_embeddings": 256,
    }


def _rwkv(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.RwkvConfig` (unsupported)."""
    return {
        "hidden_size": 32,
        "attention_hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": _pick(v, 2, 3, 4),
        "context_length": 256,
    }


def _recurrent_gemma(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.RecurrentGemmaConfig` (unsupported)."""
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "lru_width": 32,
        "num_hidden_layers": _pick(v, 2, 3, 4),
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "block_types": ("recurrent", "attention"),
        "attention_window_size": 16,
        "conv1d_width": 4,
    }


def _xlstm(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.xLSTMConfig` (unsupported).

    The config rounds qk/v dims up to multiples of 64 for its cache while the model does
    not, so hidden 64 with unit qk/v factors is the smallest consistent shape.
    """
    return {
        "hidden_size": 64,
        "qk_dim_factor": 1.0,
        "v_dim_factor": 1.0,
        "num_hidden_layers": _pick(v, 2, 3, 4),
        "num_heads": 4,
        "chunk_size": 16,
        "autocast_kernel_dtype": "float32",
        "inference_state_dtype": "float32",
    }


_BUILDERS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "mamba": ("MambaConfig", _mamba),
    "falcon_mamba": ("FalconMambaConfig", _mamba),
    "mamba2": ("Mamba2Config", _mamba2),
    "jamba": ("JambaConfig", _jamba),
    "bamba": ("BambaConfig", _bamba),
    "zamba2": ("Zamba2Config", _zamba2),
    "falcon_h1": ("FalconH1Config", _falcon_h1),
    "nemotron_h": ("NemotronHConfig", _nemotron_h),
    "granitemoehybrid": ("GraniteMoeHybridConfig", _granitemoehybrid),
    "qwen3_next": ("Qwen3NextConfig", _qwen3_next),
    "qwen3_5": ("Qwen3_5TextConfig", _qwen3_5),
    "olmo_hybrid": ("OlmoHybridConfig", _olmo_hybrid),
    "kimi_linear": ("KimiLinearConfig", _kimi_linear),
    "lfm2": ("Lfm2Config", _lfm2),
    "lfm2_moe": ("Lfm2MoeConfig", _lfm2_moe),
    "zamba": ("ZambaConfig", _zamba),
    "rwkv": ("RwkvConfig", _rwkv),
    "recurrent_gemma": ("RecurrentGemmaConfig", _recurrent_gemma),
    "xlstm": ("xLSTMConfig", _xlstm),
}

# Causal-LM class per family; qwen3_5 uses the text-only class, not the VL wrapper.
_MODEL_CLASSES: dict[str, str] = {
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "jamba": "JambaForCausalLM",
    "bamba": "BambaForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "zamba": "ZambaForCausalLM",
    "rwkv": "RwkvForCausalLM",
    "recurrent_gemma": "RecurrentGemmaForCausalLM",
    "xlstm": "xLSTMForCausalLM",
}


def _check_family(family: str) -> None:
    """Raise ``ValueError`` if ``family`` has no tiny config."""
    if family not in _BUILDERS:
        known = ", ".join(SUPPORTED_FAMILIES + UNSUPPORTED_FAMILIES)
        raise ValueError(f"Unknown family {family!r}; expected one of: {known}")


def tiny_config(family: str, *, vocab_size: int = 96, seed_variant: int = 0) -> transformers.PretrainedConfig:
    """Return a tiny config for ``family``; ``seed_variant`` picks one of a few small shapes."""
    _check_family(family)
    if vocab_size < 3:
        raise ValueError("vocab_size must be >= 3 (pad=0, bos=1, eos=2)")
    if seed_variant < 0:
        raise ValueError("seed_variant must be >= 0")
    config_name, make_kwargs = _BUILDERS[family]
    config_cls = getattr(transformers, config_name)
    kwargs = make_kwargs(seed_variant)
    kwargs.update(_TOKEN_IDS)
    if family == "rwkv":
        kwargs.pop("pad_token_id")  # RwkvConfig has no pad token field
    kwargs["vocab_size"] = vocab_size
    config = config_cls(**kwargs)
    if family == "rwkv":
        config.pad_token_id = _TOKEN_IDS["pad_token_id"]
    return config


def _reinit_degenerate(model: nn.Module, std: float) -> None:
    """Re-draw all-zero weight matrices (a zero ``out_proj`` would make its mixer a no-op)."""
    for name, param in model.named_parameters():
        if param.ndim >= 2 and name.endswith("weight") and not torch.any(param):
            with torch.no_grad():
                param.normal_(0.0, std)


def build_tiny_model(
    family: str,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    vocab_size: int = 96,
    seed_variant: int = 0,
    attn_implementation: str | None = None,
) -> transformers.PreTrainedModel:
    """Build the tiny causal LM for ``family`` on CPU in ``dtype``, eval mode, seeded init.

    sdpa is the default attention where the class supports it: HF's eager attention runs its softmax in
    float32 even for float64 models, which would blur float64 state comparisons to ~1e-8."""
    config = tiny_config(family, vocab_size=vocab_size, seed_variant=seed_variant)
    model_cls = getattr(transformers, _MODEL_CLASSES[family])
    torch.manual_seed(seed)
    # Initialise in float32 (so weights are identical across requested dtypes), then cast.
    if attn_implementation is None:
        attn_implementation = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    model = model_cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    _reinit_degenerate(model, std=getattr(config, "initializer_range", 0.02))
    model = model.to(device="cpu", dtype=dtype)
    if family in _MOE_FAMILIES and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    model.generation_config.pad_token_id = _TOKEN_IDS["pad_token_id"]
    model.generation_config.bos_token_id = _TOKEN_IDS["bos_token_id"]
    model.generation_config.eos_token_id = _TOKEN_IDS["eos_token_id"]
    return model.eval()


def build_tiny_transformer(
    *, vocab_size: int = 96, layers: int = 1, dtype: torch.dtype = torch.float64, seed: int = 3
) -> transformers.PreTrainedModel:
    """A tiny random-init Llama (no recurrent state): a transformer draft model, or a stateless target."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        **_TOKEN_IDS,
    )
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.pad_token_id = _TOKEN_IDS["pad_token_id"]
    model.generation_config.eos_token_id = _TOKEN_IDS["eos_token_id"]
    return model
