"""The generic path: exact chain speculation for a model without kernel seams, through HF's own forward and
cache (ssmspec.hf.generic).

A verify step snapshots the state (a copy of the model's cache object), feeds the root and the drafted chain in
one multi-token forward, and reads every node's logits. If the whole chain is accepted, the state already holds
it; otherwise the snapshot is restored and the accepted prefix is carried into the next step's forward, ahead of
its chain (a separate forward of the prefix cost 1.2-1.5 decode steps on the CPU; carried, it costs the marginal
tokens of one forward: docs, "The generic path"). Every forward is HF's own code on a real token sequence, so
exactness needs one property of the model only: a multi-token forward that continues a cached state computes what
single-token steps compute. The transform-time probe (ssmspec.probe.probe_generic) checks that by value before the
path is used (HF's Mamba, for one, ignores the cached state in a multi-token forward: refused). Chains only (a
tree's paths do not share one sequence), except where the model's token-mixing modules have tree forms
(ssmspec.hf.tree_modules: xLSTM's mLSTM backend, RWKV's time and channel mixing, MiniMax's attention layers,
ZAYA's attention): there a tree's nodes are fed as one sequence, each node computed after its parent, and the
commit writes the accepted node's state into the cache (no snapshot, nothing carried; its own probe,
ssmspec.probe.probe_generic_trees). A batch is verified row by row, each row in a state of its own that HF
prefilled from the row as padded in the batch (HF's handling of left padding in a recurrence is the model's own);
that is HF's batch where a second probe (ssmspec.probe.probe_generic_batches) finds HF's batched loop computing
what its rows compute alone, and refused elsewhere (HF's RWKV, MiniMax). A prompt with inputs besides token ids (a
multimodal prompt's pixel values) runs one prompt at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import EllipsisType

import torch
from torch import nn

from ssmspec import linear as packed_linear
from ssmspec.errors import PENDING_TREE, UnsupportedModelError
from ssmspec.hf import features, tree_modules
from ssmspec.hf import instance as hf_instance
from ssmspec.hf.generic import HFState, Snapshot
from ssmspec.tree import TokenTree

# why the generic path narrows what speculation may do (model.ssmspec_info.limits)
CHAINS_ONLY = "the generic path (HF's own forward, no kernel seam) verifies chains: use SpecConfig(tree=False)"
ONE_PROMPT = (
    "the generic path (HF's own forward) runs a prompt with inputs besides token ids (pixel values, ...) one prompt "
    "at a time"
)
ROW_BY_ROW = "the generic path (HF's own forward, no kernel seam) verifies a batch row by row (one forward per row)"


class _Row:
    """One row's HF state on the generic path: its snapshot per verify step and the accepted tokens it carries
    into the next forward."""

    def __init__(self, state: HFState, padding: int, max_carry: int) -> None:
        self.state = state
        self.padding = padding
        self.max_carry = max_carry
        self.carry = state.ids[:, :0]
        self.pending: tuple[torch.Tensor, Snapshot | None, torch.Tensor] | None = None  # (chain, snapshot, carry)
        self.pending_tree: tuple | None = None  # (tokens, replays, length, counters) of a tree verified

    @property
    def n_real(self) -> int:
        return self.state.length - self.padding + self.carry.shape[1]

    def verify(self, tokens: torch.Tensor, forward, discardable: bool = False) -> torch.Tensor:
        """Logits [1, n, V] of the chain `tokens` [1, n] (root first), fed after the carried tokens (`discardable`:
        a one-node chain too is verified from a snapshot, so that it can be discarded)."""
        if self.carry.shape[1] + tokens.shape[1] > self.max_carry:  # the carry would cost more than its own forward
            self.flush(forward)
        carry = self.carry
        snap = self.state.snapshot() if tokens.shape[1] > 1 or discardable else None  # (one node: always accepted)
        self.carry = carry[:, :0]
        logits = forward(self.state, torch.cat([carry, tokens], dim=1))[:, carry.shape[1] :]
        self.pending = (tokens, snap, carry)
        return logits

    def verify_tree(self, tokens: torch.Tensor, parents: list[int], steps: list, forward) -> torch.Tensor:
        """Logits [1, n, V] of a tree's nodes `tokens` [1, n] (`parents`: the root's -1) in one forward, its
        recurrence modules stepping each node from its parent's state (ssmspec.hf.tree_modules); the cache keeps
        the committed state until `commit_path`."""
        length, before = self.state.length, tree_modules.counters(self.state.cache)
        with tree_modules.verifying(steps, parents) as replays:
            logits = forward(self.state, tokens)
        self.pending_tree = (tokens, replays, length, before)
        return logits

    def commit_path(self, path: list[int]) -> None:
        """Keep the verified tree's root-to-node `path` (node indices, root first): each module's state replayed
        over it into the cache, the fed tokens those of the path."""
        tokens, replays, length, before = self.pending_tree
        self.pending_tree = None
        tree_modules.commit(replays, path)
        self.state.keep(length, tokens[:, path])
        tree_modules.set_counters(self.state.cache, before, len(path))

    def commit(self, keep: int) -> None:
        tokens, snap, carry = self.pending
        self.pending = None
        if keep < tokens.shape[1]:
            self.state.restore(snap)
            self.carry = torch.cat([carry, tokens[:, :keep]], dim=1)

    def discard(self) -> None:
        if self.pending_tree is not None:
            tokens, _, length, before = self.pending_tree
            self.pending_tree = None
            self.state.keep(length, tokens[:, :0])
            tree_modules.set_counters(self.state.cache, before, 0)
        if self.pending is not None:
            _, snap, carry = self.pending
            self.pending = None
            if snap is None:
                raise RuntimeError("a one-node step cannot be discarded (take a snapshot before it)")
            self.state.restore(snap)
            self.carry = carry

    def flush(self, forward) -> None:
        if self.carry.shape[1]:
            carry, self.carry = self.carry, self.carry[:, :0]
            forward(self.state, carry)


def _rows_padded(parts: list[torch.Tensor], n: int) -> torch.Tensor:
    """Per-row tensors [1, n_r, D] as one [B, n, D], each row's nodes first (padding nodes read zeros)."""
    if len(parts) == 1 and parts[0].shape[1] == n:
        return parts[0]
    out = parts[0].new_zeros(len(parts), n, parts[0].shape[-1])
    for r, part in enumerate(parts):
        out[r, : part.shape[1]] = part[0]
    return out


class GenericRunner:
    """ModelRunner's interface (prefill / verify / commit / discard / snapshot / restore) over HF's forward, for
    chains (trees with the tree form); a batch row by row."""

    path = "generic"
    static_shapes = False
    # its row-by-row forwards change HF's cache in place: an interrupted one cannot be retried
    retries_out_of_memory = False
    graphs = False  # (its steps are never captured: `open_runner` refuses it)
    fuse_single_nodes = False
    chooses_single_node_path = False  # (HF's forward has one path)

    def __init__(
        self, model: nn.Module, *, max_depth: int = 0, max_nodes: int | None = None, as_hf: bool = False,
        trees: bool | None = None, capture_features: bool = False, **_: object,
    ) -> None:  # fmt: skip
        """`as_hf`: HF's cache exactly as its loop keeps it (ssmspec.hf.generic.HFState; the probes' reference).
        `trees`: verify trees (and chains) through the model's recurrence modules' one-token form
        (ssmspec.hf.tree_modules), where transform installed it; None: where its probe found that exact
        (`model.ssmspec_info.generic_trees`)."""
        self.model = model
        self.as_hf = as_hf
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.dtype = next(model.parameters()).dtype
        self.device = hf_instance.input_device(model)
        self.agreement = hf_instance.Agreement(model)  # as ModelRunner's: the same timings on every process
        self.prepack = packed_linear.is_packed(model)
        self.packed_sizes: dict[int, bool] | None = None  # as ModelRunner's: measured per tree size
        self.chooses_packing = self.prepack and self.device.type == "cpu" and packed_linear.packs_any(model)
        self.capture_features = capture_features  # as ModelRunner's: the last verify's nodes' features (or prefill's)
        if capture_features:
            features.enable(model)
        self.features: torch.Tensor | None = None
        self._features: torch.Tensor | None = None  # the last forward's (one row)
        if trees is None:
            trees = bool(getattr(getattr(model, "ssmspec_info", None), "generic_trees", False))
        # the tree form: every multi-node step one forward, its commit a replay of the accepted path (no snapshot,
        # no tokens carried into the next forward)
        self.steps = tree_modules.installed(model) if trees and not as_hf else []
        self.rows: list[_Row] = []
        self._n_real: torch.Tensor | None = None  # tokens processed per row (after a prefill)
        self._pending: TokenTree | None = None
        self._discardable = False  # one-node verifies take a snapshot (`tree_path`)
        # accepted tokens not fed yet: a partial commit goes back to the snapshot and leaves the root and the
        # accepted drafts to the next verify's forward (one forward a step, the prefix's cost the marginal cost
        # of a few more tokens); fed alone first where they would make that forward longer than `max_carry`
        self.max_carry = max(2 * (max_nodes or 0), 16)

    def choose(
        self,
        *,
        packed_sizes: dict[int, bool] | None | EllipsisType = ...,
        single_node_path: bool | None | EllipsisType = ...,
    ) -> None:
        """The calibration's choices (`step.Runner.choose`): linears per tree size (HF's forward has one path for
        one-node steps, `single_node_path` is not its to take)."""
        if packed_sizes is not ...:
            self.packed_sizes = packed_sizes

    @property
    def trees(self) -> bool:
        """Whether this runner verifies branching trees (the tree form), or chains only."""
        return bool(self.steps)

    @property
    def reruns(self) -> bool:
        """Whether a partial commit feeds the accepted prefix again in the next forward (the chain form's cost,
        which the adaptive depth weighs)."""
        return not self.steps

    def _forward(self, state: HFState, tokens: torch.Tensor | None) -> torch.Tensor:
        nodes = state.ids.shape[1] if tokens is None else tokens.shape[1]
        packed = packed_linear.packs(self.packed_sizes, nodes, self.prepack)
        with packed_linear.prepacked(packed), features.capturing(self.model, self.capture_features) as capture:
            logits = state.forward(tokens)
        if capture is not None:
            self._features = features.positions(capture, logits)
        return logits

    def _row_features(self, n: int) -> torch.Tensor | None:
        """The last forward's features of its last `n` positions (a row's nodes after its carried tokens)."""
        return None if self._features is None or not self.capture_features else self._features[:, -n:]

    def _sync(self) -> None:
        self._n_real.copy_(torch.tensor([row.n_real for row in self.rows]))

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_positions: bool = False,
        model_inputs: dict | None = None, keep: int = 1,
    ) -> torch.Tensor:  # fmt: skip
        """HF's forward over each row of the (padded) prompt (with `model_inputs`: a multimodal prompt's pixel
        values, grids, token types, as HF's generate takes them: one prompt); returns the last position's logits
        [B, V] ([B, L, V] with `all_positions`). `keep` is ModelRunner.prefill's: here every position's logits and
        features are computed (a row's forward is HF's own, called as its generate calls it)."""
        if model_inputs and input_ids.shape[0] != 1:
            raise UnsupportedModelError(type(self.model).__name__, ONE_PROMPT)
        self.rows, logits, feats = [], [], []
        for r in range(input_ids.shape[0]):
            state = HFState(self.model, input_ids[r : r + 1], attention_mask[r : r + 1], model_inputs, self.as_hf)
            self.rows.append(_Row(state, int((attention_mask[r] == 0).sum()), self.max_carry))
            logits.append(self._forward(state, None))
            feats.append(self._row_features(logits[-1].shape[1]))
        self.features = torch.cat(feats) if self.capture_features else None
        self._n_real = torch.zeros(len(self.rows), dtype=torch.long, device=self.device)
        self._sync()
        logits = torch.cat(logits)
        return logits if all_positions else logits[:, -1]

    @property
    def n_real(self) -> torch.Tensor:
        """Tokens processed per row [B] (HF's cache keeps its own state; this is what the loop reads of it)."""
        return self._n_real

    def padded_size(self, nodes: int) -> int:
        return nodes

    def prepare(self, tree: TokenTree | Sequence[tuple[list[int], list[int]]]) -> TokenTree:
        """As ModelRunner.prepare: the tree (or per-row (tokens, parents) lists) on the model's device; a branching
        tree is refused where this path verifies chains only."""
        if not isinstance(tree, TokenTree):
            tree = TokenTree.from_lists([tokens for tokens, _ in tree], [parents for _, parents in tree])
        if not self.trees and not tree.depth_is_index:
            raise UnsupportedModelError(type(self.model).__name__, CHAINS_ONLY)
        return tree.to(self.device)

    @torch.no_grad()
    def verify(self, tree: TokenTree) -> torch.Tensor:
        """Logits [B, N, V] of the chains' nodes (root first), each row's real nodes fed after its carried tokens
        in one forward (padding nodes, never accepted, read zeros); with the tree form, a tree's nodes in one
        forward."""
        if self._pending is not None:
            raise RuntimeError(PENDING_TREE)
        tree = self.prepare(tree)
        out, feats = [], []
        for r, (row, ok) in enumerate(zip(self.rows, tree._acceptable_list)):
            n = sum(ok)  # a row's real nodes come first (padding follows them)
            tokens = tree.tokens[r : r + 1, :n]
            if self.trees and n > 1:
                out.append(row.verify_tree(tokens, tree._parents_list[r][:n], self.steps, self._forward))
            else:
                out.append(row.verify(tokens, self._forward, self._discardable))
            feats.append(self._row_features(n))
        logits, self.features = _rows_padded(out, tree.num_nodes), None
        if self.capture_features:
            self.features = _rows_padded(feats, tree.num_nodes)
        self._pending = tree
        self._sync()
        return logits

    @contextlib.contextmanager
    def tree_path(self) -> Iterator[None]:
        """One-node verifies in this block can be discarded (ModelRunner's name for it: a draft model's runner
        scores a root without committing it)."""
        outer, self._discardable = self._discardable, True
        try:
            yield
        finally:
            self._discardable = outer

    def verify_bytes(self) -> int:
        """Not measured on the generic path (HF's forward keeps its own cache; SpecConfig.verify_memory has nothing
        to cut by): 0."""
        return 0

    @torch.no_grad()
    def commit(self, last: torch.Tensor, hold: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep each row's chain up to node `last[b]`: as verified when it is the whole chain, else back to the
        snapshot, the carried and accepted tokens carried into the next forward (`hold`: as ModelRunner's; HF's cache
        grows for every row here)."""
        tree, self._pending = self._pending, None
        for r, (row, keep) in enumerate(zip(self.rows, last.tolist())):
            if row.pending_tree is not None:
                row.commit_path(tree.path_nodes(r, int(keep)))
            else:
                row.commit(int(keep) + 1)
        self._sync()
        return tree.paths(last.to(tree.tokens.device))

    def discard(self) -> None:
        """Forget the chains verified last."""
        if self._pending is not None:
            self._pending = None
            for row in self.rows:
                row.discard()
            self._sync()

    def flush(self) -> None:
        """Feed the carried tokens now, in a forward of their own (per row)."""
        for row in self.rows:
            row.flush(self._forward)
        self._sync()

    def release(self) -> None:
        """After a call: nothing is kept for the next (HF's cache is the call's own)."""

    def snapshot(self) -> list[tuple[Snapshot, torch.Tensor]]:
        return [(row.state.snapshot(), row.carry) for row in self.rows]

    def restore(self, snap: list[tuple[Snapshot, torch.Tensor]]) -> None:
        for row, (state, carry) in zip(self.rows, snap):
            row.state.restore(state)
            row.carry = carry
        self._sync()
