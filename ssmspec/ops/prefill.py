"""Chunked prefill from an initial state (reference): a prompt continued from a committed state.

A chain is a tree, so each chunk is one tree op call on a chain, with the op's own inputs by name (its signature is
declared once, on the op: this module names only which inputs run along the sequence); the state is carried across
chunks by the replay-commit form (`ssd_state_at` for SSD, the chain's last node state for the level-wise
recurrences). Memory per chunk is O(chunk^2) for SSD and O(chunk * state) for the others.
"""

from __future__ import annotations

import inspect

import torch

from ssmspec.ops._common import chain_structure, reference_impl
from ssmspec.ops.delta_rule import tree_delta_rule
from ssmspec.ops.selective_scan import tree_selective_scan
from ssmspec.ops.ssd import ssd_state_at, tree_ssd

# each op: (its tree op, the inputs that run along the sequence, their sequence dimension)
SEQUENCE_INPUTS = {
    "ssd": (tree_ssd, ("x", "dt", "Bm", "Cm"), 1),
    "selective_scan": (tree_selective_scan, ("x", "dt", "Bm", "Cm", "z"), -1),
    "delta_rule": (tree_delta_rule, ("q", "k", "v", "g", "beta"), 1),
}
_STATE_AT = frozenset(inspect.signature(reference_impl("ssmspec::ssd_state_at")).parameters)


def _chunks(length: int, chunk_size: int, batch: int, device: torch.device):
    """Yield (slice, parents, depth, ancestor mask) of each chunk, every chunk a chain."""
    for start in range(0, length, chunk_size):
        n = min(chunk_size, length - start)
        parents, depth = chain_structure(batch, n, device)
        anc = (depth[0, None, :] <= depth[0, :, None]).expand(batch, n, n)
        yield slice(start, start + n), parents, depth, anc


def chunked_prefill(
    op: str, h0: torch.Tensor | None, *, chunk_size: int = 64, **inputs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree op `op` ("ssd", "selective_scan" or "delta_rule") over a whole sequence from state h0, chunk by
    chunk; `inputs` are the op's own (by its parameter names, the tree structure and `return_states` aside), its
    per-token ones over the whole sequence. Returns (output over the sequence, final state)."""
    if op not in SEQUENCE_INPUTS:
        raise ValueError(f"chunked_prefill: op must be one of {', '.join(SEQUENCE_INPUTS)}, got {op!r}")
    tree_op, per_token, dim = SEQUENCE_INPUTS[op]
    first = inputs[per_token[0]]
    ys, state = [], h0
    for sl, parents, depth, anc in _chunks(first.shape[dim], chunk_size, first.shape[0], first.device):
        along = (slice(None), sl) if dim == 1 else (..., sl)
        chunk = {**inputs, "h0": state, **{n: inputs[n][along] for n in per_token if inputs.get(n) is not None}}
        if op == "ssd":  # the state from the replay commit: tree_ssd's per-node states are O(chunk) states
            y, _ = tree_op(**chunk, ancestor_mask=anc, return_states=False)
            state = ssd_state_at(**{k: v for k, v in chunk.items() if k in _STATE_AT}, path_mask=anc[:, -1])
        else:
            y, states = tree_op(**chunk, parents=parents, depth=depth, return_states=True)
            state = states[:, -1]
        ys.append(y)
    return torch.cat(ys, dim=dim), state
