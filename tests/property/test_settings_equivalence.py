"""Property suite, generation settings: with HF's logits processors and stopping criteria drawn at random,
speculative generate (n-gram chains and trees) == HF generate(do_sample=False) with the same settings, token
for token, for every supported family (float64)."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st
from transformers import StoppingCriteria, StoppingCriteriaList

import ssmspec
from ssmspec import SpecConfig
from ssmspec.testing.configs import SUPPORTED_FAMILIES
from ssmspec.testing.strategies import cached_tiny_model, capabilities, prompts

EXAMPLES = 20 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 5


@functools.cache
def _transformed(family: str):
    return ssmspec.transform(copy.deepcopy(cached_tiny_model(family)))


class StopAfter(StoppingCriteria):
    """Stops a row right after it emits `token` (a pure function of the ids)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@st.composite
def settings_for(draw, greedy: list[int], vocab: int) -> dict:
    """Processor and stopping settings, built around tokens the model really emits (so that they bite)."""
    seen = st.sampled_from(greedy)
    out = {}
    if draw(st.booleans()):
        out["repetition_penalty"] = draw(st.sampled_from([0.7, 1.3, 2.0]))
    if draw(st.booleans()):
        out["no_repeat_ngram_size"] = draw(st.integers(1, 3))
    if draw(st.booleans()):
        out["bad_words_ids"] = [[draw(seen)]]
    if draw(st.booleans()):
        out["sequence_bias"] = {(draw(seen),): draw(st.sampled_from([-5.0, 5.0]))}
    if draw(st.booleans()):
        out["suppress_tokens"] = [draw(seen)]
    if draw(st.booleans()):
        out["eos_token_id"] = draw(seen)
        out["min_new_tokens"] = draw(st.integers(0, 6))
    if draw(st.booleans()):
        out["stopping_criteria"] = StoppingCriteriaList([StopAfter(draw(seen))])
    return out


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_settings_apply_exactly_as_in_hf(family, data):
    ref = cached_tiny_model(family)
    model = _transformed(family)
    caps = capabilities(family)
    vocab = ref.config.get_text_config().vocab_size
    ids, mask = data.draw(prompts(vocab, max_batch=2 if caps.batches else 1), label="prompt")
    max_new = data.draw(st.integers(2, 10), label="max_new_tokens")
    greedy = ref.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False)
    kwargs = data.draw(settings_for(greedy[:, ids.shape[1] :].flatten().tolist(), vocab), label="settings")
    tree = caps.trees and data.draw(st.booleans(), label="tree")
    spec = SpecConfig(
        tree=tree, tree_budget=data.draw(st.integers(1, 8)), num_draft_tokens=data.draw(st.integers(1, 5))
    )
    note(f"kwargs={kwargs} spec={spec}")
    if "stopping_criteria" in kwargs and ids.shape[0] > 1 and "eos_token_id" not in kwargs:
        kwargs["eos_token_id"] = 2  # a stopped row of a batch is padded only with an EOS token (as in HF)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, **copy.deepcopy(kwargs))
    got = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, speculation=spec, **kwargs)
    assert torch.equal(got, want)
