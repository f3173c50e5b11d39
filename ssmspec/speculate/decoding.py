"""How each token is chosen and when a row stops, beyond plain greedy + EOS + max length: HF's logits
processors applied to every tree node with that node's own ids, stopping criteria after every emitted token,
sampling with a generator, a streamer, and the scores HF returns.

Node ids are what HF's processors would see for that token: the padded prompt row, the row's generated
tokens (pads after it finished, as HF), then the node's root-to-node path. Nodes are grouped by the length of
those ids and each group is one processor call, so processors that read `input_ids.shape[-1]` (minimum and
exponential-decay lengths) see HF's lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ssmspec.hf.generation import reads_ids
from ssmspec.tree import TokenTree, upload


@dataclass
class Decoding:
    """The generate settings the speculative loop applies per node and per emitted token.

    Attributes:
        processors: HF's processor list for each row (warpers included when sampling); empty: none.
        stopping: stopping criteria other than EOS and max length (stop strings, max time, custom).
        do_sample: sample (lossless speculative sampling) instead of greedy.
        generator: the random generator sampling draws from (None: torch's global one, as HF).
        streamer: HF streamer, or None.
        output_scores: keep each generated token's processed scores.
        output_logits: keep each generated token's raw logits.
    """

    processors: list[LogitsProcessorList] = field(default_factory=list)
    stopping: StoppingCriteriaList = field(default_factory=StoppingCriteriaList)
    do_sample: bool = False
    generator: torch.Generator | None = None
    streamer: Any = None
    output_scores: bool = False
    output_logits: bool = False
    # filled by the loop when asked: one [batch, vocab] tensor per generated column, as HF's
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None

    @property
    def keeps_scores(self) -> bool:
        """Whether every generated position needs its scores (then finished rows keep decoding pads, as HF)."""
        return self.output_scores or self.output_logits

    @property
    def processes(self) -> bool:
        """Whether any processor applies (plain greedy: none, the raw logits are the scores)."""
        return any(len(p) for p in self.processors)

    @property
    def reads_ids(self) -> bool:
        """Whether some processor reads the ids (otherwise nodes need no ids: one call scores them all)."""
        return any(reads_ids(p) for procs in self.processors for p in procs)

    def process(self, seqs: Sequence[Sequence[int]] | None, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Processed scores [M, V] of M positions of batch rows `rows`, each with its own ids `seqs[m]` (HF's
        `input_ids` row; may be None when no processor reads ids). Processors run in HF's order; one that
        reads only the scores (the warpers) is one call over all positions, one that reads the ids is one call
        per id length."""
        if not self.processes:
            return logits
        out = logits.clone()
        lists: dict[int, list[int]] = {}
        for m, r in enumerate(rows):
            lists.setdefault(id(self.processors[r]), []).append(m)
        for members in lists.values():
            index = torch.tensor(members, device=logits.device)
            scores = logits[index].clone()
            lengths = None
            for proc in self.processors[rows[members[0]]]:
                if not reads_ids(proc):
                    scores = proc(torch.zeros(len(members), 1, dtype=torch.long, device=logits.device), scores)
                    continue
                if lengths is None:
                    lengths = {}
                    for i, m in enumerate(members):
                        lengths.setdefault(len(seqs[m]), []).append(i)
                    lengths = [(torch.tensor(pos, device=logits.device),
                                torch.tensor([list(seqs[members[i]]) for i in pos], device=logits.device))
                               for pos in lengths.values()]  # fmt: skip
                scores = scores.clone()
                for pos, ids in lengths:
                    scores[pos] = proc(ids, scores[pos])
            out[index] = scores
        return out

    def proposal(self, seqs: Sequence[Sequence[int]] | None, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """A drafter's sampling distribution q [M, V]: its logits processed as the target's are (`process`), as
        probabilities. Where every row's processors are HF's temperature, top-k and top-p warpers alone (in HF's
        order), the same distribution is computed on the k largest logits only: a few small operations instead of
        HF's sort of the whole vocabulary per warper (up to ties at the k-th logit, which HF keeps; speculative
        sampling is lossless for any q, and this one is HF's warped distribution)."""
        warps = _plain_warps(self.processors)
        if warps is None:
            return self.process(seqs, logits, rows).softmax(-1)
        temperature, top_k, top_p = warps
        x = logits.float() / temperature
        if not top_k and top_p >= 1.0:
            return x.softmax(-1)
        values, index = x.topk(min(top_k or x.shape[-1], x.shape[-1]), dim=-1)  # sorted, largest first
        probs = values.softmax(-1)
        if top_p < 1.0:  # HF drops the smallest tokens whose cumulative mass stays within 1 - top_p
            probs = probs * ((probs.cumsum(-1) - probs) < top_p)
            probs = probs / probs.sum(-1, keepdim=True)
        return torch.zeros_like(x).scatter_(-1, index, probs)

    def score_tree(self, tree: TokenTree, logits: torch.Tensor, bases: Sequence[Sequence[int] | None]) -> torch.Tensor:
        """Processed scores [B, N, V] of every node; rows whose base is None and never-acceptable nodes keep
        their raw logits (nothing is chosen from them)."""
        if not self.processes:
            return logits
        tokens, ok = tree._tokens_list, tree._acceptable_list
        seqs, where = [], []
        with_ids = self.reads_ids
        for b, base in enumerate(bases):
            if base is None:
                continue
            for t in range(tree.num_nodes):
                if not ok[b][t]:
                    continue
                if with_ids:
                    seqs.append(list(base) + [tokens[b][j] for j in tree.path_nodes(b, t)[1:]])
                where.append((b, t))
        if not where:
            return logits
        rows, cols = upload(torch.tensor(where, dtype=torch.long), logits.device).unbind(1)
        out = logits.clone()
        out[rows, cols] = self.process(seqs if with_ids else None, logits[rows, cols], [w[0] for w in where])
        return out

    def stops(self, seq: Sequence[int], device: torch.device) -> bool:
        """Whether the extra stopping criteria end a row whose ids (HF's `input_ids` row) are `seq`."""
        if len(self.stopping) == 0:
            return False
        ids = torch.tensor([list(seq)], dtype=torch.long, device=device)
        return bool(self.stopping(ids, None)[0])

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The token per row [M] from processed scores [M, V]: argmax, or a sample of softmax (as HF)."""
        if not self.do_sample:
            return scores.argmax(-1)
        probs = scores.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)


_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)


def _plain_warps(processors: Sequence[LogitsProcessorList]) -> tuple[float, int, float] | None:
    """(temperature, top-k (0: none), top-p) where every row's processor list holds only HF's temperature, top-k and
    top-p warpers, at most one of each, in that order, with the same values on every row; else None."""
    found = None
    for procs in processors:
        kinds = [type(p) for p in procs]
        if (
            any(k not in _WARPERS for k in kinds)
            or kinds != sorted(kinds, key=_WARPERS.index)
            or len(set(kinds)) < len(kinds)
        ):
            return None
        values = [1.0, 0, 1.0]
        for proc in procs:
            if isinstance(proc, TemperatureLogitsWarper):
                values[0] = float(proc.temperature)
            elif isinstance(proc, TopKLogitsWarper):
                values[1] = int(proc.top_k)
            elif isinstance(proc, TopPLogitsWarper):
                values[2] = float(proc.top_p)
        if found is not None and tuple(values) != found:
            return None
        found = tuple(values)
    return found


class ColumnStreamer:
    """Feeds an HF streamer as HF's loop does: the prompt once, then one [batch] tensor per generated column
    (a finished row contributes pads), each column as soon as every row has it; `end()` at the end."""

    def __init__(self, streamer: Any, prompt: torch.Tensor, pad_token_id: int) -> None:
        self.streamer = streamer
        self.pad = pad_token_id
        self.sent = 0
        if streamer is not None:
            streamer.put(prompt.cpu())

    def release(self, generated: Sequence[Sequence[int]], done: Sequence[bool]) -> None:
        """Put every column that all rows have reached (a finished row has all further columns: pads)."""
        if self.streamer is None:
            return
        open_rows = [len(g) for g, d in zip(generated, done) if not d]
        upto = min(open_rows) if open_rows else max(len(g) for g in generated)
        for col in range(self.sent, upto):
            column = [g[col] if col < len(g) else self.pad for g in generated]
            self.streamer.put(torch.tensor(column, dtype=torch.long))
        self.sent = max(self.sent, upto)

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
