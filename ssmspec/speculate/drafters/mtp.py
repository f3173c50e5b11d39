"""Drafting with the multi-token-prediction (MTP) layer a hybrid checkpoint ships (Qwen3-Next, Qwen3.5, Nemotron-H:
ssmspec.hf.mtp builds it from the checkpoint's `mtp.*` tensors, which transformers drops on load).

The MTP layer drafts as a draft head does (ssmspec.speculate.drafters.head: from the target's features, through the
target's own embedding and LM head, a best-first tree for greedy decoding, sampled trees for speculative sampling),
with one difference: it attends over its own K/V of every earlier position. So the engine hands it the target's
features at every committed position (`observe_history`), and before each proposal it runs the positions committed
since the last one, at their positions, as vLLM and SGLang run it over a step's tokens: the pair (feature h_j,
token j+1) at position j; the last pair's output, at the root's parent's position, scores the root's children. Those
entries are exact (the target's features and tokens) and stay; the drafted nodes' entries sit in slots past them,
each node attending to the committed entries and its own ancestors, and are overwritten by the next proposal: a
rejected branch leaves nothing behind.
"""

from __future__ import annotations

import torch
from torch import nn

from ssmspec.hf.mtp import MTPModule
from ssmspec.speculate.drafters.head import HeadDrafter
from ssmspec.verification import write_slots


class Slots:
    """The MTP layer's K/V per attention layer, [B, kv heads, S, head dim] per row's slots, behind the one call HF's
    attention layers make on a cache (`update(k, v, layer_idx)`): each forward writes its queries' K/V into the slots
    `at` gives ([B, Q]) and attends over the first `width` slots (the mask says which)."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.at: torch.Tensor | None = None
        self.width = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        b, h, q, d = keys.shape
        k_buf, v_buf = self.kv.get(layer_idx, (None, None))
        if k_buf is None or k_buf.shape[2] < self.width or k_buf.shape[:2] != (b, h):
            size = max(64, 2 * self.width)
            grown = [keys.new_zeros(b, h, size, d), values.new_zeros(b, h, size, values.shape[-1])]
            if k_buf is not None and k_buf.shape[:2] == (b, h):
                grown[0][:, :, : k_buf.shape[2]] = k_buf
                grown[1][:, :, : v_buf.shape[2]] = v_buf
            k_buf, v_buf = grown
            self.kv[layer_idx] = (k_buf, v_buf)
        write_slots(k_buf, self.at, keys)
        write_slots(v_buf, self.at, values)
        return k_buf[:, :, : self.width], v_buf[:, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width


class MTPDrafter(HeadDrafter):
    """Drafts with an MTP layer (module docstring); trees, chains and sampling as HeadDrafter.

    Args:
        mtp: the target's MTP module (ssmspec.hf.mtp.build).
        target: the (transformed) target: its embedding and LM head are read, not copied.
        tree, branches, sampling_tree, min_path_prob: as HeadDrafter.
    """

    target_features = False
    target_history = True
    compiles_chains = False  # (its layer attends over its own K/V: called op by op)
    # a round costs a forward of the layer (attention and MoE blocks: 0.8 ms on the embedded Nemotron-H against a draft
    # head's 0.3): fewer, wider rounds (docs/data/mtp.json)
    rounds = 3

    def __init__(
        self, mtp: MTPModule, target: nn.Module, tree: bool = True, branches: int = 1,
        sampling_tree: str = "gumbel_top_k", min_path_prob: float = 0.02,
    ) -> None:  # fmt: skip
        super().__init__(mtp, target, tree=tree, branches=branches, sampling_tree=sampling_tree,
                         min_path_prob=min_path_prob)  # fmt: skip
        self.slots = Slots()
        self.committed: list[int] = []  # per row, positions whose entries are in the slots (0..n-1)
        self.pending: list[list[torch.Tensor]] = []  # per row, features of committed positions not run yet
        # this proposal's nodes per row: node -> (slot, depth); the root is the last committed entry
        self.nodes: list[dict[int, tuple[int, int]]] = []
        self.used: list[int] = []  # per row, draft slots taken in this proposal

    def start(self, input_ids, attention_mask):
        b = input_ids.shape[0]
        self._bind(b)  # (built from the target's own checkpoint: nothing to check against it)
        self.slots = Slots()
        self.committed, self.pending = [0] * b, [[] for _ in range(b)]

    def observe_history(self, row: int, features: torch.Tensor) -> None:
        self.pending[row].append(features)

    def finish(self, stats) -> None:
        super().finish(stats)
        stats.drafter["mtp"] = self.head.family
        self.slots = Slots()  # the K/V go with the call

    @torch.no_grad()
    def _forward(self, hidden, tokens, positions, slots, allowed) -> torch.Tensor:
        """One MTP forward over per-row queries (lists per row: hidden [q, H], tokens, positions, slots, and for each
        query the slots it attends to past the row's committed ones, or None: every slot up to its own); returns the
        output [B, Q, H] (padded rows' queries attend to themselves alone)."""
        self.steps += 1
        b, q = len(tokens), max(1, max(len(t) for t in tokens))
        ref = next(self.head.parameters())
        device, dtype = ref.device, ref.dtype
        width = max(max(s, default=0) for s in slots) + q + 1
        pad_slots = [s + [width - q + i for i in range(len(s), q)] for s in slots]
        h = torch.zeros(b, q, self.lm_head.weight.shape[1], device=device, dtype=dtype)
        for r, x in enumerate(hidden):
            if len(x):
                h[r, : len(x)] = x.to(device, dtype)
        ids = torch.tensor([t + [0] * (q - len(t)) for t in tokens], device=self.embed_device)
        embedded = self.embed(ids).to(device, dtype)
        pos = torch.tensor([p + [0] * (q - len(p)) for p in positions], device=device)
        # which slots each query attends to: the row's committed entries, then (a catch-up) every slot up to its own
        # or (drafted nodes) its ancestors' and its own; a padded query its own slot alone. Built with a few ops
        # whatever the nodes (a proposal makes one mask per level)
        span = torch.arange(width)
        allow = (span < torch.tensor(self.committed[:b])[:, None])[:, None, :].expand(b, q, width).clone()
        rows, queries, cols = [], [], []
        for r in range(b):
            if allowed[r] is None:  # each query attends to every slot up to its own (committed entries in order)
                allow[r, : len(slots[r])] |= span[None, :] <= torch.tensor(slots[r], dtype=torch.long)[:, None]
            for i, extra in enumerate(allowed[r] or ()):
                rows += [r] * len(extra)
                queries += [i] * len(extra)
                cols += extra
            if len(tokens[r]) < q:
                allow[r, len(tokens[r]) :] = False
                for i in range(len(tokens[r]), q):
                    rows.append(r)
                    queries.append(i)
                    cols.append(pad_slots[r][i])
        if rows:
            allow[rows, queries, cols] = True
        mask = torch.zeros(b, 1, q, width, device=device, dtype=dtype)
        mask.masked_fill_(~allow[:, None].to(device), torch.finfo(dtype).min)
        self.slots.at, self.slots.width = torch.tensor(pad_slots, device=device), width
        return self.head(h, embedded, pos, mask, self.slots)

    @torch.no_grad()
    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(out.to(self.lm_head.weight.dtype)).float()

    def _root_logits(self, contexts) -> torch.Tensor | None:
        """Run every row's committed positions not run yet (the last is the root's parent: its output scores the
        root's children); returns the logits [B, V] after each root."""
        hidden, tokens, positions, slots, allowed = [], [], [], [], []
        for r, ctx in enumerate(contexts):
            n, m = self.committed[r], len(ctx) - 1
            feats = torch.cat(self.pending[r]) if self.pending[r] else None
            self.pending[r] = []
            if m - n <= 0 or feats is None:
                # nothing committed since the last proposal (a second one in a step, a finished row): the root's
                # parent entry again, from the last feature (zeros for a row that never had one)
                n, feats = max(m - 1, 0), self._last_feature(r, feats)
            elif len(feats) < m - n:  # (never for an active row: its features come with its tokens)
                n = m - len(feats)
            feats = feats[-(m - n) :]
            hidden.append(feats)
            tokens.append([int(t) for t in ctx[n + 1 : m + 1]])
            positions.append(list(range(n, m)))
            slots.append(list(range(n, m)))
            allowed.append(None)  # (causal over the new entries)
            self.committed[r] = n  # (the entries attend to the ones before them, then count as committed)
        out = self._forward(hidden, tokens, positions, slots, allowed)
        last = torch.tensor([len(t) - 1 for t in tokens], device=out.device)
        roots = out[torch.arange(len(contexts), device=out.device), last]
        for r, ctx in enumerate(contexts):
            self.committed[r] = len(ctx) - 1
            self.features[r] = hidden[r][-1] if len(hidden[r]) else self.features[r]
        self.predicted = [{0: roots[r]} for r in range(len(contexts))]
        self.nodes = [{0: (self.committed[r] - 1, 0)} for r in range(len(contexts))]
        self.used = [0] * len(contexts)
        return self._logits(roots)

    def _last_feature(self, row: int, feats: torch.Tensor | None) -> torch.Tensor:
        if feats is not None and len(feats):
            return feats[-1:]
        last = self.features[row]
        return last[None] if last is not None else self.lm_head.weight.new_zeros(1, self.lm_head.weight.shape[1])

    def _logits_at(self, trees, new) -> torch.Tensor:
        """The MTP layer's logits after every row's new nodes: each at its parent's output, one position deeper,
        attending to the committed entries and its ancestors."""
        hidden, tokens, positions, slots, allowed = [], [], [], [], []
        for r, row in enumerate(new):
            n, nodes = self.committed[r], self.nodes[r]
            hs, ts, ps, ss, al = [], [], [], [], []
            for node in row:
                parent = trees[r][1][node]
                slot, depth = n + self.used[r], nodes[parent][1] + 1
                self.used[r] += 1
                nodes[node] = (slot, depth)
                chain, p = [slot], parent
                while p > 0:
                    chain.append(nodes[p][0])
                    p = trees[r][1][p]
                hs.append(self.predicted[r][parent])
                ts.append(int(trees[r][0][node]))
                ps.append(n - 1 + depth)
                ss.append(slot)
                al.append(chain)
            hidden.append(torch.stack(hs) if hs else torch.zeros(0))
            tokens.append(ts)
            positions.append(ps)
            slots.append(ss)
            allowed.append(al)
        out = self._forward(hidden, tokens, positions, slots, allowed)
        picked = [(r, i) for r, row in enumerate(new) for i in range(len(row))]
        rows_i = torch.tensor([r for r, _ in picked], device=out.device)
        cols_i = torch.tensor([i for _, i in picked], device=out.device)
        chosen = out[rows_i, cols_i]
        for k, (r, i) in enumerate(picked):
            self.predicted[r][new[r][i]] = chosen[k]
        return self._logits(chosen)


__all__ = ["MTPDrafter", "Slots"]
