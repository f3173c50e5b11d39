"""Logits processors per tree node, stopping criteria per emitted token, streamers and scores: speculative
generate must give exactly what HF's own greedy generate gives with the same settings (float64)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TextIteratorStreamer,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

import ssmspec
from ssmspec import SpecConfig, UnsupportedSettingError
from ssmspec.testing.strategies import cached_tiny_model

TREE = SpecConfig(tree=True, tree_budget=8, num_draft_tokens=4)
SPECS = {"chain": {"prompt_lookup_num_tokens": 4}, "tree": {"speculation": TREE}}


@pytest.fixture(scope="module", params=["mamba2", "bamba"])
def pair(request):
    ref = cached_tiny_model(request.param)
    return ref, ssmspec.transform(copy.deepcopy(ref))


def _batch():
    g = torch.Generator().manual_seed(11)
    motif = torch.randint(3, 96, (3,), generator=g)
    ids = torch.stack([motif.repeat(4), torch.cat([torch.zeros(3, dtype=torch.long), motif.repeat(3)])])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def _greedy_tokens(ref, ids, mask, n):
    return ref.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)[:, ids.shape[1] :]


PROCESSOR_SETTINGS = [
    {"repetition_penalty": 1.8},
    {"no_repeat_ngram_size": 2},
    {"encoder_repetition_penalty": 1.5},
    {"sequence_bias": {(5,): -4.0, (7, 9): 3.0}},
    {"exponential_decay_length_penalty": (3, 1.4)},
    {"renormalize_logits": True, "remove_invalid_values": True},
    {"forced_eos_token_id": 4, "max_new_tokens": 9},
]


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("setting", range(len(PROCESSOR_SETTINGS)))
def test_processors_are_applied_per_node_exactly(pair, spec, setting):
    ref, model = pair
    ids, mask = _batch()
    kwargs = {"max_new_tokens": 14, **PROCESSOR_SETTINGS[setting]}
    want = ref.generate(ids, attention_mask=mask, do_sample=False, **copy.deepcopy(kwargs))
    got = model.generate(ids, attention_mask=mask, **SPECS[spec], **kwargs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_token_dependent_processors_use_the_nodes_own_ids(pair, spec):
    """Ban and minimum-length settings built from the greedy output itself, so that they bite inside accepted
    blocks: bad words, suppressed tokens and an EOS that may only come after min_new_tokens."""
    ref, model = pair
    ids, mask = _batch()
    plain = _greedy_tokens(ref, ids, mask, 10)
    eos = int(plain[0, 2])
    cases = [
        {"bad_words_ids": [[int(plain[0, 3])], [int(plain[1, 1]), int(plain[1, 2])]]},
        {"suppress_tokens": [int(plain[0, 4]), int(plain[1, 5])]},
        {"begin_suppress_tokens": [int(plain[0, 0])]},
        {"eos_token_id": eos, "min_new_tokens": 6},
        {"eos_token_id": eos, "min_length": ids.shape[1] + 5},
    ]
    for case in cases:
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **copy.deepcopy(case))
        got = model.generate(ids, attention_mask=mask, max_new_tokens=12, **SPECS[spec], **case)
        assert torch.equal(got, want), case


class BanAfter(LogitsProcessor):
    """Pure: bans `token` once the sequence holds `after` tokens."""

    def __init__(self, token: int, after: int) -> None:
        self.token, self.after = token, after

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] >= self.after:
            scores = scores.clone()
            scores[:, self.token] = -float("inf")
        return scores


class Counting(LogitsProcessor):
    """Stateful: its effect depends on how often it was called."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores + self.calls


class PerRowBias(LogitsProcessor):
    """Reads the row's place in the batch."""

    def __init__(self, bias: torch.Tensor) -> None:
        self.bias = bias

    def __call__(self, input_ids, scores):
        return scores + self.bias[: scores.shape[0]].flip(0)


def test_custom_processors_work_when_pure_and_are_refused_by_name_otherwise(pair):
    ref, model = pair
    ids, mask = _batch()
    plain = _greedy_tokens(ref, ids, mask, 8)
    custom = LogitsProcessorList([BanAfter(int(plain[0, 4]), ids.shape[1] + 3)])
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, logits_processor=custom)
    for spec in SPECS.values():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=10, logits_processor=custom, **spec)
        assert torch.equal(got, want)
    counting = Counting()
    with pytest.raises(UnsupportedSettingError, match="logits_processor.*Counting.*attributes"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, logits_processor=[counting], **SPECS["chain"])
    assert counting.calls == 0  # checked on a copy: the user's object is untouched
    bias = torch.zeros(2, 96)
    bias[0, 5] = 10.0
    with pytest.raises(UnsupportedSettingError, match="PerRowBias.*other rows"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, logits_processor=[PerRowBias(bias)],
                       **SPECS["chain"])  # fmt: skip


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class StopOnCall(StoppingCriteria):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls > 2)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_custom_stopping_criteria_stop_at_hfs_token_inside_accepted_blocks(pair, spec):
    ref, model = pair
    ids, mask = _batch()
    plain = _greedy_tokens(ref, ids, mask, 12)
    for col in (2, 5):  # a token well inside what one step accepts on this repetitive prompt
        stop = StoppingCriteriaList([StopAfterToken(int(plain[0, col]))])
        kwargs = {"max_new_tokens": 12, "eos_token_id": 1, "pad_token_id": 0}
        want = ref.generate(ids, attention_mask=mask, do_sample=False, stopping_criteria=stop, **kwargs)
        out = model.generate(ids, attention_mask=mask, stopping_criteria=stop, return_dict_in_generate=True,
                             **SPECS[spec], **kwargs)  # fmt: skip
        assert torch.equal(out.sequences, want)
    with pytest.raises(UnsupportedSettingError, match="stopping_criteria.*StopOnCall"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, stopping_criteria=[StopOnCall()], **SPECS[spec])


def test_stop_strings_and_max_time_on_the_embedded_model():
    ref, tokenizer = ssmspec.models.load("mamba2-target", dtype=torch.float64)
    model = ssmspec.transform(copy.deepcopy(ref))
    ids = tokenizer("def check(value):\n    if value is None:\n        raise", return_tensors="pt").input_ids
    plain = ref.generate(ids, max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(plain[0, ids.shape[1] :])
    stops = [text[8:11], "\n\n"]
    want = ref.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=stops, tokenizer=tokenizer)
    assert want.shape[1] < plain.shape[1]  # the stop string bites
    for spec in SPECS.values():
        got = model.generate(ids, max_new_tokens=40, stop_strings=stops, tokenizer=tokenizer, **spec)
        assert torch.equal(got, want)
    assert torch.equal(model.generate(ids, max_new_tokens=40, max_time=600.0, **SPECS["tree"]), plain)
    short = model.generate(ids, max_new_tokens=40, max_time=0.0, **SPECS["tree"])
    assert ids.shape[1] < short.shape[1] < plain.shape[1]  # stops after the first step, as HF after its first
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    thread = threading.Thread(target=model.generate, args=(ids,), daemon=True,
                              kwargs={"max_new_tokens": 40, "streamer": streamer, **SPECS["tree"]})  # fmt: skip
    thread.start()
    assert "".join(streamer) == tokenizer.decode(plain[0, ids.shape[1] :])
    thread.join(timeout=60)


class Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_streamers_receive_what_hf_streams(pair, spec):
    ref, model = pair
    ids, mask = _batch()
    for rows in (slice(0, 1), slice(0, 2)):
        a, b = Recorder(), Recorder()
        kwargs = {"max_new_tokens": 10, "eos_token_id": int(_greedy_tokens(ref, ids, mask, 6)[1, 5])}
        ref.generate(ids[rows], attention_mask=mask[rows], do_sample=False, streamer=a, **kwargs)
        model.generate(ids[rows], attention_mask=mask[rows], streamer=b, **SPECS[spec], **kwargs)
        assert b.puts == a.puts and a.ended == b.ended == 1


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_scores_and_logits_equal_hfs_also_for_rows_that_finished_early(pair, spec):
    ref, model = pair
    ids, mask = _batch()
    eos = int(_greedy_tokens(ref, ids, mask, 6)[1, 3])  # row 1 finishes after 4 tokens, row 0 later (or not)
    kwargs = {"max_new_tokens": 11, "eos_token_id": eos, "repetition_penalty": 1.4, "output_scores": True,
              "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    want = ref.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    got = model.generate(ids, attention_mask=mask, **SPECS[spec], **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == want.sequences.shape[1] - ids.shape[1]
    for mine, theirs in zip(got.scores + got.logits, want.scores + want.logits):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        finite = torch.isfinite(theirs)
        assert torch.equal(finite, torch.isfinite(mine))
        assert torch.allclose(mine[finite], theirs[finite], rtol=1e-5, atol=1e-5)


def test_stop_criteria_on_a_batch_without_eos_are_refused(pair):
    _, model = pair
    ids, mask = _batch()
    model_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with pytest.raises(UnsupportedSettingError, match="stopping_criteria"):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, stopping_criteria=[StopAfterToken(3)],
                           **SPECS["chain"])  # fmt: skip
    finally:
        model.generation_config.eos_token_id = model_eos


@pytest.mark.parametrize(
    "warps",
    [
        [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.95)],
        [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.5)],
        [TopKLogitsWarper(5)],
        [],
        [TemperatureLogitsWarper(0.7), RepetitionPenaltyLogitsProcessor(1.3)],  # not warpers alone: HF's own path
    ],
)
def test_a_drafters_proposal_is_the_warped_distribution(warps):
    """`Decoding.proposal` (a drafter's q) computes HF's warped distribution on the top-k logits alone where the
    processors are HF's temperature / top-k / top-p warpers, and runs HF's processors otherwise: equal to
    softmax(process(...)) either way (random logits: no ties at the k-th)."""
    from ssmspec.speculate.decoding import Decoding

    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(0)) * 3
    seqs = [[1, 2, 3 + i] for i in range(6)]
    dec = Decoding(processors=[LogitsProcessorList(warps)] * 6, do_sample=True)
    want = dec.process(seqs, logits, list(range(6))).softmax(-1)
    got = dec.proposal(seqs, logits, list(range(6)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got > 0, want > 0)
