"""Lossless speculative sampling: the joint distribution of the first sampled tokens equals HF's own sampling,
by a two-sample chi-square test over thousands of samples (16-token vocabulary, float64), for chains and
trees, n-gram, draft-model and draft-head drafters, with and without warpers. The same suite shows the test detects a
biased sampler. With the `ci` profile 3,000 samples per side; with HYPOTHESIS_PROFILE=thorough 20,000 (or
SSMSPEC_SAMPLES)."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

import ssmspec
import ssmspec.speculate.step.accept as accept
from ssmspec import SpecConfig
from ssmspec.speculate.step.accept import walk_rows
from ssmspec.testing.configs import SUPPORTED_FAMILIES
from ssmspec.testing.distribution import (
    DRAFTS,
    WARPS,
    case_kwargs,
    chi_square_p_value,
    joint_counts,
    sampling_p_value,
    tiny_sampling_head,
    tiny_sampling_setup,
)
from ssmspec.testing.strategies import cached_tiny_model, capabilities

_THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
SAMPLES = int(os.environ.get("SSMSPEC_SAMPLES", "20000" if _THOROUGH else "3000"))
ALPHA = 1e-3  # the runs are seeded: a pass or a failure is reproducible, not a flake
VOCAB = 16
PROMPT = torch.zeros(1, 1, dtype=torch.long)  # set by the fixture (tiny_sampling_setup)


@functools.cache
def _transformed(family: str):
    return ssmspec.transform(copy.deepcopy(cached_tiny_model(family)))


@pytest.fixture(scope="module")
def models():
    global PROMPT
    target, draft, PROMPT = tiny_sampling_setup(VOCAB)
    return target, ssmspec.transform(copy.deepcopy(target), draft_head=tiny_sampling_head(target)), draft


def _p(models, drafter, warp):
    target, model, draft = models
    return sampling_p_value(target, model, PROMPT, samples=SAMPLES, **case_kwargs(drafter, warp, draft))


@pytest.mark.parametrize("warp", sorted(WARPS))
@pytest.mark.parametrize("drafter", sorted(DRAFTS))
def test_speculative_sampling_matches_hf_sampling(models, drafter, warp):
    p, stats = _p(models, drafter, warp)
    assert stats["accepted_tokens"] > SAMPLES // 10, "drafts were (almost) never accepted: the test shows nothing"
    assert stats["accepted_tokens"] < stats["row_steps"] * 2, "everything accepted: rejections went untested"
    assert p > ALPHA, f"{drafter} {warp}: chi-square p = {p:.2e}"


def _accept_every_draft(tree, scores, q, generator=None, rows=None):
    """A wrong verifier: follows the first child all the way down, then samples the bonus token."""
    probs = scores.double().softmax(-1)

    def walk(b, kids, tokens):
        cur, out = 0, []
        while cur in kids:
            cur = kids[cur][0]
            out.append(tokens[cur])
        return cur, out + [int(torch.multinomial(probs[b, cur], 1, generator=generator))]

    return walk_rows(tree, walk, rows)


def _no_residual(tree, scores, q, generator=None, rows=None):
    """A subtly wrong verifier: accepts a deterministic draft with probability p(x), but on rejection samples
    from p instead of p with x removed (x is then over-represented)."""
    probs = scores.double().softmax(-1)

    def walk(b, kids, tokens):
        cur, out = 0, []
        while True:
            p = probs[b, cur]
            child = kids.get(cur, [None])[0]
            if child is not None and float(torch.rand((), generator=generator, dtype=torch.float64)) < p[tokens[child]]:
                cur = child
                out.append(tokens[cur])
                continue
            return cur, out + [int(torch.multinomial(p, 1, generator=generator))]

    return walk_rows(tree, walk, rows)


@pytest.mark.parametrize("wrong", [_accept_every_draft, _no_residual])
def test_the_test_detects_a_biased_sampler(models, monkeypatch, wrong):
    monkeypatch.setattr(accept, "sample_accept", wrong)
    assert _p(models, "ngram-chain", "t1")[0] < ALPHA


def test_the_test_accepts_hf_against_itself(models):
    target = models[0]
    runs = []
    for seed in (0, 7):
        torch.manual_seed(seed)
        out = target.generate(PROMPT.expand(SAMPLES, -1), do_sample=True, max_new_tokens=3, **WARPS["t1"])
        runs.append(joint_counts(out, PROMPT.shape[1]))
    assert chi_square_p_value(*runs) > ALPHA


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


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_sampling_runs_on_every_family_with_processors_and_finished_rows(family):
    """Sampling through every family's tree path (trees where the probe allows them, level-aligned batches
    for slot-position models, a draft model of the same family), with a processor that reads the ids, EOS
    and scores: the output has HF's shape, finished rows are padded, sampled tokens were allowed."""
    ref = cached_tiny_model(family)
    model = _transformed(family)
    caps = capabilities(family)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6], [0, 0, 9, 8, 9, 8, 9, 8]])
    mask = (ids != 0).long()
    rows = slice(0, 2 if caps.batches else 1)
    ids, mask = ids[rows], mask[rows]
    for spec, extra in [(SpecConfig(tree=caps.trees, tree_budget=6, num_draft_tokens=3), {}),
                        (SpecConfig(drafter="draft_model", tree=caps.trees, tree_budget=4, num_draft_tokens=2),
                         {"assistant_model": ref})]:  # fmt: skip
        out = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=10, top_k=8, eos_token_id=4,
                             repetition_penalty=1.3, output_scores=True, return_dict_in_generate=True,
                             generator=torch.Generator().manual_seed(0), speculation=spec, **extra)  # fmt: skip
        new = out.sequences[:, ids.shape[1] :]
        assert len(out.scores) == new.shape[1] <= 10
        for r in range(new.shape[0]):
            row = new[r].tolist()
            end = row.index(4) + 1 if 4 in row else len(row)
            assert all(t == 0 for t in row[end:])  # pads after EOS
            for step in range(end):
                assert torch.isfinite(out.scores[step][r, row[step]])  # top-k allowed it
