"""The generic path (ssmspec.speculate.generic): families without kernel seams speculate through HF's own
forward and cache, exactly (HF greedy in float64), chains, batches row by row; the probe decides where it may run;
`SpecConfig(path=...)` forces it (or the seams) and refuses what it cannot do, naming why."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ssmspec
from ssmspec import SpecConfig, UnsupportedModelError
from ssmspec.hf.generic import HFState
from ssmspec.ops.mlstm import run_tree_mlstm
from ssmspec.speculate.engine import eos_and_pad, speculative_generate
from ssmspec.speculate.generic import CHAINS_ONLY, ONE_PROMPT, ROW_BY_ROW, GenericRunner
from ssmspec.testing.configs import GENERIC_FAMILIES, SUPPORTED_FAMILIES, build_tiny_model
from ssmspec.testing.drafters import OracleDrafter
from ssmspec.testing.strategies import cached_tiny_model, drafter_factories, prompts
from ssmspec.transform import generic_allowed
from ssmspec.tree import TokenTree

_THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
# seam families the generic path is forced on: in the ci profile an SSD hybrid, the gated delta rule and short
# convs; in thorough every one but the Mamba1 mixers' (HF's, Zamba v1's too, ignore the cached state in a
# multi-token forward: the generic probe refuses them, test_forcing_a_path_is_checked_and_refused_where_inexact)
FORCED = (
    tuple(f for f in SUPPORTED_FAMILIES if f not in ("mamba", "falcon_mamba", "jamba", "zamba"))
    if _THOROUGH
    else ("bamba", "qwen3_next", "lfm2")
)
_MODELS: dict[str, torch.nn.Module] = {}


def _transformed(family: str, variant: int = 0) -> torch.nn.Module:
    key = f"{family}/{variant}"
    if key not in _MODELS:
        _MODELS[key] = ssmspec.transform(copy.deepcopy(cached_tiny_model(family, variant)))
    return _MODELS[key]


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_families_without_seams_speculate_exactly_through_hfs_forward(family):
    ref = cached_tiny_model(family)
    model = _transformed(family)
    info = model.ssmspec_info
    # the families here with tree forms (hf.tree_modules)
    trees = family in ("xlstm", "rwkv", "minimax", "zaya", "recurrent_gemma")
    assert info.path == "generic" and info.generic and info.limits["seams"]
    assert info.trees == info.generic_trees == trees
    assert info.limits.get("trees") == (None if trees else CHAINS_ONLY) and info.generic_batches == info.batches
    # HF's RecurrentGemma drops its conv state in a multi-token forward: every multi-node step, chains too, goes
    # through its modules' tree forms (the chain probe's reason kept)
    assert ("chains" in info.limits) == (family == "recurrent_gemma")
    # HF's RWKV broadcasts each row's token shift over the whole batch in a one-token step, and HF's MiniMax cache
    # hides the cached positions from its decode masks (pads are attended to): their batches are not what their rows
    # compute alone, so the probe refuses them
    assert info.batches == (family not in ("rwkv", "minimax"))
    assert info.limits["batches"] == ROW_BY_ROW if info.batches else "rows' verified alone" in info.limits["batches"]
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    want = ref.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=24), want)  # the default call: chains
    assert torch.equal(model.generate(ids, max_new_tokens=24, prompt_lookup_num_tokens=4), want)
    # drafts right for two tokens, then wrong: every step commits part of a chain (snapshot restored, prefix fed)
    rows = [want[0].tolist()]
    out, stats, _ = speculative_generate(
        model, ids, torch.ones_like(ids), max_new_tokens=24, eos_token_ids=[], pad_token_id=0,
        drafter=OracleDrafter(rows, vocab_size=96, right_prefix=2), tree_budget=4, num_draft_tokens=4, generic=True,
    )  # fmt: skip
    assert torch.equal(out, want[:, : out.shape[1]]) and stats.accepted_tokens >= 2 * (stats.verify_steps - 1)
    # a left-padded batch: the default call is HF's own batched loop; asked for, speculation runs row by row
    batch = torch.cat([ids, torch.tensor([[0, 0, 0, 9, 10, 11, 9, 10, 11, 9]])])
    mask = (batch != 0).long()
    want = ref.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want) and not hasattr(out, "spec_stats")  # HF's own
    spec = SpecConfig(tree=False, num_draft_tokens=3, adaptive=False)
    if info.batches:
        out = model.generate(batch, attention_mask=mask, max_new_tokens=12, speculation=spec,
                             return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(out.sequences, want) and out.spec_stats["path"] == "generic"
    else:
        with pytest.raises(UnsupportedModelError, match="the generic path on a batch: .*verified alone"):
            model.generate(batch, attention_mask=mask, max_new_tokens=12, speculation=spec)
    if trees:
        want = ref.generate(ids, max_new_tokens=24, do_sample=False)
        out = model.generate(ids, max_new_tokens=24, speculation=SpecConfig(tree=True, adaptive=False, tree_budget=8),
                             return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(out.sequences, want) and max(out.spec_stats["tree_nodes_per_step"]) > 1
    else:
        with pytest.raises(UnsupportedModelError, match="verifies chains"):
            model.generate(ids, max_new_tokens=5, speculation=SpecConfig(tree=True))
    with pytest.raises(UnsupportedModelError, match="path='seams'"):
        model.generate(ids, max_new_tokens=5, speculation=SpecConfig(tree=False, path="seams"))


@pytest.mark.parametrize("family", GENERIC_FAMILIES + FORCED)
@settings(max_examples=60 if _THOROUGH else 4)
@given(data=st.data())
def test_generic_path_equals_hf_greedy(family, data):
    """Property: on the generic path (forced on seam families), speculative greedy output equals HF's, for any
    drafter (adversarial ones included; trees where the path verifies them), left-padded batch (row by row), depth
    and EOS."""
    variant = data.draw(st.integers(0, 2 if _THOROUGH else 1), label="variant")  # ci: two of the three shapes
    ref = cached_tiny_model(family, variant)
    model = _transformed(family, variant)
    vocab = ref.config.get_text_config().vocab_size
    batches = generic_allowed(model, batch=True)  # HF's batches are what its rows compute alone (not RWKV's)
    max_rows = (3 if _THOROUGH else 2) if batches else 1
    ids, mask = data.draw(prompts(vocab, max_batch=max_rows, allow_all_padding=False), label="prompt")
    if not batches:  # generate refuses a left-padded prompt where the batch probe failed (HF's rows differ)
        ids, mask = ids[:, mask[0].bool()], mask[:, mask[0].bool()]
    trees = model.ssmspec_info.path == "generic" and model.ssmspec_info.generic_trees
    _, factory = data.draw(drafter_factories(vocab, trees=trees), label="drafter")
    max_new = data.draw(st.integers(1, 12), label="max_new_tokens")
    depth = data.draw(st.integers(1, 6), label="num_draft_tokens")
    budget = data.draw(st.integers(depth, 2 * depth), label="tree_budget") if trees else depth
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False)
    eos, pad = eos_and_pad(ref.generation_config)
    if data.draw(st.booleans(), label="eos from reference"):  # stop on a token the model really emits
        eos = [int(want[0, -1])]
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=eos[0])
    rows = [ids[r][mask[r].bool()].tolist() + want[r, ids.shape[1] :].tolist() for r in range(ids.shape[0])]
    got, _, _ = speculative_generate(
        model, ids, mask, max_new_tokens=max_new, eos_token_ids=eos, pad_token_id=pad, drafter=factory(rows),
        tree_budget=budget, num_draft_tokens=depth, generic=True,
    )  # fmt: skip
    assert torch.equal(got, want)


def _hf_states(ref: torch.nn.Module, tokens: list[int]) -> HFState:
    """HF's loop after `tokens`: the first four prefilled, then one token per forward (its cache as HF keeps it)."""
    ids = torch.tensor([tokens[:4]])
    state = HFState(ref, ids, torch.ones_like(ids), as_hf=True)
    state.forward()
    for t in tokens[4:]:
        state.forward(torch.tensor([[t]]))
    return state


@pytest.mark.parametrize("form", ["tree op", "steps, all kept", "steps, none kept", "steps, two kept"])
def test_tree_form_verifies_each_node_on_its_path_and_commits_hfs_state(form, monkeypatch):
    """xLSTM on the generic path: a branching tree in one forward gives every node the logits HF's loop computes
    for the node's path, the cache keeps its committed state while verifying, a commit leaves the state (every
    layer's C, n, m and the token counter) HF's loop reaches over the accepted path, a discard leaves it as it
    was. With the tree op (ssmspec.ops.mlstm), and with the module's own forward stepped node by node (the nodes'
    states kept from the verification: all, none or the first two, the rest replayed at the commit)."""
    import dataclasses

    from ssmspec.hf import tree_modules

    ref = cached_tiny_model("xlstm")
    # the tree op runs in float32 (HF's xLSTM keeps its decode step's state in float32 at most, rounding it after
    # every token, which the tree op cannot: a float64 model steps); the module's own steps are HF's bit for bit
    tol = 1e-9
    if form == "tree op":
        ref, tol = copy.deepcopy(ref).float(), 2e-5
    model = ssmspec.transform(copy.deepcopy(ref)) if form == "tree op" else copy.deepcopy(_transformed("xlstm"))
    kept = {"tree op": None, "steps, all kept": None, "steps, none kept": 0, "steps, two kept": 2}[form]
    for step in tree_modules.installed(model):
        assert step.kind.tree_op is not None
        if form != "tree op":
            step.kind = dataclasses.replace(step.kind, tree_op=None)
    calls = []
    monkeypatch.setattr(tree_modules, "run_tree_mlstm", lambda *a: calls.append(1) or run_tree_mlstm(*a))
    runner = GenericRunner(model)
    assert runner.trees and not runner.reruns
    prompt = [5, 6, 7, 8]
    runner.prefill(torch.tensor([prompt]), torch.ones(1, 4, dtype=torch.long))
    cache = runner.rows[0].state.cache
    if kept is not None:  # the budget for `kept` nodes' float32 states in every layer
        layer = sum(s.numel() * 4 for s in cache.rnn_state[0])
        monkeypatch.setattr(tree_modules, "KEEP_BYTES", kept * layer * len(cache.rnn_state))
    before = [tuple(s.clone() for s in cache.rnn_state[i]) for i in cache.rnn_state]
    tree = TokenTree.from_lists([[9, 10, 11, 12, 13, 14]], [[-1, 0, 0, 1, 2, 2]])
    logits = runner.verify(tree)
    for node in range(tree.num_nodes):
        path = prompt + tree.tokens[0, tree.path_nodes(0, node)].tolist()
        want = _hf_states(ref, path[:-1]).forward(torch.tensor([path[-1:]]))[0, -1]
        torch.testing.assert_close(logits[0, node], want, rtol=tol, atol=tol * float(want.abs().max()))
    for i, state in enumerate(before):  # verifying changed nothing in the cache
        assert all(torch.equal(a, b) for a, b in zip(cache.rnn_state[i], state))
    runner.discard()
    assert all(torch.equal(a, b) for i, s in enumerate(before) for a, b in zip(cache.rnn_state[i], s))
    assert int(cache.seqlen_offset) == 4 and runner.rows[0].state.length == 4
    runner.verify(tree)
    runner.commit(torch.tensor([5]))  # the path 0 -> 2 -> 5
    want = _hf_states(ref, prompt + [9, 11, 14])
    for i in cache.rnn_state:
        for got, exp in zip(cache.rnn_state[i], want.cache.rnn_state[i]):
            torch.testing.assert_close(got, exp, rtol=tol, atol=tol * float(exp.abs().max().clamp(min=1)))
    assert int(cache.seqlen_offset) == int(want.cache.seqlen_offset) == 7
    assert runner.rows[0].state.ids.tolist() == [prompt + [9, 11, 14]] and runner.n_real.tolist() == [7]
    assert bool(calls) == (form == "tree op")  # which form ran


@pytest.mark.parametrize("family", ["rwkv", "minimax", "zaya", "recurrent_gemma"])
def test_tree_forms_of_whole_modules_verify_each_path_and_commit_hfs_state(family):
    """Tree forms that replace a module's forward while verifying (ssmspec.hf.tree_modules, `Kind.tree_forward`).
    RWKV: each node's token shift reads its parent's input and its WKV recurrence (ssmspec.ops.wkv) its parent's
    state. MiniMax: its lightning attention's recurrence (ssmspec.ops.lightning) from the parent's state, its
    softmax attention over the cached keys and the node's ancestors at the node's depth. RecurrentGemma: its
    recurrent block's conv window over the node's path and its RG-LRU (ssmspec.ops.rglru) from the parent's state,
    both kept on its modules (held per state by HFState), its sliding-window attention at each node's position.
    Every node gets the logits HF's loop computes for its path; the cache keeps its committed values while
    verifying and after a discard, and a commit leaves what HF's loop reaches over the accepted path (every tensor
    of its cache and of the state its modules hold)."""
    from torch import nn

    from ssmspec.hf import tree_modules
    from ssmspec.testing.check import _tensors

    ref = cached_tiny_model(family)
    model = _transformed(family)
    steps = tree_modules.installed(model)
    kinds = {
        "rwkv": {"RwkvSelfAttention", "RwkvFeedForward"},
        "minimax": {"MiniMaxLightningAttention", "MiniMaxAttention"},
        "zaya": {"ZayaAttention"},
        "recurrent_gemma": {"RecurrentGemmaRecurrentBlock", "RecurrentGemmaAttention"},
    }
    assert {type(s.module).__name__ for s in steps} == kinds[family]
    runner = GenericRunner(model)
    assert runner.trees and not runner.reruns
    prompt = [5, 6, 7, 8]
    runner.prefill(torch.tensor([prompt]), torch.ones(1, 4, dtype=torch.long))
    state = runner.rows[0].state
    held = [(m, name, getattr(m, name)) for m, name in state.slots]  # what the modules held before: HF's None

    def tensors(s: HFState) -> list[torch.Tensor]:  # the cache object's and the modules' state
        return _tensors([s.cache, s.held])

    before = [t.clone() for t in tensors(state)]
    assert before and (family == "recurrent_gemma") == bool(state.held)
    tree = TokenTree.from_lists([[9, 10, 11, 12, 13, 14]], [[-1, 0, 0, 1, 2, 2]])
    logits = runner.verify(tree)
    for node in range(tree.num_nodes):
        path = prompt + tree.tokens[0, tree.path_nodes(0, node)].tolist()
        want = _hf_states(ref, path[:-1]).forward(torch.tensor([path[-1:]]))[0, -1]
        torch.testing.assert_close(logits[0, node], want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))

    def unchanged() -> bool:
        now = tensors(state)
        return len(now) == len(before) and all(torch.equal(a, b) for a, b in zip(now, before))

    assert unchanged()  # verifying changed nothing in the cache
    assert all(getattr(m, name) is value for m, name, value in held)  # nor in the user's modules
    if family == "rwkv":  # outside a verification the shift is HF's
        assert all(isinstance(s.module.time_shift.shift, nn.ZeroPad2d) for s in steps)
    ids = torch.tensor([prompt + [9, 11, 14]])
    with torch.no_grad():  # a plain forward of the transformed model is HF's, bit for bit
        assert torch.equal(model(ids).logits, ref(ids).logits)
    runner.discard()
    assert unchanged() and runner.rows[0].state.length == 4
    runner.verify(tree)
    runner.commit(torch.tensor([5]))  # the path 0 -> 2 -> 5
    want = tensors(_hf_states(ref, prompt + [9, 11, 14]))
    got = tensors(state)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9 * float(w.abs().max().clamp(min=1)))
    assert runner.rows[0].state.ids.tolist() == [prompt + [9, 11, 14]] and runner.n_real.tolist() == [7]
    copied = copy.deepcopy(model)
    tree_modules.uninstall(copied)  # what a refused transform does: HF's modules as they were
    assert not tree_modules.installed(copied)
    assert all(type(m.time_shift) is nn.ZeroPad2d for m in copied.modules() if hasattr(m, "time_shift"))


def test_the_batch_probe_checks_padded_rows_through_the_tree_form(monkeypatch):
    """The tree probe feeds unpadded prompts; the batch probe verifies its left-padded rows through the tree form
    the runner will use, so an attention tree form that lets nodes see the pads is refused for batches (and a
    left-padded prompt), its trees kept for unpadded prompts."""
    from ssmspec.hf import tree_modules

    monkeypatch.setattr(
        tree_modules, "_visible_past", lambda mask, b, past, device: torch.ones(b, past, dtype=torch.bool)
    )
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("zaya")))
    info = model.ssmspec_info
    assert info.generic_trees and not info.batches and "left-padded" in info.limits["batches"]


def test_an_inexact_tree_form_is_refused_and_chains_stay(monkeypatch):
    """The tree form is probed by value: one that steps each node from the node before it (not its parent) is
    refused at transform, which then leaves the model with chains (its tree form removed, chains exact)."""
    from ssmspec.hf import tree_modules

    real = tree_modules.verifying

    def wrong_parents(steps, parents):
        return real(steps, [t - 1 for t in range(len(parents))])

    monkeypatch.setattr(tree_modules, "verifying", wrong_parents)
    ref = cached_tiny_model("xlstm")
    model = ssmspec.transform(copy.deepcopy(ref))
    info = model.ssmspec_info
    assert not info.trees and not info.generic_trees and not tree_modules.installed(model)
    assert info.limits["trees"].startswith(CHAINS_ONLY) and "tree form is not exact" in info.limits["trees"]
    assert "differs from its decode steps" in info.limits["trees"]
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    assert torch.equal(model.generate(ids, max_new_tokens=16), ref.generate(ids, max_new_tokens=16, do_sample=False))
    with pytest.raises(UnsupportedModelError, match="verifies chains"):
        model.generate(ids, max_new_tokens=5, speculation=SpecConfig(tree=True))


def test_forcing_a_path_is_checked_and_refused_where_inexact():
    """SpecConfig(path="generic") on a seam family runs the generic probe once; HF's Mamba and Zamba v1 ignore the
    cached state in a multi-token forward, so the generic path is refused there, with the probe's reason."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    model = _transformed("mamba2")
    assert model.ssmspec_info.path == "seams" and model.ssmspec_info.generic is None
    want = cached_tiny_model("mamba2").generate(ids, max_new_tokens=16, do_sample=False)
    spec = SpecConfig(path="generic", tree=False, num_draft_tokens=4, adaptive=False)
    out = model.generate(ids, max_new_tokens=16, speculation=spec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want) and model.ssmspec_info.generic is True  # probed, then run
    with pytest.raises(UnsupportedModelError, match="verifies chains"):
        model.generate(ids, max_new_tokens=4, speculation=SpecConfig(path="generic"))
    for family in ("mamba", "zamba"):  # Zamba v1's per-head scans start from a zero state too
        mamba = copy.deepcopy(_transformed(family))
        with pytest.raises(UnsupportedModelError, match="the generic path: .*one-token steps"):
            mamba.generate(ids, max_new_tokens=4, speculation=spec)
        assert mamba.ssmspec_info.generic is False and "one-token steps" in mamba.ssmspec_info.limits["generic"]
    with pytest.raises(ValueError, match="path must be one of"):
        SpecConfig(path="fast")


def test_generic_sampling_draws_what_the_seams_draw():
    """Sampling verification does not depend on the runner: with the same seed, speculative sampling through
    HF's forward (forced generic) and through the seams draws the same tokens (float64: the same logits), so
    the seams' chi-square suite carries over."""
    model = _transformed("qwen3_next")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    runs = []
    for path in ("seams", "generic"):
        spec = SpecConfig(path=path, tree=False, num_draft_tokens=3, adaptive=False)
        runs.append(model.generate(ids, do_sample=True, top_k=20, max_new_tokens=16, speculation=spec,
                                   generator=torch.Generator().manual_seed(7)))  # fmt: skip
    assert torch.equal(runs[0], runs[1])


def test_hf_state_and_runner_refuse_misuse():
    model = build_tiny_model("rwkv")
    ids = torch.tensor([[5, 6, 7]])
    state = HFState(model, ids, torch.ones_like(ids))
    state.forward()
    snap = state.snapshot()
    state.forward(torch.tensor([[9, 10]]))
    state.restore(snap)
    assert state.length == 3 and state.ids.shape[1] == 3
    with pytest.raises(RuntimeError, match="restored already"):
        state.restore(snap)
    runner = GenericRunner(model)
    runner.prefill(ids, torch.ones_like(ids))
    with pytest.raises(UnsupportedModelError, match="verifies chains"):
        runner.verify(TokenTree.from_lists([[9, 10, 11]], [[-1, 0, 0]]))
    runner.verify(TokenTree.chain(torch.tensor([[9]])))
    with pytest.raises(RuntimeError, match="cannot be discarded"):
        runner.discard()


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_a_draft_model_without_seams_drafts_through_hfs_forward(family):
    """A draft of a family without kernel seams (transform gives it the generic path) drafts through HF's own forward
    and cache: greedy chains and sampling, exact (a draft only changes the speed); it was refused."""
    from ssmspec.speculate.drafters import DraftModelDrafter
    from ssmspec.transform import prepare_draft

    ref = cached_tiny_model("mamba2")
    target = ssmspec.transform(copy.deepcopy(ref))
    draft = build_tiny_model(family)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11, 12, 9, 10, 11, 12]])
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    spec = SpecConfig(drafter="draft_model", adaptive=False, num_draft_tokens=3)
    out = target.generate(ids, max_new_tokens=12, assistant_model=draft, speculation=spec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert max(out.spec_stats["tree_nodes_per_step"]) > 1  # it drafted
    assert torch.equal(target.generate(ids, max_new_tokens=12, assistant_model=draft), want)
    seeded = [target.generate(ids, max_new_tokens=8, do_sample=True, assistant_model=draft, speculation=spec,
                              generator=torch.Generator().manual_seed(4)) for _ in range(2)]  # fmt: skip
    assert torch.equal(seeded[0], seeded[1])
    drafter = DraftModelDrafter(prepare_draft(draft), 96, tree=True)
    assert isinstance(drafter.runner, GenericRunner) and drafter.tree == drafter.runner.trees


def _qwen3_5_vl() -> torch.nn.Module:
    """A tiny Qwen3.5 vision-language model (the conditional-generation class users download) in float64."""
    import transformers

    from ssmspec.testing.configs import _TOKEN_IDS, _qwen3_5

    text = {**_qwen3_5(0), **_TOKEN_IDS, "vocab_size": 96}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
              "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 32, "in_channels": 3}  # fmt: skip
    tokens = {"image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 92, "vision_end_token_id": 93}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).double().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    return model


def _speculates_on_text(ref: torch.nn.Module) -> torch.nn.Module:
    """A multimodal model transformed: its backbone's seams, trees and batches, a left-padded text batch equal to
    HF greedy through them. Returns the transformed model."""
    model = ssmspec.transform(copy.deepcopy(ref))
    assert model.ssmspec_info.path == "seams" and model.ssmspec_info.trees and model.ssmspec_info.batches
    text = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8], [0, 0, 9, 10, 11, 9, 10, 11]])
    mask = (text != 0).long()
    want = ref.generate(text, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(text, attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want) and out.spec_stats["path"] == "seams"
    return model


def test_a_multimodal_model_speculates_on_text_and_on_prompts_with_images():
    """The conditional-generation class of a supported backbone: text prompts on the seams (trees, batches);
    a prompt with an image through the generic path, the pixels and grids going to HF's prefill, positions
    (3-D rotary, shifted by the image) and token types continued as HF's generate continues them."""
    ref = _qwen3_5_vl()
    model = _speculates_on_text(ref)
    # an 8 x 8 image: 4 patches of 4 x 4 (2 frames), merged 2 x 2 into one image token (id 90)
    ids = torch.tensor([[5, 6, 92, 90, 93, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]])
    image = {"pixel_values": torch.randn(4, 3 * 2 * 4 * 4, dtype=torch.float64,
                                         generator=torch.Generator().manual_seed(1)),
             "image_grid_thw": torch.tensor([[1, 2, 2]]), "mm_token_type_ids": (ids == 90).long()}  # fmt: skip
    want = ref.generate(ids, **image, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, **image, max_new_tokens=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want) and out.spec_stats["path"] == "generic"
    rows = [want[0].tolist()]
    for right in (None, 1):  # drafts always right / right for one token then wrong: partial commits carry
        got, stats, _ = speculative_generate(
            model, ids, torch.ones_like(ids), max_new_tokens=16, eos_token_ids=[2], pad_token_id=0,
            drafter=OracleDrafter(rows, vocab_size=96, right_prefix=right), tree_budget=4, num_draft_tokens=4,
            generic=True, model_inputs=image,
        )  # fmt: skip
        assert torch.equal(got, want) and stats.accepted_tokens > 0
    with pytest.raises(ssmspec.UnsupportedSettingError, match="pixel_values"):  # a prefill the seams cannot do
        model.generate(ids, **image, max_new_tokens=4, speculation=SpecConfig(path="seams", tree=False))
    with pytest.raises(UnsupportedModelError, match="verifies chains"):
        model.generate(ids, **image, max_new_tokens=4, speculation=SpecConfig(tree=True))
    two = {"pixel_values": image["pixel_values"].repeat(2, 1), "image_grid_thw": image["image_grid_thw"].repeat(2, 1),
           "mm_token_type_ids": image["mm_token_type_ids"].repeat(2, 1)}  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=ONE_PROMPT.replace("(", r"\(").replace(")", r"\)")):
        model.generate(ids.repeat(2, 1), **two, max_new_tokens=4, speculation=SpecConfig(tree=False))
    with pytest.raises(ValueError, match="does not take"):
        model.generate(ids, max_new_tokens=4, position_ids=torch.arange(ids.shape[1])[None])


def test_another_multimodal_family_speculates_on_prompts_with_images():
    """LFM2-VL (a short-conv backbone behind a SigLIP2 tower, image tokens in place): text prompts on the seams,
    a prompt with an image through the generic path, drafts accepted whole and in part."""
    import transformers

    from ssmspec.testing.configs import _TOKEN_IDS, _lfm2

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "patch_size": 4, "num_patches": 16}  # fmt: skip
    text = {**_lfm2(0), **_TOKEN_IDS, "vocab_size": 96}
    config = transformers.Lfm2VlConfig(text_config=text, vision_config=vision, image_token_id=90,
                                       projector_hidden_size=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.Lfm2VlForConditionalGeneration(config).double().eval()
    ref.generation_config.pad_token_id, ref.generation_config.eos_token_id = 0, 2
    model = _speculates_on_text(ref)
    # a 16 x 16 image: 16 patches of 4 x 4, unshuffled 2 x 2 into four image tokens (id 90)
    ids = torch.tensor([[5, 6, 90, 90, 90, 90, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]])
    pixels = torch.randn(1, 16, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    image = {"pixel_values": pixels, "spatial_shapes": torch.tensor([[4, 4]]),
             "pixel_attention_mask": torch.ones(1, 16, dtype=torch.long)}  # fmt: skip
    want = ref.generate(ids, **image, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, **image, max_new_tokens=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want) and out.spec_stats["path"] == "generic"
    for right in (None, 1):
        got, stats, _ = speculative_generate(
            model, ids, torch.ones_like(ids), max_new_tokens=16, eos_token_ids=[2], pad_token_id=0,
            drafter=OracleDrafter([want[0].tolist()], vocab_size=96, right_prefix=right), tree_budget=4,
            num_draft_tokens=4, generic=True, model_inputs=image,
        )  # fmt: skip
        assert torch.equal(got, want) and stats.accepted_tokens > 0
