"""Tree lightning attention (MiniMax's linear attention with a per-head decay), every node after its own path.

HF's decode step for one token (`MiniMaxLightningAttention.forward` with a cached state): with r = e^(-slope) per
head, S_t = r S_{t-1} + k_t^T v_t and o_t = q_t S_t. Every node's state is its parent's decayed plus its own
outer product, so a tree is evaluated one level at a time (ssmspec.ops._common.levelwise_states) with the decode
step's own products, in the state's dtype as HF keeps it; the commit keeps the accepted node's state.
"""

from __future__ import annotations

import torch

from ssmspec.ops._common import eager_fast_path, gather_nodes, levelwise_states, reference_op


@reference_op("tree_lightning", traceable=False)
def tree_lightning(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ratio: torch.Tensor, state0: torch.Tensor,
    parents: torch.Tensor, depth: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Every node's output and state. query, key [B, H, N, D]; value [B, H, N, E]; ratio [H, 1, 1] the per-step
    decay; state0 [B, H, D, E] the committed state; parents, depth [B, N] (-1: the committed state). Returns
    the outputs [B, H, N, E] and the node states [B, N, H, D, E], in the state's dtype."""
    k, v = key.transpose(1, 2), value.transpose(1, 2)  # [B, N, H, D|E]

    def step(prev: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        outer = torch.matmul(gather_nodes(k, idx).unsqueeze(-1), gather_nodes(v, idx).unsqueeze(-2))
        return ratio * prev + outer

    states = levelwise_states(state0, parents, depth, step)
    out = torch.matmul(query.transpose(1, 2).unsqueeze(-2), states).squeeze(-2)  # [B, N, H, E]
    return out.transpose(1, 2).contiguous(), states


@tree_lightning.register_fake
def _(query, key, value, ratio, state0, parents, depth):
    b, h, n, _ = query.shape
    return value.new_empty(b, h, n, value.shape[-1]), state0.new_empty(b, n, *state0.shape[1:])


_tree_lightning = eager_fast_path(tree_lightning)


def run_tree_lightning(query, key, value, ratio, state0, parents, depth) -> tuple[torch.Tensor, torch.Tensor]:
    """`tree_lightning`, eager calls on CPU tensors without the custom-op dispatcher."""
    return _tree_lightning(query, key, value, ratio, state0, parents, depth)
