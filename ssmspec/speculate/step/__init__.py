"""One speculative step as four parts, each with typed inputs and outputs:

    StepPlan -> propose (Proposer) -> Proposal -> verify (Verifier) -> Verified -> accept -> Accepted
             -> keep (Rows.keep) -> CommitPlan -> runner.commit + Rows.emit -> StepReport -> the policy

The policy (ssmspec.speculate.policy) says before each step how deep and wide to draft (StepPlan) and hears after
it what the step measured (StepReport). The values below are the hand-overs between the parts: plain data on the
host (the verified logits stay on the model's device), so that each part can be built and tested alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ssmspec.speculate.drafters.base import Draft, depth_of
from ssmspec.tree import TokenTree


@runtime_checkable
class Runner(Protocol):
    """What the loop, its parts, the policy and the calibration use of the target's runner: the seams'
    (ssmspec.speculate.runner.ModelRunner) and HF's own forward's (ssmspec.speculate.generic.GenericRunner) both
    provide it (tested). A call's runner holds the target's committed state; `verify` computes a tree's logits without
    committing, then `commit` keeps the accepted path (or `discard` keeps nothing). Nothing is written into it from
    outside: the calibration hands it its choices through `choose`."""

    model: nn.Module
    dtype: torch.dtype
    device: torch.device
    path: str  # "seams" or "generic" (HF's forward, calibrated on its own)
    max_depth: int
    max_nodes: int | None
    static_shapes: bool  # trees padded to fixed sizes (compiled steps)
    graphs: bool  # steps captured and replayed (ssmspec.compile.graphs)
    fuse_single_nodes: bool  # a one-node step is one captured step with its argmax (`decode`, ModelRunner only)
    reruns: bool  # a partial commit feeds the accepted prefix again in the next forward (priced by the policy)
    retries_out_of_memory: bool
    capture_features: bool  # its forwards keep the target's features (`features`) for a drafter that reads them
    features: torch.Tensor | None
    prepack: bool
    chooses_packing: bool  # may run its linears packed or not per tree size, as calibrated (`packed_sizes`)
    packed_sizes: dict[int, bool] | None
    chooses_single_node_path: bool  # may take HF's decode path for one-node steps, as calibrated
    agreement: object  # the processes' agreement on timings (ssmspec.hf.instance.Agreement)

    @property
    def n_real(self) -> torch.Tensor:
        """Each row's real tokens processed so far [B] (after a prefill)."""

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs) -> torch.Tensor: ...

    def padded_size(self, nodes: int) -> int: ...

    def prepare(self, tree: TokenTree | Sequence[tuple[list[int], list[int]]]) -> TokenTree: ...

    def verify(self, tree: TokenTree) -> torch.Tensor: ...

    def verify_bytes(self) -> int: ...

    def commit(self, last: torch.Tensor, hold: list[bool] | None = None): ...

    def discard(self) -> None: ...

    def snapshot(self): ...

    def restore(self, snap) -> None: ...

    def release(self) -> None: ...

    def choose(
        self,
        *,
        packed_sizes: dict[int, bool] | None | EllipsisType = ...,
        single_node_path: bool | None | EllipsisType = ...,
    ) -> None:
        """The calibration's choices: per tree size, packed linears or F.linear (where `chooses_packing`); for one-node
        steps HF's decode path (True), the tree path (False) or the measured one (None), where
        `chooses_single_node_path`. A choice not given stays as it is."""


class StepDraft(Protocol):
    """A drafter's next greedy chain as tensor ops that a compiled greedy step runs in its own graph, after it has
    accepted and committed (`ModelRunner.verify_greedy`): the next step's draft comes back with this step's tokens, in
    the same replay and the same read, so a run of drafted steps calls nothing between them but the step.

    Attributes:
        module: what the ops read besides the target (a draft head): its parameters are the graph's constants.
        key: what tells two drafts apart (one captured step per bucket and draft).
    """

    module: nn.Module
    key: tuple

    def __call__(self, features: torch.Tensor, roots: torch.Tensor, depth: int) -> torch.Tensor:
        """The chain [B, depth] after each row's root [B] (its bonus token), from the target's features [B, H] at the
        last node the row accepted."""


@dataclass(frozen=True)
class StepPlan:
    """What the policy allows one step.

    Attributes:
        depth: draft depth at most (0: a plain step, nothing drafted).
        budget: drafted nodes per row at most (the root not counted).
        cap: nodes per row a verify step may hold, root included (a memory budget or an out-of-memory retry), or
            None.
        shadow: a plain step that still drafts this many nodes one level deep, unverified, to follow how accurate
            drafts are now (0: none).
    """

    depth: int
    budget: int
    cap: int | None = None
    shadow: int = 0


@dataclass
class Proposal:
    """What `propose` hands to `verify`: one tree per row, as the target will verify it.

    Attributes:
        trees: per row (tokens, parents), root first (the row's last token), parents before children; trimmed to
            what the row may still emit and to the plan's cap.
        qs: per row, {node: the distribution [V] its children were drawn from} (sampling drafters), else None.
        pads: finished rows that still decode pads for HF's scores: row -> the last node of its pad chain.
        depth: the depth the plan allowed.
        shadow: the shadow draft per row (StepPlan.shadow), not verified; None without one.
        shadow_seconds: what drafting the shadow took (not part of the step's price).
    """

    trees: list[Draft]
    qs: list[dict[int, torch.Tensor] | None]
    pads: dict[int, int]
    depth: int
    shadow: list | None = None
    shadow_seconds: float = 0.0

    @property
    def nodes(self) -> int:
        """Nodes of the widest row (root included)."""
        return max(len(tokens) for tokens, _ in self.trees)

    @property
    def chains(self) -> bool:
        """Whether every row's tree is a chain (each node the child of the one before)."""
        return all(parents == list(range(-1, len(parents) - 1)) for _, parents in self.trees)

    def capped(self, cap: int) -> Proposal:
        """Every row cut to its first `cap` nodes (parents precede children, so a prefix is a tree), its
        distributions to the nodes kept, a pad chain shortened."""
        trees = [(tokens[:cap], parents[:cap]) for tokens, parents in self.trees]
        qs = [{n: v for n, v in q.items() if n < cap} if q else q for q in self.qs]
        pads = {r: min(k, cap - 1) for r, k in self.pads.items()}
        return Proposal(trees, qs, pads, self.depth, self.shadow, self.shadow_seconds)


@dataclass
class Verified:
    """What `verify` hands to `accept`: the target's logits at every node of the tree it verified.

    Attributes:
        proposal: the proposal as verified (cut to fewer nodes where an out-of-memory retry had to).
        tree: the trees as verified (on the model's device; padded or level-aligned as the runner needs: node
            indices of the proposal map through `tree.index_of`).
        logits: [B, N, V] raw logits, in float32 (HF processes and picks from float32 logits).
        scores: [B, N, V] float32 scores after HF's processors per node (the raw logits where none apply).
        qs: the proposal's distributions, by node index of `tree`.
        active: per row, whether it is still generating (a finished row is verified only to decode pads).
        features: [B, N, H] the target's features (its LM head's input) at every node, for a drafter that drafts
            from them, else None.
        held_bytes: the verify step's buffers (replay records, node states, tree K/V), where measured, else None.
        cap: the nodes per row an out-of-memory retry cut the trees to, else None.
    """

    proposal: Proposal
    tree: TokenTree
    logits: torch.Tensor
    scores: torch.Tensor
    qs: list[dict[int, torch.Tensor] | None]
    active: list[bool]
    features: torch.Tensor | None = None
    held_bytes: int | None = None
    cap: int | None = None


@dataclass
class Accepted:
    """What `accept` decided per row.

    Attributes:
        last: per row, the last accepted node (an index of the verified tree; 0 for a row that is not active).
        tokens: per row, the tokens the step emits: the accepted drafts, then the target's own next token.
        ties: per row and node (greedy only), whether the target's top-2 logits nearly tie there, else None.
        tops: the target's top-k (ids, probabilities) per row and node, for a drafter that recycles them, else None.
    """

    last: list[int]
    tokens: list[list[int]]
    ties: list[list[bool]] | None = None
    tops: tuple[list, list] | None = None


@dataclass
class CommitPlan:
    """What each row keeps of the step (`Rows.keep`): its accepted path, cut where the row stops (EOS, max length,
    stopping criteria) and, for a finished row decoding pads, its pad chain.

    Attributes:
        cut: per row, the last node to commit (an index of the verified tree).
        paths: per row, the committed nodes, root first.
        emitted: per row, the tokens the row's output gains (pads included).
        stops: per row, whether the row is finished after the step.
        progress: how much nearer its end the step brought the batch (`batch_progress`).
        hold: per row, whether it had finished before the step and keeps nothing (its state need not advance).
    """

    cut: list[int]
    paths: list[list[int]]
    emitted: list[list[int]]
    stops: list[bool]
    progress: int
    hold: list[bool] = field(default_factory=list)


@dataclass
class StepReport:
    """What a step measured, for the policy.

    Attributes:
        nodes: nodes per row the step verified (its tree as verified, padding included).
        depth: the depth the plan allowed (0: a plain step).
        drafted: per row that took part, the depth of its draft; rows that did not (finished before the step, or
            decoding pads) are absent.
        sizes: per row that took part, the nodes it drafted (its tree's beyond the root).
        accepted: per row that took part, how many drafted tokens the target accepted (before any stop).
        shadow_hits: per row that took part in a plain step with a shadow draft, whether the shadow's first level
            held the token the target chose.
        progress: how much nearer its end the step brought the batch.
        all_accepted: whether every row that took part accepted its whole draft.
        shadow: whether the step drafted a shadow (StepPlan.shadow).
        shadow_seconds: what drafting it took.
        held_bytes: Verified.held_bytes.
        cap: Verified.cap.
    """

    nodes: int
    depth: int = 0
    drafted: dict[int, int] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)
    shadow_hits: dict[int, bool] = field(default_factory=dict)
    progress: int = 1
    all_accepted: bool = True
    shadow: bool = False
    shadow_seconds: float = 0.0
    held_bytes: int | None = None
    cap: int | None = None

    @classmethod
    def plain(cls, chosen: dict[int, int], proposal: Proposal | None = None) -> StepReport:
        """The report of a plain step (one node per row, always accepted): `chosen`, per row that took part, the token
        the target chose; `proposal`, the step's own where it drafted a shadow (whose hits are reported)."""
        report = cls(nodes=1, drafted=dict.fromkeys(chosen, 0), sizes=dict.fromkeys(chosen, 0),
                     accepted=dict.fromkeys(chosen, 0))  # fmt: skip
        if proposal is not None and proposal.shadow is not None:
            report.shadow, report.shadow_seconds = True, proposal.shadow_seconds
            for r, token in chosen.items():
                shadow = proposal.shadow[r]
                if shadow is not None and len(shadow[0]) > 1:
                    report.shadow_hits[r] = token in shadow[0][1:]
        return report

    @classmethod
    def of(cls, verified: Verified, accepted: Accepted, kept: CommitPlan) -> StepReport:
        """The report of a step from what its parts handed over."""
        return cls.of_rows(verified.proposal, verified.tree.num_nodes, verified.active, accepted.tokens, kept.progress,
                           verified.held_bytes, verified.cap)  # fmt: skip

    @classmethod
    def of_rows(
        cls, proposal: Proposal, nodes: int, active: list[bool], emitted: list[list[int]], progress: int,
        held_bytes: int | None = None, cap: int | None = None,
    ) -> StepReport:  # fmt: skip
        """The report of a step of `nodes` nodes per row on `proposal`: `active` the rows still generating before it,
        `emitted` per row the tokens it accepted (the drafts, then the target's own; before any stop)."""
        report = cls(nodes=nodes, depth=proposal.depth, progress=progress, shadow=proposal.shadow is not None,
                     shadow_seconds=proposal.shadow_seconds, held_bytes=held_bytes, cap=cap)  # fmt: skip
        for r, (tokens, parents) in enumerate(proposal.trees):
            if not active[r] or r in proposal.pads:
                continue
            report.drafted[r] = depth_of(parents)
            report.sizes[r] = len(tokens) - 1
            report.accepted[r] = len(emitted[r]) - 1
            report.all_accepted &= len(emitted[r]) == len(tokens)
            shadow = proposal.shadow[r] if proposal.shadow is not None else None
            if shadow is not None and len(shadow[0]) > 1:
                report.shadow_hits[r] = emitted[r][0] in shadow[0][1:]
        return report
