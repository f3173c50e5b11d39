"""Lossless speculative sampling: the joint distribution of the first sampled tokens equals HF's own sampling,
by a two-sample chi-square test over thousands of samples (16-token vocabulary, float64), for chains and
trees, n-gram and draft-model drafters, with and without warpers. The same suite shows the test detects a
biased sampler. Profiles: `ci` draws 3,000 samples per side, `thorough` (SSMSPEC_SAMPLES) more."""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency

import ssmspec
import ssmspec.speculate.engine as engine
from ssmspec import SpecConfig
from ssmspec.speculate.verify import _children
from ssmspec.testing.configs import build_tiny_model

SAMPLES = int(os.environ.get("SSMSPEC_SAMPLES", "3000"))
ALPHA = 1e-3  # the runs are seeded: a pass or a failure is reproducible, not a flake
VOCAB = 16
SEED_PROMPT = torch.tensor([[3, 4, 5, 3, 4, 5]])
PROMPT = SEED_PROMPT  # replaced by the fixture: the seed plus the target's greedy continuation


def _model(noise: float = 0.0):
    """The target (noise 0), or a draft that agrees with it only in part (its head perturbed)."""
    model = build_tiny_model("mamba2", vocab_size=VOCAB, seed=0)
    with torch.no_grad():  # peaked but varied distributions (top probability 0.4-0.95): drafts are accepted
        model.lm_head.weight.mul_(4.0)  # and rejected
        w = model.lm_head.weight
        w.add_(noise * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(1), dtype=w.dtype))
    return model


@pytest.fixture(scope="module")
def models():
    global PROMPT
    target = _model()
    # the prompt continues as the target likes to, with repeats: n-gram drafts (chains, and trees where a
    # context was followed by several tokens) are often but not always accepted
    greedy = target.generate(SEED_PROMPT, do_sample=False, max_new_tokens=45, eos_token_id=None)[0]
    eos = target.generation_config.eos_token_id
    # cut where the greedy continuation runs on for 4 tokens without EOS (EOS stays possible, not dominant)
    cut = next(n for n in range(32, 41) if eos not in greedy[n : n + 4].tolist())
    PROMPT = greedy[None, :cut]
    return target, ssmspec.transform(copy.deepcopy(target)), _model(noise=0.7)


DRAFTERS = {
    "ngram-chain": ({"prompt_lookup_num_tokens": 3}, False),
    "ngram-tree": ({"speculation": SpecConfig(tree=True, tree_budget=6, num_draft_tokens=3)}, False),
    "draft-chain": ({"speculation": SpecConfig(drafter="draft_model", num_draft_tokens=3)}, True),
    "draft-tree": ({"speculation": SpecConfig(drafter="draft_model", tree=True, tree_budget=6, num_draft_tokens=2)},
                   True),
}  # fmt: skip
WARPS = {"t1": {"temperature": 1.0, "top_k": 0}, "t0.7-topk-topp": {"temperature": 0.7, "top_k": 6, "top_p": 0.9}}


def _counts(sequences: torch.Tensor, n: int = 3) -> Counter:
    return Counter(tuple(row) for row in sequences[:, PROMPT.shape[1] : PROMPT.shape[1] + n].tolist())


def _p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity; cells seen fewer than 10 times in all are pooled."""
    cells = sorted(set(a) | set(b))
    kept = [c for c in cells if a[c] + b[c] >= 10]
    rest = [c for c in cells if a[c] + b[c] < 10]
    table = [[x[c] for c in kept] + [sum(x[c] for c in rest)] for x in (a, b)]
    table = [[r0, r1] for r0, r1 in zip(*table) if r0 + r1 > 0]
    return float(chi2_contingency(list(zip(*table)))[1])


def _hf(target, warp, seed=0):
    torch.manual_seed(seed)
    ids = PROMPT.expand(SAMPLES, -1)
    return target.generate(ids, do_sample=True, max_new_tokens=4, **warp)


def _spec(model, draft, drafter, warp, seed=1):
    kwargs, uses_draft = DRAFTERS[drafter]
    ids = PROMPT.expand(SAMPLES, -1)
    extra = {"assistant_model": draft} if uses_draft else {}
    out = model.generate(ids, do_sample=True, max_new_tokens=4, generator=torch.Generator().manual_seed(seed),
                         return_dict_in_generate=True, **kwargs, **extra, **warp)  # fmt: skip
    return out.sequences, out.spec_stats


@pytest.mark.parametrize("warp", sorted(WARPS))
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_speculative_sampling_matches_hf_sampling(models, drafter, warp):
    target, model, draft = models
    want = _counts(_hf(target, WARPS[warp]))
    got, stats = _spec(model, draft, drafter, WARPS[warp])
    assert stats["accepted_tokens"] > SAMPLES // 10, "drafts were (almost) never accepted: the test shows nothing"
    assert stats["accepted_tokens"] < stats["row_steps"] * 2, "everything accepted: rejections went untested"
    p = _p_value(_counts(got), want)
    assert p > ALPHA, f"{drafter} {warp}: chi-square p = {p:.2e}"


def _accept_every_draft(tree, scores, q, generator=None, rows=None):
    """A wrong verifier: follows the first child all the way down, then samples the bonus token."""
    probs = scores.double().softmax(-1)
    ok, parents, tokens = tree.acceptable.tolist(), tree.parents.tolist(), tree.tokens.tolist()
    last, emitted = [], []
    for b in range(tree.batch_size):
        if rows is not None and not rows[b]:
            last.append(0)
            emitted.append([])
            continue
        kids, cur, out = _children(tree, b, ok, parents), 0, []
        while cur in kids:
            cur = kids[cur][0]
            out.append(tokens[b][cur])
        out.append(int(torch.multinomial(probs[b, cur], 1, generator=generator)))
        last.append(cur)
        emitted.append(out)
    return torch.tensor(last), emitted


def _no_residual(tree, scores, q, generator=None, rows=None):
    """A subtly wrong verifier: accepts a deterministic draft with probability p(x), but on rejection samples
    from p instead of p with x removed (x is then over-represented)."""
    probs = scores.double().softmax(-1)
    ok, parents, tokens = tree.acceptable.tolist(), tree.parents.tolist(), tree.tokens.tolist()
    last, emitted = [], []
    for b in range(tree.batch_size):
        if rows is not None and not rows[b]:
            last.append(0)
            emitted.append([])
            continue
        kids, cur, out = _children(tree, b, ok, parents), 0, []
        while True:
            p = probs[b, cur]
            child = kids.get(cur, [None])[0]
            if (
                child is not None
                and float(torch.rand((), generator=generator, dtype=torch.float64)) < p[tokens[b][child]]
            ):
                cur = child
                out.append(tokens[b][cur])
                continue
            out.append(int(torch.multinomial(p, 1, generator=generator)))
            break
        last.append(cur)
        emitted.append(out)
    return torch.tensor(last), emitted


@pytest.mark.parametrize("wrong", [_accept_every_draft, _no_residual])
def test_the_test_detects_a_biased_sampler(models, monkeypatch, wrong):
    target, model, draft = models
    want = _counts(_hf(target, WARPS["t1"]))
    monkeypatch.setattr(engine, "sample_verify", wrong)
    got, _ = _spec(model, draft, "ngram-chain", WARPS["t1"])
    assert _p_value(_counts(got), want) < ALPHA


def test_the_test_accepts_hf_against_itself(models):
    target, _, _ = models
    assert _p_value(_counts(_hf(target, WARPS["t1"], seed=0)), _counts(_hf(target, WARPS["t1"], seed=7))) > ALPHA


def test_same_seed_same_output_and_hf_style_options(models):
    target, model, draft = models
    ids = PROMPT.expand(3, -1)
    runs = [model.generate(ids, do_sample=True, max_new_tokens=12, prompt_lookup_num_tokens=3,
                           generator=torch.Generator().manual_seed(9)) for _ in range(2)]  # fmt: skip
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(4)
    a = model.generate(ids, do_sample=True, max_new_tokens=12, prompt_lookup_num_tokens=3)
    torch.manual_seed(4)
    b = model.generate(ids, do_sample=True, max_new_tokens=12, prompt_lookup_num_tokens=3)
    assert torch.equal(a, b)
    several = model.generate(PROMPT, do_sample=True, num_return_sequences=4, max_new_tokens=5,
                             prompt_lookup_num_tokens=3)  # fmt: skip
    assert several.shape == (4, PROMPT.shape[1] + 5) and torch.equal(
        several[:, : PROMPT.shape[1]], PROMPT.expand(4, -1)
    )
    out = model.generate(ids, do_sample=True, max_new_tokens=6, assistant_model=draft, output_scores=True,
                         return_dict_in_generate=True, top_k=4)  # fmt: skip
    assert len(out.scores) == out.sequences.shape[1] - ids.shape[1]
    eos = target.generation_config.eos_token_id
    for step, scores in enumerate(out.scores):  # each sampled token was allowed by top-k
        new = out.sequences[:, ids.shape[1] : ids.shape[1] + step]
        running = ~(new == eos).any(-1)  # rows that had not finished: later tokens are pads, as in HF
        chosen = out.sequences[:, ids.shape[1] + step]
        assert torch.isfinite(scores.gather(1, chosen[:, None]))[running].all()
        assert (torch.isfinite(scores).sum(-1) <= 4).all()
