"""Commit ops: fold the accepted root-to-node path of each row into the committed states.

conv_window: the new conv state is the last S inputs along the path (committed columns fill the rest).
gather_states: the materialize strategy, pick each row's state at its last accepted node.
"""

from __future__ import annotations

import torch

from ssmspec.ops._common import reference_op


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


@reference_op("gather_states")
def gather_states(states: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """states [B,N,*S], last [B] -> [B,*S]."""
    return states[torch.arange(states.shape[0], device=states.device), last].clone()


@gather_states.register_fake
def _(states, last):
    return states.new_empty(states.shape[0], *states.shape[2:])
