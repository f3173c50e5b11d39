"""Draft heads (ssmspec.speculate.drafters.head): the target's features are its LM head's input, a head trained on
the target predicts its next distribution far better than an untrained one, heads are saved, found beside a
checkpoint and refused for another model, and drafting with one never changes greedy output."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import ssmspec
from ssmspec import SpecConfig, UnsupportedModelError
from ssmspec.hf import features
from ssmspec.speculate.drafters.head import DraftHead, HeadDrafter
from ssmspec.speculate.engine import eos_and_pad, speculative_generate
from ssmspec.speculate.generic import GenericRunner
from ssmspec.speculate.head_training import collect, train_head
from ssmspec.speculate.retrieval import SuffixIndex
from ssmspec.speculate.runner import ModelRunner
from ssmspec.testing.strategies import cached_tiny_model
from ssmspec.tree import TokenTree


def _transformed(family: str, head: DraftHead | None = None):
    return ssmspec.transform(copy.deepcopy(cached_tiny_model(family)), draft_head=head)


@pytest.mark.parametrize("family", ["mamba2", "rwkv"])  # (xLSTM soft-caps its logits after the LM head)
def test_features_are_what_the_lm_head_reads(family):
    """Captured while ssmspec verifies (seams and the generic path): the LM head applied to a node's feature gives
    that node's logits; a plain forward, or a forward on another thread, captures nothing."""
    model = _transformed(family)
    kind = GenericRunner if model.ssmspec_info.path == "generic" else ModelRunner
    runner = kind(model, max_depth=4, max_nodes=5, capture_features=True)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    runner.prefill(ids, torch.ones_like(ids), keep=0)  # (every position's: an MTP layer reads them all)
    assert runner.features.shape[:2] == (1, 5)
    runner.prefill(ids, torch.ones_like(ids))  # (the last position's, as HF's prefill computes them)
    assert runner.features.shape[:2] == (1, 1 if kind is ModelRunner else 5)
    logits = runner.verify(TokenTree.chain(torch.tensor([[9, 3, 4]])))
    head = model.get_output_embeddings()
    torch.testing.assert_close(head(runner.features).to(logits.dtype), logits, rtol=1e-6, atol=1e-6)
    seen = []
    with features.capturing(model) as capture:
        thread = threading.Thread(target=lambda: seen.append(model(ids).logits))
        thread.start()
        thread.join()
    assert seen and capture.features is None  # another thread's forward is not this capture's


def test_heads_save_load_and_are_refused_for_another_model(tmp_path):
    model = cached_tiny_model("mamba2")
    head = DraftHead.for_model(model).double()
    head.save(tmp_path / "h", trained_on="nothing")
    again = DraftHead.load(tmp_path / "h")
    assert again.config == head.config
    assert all(torch.equal(a.double(), b) for a, b in zip(again.state_dict().values(), head.state_dict().values()))
    with pytest.raises(FileNotFoundError, match="draft_head.safetensors"):
        DraftHead.load(tmp_path)
    other = cached_tiny_model("bamba")  # another width
    wrong = DraftHead(head.config["hidden_size"] + 8, head.config["embedding_size"], head.config["vocab_size"])
    ref = copy.deepcopy(other)
    with pytest.raises(UnsupportedModelError, match="hidden_size .* != the target's"):
        ssmspec.transform(ref, draft_head=wrong)
    assert type(ref) is type(other) and "ssmspec_draft_head" not in ref.__dict__  # left as it was
    with pytest.raises(TypeError, match="draft_head must be"):
        ssmspec.transform(copy.deepcopy(other), draft_head=3)


def test_transform_finds_the_head_saved_beside_the_checkpoint(tmp_path):
    ref = copy.deepcopy(cached_tiny_model("mamba2"))
    ref.save_pretrained(tmp_path)
    DraftHead.for_model(ref).save(tmp_path)
    loaded = type(ref).from_pretrained(tmp_path, dtype=torch.float64)
    model = ssmspec.transform(loaded)
    assert isinstance(model.ssmspec_draft_head, DraftHead)
    assert ssmspec.transform(copy.deepcopy(ref)).ssmspec_draft_head is None  # no checkpoint: none
    assert ssmspec.transform(type(ref).from_pretrained(tmp_path), draft_head=None).ssmspec_draft_head is None
    assert "ssmspec_draft_head" not in dict(model.named_modules()) and not any(
        k.startswith("ssmspec") for k in model.state_dict()
    )  # not a submodule: HF's state dict as it was
    with pytest.raises(ValueError, match="needs a draft head"):
        ssmspec.transform(copy.deepcopy(ref)).generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=3, speculation=SpecConfig(drafter="draft_head")
        )


@pytest.mark.parametrize("family", ["mamba2", "bamba", "xlstm", "recurrent_gemma"])
def test_drafting_with_a_head_gives_hfs_greedy_output(family):
    """Trees (best first), chains, a left-padded batch where the family batches; the head untrained (its drafts
    mostly wrong) and trained (mostly right): the output is HF's either way."""
    ref = cached_tiny_model(family)
    head = DraftHead.for_model(ref).double()
    model = _transformed(family, head)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 0, 3, 4, 9, 3, 4, 9, 3, 4]])
    mask = (ids != 0).long()
    if not model.ssmspec_info.batches:
        ids, mask = ids[:1], mask[:1]
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    for spec in (SpecConfig(drafter="draft_head", tree_budget=6, num_draft_tokens=3, adaptive=False),
                 SpecConfig(drafter="draft_head", tree=False, num_draft_tokens=3, adaptive=False),
                 SpecConfig(drafter="draft_head")):  # fmt: skip
        if spec.tree and not model.ssmspec_info.trees:
            continue
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, speculation=spec,
                             return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(out.sequences, want)
        assert out.spec_stats["drafter"]["head_calls"] > 0


def _agreement(model, head, data) -> float:
    """1 - total variation between the target's next distribution and the head's, on collected positions."""
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    f, tokens = data["features"].double(), data["tokens"]
    with torch.no_grad():
        q = lm_head(head.double()(f[:, :-1], embed(tokens[:, 1:]))).softmax(-1)
        p = lm_head(f[:, 1:]).softmax(-1)
    return float(torch.minimum(p, q).sum(-1).mean())


def test_training_teaches_the_head_the_targets_next_distribution():
    """On text the target itself wrote (sampled, so it is what it predicts), a few hundred steps make the head's
    distribution much closer to the target's on held-out positions than an untrained head's; the target is not
    changed by training. (The tiny model's LM head is scaled up so its distributions are peaked, as a trained
    model's are: flat ones overlap whatever the head says.)"""
    ref = copy.deepcopy(cached_tiny_model("mamba2"))
    with torch.no_grad():
        ref.lm_head.weight.mul_(4.0)
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(3, 96, (24, 4), generator=gen)
    torch.manual_seed(0)
    text = ref.generate(starts, do_sample=True, max_new_tokens=60, min_new_tokens=60, top_k=0)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    train, test = collect(ref, text[:20], seq_len=32), collect(ref, text[20:], seq_len=32)
    assert train["features"].shape == (40, 32, ref.config.hidden_size) and train["top_ids"].shape[-1] == 64
    untrained = _agreement(ref, DraftHead.for_model(ref), test)
    head = train_head(ref, train, steps=300, batch_size=256, seed=0)
    trained = _agreement(ref, head, test)
    assert trained > 1.5 * untrained and trained > untrained + 0.08, (untrained, trained)  # measured 0.145 -> 0.27
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in before.items())
    assert all(p.requires_grad for p in ref.parameters())  # frozen only while training
    with pytest.raises(ValueError, match="no sequence holds"):
        collect(ref, [[5, 6, 7]], seq_len=32)


def test_head_drafter_proposes_trees_chains_and_sampled_trees():
    """The drafter's proposals: a best-first tree within the budget and depth, a chain, and when sampling every
    node with children carries the q they were drawn from (without replacement: distinct siblings)."""
    from ssmspec.speculate.decoding import Decoding

    ref = cached_tiny_model("mamba2")
    head = DraftHead.for_model(ref).double()
    drafter = HeadDrafter(head, ref, branches=3)
    drafter.start(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    assert drafter.propose([[5, 6], [7, 8]], 6, 3) == [([6], [-1]), ([8], [-1])]  # no feature yet: nothing
    for r in range(2):
        drafter.observe_features(r, torch.randn(ref.config.hidden_size, dtype=torch.float64))
    for tokens, parents in drafter.propose([[5, 6], [7, 8]], 6, 3):
        depth = [0]
        for p in parents[1:]:
            depth.append(depth[p] + 1)
        assert tokens[0] in (6, 8) and 1 < len(tokens) <= 7 and max(depth) <= 3
        assert all(p < t for t, p in enumerate(parents))
    chain = HeadDrafter(head, ref, tree=False)
    chain.start(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))
    chain.observe_features(0, torch.randn(ref.config.hidden_size, dtype=torch.float64))
    ((tokens, parents),) = chain.propose([[5, 6]], 4, 4)
    assert len(tokens) == 5 and parents == [-1, 0, 1, 2, 3]
    drafter.set_decoding(Decoding(do_sample=True, generator=torch.Generator().manual_seed(0)))
    for tokens, parents, qs in drafter.propose([[5, 6], [7, 8]], 6, 2):
        kids = {}
        for t, p in enumerate(parents[1:], 1):
            kids.setdefault(p, []).append(tokens[t])
        assert set(qs) == set(kids) and len(kids[0]) == 3
        assert all(len(set(k)) == len(k) for k in kids.values())
        assert all(abs(float(q.sum()) - 1) < 1e-5 for q in qs.values())


def test_a_target_compiled_whole_drafts_the_heads_chains_in_one_compiled_call():
    """On a target whose steps are compiled whole on a CPU, the head's greedy chains are one call of a compiled step
    (`CompiledChains`, one per batch size and depth, kept for later calls): the same chains as the head called op by op
    (float64), each a replay once compiled; trees, a target not compiled whole, or recorded steps run without
    Inductor keep the head's own calls."""
    from ssmspec.compile.lower import StepCompiler
    from ssmspec.speculate.drafters.head import CompiledChains

    ref = cached_tiny_model("mamba2")
    torch.manual_seed(0)
    head = DraftHead.for_model(ref).double()
    eager, compiled = _transformed("mamba2"), _transformed("mamba2")
    compiled.__dict__["_ssmspec_step_compiler"] = StepCompiler(compiled, progress=False)
    made = []

    def propose(model, rows, depth, tree=False):
        drafter = HeadDrafter(head, model, tree=tree)
        drafter.start(torch.zeros(len(rows), 3, dtype=torch.long), torch.ones(len(rows), 3, dtype=torch.long))
        for r in range(len(rows)):
            drafter.observe_features(r, feats[r])
        made.append(drafter)
        return drafter.propose(rows, depth, depth)

    feats = torch.randn(2, ref.config.hidden_size, dtype=torch.float64)
    rows = [[5, 6], [7, 8]]
    for depth in (1, 3, 3):
        want = propose(eager, rows, depth)
        assert made[-1].chains is None
        got = propose(compiled, rows, depth)
        assert got == want and all(parents == list(range(-1, depth)) for _, parents in got)
        chains = made[-1].chains
        assert isinstance(chains, CompiledChains) and made[-1].steps == depth
    assert set(chains.graphs) == {(2, 1), (2, 3)} and chains.compiler.compilations == 2  # (the second 3 replayed)
    assert chains.graphs[(2, 3)][0].replays == 1
    propose(compiled, rows, 2, tree=True)
    assert made[-1].chains is None  # (a tree: the head's own calls)
    compiled.__dict__["_ssmspec_step_compiler"] = StepCompiler(compiled, progress=False, inductor=False)
    propose(compiled, rows, 2)
    assert made[-1].chains is None


def test_a_fused_head_and_retrieval_tree_is_exact():
    ref = cached_tiny_model("mamba2")
    model = _transformed("mamba2", DraftHead.for_model(ref).double())
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    want = ref.generate(ids, max_new_tokens=16, do_sample=False)
    corpus = SuffixIndex.from_sequences([[5, 6, 7, 8, 5, 6, 7, 8] * 4])
    spec = SpecConfig(drafter="draft_head", corpus=corpus, tree_budget=8, num_draft_tokens=4)
    assert torch.equal(model.generate(ids, max_new_tokens=16, speculation=spec), want)
    with pytest.raises(ValueError, match="draft head is used by tree=True"):
        SpecConfig(drafter="draft_head", corpus=corpus, tree=False)


def test_speculative_generate_hands_the_drafter_every_committed_feature():
    """Before every proposal the drafter gets the feature of each row's last committed position (after the prefill,
    then from the step before; plain steps in between hand it nothing): its LM head's argmax is the token that step
    emitted last, the proposal's root (greedy)."""
    ref = cached_tiny_model("mamba2")
    model = _transformed("mamba2")
    head = DraftHead.for_model(ref).double()
    seen, roots = [], []

    class Recording(HeadDrafter):
        def observe_features(self, row, feature):
            seen.append(feature)
            super().observe_features(row, feature)

        def propose(self, contexts, max_nodes, max_depth):
            roots.append(contexts[0][-1])
            return super().propose(contexts, max_nodes, max_depth)

    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    eos, pad = eos_and_pad(ref.generation_config)
    out, stats, _ = speculative_generate(model, ids, torch.ones_like(ids), max_new_tokens=12, eos_token_ids=eos,
                                         pad_token_id=pad, drafter=Recording(head, model), tree_budget=4,
                                         num_draft_tokens=2)  # fmt: skip
    assert torch.equal(out, ref.generate(ids, max_new_tokens=12, do_sample=False))
    assert len(seen) == len(roots) == stats.verify_steps  # the last step's feature: no proposal followed
    lm_head = model.get_output_embeddings()
    assert [int(lm_head(f).argmax()) for f in seen] == roots


def test_a_model_compiled_before_its_features_were_hooked_drafts_with_its_head():
    """A model with a draft head is compiled with its LM head's feature hook. One compiled before it had a head (its
    default call drafted with n-grams) has graphs traced without the hook, which would never hand a draft-head call
    the features (Dynamo does not guard on module hooks): given a head by `transform`, it is hooked and compiled
    anew, and drafts as an eager model does."""
    torch.manual_seed(0)
    model = _transformed("mamba2")
    model.compile(backend="eager")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    model.generate(ids, max_new_tokens=4)  # n-grams: nothing hooked
    assert not model.get_output_embeddings()._forward_pre_hooks
    ssmspec.transform(model, draft_head=DraftHead.for_model(cached_tiny_model("mamba2")).double())
    assert model.get_output_embeddings()._forward_pre_hooks
    spec = SpecConfig(drafter="draft_head", tree=False, num_draft_tokens=2, adaptive=False)
    out = model.generate(ids, max_new_tokens=6, speculation=spec, return_dict_in_generate=True)
    ref = cached_tiny_model("mamba2").generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats["drafter"]["head_calls"] > 0
