"""The embedded default models, trained by benchmarks/train_tiny.py on the Python standard library's source, and
Nemotron-H hybrids trained with the MTP layer their checkpoints ship (benchmarks/train_mtp.py, same tokenizer).

    model, tokenizer = ssmspec.models.load("mamba2-target")
    # or with plain HF calls:
    AutoModelForCausalLM.from_pretrained(ssmspec.models.path("mamba2-target"))

Weights are fp16 safetensors; `load` casts to the requested dtype (float32 by default, for CPU). The models in
`EMBEDDED` (2-6 MB each) ship in the wheel; `nemotron-medium` (20M parameters, 43 MB: a model whose decode step reads
its weights from memory, as real checkpoints' steps do) is in the source repository only: clone it and install
from the clone, or train it (`python benchmarks/train_mtp.py --size medium`, about an hour on 2 CPU cores).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
EMBEDDED = ("mamba2-target", "mamba2-draft", "bamba-hybrid", "nemotron-mtp")  # in the wheel
REPOSITORY = ("nemotron-medium",)  # in the source repository, not in the wheel (too heavy)
NAMES = EMBEDDED + REPOSITORY
TRAINED_BY = {"nemotron-mtp": "benchmarks/train_mtp.py", "nemotron-medium": "benchmarks/train_mtp.py --size medium"}


def path(name: str) -> Path:
    """Directory of an embedded model (config, safetensors weights, tokenizer).

    Args:
        name: one of `NAMES` ("mamba2-target", "mamba2-draft", "bamba-hybrid", "nemotron-mtp", "nemotron-medium").

    Raises:
        ValueError: an unknown name.
        FileNotFoundError: the weights are missing from the installation (a wheel has no `REPOSITORY` model).
    """
    if name not in NAMES:
        raise ValueError(f"unknown embedded model {name!r}; choose one of {NAMES}")
    where = ROOT / name
    if not (where / "model.safetensors").exists():
        how = f"python {TRAINED_BY.get(name, 'benchmarks/train_tiny.py')} (in a clone of ssmspec's repository)"
        if name in REPOSITORY:
            raise FileNotFoundError(
                f"{name!r} is not in the ssmspec wheel (its weights are too heavy): install ssmspec from a clone of "
                f"its repository, which has them under ssmspec/models/{name}, or train it with {how}"
            )
        raise FileNotFoundError(f"embedded model {name!r} is missing its weights ({where}); train it with {how}")
    return where


def available() -> tuple[str, ...]:
    """The embedded models whose weights are present (`EMBEDDED`, and `REPOSITORY` in a clone of the repository)."""
    return tuple(n for n in NAMES if (ROOT / n / "model.safetensors").exists())


def load(name: str = "mamba2-target", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """An embedded model and its tokenizer.

    Args:
        name: one of `NAMES`.
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


def corpus_files(recursive: bool = False) -> tuple[list[Path], list[Path]]:
    """The training corpus: .py files of the running Python's standard library, split 95/5 (train, held out) by a
    hash of the file's path under the library, so the split is the same on every machine.

    Args:
        recursive: the whole library (its packages too, without tests, idlelib and site-packages: about 12 MB)
            instead of its top-level modules (about 5 MB). The top-level files fall on the same side of the split
            either way, so files held out from the small models are held out from a model trained recursively.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
    found = root.rglob("*.py") if recursive else root.glob("*.py")
    files = sorted(p for p in found if p.stat().st_size > 0 and not skip.intersection(p.relative_to(root).parts[:-1]))

    def held_out(p: Path) -> bool:
        return int(hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest(), 16) % 20 == 0

    held = [p for p in files if held_out(p)]
    return [p for p in files if not held_out(p)], held
