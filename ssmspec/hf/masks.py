"""Coupling to transformers' attention-mask conventions: the 4-D additive masks ssmspec hands a model for a
tree (or a one-token step), keyed the way HF hybrid models look their per-layer-type masks up."""

from __future__ import annotations

import torch

from ssmspec.tree import TokenTree

# masks of layer types without attention (HF builds a 2-D padding mask or None for them; trees have no padding)
RECURRENT_MASK_KEYS = ("linear_attention", "conv", "mamba", "moe", "mlp")
FULL, SLIDING = "full_attention", "sliding_attention"


class LayerMasks(dict):
    """Per-layer-type masks as HF models accept them; an unknown layer type is an error, not None."""

    def __missing__(self, key):
        raise KeyError(f"ssmspec: no tree attention mask for layer type {key!r} (full and sliding attention only)")


def allowed(valid: torch.Tensor, tree: TokenTree, window: int | None) -> torch.Tensor:
    """[B, N, W + N] which slots each node sees: valid committed slots (within the window: W + depth - slot
    < window, slots counted back from the node's own position) and its ancestors (depth difference < window)."""
    b, width = valid.shape
    see_prefix = valid[:, None, :].expand(b, tree.num_nodes, width)
    see_tree = tree.ancestor_mask
    if window is not None:
        depth = tree.depth
        col = torch.arange(width, device=valid.device)
        see_prefix = see_prefix & ((width + depth[:, :, None] - col) < window)
        see_tree = see_tree & ((depth[:, :, None] - depth[:, None, :]) < window)
    return torch.cat([see_prefix, see_tree], dim=-1)


def allowed_static(valid: torch.Tensor, block: torch.Tensor, tree: TokenTree, window: int | None) -> torch.Tensor:
    """[B, N, C] which slots of static K/V buffers (ssmspec.hf.cache, `static_kv`) each node sees: valid committed
    slots (within the window: block + depth - slot < window) and its ancestors, which the step wrote at
    slots block + node index. Shapes depend on the bucket only; nothing is read on the host."""
    b, width = valid.shape
    n = tree.num_nodes
    col = torch.arange(width, device=valid.device)
    node = col[None, :] - block[:, None]  # [B, C]: the tree node a slot holds (outside [0, N): none)
    in_tree = ((node >= 0) & (node < n))[:, None, :]
    node = node.clamp(0, n - 1)[:, None, :].expand(b, n, width)
    see_tree = torch.gather(tree.ancestor_mask, 2, node) & in_tree
    see_prefix = valid[:, None, :].expand(b, n, width)
    if window is not None:
        depth = tree.depth
        see_prefix = see_prefix & ((block[:, None, None] + depth[:, :, None] - col) < window)
        see_tree = see_tree & ((depth[:, :, None] - torch.gather(depth[:, None, :].expand(b, n, n), 2, node)) < window)
    return see_prefix | see_tree


def additive(allow: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, N, S] float mask: 0 where allowed, the dtype's minimum elsewhere."""
    mask = torch.zeros(allow.shape[0], 1, *allow.shape[1:], dtype=dtype, device=allow.device)
    return mask.masked_fill(~allow[:, None], torch.finfo(dtype).min)


def for_attention(allow: torch.Tensor, dtype: torch.dtype, implementation: str | None) -> torch.Tensor:
    """The 4-D mask [B, 1, N, S] a model's attention takes, as HF builds it for that implementation: boolean (True:
    attend) for SDPA, additive (`additive`) for eager attention; a quarter of the bytes of an additive float32 mask,
    which a verify step over a long context builds per layer type and step."""
    return allow[:, None] if implementation == "sdpa" else additive(allow, dtype)


def package(masks: dict[int | None, torch.Tensor], recurrent: bool):
    """What the model's forward takes as `attention_mask`: the tensor itself for a model with one kind of
    attention layer and no recurrent layers, else a dict keyed by layer type."""
    if not masks:
        return None
    if len(masks) == 1 and not recurrent:
        return next(iter(masks.values()))
    out = LayerMasks(dict.fromkeys(RECURRENT_MASK_KEYS))
    for window, mask in masks.items():
        out[FULL if window is None else SLIDING] = mask
    return out
