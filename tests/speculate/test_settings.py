"""Every GenerationConfig field is either applied exactly by speculative generate or refused by name: a setting
is never silently ignored. Behavioural: each field is set to a value that would matter, and the result must
equal HF's own generate with it, or be an UnsupportedSettingError naming the field."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import CompileConfig, WatermarkingConfig

import ssmspec
from ssmspec import SpecConfig, UnsupportedSettingError
from ssmspec.hf.generation import settings_table
from ssmspec.testing.strategies import cached_tiny_model

# a value per field that changes (or could change) HF's greedy output or its return type
SAMPLES = {
    "assistant_confidence_threshold": 0.9,
    "assistant_early_exit": 1,
    "assistant_ensemble_weight": 0.5,
    "assistant_lookbehind": 5,
    "bad_words_ids": [[7]],
    "begin_suppress_tokens": [7],
    "bos_token_id": 1,
    "cache_config": {"backend": "quanto"},
    "cache_implementation": "static",
    "compile_config": CompileConfig(),
    "constraints": ["not a constraint"],
    "continuous_batching_config": {"block_size": 4},
    "decoder_start_token_id": 0,
    "disable_compile": True,
    "diversity_penalty": 0.5,
    "do_sample": True,
    "dola_layers": "low",
    "early_stopping": True,
    "encoder_no_repeat_ngram_size": 2,
    "encoder_repetition_penalty": 1.5,
    "eos_token_id": 7,
    "epsilon_cutoff": 0.1,
    "eta_cutoff": 0.1,
    "exponential_decay_length_penalty": (2, 1.5),
    "force_words_ids": [[7]],
    "forced_bos_token_id": 7,
    "forced_eos_token_id": 7,
    "guidance_scale": 1.5,
    "is_assistant": True,
    "length_penalty": 2.0,
    "low_memory": True,
    "max_cache_len": 64,
    "max_length": 27,
    "max_matching_ngram_size": 3,
    "max_new_tokens": 7,
    "max_time": 30.0,
    "min_length": 25,
    "min_new_tokens": 5,
    "min_p": 0.1,
    "no_repeat_ngram_size": 2,
    "num_assistant_tokens": 3,
    "num_assistant_tokens_schedule": "heuristic",
    "num_beam_groups": 2,
    "num_beams": 2,
    "num_return_sequences": 2,
    "output_attentions": True,
    "output_hidden_states": True,
    "output_logits": True,
    "output_scores": True,
    "pad_token_id": 3,
    "penalty_alpha": 0.6,
    "prefill_chunk_size": 4,
    "prompt_lookup_num_tokens": 3,
    "remove_invalid_values": True,
    "renormalize_logits": True,
    "repetition_penalty": 1.5,
    "return_dict_in_generate": True,
    "sequence_bias": {(7,): -10.0},
    "speculation_type": "dflash",
    "stop_strings": ["x"],
    "suppress_tokens": [7],
    "target_lookbehind": 5,
    "temperature": 0.5,
    "token_healing": True,
    "top_h": 0.5,
    "top_k": 5,
    "top_p": 0.5,
    "typical_p": 0.5,
    "use_cache": False,
    "use_mtp": True,
    "watermarking_config": WatermarkingConfig(),
}
METADATA = {"_from_model_config", "transformers_version"}
# settings that only tell HF how to speculate (HF itself refuses assisted generation on stateful models)
SPECULATION_ONLY = {
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "is_assistant",
}  # fmt: skip


def test_every_field_has_a_sample():
    """A field added by a new transformers version fails here until it is accounted for."""
    assert set(GenerationConfig().to_dict()) - METADATA == set(SAMPLES)


@pytest.fixture(scope="module")
def pair():
    ref = cached_tiny_model("mamba2")
    return ref, ssmspec.transform(copy.deepcopy(ref))


def _ids():
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(8, 96, (4,), generator=g)
    return torch.cat([torch.randint(8, 96, (3,), generator=g), motif, motif, motif])[None]


@pytest.mark.parametrize("field", sorted(SAMPLES))
def test_field_is_applied_or_refused_by_name(pair, field):
    ref, model = pair
    ids = _ids()
    value = SAMPLES[field]
    length = {} if field in ("max_length", "max_new_tokens") else {"max_new_tokens": 8}
    spec = {} if field == "prompt_lookup_num_tokens" else {"prompt_lookup_num_tokens": 3}
    documented = {name: status for name, status, _ in settings_table()}[field]  # what the docs say
    if field == "do_sample":  # distribution equality with HF: tests/speculate/test_sampling.py
        greedy = model.generate(ids, **spec, **length)
        sampled = [model.generate(ids, **spec, **length, do_sample=True, generator=torch.Generator().manual_seed(s))
                   for s in range(3)]  # fmt: skip
        assert documented == "applied" and any(not torch.equal(x, greedy) for x in sampled)
        return
    try:
        got = model.generate(ids, **spec, **length, **{field: copy.deepcopy(value)})
    except UnsupportedSettingError as exc:
        assert field in str(exc) and exc.setting == field
        greedy_only = field == "num_return_sequences"  # applied when sampling; greedy refuses it (as HF)
        assert documented.startswith("refused") or greedy_only, f"{field} is refused but documented as {documented!r}"
        return
    except Exception as exc:  # noqa: BLE001 - a setting HF itself rejects must be rejected here too
        with pytest.raises(type(exc)):
            ref.generate(ids, **length, **{field: copy.deepcopy(value)})
        return
    assert not documented.startswith("refused") or field == "num_return_sequences", f"{field}: documented {documented}"
    hf_kwargs = {} if field in SPECULATION_ONLY else {field: copy.deepcopy(value)}
    want = ref.generate(ids, do_sample=False, **length, **hf_kwargs)
    seq = lambda out: out.sequences if hasattr(out, "sequences") else out  # noqa: E731
    assert torch.equal(seq(got), seq(want)), f"{field}={value!r} changed nothing here but changes HF's output"


@pytest.mark.parametrize("setting", ["penalty_alpha", "token_healing", "guidance_scale", "num_beams", "dola_layers"])
def test_settings_that_are_not_applied_are_refused_by_name(pair, setting):
    _, model = pair
    with pytest.raises(UnsupportedSettingError, match=setting):
        model.generate(_ids(), max_new_tokens=5, prompt_lookup_num_tokens=3, **{setting: SAMPLES[setting]})


def test_a_generation_config_carrying_settings_is_checked_too(pair):
    ref, model = pair
    config = GenerationConfig(max_new_tokens=5, penalty_alpha=0.6, top_k=4, pad_token_id=0, eos_token_id=2)
    with pytest.raises(UnsupportedSettingError, match="penalty_alpha"):
        model.generate(_ids(), generation_config=config, prompt_lookup_num_tokens=3)
    config = GenerationConfig(max_new_tokens=8, repetition_penalty=1.6, no_repeat_ngram_size=2)
    want = ref.generate(_ids(), generation_config=copy.deepcopy(config))
    assert torch.equal(model.generate(_ids(), generation_config=config, prompt_lookup_num_tokens=3), want)


@pytest.mark.parametrize(
    "argument,value",
    [("prefix_allowed_tokens_fn", lambda b, ids: [3]), ("negative_prompt_ids", torch.ones(1, 2, dtype=torch.long)),
     ("assistant_tokenizer", "a tokenizer"), ("synced_gpus", True), ("custom_generate", "an/repo")],
)  # fmt: skip
def test_generate_arguments_outside_the_config_are_refused(pair, argument, value):
    _, model = pair
    with pytest.raises(UnsupportedSettingError, match=argument):
        model.generate(_ids(), max_new_tokens=5, prompt_lookup_num_tokens=3, **{argument: value})


def test_no_max_new_tokens_uses_hf_default_length(pair):
    """Used to raise TypeError; HF falls back to its default max_length (20)."""
    ref, model = pair
    ids = _ids()
    want = ref.generate(ids, do_sample=False)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=4), want)
    assert torch.equal(model.generate(ids, speculation=SpecConfig(tree=True)), want)


def test_unknown_model_kwargs_are_refused(pair):
    _, model = pair
    with pytest.raises(ValueError, match="does not take"):
        model.generate(_ids(), max_new_tokens=3, prompt_lookup_num_tokens=3, not_an_argument=1)
    with pytest.raises(ValueError, match="inputs_embeds|does not take"):
        model.generate(inputs_embeds=torch.zeros(1, 3, 32), max_new_tokens=3, prompt_lookup_num_tokens=3)
