"""Tree mLSTM (xLSTM's matrix memory with exponential gating and a max stabilizer), all nodes at once.

HF's decode step for one token (`mlstm_recurrent_step_native`): with lf = logsigmoid(f),
    m_t = max(lf_t + m_{t-1}, i_t),  C_t = e^(lf_t + m_{t-1} - m_t) C_{t-1} + e^(i_t - m_t) k_t v_t^T   (n_t alike, k_t)
    h_t = (q_t/sqrt(d)) C_t / (max(|(q_t/sqrt(d)) n_t|, e^(-m_t)) + eps).
Unrolled along node t's root-to-node path P(t) after the committed state (C0, n0, m0), with F_t the sum of lf over
P(t): m_t = max(m0 + F_t, max_{j in P(t)} i_j + F_t - F_j) and C_t = sum_j e^(i_j + F_t - F_j - m_t) k_j v_j^T +
e^(m0 + F_t - m_t) C0, so every node's output is a masked product over its ancestors, the tree's ancestor mask in
place of a causal one: one set of batched products for the whole tree instead of a step per node. The commit's
state at one node per row is the same sum over its path. Computed in at least float32 (float64 for float64
inputs); HF's step keeps its state in `dtype_state` between tokens (rounding it there), which this form does not:
they agree to that rounding (the transform-time probe checks by value).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmspec.ops._common import compute_dtype, eager_fast_path, reference_op


def _weights(igate, fgate, m0, ancestors):
    """Per node t and ancestor j: the log weight i_j + F_t - F_j (-inf off the path), the stabilizer m_t and the
    committed state's weight e^(m0 + F_t - m_t). igate, fgate [B, H, N]; m0 [B, H, 1]; ancestors [B, N, N] bool."""
    lf = F.logsigmoid(fgate)
    mask = ancestors[:, None]  # [B, 1, N, N]
    cum = (mask.to(lf.dtype) @ lf.unsqueeze(-1)).squeeze(-1)  # F_t [B, H, N]
    logw = (igate - cum).unsqueeze(-2) + cum.unsqueeze(-1)  # [B, H, N(t), N(j)]
    logw = logw.masked_fill(~mask, float("-inf"))
    m = torch.maximum(m0 + cum, logw.amax(-1))  # [B, H, N]
    return logw, m, torch.exp(m0 + cum - m)


@reference_op("tree_mlstm")
def tree_mlstm(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor, fgate: torch.Tensor,
    c0: torch.Tensor, n0: torch.Tensor, m0: torch.Tensor, ancestors: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    """Every node's mLSTM output. query, key [B, H, N, K]; value [B, H, N, V]; igate, fgate [B, H, N] (gate
    pre-activations); c0 [B, H, K, V], n0 [B, H, K], m0 [B, H, 1] the committed state; ancestors [B, N, N] bool
    (node t's path: ancestors[:, t, j] for j on it, t included). Returns h [B, H, N, V] in query's dtype."""
    cd = compute_dtype(query, c0)
    q, k, v = (x.to(cd) for x in (query, key, value))
    q = q * q.shape[-1] ** -0.5
    logw, m, w0 = _weights(igate.to(cd), fgate.to(cd), m0.to(cd), ancestors)
    a = torch.exp(logw - m.unsqueeze(-1)) * (q @ k.transpose(-1, -2))  # [B, H, N, N]
    num = a @ v + w0.unsqueeze(-1) * (q @ c0.to(cd))
    qn = a.sum(-1) + w0 * (q @ n0.to(cd).unsqueeze(-1)).squeeze(-1)
    den = torch.maximum(qn.abs(), torch.exp(-m)) + eps
    return (num / den.unsqueeze(-1)).to(query.dtype)


@tree_mlstm.register_fake
def _(query, key, value, igate, fgate, c0, n0, m0, ancestors, eps):
    return value.new_empty(*query.shape[:-1], value.shape[-1]).to(query.dtype)


@reference_op("mlstm_state_at")
def mlstm_state_at(
    key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor, fgate: torch.Tensor, c0: torch.Tensor,
    n0: torch.Tensor, m0: torch.Tensor, path: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The state (C [B, H, K, V], n [B, H, K], m [B, H, 1]) after one root-to-node path per row, `path` [B, N]
    bool (the nodes on it), from the committed state (c0, n0, m0): in at least float32, c0's dtype is the
    caller's to cast to."""
    cd = compute_dtype(key, c0)
    k, v = key.to(cd), value.to(cd)
    lf = F.logsigmoid(fgate.to(cd))
    on = path[:, None].to(cd)  # [B, 1, N]
    total = (lf * on).sum(-1, keepdim=True)  # F at the path's end [B, H, 1]
    # F_t - F_j for j on the path: the forget gates after j (j excluded) up to the end
    after = total - torch.cumsum(lf * on, dim=-1)
    logw = (igate.to(cd) + after).masked_fill(on == 0, float("-inf"))  # [B, H, N]
    m = torch.maximum(m0.to(cd) + total, logw.amax(-1, keepdim=True))  # [B, H, 1]
    w = torch.exp(logw - m)  # [B, H, N]
    w0 = torch.exp(m0.to(cd) + total - m)  # [B, H, 1]
    c = (k * w.unsqueeze(-1)).transpose(-1, -2) @ v + w0.unsqueeze(-1) * c0.to(cd)
    n = (k * w.unsqueeze(-1)).sum(-2) + w0 * n0.to(cd)
    return c, n, m


@mlstm_state_at.register_fake
def _(key, value, igate, fgate, c0, n0, m0, path):
    cd = compute_dtype(key, c0)
    return c0.new_empty(c0.shape, dtype=cd), n0.new_empty(n0.shape, dtype=cd), m0.new_empty(m0.shape, dtype=cd)


_tree_mlstm, _mlstm_state_at = eager_fast_path(tree_mlstm), eager_fast_path(mlstm_state_at)


def run_tree_mlstm(query, key, value, igate, fgate, c0, n0, m0, ancestors, eps: float) -> torch.Tensor:
    """`tree_mlstm`, eager calls on CPU tensors without the custom-op dispatcher."""
    return _tree_mlstm(query, key, value, igate, fgate, c0, n0, m0, ancestors, eps)


def run_mlstm_state_at(key, value, igate, fgate, c0, n0, m0, path) -> tuple[torch.Tensor, ...]:
    """`mlstm_state_at`, eager calls on CPU tensors without the custom-op dispatcher."""
    return _mlstm_state_at(key, value, igate, fgate, c0, n0, m0, path)
