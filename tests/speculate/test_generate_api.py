"""The HF-style API on a transformed model: every speculation entry point equals HF greedy, and bad
arguments raise clear errors before generating."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import ssmspec
from ssmspec import SpecConfig, VocabMismatchError
from ssmspec.testing.configs import build_tiny_transformer
from ssmspec.testing.strategies import cached_tiny_model


def _pair(family: str, seed: int = 0):
    ref = cached_tiny_model(family, 0, torch.float64, seed)
    return ref, ssmspec.transform(copy.deepcopy(ref))


def _batch():
    g = torch.Generator().manual_seed(7)
    motif = torch.randint(3, 96, (4,), generator=g)
    ids = torch.stack([motif.repeat(3), torch.randint(3, 96, (12,), generator=g)])
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    return ids, mask


@pytest.mark.parametrize("family", ["mamba2", "bamba", "qwen3_next"])
def test_every_entry_point_equals_hf_greedy(family):
    ref, model = _pair(family)
    ids, mask = _batch()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want)
    for spec in (
        SpecConfig(tree=True, tree_budget=12, num_draft_tokens=5),
        SpecConfig(commit="materialize"),
        SpecConfig(drafter="none"),
    ):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=10, speculation=spec), want)
    ssm_draft = cached_tiny_model("mamba2", 0, torch.float64, 1)
    for draft in (ssm_draft, build_tiny_transformer()):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=10, assistant_model=copy.deepcopy(draft))
        assert torch.equal(got, want)


def test_draft_model_that_is_the_target_accepts_everything():
    ref, model = _pair("mamba2")
    ids, mask = _batch()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        assistant_model=copy.deepcopy(ref),
        speculation=ssmspec.SpecConfig(drafter="draft_model", num_draft_tokens=4, tree=False, adaptive=False),
        return_dict_in_generate=True,
    )
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, want)
    stats = out.spec_stats
    assert stats["mean_accepted_per_step"] == pytest.approx(5.0, abs=1.5)  # 4 drafts + bonus, minus the tail
    assert stats["verify_steps"] <= 4


def test_return_dict_has_spec_stats():
    _, model = _pair("mamba2")
    ids, mask = _batch()
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=3, return_dict_in_generate=True
    )
    for key in ("verify_steps", "accepted_tokens", "mean_accepted_per_step", "tree_nodes_per_step"):
        assert key in out.spec_stats
    assert len(out.spec_stats["tree_nodes_per_step"]) == out.spec_stats["verify_steps"]
    assert out.sequences.shape == (2, ids.shape[1] + 8)


def test_edge_cases_behave_as_hf():
    ref, model = _pair("bamba")
    ids, mask = _batch()
    with pytest.raises(ValueError, match="max_new_tokens"):
        ref.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids, max_new_tokens=0, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="non-empty"):
        model.generate(ids[:, :0], max_new_tokens=3, prompt_lookup_num_tokens=3)
    all_pad = mask.clone()
    all_pad[1] = 0
    want = ref.generate(ids, attention_mask=all_pad, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, attention_mask=all_pad, max_new_tokens=5, prompt_lookup_num_tokens=3), want)
    long_ids = torch.randint(3, 96, (1, ref.config.max_position_embeddings))
    want = ref.generate(long_ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(model.generate(long_ids, max_new_tokens=3, prompt_lookup_num_tokens=3), want)
    want = ref.generate(ids, attention_mask=mask, max_length=ids.shape[1] + 4, do_sample=False)
    got = model.generate(ids, attention_mask=mask, max_length=ids.shape[1] + 4, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)


def test_bad_arguments_raise_clear_errors():
    _, model = _pair("mamba2")
    ids, mask = _batch()
    with pytest.raises(ValueError, match="beam"):
        model.generate(ids, num_beams=2, max_new_tokens=3, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="guidance_scale"):
        model.generate(ids, guidance_scale=1.5, max_new_tokens=3, prompt_lookup_num_tokens=3)
    with pytest.raises(TypeError, match="generator"):
        model.generate(ids, do_sample=True, generator=3, max_new_tokens=3, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="does not take"):
        model.generate(ids, max_new_tokens=3, prompt_lookup_num_tokens=3, not_an_argument=1)
    with pytest.raises(VocabMismatchError, match="vocab_size 50"):
        model.generate(ids, max_new_tokens=3, assistant_model=build_tiny_transformer(vocab_size=50))
    with pytest.raises(ValueError, match="commit strategy|SpecConfig.commit"):
        SpecConfig(commit="gather-everything")
    with pytest.raises(ValueError, match="drafter"):
        SpecConfig(drafter="magic")


def test_transform_with_a_default_spec_config_speculates_by_default():
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref), SpecConfig(tree=True, num_draft_tokens=3))
    ids, mask = _batch()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True)
    assert out.spec_stats is not None  # went through speculation
    assert torch.equal(out.sequences, ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))


def test_assistant_model_is_never_changed():
    """generate(assistant_model=d) used to transform the user's draft in place."""
    ref, model = _pair("mamba2")
    draft = copy.deepcopy(cached_tiny_model("mamba2", 0, torch.float64, 1))
    cls, attrs = type(draft), set(draft.__dict__)
    params = {k: v.clone() for k, v in draft.state_dict().items()}
    ids, mask = _batch()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for _ in range(2):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8, assistant_model=draft), want)
    assert type(draft) is cls and set(draft.__dict__) == attrs
    assert all("forward" not in m.__dict__ for m in draft.modules())
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in params.items())
    assert torch.equal(draft.generate(ids, max_new_tokens=4), draft.generate(ids, max_new_tokens=4))


@pytest.mark.parametrize(
    "kwargs,error",
    [({"num_draft_tokens": "8"}, TypeError), ({"num_draft_tokens": 2.5}, TypeError), ({"tree": "no"}, TypeError),
     ({"tree_budget": True}, TypeError), ({"drafter": 3}, TypeError), ({"commit": None}, TypeError),
     ({"num_draft_tokens": -1}, ValueError), ({"max_matching_ngram_size": 0}, ValueError)],
)  # fmt: skip
def test_spec_config_checks_types_and_values(kwargs, error):
    field = next(iter(kwargs))
    with pytest.raises(error, match=f"SpecConfig.{field}"):
        SpecConfig(**kwargs)


@pytest.mark.parametrize("speculation", ["tree", {"tree": True}, 8])
def test_speculation_must_be_a_spec_config(speculation):
    _, model = _pair("mamba2")
    ids, mask = _batch()
    with pytest.raises(TypeError, match="SpecConfig"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, speculation=speculation)
    with pytest.raises(TypeError, match="SpecConfig"):
        ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2")), speculation)


def test_near_ties_are_counted_in_spec_stats():
    """A bf16 user sees where a flip could occur: emitted tokens whose top-2 logit gap is within a few ulps."""
    ref = copy.deepcopy(cached_tiny_model("mamba2"))
    ids, mask = _batch()
    model = ssmspec.transform(copy.deepcopy(ref))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=3,
                         return_dict_in_generate=True)  # fmt: skip
    assert out.spec_stats["near_ties"] == 0 and 0 < out.spec_stats["near_tie_tolerance"] < 1e-14
    with torch.no_grad():  # every token gets the same logit: every step is an exact tie
        ref.lm_head.weight[:] = ref.lm_head.weight[5].clone()
    model = ssmspec.transform(copy.deepcopy(ref))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=3,
                         return_dict_in_generate=True)  # fmt: skip
    assert out.spec_stats["near_ties"] == out.spec_stats["emitted_tokens"] == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_near_ties_match_the_top_two_of_topk(dtype):
    """`near_ties` finds the runner-up with reductions (fused in compiled steps): the same verdicts as topk's top two,
    with exact ties (a repeated top value), near ties, -inf logits and random rows."""
    from ssmspec.speculate.ties import near_ties

    g = torch.Generator().manual_seed(0)
    verdicts = set()
    for trial in range(60):
        x = torch.randn(2, 3, 257, generator=g).to(dtype)
        top, first = x.max(-1)
        other = (first + 1 + trial) % x.shape[-1]
        if trial % 3 == 0:  # an exact tie at another position
            x.scatter_(-1, other[..., None], top[..., None])
        elif trial % 3 == 1:  # a gap of one ulp-sized step
            x.scatter_(-1, other[..., None], (top - torch.finfo(dtype).eps * top.abs())[..., None])
        if trial % 4 == 0:
            x[..., 7] = float("-inf")
        want = x.float().topk(2, dim=-1).values
        want = (want[..., 0] - want[..., 1]) < 1e-3 * want[..., 0].abs().clamp(min=1.0)
        got = near_ties(x, 1e-3)
        assert torch.equal(got, want), trial
        verdicts.update(got.flatten().tolist())
    assert verdicts == {True, False}


def test_generate_speculates_by_default_and_false_is_hfs_own():
    ref, model = _pair("mamba2")
    ids, mask = _batch()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert out.spec_stats["verify_steps"] > 0  # no speculation kwarg: speculative all the same
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True,
                           speculation=False)  # fmt: skip
    assert torch.equal(plain.sequences, want) and not hasattr(plain, "spec_stats")
    with pytest.raises(ValueError, match="speculation=False"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, speculation=False, prompt_lookup_num_tokens=3)


def test_a_default_call_speculation_cannot_run_is_hfs_own_and_an_asked_one_raises():
    ref, model = _pair("mamba2")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    beams = ref.generate(ids, max_new_tokens=6, num_beams=2, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=6, num_beams=2), beams)  # beam search: HF's own
    for asked in ({"speculation": True}, {"prompt_lookup_num_tokens": 3}):
        with pytest.raises(ssmspec.UnsupportedSettingError, match="num_beams"):
            model.generate(ids, max_new_tokens=6, num_beams=2, **asked)
    ids2, mask = _batch()
    limited = copy.deepcopy(model)
    limited.ssmspec_info.batches = False  # as the probe leaves a model whose batches are inexact
    limited.ssmspec_info.limits["batches"] = "layer 0 (made up here)"
    want = ref.generate(ids2, attention_mask=mask, max_new_tokens=6, do_sample=False)
    out = limited.generate(ids2, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want) and not hasattr(out, "spec_stats")
    with pytest.raises(ssmspec.UnsupportedModelError):
        limited.generate(ids2, attention_mask=mask, max_new_tokens=6, speculation=True)


def test_the_defaults_for_each_kind_of_call():
    from transformers import GenerationConfig

    from ssmspec.speculate.defaults import spec_for

    default = spec_for(None, GenerationConfig(), None)
    assert default == SpecConfig(drafter="prompt_lookup", tree=True, num_draft_tokens=8, tree_budget=16)
    assert default.tree and default.adaptive
    lookup = spec_for(None, GenerationConfig(prompt_lookup_num_tokens=4, max_matching_ngram_size=3), None)
    assert (lookup.num_draft_tokens, lookup.tree_budget, lookup.max_matching_ngram_size) == (4, 8, 3)
    assert lookup.tree and lookup.adaptive
    draft = object()
    d = spec_for(None, GenerationConfig(), draft)
    assert (d.drafter, d.num_draft_tokens, d.tree_budget, d.tree, d.adaptive) == ("draft_model", 4, 12, True, True)
    set_depth = {"user_set": frozenset({"num_assistant_tokens"})}  # (hf.generation.Plan.user_set)
    assert spec_for(None, GenerationConfig(num_assistant_tokens=3), draft, **set_depth).num_draft_tokens == 3
    heuristic = spec_for(None, GenerationConfig(num_assistant_tokens_schedule="heuristic"), draft)
    assert not heuristic.tree and not heuristic.adaptive  # HF's schedule decides the depth of HF's chains
    assert not spec_for(None, GenerationConfig(), None, trees=False).tree  # chains where trees are inexact
    given = SpecConfig(drafter="prompt_lookup", tree=False, num_draft_tokens=6, tree_budget=10)
    assert spec_for(given, GenerationConfig(prompt_lookup_num_tokens=4), None) is given  # (sizes given: kept)
    # drafter "auto": the model's draft head where it has one (budgets of their own), n-gram lookup without one
    assert spec_for(SpecConfig(tree=False, num_draft_tokens=6, tree_budget=10), GenerationConfig(), None) == given
    # sizes left None: the ones measured for the drafter the call runs, also where the drafter is named
    assert spec_for(SpecConfig(tree=False), GenerationConfig(), None) == replace(given, num_draft_tokens=8,
                                                                                   tree_budget=16)  # fmt: skip
    named = spec_for(SpecConfig(drafter="draft_head"), GenerationConfig(), None)
    assert (named.num_draft_tokens, named.tree_budget) == (8, 24)
    named = spec_for(SpecConfig(drafter="draft_head", num_draft_tokens=5), GenerationConfig(), None, sampling=True)
    assert (named.num_draft_tokens, named.tree_budget) == (5, 4)  # (a head's sampling default: a chain 4 deep)
    # an MTP layer (named, or a head that is one): greedy the head's tree; sampling 3 deep, 3 branches
    for kw in ({"speculation": SpecConfig(drafter="mtp")}, {"speculation": SpecConfig(drafter="draft_head"),
                                                            "head_kind": "mtp"}):  # fmt: skip
        kw = {"config": GenerationConfig(), "draft": None, **kw}
        assert (spec_for(**kw).num_draft_tokens, spec_for(**kw).tree_budget) == (8, 24)
        assert (spec_for(**kw, sampling=True).num_draft_tokens, spec_for(**kw, sampling=True).tree_budget) == (3, 9)
    mtp = spec_for(None, GenerationConfig(), None, head=True, sampling=True, head_kind="mtp")
    assert (mtp.drafter, mtp.num_draft_tokens, mtp.tree_budget, mtp.adaptive) == ("mtp", 3, 9, True)
    assert spec_for(None, GenerationConfig(), None, head=True, head_kind="mtp").drafter == "mtp"
    # a model whose MTP layer "auto" does not draft with (too large) drafts n-grams
    assert spec_for(None, GenerationConfig(), None, head=False, head_kind="mtp").drafter == "prompt_lookup"
    named = spec_for(SpecConfig(drafter="draft_model"), GenerationConfig(), object())
    assert (named.num_draft_tokens, named.tree_budget) == (4, 12)
    # `tree` left unset follows the model (chains where its trees were found inexact); set, it is kept
    assert spec_for(SpecConfig(num_draft_tokens=4), GenerationConfig(), None, trees=False).tree is False
    assert spec_for(SpecConfig(tree=True), GenerationConfig(), None, trees=False).tree is True
    # drafter "auto" takes the call's draft model (it was refused: "does not use it")
    auto = spec_for(SpecConfig(adaptive=False), GenerationConfig(), object())
    assert auto.drafter == "draft_model" and not auto.adaptive
    head = spec_for(None, GenerationConfig(), None, head=True)
    assert (head.drafter, head.tree_budget, head.num_draft_tokens, head.adaptive) == ("draft_head", 24, 8, True)
    sampled = spec_for(None, GenerationConfig(), None, head=True, sampling=True)
    assert (sampled.drafter, sampled.tree_budget, sampled.num_draft_tokens) == ("draft_head", 4, 4)
    assert spec_for(None, GenerationConfig(prompt_lookup_num_tokens=4), None, head=True).tree_budget == 12
    assert spec_for(SpecConfig(recycle=4), GenerationConfig(), None, head=True).drafter == "prompt_lookup"
    assert spec_for(None, GenerationConfig(), object(), head=True).drafter == "draft_model"


@pytest.mark.parametrize("do_sample", [False, True])
def test_an_eager_call_returns_ordinary_tensors_and_leaves_the_model_as_hf_uses_it(do_sample):
    """An eager call runs under inference mode: what it returns is ordinary tensors (updated in place without error,
    as HF's outputs), and nothing of the model is left an inference tensor, so HF's own generate and training run on
    it afterwards."""
    ref, model = _pair("bamba")
    ids, mask = _batch()
    kw = {"do_sample": do_sample, "max_new_tokens": 8, "return_dict_in_generate": True, "output_scores": True,
          "output_logits": True, "pad_token_id": 0}  # fmt: skip
    out = model.generate(ids, attention_mask=mask, generator=torch.Generator().manual_seed(0), **kw)
    assert out.spec_stats["verify_steps"] > 0
    tensors = [out.sequences, *out.scores, *out.logits]
    assert not any(t.is_inference() for t in tensors)
    out.sequences[:, -1] = 0
    out.scores[0].add_(1.0)
    if not do_sample:
        assert torch.equal(model.generate(ids, attention_mask=mask, **kw).sequences,
                           ref.generate(ids, attention_mask=mask, **kw).sequences)  # fmt: skip
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])
    hf = model.generate(ids, attention_mask=mask, speculation=False, **kw)  # HF's own generate on the same model
    assert not hf.sequences.is_inference()
    loss = model(ids, attention_mask=mask).logits.float().pow(2).mean()
    loss.backward()  # (autograd works on it as before)
    assert next(p for p in model.parameters() if p.grad is not None) is not None
