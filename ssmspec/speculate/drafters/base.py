"""The drafter interface: `propose(contexts, max_nodes, max_depth)` returns one (tokens, parents) pair per row
with node 0 = the root (contexts[b][-1]) and parents[t] < t. Drafts never change the output, only the speed:
verification keeps exactly the target's tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ssmspec.speculate.decoding import Decoding

Draft = tuple[list[int], list[int]]


class Drafter:
    """Base class of drafters: subclasses implement `propose`; `start` sees the prompt once per generate call.

    Drafts never change the output, only the speed: verification keeps exactly the target's tokens."""

    decoding: Decoding | None = None
    # it works on every step, a plain one too: `propose` and `ahead` are called though the step drafts nothing (Saguaro
    # prepares the next proposals in `ahead`); False: a plain step calls neither (the step's tree is its root alone)
    works_ahead: bool = False

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
        ssmspec.speculate.drafters.ahead). Default: nothing."""

    def finish(self, stats) -> None:
        """Called once after the last step (also when generation fails): release what the drafter holds and add
        its counters to `stats` (the call's SpecStats). Default: nothing."""

    def size_by_goodput(self, cost: Callable[[int], float]) -> bool:
        """Adaptive speculation (SpecConfig.adaptive): a drafter that estimates each node's chance of acceptance
        may size its trees itself, for the most expected tokens per unit of step cost (`cost(n)`: verifying n
        nodes, relative to a decode step); it returns True and the engine stops choosing depths. Default: False
        (the engine chooses depth and budget from the rows' acceptance rates)."""
        return False

    def step_draft(self):
        """(A greedy call on steps compiled whole.) The next chain as tensor ops the target's greedy step runs in its
        own graph (a `ssmspec.speculate.step.StepDraft`), each step's draft then handed over by `observe_drafted`; None
        (default): the drafter drafts on the host."""
        return None

    def observe_drafted(self, chains: Sequence[Sequence[int]], contexts: Sequence[Sequence[int]]) -> None:
        """After a greedy step that drafted with `step_draft`: per row the next chain it drafted (root first: the bonus
        token the step emitted last) and the rows' contexts after the step. Default: nothing."""

    def has_drafted(self, contexts: Sequence[Sequence[int]], max_depth: int) -> bool:
        """Whether the chains handed by `observe_drafted` serve a proposal for `contexts` `max_depth` deep (the engine
        then skips handing over the target's features, which they were drafted from). Default: False."""
        return False

    # whether the engine hands this drafter the target's features (its LM head's input, ssmspec.hf.features) at the
    # last position it committed, before every proposal (`observe_features`; plain steps between hand it nothing)
    target_features: bool = False

    def observe_features(self, row: int, feature: torch.Tensor) -> None:
        """(Drafters with `target_features`.) The target's feature [H] at row `row`'s last committed position, whose
        logits chose the next root. Default: nothing."""

    # whether the engine hands this drafter the target's features at every position a row commits, in order
    # (`observe_history`: the prompt's after the prefill, each step's accepted path after it), plain steps included
    target_history: bool = False

    def observe_history(self, row: int, features: torch.Tensor) -> None:
        """(Drafters with `target_history`.) The target's features [k, H] at the next k positions row `row`
        committed (the prompt's real positions, then each step's accepted nodes, root first). Default: nothing."""

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


# every hook the engine calls on a drafter, and the flags it reads (a test checks that each wrapper handles them all)
HOOKS = ("set_decoding", "start", "propose", "ahead", "finish", "size_by_goodput", "observe_features",
         "observe_history", "observe_prompt", "observe", "step_draft", "observe_drafted", "has_drafted")  # fmt: skip
FLAGS = ("target_features", "target_history", "target_topk", "works_ahead")


class Wrapper(Drafter):
    """A drafter built around others (`inner`: the drafters it wraps): every hook reaches each of them unless the
    wrapper overrides it, and each flag is what they ask together, so that a wrapper cannot forget one (a hook a
    new drafter needs reaches it through every wrapper). `propose` is the wrapper's own; `size_by_goodput` stays
    False (a wrapper sizes what it asks of each drafter itself)."""

    inner: tuple[Drafter, ...] = ()

    def set_decoding(self, decoding: Decoding) -> None:
        super().set_decoding(decoding)
        for d in self.inner:
            d.set_decoding(decoding)

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        for d in self.inner:
            d.start(input_ids, attention_mask)

    def ahead(self, contexts, drafts, max_nodes: int, max_depth: int) -> None:
        for d in self.inner:
            d.ahead(contexts, drafts, max_nodes, max_depth)

    def finish(self, stats) -> None:
        for d in self.inner:
            d.finish(stats)

    def size_by_goodput(self, cost: Callable[[int], float]) -> bool:
        return False  # (the wrapper splits the budget it is given between the drafters it wraps)

    def step_draft(self):
        return None  # (a wrapper composes its drafters' proposals on the host)

    def observe_drafted(self, chains, contexts) -> None:
        pass  # (nothing it wraps drafted in the step: `step_draft`)

    def has_drafted(self, contexts, max_depth: int) -> bool:
        return False

    def _asking(self, flag: str) -> list[Drafter]:
        """The wrapped drafters that ask for what `flag` names (the target's features, history or top-k)."""
        return [d for d in self.inner if getattr(d, flag)]

    @property
    def target_features(self) -> bool:
        return bool(self._asking("target_features"))

    def observe_features(self, row: int, feature: torch.Tensor) -> None:
        for d in self._asking("target_features"):
            d.observe_features(row, feature)

    @property
    def target_history(self) -> bool:
        return bool(self._asking("target_history"))

    def observe_history(self, row: int, features: torch.Tensor) -> None:
        for d in self._asking("target_history"):
            d.observe_history(row, features)

    @property
    def works_ahead(self) -> bool:
        return bool(self._asking("works_ahead"))

    @property
    def target_topk(self) -> int:
        return max((d.target_topk for d in self.inner), default=0)

    def observe_prompt(self, row: int, tokens, tops) -> None:
        for d in self._asking("target_topk"):
            d.observe_prompt(row, tokens, _first(tops, d.target_topk))

    def observe(self, row: int, context, draft: Draft, tops, emitted) -> None:
        for d in self._asking("target_topk"):
            d.observe(row, context, draft, _first(tops, d.target_topk), emitted)


def _first(tops, k: int) -> list[tuple[list[int], list[float]]]:
    """Each position's top-k successors cut to the first k (a drafter that asked for fewer than another)."""
    return [(ids[:k], probs[:k]) for ids, probs in tops]


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


def depth_of(parents: list[int]) -> int:
    """How deep a drafted tree goes (`parents`: each node's parent, the root's -1)."""
    depth = [0] * len(parents)
    for t in range(1, len(depth)):
        depth[t] = depth[parents[t]] + 1
    return max(depth)
