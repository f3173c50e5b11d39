"""Verification: one object per verify call, holding everything between a tree's forward and its commit.

The cache creates it (`SpecCache.verifying(tree)`); the seam adapters of the mixers that receive that cache
leave their per-layer records on it (ssmspec.hf.seams passes it to them explicitly through the mixer call);
`commit(last)` folds each row's accepted root-to-`last` path into the committed states: each op family's
commit for its records (ssmspec.ops), then the attention K/V (the cache keeps the path's slots).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ssmspec.errors import UnsupportedModelError, not_one_of
from ssmspec.ops import COMMITS, Record
from ssmspec.tree import TokenTree, upload

_DONE = "this verification was already committed or discarded"

COMMIT_STRATEGIES = ("replay", "materialize")


class CommittedState(Protocol):
    """What a verification needs from the cache that owns it (ssmspec.hf.cache.SpecCache)."""

    def kv_widths(self) -> dict[int, int]: ...

    def committed_recurrent(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None: ...

    def state_tensor(self, rec: Record) -> torch.Tensor: ...

    def keep_kv(
        self, widths: dict[int, int], path: torch.Tensor, lengths: torch.Tensor, longest: int | None = None
    ) -> None: ...

    def drop_kv(self, widths: dict[int, int]) -> None: ...

    def kv_slots(self) -> tuple[list[torch.Tensor], torch.Tensor] | None: ...

    def advance_static(self, path: torch.Tensor, lengths: torch.Tensor) -> None: ...

    def settle_static(self, longest: int) -> None: ...


def write_slots(buf: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """K/V buffer [B, H, C, D]: buf[b, :, slots[b, j]] = new[b, :, j] for every row b and j ([B, N] distinct slots per
    row), in place. An index_put_, which Inductor keeps in place in a compiled step: a scatter_ on the step's buffer
    became a copy of the whole buffer with the slots written, read by the attention and copied back (on the 19.6M
    Nemotron-H, four copies of its two layers' K and V buffers per step, growing with the context)."""
    rows = torch.arange(buf.shape[0], device=buf.device)[:, None, None]
    heads = torch.arange(buf.shape[1], device=buf.device)[None, :, None]
    buf.index_put_((rows, heads, slots[:, None, :]), new.to(buf.dtype))


def move_slots(buffers: list[torch.Tensor], block: torch.Tensor, path: torch.Tensor) -> None:
    """Static K/V buffers [B, H, C, D]: each row's accepted nodes, written by the verify step at slots
    block[b] + node, move down to block[b] + i (i-th node of the path), in place. All M path entries are read
    before any is written; padded entries land past the row's new end, where no slot is valid."""
    target = block[:, None] + torch.arange(path.shape[1], device=path.device)
    source = block[:, None] + path
    for t in buffers:
        moved = torch.gather(t, 2, source[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
        write_slots(t, target, moved)


def fold_states(
    groups: dict[str, list[tuple[torch.Tensor, Record]]], path: torch.Tensor, lengths: torch.Tensor, last: torch.Tensor,
    kv: tuple[list[torch.Tensor], torch.Tensor] | None = None,
) -> None:  # fmt: skip
    """Overwrite the committed states with the accepted paths' (each op family's commit on its records, all
    layers of a family at once), and move the accepted K/V slots of static buffers (`kv`: the buffers and each
    row's first tree slot). Tensor work only, so that a compiled model runs the whole commit as one graph."""
    for kind, items in groups.items():
        COMMITS[kind](items, path, lengths, last)
    if kv is not None:
        move_slots(*kv, path)


class Verification:
    """The tree being verified, the commit strategy, and what every layer recorded for commit."""

    def __init__(self, cache: CommittedState, tree: TokenTree, commit: str, in_place: bool = False) -> None:
        if commit not in COMMIT_STRATEGIES:
            raise not_one_of("commit strategy", commit, COMMIT_STRATEGIES)
        if in_place and tree.num_nodes != 1:
            raise ValueError(f"only a one-node tree is verified in place (it is always accepted), not {tree.num_nodes}")
        self.cache = cache
        self.tree = tree
        self.commit_strategy = commit
        # one node per row, always accepted: ops that can (SSD, the conv window) advance the committed state as they
        # verify and record nothing (their commit would replay that one node); the others record as usual
        self.in_place = in_place
        self.records: dict[tuple[int, int, bool, int | None], Record] = {}
        self.claimed: set[tuple[int, int, bool, int | None]] = set()  # the states this forward updates (`claim`)
        self.kv_start = cache.kv_widths()  # attention slots per layer before the tree's K/V were appended
        self.buffers: dict[tuple, torch.Tensor] = {}  # records of all layers stacked (the cache's to fill)
        self.done = False

    def nbytes(self) -> int:
        """Bytes this verification holds until its commit: every layer's records (replay inputs or node states),
        their stacked buffers, and the attention K/V the tree appended (`CommittedState.tree_kv_bytes`)."""
        seen: set[int] = set()
        total = 0

        def add(t) -> None:
            nonlocal total
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()

        for rec in self.records.values():
            add(rec.states)
            for value in rec.replay.values():
                for t in value if isinstance(value, list | tuple) else (value,):
                    add(t)
        for t in self.buffers.values():
            add(t)
        kv = getattr(self.cache, "tree_kv_bytes", None)
        return total + (kv(self.kv_start) if kv is not None else 0)

    def record(self, module: str, seam: str, rec: Record) -> None:
        """Remember what commit needs for (layer, state index); one recurrence call per state and forward."""
        self.records[self.claim(module, seam, rec.layer, rec.state_idx, rec.kind == "conv", rec.part)] = rec

    def claim(
        self, module: str, seam: str, layer: int, state_idx: int, conv: bool, part: int | None
    ) -> tuple[int, int, bool, int | None]:
        """A state this forward updates (recorded for a commit, or advanced in place): a second call on it in the same
        forward would read what the first one wrote, so it is refused (UnsupportedModelError naming it). Returns its
        key."""
        key = (layer, state_idx, conv, part)
        if key in self.claimed:
            where = "" if part is None else f", part {part}"
            raise UnsupportedModelError(
                module, f"calls `{seam}` more than once per forward on layer {layer}, state {state_idx}{where}"
            )
        self.claimed.add(key)
        return key

    def committed_state(self, layer: int, state_idx: int = 0) -> torch.Tensor | None:
        """The committed recurrent state a tree op starts from (None before the layer's first update)."""
        return self.cache.committed_recurrent(layer, state_idx)

    def commit(
        self, last: torch.Tensor, width: int | None = None, fold: Callable | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance every row past root -> last[b]; returns (path [B, M] padded node indices, lengths [B]).
        `width` fixes M (static shapes: the replay runs M masked steps whatever was accepted); `fold` runs
        instead of `fold_states` (a compiled model's compiled version of it)."""
        if self.done:
            raise RuntimeError(_DONE)
        # the longest accepted path, when `last` is on the host (static K/V buffers track how full they are)
        longest = self.tree.longest_path(last.tolist()) if last.device.type == "cpu" else None
        on_device = upload(last, self.tree.tokens.device)
        # host indices for the walked paths (no device read); the fixed-width paths are computed on the device
        path, lengths = self.tree.paths(last if width is None else on_device, width)
        last = on_device
        (fold or fold_states)(self.groups(), path, lengths, last, self.cache.kv_slots())
        self.cache.keep_kv(self.kv_start, path, lengths, longest)
        self.done = True
        return path, lengths

    def groups(self) -> dict[str, list[tuple[torch.Tensor, Record]]]:
        """The records by op family, each with the committed tensor it overwrites."""
        groups: dict[str, list[tuple[torch.Tensor, Record]]] = {}
        for rec in self.records.values():
            groups.setdefault(rec.kind, []).append((self.cache.state_tensor(rec), rec))
        return groups

    def commit_static(
        self, last: torch.Tensor, width: int, fold: Callable | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`commit`'s device work alone, for a captured commit (static K/V): `last` on the tree's device, paths of the
        fixed `width` computed there, the states folded and the slot layout advanced in place; nothing read on the
        host. `settle` finishes it."""
        if self.done:
            raise RuntimeError(_DONE)
        path, lengths = self.tree.paths(last, width)
        (fold or fold_states)(self.groups(), path, lengths, last, self.cache.kv_slots())
        self.cache.advance_static(path, lengths)
        return path, lengths

    def settle(self, longest: int) -> None:
        """After `commit_static` (or its replay): the host's bookkeeping, `longest` the longest accepted path."""
        self.cache.settle_static(longest)
        self.done = True

    def reopen(self) -> None:
        """Ready for another commit: a captured step's verification, whose records its replay refilled."""
        self.done = False

    def discard(self) -> None:
        """Drop the tree: committed states were never touched (an in-place verification's were: it ends a failed
        step, whose cache is not used again); the tree's K/V slots are removed."""
        if not self.done:
            self.cache.drop_kv(self.kv_start)
            self.done = True
