"""transform(): supported families keep their plain behaviour; unsupported ones get a clear error."""

from __future__ import annotations

import copy

import pytest
import torch

import ssmspec
from ssmspec import UnsupportedModelError
from ssmspec.testing.configs import (
    SUPPORTED_FAMILIES,
    UNSUPPORTED_FAMILIES,
    build_tiny_model,
    build_tiny_transformer,
)
from ssmspec.testing.strategies import cached_tiny_model


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_transform_keeps_plain_forward_and_generate(family):
    ref = cached_tiny_model(family)
    model = ssmspec.transform(copy.deepcopy(ref))
    info = model.ssmspec_info
    assert info.mixers, "no mixer was rewritten"
    assert set(info.recurrent_layers) <= {getattr(model.get_submodule(p), "layer_idx", None) for p in info.mixers}
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)
    want = ref.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)  # HF's own path
    assert isinstance(model, type(ref)) and type(model).__name__ == type(ref).__name__


@pytest.mark.parametrize("family", UNSUPPORTED_FAMILIES)
def test_unsupported_family_names_the_module_and_is_left_as_it_was(family):
    """A refused transform used to leave the model mutated (class swapped, forwards patched)."""
    model = build_tiny_model(family)
    cls, attrs = type(model), set(model.__dict__)
    with pytest.raises(UnsupportedModelError) as err:
        ssmspec.transform(model)
    assert err.value.module_path and err.value.module_path in str(err.value) and err.value.reason
    assert type(model) is cls and set(model.__dict__) == attrs
    assert all("forward" not in m.__dict__ for m in model.modules())
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.generate(ids, max_new_tokens=3), build_tiny_model(family).generate(ids, max_new_tokens=3))


def test_transformer_without_state_is_accepted():
    """A plain transformer (e.g. as a draft model) needs no seams: only tree attention."""
    ref = build_tiny_transformer(layers=2, seed=0)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.randint(3, 96, (2, 6))
    want = ref.generate(ids, max_new_tokens=8, do_sample=False)
    got = model.generate(ids, max_new_tokens=8, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)


def test_flash_attention_is_refused():
    model = copy.deepcopy(cached_tiny_model("bamba"))
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(UnsupportedModelError, match="tree mask"):
        ssmspec.transform(model)


def test_transform_rejects_non_models():
    with pytest.raises(TypeError, match="causal LM"):
        ssmspec.transform(torch.nn.Linear(2, 2))


def test_torch_compiles_wrapper_is_refused_and_left_as_it_was():
    """`transform(torch.compile(model))` would transform through the wrapper's forwarded attributes and leave a model
    whose generate does not speculate: refused, naming what to do instead, the wrapped model untouched."""
    from ssmspec.transform import SpecGenerationMixin

    model = copy.deepcopy(cached_tiny_model("mamba2"))
    wrapper = torch.compile(model, backend="eager")
    with pytest.raises(TypeError, match=r"torch.compile\(model\).*compile=True"):
        ssmspec.transform(wrapper)
    assert not isinstance(model, SpecGenerationMixin) and "ssmspec_info" not in model.__dict__


def test_speculation_of_the_wrong_type_names_every_accepted_value():
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2")))
    with pytest.raises(TypeError, match=r"SpecConfig, True .*False .*None"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, speculation="tree")
