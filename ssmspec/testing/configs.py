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

import os
from collections.abc import Callable
from pathlib import Path
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
    "lfm3",
    "inkling",
    "inkling2",
    "bailing_hybrid",
    "qwen3_5_moe",
    "zamba",
)

# Families without kernel seams that speculate through the generic path (HF's own forward and cache: chains, one
# prompt; ssmspec.speculate.generic), the probe having found it exact on their tiny configs.
GENERIC_FAMILIES: tuple[str, ...] = ("rwkv", "xlstm", "glm5_next", "qwen4_exp", "zaya", "minimax", "recurrent_gemma")

# Families transform refuses: HF's forward of several tokens after a cached state differs from its one-token steps
# and no tree form exists (deepseek_v4, an attention model whose K/V compressors keep a running window HF marks as
# not rewindable, on some inputs). (recurrent_gemma's multi-token forward drops its conv state too; its modules'
# tree forms verify every step instead: a generic family.)
UNSUPPORTED_FAMILIES: tuple[str, ...] = ("deepseek_v4",)

# Weight scale of the tiny models of these families. At HF's default (0.02) the recurrent state of their random tiny
# SSM mixers moved the next token's logits by 1e-8 to 1e-6 (relative): far below the probe's float64 tolerance
# (1e-5), so a state committed wrongly, or a forward that ignores the cached state (HF's Zamba v1 in a multi-token
# forward), went unseen. At 0.2 the state moves them by 1e-3 to 0.3 (tests/test_tiny_configs.py checks it; the
# other families' states move them by 2e-5 to 0.5 at HF's default).
STRONG_STATE_FAMILIES = frozenset({"bamba", "nemotron_h", "granitemoehybrid", "zamba2", "falcon_h1", "zamba"})
INIT_RANGE = 0.2

_TOKEN_IDS: dict[str, int] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# Families whose feed-forward blocks contain routed experts (grouped_mm lacks float64).
_MOE_FAMILIES: frozenset[str] = frozenset({
    "jamba", "granitemoehybrid", "qwen3_next", "kimi_linear", "lfm2_moe", "nemotron_h", "inkling", "inkling2",
    "bailing_hybrid", "glm5_next", "zaya", "qwen4_exp", "qwen3_5_moe", "minimax", "deepseek_v4",
})  # fmt: skip


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


def _lfm3(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Lfm3Config` (width-7 gated short convs + full and sliding attention)."""
    layer_types = _pick(
        v,
        ["conv", "sliding_attention", "full_attention"],
        ["conv", "conv", "full_attention", "sliding_attention"],
        ["sliding_attention", "conv", "full_attention", "conv", "sliding_attention"],
    )
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": _pick(v, 2, 4, 1),
        "head_dim": 8,
        "sliding_window": _pick(v, 4, 5, 6),
        "conv_L_cache": 7,
        "use_attention_gate": _pick(v, True, True, False),
        "max_position_embeddings": 256,
    }


def _inkling(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.InklingTextConfig` (short convs around sliding / full attention, MoE)."""
    layer_types = _pick(
        v,
        ["hybrid_sliding", "hybrid"],
        ["hybrid", "hybrid"],
        ["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding"],
    )
    n = len(layer_types)
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": n,
        "layer_types": layer_types,
        "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1),
        "num_attention_heads": 4,
        "num_key_value_heads": _pick(v, 2, 4, 1),
        "head_dim": 8,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 8,
        "sliding_window_size": _pick(v, 4, 5, 6),
        "d_rel": 4,
        "rel_extent": 16,
        # variant 1 (full attention only) also exercises the log-scaling of queries by position
        "log_scaling_n_floor": _pick(v, None, 8, None),
        "conv_kernel_size": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "logits_mup_width_multiplier": 1.0,
        "max_position_embeddings": 256,
    }


def _inkling2(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Inkling2TextConfig` (static / dynamic short convs, attention residuals, MoE).

    ``unpadded_vocab_size`` keeps its default (200058 > vocab): the logits slice is then a no-op.
    """
    layer_types = _pick(
        v,
        ["hybrid_sliding", "hybrid"],
        ["hybrid", "hybrid"],
        ["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding"],
    )
    return {
        "hidden_size": 32,
        "moe_intermediate_size": 32,  # ``intermediate_size`` is an alias of this field
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": _pick(v, 2, 4, 1),
        "head_dim": 8,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 8,
        "sliding_window_size": _pick(v, 4, 5, 6),
        "d_rel": 4,
        "rel_extent": 16,
        "log_scaling_n_floor": _pick(v, 128000, 8, 128000),
        "conv_kernel_size": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_layers_per_attn_res_block": 2,
        "max_position_embeddings": 256,
    }


def _bailing_hybrid(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.BailingHybridConfig` (KDA linear attention + gated MLA, MoE MLPs)."""
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
        "head_dim": 8,  # becomes the KDA head dim; ``head_dim`` is then reset to ``qk_rope_head_dim``
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "short_conv_kernel_size": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "num_mtp_layers": 0,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
    }


def _glm5_next(v: int) -> dict[str, Any]:
    """Flat text kwargs for :class:`transformers.Glm5NextConfig` (KDA + DSA/MLA, mHC streams, MoE) + tiny vision.

    ``indexed_attention`` layers select ``index_topk`` keys in pools of ``index_kpool`` tokens (plus the tail pool).
    Variants 0/1 use a budget (64) above any short test context, so the selection keeps every visible key. Variant 2
    (budget 12) is genuinely sparse on ~20-token contexts and has two consecutive indexed layers, the second reusing
    the first one's top-k (``indexer_types`` "shared"). Caveat: the indexer ranks pools by ``relu`` scores, so pools
    tie at exactly 0.0 and ``topk`` breaks the tie by position in a tensor whose length is the number of pools in the
    forward; HF's own cached decode and full forward then pick different keys (observed: max logit diff ~4e-2).
    """
    layer_types = _pick(
        v,
        ["linear_attention", "indexed_attention"],
        ["linear_attention", "linear_attention", "indexed_attention"],
        ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    )
    n = len(layer_types)
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": n,
        "layer_types": layer_types,
        "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1),
        "indexer_types": _pick(v, ["full"] * 2, ["full"] * 3, ["full", "full", "shared", "full"]),
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "index_n_heads": _pick(v, 2, 2, 4),
        "index_head_dim": 8,
        "index_kpool": 2,
        # 64 >= any test context: dense selection. Variant 2 (12) is genuinely sparse; see the tie note above.
        "index_topk": _pick(v, 64, 64, 12),
        "linear_num_heads": 4,
        "linear_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "hc_mult": _pick(v, 2, 4, 2),
        "hc_sinkhorn_iters": 5,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "max_position_embeddings": 256,
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "num_heads": 2,
            "intermediate_size": 32,
            "out_hidden_size": 32,
            "projection_intermediate_size": 32,
            "patch_size": 2,
            "image_size": 8,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
        },
    }


def _zaya(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.ZayaConfig` (CCA attention with conv + delayed-value state, top-1 MoE)."""
    layer_types = _pick(
        v,
        ["hybrid_sliding", "hybrid"],
        ["hybrid", "hybrid", "hybrid"],
        ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    )
    return {
        "hidden_size": 32,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": _pick(v, 2, 4, 1),
        "head_dim": 8,
        "sliding_window": _pick(v, 4, None, 6),
        "cca_time0": _pick(v, 2, 2, 3),
        "cca_time1": _pick(v, 2, 3, 2),
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 1,  # ZayaConfig.validate_architecture rejects anything else
        "router_hidden_size": 16,
        # tied embeddings make the tiny model echo its last input token forever (greedy fixed point)
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
    }


def _qwen_mrope(head_dim: int, partial: float) -> dict[str, Any]:
    half_rot = int(head_dim * partial) // 2
    return {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
        "mrope_section": [half_rot - half_rot // 2, half_rot // 2, 0],
        "mrope_interleaved": True,
    }


def _qwen4_exp(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Qwen4ExpTextConfig` (gated delta net + QSA-indexed gated attention,
    hyper-connection residual streams, MoE; variant 1 adds PLE on layer 1)."""
    layer_types = _gated_delta_layers(v)  # "full_attention" is renamed "indexed_attention" by the config
    head_dim = 16
    return {
        "hidden_size": 32,
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
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "hc_count": _pick(v, 2, 2, 3),
        "hc_lowrank": 8,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
        "indexer_budget": _pick(v, 4, 8, 4),
        "indexer_compress_ratio": 2,
        "ple_layer_ids": _pick(v, [], [1], []),
        "ple_embed_dim": 32,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 101,
        "make_ngram_vocab_size_divisible_by": 8,
        "max_position_embeddings": 256,
        "rope_parameters": _qwen_mrope(head_dim, 0.25),
    }


def _qwen3_5_moe(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.Qwen3_5MoeTextConfig` (text-only Qwen3.5-MoE: GDN + gated attention, MoE)."""
    layer_types = _gated_delta_layers(v)
    head_dim = 16
    return {
        "hidden_size": 32,
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
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 256,
        "rope_parameters": _qwen_mrope(head_dim, 0.25),
    }


def _zamba(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.ZambaConfig` (Zamba v1: one selective scan per Mamba head, on a slice of the
    layer's state).

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


def _minimax(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.MiniMaxConfig` (lightning attention, a decayed linear attention, between
    softmax-attention layers; top-k MoE)."""
    layer_types = _pick(
        v,
        ["linear_attention", "full_attention"],
        ["linear_attention", "linear_attention", "full_attention"],
        ["full_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    return {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": _pick(v, 2, 4, 1),
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": _pick(v, 2, 1, 2),
        "block_size": _pick(v, 4, 3, 5),
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
    }


def _deepseek_v4(v: int) -> dict[str, Any]:
    """Kwargs for :class:`transformers.DeepseekV4Config` (unsupported: attention whose compressed K/V branches keep
    a running window of not-yet-compressed tokens; sliding, compressed-sparse and heavily-compressed layers)."""
    layer_types = _pick(
        v,
        ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        ["compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
    )
    return {
        "hidden_size": 32,
        "moe_intermediate_size": 32,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "mlp_layer_types": ["hash_moe"] + ["moe"] * (len(layer_types) - 1),
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "q_lora_rank": 16,
        "num_experts_per_tok": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "hc_mult": 2,
        "sliding_window": 8,
        "o_groups": 2,
        "o_lora_rank": 8,
        "index_n_heads": 2,
        "index_head_dim": 8,
        "index_topk": 4,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "max_position_embeddings": 512,
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
    """Kwargs for :class:`transformers.RecurrentGemmaConfig` (the generic path, its modules' tree forms)."""
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
    "lfm3": ("Lfm3Config", _lfm3),
    "inkling": ("InklingTextConfig", _inkling),
    "inkling2": ("Inkling2TextConfig", _inkling2),
    "bailing_hybrid": ("BailingHybridConfig", _bailing_hybrid),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", _qwen3_5_moe),
    "glm5_next": ("Glm5NextConfig", _glm5_next),
    "zaya": ("ZayaConfig", _zaya),
    "qwen4_exp": ("Qwen4ExpTextConfig", _qwen4_exp),
    "minimax": ("MiniMaxConfig", _minimax),
    "deepseek_v4": ("DeepseekV4Config", _deepseek_v4),
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
    "lfm3": "Lfm3ForCausalLM",
    "inkling": "InklingForCausalLM",
    "inkling2": "Inkling2ForCausalLM",
    "bailing_hybrid": "BailingHybridForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "glm5_next": "Glm5NextForConditionalGeneration",  # no text-only causal LM in 5.23
    "zaya": "ZayaForCausalLM",
    "qwen4_exp": "Qwen4ExpForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "zamba": "ZambaForCausalLM",
    "rwkv": "RwkvForCausalLM",
    "recurrent_gemma": "RecurrentGemmaForCausalLM",
    "xlstm": "xLSTMForCausalLM",
}


def _check_family(family: str) -> None:
    """Raise ``ValueError`` if ``family`` has no tiny config."""
    if family not in _BUILDERS:
        known = ", ".join(SUPPORTED_FAMILIES + GENERIC_FAMILIES + UNSUPPORTED_FAMILIES)
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
    if family in STRONG_STATE_FAMILIES:
        kwargs.setdefault("initializer_range", INIT_RANGE)
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


def _post_build(model: nn.Module, family: str) -> None:
    """Fix-ups after the cast (deterministic, no RNG use).

    * inkling2: its router computes `F.linear(hidden_states.float(), self.weight)`, relying on
      `_keep_in_fp32_modules_strict`, which HF enforces only when loading in fp16/bf16: keep the weight float32.
    * zaya: `ZayaQKNorm.temp` is zero-initialised (every key zero, uniform attention): set it to 1.
    """
    for name, param in model.named_parameters():
        if family == "inkling2" and name.endswith("mlp.gate.weight"):
            param.data = param.data.to(torch.float32)
        elif family == "zaya" and name.endswith("qk_norm.temp") and not torch.any(param):
            with torch.no_grad():
                param.fill_(1.0)


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
    _post_build(model, family)
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


def load_device_mapped(
    model: nn.Module, directory: str | os.PathLike, devices: tuple[str, ...] = ("cpu", "disk")
) -> nn.Module:
    """The model saved in `directory` and loaded back with accelerate's big-model inference: its decoder layers
    spread over `devices` in turn ("disk": offloaded to `directory`/offload, loaded per forward by accelerate's hooks;
    "cpu", "cuda:0": placed there), everything else on the first device; each parameter's dtype kept. A layer that
    shares weights with an earlier one (Zamba's shared attention block) goes where that one went, as accelerate's
    own `device_map="auto"` keeps tied weights together. Needs accelerate.

    Args:
        model: a model built here (any family; its layers are the largest nn.ModuleList it has).
        directory: where the checkpoint (and the disk offload) goes.
        devices: the devices the layers take in turn.
    """
    directory = Path(directory)
    model.save_pretrained(directory / "checkpoint")
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    path, layers = max(lists, key=lambda item: len(item[1]))
    device_map: dict[str, str] = {}
    parts = path.split(".")
    for depth in range(len(parts)):  # beside each module on the way to the layers: the first device
        parent = ".".join(parts[:depth])
        module = model.get_submodule(parent)
        prefix = f"{parent}." if parent else ""
        for name, _ in module.named_children():
            if name != parts[depth]:
                device_map[prefix + name] = devices[0]
        for name, _ in module.named_parameters(recurse=False):
            device_map[prefix + name] = devices[0]
        for name, _ in module.named_buffers(recurse=False):
            device_map[prefix + name] = devices[0]
    placed: dict[int, str] = {}  # a parameter's id -> the device of the first layer holding it
    for i, layer in enumerate(layers):
        shared = [placed[id(p)] for p in layer.parameters() if id(p) in placed]
        device_map[f"{path}.{i}"] = shared[0] if shared else devices[i % len(devices)]
        for p in layer.parameters():
            placed.setdefault(id(p), device_map[f"{path}.{i}"])
    dtype = next(model.parameters()).dtype
    kwargs = {"experts_implementation": "eager"} if hasattr(model, "set_experts_implementation") else {}
    loaded = type(model).from_pretrained(
        directory / "checkpoint",
        device_map=device_map,
        offload_folder=str(directory / "offload"),
        dtype=dtype,
        **kwargs,
    )
    # A parameter kept in another dtype than the rest (inkling2's float32 router) loads in `dtype`; set it back.
    # Offloaded ones are meta tensors here, and accelerate casts what it loads to their dtype.
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    for name, p in loaded.named_parameters():
        if name in dtypes and p.dtype != dtypes[name]:
            p.data = p.data.to(dtypes[name])
    return loaded
