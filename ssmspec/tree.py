"""TokenTree: a batch of draft trees in topological order (node 0 = root, parent[t] < t).

Everything the tree ops, the attention mask and the commit need is derived here once per step:
depth, ancestor mask, the k nearest ancestors (for tree conv) and root-to-node paths.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ssmspec.errors import InvalidTreeError
from ssmspec.static import static

_NO_ROOT = "a token tree needs at least its root node"


def upload(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A host tensor on `device`. To CUDA it goes from pinned memory without waiting for the device (a plain
    copy from pageable memory synchronises the stream): building a step's tree and handing over its commit
    never stall the queued work."""
    device = torch.device(device) if device is not None else t.device
    if device == t.device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _padded(rows: Sequence[Sequence[int]], n: int, pad_token_id: int) -> tuple[list[list[int]], list[list[bool]]]:
    """Each row's tokens padded to `n` nodes with `pad_token_id`, and which nodes are acceptable (the padding not)."""
    return ([list(row) + [pad_token_id] * (n - len(row)) for row in rows],
            [[True] * len(row) + [False] * (n - len(row)) for row in rows])  # fmt: skip


@dataclass
class TokenTree:
    """A batch of B token trees of N nodes each, in topological order (node 0 = root, parent[t] < t); rows
    are padded to a common N with never-acceptable nodes. Everything the tree ops, the masks and the commit
    need (depth, ancestor mask, nearest ancestors, paths) is derived once, at construction.

    Attributes:
        tokens: [B, N] token ids; tokens[:, 0] is the root (the last emitted, not yet processed token).
        parents: [B, N] parent index; parents[:, 0] == -1 and 0 <= parents[:, t] < t for t >= 1.
        acceptable: [B, N] False for padding nodes that verification must never accept.
        depth: [B, N] distance from the root.
        ancestor_mask: [B, N, N] True where the column node is on the row node's root-to-node path.

    Raises:
        InvalidTreeError: shapes that differ, no root, a parent that is not an earlier node.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    acceptable: torch.Tensor | None = None
    depth: torch.Tensor = field(init=False)
    ancestor_mask: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.tokens.ndim != 2 or self.parents.shape != self.tokens.shape:
            raise InvalidTreeError(
                f"tokens and parents must both be [batch, nodes]; got {tuple(self.tokens.shape)} and "
                f"{tuple(self.parents.shape)}"
            )
        b, n = self.tokens.shape
        if n == 0:
            raise InvalidTreeError(_NO_ROOT)
        self.parents = self.parents.to(torch.long)
        # the structure is tiny (B x N <= a few thousand): checked and derived in Python, then one tensor each
        par = self.parents.tolist()
        if any(row[0] != -1 for row in par):
            raise InvalidTreeError("node 0 is the root: parents[:, 0] must be -1")
        if self.acceptable is None:
            self.acceptable = torch.ones_like(self.tokens, dtype=torch.bool)
        elif self.acceptable.shape != self.tokens.shape:
            raise InvalidTreeError("acceptable must have the shape of tokens")
        dev = self.tokens.device
        if n == 1:  # one node per row, a plain decoding step (most steps at large batches): nothing to derive
            ones = torch.ones(b, 1, 1, dtype=torch.bool, device=dev)
            self._keep_structure(par, [[0] for _ in range(b)], torch.zeros_like(self.parents), ones)
            return
        for row, pr in enumerate(par):
            bad = next((t for t in range(1, n) if not 0 <= pr[t] < t), None)
            if bad is not None:
                raise InvalidTreeError(
                    f"row {row}: node {bad} has parent {pr[bad]}; every node's parent must be an earlier node "
                    "(topological order, no cycles)"
                )
        depth = [[0] * n for _ in range(b)]
        anc = [[[False] * n for _ in range(n)] for _ in range(b)]
        for r in range(b):
            d, a, pr = depth[r], anc[r], par[r]
            a[0][0] = True
            for t in range(1, n):
                p = pr[t]
                d[t] = d[p] + 1
                row = a[t]
                row[:t] = a[p][:t]
                row[t] = True
        depth_tensor, anc_tensor = torch.tensor(depth, device=dev), torch.tensor(anc, dtype=torch.bool, device=dev)
        self._keep_structure(par, depth, depth_tensor, anc_tensor)

    def _keep_structure(
        self, par: list[list[int]], depth: list[list[int]], depth_tensor: torch.Tensor, ancestor_mask: torch.Tensor
    ) -> None:
        """Keep what construction derived: the depths (host and device), the ancestor mask, host copies."""
        n = self.tokens.shape[1]
        self.depth_is_index = all(d == list(range(n)) for d in depth)  # every row a chain (positions = slots)
        # host copies of the structure: verification walks and paths read these, never the device tensors
        self._parents_list = par
        self._depth_list = depth
        self.depth = depth_tensor
        self.ancestor_mask = ancestor_mask
        self._derived_tensors: dict = {}  # `derived`'s (the nearest ancestors per k among them)
        # per row, the index each node had in the tree this one was level-aligned from (-1: padding)
        self.origin: list[list[int]] | None = None

    @property
    def _tokens_list(self) -> list[list[int]]:
        """The tokens on the host (read from the device once, for a tree built there; carried by `to`)."""
        if "_tokens_host" not in self.__dict__:
            self._tokens_host = self.tokens.tolist()
        return self._tokens_host

    @property
    def _acceptable_list(self) -> list[list[bool]]:
        """Which nodes are acceptable, on the host (as `_tokens_list`)."""
        if "_acceptable_host" not in self.__dict__:
            self._acceptable_host = self.acceptable.tolist()
        return self._acceptable_host

    @classmethod
    def from_lists(
        cls,
        tokens: Sequence[Sequence[int]],
        parents: Sequence[Sequence[int]],
        *,
        pad_token_id: int = 0,
        device: torch.device | str | None = None,
        num_nodes: int | None = None,
    ) -> TokenTree:
        """Build a batch from per-row python lists.

        Short rows are padded with unacceptable nodes: a chain below the row's last node, so that a batch of
        chains is a chain.

        Args:
            tokens: per row, the node tokens (root first).
            parents: per row, each node's parent (-1 for the root).
            pad_token_id: the token of padding nodes.
            device: where the tensors go.
            num_nodes: pad every row to this many nodes (static shapes); default: the longest row.

        Raises:
            InvalidTreeError: rows of different lengths for tokens and parents, an empty row, a bad parent, or
                a row longer than `num_nodes`.
        """
        if len(tokens) != len(parents) or len(tokens) == 0:
            raise InvalidTreeError("tokens and parents need one (non-empty) entry per batch row")
        n = max(len(t) for t in tokens)
        if num_nodes is not None:
            if num_nodes < n:
                raise InvalidTreeError(f"a row has {n} nodes, more than num_nodes={num_nodes}")
            n = num_nodes
        for row_t, row_p in zip(tokens, parents):
            if len(row_t) != len(row_p):
                raise InvalidTreeError("each row needs as many parents as tokens")
            if len(row_t) == 0:
                raise InvalidTreeError(_NO_ROOT)
        if n == 1:  # a root per row (a plain decoding step): no padding
            roots = torch.tensor([t[0] for t in tokens], dtype=torch.long).view(-1, 1)
            host = cls(roots, torch.tensor([p[0] for p in parents], dtype=torch.long).view(-1, 1))
        else:
            tok, ok = _padded(tokens, n, pad_token_id)
            # padding continues the row's last node as a chain: a row of chains stays a chain
            par = [list(row_p) + list(range(len(row_p) - 1, n - 1)) for row_p in parents]
            host = cls(torch.tensor(tok, dtype=torch.long), torch.tensor(par, dtype=torch.long), torch.tensor(ok))
        return host.to(device) if device is not None else host

    def to(self, device: torch.device | str) -> TokenTree:
        """The same trees on `device`, every tensor in one transfer (non-blocking to CUDA, see `upload`); the
        host-side structure comes along, so nothing derived later reads the device."""
        device = torch.device(device)
        if self.tokens.device == device:
            return self
        return self._moved(lambda flat: upload(flat, device))

    def _moved(self, transfer) -> TokenTree:
        """A copy whose tensors went through `transfer` packed into one flat int64 tensor."""
        b, n = self.tokens.shape
        self._tokens_list, self._acceptable_list  # noqa: B018 - read here (cheaply, on the host) so the copy keeps them
        parts = [self.tokens, self.parents, self.acceptable, self.depth, self.ancestor_mask]
        flat = transfer(torch.cat([t.reshape(-1).to(torch.long) for t in parts]))
        tokens, parents, ok, depth, anc = flat.split([b * n] * 4 + [b * n * n])
        moved = copy.copy(self)
        moved.tokens = tokens.view(b, n).to(self.tokens.dtype)
        moved.parents, moved.depth = parents.view(b, n), depth.view(b, n)
        moved.acceptable, moved.ancestor_mask = ok.view(b, n).bool(), anc.view(b, n, n).bool()
        moved._derived_tensors = {}
        return moved

    def owned(self) -> TokenTree:
        """A copy whose tensors are its own (the static inputs of a captured step, refilled by `copy_from`)."""
        out = self._moved(lambda flat: flat.clone())
        out.origin = self.origin
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The tree's tensors (what a step captured over it reads)."""
        return [self.tokens, self.parents, self.acceptable, self.depth, self.ancestor_mask]

    def copy_from(self, other: TokenTree) -> None:
        """Become `other` (a tree of the same batch size and node count) in place: every tensor keeps its address
        (a captured step reads them), the host-side structure is `other`'s."""
        if other.tokens.shape != self.tokens.shape:
            raise InvalidTreeError(
                f"a tree of shape {tuple(other.tokens.shape)} into one of {tuple(self.tokens.shape)}"
            )
        for name in ("tokens", "parents", "acceptable", "depth", "ancestor_mask"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)
        for name in ("depth_is_index", "_parents_list", "_depth_list", "origin", "_tokens_host", "_acceptable_host"):
            if name in other.__dict__:
                self.__dict__[name] = other.__dict__[name]
            else:
                self.__dict__.pop(name, None)
        self._derived_tensors = {}

    def refill_chains(self, chains: Sequence[Sequence[int]], pad_token_id: int = 0) -> None:
        """Become per row the chain `chains[b]` (root first; shorter rows padded with never-acceptable nodes, as
        `from_lists` pads them) in place, this tree being a batch of chains of as many rows: only its tokens and
        which nodes are acceptable change (a captured step reads them where they are)."""
        b, n = self.tokens.shape
        if len(chains) != b or not self.depth_is_index or self.origin is not None:
            raise InvalidTreeError(f"{len(chains)} chains into a tree of {b} rows that is not a batch of chains")
        if any(len(row) > n or not row for row in chains):
            raise InvalidTreeError(f"a chain of {max(map(len, chains))} nodes into a tree of {n}")
        tokens, acceptable = _padded(chains, n, pad_token_id)
        self.tokens.copy_(torch.tensor(tokens, dtype=self.tokens.dtype))
        if acceptable != self._acceptable_list:
            self.acceptable.copy_(torch.tensor(acceptable))
        self._tokens_host, self._acceptable_host = tokens, acceptable

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> TokenTree:
        """A chain (each node the child of the previous) for every row.

        Args:
            tokens: [B, N] token ids, root first.
        """
        b, n = tokens.shape
        parents = (torch.arange(n, device=tokens.device) - 1).expand(b, n).clone()
        return cls(tokens, parents)

    def level_aligned(self, pad_token_id: int = 0) -> TokenTree:
        """The same trees with nodes sorted by depth and each level padded (with never-acceptable nodes) to
        the same width in every row, so that node index t has one depth in all rows. Needed by models that
        derive positions from cache slots.

        Args:
            pad_token_id: the token of padding nodes.
        """
        depth, ok, tok = self._depth_list, self._acceptable_list, self._tokens_list
        levels = [[[t for t in range(self.num_nodes) if d[t] == lv] for lv in range(max(d) + 1)] for d in depth]
        widths = [max(len(rows[lv]) if lv < len(rows) else 0 for rows in levels) for lv in range(max(map(len, levels)))]
        tokens, parents, accept, origin = [], [], [], []
        for r, rows in enumerate(levels):
            new_index: dict[int, int] = {}
            t_r, p_r, a_r, o_r = [], [], [], []
            level_start = 0
            for lv, width in enumerate(widths):
                nodes = rows[lv] if lv < len(rows) else []
                for k in range(width):
                    if k < len(nodes):
                        old = nodes[k]
                        new_index[old] = len(t_r)
                        o_r.append(old)
                        par = self._parents_list[r][old]
                        t_r.append(tok[r][old])
                        p_r.append(new_index[par] if par >= 0 else -1)
                        a_r.append(ok[r][old])
                    else:  # padding: a child of the first node one level up
                        o_r.append(-1)
                        t_r.append(pad_token_id)
                        p_r.append(level_start - widths[lv - 1])
                        a_r.append(False)
                level_start += width
            tokens.append(t_r)
            parents.append(p_r)
            accept.append(a_r)
            origin.append(o_r)
        aligned = TokenTree(
            torch.tensor(tokens, dtype=self.tokens.dtype), torch.tensor(parents, dtype=torch.long),
            torch.tensor(accept, dtype=torch.bool),
        ).to(self.tokens.device)  # fmt: skip
        aligned.origin = origin
        return aligned

    def padded(self, num_nodes: int, pad_token_id: int = 0) -> TokenTree:
        """The same trees with never-acceptable nodes appended up to `num_nodes` per row (each continuing the
        row's last node as a chain, so they are nobody's ancestors); node indices are unchanged."""
        if num_nodes == self.num_nodes:
            return self
        extra = num_nodes - self.num_nodes
        if extra < 0:
            raise InvalidTreeError(f"cannot pad {self.num_nodes} nodes down to {num_nodes}")
        tail = list(range(self.num_nodes - 1, num_nodes - 1))
        padded = TokenTree(
            torch.tensor([row + [pad_token_id] * extra for row in self._tokens_list], dtype=self.tokens.dtype),
            torch.tensor([row + tail for row in self._parents_list], dtype=torch.long),
            torch.tensor([row + [False] * extra for row in self._acceptable_list]),
        ).to(self.tokens.device)
        padded.origin = self.origin
        return padded

    def index_of(self, row: int, node: int) -> int:
        """Where node `node` of the tree this one was derived from (by `level_aligned`) sits in this tree."""
        if self.origin is None:
            return node
        return self.origin[row].index(node)

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """Nodes per row, padding included."""
        return self.tokens.shape[1]

    def ancestors(self, k: int) -> torch.Tensor:
        """The k nearest ancestors of every node.

        Args:
            k: how many (a conv of width k needs k).

        Returns:
            [B, N, k]: entry j is node t's j-th ancestor (j = 0 is t itself); past the root, -1, -2, ...
            count back into the committed history (-1 = the most recent committed input). Cached per k.

        Under torch.compile it is computed with tensor ops instead, so that compiled graphs do not guard on
        (and recompile for) the Python-side cache of each new tree."""
        if static():
            return self._ancestors_tensor(k)
        return self.derived(("ancestors", k), lambda: self._ancestors_walked(k))

    def _ancestors_walked(self, k: int) -> torch.Tensor:
        """`ancestors(k)` walked on the host (the parents' Python copy), one upload."""
        out = []
        for pr in self._parents_list:
            rows = []
            for t in range(len(pr)):
                chain, cur = [], t
                while len(chain) < k and cur >= 0:
                    chain.append(cur)
                    cur = pr[cur]
                rows.append(chain + [-(i + 1) for i in range(k - len(chain))])
            out.append(rows)
        return upload(torch.tensor(out, dtype=torch.long), self.tokens.device)

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """What `make()` returns, made once per tree and kept under `key`: a form of the structure that the ops of
        every layer need (an ancestor mask in the compute dtype, a conv's tap indices), made once per verify step
        rather than once per layer (each op costs microseconds on a small model). Not kept under torch.compile,
        whose graphs would guard on this Python-side cache, nor while a step is captured (replays see other trees)."""
        if static():
            return make()
        if key not in self._derived_tensors:
            self._derived_tensors[key] = make()
        return self._derived_tensors[key]

    def _ancestors_tensor(self, k: int) -> torch.Tensor:
        b, n = self.tokens.shape
        rows = torch.arange(b, device=self.tokens.device)[:, None]
        cur = torch.arange(n, device=self.tokens.device).expand(b, n)
        cols = []
        for _ in range(k):
            cols.append(cur)
            par = self.parents[rows, cur.clamp(min=0)]
            cur = torch.where(cur < 0, cur - 1, torch.where(cur == 0, torch.full_like(cur, -1), par))
        return torch.stack(cols, dim=-1)

    def path_nodes(self, row: int, node: int) -> list[int]:
        """The nodes from the root to `node` (both included) in row `row`, root first."""
        pr, out = self._parents_list[row], []
        while node >= 0:
            out.append(node)
            node = pr[node]
        return out[::-1]

    def greedy_last(self, target: torch.Tensor) -> torch.Tensor:
        """The greedy walk of `ssmspec.speculate.step.accept.greedy_accept` as tensor ops (no host read: a compiled or
        captured step accepts on the device): from the root, follow the first acceptable child, in node order, whose
        token is the target's choice at its parent, while there is one. `target` [B, N]: the target's choice after
        each node. Returns [B] the last node each row accepts."""
        n = self.num_nodes
        if n == 1:
            return torch.zeros_like(target[:, 0])
        parent = self.parents.clamp(min=0)
        # a node matches where it is acceptable and holds its parent's choice (the root always "matches")
        match = self.acceptable & (self.tokens == torch.gather(target, 1, parent))
        index = torch.arange(n, device=target.device)
        match = match | (index == 0)
        # ... and is followed only where no earlier sibling matched first
        earlier = (self.parents[:, :, None] == self.parents[:, None, :]) & (index[None, :] < index[:, None])
        first = match & ~(earlier & match[:, None, :]).any(-1)
        # accepted: every node on its root-to-node path followed (one path per row: at most one child each)
        accepted = ~(self.ancestor_mask & ~first[:, None, :]).any(-1)
        return torch.where(accepted, self.depth, -1).argmax(-1)

    def longest_path(self, last: Sequence[int]) -> int:
        """The longest root-to-`last[b]` path over the rows, in nodes (read on the host)."""
        return max(self._depth_list[r][node] for r, node in enumerate(last)) + 1

    def _static_paths(self, last: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`paths` of a fixed width on the device, without reading `last` on the host (a CUDA-graph step):
        a node's ancestors in index order are its root-to-node path (parents precede their children)."""
        n = self.num_nodes
        if n == 1:  # roots only (fresh tensors: a captured step's outputs, not views of its input)
            return torch.zeros_like(last)[:, None], torch.ones_like(last)
        on_path = torch.gather(self.ancestor_mask, 1, last.view(-1, 1, 1).expand(-1, 1, n)).squeeze(1)  # [B, N]
        index = torch.arange(n, device=last.device)
        # the path's node at each depth: its nodes are `last`'s ancestors, one per depth (a compare and a sum, which
        # a compiled step fuses, where a sort would be a library call)
        at_depth = on_path[:, None, :] & (self.depth[:, None, :] == index[:m, None])  # [B, M, N]
        lengths = on_path.sum(-1)
        path = torch.where(index[:m] < lengths[:, None], (at_depth * index).sum(-1), last[:, None])
        return path, lengths

    def paths(self, last: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Root-to-node paths for one node per row: walked on the host where `last` is there (a few ints, one
        transfer), computed on the device otherwise (a fixed width, no host read: CUDA graphs).

        Args:
            last: [B] the last node of each row's path.
            width: M, fixed (static shapes: one shape per configuration); default: the longest path. Must be at
                least the longest path.

        Returns:
            ([B, M] node indices of each path, padded with its last node, [B] path lengths).
        """
        if width is not None and (last.device.type != "cpu" or static()):
            return self._static_paths(upload(last, self.tokens.device), min(int(width), self.num_nodes))
        if self.num_nodes == 1:  # roots only: every path is the root (nothing to read or upload)
            root = torch.zeros(self.batch_size, 1, dtype=torch.long, device=self.tokens.device)
            return root, root[:, 0] + 1
        paths = [self.path_nodes(r, node) for r, node in enumerate(last.tolist())]
        m = max(map(len, paths)) if width is None else min(int(width), self.num_nodes)
        rows = [(p + [p[-1]] * (m - len(p)))[:m] for p in paths]
        b = len(rows)
        flat = upload(torch.tensor([x for row in rows for x in row] + [len(p) for p in paths], dtype=torch.long),
                      self.tokens.device)  # fmt: skip
        path, lengths = flat.split([b * m, b])
        return path.view(b, m), lengths
