"""Context drafting: n-gram prompt lookup (HF's prompt_lookup_num_tokens), frequency-weighted, with retrieval
from a corpus (REST / SuffixDecoding style) and token recycling."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from ssmspec.speculate.drafters.base import Draft, Drafter, accepted_path
from ssmspec.speculate.recycling import Calibration, SuccessorTable, Trie, best_first, goodput_size
from ssmspec.speculate.retrieval import ContextIndex, SuffixIndex


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
        # the prompts indexed now, with the prefill, not in the first proposal (whose time the adaptive policy
        # takes for what every speculative step costs: at batch 16 it priced speculation out for a whole call)
        for r in range(0 if input_ids is None else input_ids.shape[0]):
            row = input_ids[r] if attention_mask is None else input_ids[r][attention_mask[r].bool()]
            self.row_index(r, row.tolist())

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
