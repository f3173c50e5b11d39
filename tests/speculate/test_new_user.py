"""What a new user runs into, each with a clear error or a bounded run: draft sizes, arguments of the wrong kind,
a missing prompt, a model transformed twice, a draft head through save_pretrained, chain-only models, flat drafts."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import ssmspec
from ssmspec import SpecConfig, UnsupportedModelError
from ssmspec.speculate.config import MAX_DRAFT_NODES
from ssmspec.testing.strategies import cached_tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])


@pytest.fixture(scope="module")
def pair():
    ref = cached_tiny_model("mamba2")
    return ref, ssmspec.transform(copy.deepcopy(ref))


@pytest.mark.parametrize("field", ["num_draft_tokens", "tree_budget"])
def test_draft_sizes_beyond_what_a_step_can_use_are_refused_by_name(field):
    for value in (MAX_DRAFT_NODES + 1, 10**6):
        with pytest.raises(ValueError, match=f"SpecConfig.{field} must be between"):
            SpecConfig(**{field: value})
    SpecConfig(**{field: MAX_DRAFT_NODES})


def test_huge_hf_draft_depths_run_bounded_and_bad_ones_are_named(pair):
    """HF's own kwargs take any positive depth (HF drafts no deeper than the tokens left): so does a call here, and a
    step allocates nothing for nodes that cannot exist; a depth below 1 is refused under its own name."""
    ref, model = pair
    want = ref.generate(IDS, max_new_tokens=8, do_sample=False)
    t0 = time.perf_counter()
    out = model.generate(IDS, max_new_tokens=8, prompt_lookup_num_tokens=10**6, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want) and time.perf_counter() - t0 < 60
    assert max(out.spec_stats["tree_nodes_per_step"]) <= 8  # at most what 7 tokens left can use, and the root
    assert sorted(model._ssmspec_calibration[(1, "cpu")].sizes)[-1] <= 64  # nothing measured for absent nodes
    for bad in (-1, 0, 2.5):
        with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be a positive int"):
            model.generate(IDS, max_new_tokens=4, prompt_lookup_num_tokens=bad)


def test_a_deep_config_drafts_no_deeper_than_its_budget(pair):
    """num_draft_tokens=1024 with the default budget of 16 nodes priced 1,024 levels every step (33x slower than the
    default): a tree of 16 nodes is no deeper than 16."""
    ref, model = pair
    want = ref.generate(IDS, max_new_tokens=24, do_sample=False)
    out = model.generate(IDS, max_new_tokens=24, speculation=SpecConfig(num_draft_tokens=1024),
                         return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, want) and max(out.spec_stats["tree_nodes_per_step"]) <= 17


def test_arguments_of_the_wrong_kind_are_named(pair):
    _, model = pair
    with pytest.raises(TypeError, match="assistant_model= must be a causal LM model object"):
        model.generate(IDS, max_new_tokens=4, assistant_model="mamba2-draft")
    with pytest.raises(ssmspec.UnsupportedSettingError, match="inputs_embeds"):
        model.generate(inputs_embeds=torch.zeros(1, 3, 32), max_new_tokens=4, speculation=True)


def test_generate_without_a_prompt_starts_from_bos_as_hf_does(pair):
    ref, model = pair
    want = ref.generate(max_new_tokens=6, do_sample=False)
    assert want.shape == (1, 7) and torch.equal(model.generate(max_new_tokens=6, prompt_lookup_num_tokens=3), want)
    no_bos = copy.deepcopy(model)
    no_bos.generation_config.bos_token_id = None
    no_bos.config.bos_token_id = None
    with pytest.raises(ValueError, match="no input_ids, and the model has no bos_token_id"):
        no_bos.generate(max_new_tokens=4, speculation=True)


def test_transforming_again_keeps_what_is_not_given(pair):
    """transform(m, SpecConfig(...)) then transform(m) dropped the first config (and a head attached by hand, and
    prepack=False): what a second transform leaves out stays as it was; what it gives changes."""
    from ssmspec import linear
    from ssmspec.speculate.drafters.head import DraftHead

    ref, _ = pair
    config = SpecConfig(num_draft_tokens=3)
    head = DraftHead.for_model(ref)
    model = ssmspec.transform(copy.deepcopy(ref).float(), config, draft_head=head, prepack=False)
    again = ssmspec.transform(model)
    assert again is model and model.ssmspec_config is config and model.__dict__["ssmspec_draft_head"] is head
    assert not linear.is_packed(model)
    other = SpecConfig(num_draft_tokens=5)
    ssmspec.transform(model, other, draft_head=None)
    assert model.ssmspec_config is other and model.__dict__["ssmspec_draft_head"] is None


def test_save_pretrained_keeps_the_draft_head_beside_the_weights(tmp_path):
    """A transformed model saved and loaded again is transformed with its head (it fell from 2.25 to 1.07 tokens per
    step on the embedded target, silently)."""
    from transformers import AutoModelForCausalLM

    from ssmspec import models
    from ssmspec.speculate.drafters.head import DraftHead

    model = ssmspec.transform(models.load("mamba2-target")[0])
    head = model.__dict__["ssmspec_draft_head"]
    assert head is not None and head.about.get("trained_on")
    model.save_pretrained(tmp_path)
    again = ssmspec.transform(AutoModelForCausalLM.from_pretrained(tmp_path))
    loaded = again.__dict__["ssmspec_draft_head"]
    assert loaded is not None and loaded.about == head.about
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    assert DraftHead.load(tmp_path).config == head.config


def test_a_chain_only_model_runs_chains_where_tree_is_unset_and_refuses_asked_trees_at_once(monkeypatch):
    """On a model whose trees the probe found inexact, a SpecConfig that does not set `tree` runs chains (it was
    refused: "use SpecConfig(tree=False)"); tree=True is refused before anything runs, whatever the drafts would have
    been (it used to be refused only where a step happened to branch)."""
    ref = cached_tiny_model("inkling2", 0)
    model = ssmspec.transform(copy.deepcopy(ref))
    assert not model.ssmspec_info.trees
    ids = torch.cat([IDS, IDS], dim=1)
    want = ref.generate(ids, max_new_tokens=10, do_sample=False)
    out = model.generate(ids, max_new_tokens=10, speculation=SpecConfig(num_draft_tokens=4))
    assert torch.equal(out, want)
    import ssmspec.speculate.generate as spec_generate

    def ran(*args, **kwargs):
        raise AssertionError("the loop ran")

    monkeypatch.setattr(spec_generate, "speculative_generate", ran)
    with pytest.raises(UnsupportedModelError, match="only chains"):
        model.generate(ids, max_new_tokens=10, speculation=SpecConfig(tree=True))


def test_a_flat_draft_falls_back_to_a_chain_and_says_so():
    """A draft whose distributions are flat reaches min_path_prob nowhere: its dynamic tree held no node and every step
    was a plain step, silently. Now it drafts its likeliest chain, counted in spec_stats["drafter"]."""
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    flat = copy.deepcopy(cached_tiny_model("mamba2", seed=1))
    with torch.no_grad():
        flat.get_output_embeddings().weight.mul_(1e-6)  # every token about 1/96 < min_path_prob
    want = ref.generate(IDS, max_new_tokens=12, do_sample=False)
    spec = SpecConfig(drafter="draft_model", adaptive=False, num_draft_tokens=3, tree_budget=6)
    out = model.generate(IDS, max_new_tokens=12, assistant_model=flat, speculation=spec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert max(out.spec_stats["tree_nodes_per_step"]) == 4  # a chain of three
    assert out.spec_stats["drafter"]["chain_fallbacks"] > 0
