"""The rows of a generate call as HF's loop keeps them: what each row has generated, whether it has stopped (EOS,
max length, stopping criteria, checked after every token), the streamer fed column by column, the scores HF returns;
and from each step's accepted tokens, what each row keeps (`keep`: the commit plan) and emits (`emit`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssmspec.speculate.decoding import ColumnStreamer, Decoding
from ssmspec.speculate.step import Accepted, CommitPlan, Proposal, Verified
from ssmspec.tree import TokenTree


class Rows:
    """Every row's output so far, and when it stops, exactly as HF's `generate` decides it.

    Args:
        input_ids: [B, L] the (left-padded) prompts.
        attention_mask: [B, L] their mask.
        decoding: processors, stopping criteria, sampling, streamer, kept scores.
        eos_token_ids: tokens that end a row.
        pad_token_id: what a finished row's columns hold.
        max_new_tokens: tokens a row generates at most.
        stats: the call's SpecStats (emitted, accepted tokens, near-ties, steps are counted here).
    """

    def __init__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoding: Decoding, eos_token_ids: list[int],
        pad_token_id: int, max_new_tokens: int, stats,
    ) -> None:  # fmt: skip
        self.input_ids = input_ids
        self.decoding = decoding
        self.eos = set(eos_token_ids)
        self.pad = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.stats = stats
        self.device = input_ids.device
        b = input_ids.shape[0]
        mask = attention_mask.bool()
        self.prompts = input_ids.tolist()  # what HF's processors and criteria see: the padded prompt rows
        self.contexts = [input_ids[r][mask[r]].tolist() for r in range(b)]  # real tokens: what drafters read
        self.generated: list[list[int]] = [[] for _ in range(b)]
        self.pads = [0] * b  # pads a finished row has decoded since (only when scores are kept, as HF's loop does)
        self.done = [False] * b
        self.keeps_scores = decoding.keeps_scores
        self.kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(b)]  # (scores, raw) per token
        self.stream = ColumnStreamer(decoding.streamer, input_ids, pad_token_id)

    @property
    def batch(self) -> int:
        return len(self.generated)

    @property
    def finished(self) -> bool:
        """Whether every row has stopped."""
        return all(self.done)

    @property
    def remaining(self) -> list[int]:
        """Per row, the tokens it may still generate."""
        return [self.max_new_tokens - len(g) for g in self.generated]

    def ids(self, row: int) -> list[int]:
        """HF's `input_ids` row as its processors and criteria see it: the padded prompt, the generated tokens, the
        pads a finished row decoded since."""
        return self.prompts[row] + self.generated[row] + [self.pad] * self.pads[row]

    def score_bases(self, proposal: Proposal) -> list[list[int] | None]:
        """Per row, the ids its tree's nodes continue (None for a row that is neither generating nor decoding
        pads: nothing is chosen from its scores)."""
        return [self.ids(r) if not self.done[r] or r in proposal.pads else None for r in range(self.batch)]

    # ------------------------------------------------------------------ the prefill's token
    def first(self, logits: torch.Tensor, near_ties: torch.Tensor | None) -> None:
        """Choose and emit every row's first token from the prefill's last logits [B, V] (`near_ties` [B]: whether
        the target's top two nearly tie there; None when sampling)."""
        raw = logits.float()  # HF processes and picks from float32 logits
        scores = self.decoding.process([self.ids(r) for r in range(self.batch)], raw, list(range(self.batch)))
        first = self.decoding.choose(scores).tolist()
        ties = [False] * self.batch if near_ties is None else near_ties.tolist()
        for r in range(self.batch):
            if self.keeps_scores:
                self.kept[r].append((scores[r], raw[r]))
            self.stats.near_ties += int(ties[r])
            self.done[r] = self._cut(r, [first[r]])[1]
            self._append(r, [first[r]])
        self.stream.release(self.generated, self.done)

    # ------------------------------------------------------------------ a step's tokens
    def keep(self, verified: Verified, accepted: Accepted) -> CommitPlan:
        """What each row keeps of the step: its accepted path, cut after the first token that stops it (EOS, max
        length, HF's criteria on the ids as they would be); a finished row decoding pads keeps its pad chain.
        Nothing is appended yet (`emit`)."""
        tree, proposal = verified.tree, verified.proposal
        cut, paths, emitted, stops = list(accepted.last), [], [], list(self.done)
        for r in range(self.batch):
            if r in proposal.pads:
                cut[r] = tree.index_of(r, proposal.pads[r])
                paths.append(tree.path_nodes(r, cut[r]))
                emitted.append([self.pad] * len(paths[-1]))
            elif verified.active[r]:
                n, stops[r] = self._cut(r, accepted.tokens[r])
                path = tree.path_nodes(r, cut[r])[:n]
                cut[r] = path[-1]  # a row that stopped inside the block commits only what it emitted
                paths.append(path)
                emitted.append(accepted.tokens[r][:n])
            else:
                paths.append([cut[r]])
                emitted.append([])
        lengths = [len(g) + (len(e) if a else 0) for g, e, a in zip(self.generated, emitted, verified.active)]
        progress = batch_progress(self.remaining, self.done, lengths, stops, self.max_new_tokens, accepted.tokens)
        hold = [not a and r not in proposal.pads for r, a in enumerate(verified.active)]
        return CommitPlan(cut, paths, emitted, stops, progress, hold)

    def emit(self, kept: CommitPlan, verified: Verified, accepted: Accepted) -> None:
        """Append what `keep` decided: tokens (pads for a finished row decoding them), the step's counters, the
        kept scores, the streamer's full columns."""
        stats = self.stats
        stats.verify_steps += 1
        stats.tree_nodes_per_step.append(max(sum(row) for row in verified.tree._acceptable_list))
        for r, tokens in enumerate(kept.emitted):
            if not tokens:
                continue
            if self.done[r]:  # a finished row's pads
                self.pads[r] += len(tokens)
            else:
                stats.row_steps += 1
                stats.accepted_tokens += len(accepted.tokens[r]) - 1
                if accepted.ties is not None:
                    stats.near_ties += sum(accepted.ties[r][node] for node in kept.paths[r])
                self._append(r, tokens)
                self.done[r] = kept.stops[r]
            if self.keeps_scores:
                self.kept[r].extend((verified.scores[r, node].clone(), verified.logits[r, node].float().clone())
                                    for node in kept.paths[r])  # fmt: skip
        self.stream.release(self.generated, self.done)

    def emit_greedy(self, tokens: Sequence[Sequence[int]], ties: Sequence[Sequence[int]], nodes: int = 1) -> int:
        """A greedy step whose rows' paths were accepted on the device (`ModelRunner.decode`, `.verify_greedy`):
        per row the tokens it accepted (the drafts, then the target's own; `ties`: whether the target's top two nearly
        tied at each), emitted and counted as `keep` and `emit` do, cut after the first that stops the row; a row that
        has stopped takes none. `nodes`: the step's nodes per row (its tree's, unpadded). Returns how much nearer its
        end the step brought the batch (`batch_progress`; a one-node step: 1)."""
        stats = self.stats
        stats.verify_steps += 1
        stats.tree_nodes_per_step.append(nodes)
        remaining, done = (self.remaining, list(self.done)) if nodes > 1 else (None, None)
        for r, row in enumerate(tokens):
            if self.done[r]:
                continue
            n, self.done[r] = self._cut(r, row)
            stats.row_steps += 1
            stats.accepted_tokens += len(row) - 1
            stats.near_ties += sum(ties[r][:n])
            self._append(r, row[:n])
        self.stream.release(self.generated, self.done)
        if remaining is None:
            return 1
        return batch_progress(remaining, done, [len(g) for g in self.generated], self.done, self.max_new_tokens,
                              tokens)  # fmt: skip

    def _append(self, row: int, tokens: Sequence[int]) -> None:
        self.generated[row].extend(tokens)
        self.contexts[row].extend(tokens)
        self.stats.emitted_tokens += len(tokens)

    def _cut(self, row: int, tokens: Sequence[int]) -> tuple[int, bool]:
        """How many of `tokens` the row emits (up to and including the first that stops it: EOS, max length, a
        stopping criterion on HF's ids with it), and whether one stops it."""
        length, base = len(self.generated[row]), None
        for i, t in enumerate(tokens):
            if t in self.eos or length + i + 1 >= self.max_new_tokens:
                return i + 1, True
            if len(self.decoding.stopping):
                base = self.ids(row) if base is None else base
                if self.decoding.stops(base + list(tokens[: i + 1]), self.device):
                    return i + 1, True
        return len(tokens), False

    # ------------------------------------------------------------------ the call's result
    def result(self, runner) -> torch.Tensor:
        """The sequences [B, L + T] as HF returns them (a finished row padded); with kept scores, HF's scores and
        logits per column in `decoding.scores` / `.logits` (a row that finished early decodes pads for them, as
        HF's loop does: `catch_up_scores`). Ends the streamer."""
        width = max(len(g) for g in self.generated)
        dec = self.decoding
        if self.keeps_scores:
            catch_up_scores(self, runner, width)
            dec.scores = tuple(torch.stack([k[c][0] for k in self.kept]) for c in range(width))
            dec.logits = tuple(torch.stack([k[c][1] for k in self.kept]) for c in range(width))
        self.stream.end()
        out = torch.full((self.batch, width), self.pad, dtype=self.input_ids.dtype, device=self.device)
        for r, g in enumerate(self.generated):
            out[r, : len(g)] = torch.tensor(g, dtype=self.input_ids.dtype)
        return torch.cat([self.input_ids, out], dim=1)


def catch_up_scores(rows: Rows, runner, width: int) -> None:
    """Rows that finished before the last one still owe HF's scores up to `width`: decode pads for them (as HF's
    loop does for finished rows) until every row has one score per generated column."""
    b, kept = rows.batch, rows.kept
    while any(len(k) < width for k in kept):
        need = [width - len(k) for k in kept]
        longest = runner.max_depth if runner.static_shapes else 15
        chains = [min(n - 1, longest) if n > 0 else -1 for n in need]
        drafts = [[rows.ids(r)[-1]] + [rows.pad] * max(k, 0) for r, k in enumerate(chains)]
        chain_parents = [list(range(-1, len(d) - 1)) for d in drafts]
        tree = runner.prepare(TokenTree.from_lists(drafts, chain_parents, device=rows.device))
        raw = runner.verify(tree).float()
        scores = rows.decoding.score_tree(tree, raw, [rows.ids(r) if chains[r] >= 0 else None for r in range(b)])
        last = torch.tensor([tree.index_of(r, max(k, 0)) for r, k in enumerate(chains)], device=rows.device)
        path = tree.paths(last)[0].tolist()
        for r, k in enumerate(chains):
            if k >= 0:
                kept[r].extend((scores[r, node].clone(), raw[r, node].clone()) for node in path[r][: k + 1])
                rows.pads[r] += k + 1
        runner.commit(last)


def batch_progress(
    remaining: Sequence[int],
    done_before: Sequence[bool],
    generated: Sequence[int | Sequence[int]],
    done: Sequence[bool],
    max_new_tokens: int,
    emitted: Sequence[Sequence[int]],
) -> int:
    """How much nearer its end a step brought the batch: how far the most tokens any unfinished row has left to
    generate fell (`remaining` and `done_before`: before the step), at most the most tokens a row emitted (a row
    that stops at EOS ends no sooner for the others). A batch ends with its last row, so the rows that gained more
    than the slowest did not shorten it: at batch 4 the tokens per row of the rows the batch waits for measured
    speculation winning by 10% where it was 0.93x plain decoding. `generated`: per row its tokens after the step
    (or how many)."""
    before = [n for n, d in zip(remaining, done_before) if not d]
    if not before:
        return 0
    after = [max_new_tokens - (g if isinstance(g, int) else len(g)) for g, d in zip(generated, done) if not d]
    most = max((len(e) for e, d in zip(emitted, done_before) if not d), default=0)
    return max(0, min(max(before) - max(after, default=0), most))
