"""SpecCache: a transformers `DynamicCache` that verifies token trees without touching committed state.

Outside verification it is HF's DynamicCache (prefill and one-token decode steps are HF's own code), plus
the bookkeeping of the attention slots: which slots are valid per row (`valid`, right-aligned: each row's
slots form one contiguous block ending at the last column, laid out exactly as in HF's own cache for that
row), the absolute slot count `seen`, and the real tokens per row `n_real`. The offsets HF models read
(`get_query_offset`, `get_mask_sizes`, `get_seq_length`) are derived from that layout.

Inside `verifying(tree)` (one ssmspec.verification.Verification per call):
- mixers see no previous state and `is_recording_past() == True`, so they take their multi-token path for
  any tree size (the seam adapters read the committed state themselves);
- `update_conv_state` records each node's pre-conv input and returns [committed state | node inputs];
- attention `update` appends the nodes' K/V after the committed slots (sliding layers keep them all);
- query and key offsets are each node's own position (prefix + depth), per node when the tree branches.
`Verification.commit(last)` then folds the accepted paths in; `keep_kv` rewrites the attention slots so that
every row again holds exactly its own tokens, contiguous (no slots of rejected drafts, bounded memory).

With a `capacity`, the attention K/V live instead in preallocated buffers [B, H, prompt + capacity, D] updated in
place (`static_kv`), laid out by absolute slot: each row's tokens occupy its slots [0, block[b]) (the prompt's pads
invalid), a step's nodes are written at [block[b], block[b] + N), and commit moves each row's accepted path down to
[block[b], block[b] + length). No step copies the K/V (HF's layout concatenates them every step and the commit
rewrites them: a long batched run held several copies at its peak). With static shapes (compiled and CUDA-graph
verification) every tensor a step touches keeps its shape and address, so one compiled graph (one CUDA graph)
serves every step of a tree-size bucket; in eager mode (`views`) the attention reads only the slots in use (views
of the buffers), which are preallocated for the whole call where that is affordable (PREALLOCATE_BYTES) and grow
by half otherwise. The masks say which slots each node sees (`hf.masks.allowed_static`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import DynamicCache, PretrainedConfig

from ssmspec.errors import not_one_of
from ssmspec.hf import layers as hf_layers
from ssmspec.ops import Record
from ssmspec.tree import TokenTree
from ssmspec.verification import COMMIT_STRATEGIES, Verification, write_slots

# static K/V in eager mode: the whole call's slots are allocated at its start where they take at most this much (all
# attention layers, K and V, every row); beyond it the buffers start at what this holds and grow by half when full
PREALLOCATE_BYTES = 256 << 20
# static K/V of captured steps: at least this many slots per row, so that the calls of usual lengths (prompt and new
# tokens within it) share one layout, and with it every step captured (and on a CPU compiled) for it
STATIC_KV_SLOTS = 1024


class SpecCache(DynamicCache):
    """HF DynamicCache plus tree verification, per-row commit and a right-aligned attention layout.

    Args:
        config: the model's config (HF builds the per-layer caches from it).
        commit: "replay" or "materialize" (how verifications commit recurrent states).
        state_dtype: recurrent states are stored in at least this dtype.
        capacity: static K/V: slots per row to preallocate after the prompt (the tokens that may still follow,
            tree nodes included; the buffers grow if a step would overflow them). None: HF's dynamic layout (K/V
            concatenated and rewritten per step).
        views: static K/V in eager mode: the attention reads only the slots in use, and the buffers are sized for
            memory (PREALLOCATE_BYTES) rather than for one compiled shape; a model with sliding-window layers keeps
            HF's layout then.

    Raises:
        ValueError: an unknown commit strategy.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        commit: str = "replay",
        state_dtype: torch.dtype | None = None,
        capacity: int | None = None,
        views: bool = False,
    ) -> None:
        if commit not in COMMIT_STRATEGIES:
            raise not_one_of("commit strategy", commit, COMMIT_STRATEGIES)
        super().__init__(config=config)
        self.commit_strategy = commit
        self.state_dtype = state_dtype
        self.verification: Verification | None = None
        self.attention = hf_layers.attention_layers(self.layers)
        self.recurrent = hf_layers.recurrent_layers(self.layers)
        self.valid: torch.Tensor | None = None  # [B, W] validity of the last W absolute slots
        self._seen: int | None = 0  # absolute slot count (of the longest row); None: block.max(), not read yet
        self.n_real: torch.Tensor | None = None  # [B] real tokens processed per row
        self.block: torch.Tensor | None = None  # [B] slots of each row in HF's layout (its pads included)
        self.reads_slot_positions = False  # a model read query/key offsets while verifying a tree
        self.views = views
        # eager buffers keep every slot where HF's layout keeps a sliding layer's window only: HF's layout there
        self.capacity = None if views and any(w is not None for w in self.windows()) else capacity
        self.static_kv = False  # K/V in preallocated buffers (set by `start` when a capacity was given)
        self._bound = 0  # static K/V: host upper bound of the longest row's slots (`reserve` grows the buffers)
        self._limit = 0  # static K/V: the slots the call may need at most (prompt + capacity)
        self._step_start: tuple = (None, None)  # (block, n_real) where the step being verified started
        self.held: torch.Tensor | None = None  # rows `hold` has held since the call started (finished)
        # static K/V: `valid`, `block` and `n_real` are updated in place (captured steps read them at fixed addresses)
        self.in_place_layout = False
        self.kv_generation = 0  # static K/V: how often the buffers were (re)allocated (a captured step reads them)

    # ---------------------------------------------------------------- layout bookkeeping
    @property
    def seen(self) -> int:
        """Absolute slot count of the longest row. A model without attention never needs it during a step, so
        its commit leaves it on the device (no host synchronisation: CUDA graphs) until something reads it."""
        if self._seen is None:
            self._seen = int(self.block.max())
        return self._seen

    @seen.setter
    def seen(self, value: int) -> None:
        self._seen = value

    def attention_layers(self) -> list[int]:
        """Indices of layers that hold attention K/V."""
        return [a.index for a in self.attention]

    def linear_layers(self) -> list[int]:
        """Indices of layers that hold conv/recurrent states."""
        return self.recurrent

    def kv_widths(self) -> dict[int, int]:
        """Stored slots per attention layer."""
        return {a.index: hf_layers.kv_width(self.layers[a.index]) for a in self.attention}

    def tree_kv_bytes(self, before: dict[int, int]) -> int:
        """Bytes of the attention K/V slots appended since `before` (kv_widths then); static K/V: none (its buffers
        are allocated once, for the whole call)."""
        if self.static_kv:
            return 0
        total = 0
        for a in self.attention:
            keys, values = hf_layers.kv(self.layers[a.index])
            added = hf_layers.kv_width(self.layers[a.index]) - before.get(a.index, 0)
            for t in (keys, values):
                if t is not None and t.shape[-2] > 0 and added > 0:
                    total += added * (t.numel() // t.shape[-2]) * t.element_size()
        return total

    def _needed_width(self, full_width: int) -> int:
        """Columns of the canonical layout some layer still needs."""
        widths = [full_width if a.window is None else min(a.window - 1, full_width) for a in self.attention]
        return max(widths, default=0)

    def start(self, attention_mask: torch.Tensor) -> None:
        """After HF's prefill of a (left-padded) prompt: its slots as HF stored them.

        Args:
            attention_mask: [B, L] the prompt's mask (1 = token, 0 = padding).
        """
        mask = attention_mask.bool()
        self.seen = mask.shape[1]
        self.valid = mask[:, mask.shape[1] - self._needed_width(mask.shape[1]) :]
        self.n_real = mask.sum(-1)
        self.block = torch.full_like(self.n_real, mask.shape[1])
        self.held = None
        hf_layers.stack_states(self.layers, self.recurrent)
        if self.capacity is not None and self.attention:
            self.static_kv = True
            self._bound = mask.shape[1]
            self._limit = mask.shape[1] + self.capacity
            if self.views:  # the whole call where affordable, else what PREALLOCATE_BYTES holds (growing by half)
                width = self._limit
                if width * self._slot_bytes() > PREALLOCATE_BYTES:
                    width = mask.shape[1] + max(256, PREALLOCATE_BYTES // self._slot_bytes())
            else:  # a power of two: prompts of similar lengths share the buffers' shape (and their compiled graphs);
                # captured steps (compiled or CUDA graphs, kept for later calls) at least STATIC_KV_SLOTS
                least = STATIC_KV_SLOTS if self.in_place_layout else 64
                width = 1 << max(least - 1, self._limit - 1).bit_length()
            self.valid = torch.cat([mask, mask.new_zeros(mask.shape[0], width - mask.shape[1])], dim=1)
            self._place_kv(self.valid.shape[1], mask.shape[1])

    # ---------------------------------------------------------------- static K/V buffers
    def _slot_bytes(self) -> int:
        """Bytes one slot takes in every attention layer's K and V, all rows."""
        total = 0
        for a in self.attention:
            for t in hf_layers.kv(self.layers[a.index]):
                if t is not None:
                    total += t.shape[0] * t.shape[1] * t.shape[3] * t.element_size()
        return total

    def visible(self, nodes: int) -> int | None:
        """Static K/V in eager mode: the slots a step of `nodes` nodes per row reads (every row's committed slots
        and the step's own: the attention and the masks are that wide); None: the whole buffers."""
        return self._bound + nodes if self.static_kv and self.views else None

    def _place_kv(self, width: int, end: int) -> None:
        """Put every attention layer's K/V in zeroed [B, H, width, D] buffers, their columns ending at slot `end`:
        after the prefill, the prompt's last slot (a sliding layer kept only its window); when the buffers grow,
        the old width (every slot stays where it was). Addresses are marked static (CUDA graphs)."""
        for a in self.attention:
            layer = self.layers[a.index]
            keys, values = hf_layers.kv(layer)
            if keys is None:
                raise RuntimeError(f"layer {a.index}: static K/V buffers need a prefilled attention cache")
            placed = []
            for t in (keys, values):
                buf = t.new_zeros(*t.shape[:2], width, t.shape[3])
                buf[:, :, end - t.shape[2] : end] = t
                if not torch.compiler.is_compiling():
                    torch._dynamo.mark_static_address(buf)
                placed.append(buf)
            hf_layers.set_kv(layer, *placed, self.seen)
        self.kv_generation += 1

    def reserve(self, nodes: int) -> None:
        """Make sure a step of `nodes` nodes per row fits the static K/V buffers (eager, before the step: inside a
        compiled step nothing may change shape); grows them, doubling, where it would not. No-op otherwise."""
        old = self.valid.shape[1] if self.static_kv else 0
        self._step_start = (self.block, self.n_real)  # (where a step starts: `holding`)
        if not self.static_kv or self._bound + nodes <= old:
            return
        width = max(2 * old, self._bound + nodes)
        if self.views:  # by half, within what the call may need while it fits: growing copies the buffers
            half = old + old // 2
            width = max(min(half, self._limit) if self._bound + nodes <= self._limit else half, self._bound + nodes)
        self._place_kv(width, old)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(self.valid.shape[0], width - old)], dim=1)

    def _write_kv(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Static K/V: write a step's N nodes per row at slots [block[b], block[b] + N), in place; returns the
        whole buffers (the masks say which slots each node sees)."""
        layer = self.layers[layer_idx]
        keys, values = hf_layers.kv(layer)
        n = key_states.shape[-2]
        slots = self.block[:, None] + torch.arange(n, device=self.block.device)
        for buf, new in ((keys, key_states), (values, value_states)):  # K and V may differ in width (MLA)
            write_slots(buf, slots, new)
        width = self.visible(n)
        return (keys, values) if width is None else (keys[:, :, :width], values[:, :, :width])

    def after_decode(self) -> None:
        """After one HF decode step (one token per row, HF's own cache update)."""
        if self._seen is not None:
            self._seen += 1
        self.n_real = self.n_real + 1
        if self.static_kv:  # the token was written at each row's slot `block` (no host synchronisation)
            self.valid = self.valid.scatter(1, self.block[:, None], True)
            self.block = self.block + 1
            self._bound += 1
            return
        self.block = self.block + 1
        valid = torch.cat([self.valid, self.valid.new_ones(self.valid.shape[0], 1)], dim=1)
        self.valid = valid[:, valid.shape[1] - self._needed_width(valid.shape[1]) :]

    def windows(self) -> list[int | None]:
        """The distinct sliding windows of the attention layers (None = full attention)."""
        return list(dict.fromkeys(a.window for a in self.attention))

    def window_view(self, window: int | None) -> torch.Tensor:
        """[B, W_k] validity of the committed slots stored by attention layers with this window."""
        index = next(a.index for a in self.attention if a.window == window)
        width = self.verification.kv_start[index] if self.verification is not None else None
        if width is None:
            width = hf_layers.kv_width(self.layers[index])
        return self.valid[:, self.valid.shape[1] - width :]

    def committed_kv(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V [H, T, D] of one row's committed tokens that the layer still attends to (a sliding layer: the
        last window - 1), in slot order, whichever the layout."""
        keys, values = hf_layers.kv(self.layers[layer_idx])
        if self.static_kv:
            window = next(a.window for a in self.attention if a.index == layer_idx)
            valid = self.valid[row].clone()
            if window is not None:
                valid[: max(int(self.block[row]) - (window - 1), 0)] = False
        else:
            valid = self.valid[row, self.valid.shape[1] - keys.shape[2] :]
        return keys[row][:, valid], values[row][:, valid]

    # ---------------------------------------------------------------- committed state access
    def committed_recurrent(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The committed recurrent state of a layer (None before its first update)."""
        return hf_layers.recurrent_state(self.layers[layer_idx], state_idx)

    def state_tensor(self, rec: Record) -> torch.Tensor:
        """The committed tensor a commit record overwrites (a view of the slice it owns, for a per-head record)."""
        layer = self.layers[rec.layer]
        state = layer.conv_states[rec.state_idx] if rec.kind == "conv" else layer.recurrent_states[rec.state_idx]
        return state if rec.part is None else state[:, rec.part]

    # ---------------------------------------------------------------- HF Cache API overrides
    # While verifying, mixers are told there is no previous state: then every family takes its multi-token
    # path (update_conv_state + the chunked seams) even for a one-node tree, never the in-place decode path.
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.verification is not None else super().get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.verification is not None else super().get_recurrent_state(layer_idx, state_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return False if self.verification is not None else super().has_previous_state(layer_idx, state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return True if self.verification is not None else super().is_recording_past(layer_idx)

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        if self.verification is None:
            return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)
        committed = hf_layers.conv_state(self.layers[layer_idx], state_idx)
        if committed is None:
            raise RuntimeError(f"layer {layer_idx}: tree verification needs a prefilled conv state")
        ext = self._conv_ext(committed.to(conv_states.dtype), conv_states)
        if self.verification.in_place:  # one node, always accepted: the window moves by it now (what commit would do)
            self.verification.claim(f"layer {layer_idx}", "update_conv_state", layer_idx, state_idx, True, None)
            committed.copy_(ext[..., 1:])
            return ext
        rec = Record("conv", layer_idx, state_idx, replay={"nodes": conv_states, "ext": ext})
        self.verification.record(f"layer {layer_idx}", "update_conv_state", rec)
        return ext

    def _conv_ext(self, committed: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """[committed | node inputs] along time, [B, C, S+N], in time-major memory ([B, S+N, C] transposed: the tree
        conv reads rows of contiguous channels). Where the committed state is one of a stack (`stack_states`), it
        is written into the verification's matching stack, so that the commit gathers every layer's new window
        with one op."""
        parts = (committed.transpose(1, 2), nodes.transpose(1, 2))
        stack = committed._base
        if stack is None or torch.compiler.is_compiling() or stack.dim() != committed.dim() + 1:
            return torch.cat(parts, 1).transpose(1, 2)
        b, c, s = committed.shape
        buffers = self.verification.buffers
        key = (id(stack), nodes.dtype)
        if key not in buffers:
            buffers[key] = nodes.new_empty(stack.shape[0], b, s + nodes.shape[-1], c)
        out = buffers[key][(committed.storage_offset() - stack.storage_offset()) // stack.stride(0)]
        return torch.cat(parts, 1, out=out).transpose(1, 2)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        if self.verification is not None:  # the seam adapter already recorded what commit needs
            return recurrent_states
        if self.state_dtype is not None and recurrent_states.is_floating_point():
            recurrent_states = recurrent_states.to(torch.promote_types(recurrent_states.dtype, self.state_dtype))
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.static_kv:
            return self._write_kv(layer_idx, key_states, value_states)
        if self.verification is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]  # keep every slot until commit (sliding layers too)
        keys, values = hf_layers.kv(layer)
        keys = torch.cat([keys, key_states.to(keys.dtype)], dim=-2)
        values = torch.cat([values, value_states.to(values.dtype)], dim=-2)
        layer.keys, layer.values = keys, values
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not self.attention or self.valid is None:
            return super().get_seq_length(layer_idx)
        return self.seen

    def get_query_offset(self, layer_idx: int = 0):
        """Absolute slot of the first query; while verifying a branching tree, per node (prefix + depth)
        minus its index, so that `arange(q) + offset` is every node's own position."""
        self._no_slot_positions("get_query_offset")
        if self.verification is None:
            return self.seen
        self.reads_slot_positions = True
        depth = self._uniform_depth()
        if depth is None:
            return self.seen
        return self.seen + depth - torch.arange(depth.shape[0], device=depth.device)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if not self.attention or self.valid is None:
            return super().get_mask_sizes(query_length, layer_idx)
        self._no_slot_positions("get_mask_sizes")
        if layer_idx >= len(self.layers) or layer_idx not in self.kv_widths():
            layer_idx = self.attention[0].index
        if self.verification is None:
            width = hf_layers.kv_width(self.layers[layer_idx])
            return width + query_length, self.seen - width
        self.reads_slot_positions = True
        width = self.verification.kv_start[layer_idx]
        depth = self._uniform_depth()
        if depth is None:
            return width + query_length, self.seen - width
        nodes = self.seen + depth - torch.arange(width, width + depth.shape[0], device=depth.device)
        return width + query_length, torch.cat([nodes.new_full((width,), self.seen - width), nodes])

    def _no_slot_positions(self, method: str) -> None:
        """Static K/V slots are not HF's layout: a model deriving positions or mask sizes from them is refused
        (the runner keeps HF's layout for models the probe saw reading them)."""
        if self.static_kv:
            raise RuntimeError(
                f"the model calls SpecCache.{method} (positions from cache slots), which the static K/V layout does "
                "not provide; verify it with SpecConfig(static_shapes=False)"
            )

    def _uniform_depth(self) -> torch.Tensor | None:
        """The tree's node depths if every row has the same depth per node index (None for chains: then
        positions are plain slot offsets); raises for batches whose rows differ (trees must be level-aligned
        for a model that derives positions from cache slots)."""
        tree = self.verification.tree
        depth = tree.depth
        if tree.depth_is_index:
            return None
        if depth.shape[0] > 1 and not bool((depth == depth[:1]).all()):
            raise RuntimeError(
                "the model derives positions from cache slots; verify level-aligned trees (same depth per node "
                "index in every row), see TokenTree.level_aligned"
            )
        return depth[0]

    # ---------------------------------------------------------------- verification
    @contextlib.contextmanager
    def verifying(self, tree: TokenTree, in_place: bool = False) -> Iterator[Verification]:
        """Run model forwards on `tree` without changing committed state; then commit or discard.

        Args:
            tree: the trees to verify, one per batch row.
            in_place: a one-node tree whose ops advance the committed state as they verify, where they can (the
                verification cannot be discarded afterwards).

        Yields:
            The Verification: `commit(last)` it afterwards (or `discard()`); an exception inside discards it.

        Raises:
            RuntimeError: a verification is already open on this cache.
        """
        if self.verification is not None:
            raise RuntimeError("SpecCache is already verifying a tree")
        verification = Verification(self, tree, self.commit_strategy, in_place)
        self.verification = verification
        try:
            yield verification
        except BaseException:
            verification.discard()
            raise
        finally:
            self.verification = None

    def drop_kv(self, widths: dict[int, int]) -> None:
        """Remove the slots appended after `widths` (a discarded tree). Static K/V: nothing to do, the tree's
        slots were never valid."""
        if self.static_kv:
            return
        for a in self.attention:
            layer = self.layers[a.index]
            keys, values = hf_layers.kv(layer)
            if keys is not None:
                hf_layers.set_kv(layer, keys[:, :, : widths[a.index]], values[:, :, : widths[a.index]], self.seen)

    def keep_kv(
        self, widths: dict[int, int], path: torch.Tensor, lengths: torch.Tensor, longest: int | None = None
    ) -> None:
        """Keep each row's committed slots plus its accepted path, right-aligned, and nothing else: every row
        is again laid out as in HF's own cache for that row (its pads, its tokens), the slots of rejected drafts
        are gone, and the layout is as wide as the longest row. Static K/V: the commit already moved the path's
        slots (`kv_slots`); they become valid here.

        Args:
            widths: stored slots per attention layer before the tree's K/V were appended.
            path: [B, M] each row's accepted node indices (padded).
            lengths: [B] accepted path lengths.
            longest: max(lengths) if known on the host (static K/V: how full the buffers are; else M is assumed).
        """
        if self.static_kv or not self.attention:  # (no attention: the token counts alone)
            self._keep_static(path, lengths, path.shape[1] if longest is None else longest)
            return
        self.n_real = self.n_real + lengths
        self.block = self.block + lengths
        self.seen = int(self.block.max())
        b, w = self.valid.shape
        dev = self.valid.device
        block = torch.minimum(self.block - lengths, torch.full_like(lengths, w))  # each row's stored columns
        first = w - block
        new_block = block + lengths
        width = int(new_block.max())
        j = torch.arange(width, device=dev)[None, :] - (width - new_block)[:, None]  # index inside the row's block
        old = j < block[:, None]
        # source column relative to the end of the committed layout (< 0), or the tree node (>= 0)
        node = torch.gather(path, 1, (j - block[:, None]).clamp(0, path.shape[1] - 1))
        source = torch.where(old, j - block[:, None], node)
        source = torch.where(j < 0, torch.full_like(source, -1), source)
        old_valid = torch.gather(self.valid, 1, (first[:, None] + j).clamp(0, max(w - 1, 0))) if w else old
        valid = (j >= 0) & (~old | old_valid)
        needed = self._needed_width(width)
        self.valid = valid[:, width - needed :]
        simple = b == 1 and bool((first == 0).all())
        for a in self.attention:
            layer = self.layers[a.index]
            keys, values = hf_layers.kv(layer)
            start = widths[a.index]
            keep = width if a.window is None else min(a.window - 1, width)
            if simple:  # one row: the committed slots stay, the path's slots follow
                tail = path[0, : int(lengths[0])] + start
                keys = torch.cat([keys[:, :, :start], keys[:, :, tail]], dim=2)[:, :, -keep:]
                values = torch.cat([values[:, :, :start], values[:, :, tail]], dim=2)[:, :, -keep:]
            else:
                col = (source + start)[:, width - keep :].clamp(0, keys.shape[2] - 1)
                keys, values = (torch.gather(t, 2, col[:, None, :, None].expand(b, t.shape[1], keep, t.shape[3]))
                                for t in (keys, values))  # fmt: skip
            hf_layers.set_kv(layer, keys, values, self.seen)

    def kv_slots(self) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """Static K/V: every attention layer's K and V buffers and each row's first tree slot, for the commit to
        move the accepted nodes' slots (ssmspec.verification.move_slots); None for HF's layout."""
        if not self.static_kv:
            return None
        return [t for a in self.attention for t in hf_layers.kv(self.layers[a.index])], self.block

    def _keep_static(self, path: torch.Tensor, lengths: torch.Tensor, longest: int) -> None:
        """Static K/V (or no attention at all), after the commit moved the accepted slots (`kv_slots`): they become
        valid, the rest of the step's slots stay invalid; each row's token count advances."""
        self.advance_static(path, lengths)
        self.settle_static(longest)

    def advance_static(self, path: torch.Tensor, lengths: torch.Tensor) -> None:
        """`_keep_static`'s device work: the accepted slots valid (static K/V), each row's block and token count
        advanced (in place with `in_place_layout`: a captured commit)."""
        if self.static_kv:
            steps = torch.arange(path.shape[1], device=path.device)
            slots, kept = self.block[:, None] + steps, steps[None, :] < lengths[:, None]
            self.valid = (
                self.valid.scatter_(1, slots, kept) if self.in_place_layout else self.valid.scatter(1, slots, kept)
            )
        if self.in_place_layout:
            self.block.add_(lengths)
            self.n_real.add_(lengths)
        else:
            self.block = self.block + lengths
            self.n_real = self.n_real + lengths

    def settle_static(self, longest: int) -> None:
        """`_keep_static`'s host bookkeeping, `longest` the longest accepted path."""
        self._seen = None
        if self.static_kv:  # eager: the slots in use exactly (a host read; a step's views are that wide), else a bound
            self._bound = int(self.block.max()) if self.views else self._bound + longest

    def holding(self, rows: list[bool] | None) -> tuple | None:
        """Before a commit: what `hold` needs to keep `rows` (finished rows) where they are, or None where nothing is
        held (no such row, or not eager K/V buffers: HF's layout and compiled buffers advance every row alike)."""
        if rows is None or not any(rows) or not (self.static_kv and self.views):
            return None
        return torch.tensor(rows, device=self.block.device), *self._step_start

    def hold(self, held: tuple | None) -> None:
        """After a commit: the rows `holding` saw stay where they were (their slots, made valid by the commit, are not;
        their next step's K/V is written over them)."""
        if held is None:
            return
        rows, block, n_real = held
        self.held = rows if self.held is None else self.held | rows
        col = torch.arange(self.valid.shape[1], device=block.device)
        advanced = rows[:, None] & (col[None, :] >= block[:, None]) & (col[None, :] < self.block[:, None])
        self.valid = self.valid & ~advanced
        self.block = torch.where(rows, block, self.block)
        self.n_real = torch.where(rows, n_real, self.n_real)
        self._seen = None
        self._bound = int(self.block.max())

    # ---------------------------------------------------------------- workspaces kept between calls
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this cache holds (states, K/V, slot layout): what a step captured over it may read."""
        out = [t for t in (self.valid, self.block, self.n_real) if t is not None]
        for layer in self.layers:
            for states in hf_layers.state_dicts(layer).values():
                out.extend(t for t in states.values() if t is not None)
            out.extend(t for t in (hf_layers.kv(layer) if hasattr(layer, "keys") else ()) if t is not None)
        return out

    def layout(self) -> tuple:
        """The shapes and dtypes of every tensor this cache holds, and how its K/V are laid out: two caches with the
        same layout can take each other's state (`adopt`)."""
        return (self.static_kv, self.in_place_layout, self.commit_strategy, self.views,
                tuple((tuple(t.shape), t.dtype, str(t.device)) for t in self.tensors()))  # fmt: skip

    def adopt(self, other: SpecCache) -> None:
        """Take the state of `other` (a cache of the same `layout`, just prefilled) into this cache's own tensors, in
        place: steps captured over this cache then continue `other`'s call."""
        if other.layout() != self.layout():
            raise ValueError("SpecCache.adopt: the caches' layouts differ")
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs)
        for name in ("_seen", "_bound", "_limit", "reads_slot_positions"):
            setattr(self, name, getattr(other, name))
        self.held = None
        self.verification = None
        self._step_start = (self.block, self.n_real)
        for a in self.attention:  # (a sliding layer counts the slots seen)
            keys, values = hf_layers.kv(self.layers[a.index])
            hf_layers.set_kv(self.layers[a.index], keys, values, self.seen)

    # ---------------------------------------------------------------- snapshots (draft models)
    def snapshot(self) -> dict:
        """Everything needed to roll the cache back: conv/recurrent states (copied, they change in place),
        K/V (references: ssmspec and HF only ever replace them) and the slot layout."""
        states = []
        for layer in self.layers:
            item = {name: {k: (v.clone() if v is not None else None) for k, v in d.items()}
                    for name, d in hf_layers.state_dicts(layer).items()}  # fmt: skip
            item["kv"] = hf_layers.kv(layer) if hasattr(layer, "keys") else (None, None)
            states.append(item)
        # static K/V: slots below each row's block are never written again, and `valid` is replaced, not changed
        # (copied where the layout is updated in place)
        layout = [self.valid, self.n_real, self.block]
        if self.in_place_layout:
            layout = [t.clone() for t in layout]
        return {
            "layers": states,
            "valid": layout[0],
            "seen": self._seen,
            "n_real": layout[1],
            "block": layout[2],
            "bound": self._bound,
        }

    def restore(self, snap: dict) -> None:
        """Put back the state saved by `snapshot` (conv/recurrent states in place, keeping addresses)."""
        for layer, item in zip(self.layers, snap["layers"]):
            for name, d in hf_layers.state_dicts(layer).items():
                for k, v in item[name].items():
                    if v is not None:
                        d[k].copy_(v)
            keys, values = item["kv"]
            if keys is not None:
                hf_layers.set_kv(layer, keys, values, snap["seen"])
        if self.in_place_layout:
            for name in ("valid", "n_real", "block"):
                getattr(self, name).copy_(snap[name])
        else:
            self.valid, self.n_real, self.block = snap["valid"], snap["n_real"], snap["block"]
        self._seen = snap["seen"]
        self._bound = snap["bound"]
