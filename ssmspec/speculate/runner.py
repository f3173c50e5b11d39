"""ModelRunner: one transformed model plus its SpecCache, with prefill / verify(tree) / commit.

It owns the bookkeeping that makes batched trees exact: a per-row validity mask over attention slots
(rows accept different numbers of tokens, so compacted K/V keep stale slots that are masked out) and
per-row positions (HF's `cumsum(attention_mask) - 1` convention, continued by tree depth).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ssmspec.cache import SpecCache
from ssmspec.tree import TokenTree

_RECURRENT_MASK_KEYS = ("linear_attention", "conv", "mamba")


class _LayerMasks(dict):
    """Per-layer-type masks as HF hybrid models accept them; an unknown layer type is an error, not None."""

    def __missing__(self, key):
        raise KeyError(f"ssmspec: no tree attention mask for layer type {key!r} (only full attention is supported)")


def cache_kwarg(model: nn.Module) -> str:
    """The name under which the model's forward takes its cache (past_key_values or cache_params)."""
    params = inspect.signature(model.forward).parameters
    for name in ("past_key_values", "cache_params"):
        if name in params:
            return name
    raise ValueError(f"{type(model).__name__}.forward takes neither past_key_values nor cache_params")


class ModelRunner:
    """Drive a (transformed) HF causal LM through prefill, tree verification and commit."""

    def __init__(self, model: nn.Module, *, strategy: str = "replay", single_node_decode: bool = True) -> None:
        self.model = model
        self.cache_kwarg = cache_kwarg(model)
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.strategy = strategy
        # one-node trees go through HF's decode path (False: the tree path, e.g. to test it on one node)
        self.single_node_decode = single_node_decode
        self.dtype = next(model.parameters()).dtype
        self.cache: SpecCache | None = None
        self.kv_valid: torch.Tensor | None = None  # [B, L] bool
        self.n_real: torch.Tensor | None = None  # [B] tokens processed per row (padding excluded)

    def _call(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        kwargs = {self.cache_kwarg: self.cache, "use_cache": True}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if self.takes_positions:
            kwargs["position_ids"] = position_ids
        return self.model(input_ids=input_ids, **kwargs).logits

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Process the (left-padded) prompt with HF's own forward; returns the last position's logits [B, V]."""
        self.cache = SpecCache(self.model.config, strategy=self.strategy, state_dtype=self.dtype)
        mask = attention_mask.to(torch.long)
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits = self._call(input_ids, mask, position_ids)
        self.kv_valid = mask.bool()
        self.n_real = mask.sum(-1)
        return logits[:, -1]

    def _tree_mask(self, tree: TokenTree) -> torch.Tensor:
        b, n = tree.tokens.shape
        allowed = torch.cat([self.kv_valid[:, None, :].expand(b, n, -1), tree.ancestor_mask], dim=-1)
        mask = torch.zeros(b, 1, n, allowed.shape[-1], dtype=self.dtype, device=tree.tokens.device)
        return mask.masked_fill(~allowed[:, None], torch.finfo(self.dtype).min)

    def _decodes(self, tree: TokenTree) -> bool:
        """Whether `verify(tree)` runs HF's decode path instead of the tree path."""
        return tree.num_nodes == 1 and self.single_node_decode

    @torch.no_grad()
    def verify(self, tree: TokenTree) -> torch.Tensor:
        """Logits [B, N, V] for every node of the tree; committed state is untouched until `commit`."""
        self._pending_tree = tree
        attention = None
        if self.cache.attention_layers():
            attention = self._tree_mask(tree)
            if self.cache.linear_layers():  # hybrids take per-layer-type masks; recurrent layers need none
                attention = _LayerMasks({"full_attention": attention}, **dict.fromkeys(_RECURRENT_MASK_KEYS))
        positions = self.n_real[:, None] + tree.depth
        if self._decodes(tree):
            # one node per row is always accepted: HF's own decode path (in-place state update) is exact by
            # definition and cheaper than the tree path plus a commit
            return self._call(tree.tokens, attention, positions)
        with self.cache.verifying(tree):
            logits = self._call(tree.tokens, attention, positions)
        return logits

    @torch.no_grad()
    def commit(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance each row past root -> last[b] of the tree verified last; returns (path, lengths)."""
        tree = self._pending_tree
        if self._decodes(tree):  # the decode step already advanced every row by its one token
            path, lengths = tree.paths(last)
        else:
            path, lengths = self.cache.commit(tree, last)
        m = path.shape[1]
        if self.cache.attention_layers():
            new = torch.arange(m, device=path.device)[None, :] < lengths[:, None]
            self.kv_valid = torch.cat([self.kv_valid, new], dim=1)
        self.n_real = self.n_real + lengths
        self._pending_tree = None
        return path, lengths

    def snapshot(self) -> tuple:
        """Everything needed to roll the runner back (states, K/V length, masks)."""
        return self.cache.snapshot(), self.kv_valid.clone(), self.n_real.clone()

    def restore(self, snap: tuple) -> None:
        """Roll back to a snapshot."""
        states, kv_valid, n_real = snap
        self.cache.restore(states)
        self.kv_valid, self.n_real = kv_valid, n_real
