"""Draft-model drafting: chains, dynamic trees (DySpec), sampled trees, VocabTrim."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence

import torch
from torch import nn

from ssmspec.compiled import compiled_as
from ssmspec.errors import UnsupportedModelError, VocabMismatchError, not_one_of
from ssmspec.hf.instance import Agreement
from ssmspec.speculate.config import SAMPLING_TREES
from ssmspec.speculate.drafters.base import Draft, Drafter
from ssmspec.speculate.drafters.trees import best_first_tree, sample_tree
from ssmspec.speculate.generic import GenericRunner
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
    call = compiled_as(draft).call
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
    around drafting, catch-up through tree verification). A draft without kernel seams (RWKV, xLSTM, ...: transform
    gave it the generic path) drafts through HF's own forward and cache (ssmspec.speculate.generic), chains only
    unless its recurrence modules' tree form was found exact. With `confidence_threshold`, drafting stops once
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
        sampling_tree: "gumbel_top_k" or "stochastic_beam" (see `ssmspec.speculate.drafters.trees.grow_level`).
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
        agreement: the target's (`ssmspec.hf.instance.Agreement`): under tensor parallelism the draft's measured
            choices (its one-node path) are the same on every process; None: the draft's own.

    Raises:
        VocabMismatchError: the draft's vocabulary differs from the target's.
        TypeError: the draft is not transformed.
    """

    def __init__(
        self, draft_model: nn.Module, target_vocab_size: int, commit: str = "replay",
        confidence_threshold: float = 0.0, branches: int = 1, sampling_tree: str = "gumbel_top_k",
        tree: bool = False, min_path_prob: float = 0.02, vocab: torch.Tensor | None = None,
        static_shapes: bool | None = None, max_nodes: int | None = None, max_depth: int = 8,
        agreement: Agreement | None = None,
    ) -> None:  # fmt: skip
        check_vocab(draft_model, target_vocab_size)
        if getattr(draft_model, "ssmspec_info", None) is None:
            raise TypeError("DraftModelDrafter needs a transformed draft: pass ssmspec.transform(copy of the draft)")
        compiled = compiled_as(draft_model).call is not None
        generic = getattr(draft_model.ssmspec_info, "path", "seams") == "generic"
        if static_shapes is None:
            static_shapes = compiled
        masked = None
        if vocab is not None:
            if compiled and not generic:  # the same proposals from masked logits: a trimmed copy would compile anew
                masked = check_keep(vocab, draft_model.config.get_text_config().vocab_size)
            else:
                draft_model = trim_vocab(draft_model, vocab)
        if generic:  # a draft without kernel seams drafts through HF's own forward and cache (chains, or its tree form)
            self.runner = GenericRunner(draft_model, max_depth=max_depth, max_nodes=max_nodes)
            if not self.runner.trees:
                tree, branches = False, 1
        else:
            self.runner = ModelRunner(
                draft_model, commit=commit, static_shapes=static_shapes, max_depth=max_depth, max_nodes=max_nodes,
                vocab=masked, agreement=agreement,
            )  # fmt: skip
        self.confidence_threshold = confidence_threshold
        self.branches = max(1, int(branches))
        if sampling_tree not in SAMPLING_TREES:
            raise not_one_of("sampling_tree", sampling_tree, SAMPLING_TREES)
        self.sampling_tree = sampling_tree
        self.tree = tree
        self.min_path_prob = min_path_prob
        self.chain_fallbacks = 0
        self.processed: list[int] = []
        # per row, the draft's logits [V] at the nodes of its last dynamic tree whose children it scored (empty
        # after a proposal of another kind)
        self.scored: list[dict[int, torch.Tensor]] = []
        self._root_logits: torch.Tensor | None = None  # a chain's: the draft's logits at the roots [B, V]

    def start(self, input_ids, attention_mask):
        self.chain_fallbacks = 0  # rows a dynamic tree fell back to a chain for, this call
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

    def _propose_sampled(self, contexts, max_nodes, max_depth):
        """Sample a draft tree (see the class docstring); the draft's state keeps every token but the root."""
        depth = min(max_nodes, max_depth)
        if depth <= 0:
            return [([int(c[-1])], [-1]) for c in contexts]
        dev, runner = self._device, self.runner
        width = max(1, min(self.branches, max_nodes // depth))

        def logits_at(trees, new):  # the draft's logits at every row's new nodes, in order
            aligned = runner.prepare(TokenTree.from_lists([t[0] for t in trees], [t[1] for t in trees], device=dev))
            logits = runner.verify(aligned)
            runner.discard()
            return torch.stack([logits[r, aligned.index_of(r, node)] for r, row in enumerate(new) for node in row])

        root_logits = self._catch_up_to_root(contexts)
        return sample_tree(contexts, root_logits, logits_at, depth, width, self.sampling_tree, self.decoding)

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
        """A dynamic tree per row (DySpec; EAGLE-2's global re-ranking; `best_first_tree`), one draft forward per
        round over all rows; the draft's logits at every node whose children it scored kept in `scored`."""
        dev, b, runner = self._device, len(contexts), self.runner
        if max_nodes <= 0 or max_depth <= 0:
            return [([int(c[-1])], [-1]) for c in contexts]
        logits = self._catch_up_to_root(contexts)
        self.scored = [{0: logits[r]} for r in range(b)]

        def logits_at(trees, new):  # the draft's logits at every row's new nodes, in order
            aligned = runner.prepare(TokenTree.from_lists([t[0] for t in trees], [t[1] for t in trees], device=dev))
            out = runner.verify(aligned)
            runner.discard()
            at = torch.stack([out[r, aligned.index_of(r, node)] for r in range(b) for node in new[r]])
            k = 0
            for r in range(b):
                for node in new[r]:
                    self.scored[r][node] = at[k]
                    k += 1
            return at

        per_round = max(1, -(-max_nodes // max_depth))
        trees, fallbacks = best_first_tree(contexts, logits, logits_at, max_nodes, max_depth, per_round,
                                           self.min_path_prob)  # fmt: skip
        self.chain_fallbacks += fallbacks
        return trees

    def finish(self, stats) -> None:
        if self.chain_fallbacks:  # rows whose draft was too unsure for a dynamic tree (`trees.best_first_tree`)
            stats.drafter["chain_fallbacks"] = self.chain_fallbacks

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
