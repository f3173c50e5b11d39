"""The speculative decoding loop: prefill, draft, verify, commit; stops exactly where HF generate() stops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ssmspec.speculate.drafters import Drafter
from ssmspec.speculate.runner import ModelRunner
from ssmspec.speculate.verify import greedy_verify
from ssmspec.tree import TokenTree


@dataclass
class SpecStats:
    """Counters of one generate call (all rows together)."""

    verify_steps: int = 0
    accepted_tokens: int = 0  # drafted tokens accepted, summed over rows
    emitted_tokens: int = 0  # tokens appended to the outputs (accepted + bonus, after EOS/max truncation)
    tree_nodes_per_step: list[int] = field(default_factory=list)  # nodes per row verified, per step (max over rows)
    row_steps: int = 0  # verify steps counted per active row
    # emitted tokens whose top-2 logit gap was below near_tie_tolerance * max(1, |top logit|): where another
    # arithmetic (a tree vs one token, another kernel) may pick the other token in float32/bf16
    near_ties: int = 0
    near_tie_tolerance: float = 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens gained per verify step and row: accepted drafts + the bonus token."""
        return (self.accepted_tokens + self.row_steps) / max(self.row_steps, 1)


def eos_and_pad(generation_config) -> tuple[list[int], int]:
    """EOS ids as a list and the pad id, resolved as HF generate does (no pad token: the first EOS, else 0)."""
    eos = generation_config.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    pad = generation_config.pad_token_id
    return eos, int(pad) if pad is not None else (eos[0] if eos else 0)


def speculative_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    drafter: Drafter,
    tree_budget: int,
    num_draft_tokens: int,
    commit: str = "replay",
    decode_single_nodes: bool = True,
    schedule: str = "constant",
) -> tuple[torch.Tensor, SpecStats, ModelRunner]:
    """Greedy speculative decoding. Returns (sequences [B, L + T] as HF generate, stats, the target's runner
    holding the final committed cache). Each step drafts at most `tree_budget` nodes per row, at most
    `num_draft_tokens` deep. `schedule` "heuristic" adapts the depth as HF's assisted generation does (+2
    after a step that accepted every drafted token, -1 otherwise). Steps that verify one node per row use
    HF's own decode path unless `decode_single_nodes` is False (then the tree path, as for any tree)."""
    stats = SpecStats()
    b = input_ids.shape[0]
    runner = ModelRunner(model, commit=commit, decode_single_nodes=decode_single_nodes)
    stats.near_tie_tolerance = near_tie_tolerance(runner.dtype)
    if max_new_tokens <= 0:
        return input_ids.clone(), stats, runner
    logits = runner.prefill(input_ids, attention_mask)
    drafter.start(input_ids, attention_mask)
    mask = attention_mask.bool()
    contexts = [input_ids[r][mask[r]].tolist() for r in range(b)]
    generated: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    eos = set(eos_token_ids)
    depth_limit = num_draft_tokens

    def emit(row: int, toks: list[int]) -> None:
        for t in toks:
            if done[row]:
                return
            generated[row].append(t)
            contexts[row].append(t)
            stats.emitted_tokens += 1
            if t in eos or len(generated[row]) >= max_new_tokens:
                done[row] = True

    first_ties = _near_ties(logits, stats.near_tie_tolerance).tolist()
    for r, t in enumerate(logits.argmax(-1).tolist()):
        stats.near_ties += int(first_ties[r])
        emit(r, [t])
    while not all(done):
        remaining = [max_new_tokens - len(g) for g in generated]
        depth = min(depth_limit, max(remaining) - 1)
        drafts = drafter.propose(contexts, tree_budget, max(depth, 0))
        drafts = [_trim(d, remaining[r] - 1) if not done[r] else ([d[0][0]], [-1]) for r, d in enumerate(drafts)]
        tree = runner.prepare(
            TokenTree.from_lists([d[0] for d in drafts], [d[1] for d in drafts], device=input_ids.device)
        )
        node_logits = runner.verify(tree)
        last, emitted = greedy_verify(tree, node_logits)
        path, _ = runner.commit(last)
        ties = torch.gather(_near_ties(node_logits, stats.near_tie_tolerance), 1, path).tolist()
        stats.verify_steps += 1
        stats.tree_nodes_per_step.append(max(len(d[0]) for d in drafts))
        all_accepted = True
        for r in range(b):
            if done[r]:
                continue
            stats.row_steps += 1
            stats.accepted_tokens += len(emitted[r]) - 1
            all_accepted &= len(emitted[r]) == len(drafts[r][0])
            before = len(generated[r])
            emit(r, emitted[r])
            stats.near_ties += sum(ties[r][: len(generated[r]) - before])
        if schedule != "constant":
            depth_limit = depth_limit + 2 if all_accepted else max(1, depth_limit - 1)
    width = max(len(g) for g in generated)
    out = torch.full((b, width), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    for r, g in enumerate(generated):
        out[r, : len(g)] = torch.tensor(g, dtype=input_ids.dtype)
    return torch.cat([input_ids, out], dim=1), stats, runner


def near_tie_tolerance(dtype: torch.dtype) -> float:
    """Relative top-2 gap below which a greedy token could flip under other rounding: 8 ulps of the dtype."""
    return 8 * torch.finfo(dtype).eps


def _near_ties(logits: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Per position, whether the top-2 logit gap is below tolerance * max(1, |top logit|)."""
    top = logits.float().topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]) < tolerance * top[..., 0].abs().clamp(min=1.0)


def _trim(draft: tuple[list[int], list[int]], max_depth: int) -> tuple[list[int], list[int]]:
    """Drop drafted nodes deeper than max_depth (no use drafting past max_new_tokens)."""
    tokens, parents = draft
    depth = [0] * len(tokens)
    keep = [0]
    new_index = {0: 0}
    for t in range(1, len(tokens)):
        depth[t] = depth[parents[t]] + 1
        if depth[t] <= max_depth and parents[t] in new_index:
            new_index[t] = len(keep)
            keep.append(t)
    return [tokens[t] for t in keep], [-1] + [new_index[parents[t]] for t in keep[1:]]
