"""Tree WKV (RWKV-4's time-mixing recurrence with its max stabilizer), every node after its own path.

HF's decode step for one token (`rwkv_linear_attention_cpu`), with w = -exp(time_decay), u = time_first, the
state (a, b, p) a numerator, a denominator and their common log scale:
    q = max(p, u + k_t),  out_t = (e^(p - q) a + e^(u + k_t - q) v_t) / (e^(p - q) b + e^(u + k_t - q))
    p' = max(p + w, k_t), a' = e^(p + w - p') a + e^(k_t - p') v_t,  b' = e^(p + w - p') b + e^(k_t - p').
Every node's output reads its parent's state and its own key and value, so a tree is evaluated one level at a
time (ssmspec.ops._common.levelwise_states): each level the same elementwise products as a decode step, its
states rounded to the state's dtype as HF's cache stores them between tokens (float32: HF keeps RWKV's state in
float32 whatever the model's dtype, and reads each key as float32). The commit keeps the accepted node's state.
"""

from __future__ import annotations

import torch

from ssmspec.ops._common import eager_fast_path, gather_nodes, levelwise_states, reference_op


def _update(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """The state after one token: state [..., 3, C] (a, b, p), key [..., C] float32, value [..., C]."""
    a, b, p = state.unbind(-2)
    p_new = torch.maximum(p + decay, key)
    e1, e2 = torch.exp(p + decay - p_new), torch.exp(key - p_new)
    return torch.stack([e1 * a + e2 * value, e1 * b + e2, p_new], dim=-2)


@reference_op("tree_wkv", traceable=False)
def tree_wkv(
    key: torch.Tensor, value: torch.Tensor, time_decay: torch.Tensor, time_first: torch.Tensor,
    state0: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Every node's WKV output and state. key, value [B, N, C]; time_decay, time_first [C]; state0 [B, 3, C] the
    committed (a, b, p) in the state's dtype; parents, depth [B, N] (-1: the committed state). Returns the
    outputs [B, N, C] in key's dtype and the node states [B, N, 3, C] in state0's dtype."""
    decay = -torch.exp(time_decay)
    k = key.float()  # as HF's step reads each key, whatever the model's dtype
    states = levelwise_states(
        state0, parents, depth,
        lambda prev, idx: _update(prev, gather_nodes(k, idx), gather_nodes(value, idx), decay).to(state0.dtype),
    )  # fmt: skip
    before = gather_nodes(states, parents.clamp(min=0))  # each node's parent state
    before = torch.where((parents >= 0)[..., None, None], before, state0[:, None])
    a, bb, p = before.unbind(-2)
    q = torch.maximum(p, k + time_first)
    e1, e2 = torch.exp(p - q), torch.exp(k + time_first - q)
    out = (e1 * a + e2 * value) / (e1 * bb + e2)
    return out.to(key.dtype), states


@tree_wkv.register_fake
def _(key, value, time_decay, time_first, state0, parents, depth):
    return torch.empty_like(key), state0.new_empty(key.shape[0], key.shape[1], *state0.shape[1:])


_tree_wkv = eager_fast_path(tree_wkv)


def run_tree_wkv(key, value, time_decay, time_first, state0, parents, depth) -> tuple[torch.Tensor, torch.Tensor]:
    """`tree_wkv`, eager calls on CPU tensors without the custom-op dispatcher."""
    return _tree_wkv(key, value, time_decay, time_first, state0, parents, depth)
