"""Drafters: propose a token tree per row from the context (prompt + emitted tokens, root last).

`propose(contexts, max_nodes, max_depth)` returns one (tokens, parents) pair per row with node 0 = the
root (contexts[b][-1]) and parents[t] < t. Drafts never change the output, only the speed: verification
keeps exactly the target's greedy tokens.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from ssmspec.errors import UnsupportedModelError, VocabMismatchError
from ssmspec.speculate.config import SAMPLING_TREES
from ssmspec.speculate.decoding import Decoding
from ssmspec.speculate.recycling import Calibration, SuccessorTable, Trie, best_first, goodput_size
from ssmspec.speculate.retrieval import ContextIndex, SuffixIndex
from ssmspec.speculate.runner import ModelRunner
from ssmspec.tree import TokenTree

Draft = tuple[list[int], list[int]]


class Drafter:
    """Base class of drafters: subclasses implement `propose`; `start` sees the prompt once per generate call.

    Drafts never change the output, only the speed: verification keeps exactly the target's tokens."""

    decoding: Decoding | None = None

    def set_decoding(self, decoding: Decoding) -> None:
        """Called once per generate call, before `start`: how the target chooses tokens (processors, sampling).
        A sampling drafter draws from its own processed distribution and returns it with its draft."""
        self.decoding = decoding

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Called once before the first proposal."""

    def propose(self, contexts: Sequence[Sequence[int]], max_nodes: int, max_depth: int) -> list[Draft]:
        """One tree per row.

        Args:
            contexts: per row, the real tokens so far (prompt and output; the last one is the root).
            max_nodes: drafted nodes per row at most (the root not counted).
            max_depth: draft depth at most.

        Returns:
            Per row, `(tokens, parents)`: node 0 is the root (`contexts[b][-1]`), `parents[0] == -1`,
            `parents[t] < t`. A drafter that samples adds a third element, `{node: q}`: the distribution
            [vocab] the node's children were drawn from (several children: without replacement, in node
            order). Nodes without one are deterministic proposals. Speculative sampling needs it to stay
            lossless; greedy verification ignores it.
        """
        raise NotImplementedError

    def ahead(self, contexts: Sequence[Sequence[int]], drafts: Sequence[Draft], max_nodes: int, max_depth: int) -> None:
        """Called after each proposal, just before the target verifies it (`drafts` as verified; None for a
        finished row): a drafter may start preparing the next step's proposals here (Saguaro, see
        ssmspec.speculate.ahead). Default: nothing."""

    def finish(self, stats) -> None:
        """Called once after the last step (also when generation fails): release what the drafter holds and add
        its counters to `stats` (the call's SpecStats). Default: nothing."""

    def size_by_goodput(self, cost: Callable[[int], float]) -> bool:
        """Adaptive speculation (SpecConfig.adaptive): a drafter that estimates each node's chance of acceptance
        may size its trees itself, for the most expected tokens per unit of step cost (`cost(n)`: verifying n
        nodes, relative to a decode step); it returns True and the engine stops choosing depths. Default: False
        (the engine chooses depth and budget from the rows' acceptance rates)."""
        return False

    # the target's top-k successors the engine reports after every token it processes (`observe_prompt`,
    # `observe`); 0: none (the engine then computes nothing for the drafter)
    target_topk: int = 0

    def observe_prompt(self, row: int, tokens: Sequence[int], tops: Sequence[tuple[list[int], list[float]]]) -> None:
        """After the prefill (drafters with `target_topk`): row `row`'s real prompt tokens and, after each of
        them, the target's top-k next tokens with their probabilities. Default: nothing."""

    def observe(
        self, row: int, context: Sequence[int], draft: Draft, tops: Sequence[tuple[list[int], list[float]]],
        emitted: Sequence[int],
    ) -> None:  # fmt: skip
        """After a verify step (drafters with `target_topk`): the draft verified for `row` from `context`, the
        target's top-k next tokens with their probabilities after each of its nodes, and the tokens the step
        emitted (the accepted drafts, then the bonus token). Default: nothing."""


def accepted_path(tokens: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> tuple[list[int], dict]:
    """Walk a verified draft along the tokens its step emitted: (the accepted nodes, root first; each node's
    children in node order). The walk stops at the first emitted token no child has (the bonus token)."""
    kids: dict[int, list[int]] = {}
    for t in range(1, len(tokens)):
        kids.setdefault(parents[t], []).append(t)
    path = [0]
    for tok in emitted:
        child = next((c for c in kids.get(path[-1], ()) if tokens[c] == tok), None)
        if child is None:
            break
        path.append(child)
    return path, kids


class NoDrafter(Drafter):
    """Proposes nothing: plain greedy decoding through the tree path (ssmspec's own autoregressive decode)."""

    def propose(self, contexts, max_nodes, max_depth):
        return [([ctx[-1]], [-1]) for ctx in contexts]


class PromptLookupDrafter(Drafter):
    """N-gram prompt lookup (as HF's prompt_lookup_num_tokens), frequency-weighted, optionally with retrieval
    from a corpus (REST / SuffixDecoding style).

    Every earlier occurrence of the context's last token votes for what followed it, with weight
    `ngram_weight ** (m - 1)` where m <= max_matching_ngram_size is how many tokens of the context's tail it
    matches (longer matches are more reliable; the `max_matches` best occurrences vote). With a `corpus` (a
    ssmspec.SuffixIndex), what followed the longest occurrence of the context's tail in the corpus votes too,
    with a total weight of one occurrence shared by its continuations in proportion to their frequency: the
    context decides where it has evidence, the corpus fills in where it has none and breaks ties. The votes
    form a trie whose node weights estimate the chance that the target takes that path. A chain follows the
    heaviest child at each step; a tree keeps the `max_nodes` heaviest nodes (a child never outweighs its
    parent, so they form a subtree), which maximises the expected accepted length under those estimates.

    Args:
        max_matching_ngram_size: the longest tail match that counts in the context.
        tree: draft a tree (True) or a chain (False).
        max_matches: how many earlier occurrences in the context vote.
        ngram_weight: the vote of an occurrence is `ngram_weight ** (match length - 1)`.
        corpus: a SuffixIndex to retrieve continuations from (None: the context only).
        corpus_weight: the corpus's total vote (in units of one single-token context match).
        corpus_samples: occurrences of the corpus match read per step (evenly spaced over all of them).
        max_corpus_match: the longest context tail matched against the corpus.
        recycle: token recycling (ssmspec.speculate.recycling): the target's top-`recycle` successors of every
            token it verified are proposed besides the votes, and the draft is grown best-first by calibrated
            acceptance estimates (learned online from which drafted nodes the target accepts). 0: off.
    """

    def __init__(
        self, max_matching_ngram_size: int = 2, tree: bool = False, max_matches: int = 16, ngram_weight: float = 4.0,
        corpus: SuffixIndex | None = None, corpus_weight: float = 1.0, corpus_samples: int = 32,
        max_corpus_match: int = 16, recycle: int = 0,
    ) -> None:  # fmt: skip
        if recycle < 0:
            raise ValueError(f"recycle must be >= 0 (successors kept per token), got {recycle}")
        self.max_ngram = max_matching_ngram_size
        self.tree = tree
        self.max_matches = max_matches
        self.ngram_weight = ngram_weight
        self.corpus = corpus
        self.corpus_weight = corpus_weight
        self.corpus_samples = corpus_samples
        self.max_corpus_match = max_corpus_match
        self.recycle = int(recycle)
        self.target_topk = self.recycle
        self._indices: list[ContextIndex] = []  # per row, over its context (reset by `start`)
        self._frozen = False
        self._start_recycling()

    def _start_recycling(self) -> None:
        """Fresh successor table and calibration (one generate call learns from its own target only)."""
        self.successors = SuccessorTable(self.recycle) if self.recycle else None
        self.calibration = Calibration()
        self._evidence: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {}  # row -> {token path: bucket}
        # adaptive: the step cost of n nodes, set after `start` for this generate call (size_by_goodput)
        self._cost: Callable[[int], float] | None = None

    def size_by_goodput(self, cost):
        if not self.recycle:
            return False
        self._cost = cost
        return True

    def continuations(
        self, ctx: Sequence[int], depth: int, index: ContextIndex | None = None
    ) -> list[tuple[list[int], float]]:
        """(continuation, weight) after earlier occurrences of the context's tail, best (longest match,
        then latest) first; then the corpus's continuations. `index`: the row's ContextIndex, synced to a
        prefix of `ctx` (None: one is built for this call)."""
        if index is None:
            index = ContextIndex(self.max_ngram)
            index.extend(ctx)
        found = index.matches(ctx, self.max_matches)
        out = [(list(ctx[end + 1 : end + 1 + depth]), self.ngram_weight ** (m - 1)) for m, end in found]
        if self.corpus is not None:
            _, retrieved = self.corpus.continuations(ctx, depth, self.max_corpus_match, self.corpus_samples)
            out += [(cont, w * self.corpus_weight) for cont, w in retrieved]
        return out

    def start(self, input_ids, attention_mask):
        self._indices = []
        self._start_recycling()

    def draft(
        self, ctx: Sequence[int], max_nodes: int, max_depth: int, index: ContextIndex | None = None,
        with_weights: bool = False,
    ) -> Draft | tuple[list[int], list[int], list[float]]:  # fmt: skip
        """One row's draft for the context `ctx` (see `continuations` for `index`); with `with_weights`, each
        node's vote weight too (see `_weighted_draft`)."""
        conts = self._votes(ctx, max_nodes, max_depth, index)
        if self.recycle and not with_weights:
            return self._calibrated_draft(ctx, conts, max_nodes, max_depth)[:2]
        return _weighted_draft(int(ctx[-1]), conts, max_nodes, chain=not self.tree, with_weights=with_weights)

    def _votes(self, ctx: Sequence[int], max_nodes: int, max_depth: int, index: ContextIndex | None):
        """The weighted continuations a draft is made of (none when nothing may be drafted)."""
        return self.continuations(ctx, max_depth, index) if max_depth > 0 and max_nodes > 0 else []

    def _calibrated_draft(
        self, ctx: Sequence[int], conts, max_nodes: int, max_depth: int
    ) -> tuple[list[int], list[int], dict[tuple[int, ...], tuple[int, int]]]:
        """Votes and recycled successors, grown best-first by calibrated estimates (see `recycle`); with each
        node's evidence by its token path (what `observe` calibrates with)."""
        prev = int(ctx[-2]) if len(ctx) > 1 else None
        trie = Trie(int(ctx[-1]), conts)
        depth = max_depth if max_nodes > 0 else 0
        tokens, parents, paths, evidence, logp = best_first(
            prev, trie, self.successors, self.calibration, max_nodes, depth, chain=not self.tree
        )
        if self._cost is not None:  # nodes come in best-first order: keep the prefix with the best goodput
            n = goodput_size(logp, self._cost)
            tokens, parents, paths = tokens[:n], parents[:n], paths[:n]
        return tokens, parents, dict(zip(paths, evidence))

    def observe_prompt(self, row, tokens, tops):
        for i, (ids, probs) in enumerate(tops):
            self.successors.learn(int(tokens[i - 1]) if i else None, int(tokens[i]), ids, probs)

    def observe(self, row, context, draft, tops, emitted):
        tokens, parents = draft[0], draft[1]
        path, _ = accepted_path(tokens, parents, emitted)  # the accepted nodes: what the target saw for real
        on_path = set(path)
        # the target's successors of every verified token; a rejected node's (its context was not the real one)
        # only where nothing is known yet, an accepted node's always. Measured on the embedded model, 16-node
        # trees: 2.60 tokens per step (2.40 learning from accepted nodes only); with a corpus 3.33 (3.28 learning
        # from every node alike)
        before = [int(context[-2]) if len(context) > 1 else None] + [tokens[p] for p in parents[1:]]
        for t in range(len(tokens)):
            if t in on_path or not self.successors.knows(before[t], tokens[t]):
                self.successors.learn(before[t], tokens[t], *tops[t])
        # calibration: every node whose parent was accepted was tested; it passed if it is on the accepted path
        evidence = self._evidence.pop(row, {})
        paths = [()] * len(tokens)
        for t in range(1, len(tokens)):
            paths[t] = (*paths[parents[t]], tokens[t])
            if parents[t] in on_path and paths[t] in evidence:
                self.calibration.update(evidence[paths[t]], t in on_path)

    def row_index(self, row: int, ctx: Sequence[int]) -> ContextIndex:
        """The row's incremental index, synced to `ctx` (kept across the steps of one generate call); while
        `frozen`, as it is (`ctx` then continues what it indexed: lookups scan the rest)."""
        while len(self._indices) <= row:
            self._indices.append(ContextIndex(self.max_ngram))
        index = self._indices[row]
        if not self._frozen:
            index.sync(ctx)
        return index

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Propose without extending the rows' indexes (a background thread drafting for hypothetical contexts
        reads them while the main thread owns them)."""
        self._frozen = True
        try:
            yield
        finally:
            self._frozen = False

    def propose(self, contexts, max_nodes, max_depth):
        if not self.recycle:
            return [self.draft(ctx, max_nodes, max_depth, self.row_index(r, ctx)) for r, ctx in enumerate(contexts)]
        out = []
        for r, ctx in enumerate(contexts):
            conts = self._votes(ctx, max_nodes, max_depth, self.row_index(r, ctx))
            tokens, parents, self._evidence[r] = self._calibrated_draft(ctx, conts, max_nodes, max_depth)
            out.append((tokens, parents))
        return out


def _weighted_draft(
    root: int, continuations: Sequence[tuple[Sequence[int], float]], max_nodes: int, chain: bool,
    with_weights: bool = False,
) -> Draft | tuple[list[int], list[int], list[float]]:  # fmt: skip
    """The heaviest chain, or the `max_nodes` heaviest nodes, of the weighted trie of continuations; with
    `with_weights`, each kept node's weight too (the root's: the total of all continuations)."""
    trie = Trie(root, continuations)
    tokens, parents, weight, depth = trie.tokens, trie.parents, trie.weight, trie.depth
    if chain:
        keep, cur = [0], 0
        while cur in trie.kids and len(keep) <= max_nodes:
            cur = max(trie.kids[cur], key=lambda k: (weight[k], -k))  # heaviest child, first inserted on ties
            keep.append(cur)
        keep = keep[: max_nodes + 1]
    else:
        ranked = sorted(range(1, len(tokens)), key=lambda k: (-weight[k], depth[k], k))
        keep = [0] + sorted(ranked[:max_nodes], key=lambda k: (depth[k], -weight[k], k))
    index = {node: i for i, node in enumerate(keep)}
    draft = [tokens[k] for k in keep], [-1] + [index[parents[k]] for k in keep[1:]]
    if with_weights:
        return (*draft, [weight[k] for k in keep])
    return draft


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

    # ------------------------------------------------------------------ Saguaro (ssmspec.speculate.ahead)
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


class FusedDrafter(Drafter):
    """RASD-style fusion of a draft model's tree with a retrieval tree: both drafters propose for every row,
    the retrieval tree is pruned with the draft model's probabilities, and what is left is merged into the
    draft's tree by longest-prefix matching (a retrieved path that starts like a drafted one continues it; the
    rest branch off), within one node budget, so both are verified in one pass. The draft model gets
    `draft_share` of the budget; the retrieval tree fills the rest (nodes the two agree on are counted once).

    Pruning: wherever a retrieved token would branch off a node whose children the draft model scored (the
    root, and the inner nodes of its dynamic tree), it is dropped with its subtree when the draft gives it a
    probability below `prune_below`, and the budget goes to the next retrieved candidates (the retrieval
    tree is asked for twice the budget). Retrieval still adds what the draft did not consider likely enough
    to draft, but not what the draft rules out. When sampling, retrieved nodes stay deterministic proposals
    next to the draft's sampled ones, only where they do not collide with a sampled node's parent (a node's
    children are either all sampled or all deterministic, which the verifier requires).

    Args:
        draft: the draft model's drafter.
        retrieval: a PromptLookupDrafter (with a corpus) in tree mode.
        draft_share: the draft model's share of the node budget.
        prune_below: the draft probability under which a retrieved branch is pruned (0: no pruning).
    """

    def __init__(
        self, draft: DraftModelDrafter, retrieval: PromptLookupDrafter, draft_share: float = 0.5,
        prune_below: float = 0.01,
    ) -> None:  # fmt: skip
        self.draft = draft
        self.retrieval = retrieval
        self.draft_share = draft_share
        self.prune_below = prune_below
        self.pruned = 0  # retrieved branches pruned in this generate call

    def set_decoding(self, decoding: Decoding) -> None:
        super().set_decoding(decoding)
        self.draft.set_decoding(decoding)
        self.retrieval.set_decoding(decoding)

    def start(self, input_ids, attention_mask):
        self.pruned = 0
        self.draft.start(input_ids, attention_mask)
        self.retrieval.start(input_ids, attention_mask)

    def finish(self, stats) -> None:
        stats.drafter["pruned"] = self.pruned

    def propose(self, contexts, max_nodes, max_depth):
        share = max(1, int(round(max_nodes * self.draft_share))) if max_nodes > 1 else max_nodes
        drafted = self.draft.propose(contexts, share, max_depth)
        prune = self.prune_below > 0 and bool(self.draft.scored)
        retrieved = self.retrieval.propose(contexts, 2 * max_nodes if prune else max_nodes, max_depth)
        return [
            _merge(d, e, max_nodes, self._pruner(self.draft.scored[r]) if prune else None)
            for r, (d, e) in enumerate(zip(drafted, retrieved))
        ]

    # ------------------------------------------------------------------ Saguaro (ssmspec.speculate.ahead)
    def save_state(self) -> tuple:
        """The draft model's state (`DraftModelDrafter.save_state`) and the pruning count; retrieval keeps no
        state of its own (its indexes follow the contexts)."""
        return self.draft.save_state(), self.pruned

    def load_state(self, state: tuple) -> None:
        self.draft.load_state(state[0])
        self.pruned = state[1]

    def node_logits(self, contexts, drafts) -> list[dict]:
        """The draft model's logits after every node of the fused drafts (see DraftModelDrafter.node_logits)."""
        return self.draft.node_logits(contexts, drafts)

    def frozen(self):
        """Propose without extending the retrieval's context indexes (PromptLookupDrafter.frozen)."""
        return self.retrieval.frozen()

    def _pruner(self, scored: dict[int, torch.Tensor]):
        """keep(node, token) for `_merge`: False where the draft scored `node`'s children and gives `token` a
        probability below `prune_below`; a token outside a trimmed draft vocabulary (logit -inf) is kept, as
        the draft says nothing about it."""
        probs: dict[int, torch.Tensor] = {}

        def keep(node: int, token: int) -> bool:
            logits = scored.get(node)
            if logits is None or not math.isfinite(float(logits[token])):
                return True
            if node not in probs:
                probs[node] = logits.float().softmax(-1)
            if float(probs[node][token]) >= self.prune_below:
                return True
            self.pruned += 1
            return False

        return keep


def _merge(base: tuple, extra: Draft, max_nodes: int, keep=None) -> tuple:
    """`extra`'s nodes merged into `base` (prefix-matched, in `extra`'s order) up to `max_nodes` drafted
    nodes; extra nodes never go under a node whose children were sampled (those carry a q). `keep(node,
    token)`: whether a new child `token` may branch off base node `node` (None: always); a refused node's
    subtree is dropped with it."""
    tokens, parents = list(base[0]), list(base[1])
    qs = base[2] if len(base) > 2 else None
    child = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents)) if p >= 0}
    where = {0: 0}  # extra node -> merged node
    for j in range(1, len(extra[0])):
        parent = where.get(extra[1][j])
        if parent is None:
            continue
        key = (parent, extra[0][j])
        if key in child:
            where[j] = child[key]
        elif (
            len(tokens) - 1 < max_nodes
            and not (qs and parent in qs)
            and (keep is None or parent >= len(base[0]) or keep(parent, extra[0][j]))
        ):
            tokens.append(extra[0][j])
            parents.append(parent)
            child[key] = where[j] = len(tokens) - 1
    return (tokens, parents, qs) if qs is not None else (tokens, parents)
