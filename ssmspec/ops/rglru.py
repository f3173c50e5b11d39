"""Tree RG-LRU (Griffin / RecurrentGemma's real-gated linear recurrence), every node after its own path.

HF's decode step for one token (`RecurrentGemmaRglru._rnn_scan` in sampling mode), with the gated, normalized input
x_t and the per-channel decay a_t (both computed per token from the token's own activations, no state involved):
    h_t = a_t h_{t-1} + x_t,  out_t = h_t,
accumulated in float32 (HF's `acc_dtype`) whatever the model's dtype, the output cast back to x's dtype. Every
node's state is its parent's decayed plus its own input, so a tree is evaluated one level at a time
(ssmspec.ops._common.levelwise_states) with the decode step's own products; the commit keeps the accepted node's
state.
"""

from __future__ import annotations

import torch

from ssmspec.ops._common import eager_fast_path, gather_nodes, levelwise_states, reference_op


@reference_op("tree_rglru", traceable=False)
def tree_rglru(
    decay: torch.Tensor, x: torch.Tensor, state0: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every node's output and state. decay, x [B, N, C] (a_t and the normalized input, in the model's dtype);
    state0 [B, C] the committed state in its accumulation dtype; parents, depth [B, N] (-1: the committed state).
    Returns the outputs [B, N, C] in x's dtype and the node states [B, N, C] in state0's dtype."""
    acc = state0.dtype

    def step(prev: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return gather_nodes(decay, idx).to(acc) * prev + gather_nodes(x, idx).to(acc)

    states = levelwise_states(state0, parents, depth, step)
    return states.to(x.dtype, copy=True), states  # a copy: an op output may not alias another


@tree_rglru.register_fake
def _(decay, x, state0, parents, depth):
    return torch.empty_like(x), state0.new_empty(x.shape[0], x.shape[1], state0.shape[-1])


_tree_rglru = eager_fast_path(tree_rglru)


def run_tree_rglru(decay, x, state0, parents, depth) -> tuple[torch.Tensor, torch.Tensor]:
    """`tree_rglru`, eager calls on CPU tensors without the custom-op dispatcher."""
    return _tree_rglru(decay, x, state0, parents, depth)
