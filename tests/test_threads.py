"""Two models in two threads: each verification belongs to the cache its mixers are given, per thread; nothing
on the verification path is process-global."""

from __future__ import annotations

import copy
import threading

import torch

import ssmspec
from ssmspec import SpecConfig
from ssmspec.testing.strategies import cached_tiny_model


def _run_in_threads(jobs):
    results, errors = {}, {}
    barrier = threading.Barrier(len(jobs))

    def run(name, fn):
        barrier.wait()
        try:
            for i in range(3):
                results[(name, i)] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[name] = exc

    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def _prompt(seed):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 96, (4,), generator=g)
    return torch.cat([motif, motif, torch.randint(3, 96, (3,), generator=g), motif])[None]


def test_two_transformed_models_speculate_in_two_threads():
    """Used to crash: `seam causal_conv1d_update was called during tree verification` (one global verifying
    cache for the process)."""
    refs = {"bamba": cached_tiny_model("bamba"), "qwen3_next": cached_tiny_model("qwen3_next")}
    models = {k: ssmspec.transform(copy.deepcopy(v)) for k, v in refs.items()}
    want = {k: refs[k].generate(_prompt(i), max_new_tokens=12, do_sample=False) for i, k in enumerate(refs)}
    spec = SpecConfig(tree=True, num_draft_tokens=4, tree_budget=8)
    jobs = {
        k: (lambda k=k, i=i: models[k].generate(_prompt(i), max_new_tokens=12, speculation=spec))
        for i, k in enumerate(models)
    }
    for (name, _), out in _run_in_threads(jobs).items():
        assert torch.equal(out, want[name]), name


def test_plain_generate_in_one_thread_while_another_verifies_the_same_family():
    ref = cached_tiny_model("mamba2")
    spec_model = ssmspec.transform(copy.deepcopy(ref))
    plain_model = ssmspec.transform(copy.deepcopy(ref))
    ids = _prompt(5)
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    jobs = {
        "speculative": lambda: spec_model.generate(ids, max_new_tokens=12, speculation=SpecConfig(tree=True)),
        "plain": lambda: plain_model.generate(ids, max_new_tokens=12, do_sample=False),
        "untransformed": lambda: ref.generate(ids, max_new_tokens=12, do_sample=False),
    }
    for (name, _), out in _run_in_threads(jobs).items():
        assert torch.equal(out, want), name


def test_captured_steps_in_two_threads():
    """Each thread's step capture records its own thread's ops only (the op tape is a thread's dispatch mode)."""
    refs = {"bamba": cached_tiny_model("bamba"), "lfm2": cached_tiny_model("lfm2")}
    models = {k: ssmspec.transform(copy.deepcopy(v)) for k, v in refs.items()}
    want = {k: refs[k].generate(_prompt(i), max_new_tokens=12, do_sample=False) for i, k in enumerate(refs)}
    spec = SpecConfig(tree=True, num_draft_tokens=4, tree_budget=8, graphs=True)
    jobs = {
        k: (lambda k=k, i=i: models[k].generate(_prompt(i), max_new_tokens=12, speculation=spec))
        for i, k in enumerate(models)
    }
    for (name, _), out in _run_in_threads(jobs).items():
        assert torch.equal(out, want[name]), name
