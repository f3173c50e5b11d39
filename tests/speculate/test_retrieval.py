"""Retrieval drafting: the suffix index against brute force, persistence, SpecConfig(corpus=...) through
generate (token-exact with HF greedy, speculative sampling distribution), and the errors it raises."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ssmspec
from ssmspec.errors import VocabMismatchError
from ssmspec.speculate.drafters import PromptLookupDrafter
from ssmspec.speculate.retrieval import SuffixIndex
from ssmspec.testing.distribution import sampling_p_value, tiny_sampling_setup
from ssmspec.testing.strategies import cached_tiny_model

docs_strategy = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=40), min_size=1, max_size=4)


def brute_force(docs, context, max_match, depth):
    """Longest tail of `context` occurring in a document, and every continuation after its occurrences."""
    best, conts = 0, []
    for m in range(1, min(max_match, len(context)) + 1):
        tail = context[len(context) - m :]
        found = [d[i + m : i + m + depth] for d in docs for i in range(len(d) - m + 1) if d[i : i + m] == tail]
        if not found:
            break
        best, conts = m, found
    return best, Counter(tuple(c) for c in conts if c)


@given(docs=docs_strategy, context=st.lists(st.integers(0, 4), min_size=1, max_size=12),
       max_match=st.integers(1, 6), depth=st.integers(1, 5), sort_depth=st.sampled_from([4, 8, 64]))  # fmt: skip
def test_continuations_equal_brute_force(docs, context, max_match, depth, sort_depth):
    index = SuffixIndex.from_sequences(docs, sort_depth=sort_depth)
    m, conts = index.continuations(context, depth, max_match=min(max_match, sort_depth), max_samples=10**6)
    want_m, want = brute_force(docs, context, min(max_match, sort_depth), depth)
    assert m == want_m
    total = sum(want.values()) + (0 if m == 0 else sum(1 for d in docs for i in range(len(d) - m + 1)
                                                          if d[i : i + m] == context[len(context) - m :]
                                                          and i + m == len(d)))  # fmt: skip
    got = Counter()
    for cont, w in conts:
        got[tuple(cont)] += 1
        assert w == pytest.approx(1.0 / total)  # every occurrence read once, its share of all of them
    assert got == want


def test_sampled_occurrences_keep_frequencies():
    """More occurrences than samples: evenly spaced ones over the sorted range keep each continuation's share."""
    docs = [[1, 2] * 30 + [1, 3] * 10 + [1, 4] * 20]
    index = SuffixIndex.from_sequences(docs)
    m, conts = index.continuations([9, 1], depth=1, max_match=4, max_samples=6)
    share = Counter()
    for cont, w in conts:
        share[cont[0]] += w
    assert m == 1 and sum(share.values()) == pytest.approx(1.0)
    assert share[2] == pytest.approx(3 / 6) and share[4] == pytest.approx(2 / 6) and share[3] == pytest.approx(1 / 6)


def test_save_and_load_roundtrip(tmp_path):
    index = SuffixIndex.from_sequences([[1, 2, 3, 1, 2, 4], [2, 3, 5]])
    path = tmp_path / "corpus.safetensors"
    index.save(path)
    again = SuffixIndex.load(path)
    assert len(again) == len(index) == 9 and again.documents == 2
    assert again.continuations([7, 1, 2], 3) == index.continuations([7, 1, 2], 3)
    bad = tmp_path / "other.safetensors"
    from safetensors.numpy import save_file

    save_file({"tokens": again.np_tokens}, str(bad))
    with pytest.raises(ValueError, match="not an ssmspec suffix index"):
        SuffixIndex.load(bad)
    with pytest.raises(FileNotFoundError):
        SuffixIndex.load(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match=">= 0"):
        SuffixIndex.from_sequences([[1, -2]])


def test_corpus_drafts_are_used_and_output_is_exact():
    """A corpus holding the model's own continuation: drafts come from it (the context alone has none) and
    the output stays token-exact with HF greedy, for chains and trees, with an index, a saved index and texts."""
    ref = cached_tiny_model("mamba2", dtype=torch.float64)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[11, 12, 13, 14]])
    want = ref.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    cont = want[0, 2:].tolist()  # the continuation, found by its tail (no repeats in the prompt itself)
    index = SuffixIndex.from_sequences([[5, 6, 7] + cont[:20], cont[18:]])
    for tree in (False, True):
        base = model.generate(ids, max_new_tokens=40, eos_token_id=None, return_dict_in_generate=True,
                              speculation=ssmspec.SpecConfig(num_draft_tokens=6, tree=tree,
                                                             adaptive=False))  # fmt: skip
        out = model.generate(ids, max_new_tokens=40, eos_token_id=None, return_dict_in_generate=True,
                             speculation=ssmspec.SpecConfig(num_draft_tokens=6, tree=tree, corpus=index,
                                                             adaptive=False))  # fmt: skip
        assert torch.equal(out.sequences, want) and torch.equal(base.sequences, want)
        assert out.spec_stats["verify_steps"] < base.spec_stats["verify_steps"] / 2  # drafts came from the corpus


class ToyTokenizer:
    """Space-separated integers (enough for corpus documents)."""

    name_or_path = "toy"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}

    def __len__(self):
        return 96


def test_corpus_forms_and_caching(tmp_path):
    ref = cached_tiny_model("mamba2", dtype=torch.float64)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[11, 12, 13, 14]])
    want = ref.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    text = " ".join(str(t) for t in want[0].tolist())
    file = tmp_path / "doc.txt"
    file.write_text(text)
    saved = tmp_path / "index.safetensors"
    SuffixIndex.from_sequences([want[0].tolist()]).save(saved)
    tok = ToyTokenizer()
    for corpus, kw in [([text], {"tokenizer": tok}), ([file], {"tokenizer": tok}), (str(saved), {}), (saved, {})]:
        out = model.generate(ids, max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True,
                             speculation=ssmspec.SpecConfig(corpus=corpus, adaptive=False), **kw)  # fmt: skip
        assert torch.equal(out.sequences, want)
        assert out.spec_stats["verify_steps"] <= 8, corpus
    assert len(model._ssmspec_corpus_indexes) == 3  # texts, file, saved path (str and Path differ as keys)
    cached = dict(model._ssmspec_corpus_indexes)
    model.generate(ids, max_new_tokens=4, speculation=ssmspec.SpecConfig(corpus=[text]), tokenizer=tok)
    assert all(model._ssmspec_corpus_indexes[k] is v for k, v in cached.items())  # built once per model


def test_corpus_errors_leave_the_model_alone(tmp_path, monkeypatch):
    ref = cached_tiny_model("mamba2", dtype=torch.float64)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = torch.tensor([[11, 12, 13, 14]])
    with pytest.raises(ValueError, match="tokenizer="):
        model.generate(ids, max_new_tokens=4, speculation=ssmspec.SpecConfig(corpus=["1 2 3"]))
    monkeypatch.chdir(tmp_path)
    Path("notes.txt").write_text("1 2 3")
    with pytest.raises(ValueError, match="pathlib.Path"):
        model.generate(ids, max_new_tokens=4, speculation=ssmspec.SpecConfig(corpus=["notes.txt"]),
                       tokenizer=ToyTokenizer())  # fmt: skip
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        model.generate(ids, max_new_tokens=4, speculation=ssmspec.SpecConfig(corpus=[Path("missing.txt")]),
                       tokenizer=ToyTokenizer())  # fmt: skip
    with pytest.raises(VocabMismatchError, match="500"):
        outside = ssmspec.SpecConfig(corpus=SuffixIndex.from_sequences([[500]]))
        model.generate(ids, max_new_tokens=4, speculation=outside)
    assert "_ssmspec_corpus_indexes" not in model.__dict__
    with pytest.raises(TypeError, match="SpecConfig.corpus"):
        ssmspec.SpecConfig(corpus=3)
    with pytest.raises(ValueError, match="tree=True"):
        ssmspec.SpecConfig(drafter="draft_model", tree=False, corpus=["x"])
    with pytest.raises(ValueError, match="needs a drafter"):
        ssmspec.SpecConfig(drafter="none", corpus=["x"])
    assert isinstance(ssmspec.SpecConfig(corpus=["a", "b"]).corpus, tuple)


def test_corpus_sampling_matches_hf_sampling():
    """Retrieved drafts are deterministic proposals: speculative sampling with them keeps HF's distribution
    (the corpus holds the target's greedy continuation, so drafts are often accepted, sometimes rejected)."""
    target, _, prompt = tiny_sampling_setup()
    greedy = target.generate(prompt, do_sample=False, max_new_tokens=8, eos_token_id=None)[0].tolist()
    index = SuffixIndex.from_sequences([greedy, greedy[3:] + [1, 2, 3]])
    spec = ssmspec.transform(copy.deepcopy(target))
    config = ssmspec.SpecConfig(tree=True, num_draft_tokens=3, corpus=index, adaptive=False)
    p, stats = sampling_p_value(target, spec, prompt, samples=3000, do_sample=True, temperature=1.0, top_k=0,
                                speculation=config)  # fmt: skip
    accepted = stats["accepted_tokens"] / stats["row_steps"]
    assert 0.05 < accepted and stats["accepted_tokens"] < stats["row_steps"] * 3, stats
    assert p > 1e-3, p


def test_drafter_merges_context_and_corpus_votes():
    """The context's own repeat wins where it exists; the corpus proposes where the context has nothing."""
    index = SuffixIndex.from_sequences([[1, 2, 7, 7, 7], [3, 4, 8, 8]])
    drafter = PromptLookupDrafter(2, tree=False, corpus=index)
    assert drafter.propose([[1, 2, 9, 1, 2]], 3, 3)[0][0] == [2, 9, 1, 2]  # context: "1 2" was followed by 9
    assert drafter.propose([[5, 3, 4]], 3, 3)[0][0] == [4, 8, 8]  # corpus only
