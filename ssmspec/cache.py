"""SpecCache: a transformers `DynamicCache` that can verify a token tree without touching committed state.

Outside verification it is exactly HF's DynamicCache (prefill and plain forwards go through HF's own code).
Inside `cache.verifying(tree)`:
- mixers see no previous state and `is_recording_past() == True`, so they take their multi-token path
  for any tree size (the tree ops read the committed state themselves);
- `update_conv_state` records each node's pre-conv input and returns [committed state | node inputs];
- the tree ops (called from the rewritten seams) record per-node states or replay inputs;
- attention `update` appends the nodes' K/V after the committed prefix.
`commit(last)` then folds each row's accepted root-to-`last` path into the committed states: conv window
gather, recurrent state (materialized gather or replay along the path), and K/V compaction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from ssmspec.ops import commit as _commit_ops
from ssmspec.ops import ssd as _ssd_ops
from ssmspec.ops._common import eager_fast_path
from ssmspec.tree import TokenTree

conv_window, gather_states, ssd_state_at = map(
    eager_fast_path, (_commit_ops.conv_window, _commit_ops.gather_states, _ssd_ops.ssd_state_at)
)
COMMIT_STRATEGIES = ("replay", "materialize")
# SSD layers whose committed states are at most this many elements are replayed in one batched call
# (small models are bound by per-op overhead); larger states are replayed layer by layer, since the
# batched call would first copy every layer's state.
_BATCH_REPLAY_MAX_STATE = 65536


# A plain module-level holder (not a ContextVar) so that torch.compile can trace reads of it.
class _Active:
    cache: SpecCache | None = None


_ACTIVE = _Active()


def active_verify_cache() -> SpecCache | None:
    """The SpecCache currently verifying a tree, or None outside verification."""
    return _ACTIVE.cache


@dataclass
class RecurrentRecord:
    """What a tree op left for commit: all node states (materialize) or a replay closure (replay)."""

    states: torch.Tensor | None = None
    replay: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (last, path, lengths)
    # SSD replay inputs, kept as data so that commit can replay all layers of the same shape in one call
    ssd: dict | None = None


class SpecCache(DynamicCache):
    """HF DynamicCache plus tree verification and per-row commit (see module docstring)."""

    def __init__(self, config, *, strategy: str = "replay", state_dtype: torch.dtype | None = None) -> None:
        if strategy not in COMMIT_STRATEGIES:
            raise ValueError(f"commit strategy must be one of {COMMIT_STRATEGIES}, got {strategy!r}")
        super().__init__(config=config)
        self.strategy = strategy
        self.state_dtype = state_dtype
        self.tree: TokenTree | None = None
        self.current_layer: int | None = None
        self._pending_conv: dict[tuple[int, int], torch.Tensor] = {}
        self._pending_rec: dict[tuple[int, int], RecurrentRecord] = {}
        self._kv_len: dict[int, int] = {}

    # ---------------------------------------------------------------- layer bookkeeping
    def attention_layers(self) -> list[int]:
        """Indices of layers that hold attention K/V."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, CacheLayerMixin)]

    def linear_layers(self) -> list[int]:
        """Indices of layers that hold conv/recurrent states."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]

    def committed_recurrent(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The committed recurrent state of a layer (None before its first update)."""
        layer = self.layers[layer_idx]
        if not layer.is_recurrent_states_initialized[state_idx]:
            return None
        return layer.recurrent_states[state_idx]

    # ---------------------------------------------------------------- HF Cache API overrides
    # While verifying, mixers are told there is no previous state: then every family takes its multi-token
    # path (update_conv_state + the chunked seams) even for a one-node tree, never the in-place decode path.
    # The tree ops read the committed state from the cache themselves.
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self.current_layer = layer_idx
        return None if self.tree is not None else super().get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self.current_layer = layer_idx
        return None if self.tree is not None else super().get_recurrent_state(layer_idx, state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        if self.tree is not None:
            return True
        return super().is_recording_past(layer_idx)

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        self.current_layer = layer_idx
        if self.tree is None:
            return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)
        layer = self.layers[layer_idx]
        committed = layer.conv_states[state_idx]
        if committed is None or not layer.has_previous_state[state_idx]:
            raise RuntimeError(f"layer {layer_idx}: tree verification needs a prefilled conv state")
        self._pending_conv[(layer_idx, state_idx)] = conv_states
        return torch.cat([committed.to(conv_states.dtype), conv_states], dim=-1)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        if self.tree is not None:  # the tree op already recorded what commit needs
            return recurrent_states
        if self.state_dtype is not None and recurrent_states.is_floating_point():
            recurrent_states = recurrent_states.to(torch.promote_types(recurrent_states.dtype, self.state_dtype))
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    # ---------------------------------------------------------------- verification
    def record_recurrent(self, record: RecurrentRecord, state_idx: int = 0) -> None:
        """Called by a tree op seam: remember what commit needs for the current layer."""
        if self.current_layer is None:
            raise RuntimeError("a tree op ran before its mixer read its cache state")
        self._pending_rec[(self.current_layer, state_idx)] = record

    @contextlib.contextmanager
    def verifying(self, tree: TokenTree) -> Iterator[SpecCache]:
        """Run model forwards on `tree` without changing committed state; call `commit` afterwards."""
        if self.tree is not None:
            raise RuntimeError("SpecCache is already verifying a tree")
        self.tree = tree
        self._pending_conv.clear()
        self._pending_rec.clear()
        self._kv_len = {i: self.layers[i].get_seq_length() for i in self.attention_layers()}
        outer, _ACTIVE.cache = _ACTIVE.cache, self
        try:
            yield self
        finally:
            _ACTIVE.cache = outer
            self.tree = None

    def discard(self) -> None:
        """Drop a verified tree without committing anything (K/V appended by the tree are removed)."""
        for i, n0 in self._kv_len.items():
            layer = self.layers[i]
            layer.keys = layer.keys[:, :, :n0]
            layer.values = layer.values[:, :, :n0]
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._pending_conv.clear()
        self._pending_rec.clear()
        self._kv_len = {}

    def commit(self, tree: TokenTree, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance every row past its accepted path root -> last[b]. Returns (path [B, M], lengths [B]).

        Attention layers keep M new slots per row; slots past a row's length hold stale K/V that the
        caller must mask out (the engine tracks a per-row validity mask)."""
        path, lengths = tree.paths(last)
        # conv windows: one op call per group of layers with equal shapes
        groups: dict[tuple, list] = {}
        for (li, si), nodes in self._pending_conv.items():
            committed = self.layers[li].conv_states[si]
            key = (tuple(committed.shape), committed.dtype, tuple(nodes.shape), nodes.dtype)
            groups.setdefault(key, []).append((committed, nodes))
        for items in groups.values():
            k = len(items)
            new = conv_window(
                torch.cat([c for c, _ in items]), torch.cat([n for _, n in items]), path.repeat(k, 1), lengths.repeat(k)
            )
            for (target, _), part in zip(items, new.split(items[0][0].shape[0])):
                target.copy_(part)
        # recurrent states: gather (materialize), batched SSD replay, or the op's replay closure
        ssd_groups: dict[tuple, list] = {}
        for (li, si), rec in self._pending_rec.items():
            target = self.layers[li].recurrent_states[si]
            if rec.states is not None:
                target.copy_(gather_states(rec.states, last).to(target.dtype))
            elif rec.ssd is not None:
                a = rec.ssd
                key = tuple(
                    (n, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (n, v) for n, v in a.items()
                )
                if target.numel() > _BATCH_REPLAY_MAX_STATE:  # big states: concatenating them costs more
                    key = (li, si)
                ssd_groups.setdefault(key, []).append((target, a))
            else:
                target.copy_(rec.replay(last, path, lengths).to(target.dtype))
        rows = torch.arange(last.shape[0], device=last.device)
        for items in ssd_groups.values():
            self._replay_ssd(items, rows, last)
        for li, n0 in self._kv_len.items():
            layer = self.layers[li]
            for name in ("keys", "values"):
                full = getattr(layer, name)
                tail = full[:, :, n0:]
                idx = path[:, None, :, None].expand(full.shape[0], full.shape[1], path.shape[1], full.shape[3])
                setattr(layer, name, torch.cat([full[:, :, :n0], torch.gather(tail, 2, idx)], dim=2))
        self._reset_pending()
        return path, lengths

    @staticmethod
    def _replay_ssd(items: list, rows: torch.Tensor, last: torch.Tensor) -> None:
        """Replay the accepted paths of several SSD layers (same shapes) in one ssd_state_at call."""
        first = items[0][1]
        b, h = first["x"].shape[0], first["x"].shape[2]

        def cat(name):
            vals = [a[name] for _, a in items]
            if vals[0] is None:
                return None
            if vals[0].ndim == 1:  # per-layer parameters -> one row per (layer, batch row)
                return torch.cat([v.expand(b, h) for v in vals])
            return torch.cat(vals)

        mask = first["ancestor_mask"][rows, last].repeat(len(items), 1)
        new = ssd_state_at(
            cat("x"), cat("dt"), cat("A"), cat("Bm"), cat("dt_bias"), cat("h0"), mask,
            first["dt_softplus"], first["dt_min"], first["dt_max"],
        )  # fmt: skip
        for (target, _), part in zip(items, new.split(b)):
            target.copy_(part.to(target.dtype))

    # ---------------------------------------------------------------- snapshots (draft models)
    def snapshot(self) -> list[tuple]:
        """A copy of all committed states, for a drafter that advances and must roll back."""
        snap = []
        for layer in self.layers:
            item = {}
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                item["conv"] = {k: (v.clone() if v is not None else None) for k, v in layer.conv_states.items()}
                item["rec"] = {k: (v.clone() if v is not None else None) for k, v in layer.recurrent_states.items()}
            if isinstance(layer, CacheLayerMixin) and getattr(layer, "keys", None) is not None:
                item["kv_len"] = layer.get_seq_length()
            snap.append(item)
        return snap

    def restore(self, snap: list[dict]) -> None:
        """Put back the states saved by `snapshot` (in place, keeping tensor addresses)."""
        for layer, item in zip(self.layers, snap):
            for k, v in item.get("conv", {}).items():
                if v is not None:
                    layer.conv_states[k].copy_(v)
            for k, v in item.get("rec", {}).items():
                if v is not None:
                    layer.recurrent_states[k].copy_(v)
            if "kv_len" in item:
                n0 = item["kv_len"]
                layer.keys = layer.keys[:, :, :n0]
                layer.values = layer.values[:, :, :n0]
