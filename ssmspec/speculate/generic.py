"""The generic path: exact chain speculation for a model without kernel seams, through HF's own forward and
cache (ssmspec.hf.generic).

A verify step snapshots the state (a copy of the model's cache object), feeds the root and the drafted chain
in one multi-token forward, and reads every node's logits. If the whole chain is accepted, the state already
holds it; otherwise the snapshot is restored and the accepted prefix is carried into the next step's forward,
ahead of its chain (a separate forward of the prefix cost 1.2-1.5 decode steps on the CPU; carried, it costs
the marginal tokens of one forward: docs, "The generic path"). Every forward is HF's own code on a real token
sequence, so exactness needs one property of the model only: a multi-token forward that continues a cached
state computes what single-token steps compute. The transform-time probe (ssmspec.probe.probe_generic) checks
that by value before the path is used (HF's Mamba, for one, ignores the cached state in a multi-token forward:
refused). Chains only (a tree's paths do not share one sequence), one prompt at a time (HF's handling of left
padding in a recurrence is the model's own: rows are not batched here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ssmspec import linear as packed_linear
from ssmspec.errors import UnsupportedModelError
from ssmspec.hf.generic import HFState, Snapshot
from ssmspec.tree import TokenTree

# why the generic path narrows what speculation may do (model.ssmspec_info.limits)
CHAINS_ONLY = "the generic path (HF's own forward, no kernel seam) verifies chains: use SpecConfig(tree=False)"
ONE_PROMPT = "the generic path (HF's own forward, no kernel seam) runs one prompt at a time"


@dataclass
class _Progress:
    """What the engine reads of a runner's cache: tokens processed per row."""

    n_real: torch.Tensor


class GenericRunner:
    """ModelRunner's interface (prefill / verify / commit / discard / snapshot / restore) over HF's forward,
    for chains and one prompt."""

    path = "generic"
    static_shapes = False

    def __init__(self, model: nn.Module, *, max_depth: int = 0, max_nodes: int | None = None, **_: object) -> None:
        self.model = model
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.prepack = packed_linear.is_packed(model)
        self.state: HFState | None = None
        self.cache: _Progress | None = None
        self._pending: tuple[TokenTree, Snapshot | None, torch.Tensor] | None = None
        # accepted tokens not fed yet: a partial commit goes back to the snapshot and leaves the root and the
        # accepted drafts to the next verify's forward (one forward a step, the prefix's cost the marginal cost
        # of a few more tokens); fed alone first where they would make that forward longer than `max_carry`
        self.carry = torch.zeros(1, 0, dtype=torch.long, device=self.device)
        self.max_carry = max(2 * (max_nodes or 0), 16)

    def _sync(self) -> None:
        self.cache.n_real.fill_(self.state.length - self.padding + self.carry.shape[1])

    def _forward(self, tokens: torch.Tensor | None) -> torch.Tensor:
        with packed_linear.prepacked(self.prepack):
            logits = self.state.forward(tokens)
        self._sync()
        return logits

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_positions: bool = False,
        model_inputs: dict | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """HF's forward over the prompt (with `model_inputs`: a multimodal prompt's pixel values, grids, token
        types, as HF's generate takes them); returns the last position's logits [1, V] ([1, L, V] with
        `all_positions`)."""
        if input_ids.shape[0] != 1:
            raise UnsupportedModelError(type(self.model).__name__, ONE_PROMPT)
        self.state = HFState(self.model, input_ids, attention_mask, model_inputs)
        self.padding = int((attention_mask == 0).sum())
        self.carry = input_ids[:, :0].to(self.device)
        self.cache = _Progress(torch.zeros(1, dtype=torch.long, device=self.device))
        logits = self._forward(None)
        return logits if all_positions else logits[:, -1]

    @property
    def n_real(self) -> torch.Tensor:
        return self.cache.n_real

    def padded_size(self, nodes: int) -> int:
        return nodes

    def prepare(self, tree: TokenTree) -> TokenTree:
        if not tree.depth_is_index:
            raise UnsupportedModelError(type(self.model).__name__, CHAINS_ONLY)
        return tree.to(self.device)

    @torch.no_grad()
    def verify(self, tree: TokenTree) -> torch.Tensor:
        """Logits [1, N, V] of the chain's nodes (root first), fed after the carried tokens in one forward."""
        if self._pending is not None:
            raise RuntimeError("commit or discard the previous tree before verifying another")
        tree = self.prepare(tree)
        if self.carry.shape[1] + tree.num_nodes > self.max_carry:  # the carry would cost more than its own forward
            self.flush()
        carry = self.carry
        snap = self.state.snapshot() if tree.num_nodes > 1 else None  # one node is always accepted
        self.carry = carry[:, :0]
        logits = self._forward(torch.cat([carry, tree.tokens], dim=1))[:, carry.shape[1] :]
        self._pending = (tree, snap, carry)
        return logits

    @torch.no_grad()
    def commit(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the chain up to node `last[0]`: as verified when it is the whole chain, else back to the snapshot,
        the carried and accepted tokens carried into the next forward."""
        tree, snap, carry = self._pending
        self._pending = None
        keep = int(last[0]) + 1
        if keep < tree.num_nodes:
            self.state.restore(snap)
            self.carry = torch.cat([carry, tree.tokens[:, :keep]], dim=1)
            self._sync()
        return tree.paths(last.to(tree.tokens.device))

    def discard(self) -> None:
        """Forget the chain verified last."""
        if self._pending is not None:
            tree, snap, carry = self._pending
            self._pending = None
            if snap is None:
                raise RuntimeError("a one-node step cannot be discarded (take a snapshot before it)")
            self.state.restore(snap)
            self.carry = carry
            self._sync()

    def flush(self) -> None:
        """Feed the carried tokens now, in a forward of their own."""
        if self.carry.shape[1]:
            carry, self.carry = self.carry, self.carry[:, :0]
            self._forward(carry)

    def snapshot(self) -> tuple[Snapshot, torch.Tensor]:
        return self.state.snapshot(), self.carry

    def restore(self, snap: tuple[Snapshot, torch.Tensor]) -> None:
        self.state.restore(snap[0])
        self.carry = snap[1]
        self._sync()
