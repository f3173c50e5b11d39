"""Tree causal conv1d (Mamba/Mamba2/GDN/KDA conv, LFM2 short conv): reference op.

Node t convolves its own input with its K-1 nearest ancestors' inputs; where the root-to-t path is
shorter than K-1, the missing taps come from the committed conv state (the last inputs before the root).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmspec.ops._common import reference_op

_ACTIVATIONS = {None: None, "": None, "identity": None, "silu": F.silu, "swish": F.silu}


def _check_activation(activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"tree_causal_conv1d: unsupported activation {activation!r} (known: silu, swish, none)")


@reference_op("tree_causal_conv1d")
def tree_causal_conv1d(
    x_ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ancestors: torch.Tensor, activation: str
) -> torch.Tensor:
    """x_ext: [B, C, S+N] committed state (S columns) then the N node inputs; weight: [C, K];
    ancestors: [B, N, K] from TokenTree.ancestors(K). Returns [B, C, N] in x_ext's dtype."""
    act = activation or None
    _check_activation(act)
    b, c, total = x_ext.shape
    n, k = ancestors.shape[1], ancestors.shape[2]
    s = total - n
    if weight.shape != (c, k):
        raise ValueError(f"tree_causal_conv1d: weight {tuple(weight.shape)} does not match [C={c}, K={k}]")
    if s < k - 1:
        raise ValueError(f"tree_causal_conv1d: committed state has {s} columns, width {k} needs {k - 1}")
    idx = (ancestors + s).reshape(b, 1, n * k).expand(b, c, n * k)
    taps = torch.gather(x_ext.to(weight.dtype), 2, idx).view(b, c, n, k)  # tap j = j-th ancestor
    out = (taps * weight.flip(-1)[None, :, None, :]).sum(-1)
    if bias is not None:
        out = out + bias[None, :, None]
    fn = _ACTIVATIONS[act]
    if fn is not None:
        out = fn(out)
    return out.to(x_ext.dtype)


@tree_causal_conv1d.register_fake
def _(x_ext, weight, bias, ancestors, activation):
    return x_ext.new_empty(x_ext.shape[0], x_ext.shape[1], ancestors.shape[1])
