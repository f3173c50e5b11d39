"""Draft-model drafting: chains, dynamic trees (DySpec), sampled trees, VocabTrim."""

from __future__ import annotations

import contextlib
import copy
import heapq
from collections.abc import Sequence

import torch
from torch import nn

from ssmspec.errors import UnsupportedModelError, VocabMismatchError
from ssmspec.speculate.config import SAMPLING_TREES
from ssmspec.speculate.drafters.base import Draft, Drafter
from ssmspec.speculate.runner import ModelRunner
from ssmspec.tree import TokenTree


class TrimmedHead(nn.Module):
    """VocabTrim: a draft's LM head restricted to `keep` token ids. Logits of the kept ids are computed (a
    K-row matmul instead of a V-row one); every other id gets -inf, so the draft proposes and samples only
    kept tokens while the output keeps the target's ids and vocabulary size. Drafts only change speed: the
    verifier stays exact whatever the draft's vocabulary."""

    def __init__(self, head: nn.Linear, keep: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = head.out_features
        self.register_buffer("keep", keep.to(head.weight.device, torch.long), persistent=False)
        self.weight = nn.Parameter(head.weight.detach().index_select(0, self.keep), requires_grad=False)
        bias = head.bias.detach().index_select(0, self.keep) if head.bias is not None else None
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = nn.functional.linear(hidden, self.weight, self.bias)
        out = small.new_full((*small.shape[:-1], self.vocab_size), -float("inf"))
        return out.index_copy_(-1, self.keep, small)


def trim_vocab(draft: nn.Module, keep: torch.Tensor) -> nn.Module:
    """A shallow copy of a (transformed) draft whose LM head keeps only the `keep` ids; `draft` is unchanged
    (the copy shares its other modules and parameters).

    Raises:
        UnsupportedModelError: the draft's output embedding is not a top-level nn.Linear.
        ValueError: `keep` is empty or holds ids outside the vocabulary.
    """
    head = draft.get_output_embeddings()
    name = next((n for n, m in draft.named_children() if m is head), None)
    if name is None or not isinstance(head, nn.Linear):
        raise UnsupportedModelError(
            type(draft).__name__, "VocabTrim needs the output embedding to be a top-level nn.Linear"
        )
    keep = check_keep(keep, head.out_features)
    clone = copy.copy(draft)
    clone._modules = dict(draft._modules)
    clone._modules[name] = TrimmedHead(head, keep)
    call = getattr(draft, "ssmspec_compile_call", None)
    if call is not None:  # a compiled draft's compiled forward is bound to the draft (its full head): compile the copy
        clone.compile(*call[0], **call[1])
    return clone


def check_keep(keep, vocab_size: int) -> torch.Tensor:
    """VocabTrim's kept ids, sorted and unique (ValueError unless a non-empty subset of range(vocab_size))."""
    keep = torch.as_tensor(keep, dtype=torch.long).unique()
    if keep.numel() == 0 or int(keep.min()) < 0 or int(keep.max()) >= vocab_size:
        raise ValueError(f"VocabTrim ids must be a non-empty subset of range({vocab_size})")
    return keep


def check_vocab(draft_model: nn.Module, target_vocab_size: int) -> None:
    """A draft must share the target's vocabulary (VocabMismatchError names both sizes)."""
    draft_vocab = getattr(draft_model.config.get_text_config(), "vocab_size", None)
    if draft_vocab != target_vocab_size:
        raise VocabMismatchError(
            f"draft model vocab_size {draft_vocab} != target vocab_size {target_vocab_size}; the draft must "
            "share the target's tokenizer"
        )


class DraftModelDrafter(Drafter):
    """A smaller causal LM drafts a chain greedily. The draft must be transformed (ssmspec.transform, on a
    copy: the user's draft is never changed), so an SSM draft rolls its state back exactly (snapshot/restore
    around drafting, catch-up through tree verification). With `confidence_threshold`, drafting stops once
    the draft's top probability falls below it (HF's `assistant_confidence_threshold`).

    When the target samples (`do_sample=True`), the draft samples too, from its own distribution processed by
    the target's processors and warpers, and returns it with the draft (the q of speculative sampling). With
    `branches` > 1 the root gets that many children drawn without replacement (Gumbel-top-k), each continued
    as a sampled chain: a tree whose siblings are distinct, verified by recursive rejection sampling.

    Args:
        draft_model: a transformed causal LM (`ssmspec.transform(copy)`; `generate(assistant_model=)` does it).
        target_vocab_size: the target's vocabulary size.
        commit: the draft's commit strategy ("replay" or "materialize").
        confidence_threshold: 0 drafts the full depth.
        branches: when sampling, children of the root (Gumbel-top-k) or the beam width (stochastic beam search);
            1: a chain.
        sampling_tree: "gumbel_top_k" or "stochastic_beam" (see `_grow`).
        tree: greedy decoding drafts a dynamic tree (DySpec / EAGLE-2 style, see `_propose_dynamic`) instead
            of a chain.
        min_path_prob: a dynamic tree never holds a node whose path probability under the draft is below this.
        vocab: VocabTrim: the token ids the draft may propose (its LM head computes only those; see
            `trim_vocab`); None: all.
        static_shapes: run the draft with static shapes (trees padded to buckets, fixed-length commits, static
            K/V), as a compiled target runs; None: when the draft was compiled (`draft.compile(...)`), so a
            compiled draft compiles once per bucket instead of once per tree size.
        max_nodes: the largest tree the draft verifies (its largest bucket with static shapes).
        max_depth: the longest path it commits at once (with static shapes, the fixed commit length - 1; a
            longer catch-up widens it).

    Raises:
        VocabMismatchError: the draft's vocabulary differs from the target's.
        TypeError: the draft is not transformed.
    """

    def __init__(
        self, draft_model: nn.Module, target_vocab_size: int, commit: str = "replay",
        confidence_threshold: float = 0.0, branches: int = 1, sampling_tree: str = "gumbel_top_k",
        tree: bool = False, min_path_prob: float = 0.02, vocab: torch.Tensor | None = None,
        static_shapes: bool | None = None, max_nodes: int | None = None, max_depth: int = 8,
    ) -> None:  # fmt: skip
        check_vocab(draft_model, target_vocab_size)
        if getattr(draft_model, "ssmspec_info", None) is None:
            raise TypeError("DraftModelDrafter needs a transformed draft: pass ssmspec.transform(copy of the draft)")
        compiled = getattr(draft_model, "ssmspec_compile_call", None) is not None
        if static_shapes is None:
            static_shapes = compiled
        masked = None
        if vocab is not None:
            if compiled:  # the same proposals from masked logits: a trimmed copy would compile anew per call
                masked = check_keep(vocab, draft_model.config.get_text_config().vocab_size)
            else:
                draft_model = trim_vocab(draft_model, vocab)
        self.runner = ModelRunner(
            draft_model, commit=commit, static_shapes=static_shapes, max_depth=max_depth, max_nodes=max_nodes,
            vocab=masked,
        )  # fmt: skip
        self.confidence_threshold = confidence_threshold
        self.branches = max(1, int(branches))
        if sampling_tree not in SAMPLING_TREES:
            raise ValueError(f"sampling_tree must be one of {SAMPLING_TREES}, got {sampling_tree!r}")
        self.sampling_tree = sampling_tree
        self.tree = tree
        self.min_path_prob = min_path_prob
        self.processed: list[int] = []
        # per row, the draft's logits [V] at the nodes of its last dynamic tree whose children it scored (empty
        # after a proposal of another kind)
        self.scored: list[dict[int, torch.Tensor]] = []
        self._root_logits: torch.Tensor | None = None  # a chain's: the draft's logits at the roots [B, V]

    def start(self, input_ids, attention_mask):
        self.runner.prefill(input_ids, attention_mask)
        self.processed = attention_mask.sum(-1).tolist()
        self._device = input_ids.device

    def propose(self, contexts, max_nodes, max_depth):
        self.scored = []  # filled by a dynamic tree only
        if self.decoding is not None and self.decoding.do_sample:
            return self._propose_sampled(contexts, max_nodes, max_depth)
        if self.tree:
            return self._propose_dynamic(contexts, max_nodes, max_depth)
        depth = min(max_nodes, max_depth)
        if depth <= 0:
            return [([int(c[-1])], [-1]) for c in contexts]
        dev = self._device
        # 1. catch up: feed each row's unprocessed tokens (root last) as a chain and commit them
        # a finished row stops growing; re-feeding its last token only disturbs that row's (unused) draft state
        pending = [list(ctx[self.processed[b] :]) or [ctx[-1]] for b, ctx in enumerate(contexts)]
        tree = TokenTree.from_lists(pending, [list(range(-1, len(p) - 1)) for p in pending], device=dev)
        self._fits(max(map(len, pending)))
        logits = self.runner.verify(self.runner.prepare(tree))
        last = torch.tensor([len(p) - 1 for p in pending], device=dev)
        self.runner.commit(last)
        self.processed = [len(ctx) for ctx in contexts]
        self._root_logits = logits[torch.arange(len(pending), device=dev), last]
        nxt = self._root_logits.argmax(-1)
        drafts = [[int(t)] for t in nxt]
        # 2. draft greedily, then roll back
        confident = self._confident(logits[torch.arange(len(pending), device=dev), last])
        snap = self.runner.snapshot()
        for _ in range(depth - 1):
            if not any(confident):
                break
            logits = self.runner.verify(TokenTree.chain(nxt[:, None]))
            self.runner.commit(torch.zeros_like(nxt))
            nxt = logits[:, 0].argmax(-1)
            for b, t in enumerate(nxt.tolist()):
                if confident[b]:
                    drafts[b].append(t)
            confident = [c and k for c, k in zip(confident, self._confident(logits[:, 0]))]
        self.runner.restore(snap)
        return [([int(ctx[-1])] + d, list(range(-1, len(d)))) for ctx, d in zip(contexts, drafts)]

    # ------------------------------------------------------------------ Saguaro (ssmspec.speculate.drafters.ahead)
    def frozen(self):
        """Nothing to freeze: a draft model keeps no index (see FusedDrafter.frozen)."""
        return contextlib.nullcontext()

    def save_state(self) -> tuple:
        """Everything a proposal changes (the draft's cache, what it has processed, its scores), to return to."""
        return self.runner.snapshot(), list(self.processed), [dict(s) for s in self.scored], self._root_logits

    def load_state(self, state: tuple) -> None:
        """Return to a state saved by `save_state` (the cache's tensors keep their addresses)."""
        snap, processed, scored, root = state
        self.runner.restore(snap)
        self.processed, self.scored, self._root_logits = list(processed), [dict(s) for s in scored], root

    def node_logits(self, contexts: Sequence[Sequence[int]], drafts: Sequence[Draft | None]) -> list[dict]:
        """The draft's logits [V] after every node of its last greedy proposal for `contexts` (`drafts`: those
        proposals as verified, possibly trimmed; None for a finished row, which gets none), per row; the
        draft's state is unchanged. A dynamic tree is verified from the state before its roots; a chain from
        the state after them (its roots' logits are kept from the proposal)."""
        dev, runner = self._device, self.runner
        rows = [d if d is not None else ([int(c[-1])], [-1]) for c, d in zip(contexts, drafts)]
        out: list[dict] = [{} for _ in rows]
        if self.tree:
            tree = TokenTree.from_lists([d[0] for d in rows], [d[1] for d in rows], device=dev)
        else:  # the drafted tokens (a row without any: a stand-in)
            chains = [d[0][1:] or d[0][:1] for d in rows]
            tree = TokenTree.from_lists(chains, [list(range(-1, len(c) - 1)) for c in chains], device=dev)
        tree = runner.prepare(tree)
        with runner.tree_path():  # the tree path even for one node: discarded, nothing changes
            logits = runner.verify(tree)
            runner.discard()
        for r, d in enumerate(rows):
            if drafts[r] is None:
                continue
            if self.tree:
                out[r] = {n: logits[r, tree.index_of(r, n)] for n in range(len(d[0]))}
            elif self._root_logits is not None:
                out[r] = {0: self._root_logits[r], **{n: logits[r, n - 1] for n in range(1, len(d[0]))}}
        return out

    def _distributions(self, seqs: list[list[int]], logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The draft's sampling distributions [M, V] at M positions of rows `rows` with ids `seqs`: its logits
        processed by the target's processors and warpers, as the target's p is."""
        return self.decoding.process(seqs, logits.float(), rows).softmax(-1)

    def _propose_sampled(self, contexts, max_nodes, max_depth):
        """Sample a draft tree (see the class docstring); the draft's state keeps every token but the root."""
        depth = min(max_nodes, max_depth)
        roots = [([int(c[-1])], [-1]) for c in contexts]
        if depth <= 0:
            return roots
        dev = self._device
        gen = self.decoding.generator
        runner = self.runner
        logits = self._catch_up_to_root(contexts)
        width = max(1, min(self.branches, max_nodes // depth))
        # per row: tokens, parents, {parent: q}, frontier [(node, log-prob of its path, its perturbed key)]
        trees = [([int(c[-1])], [-1], {}, [(0, 0.0, 0.0)]) for c in contexts]
        at = logits  # the draft's logits at the frontier nodes, in frontier order (the roots first)
        for level in range(depth):
            seqs, where = [], []
            for r, (tokens, parents, _, frontier) in enumerate(trees):
                for node, _, _ in frontier:
                    path, cur = [], node
                    while cur > 0:
                        path.append(tokens[cur])
                        cur = parents[cur]
                    seqs.append(list(contexts[r]) + path[::-1])
                    where.append(r)
            dists = self._distributions(seqs, at, where)
            grown = self._grow(trees, dists, width, level, gen)
            if level == depth - 1 or not any(grown):
                break
            tree = TokenTree.from_lists([t[0] for t in trees], [t[1] for t in trees], device=dev)
            aligned = runner.prepare(tree)
            logits = runner.verify(aligned)
            runner.discard()
            trees = [(t, p, q, f) for (t, p, q, _), f in zip(trees, grown)]
            at = torch.stack(
                [logits[r, aligned.index_of(r, node)] for r, (*_, f) in enumerate(trees) for node, *_ in f]
            )
        return [(tokens, parents, qs) for tokens, parents, qs, _ in trees]

    def _catch_up_to_root(self, contexts) -> torch.Tensor:
        """Commit every row's tokens before its root (contexts[b][-1]) into the draft's state and return the
        draft's logits at the roots [B, V]; trees rooted at the roots are then verified on that state."""
        dev, b, runner = self._device, len(contexts), self.runner
        pending = [list(ctx[self.processed[r] :]) for r, ctx in enumerate(contexts)]
        if all(len(p) == 1 for p in pending):  # only the root is new: score it without committing it
            with runner.tree_path():
                logits = runner.verify(TokenTree.from_lists(pending, [[-1]] * b, device=dev))[:, 0]
                runner.discard()
        else:
            # commit everything before the root (a finished row that did not grow re-feeds its root: its
            # draft state no longer matters)
            pending = [p if len(p) > 1 else [p[-1], p[-1]] for p in pending]
            tree = TokenTree.from_lists(pending, [list(range(-1, len(p) - 1)) for p in pending], device=dev)
            self._fits(max(map(len, pending)) - 1)
            tip = torch.tensor([len(p) - 1 for p in pending], device=dev)
            logits = runner.verify(runner.prepare(tree))
            logits = logits[torch.arange(b, device=dev), tip]
            runner.commit(tip - 1)
        self.processed = [len(ctx) - 1 for ctx in contexts]
        return logits

    def _propose_dynamic(self, contexts, max_nodes, max_depth):
        """A dynamic tree per row (DySpec; EAGLE-2's global re-ranking): grown best-first by the draft's path
        probability (the product of its probabilities along the root-to-node path), a few nodes per round,
        one draft forward per round over all rows; a node joins only while the row has budget left and its
        path probability reaches `min_path_prob`, so confident drafts grow deep trees, unsure ones small
        ones. Children never outscore their parent, so the nodes taken form a tree."""
        dev, b, runner = self._device, len(contexts), self.runner
        roots = [([int(c[-1])], [-1]) for c in contexts]
        if max_nodes <= 0 or max_depth <= 0:
            return roots
        logits = self._catch_up_to_root(contexts)
        per_round = max(1, -(-max_nodes // max_depth))
        trees = [([int(c[-1])], [-1], [0], [1.0]) for c in contexts]  # tokens, parents, depth, path prob
        self.scored = [{0: logits[r]} for r in range(b)]
        heaps: list[list] = [[] for _ in range(b)]
        new = [[0] for _ in range(b)]  # nodes whose children are not scored yet (logits in `at`, in order)
        at = logits
        for _ in range(max_nodes):
            k = 0
            probs = at.float().softmax(-1)
            top_p, top_x = probs.topk(min(per_round + 1, probs.shape[-1]), dim=-1)
            top_p, top_x = top_p.tolist(), top_x.tolist()
            for r, (tokens, parents, depth, score) in enumerate(trees):
                for node in new[r]:
                    if depth[node] < max_depth:
                        for p, x in zip(top_p[k], top_x[k]):
                            s = score[node] * p
                            if s >= self.min_path_prob:
                                heapq.heappush(heaps[r], (-s, node, x))
                    k += 1
                new[r] = []
                while heaps[r] and len(new[r]) < per_round and len(tokens) <= max_nodes:
                    neg, node, x = heapq.heappop(heaps[r])
                    tokens.append(x)
                    parents.append(node)
                    depth.append(depth[node] + 1)
                    score.append(-neg)
                    new[r].append(len(tokens) - 1)
            if not any(new):
                break
            if all(len(t[0]) > max_nodes for t in trees):
                break
            aligned = runner.prepare(TokenTree.from_lists([t[0] for t in trees], [t[1] for t in trees], device=dev))
            out = runner.verify(aligned)
            runner.discard()
            at = torch.stack([out[r, aligned.index_of(r, node)] for r in range(b) for node in new[r]])
            k = 0
            for r in range(b):
                for node in new[r]:
                    self.scored[r][node] = at[k]
                    k += 1
        return [(tokens, parents) for tokens, parents, _, _ in trees]

    def _grow(self, trees, dists: torch.Tensor, width: int, level: int, gen) -> list[list]:
        """Add one level of children to every row's frontier (their distributions `dists`, in frontier order);
        returns the new frontiers. Gumbel-top-k: `width` distinct children of the root, then one sampled child
        per node. Stochastic beam search: the `width` best children of the whole level by perturbed path
        log-probability (Gumbel keys conditioned on the parent's, as in Kool et al. 2019), so each node's kept
        children are drawn from its q without replacement, in key order."""
        out, k = [], 0
        for tokens, parents, qs, frontier in trees:
            q = dists[k : k + len(frontier)]
            k += len(frontier)
            logq = q.clamp(min=torch.finfo(q.dtype).tiny).log().masked_fill(q <= 0, -float("inf"))
            gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=gen, device=q.device, dtype=q.dtype)))
            if self.sampling_tree == "stochastic_beam":
                phi = torch.tensor([f[1] for f in frontier], device=q.device, dtype=q.dtype)[:, None] + logq
                keys = phi + gumbel
                top = torch.tensor([f[2] for f in frontier], device=q.device, dtype=q.dtype)[:, None]
                # condition each parent's children on their max being the parent's key: G~ = -log(e^-T - e^-Z + e^-G)
                z = keys.max(-1, keepdim=True).values
                u = top - keys + torch.log1p(-torch.exp((keys - z).clamp(max=0)))
                cond = top - u.clamp(min=0) - torch.log1p(torch.exp(-u.abs()))
                cond = cond.masked_fill(~torch.isfinite(keys), -float("inf"))
                flat = cond.flatten()
                best = flat.topk(min(width, int(torch.isfinite(flat).sum()))).indices.tolist()
                chosen = sorted(
                    ((i // q.shape[1], i % q.shape[1]) for i in best), key=lambda fx: (fx[0], -float(cond[fx]))
                )
                picks = [(f, x, float(phi[f, x]), float(cond[f, x])) for f, x in chosen]
            elif level == 0:  # Gumbel-top-k at the root
                order = (logq[0] + gumbel[0]).topk(min(width, int((q[0] > 0).sum()))).indices.tolist()
                picks = [(0, x, 0.0, 0.0) for x in order]
            else:
                picks = [(f, int(torch.multinomial(q[f], 1, generator=gen)), 0.0, 0.0) for f in range(len(frontier))]
            new = []
            for f, x, phi_x, key in picks:
                node = frontier[f][0]
                qs.setdefault(node, q[f])
                tokens.append(int(x))
                parents.append(node)
                new.append((len(tokens) - 1, phi_x, key))
            out.append(new)
        return out

    def _fits(self, length: int) -> None:
        """Widen a static-shape draft's fixed commit length to a `length`-node path (a catch-up after a long
        accepted path, e.g. under the heuristic schedule; one more compiled shape), so no path is cut short."""
        if self.runner.static_shapes and length > self.runner.max_depth + 1:
            self.runner.max_depth = length - 1

    def _confident(self, logits: torch.Tensor) -> list[bool]:
        """Per row, whether the draft's top probability reaches the threshold (always, without one)."""
        if self.confidence_threshold <= 0:
            return [True] * logits.shape[0]
        return (logits.float().softmax(-1).max(-1).values >= self.confidence_threshold).tolist()
