"""MTP layers shipped in checkpoints (ssmspec.hf.mtp, ssmspec.speculate.drafters.mtp): found in a checkpoint that
`from_pretrained` loaded (transformers drops them), built in each family's layout, drafting exactly (float64, chains,
trees, batches with padding, sampling losslessly), their incremental K/V equal to a full forward, and refused by
name where the layout is partial or unknown."""

from __future__ import annotations

import pytest
import torch
import transformers

import ssmspec
from ssmspec.errors import UnsupportedModelError
from ssmspec.hf import mtp as hf_mtp
from ssmspec.speculate.drafters.mtp import MTPDrafter, Slots
from ssmspec.testing.configs import build_tiny_model
from ssmspec.testing.mtp import MTP_FAMILIES, write_checkpoint


def load(directory, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float64, experts_implementation="eager", **kwargs
    )
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def flush_denormals():
    """Denormal float64 numbers (the gated-delta families' decays) slow the tiny models' forwards twentyfold on a CPU;
    flushed to zero for reference and speculation alike (the comparisons stay like for like)."""
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(scope="module", params=MTP_FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(family, HF's model and the transformed one, loaded from a tiny checkpoint of the family with MTP tensors in
    its published layout)."""
    where = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, load(where), ssmspec.transform(load(where))


PROMPTS = (torch.tensor([[5, 9, 17, 33, 9, 17, 33, 41, 7], [0, 0, 0, 12, 44, 12, 44, 61, 3]]),
           torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9]))  # fmt: skip


@pytest.mark.parametrize("tree", [False, True])
def test_mtp_drafts_exactly_in_every_family(checkpoint, tree):
    """from_pretrained + transform finds the checkpoint's MTP tensors; greedy chains and trees drafted with them over
    a padded batch equal HF's greedy output on the untransformed model, token for token (float64)."""
    family, ref, model = checkpoint
    head = model.__dict__["ssmspec_draft_head"]
    assert isinstance(head, hf_mtp.MTPModule) and head.family == hf_mtp.family_of(model)
    ids, mask = PROMPTS
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    spec = ssmspec.SpecConfig(drafter="mtp", tree=tree, tree_budget=8, num_draft_tokens=4, adaptive=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, speculation=spec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert out.spec_stats["drafter"]["mtp"] == head.family
    assert out.spec_stats["drafter"]["head_calls"] > 0


def test_auto_drafts_with_a_small_mtp_layer_only(checkpoint, monkeypatch):
    """drafter "draft_head" drafts with the MTP layer the checkpoint ships; "auto" does where the layer is small against
    the model (HEAD_MAX_SHARE of its parameters; a tiny model's one layer of a few is not: n-gram lookup drafts); every
    call gives HF's output."""
    from ssmspec.speculate import plan as spec_plan

    family, ref, model = checkpoint
    ids = PROMPTS[0][:1]
    want = ref.generate(ids, max_new_tokens=16, do_sample=False)

    def drafter_stats(**kw):
        out = model.generate(ids, max_new_tokens=16, return_dict_in_generate=True, **kw)
        assert torch.equal(out.sequences, want)
        return out.spec_stats["drafter"]

    assert drafter_stats(speculation=ssmspec.SpecConfig(drafter="draft_head")).get("mtp") == hf_mtp.family_of(model)
    share = hf_mtp.size_share(model.__dict__["ssmspec_draft_head"], model)
    assert share > spec_plan.HEAD_MAX_SHARE and "mtp" not in drafter_stats()
    monkeypatch.setattr(spec_plan, "HEAD_MAX_SHARE", share)
    assert drafter_stats().get("mtp") == hf_mtp.family_of(model)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_incremental_entries_equal_a_full_forward(family, tmp_path, monkeypatch):
    """Every proposal's root logits (the MTP layer run over the positions committed since the last proposal, on its
    K/V of the earlier ones, drafted branches overwritten) equal the MTP layer run over the whole sequence at once on
    the target's features: the K/V it keeps is the committed sequence's, whatever was drafted and rejected."""
    where = write_checkpoint(family, tmp_path)
    model = ssmspec.transform(load(where))
    mtp = model.__dict__["ssmspec_draft_head"]
    seen = []
    original = MTPDrafter._root_logits

    def record(self, contexts):
        logits = original(self, contexts)
        seen.append(([list(c) for c in contexts], logits.clone()))
        return logits

    monkeypatch.setattr(MTPDrafter, "_root_logits", record)
    ids, mask = PROMPTS
    spec = ssmspec.SpecConfig(drafter="mtp", tree=True, tree_budget=6, num_draft_tokens=3, adaptive=False)
    model.generate(ids, attention_mask=mask, max_new_tokens=16, speculation=spec)
    assert len(seen) > 3
    for contexts, logits in seen:
        for r, ctx in enumerate(contexts):
            want = full_forward_root_logits(model, mtp, ctx)
            torch.testing.assert_close(logits[r], want, atol=1e-6, rtol=1e-5)  # (logits in float32)


@torch.no_grad()
def full_forward_root_logits(model, mtp, seq: list[int]) -> torch.Tensor:
    """The MTP layer's logits after seq[-1], from one causal forward over the pairs (h_j, seq[j+1]), j < len - 1."""
    m = len(seq) - 1
    hidden = model.base_model(torch.tensor([seq[:-1]])).last_hidden_state
    embedded = model.get_input_embeddings()(torch.tensor([seq[1:]]))
    positions = torch.arange(m)[None]
    mask = torch.full((1, 1, m, m), torch.finfo(hidden.dtype).min, dtype=hidden.dtype).triu(1)
    slots = Slots()
    slots.at, slots.width = positions, m
    out = mtp(hidden, embedded, positions, mask, slots)
    return model.lm_head(out[0, -1]).float()


def test_mtp_sampling_is_lossless(tmp_path):
    """Speculative sampling with MTP trees and chains: the joint distribution of the first three tokens equals
    HF's sampling (chi-square over 3,000 samples; the test rejects biased samplers: tests/speculate/test_sampling.py);
    peaked distributions (the LM head scaled up) so the drafts are accepted often enough to matter."""
    from ssmspec.testing.distribution import sampling_p_value

    where = write_checkpoint("nemotron_h", tmp_path, vocab_size=16)
    ref, model = load(where), load(where)
    with torch.no_grad():
        ref.lm_head.weight.mul_(4.0)
        model.lm_head.weight.mul_(4.0)
    model = ssmspec.transform(model)
    prompt = torch.tensor([[3, 5, 7, 3, 5]])
    for tree in (False, True):
        spec = ssmspec.SpecConfig(drafter="mtp", tree=tree, tree_budget=6, num_draft_tokens=2, adaptive=False)
        p, stats = sampling_p_value(ref, model, prompt, samples=3000, do_sample=True, temperature=0.7, top_k=0,
                                    speculation=spec)  # fmt: skip
        assert p > 1e-3, (tree, p)
        assert stats["accepted_tokens"] > 0


def test_partial_layout_is_refused_by_name_and_changes_nothing(tmp_path):
    """A checkpoint whose MTP tensors miss one of its family's layout: transform refuses, naming the tensor, and
    leaves the model as it was; draft_head=None transforms without them."""
    where = write_checkpoint("qwen3_next", tmp_path, drop=("mtp.pre_fc_norm_hidden.weight",))
    model = load(where)
    cls = type(model)
    with pytest.raises(UnsupportedModelError, match=r"missing mtp\.pre_fc_norm_hidden\.weight"):
        ssmspec.transform(model)
    assert type(model) is cls and "ssmspec_draft_head" not in model.__dict__
    assert ssmspec.transform(model, draft_head=None).__dict__["ssmspec_draft_head"] is None


def test_layouts_ssmspec_does_not_build_are_refused_by_name():
    """Inkling's per-depth MTP heads and a family without a published layout are refused naming the family."""
    with pytest.raises(UnsupportedModelError, match="Inkling"):
        hf_mtp.build(build_tiny_model("inkling"), {"layers.0.input_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(UnsupportedModelError, match="no MTP layout is known for model type 'mamba2'"):
        hf_mtp.build(build_tiny_model("mamba2"), {"layers.0.fc.weight": torch.zeros(2, 2)})


def test_checkpoint_without_mtp_changes_nothing_and_mtp_drafter_is_refused(tmp_path):
    """No `mtp.*` tensors: no head, the default call is n-gram lookup's; drafter="mtp" is refused with its reason."""
    model = build_tiny_model("qwen3_next")
    model.save_pretrained(tmp_path)
    model = ssmspec.transform(load(tmp_path))
    assert model.__dict__["ssmspec_draft_head"] is None
    with pytest.raises(ValueError, match="drafter='mtp'"):
        model.generate(PROMPTS[0][:1], max_new_tokens=4, speculation=ssmspec.SpecConfig(drafter="mtp"))


def test_save_pretrained_keeps_the_mtp_layer(tmp_path):
    """A transformed model saved with save_pretrained writes its MTP tensors (`mtp.safetensors`, which HF's state dict
    lacks); loaded again and transformed, it drafts with the same layer, also from a sharded checkpoint."""
    where = write_checkpoint("nemotron_h", tmp_path / "src")
    model = ssmspec.transform(load(where))
    before = hf_mtp.mtp_state(model.__dict__["ssmspec_draft_head"])
    for name, shard in (("one", "5GB"), ("sharded", "20KB")):
        model.save_pretrained(tmp_path / name, max_shard_size=shard)
        again = ssmspec.transform(load(tmp_path / name))
        after = hf_mtp.mtp_state(again.__dict__["ssmspec_draft_head"])
        assert after.keys() == before.keys()
        assert all(torch.equal(after[k], before[k]) for k in before)
    given = ssmspec.transform(load(where), draft_head=tmp_path / "one" / hf_mtp.MTP_FILE)
    assert isinstance(given.__dict__["ssmspec_draft_head"], hf_mtp.MTPModule)


def test_mtp_drafts_on_a_model_whose_lm_head_is_offloaded(tmp_path):
    """With accelerate's big-model inference putting the LM head on disk (its weights on the meta device between
    forwards), the MTP layer is built where the head computes and drafts exactly."""
    pytest.importorskip("accelerate")
    where = write_checkpoint("nemotron_h", tmp_path / "checkpoint")
    ref = load(where)
    tied = bool(ref.config.get_text_config().tie_word_embeddings)
    device_map = {"model": "disk" if tied else "cpu", "lm_head": "disk"}
    model = load(where, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert model.lm_head.weight.device.type == "meta"
    model = ssmspec.transform(model)
    head = model.__dict__["ssmspec_draft_head"]
    assert all(p.device.type == "cpu" for p in head.parameters())
    ids = PROMPTS[0][:1]
    spec = ssmspec.SpecConfig(drafter="mtp", tree=True, tree_budget=6, num_draft_tokens=3, adaptive=False)
    out = model.generate(ids, max_new_tokens=12, speculation=spec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.generate(ids, max_new_tokens=12, do_sample=False))
    assert out.spec_stats["drafter"]["head_calls"] > 0


def test_layer_kinds_come_from_the_checkpoint_and_recurrent_blocks_are_refused():
    """A Qwen3-Next MTP layer with a dense MLP (no router tensors) builds with one, whatever the model's own layers use;
    a Nemotron-H MTP layer with a Mamba2 block (which would need a recurrent cache of its own) is refused by name."""
    model = build_tiny_model("qwen3_next")
    dense = hf_mtp.QwenMTP(model, *hf_mtp.QWEN["qwen3_next"], moe=False).state_dict()
    assert not any(".experts." in k for k in hf_mtp.build(model, dense).state_dict())
    model = build_tiny_model("nemotron_h")
    model.config.mtp_layers_block_type = ["linear_attention", "moe"]
    tensors = {"layers.0.norm.weight": torch.ones(2), "layers.1.norm.weight": torch.ones(2)}
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        hf_mtp.build(model, tensors)
