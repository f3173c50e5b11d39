"""The embedded trained models: shipped, small, loadable with from_pretrained, and exact under speculation."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import ssmspec
from ssmspec import models


def test_all_embedded_models_are_shipped_and_small():
    assert models.available() == models.NAMES  # (a clone of the repository: the wheel's and the medium model)
    total = sum((models.path(n) / "model.safetensors").stat().st_size for n in models.EMBEDDED)
    assert total <= 16 * 2**20, f"embedded weights take {total / 2**20:.1f} MiB > 16 MiB"
    report = models.report()
    for name in models.NAMES:
        assert 0 < report[name]["held_out_bits_per_byte"] < 8


def test_the_medium_model_reads_its_weights_from_memory_and_trained_on_files_it_holds_out():
    """nemotron-medium's float32 weights are over twice a 32 MiB last-level cache (a decode step reads them from
    memory, as real checkpoints' do), its MTP layer is under a tenth of it (the default drafts with it or its head),
    and the files it was trained on exclude every held-out file of the small models' split."""
    from ssmspec.hf.mtp import read_mtp

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models.path("nemotron-medium")))
    params = sum(p.numel() for p in model.parameters())
    assert 4 * params >= 2 * 32 * 2**20
    assert models.report()["nemotron-medium"]["params"] == params
    mtp = sum(t.numel() for t in read_mtp(models.path("nemotron-medium")).values())
    assert 0 < mtp <= 0.1 * params
    train, held = models.corpus_files(recursive=True)
    small_train, small_held = models.corpus_files()
    assert set(small_held) <= set(held) and not set(train) & set(held)
    assert set(small_train) <= set(train) and len(train) > 3 * len(small_train)
    assert models.report()["nemotron-medium"]["corpus"]["files"] == len(train)


def test_a_repository_model_missing_from_an_installation_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "ROOT", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"not in the ssmspec wheel.*clone.*train_mtp.py --size medium"):
        models.path("nemotron-medium")
    assert models.available() == ()
    with pytest.raises(ValueError, match="unknown embedded model 'nemotron-large'"):
        models.path("nemotron-large")


@pytest.mark.parametrize("name", models.NAMES)
def test_loads_with_plain_from_pretrained_and_speculates_exactly(name):
    ref = AutoModelForCausalLM.from_pretrained(models.path(name), dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(models.path(name))
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == text
    want = ref.generate(ids, max_new_tokens=24, do_sample=False)
    model = ssmspec.transform(copy.deepcopy(ref))
    for spec in (ssmspec.SpecConfig(), ssmspec.SpecConfig(tree=True)):
        assert torch.equal(model.generate(ids, max_new_tokens=24, speculation=spec), want)


def test_models_available_after_import_ssmspec():
    """`import ssmspec; ssmspec.models.load(...)` used to fail without `import ssmspec.models`."""
    code = "import ssmspec\nm, tok = ssmspec.models.load('mamba2-draft')\nassert m.config.vocab_size == len(tok)\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_the_mtp_example_drafts_with_its_layer_by_default():
    """nemotron-mtp's MTP layer is found in its checkpoint by from_pretrained + transform, is small enough for the
    default call to draft with it (as released checkpoints' are), and its drafts keep the output HF's (float64)."""
    from ssmspec.hf.mtp import size_share
    from ssmspec.speculate.plan import HEAD_MAX_SHARE

    ref = AutoModelForCausalLM.from_pretrained(models.path("nemotron-mtp"), dtype=torch.float64).eval()
    model = ssmspec.transform(copy.deepcopy(ref))
    assert size_share(model.ssmspec_draft_head, model) <= HEAD_MAX_SHARE
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    want = ref.generate(ids, max_new_tokens=24, do_sample=False)
    out = model.generate(ids, max_new_tokens=24, return_dict_in_generate=True)
    assert out.spec_stats["drafter"]["mtp"] == "nemotron_h"
    assert torch.equal(out.sequences, want)
