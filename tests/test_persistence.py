"""Transformed models are ordinary objects: they pickle, torch.save/torch.load round-trip (also into a fresh
process), deepcopy, and save_pretrained writes the original architecture so that reloading + transform works."""

from __future__ import annotations

import copy
import io
import json
import pickle
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

import ssmspec
from ssmspec import SpecConfig
from ssmspec.testing.strategies import cached_tiny_model


def _ids():
    g = torch.Generator().manual_seed(4)
    motif = torch.randint(3, 96, (4,), generator=g)
    return torch.cat([motif, motif, torch.randint(3, 96, (2,), generator=g), motif])[None]


def test_pickle_and_torch_save_round_trip():
    ref = cached_tiny_model("bamba")
    model = ssmspec.transform(copy.deepcopy(ref), SpecConfig(tree=True, num_draft_tokens=3))
    want = ref.generate(_ids(), max_new_tokens=10, do_sample=False)
    again = pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for m in (again, loaded, copy.deepcopy(model)):
        assert type(m) is type(model) and isinstance(m, type(ref))
        assert m.ssmspec_config == model.ssmspec_config
        out = m.generate(_ids(), max_new_tokens=10, return_dict_in_generate=True)
        assert out.spec_stats is not None and torch.equal(out.sequences, want)


def test_torch_load_in_a_fresh_process(tmp_path):
    """The seams live in transformers' modeling modules, which a new process imports fresh: unpickling puts
    them back."""
    ref = cached_tiny_model("qwen3_next")
    model = ssmspec.transform(copy.deepcopy(ref))
    torch.save(model, tmp_path / "model.pt")
    torch.save(_ids(), tmp_path / "ids.pt")
    torch.save(ref.generate(_ids(), max_new_tokens=10, do_sample=False), tmp_path / "want.pt")
    code = (
        "import torch\n"
        f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        f"want = torch.load({str(tmp_path / 'want.pt')!r})\n"
        "got = m.generate(ids, max_new_tokens=10, speculation=__import__('ssmspec').SpecConfig(tree=True))\n"
        "assert torch.equal(got, want), (got, want)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_save_pretrained_writes_the_original_architecture(tmp_path):
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [type(ref).__name__]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(reloaded) is type(ref)
    again = ssmspec.transform(reloaded)
    want = ref.generate(_ids(), max_new_tokens=10, do_sample=False)
    assert torch.equal(again.generate(_ids(), max_new_tokens=10, prompt_lookup_num_tokens=3), want)
