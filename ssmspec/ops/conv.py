"""Tree causal conv1d (Mamba/Mamba2/GDN/KDA conv, LFM2/LFM3 short conv, Inkling's K/V and residual convs).

Reference op: node t convolves its own input with its K-1 nearest ancestors' inputs; where the root-to-t path
is shorter than K-1, the missing taps come from the committed conv state (the last inputs before the root).
Seam adapter for `causal_conv1d_fn`; commit `conv_window`: the new conv state is the last S inputs along the
accepted path (committed columns fill the rest).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ssmspec.ops._common import (
    Record,
    SeamCall,
    commits,
    compute_dtype,
    eager_fast_path,
    reference_op,
    seam_adapter,
)

_ACTIVATIONS = {None: None, "": None, "identity": None, "silu": F.silu, "swish": F.silu}


def _check_activation(activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"tree_causal_conv1d: unsupported activation {activation!r} (known: silu, swish, none)")


@reference_op("tree_causal_conv1d")
def tree_causal_conv1d(
    x_ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ancestors: torch.Tensor, activation: str
) -> torch.Tensor:
    """x_ext: [B, C, S+N] committed state (S columns) then the N node inputs; weight: [C, K];
    ancestors: [B, N, K] from TokenTree.ancestors(K). Returns [B, C, N] in x_ext's dtype; computed in at least
    float32 (half-precision inputs accumulate in float32, as a GPU conv does)."""
    act = activation or None
    _check_activation(act)
    b, c, total = x_ext.shape
    n, k = ancestors.shape[1], ancestors.shape[2]
    s = total - n
    if weight.shape != (c, k):
        raise ValueError(f"tree_causal_conv1d: weight {tuple(weight.shape)} does not match [C={c}, K={k}]")
    if s < k - 1:
        raise ValueError(f"tree_causal_conv1d: committed state has {s} columns, width {k} needs {k - 1}")
    cd = compute_dtype(x_ext, weight)
    idx = (ancestors + s).reshape(b, 1, n * k).expand(b, c, n * k)
    taps = torch.gather(x_ext.to(cd), 2, idx).view(b, c, n, k)  # tap j = j-th ancestor
    out = (taps * weight.to(cd).flip(-1)[None, :, None, :]).sum(-1)
    if bias is not None:
        out = out + bias.to(cd)[None, :, None]
    fn = _ACTIVATIONS[act]
    if fn is not None:
        out = fn(out)
    return out.to(x_ext.dtype)


@tree_causal_conv1d.register_fake
def _(x_ext, weight, bias, ancestors, activation):
    return x_ext.new_empty(x_ext.shape[0], x_ext.shape[1], ancestors.shape[1])


@reference_op("conv_window")
def conv_window(
    committed: torch.Tensor, nodes: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """committed [B,C,S], nodes [B,C,N] (pre-conv inputs of the tree), path [B,M] node indices (padded),
    lengths [B] path lengths. Returns the new committed state [B,C,S]."""
    b, c, s = committed.shape
    ext = torch.cat([committed, nodes.to(committed.dtype)], dim=-1)  # [B, C, S+N]
    pos = torch.arange(s, device=committed.device)[None, :] - s + lengths[:, None]  # index into the path
    rows = torch.arange(b, device=committed.device)[:, None]
    from_path = path[rows, pos.clamp(min=0)] + s
    from_committed = s + pos  # pos < 0: column s + pos of the committed state
    idx = torch.where(pos >= 0, from_path, from_committed)
    return torch.gather(ext, 2, idx[:, None, :].expand(b, c, s))


@conv_window.register_fake
def _(committed, nodes, path, lengths):
    return torch.empty_like(committed)


_tree_conv, _conv_window = eager_fast_path(tree_causal_conv1d), eager_fast_path(conv_window)


@seam_adapter("causal_conv1d_fn", understands=("hidden_states", "weight", "bias", "activation"))
def verify_conv(call: SeamCall, a: dict[str, Any]) -> torch.Tensor:
    """`causal_conv1d_fn` on [committed conv state | node inputs] (what the cache's update_conv_state handed the
    mixer): the tree conv of the nodes, left-padded with zeros where the committed columns were, so that the
    mixer's own `[..., -seq_len:]` slice picks the node outputs."""
    x_ext, weight = a["hidden_states"], a["weight"]
    tree = call.tree
    out = _tree_conv(x_ext, weight, a.get("bias"), tree.ancestors(weight.shape[-1]), a.get("activation") or "")
    s = x_ext.shape[-1] - tree.num_nodes
    return torch.cat([out.new_zeros(out.shape[0], out.shape[1], s), out], dim=-1)


@commits("conv")
def commit_conv(items: list[tuple[torch.Tensor, Record]], path: torch.Tensor, lengths: torch.Tensor, last) -> None:
    """New conv windows: one conv_window call per group of states of equal shape (all layers at once)."""
    groups: dict[tuple, list] = {}
    for target, rec in items:
        nodes = rec.replay["nodes"]
        key = (tuple(target.shape), target.dtype, tuple(nodes.shape), nodes.dtype)
        groups.setdefault(key, []).append((target, nodes))
    for group in groups.values():
        k = len(group)
        new = _conv_window(
            torch.cat([t for t, _ in group]), torch.cat([n for _, n in group]), path.repeat(k, 1), lengths.repeat(k)
        )
        for (target, _), part in zip(group, new.split(group[0][0].shape[0])):
            target.copy_(part)
