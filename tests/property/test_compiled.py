"""Property suite, compiled: the default call (`model.generate` with no speculation argument), and plain decoding, of a
model whose steps are
captured and compiled whole (`transform(model, compile=True)` on a CPU) equals HF generate(do_sample=False), for every
family whose steps can be captured (float64, random prompts, batches where the probe found them exact, EOS from the
reference). Every model's compiled steps are kept between examples, so later examples replay steps that earlier ones
captured, over other prompts, lengths and batch sizes. The steps run as recorded graphs (StepCompiler without
Inductor's code generation): the same recording, inputs, outputs and replays, in seconds; tests/test_compiled_steps.py
compiles them with Inductor."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ssmspec
from ssmspec.compile.lower import StepCompiler
from ssmspec.testing.configs import _MOE_FAMILIES, SUPPORTED_FAMILIES
from ssmspec.testing.strategies import cached_tiny_model, capabilities, prompts

CAPTURED = [f for f in SUPPORTED_FAMILIES if f not in ("inkling", "inkling2")]  # (positions from cache slots)


@functools.cache
def _compiled(family: str, variant: int):
    """The reference model and a transformed copy whose default call runs on captured, compiled steps."""
    ref = cached_tiny_model(family, variant)
    if family in _MOE_FAMILIES:  # HF's eager experts read the host (which experts a batch routes to)
        ref = copy.deepcopy(ref)
        ref.set_experts_implementation("batched_mm")
    model = ssmspec.transform(copy.deepcopy(ref), ssmspec.SpecConfig(tree_budget=6, num_draft_tokens=3))
    model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    model.ssmspec_graphs = True
    return ref, model


@pytest.mark.parametrize("family", CAPTURED)
@settings(max_examples=6)
@given(data=st.data())
def test_compiled_default_call_equals_hf_greedy(family, data):
    variant = data.draw(st.integers(0, 2), label="variant")
    ref, model = _compiled(family, variant)
    caps = capabilities(family, variant)
    vocab = model.config.get_text_config().vocab_size
    ids, mask = data.draw(prompts(vocab, max_batch=3 if caps.batches else 1, allow_all_padding=False), label="prompt")
    max_new = data.draw(st.integers(1, 16), label="max_new_tokens")
    kwargs = {"attention_mask": mask, "max_new_tokens": max_new, "pad_token_id": 0}
    if data.draw(st.booleans(), label="eos from reference"):
        free = ref.generate(ids, do_sample=False, eos_token_id=None, **kwargs)
        new = free[:, ids.shape[1] :].flatten().tolist()
        kwargs["eos_token_id"] = new[data.draw(st.integers(0, len(new) - 1), label="eos index")]
    if data.draw(st.booleans(), label="plain decoding"):  # (its steps: back-to-back replays of the one-node step)
        kwargs["speculation"] = ssmspec.SpecConfig(drafter="none")
    out = model.generate(ids, **kwargs)
    kwargs.pop("speculation", None)
    want = ref.generate(ids, do_sample=False, **kwargs)
    assert torch.equal(out, want)
    assert model.__dict__.get("_ssmspec_workspaces")  # (its captured steps were kept for the next example)
