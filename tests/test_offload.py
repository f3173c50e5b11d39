"""Models loaded with accelerate's big-model inference (`device_map`, weights offloaded to disk) speculate exactly:
ssmspec's instance forwards go inside accelerate's hooks (ssmspec.hf.instance), so every verify forward runs with
the layer's weights loaded and on its device. On a GPU session, a cpu / cuda split too."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import ssmspec
from ssmspec.testing.check import check_model
from ssmspec.testing.configs import build_tiny_model, load_device_mapped
from ssmspec.testing.strategies import drafter_factories, prompts

pytest.importorskip("accelerate")

FAMILIES = ["mamba2", "bamba", "qwen3_next", "recurrent_gemma"]  # SSD, hybrid attention, delta rule, generic path


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    models = {}

    def get(family):
        if family not in models:
            models[family] = load_device_mapped(build_tiny_model(family), tmp_path_factory.mktemp(family))
        return models[family]

    return get


def test_the_device_map_offloads_layers_to_disk_and_transform_keeps_the_seams(offloaded):
    model = offloaded("mamba2")
    assert "disk" in set(model.hf_device_map.values())
    assert any(p.device.type == "meta" for p in model.parameters())  # offloaded weights load per forward
    target = ssmspec.transform(copy.deepcopy(model))
    assert target.ssmspec_info.path == "seams" and target.ssmspec_info.trees and target.ssmspec_info.batches


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=3)
@given(data=st.data())
def test_speculative_equals_hf_greedy_on_an_offloaded_model(offloaded, family, data):
    model = offloaded(family)
    info = ssmspec.transform(copy.deepcopy(model)).ssmspec_info
    vocab = model.config.get_text_config().vocab_size
    prompt = data.draw(prompts(vocab, max_batch=2 if info.batches else 1), label="prompt")
    name, factory = data.draw(drafter_factories(vocab, trees=bool(info.trees)), label="drafter")
    note(f"drafter={name}")
    report = check_model(
        model,
        [prompt],
        [factory],
        max_new_tokens=data.draw(st.integers(1, 10)),
        commits=[data.draw(st.sampled_from(["replay", "materialize"]))],
        decode_single_nodes=False,
    )
    assert report.tie_flips == 0 and report.max_state_diff <= 1e-9 and report.runs == 1
    # the call users make too; its steps cannot be captured where accelerate loads weights inside each forward (nor on
    # the generic path, HF's own cache)
    why = "generic path" if info.path == "generic" else "offloaded"
    assert "default call" in report.certified and why in report.not_certified["default call, captured steps"]


def test_transform_installs_inside_accelerates_hooks_and_uninstalls_cleanly(offloaded):
    model = copy.deepcopy(offloaded("mamba2"))
    mixer = model.backbone.layers[1].mixer
    before = mixer.__dict__["_old_forward"]
    target = ssmspec.transform(model)
    from ssmspec.hf import instance, seams

    assert isinstance(instance.own_forward(mixer), seams.MixerForward)
    assert mixer.__dict__["forward"] is not mixer.__dict__["_old_forward"]  # accelerate's wrapper still outside
    seams.uninstall([mixer])
    assert instance.own_forward(mixer) is None and before.__func__ is type(mixer).forward
    assert target is model


@pytest.mark.parametrize("family", ["zamba", "zaya", "inkling2"])
def test_the_loader_keeps_tied_layers_together_parameters_off_the_layers_and_dtypes(tmp_path, family):
    """Zamba's hybrid layers share one attention block (tied weights: accelerate needs them on one device, as
    its own device_map="auto" keeps them), Zaya has parameters on the model beside its layers, inkling2 a float32
    router in a float64 model: each loads offloaded, HF's generate on it equals the model's, and ssmspec's equals
    both."""
    model = build_tiny_model(family)
    mapped = load_device_mapped(model, tmp_path)
    assert "disk" in set(mapped.hf_device_map.values())
    assert {n: p.dtype for n, p in mapped.named_parameters()} == {n: p.dtype for n, p in model.named_parameters()}
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(0))
    want = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(mapped.generate(ids, max_new_tokens=10, do_sample=False), want)
    got = ssmspec.transform(copy.deepcopy(mapped)).generate(ids, max_new_tokens=10, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)
    if family == "zamba":
        devices = {mapped.hf_device_map[f"model.layers.{i}"] for i in (1, 2)}  # the two layers sharing the block
        assert len(devices) == 1


def test_a_half_precision_checkpoint_with_its_embedding_and_lm_head_on_disk(tmp_path):
    """The shipped target as a user loads it (its float16 checkpoint) with its embedding, LM head and half its layers
    offloaded to disk. transform failed on it twice over: the low-precision probe's float32 re-check called
    `model.to`, which accelerate refuses on an offloaded model, and ssmspec built its inputs on the device of the
    model's first parameter, the offloaded embedding's meta. Now it transforms, leaves every dtype as it was, and
    the default call (draft head: the embedding and LM head loaded per call) and prompt lookup give HF's greedy
    tokens on the same model (float16: a divergence only at a near-tie of HF's logits)."""
    from transformers import AutoModelForCausalLM

    from ssmspec import bench, models

    where = {"backbone.embeddings": "disk", "backbone.norm_f": "disk", "lm_head": "disk"}
    where.update({f"backbone.layers.{i}": ("cpu", "disk")[i % 2] for i in range(6)})
    model = AutoModelForCausalLM.from_pretrained(models.path("mamba2-target"), device_map=where,
                                                 offload_folder=str(tmp_path))  # fmt: skip
    assert model.get_input_embeddings().weight.device.type == "meta"
    _, tok = models.load("mamba2-target")
    ids = torch.stack(bench.batch_prompts(tok, 2, 48))
    want = model.generate(ids, max_new_tokens=24, do_sample=False, output_scores=True, return_dict_in_generate=True)
    # (after a forward: accelerate's hooks leave the tied embedding and LM head as two meta parameters)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert set(dtypes.values()) == {torch.float16}
    target = ssmspec.transform(model)
    assert {n: p.dtype for n, p in target.named_parameters()} == dtypes and target.ssmspec_info.path == "seams"
    assert target.__dict__.get("ssmspec_draft_head") is not None
    for kwargs in ({}, {"prompt_lookup_num_tokens": 4}):
        got = target.generate(ids, max_new_tokens=24, **kwargs)
        for r in range(ids.shape[0]):
            new, ref = got[r, ids.shape[1] :].tolist(), want.sequences[r, ids.shape[1] :].tolist()
            if new != ref:  # only where HF's top two logits nearly tie
                k = next(i for i, (a, b) in enumerate(zip(new, ref)) if a != b)
                top2 = want.scores[k][r].float().topk(2).values
                assert float(top2[0] - top2[1]) < 0.05, (r, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a cpu / cuda split needs a GPU")
@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_speculative_equals_hf_greedy_split_between_cuda_and_cpu(tmp_path, family):
    model = load_device_mapped(build_tiny_model(family), tmp_path, devices=("cuda:0", "cpu"))
    ids = torch.randint(3, 90, (2, 9), device="cuda:0")
    want = model.generate(ids, max_new_tokens=16, do_sample=False)
    got = ssmspec.transform(copy.deepcopy(model)).generate(ids, max_new_tokens=16)
    assert torch.equal(got, want)


def test_pipeline_or_fsdp_parallelism_is_refused_naming_it_and_the_model_left_as_it_was():
    """Tensor parallelism speculates (tests/test_tensor_parallel.py); transformers' other kinds (pipeline stages,
    FSDP, expert parallelism, data replicas: `config.distributed_config`) run other forwards in each process, so
    transform refuses them by name."""
    import types

    from ssmspec.errors import UnsupportedModelError

    model = build_tiny_model("qwen3_next")
    model.config.distributed_config = types.SimpleNamespace(tp_size=1, pp_size=2, fsdp_size=1, ep_size=1)
    cls = type(model)
    with pytest.raises(UnsupportedModelError, match="pipeline parallelism of degree 2"):
        ssmspec.transform(model)
    assert type(model) is cls and not hasattr(model, "ssmspec_info")
