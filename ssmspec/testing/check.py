"""check_model: the equivalence checker users run in CI on a new architecture.

For each prompt batch and drafter it asserts that speculative greedy output equals Hugging Face's own
`generate(do_sample=False)` on the untransformed model and ssmspec's own autoregressive decode, that the
committed states after generation equal those after plain greedy, and that the transformed model's plain
forward logits equal the original's. In float64 any difference is a failure; in lower precision a token
divergence is accepted only at a near-tie of the reference (top-2 logit gap < tie_tolerance) and counted.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ssmspec.hf import layers as hf_layers
from ssmspec.speculate.drafters import Drafter, NoDrafter
from ssmspec.speculate.engine import eos_and_pad, speculative_generate
from ssmspec.speculate.generic import GenericRunner
from ssmspec.speculate.runner import ModelRunner
from ssmspec.speculate.ties import near_tie_tolerance
from ssmspec.testing.report import computes_in_float32
from ssmspec.transform import transform


class EquivalenceError(AssertionError):
    """Speculative output, states or logits differ from the reference beyond what the dtype allows."""


@dataclass
class CheckReport:
    """What check_model measured.

    Attributes:
        runs: speculative runs compared (prompt batches x drafters x commit strategies).
        tokens_compared: generated tokens compared with HF greedy.
        tie_flips: tokens that differed at a near-tie of the reference (float32/bf16 only).
        max_state_diff: largest relative committed-state difference against ssmspec's autoregressive decode.
        max_logit_diff: largest plain-forward logit difference of the transformed model against the original.
        mean_accepted_per_step: per run, tokens gained per verify step and row.
        seams: the kernel seams transform made tree-aware.
        path: how the model verifies: "seams" (ssmspec's tree-aware mixers) or "generic" (HF's own forward and
            cache, batches row by row: ssmspec.speculate.generic; chains, or trees through a recurrence module's
            tree form, whose commit writes the state: `max_state_diff` compares every tensor of each row's cache).
        certified: the calls compared with HF greedy: the adversarial drafters' runs ("adversarial drafters, <commit>
            commit"), and with `default_call`, the call a user makes ("default call": `model.generate(ids)` with the
            model's defaults, its draft head or MTP layer where it has one, the adaptive policy, inference mode) and
            that call with its steps captured ("default call, captured steps": the op tape standing in for CUDA
            graphs and compiled steps).
        not_certified: a call the model cannot take, with why (a model whose steps cannot be captured).
    """

    runs: int = 0
    tokens_compared: int = 0
    tie_flips: int = 0
    max_state_diff: float = 0.0
    max_logit_diff: float = 0.0
    mean_accepted_per_step: list[float] = field(default_factory=list)
    seams: list[str] = field(default_factory=list)  # the kernel seams transform made tree-aware
    path: str = "seams"
    certified: list[str] = field(default_factory=list)  # the calls compared with HF greedy (what users run too)
    not_certified: dict[str, str] = field(default_factory=dict)  # a call the model cannot take -> why


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    """|x - y| relative to y's magnitude (at least 1): states of trained models reach tens, so an absolute
    tolerance would measure their size, not the arithmetic."""
    x, y = x.double(), y.double()
    return float((x - y).abs().max() / (1.0 + y.abs().max()))


def _tensors(obj: object, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor held by a cache object (its attributes, lists, tuples and dicts, depth first, in order)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _tensors(item, seen)]


def _generic_state_diff(a: GenericRunner, b: GenericRunner, rows: Sequence[int]) -> float:
    """`state_diff` on the generic path: every tensor of each row's HF cache and module-held state (tokens carried
    into a next forward fed first)."""
    a.flush()
    worst = 0.0
    for r in rows:
        sa, sb = a.rows[r].state, b.rows[r].state  # the cache object and the state a model keeps on its modules
        ta, tb = _tensors([sa.cache, sa.held]), _tensors([sb.cache, sb.held])
        if [t.shape for t in ta] != [t.shape for t in tb]:
            return float("inf")
        worst = max([worst] + [_rel(x, y) for x, y in zip(ta, tb) if x.is_floating_point() and x.numel()])
    return worst


def state_diff(a: ModelRunner | GenericRunner, b: ModelRunner | GenericRunner, rows: Sequence[int]) -> float:
    """Largest relative difference (max |a - b| / (1 + max |b|), per tensor) of the committed conv/recurrent
    states and valid K/V of two runners, on rows."""
    if not rows:
        return 0.0
    if isinstance(a, GenericRunner):
        return _generic_state_diff(a, b, rows)
    idx = torch.tensor(list(rows))
    worst = 0.0
    for i, (la, lb) in enumerate(zip(a.cache.layers, b.cache.layers)):
        for name, states in hf_layers.state_dicts(la).items():
            for k, ta in states.items():
                tb = hf_layers.state_dicts(lb)[name][k]
                if ta is not None and tb is not None:
                    worst = max(worst, _rel(ta[idx], tb[idx]))
        if i in a.cache.attention_layers():
            for r in rows:
                (ka, va), (kb, vb) = a.cache.committed_kv(i, r), b.cache.committed_kv(i, r)
                if ka.shape != kb.shape:
                    return float("inf")
                worst = max(worst, _rel(ka, kb), _rel(va, vb))
    return worst


def check_model(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    prompts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    drafters: Sequence[Callable[[torch.Tensor], Drafter]] | None = None,
    *,
    max_new_tokens: int = 12,
    tree_budget: int = 8,
    num_draft_tokens: int = 4,
    commits: Sequence[str] = ("replay", "materialize"),
    tie_tolerance: float | None = None,
    state_tolerance: float | None = None,
    logit_tolerance: float | None = None,
    eos_token_id: int | list[int] | None = None,
    decode_single_nodes: bool = True,
    static_shapes: bool = False,
    default_call: bool = True,
) -> CheckReport:
    """Run the equivalence checks on a model; raises EquivalenceError at the first violation.

    Speculative greedy output must equal HF's `generate(do_sample=False)` on the untransformed model and
    ssmspec's own autoregressive decode; committed states after speculation must equal those after plain
    decoding; plain-forward logits of the transformed model must equal the original's.

    Args:
        model_or_factory: the untransformed model, or a zero-argument function returning it (it is copied).
        prompts: (input_ids, attention_mask) pairs, left-padded batches.
        drafters: factories taking the reference rows (HF greedy output, real tokens) and returning a
            Drafter, so oracles can be built; default: no drafts only.
        max_new_tokens: tokens generated per run.
        tree_budget: drafted nodes per row and step at most.
        num_draft_tokens: draft depth at most.
        commits: commit strategies to run.
        tie_tolerance: top-2 logit gap (relative to max(1, |top logit|)) below which a float32/bf16 token difference
            counts as a tie flip (default: 0 in float64, 1e-3 in float32, 8 units in the last place in bf16/fp16).
        state_tolerance: largest relative committed-state difference allowed (default, float64: 1e-9, or 1e-6
            where one-node steps take HF's decode path or HF's code computes in float32 there; float32: 1e-3;
            bf16/fp16: 8 units in the last place), over the rows that emitted what plain decoding did.
        logit_tolerance: largest plain-forward logit difference allowed.
        eos_token_id: overrides the model's EOS for both sides (to test stopping exactly).
        decode_single_nodes: whether one-node steps use HF's decode path or the tree path (`generate` takes
            whichever measured faster on the model; the checker runs the one asked for).
        static_shapes: verify as a compiled model does (SpecConfig.static_shapes): padded trees, fixed-length
            commits, attention K/V in preallocated buffers written in place.
        default_call: also compare the call users make, `model.generate(ids, attention_mask=...)` on the transformed
            model with its defaults (drafter, sizes, adaptive policy), and that call with its steps captured
            (`SpecConfig(graphs=True)`: the op tape on a CPU) where the model allows it (`CheckReport.certified`).

    Returns:
        A CheckReport of what was compared.

    Raises:
        EquivalenceError: the first violation, with where and by how much.
        UnsupportedModelError: the model (or a tree / batch the checks need) cannot be verified exactly.

    Tolerances default by dtype: float64 -> no tie flips allowed, states 1e-9 (1e-6 with HF decode steps,
    see below; states are compared relative to their magnitude), logits 1e-10; otherwise tie gap 1e-3,
    states 1e-3, logits 1e-4.
    eos_token_id overrides the model's generation config for both sides (to test stopping exactly).
    decode_single_nodes=False sends one-node steps through the tree path too (`generate` takes it where it
    measured faster than HF's own decode path): then every committed state comes from ssmspec's tree ops and
    commit, the strictest test of the commit. With True, states that went through HF's single-token fallbacks carry
    float32 rounding even in a float64 model: HF's torch fallbacks compute the scan in float32 (Mamba2's
    `mamba2_selective_state_update` takes `exp(dt.float() * A.float())`, its chunk scan `hidden_states.float()`),
    so they agree with ssmspec's float64 tree ops to ~1e-7 of the state's magnitude (the embedded
    mamba2-target: 1.3e-6 absolute on states up to 14), hence the relative 1e-6.
    """
    reference = (
        model_or_factory()
        if callable(model_or_factory) and not isinstance(model_or_factory, nn.Module)
        else (model_or_factory)
    )
    dtype = next(reference.parameters()).dtype
    tie_tolerance, state_tolerance, logit_tolerance = _tolerances(
        dtype, reference, decode_single_nodes, tie_tolerance, state_tolerance, logit_tolerance
    )
    target = transform(copy.deepcopy(reference))
    eos, pad = eos_and_pad(reference.generation_config)
    if eos_token_id is not None:
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    report = CheckReport(seams=sorted({s for seams in target.ssmspec_info.mixers.values() for s in seams}),
                         path=target.ssmspec_info.path)  # fmt: skip
    run = _Run(target, eos, pad, max_new_tokens, tie_tolerance, state_tolerance, report,
               dict(decode_single_nodes=decode_single_nodes, static_shapes=static_shapes,
                    generic=target.ssmspec_info.path == "generic"))  # fmt: skip
    for input_ids, attention_mask in prompts:
        ref_seq, ref_logits, ref_rows = _reference(reference, run, input_ids, attention_mask, logit_tolerance)
        for commit in commits:
            _check_commit(run, input_ids, attention_mask, ref_seq, ref_logits, ref_rows, commit,
                          list(drafters or [lambda ref: NoDrafter()]), tree_budget, num_draft_tokens)  # fmt: skip
        if default_call:
            _check_default_call(target, input_ids, attention_mask, max_new_tokens, pad, eos, ref_seq, ref_logits,
                                tie_tolerance, report)  # fmt: skip
    return report


def _tolerances(
    dtype: torch.dtype, reference: nn.Module, decode_single_nodes: bool, tie: float | None, state: float | None,
    logit: float | None,
) -> tuple[float, float, float]:  # fmt: skip
    """The tie, state and logit tolerances: those given, else the dtype's defaults (check_model's docstring)."""
    exact = dtype == torch.float64
    # bfloat16 / float16: rounding moves a logit or a state by a few units in the last place (bfloat16's is 0.8% of
    # the value), so their defaults are the engine's near-tie rule, 8 of them (near_tie_tolerance): at 1e-3 the check
    # failed on 18 of the 28 families, on differences of 1-2 units
    half = dtype in (torch.bfloat16, torch.float16)
    if tie is None:
        tie = 0.0 if exact else near_tie_tolerance(dtype) if half else 1e-3
    if state is None:  # HF's float32 casts (report.FLOAT32_IN_HF_CODE) round the states at ~1e-7
        if exact:
            state = 1e-6 if decode_single_nodes or computes_in_float32(reference) else 1e-9
        else:
            state = near_tie_tolerance(dtype) if half else 1e-3
    return tie, state, (1e-10 if exact else 1e-4) if logit is None else logit


@dataclass
class _Run:
    """What every run of one check shares: the transformed model, EOS and pad, length, tolerances, the report, and
    the runner settings the checks verify with."""

    target: nn.Module
    eos: list[int]
    pad: int
    max_new_tokens: int
    tie_tolerance: float
    state_tolerance: float
    report: CheckReport
    settings: dict


def _reference(reference: nn.Module, run: _Run, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               logit_tolerance: float) -> tuple[torch.Tensor, torch.Tensor | None, list[list[int]]]:  # fmt: skip
    """The transformed model's plain-forward logits checked against the original's, then HF greedy's output on the
    untransformed model: (sequences, logits [B, T, V], each row's real tokens)."""
    with torch.no_grad():
        want = reference(input_ids=input_ids, attention_mask=attention_mask).logits
        got = run.target(input_ids=input_ids, attention_mask=attention_mask).logits
    diff = float((want - got).abs().max())
    run.report.max_logit_diff = max(run.report.max_logit_diff, diff)
    if diff > logit_tolerance:
        raise EquivalenceError(f"plain forward logits of the transformed model differ by {diff:.3g}")
    hf = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=run.max_new_tokens,
                            do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=run.pad,
                            eos_token_id=run.eos or None)  # fmt: skip
    ref_seq = hf.sequences
    ref_logits = torch.stack(hf.logits, 1) if hf.logits else None  # [B, T, V]
    mask = attention_mask.bool()
    ref_rows = [
        ref_seq[r, : input_ids.shape[1]][mask[r]].tolist() + ref_seq[r, input_ids.shape[1] :].tolist()
        for r in range(ref_seq.shape[0])
    ]
    return ref_seq, ref_logits, ref_rows


def _check_commit(
    run: _Run, input_ids: torch.Tensor, attention_mask: torch.Tensor, ref_seq: torch.Tensor,
    ref_logits: torch.Tensor | None, ref_rows: list[list[int]], commit: str,
    drafters: list[Callable[[list[list[int]]], Drafter]], tree_budget: int, num_draft_tokens: int,
) -> None:  # fmt: skip
    """ssmspec's plain decoding, then each adversarial drafter, with one commit strategy: outputs against HF's,
    committed states against plain decoding's."""
    report, prompt = run.report, input_ids.shape[1]
    common = dict(max_new_tokens=run.max_new_tokens, eos_token_ids=run.eos, pad_token_id=run.pad, commit=commit,
                  **run.settings)  # fmt: skip
    ar_seq, _, ar_runner = speculative_generate(run.target, input_ids, attention_mask, drafter=NoDrafter(),
                                                tree_budget=0, num_draft_tokens=0, **common)  # fmt: skip
    _compare(ar_seq, ref_seq, ref_logits, prompt, run.tie_tolerance, report, "ssmspec autoregressive")
    for make in drafters:
        seq, stats, runner = speculative_generate(run.target, input_ids, attention_mask, drafter=make(ref_rows),
                                                  tree_budget=tree_budget, num_draft_tokens=num_draft_tokens,
                                                  **common)  # fmt: skip
        report.runs += 1
        report.mean_accepted_per_step.append(stats.mean_accepted_per_step)
        flips = _compare(seq, ref_seq, ref_logits, prompt, run.tie_tolerance, report, "speculative")
        if not torch.equal(seq, ar_seq) and not flips:
            raise EquivalenceError(f"speculative output differs from ssmspec autoregressive ({commit})")
        # rows that emitted what plain decoding did (after a counted tie flip a row's tokens, so its
        # states, legitimately differ) and ran to the end: a row that stopped early keeps its K/V slots while
        # the others go on, and its recurrent states step over pads as many times as the batch took steps
        same = [
            r
            for r in range(seq.shape[0])
            if int(runner.n_real[r]) == int(ar_runner.n_real[r])
            and torch.equal(seq[r], ar_seq[r])
            and not _held(runner, r)
            and not _held(ar_runner, r)
        ]
        sd = state_diff(runner, ar_runner, same)
        report.max_state_diff = max(report.max_state_diff, sd)
        if sd > run.state_tolerance:
            raise EquivalenceError(f"committed states after speculation differ by {sd:.3g} ({commit})")
    _certified(report, f"adversarial drafters, {commit} commit")


def _certified(report: CheckReport, what: str) -> None:
    if what not in report.certified:
        report.certified.append(what)


def _check_default_call(target, input_ids, attention_mask, max_new_tokens, pad, eos, ref_seq, ref_logits,
                        tie_tolerance, report) -> None:  # fmt: skip
    """The call a user makes, with the model's defaults, and with its steps captured, against HF greedy."""
    from ssmspec import SpecConfig
    from ssmspec.errors import CaptureError, UnsupportedModelError

    kwargs = {"attention_mask": attention_mask, "max_new_tokens": max_new_tokens, "pad_token_id": pad,
              "eos_token_id": eos or None, "do_sample": False}  # fmt: skip
    calls = {"default call": {}, "default call, captured steps": {"speculation": SpecConfig(graphs=True)}}
    for what, extra in calls.items():
        if what in report.not_certified:
            continue
        try:
            out = target.generate(input_ids, **kwargs, **extra)
        except (UnsupportedModelError, CaptureError) as e:  # (refused by name: the call the model cannot take)
            if not extra:
                raise
            report.not_certified[what] = str(e)
            continue
        _compare(out, ref_seq, ref_logits, input_ids.shape[1], tie_tolerance, report, what)
        _certified(report, what)


def _held(runner: ModelRunner | GenericRunner, row: int) -> bool:
    """Whether `runner` held `row` (it finished while the batch went on: its K/V stopped advancing, its recurrent
    states did not)."""
    held = getattr(getattr(runner, "cache", None), "held", None)
    return held is not None and bool(held[row])


def _compare(seq, ref_seq, ref_logits, prompt_len, tie_tolerance, report, what) -> int:
    """Token-compare one output with the reference; returns the number of tie flips found."""
    flips = 0
    if seq.shape == ref_seq.shape and torch.equal(seq, ref_seq):
        report.tokens_compared += int(seq[:, prompt_len:].numel())
        return 0
    for r in range(ref_seq.shape[0]):
        a, b = seq[r, prompt_len:].tolist(), ref_seq[r, prompt_len:].tolist()
        for i in range(max(len(a), len(b))):
            ta = a[i] if i < len(a) else None
            tb = b[i] if i < len(b) else None
            if ta == tb:
                report.tokens_compared += 1
                continue
            gap, scale = float("inf"), 1.0
            if ref_logits is not None and i < ref_logits.shape[1]:
                top2 = ref_logits[r, i].double().topk(2).values
                gap, scale = float(top2[0] - top2[1]), max(1.0, abs(float(top2[0])))  # rounding is relative
            if gap >= tie_tolerance * scale or ta is None or tb is None:
                raise EquivalenceError(
                    f"{what} output differs from HF greedy at row {r}, new token {i}: {ta} vs {tb} "
                    f"(reference top-2 gap {gap:.3g}, tie tolerance {tie_tolerance})"
                )
            flips += 1
            report.tie_flips += 1
            break
    return flips
