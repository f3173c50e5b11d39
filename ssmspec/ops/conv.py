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
    eager_reference,
    in_place_commit,
    reference_op,
    seam_adapter,
    stacked,
)
from ssmspec.static import static

_ACTIVATIONS = {None: None, "": None, "identity": None, "silu": F.silu, "swish": F.silu}


def _check_state(columns: int, width: int) -> None:
    """A tree convolution of `width` taps reads `width - 1` committed columns before its nodes."""
    if columns < width - 1:
        raise ValueError(f"tree_causal_conv1d: committed state has {columns} columns, width {width} needs {width - 1}")


def _check_activation(activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"tree_causal_conv1d: unsupported activation {activation!r} (known: silu, swish, none)")


@reference_op("tree_causal_conv1d")
def tree_causal_conv1d(
    x_ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ancestors: torch.Tensor, activation: str
) -> torch.Tensor:
    """x_ext: [B, C, S+N] committed state (S columns) then the N node inputs; weight: [C, K];
    ancestors: [B, N, K] from TokenTree.ancestors(K). Returns [B, C, N] in x_ext's dtype, laid out time-major (a
    transposed view of [B, N, C] memory, as the mixer's own projections are: its later slices stay rows of
    contiguous channels); computed in at least float32 (half-precision inputs accumulate in float32, as a GPU
    conv does)."""
    total, n = x_ext.shape[2], ancestors.shape[1]
    return _tapped(x_ext, weight, bias, tap_index(ancestors, total), n, activation)


def tap_index(ancestors: torch.Tensor, total: int) -> torch.Tensor:
    """The rows `tree_causal_conv1d` gathers for ancestors [B, N, K] from [committed | nodes] of `total` columns
    per row: [B * N * K] indices into the batch's time-major rows laid end to end, tap j of node t its (K-1-j)-th
    ancestor (as weight column j expects). The same for every layer of a verify step whose conv has this width
    and window: the seam adapter makes it once per tree (`TokenTree.derived`)."""
    return _batch_rows(ancestors.flip(-1) + (total - ancestors.shape[1]), total).view(-1)


def _tapped(x_ext, weight, bias, index, n: int, activation: str) -> torch.Tensor:
    """`tree_causal_conv1d` of n nodes given its tap rows (`tap_index`)."""
    act = activation or None
    _check_activation(act)
    b, c, total = x_ext.shape
    k = index.shape[0] // (b * n)
    s = total - n
    if weight.shape != (c, k):
        raise ValueError(f"tree_causal_conv1d: weight {tuple(weight.shape)} does not match [C={c}, K={k}]")
    _check_state(s, k)
    cd = compute_dtype(x_ext, weight)
    # time-major [B, S+N, C]: each tap is a row of C contiguous channels (x_ext is usually a transposed view of
    # such rows already: the mixer's projection output), so the gather copies rows and the weighted sum runs
    # over contiguous channels
    rows = x_ext.transpose(1, 2).to(cd)
    taps = rows.reshape(b * total, c).index_select(0, index).view(b, n, k, c)
    return _weighted(taps, weight, bias, act, cd, x_ext.dtype)


def _weighted(taps: torch.Tensor, weight, bias, act: str | None, cd: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """taps [B, N, K, C] (rows of contiguous channels, in `cd`) weighted by weight [C, K] and summed over K, plus the
    bias and the activation: [B, C, N] in `dtype`, time-major (the tree conv and its one-node form share it)."""
    out = (taps * weight.to(cd).t()).sum(2)  # [B, N, C]
    if bias is not None:
        out = out.add_(bias.to(cd))
    fn = _ACTIVATIONS[act]
    if fn is not None:
        out = fn(out, inplace=True)
    return out.to(dtype).transpose(1, 2)


@tree_causal_conv1d.register_fake
def _(x_ext, weight, bias, ancestors, activation):
    return x_ext.new_empty(x_ext.shape[0], ancestors.shape[1], x_ext.shape[1]).transpose(1, 2)


def conv_step(x_ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """`tree_causal_conv1d` of a one-node tree (a plain step: x_ext [B, C, S+1], the node last): its taps are the
    last K columns, read in place instead of gathered by ancestor indices (same taps, same order, same sums), so a
    plain step's conv is four ops instead of ten. Returns [B, C, 1] in x_ext's dtype, time-major."""
    act = activation or None
    _check_activation(act)
    k = weight.shape[-1]
    cd = compute_dtype(x_ext, weight)
    taps = x_ext[..., -k:].transpose(1, 2).to(cd).unsqueeze(1)  # [B, 1, K, C]: rows of contiguous channels
    return _weighted(taps, weight, bias, act, cd, x_ext.dtype)


def _batch_rows(idx: torch.Tensor, total: int) -> torch.Tensor:
    """Column indices idx [B, ...] into each row's `total` columns as indices into the batch's rows laid end to end
    ([B * total]): one index_select then gathers for every row (a gather with an expanded index is 3-5x slower)."""
    b = idx.shape[0]
    if b == 1:
        return idx
    return idx + torch.arange(0, b * total, total, device=idx.device).view(b, *[1] * (idx.dim() - 1))


def window_index(s: int, path: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, S] column indices into [committed (S columns) | node inputs] of the new conv state after the
    accepted path [B, M] (padded) of `lengths` [B] nodes: its last S inputs, committed columns filling in.
    On the host (CPU tensors, eager) a few Python ints and one tensor; elsewhere tensor ops."""
    if path.device.type == "cpu" and not static():
        host = zip(path.tolist(), lengths.tolist())
        rows = [[p[i] + s if i >= 0 else s + i for i in range(n - s, n)] for p, n in host]
        return torch.tensor(rows, dtype=torch.long)
    return _window_index_tensors(s, path, lengths)


def _window_index_tensors(s: int, path: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`window_index` with tensor ops (no host read: compiled graphs, CUDA graphs)."""
    pos = torch.arange(s, device=path.device)[None, :] - s + lengths[:, None]  # index into the path
    from_path = torch.gather(path, 1, pos.clamp(min=0)) + s
    return torch.where(pos >= 0, from_path, s + pos)  # pos < 0: column s + pos of the committed state


@reference_op("conv_window")
def conv_window(
    committed: torch.Tensor, nodes: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """committed [B,C,S], nodes [B,C,N] (pre-conv inputs of the tree), path [B,M] node indices (padded),
    lengths [B] path lengths. Returns the new committed state [B,C,S]."""
    b, c, s = committed.shape
    ext = torch.cat([committed, nodes.to(committed.dtype)], dim=-1)  # [B, C, S+N]
    return torch.gather(ext, 2, window_index(s, path, lengths)[:, None, :].expand(b, c, s))


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
    if tree.num_nodes == 1 and eager_reference(x_ext):  # a plain step, where the reference op would run
        out = conv_step(x_ext, weight, a.get("bias"), a.get("activation") or "")
    elif eager_reference(x_ext):  # the reference op's own computation, its tap rows made once for all layers
        k, total = weight.shape[-1], x_ext.shape[-1]
        index = tree.derived(("conv_taps", k, total), lambda: tap_index(tree.ancestors(k), total))
        out = _tapped(x_ext, weight, a.get("bias"), index, tree.num_nodes, a.get("activation") or "")
    else:
        out = _tree_conv(x_ext, weight, a.get("bias"), tree.ancestors(weight.shape[-1]), a.get("activation") or "")
    b, c, n = out.shape
    s = x_ext.shape[-1] - n
    if torch.compiler.is_compiling():  # the pattern the backend's fold_conv_padding pass removes from a graph
        return torch.cat([out.new_zeros(b, c, s), out], dim=-1)
    padded = out.new_zeros(b, s + n, c)  # time-major, as the tree op's output
    padded[:, s:] = out.transpose(1, 2)
    return padded.transpose(1, 2)


def _window_in_place(group: list, path: torch.Tensor, lengths: torch.Tensor) -> None:
    """Each layer's new window gathered from the [committed | nodes] its verification recorded, straight into
    its committed state: one gather for all layers where the cache keeps both stacked, else one per layer."""
    target = group[0][0]
    b, c, s = target.shape
    idx = window_index(s, path, lengths)  # [B, S], shared by every layer
    stack = stacked([t for t, _, _ in group])
    exts = stacked([e.transpose(1, 2) for _, _, e in group])  # [layers, B, S+N, C]
    if stack is not None and exts is not None:
        # the batch's rows laid end to end, [layers, B * (S+N), C], read by index_select, as in tree_causal_conv1d
        flat, rows = _batch_rows(idx, exts.shape[2]).to(exts.device), exts.flatten(1, 2)
        if static() and stack.device.type == "cpu":
            # a step compiled whole: one column at a time, each a row of contiguous channels per (layer, row) read at
            # its index and written into the state's column (one gather over [S, C] would be vectorized over the
            # state's few columns, with the index arithmetic redone for every element)
            for j in range(s):
                stack[..., j].copy_(rows.index_select(1, flat[:, j]).view(len(group), b, c))
            return
        stack.copy_(rows.index_select(1, flat.view(-1)).view(len(group), b, s, c).transpose(2, 3))
        return
    for target, _, ext in group:
        if b == 1:
            torch.index_select(ext, 2, idx[0], out=target)
        else:
            torch.gather(ext, 2, idx[:, None, :].expand(b, c, s), out=target)


@commits("conv")
def commit_conv(items: list[tuple[torch.Tensor, Record]], path: torch.Tensor, lengths: torch.Tensor, last) -> None:
    """New conv windows. Eager: each layer's window gathered from the [committed | nodes] its verification
    recorded straight into its committed state (one op per layer, the column indices shared). Compiled or with
    kernels: one conv_window call per group of states of equal shape (all layers at once)."""
    groups: dict[tuple, list] = {}
    for target, rec in items:
        nodes = rec.replay["nodes"]
        key = (tuple(target.shape), target.dtype, tuple(nodes.shape), nodes.dtype)
        groups.setdefault(key, []).append((target, nodes, rec.replay.get("ext")))
    for group in groups.values():
        target, _, ext = group[0]
        if ext is not None and ext.dtype == target.dtype and in_place_commit(target):
            _window_in_place(group, path, lengths)
            continue
        k = len(group)
        new = _conv_window(
            torch.cat([t for t, _, _ in group]), torch.cat([n for _, n, _ in group]), path.repeat(k, 1),
            lengths.repeat(k),
        )  # fmt: skip
        for (target, _, _), part in zip(group, new.split(group[0][0].shape[0])):
            target.copy_(part)
