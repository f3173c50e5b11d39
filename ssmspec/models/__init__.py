"""The embedded default models, trained by benchmarks/train_tiny.py on the Python standard library's source, and a
Nemotron-H hybrid trained with the MTP layer its checkpoint ships (benchmarks/train_mtp.py, same corpus and tokenizer).

    model, tokenizer = ssmspec.models.load("mamba2-target")
    # or with plain HF calls:
    AutoModelForCausalLM.from_pretrained(ssmspec.models.path("mamba2-target"))

Weights are fp16 safetensors; `load` casts to the requested dtype (float32 by default, for CPU).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
EMBEDDED = ("mamba2-target", "mamba2-draft", "bamba-hybrid", "nemotron-mtp")


def path(name: str) -> Path:
    """Directory of an embedded model (config, safetensors weights, tokenizer).

    Args:
        name: one of `EMBEDDED` ("mamba2-target", "mamba2-draft", "bamba-hybrid", "nemotron-mtp").

    Raises:
        ValueError: an unknown name.
        FileNotFoundError: the weights are missing from the installation.
    """
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; choose one of {EMBEDDED}")
    where = ROOT / name
    if not (where / "model.safetensors").exists():
        raise FileNotFoundError(
            f"embedded model {name!r} is missing its weights ({where}); run benchmarks/train_tiny.py"
        )
    return where


def available() -> tuple[str, ...]:
    """The embedded models whose weights are present."""
    return tuple(n for n in EMBEDDED if (ROOT / n / "model.safetensors").exists())


def load(name: str = "mamba2-target", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """An embedded model and its tokenizer.

    Args:
        name: one of `EMBEDDED`.
        dtype: the model's dtype (weights are stored in fp16).

    Returns:
        The model in eval mode and its tokenizer.

    Raises:
        ValueError: an unknown name.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = path(name)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(where)


def report() -> dict:
    """Training report: corpus, parameters, steps, held-out bits per byte per model."""
    file = ROOT / "report.json"
    return json.loads(file.read_text()) if file.exists() else {}


def corpus_files() -> tuple[list[Path], list[Path]]:
    """The training corpus: top-level .py files of the running Python's standard library, split 95/5
    (train, held out) by a hash of the file name, so the split is the same on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 0)
    held = [p for p in files if int(hashlib.sha1(p.name.encode()).hexdigest(), 16) % 20 == 0]
    return [p for p in files if p not in held], held
