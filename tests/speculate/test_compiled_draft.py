"""A compiled draft model: it runs with static shapes (trees padded to buckets, fixed-length commits), it keeps
its own recompilation budget apart from a target of the same class (whose forward is the same code object),
VocabTrim applies to it, and outputs equal HF greedy."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import ssmspec
from ssmspec.speculate.drafters import DraftModelDrafter, TrimmedHead, trim_vocab
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.runner import bucket
from ssmspec.testing.strategies import cached_tiny_model
from ssmspec.transform import prepare_draft

ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters
IDS = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])


def _compiled(model, **kwargs):
    out = ssmspec.transform(copy.deepcopy(model))
    out.compile(backend="ssmspec", fullgraph=True, dynamic=False, options={"inductor": False}, **kwargs)
    return out


def _models():
    return cached_tiny_model("mamba2", dtype=torch.float32), cached_tiny_model("mamba2", dtype=torch.float32, seed=1)


def _generate_all(target, draft, want):
    spec = ssmspec.SpecConfig
    tree = spec(drafter="draft_model", num_draft_tokens=3, tree=True, tree_budget=8)
    for kw in (dict(num_assistant_tokens=4), dict(speculation=tree)):
        out = target.generate(IDS, max_new_tokens=40, assistant_model=draft, eos_token_id=None, **kw)
        assert torch.equal(out, want)


@pytest.mark.skipif(not ISOLATES, reason="this torch's torch.compile has no isolate_recompiles")
def test_target_and_draft_of_one_class_keep_their_own_graphs():
    """fullgraph=True turns Dynamo's recompile limit into an error: with both models on one code object's 8
    entries (what the user's own isolate_recompiles=False asks for) the run fails; by default each compiled
    model has its own budget and every graph compiles."""
    ref, draft_ref = _models()
    want = ref.generate(IDS, max_new_tokens=40, do_sample=False, eos_token_id=None)
    torch._dynamo.reset()
    _generate_all(_compiled(ref), _compiled(draft_ref), want)
    torch._dynamo.reset()
    shared = dict(isolate_recompiles=False, recompile_limit=8)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        _generate_all(_compiled(ref, **shared), _compiled(draft_ref, **shared), want)
    torch._dynamo.reset()


def test_a_compiled_draft_verifies_bucketed_trees():
    """Every tree the compiled draft verifies has a bucket's node count; an eager draft's has its own."""
    ref, draft_ref = _models()
    want = ref.generate(IDS, max_new_tokens=40, do_sample=False, eos_token_id=None)
    target = ssmspec.transform(copy.deepcopy(ref))
    for draft, static in ((_compiled(draft_ref), True), (prepare_draft(draft_ref), False)):
        drafter = DraftModelDrafter(draft, 96, tree=True, max_nodes=10, max_depth=3)
        assert drafter.runner.static_shapes is static
        sizes = []
        verify = drafter.runner.verify
        drafter.runner.verify = lambda tree: sizes.append(tree.num_nodes) or verify(tree)
        out, _, _ = speculative_generate(
            target, IDS, torch.ones_like(IDS), max_new_tokens=40, eos_token_ids=[], pad_token_id=0, drafter=drafter,
            tree_budget=8, num_draft_tokens=3,
        )  # fmt: skip
        assert torch.equal(out, want)
        padded = {n for n in sizes if n > 1 and bucket(n, 10) != n}
        assert not padded if static else padded  # the eager draft does verify unpadded sizes


def test_a_compiled_draft_catches_up_past_its_commit_length():
    """Under HF's heuristic schedule the depth grows past num_assistant_tokens: the draft's fixed commit length
    widens instead of cutting a path short (a draft identical to the target then keeps accepting everything)."""
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    want = ref.generate(IDS, max_new_tokens=60, do_sample=False, eos_token_id=None)
    target = ssmspec.transform(copy.deepcopy(ref))
    draft = _compiled(ref)
    out = target.generate(
        IDS, max_new_tokens=60, assistant_model=draft, num_assistant_tokens=2, eos_token_id=None,
        num_assistant_tokens_schedule="heuristic", return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, want)
    # depths 2, 4, 6, ...: every step accepts its whole draft (a wrong draft state would break the run)
    assert out.spec_stats["mean_accepted_per_step"] > 5


def test_vocab_trim_applies_to_a_compiled_draft():
    """A compiled draft's forward is bound to the draft: VocabTrim masks its logits (drafter) or compiles the
    trimmed copy (trim_vocab); either way only kept ids are proposed, and the user's draft is unchanged."""
    ref, draft_ref = _models()
    want = ref.generate(IDS, max_new_tokens=40, do_sample=False, eos_token_id=None)
    draft = _compiled(draft_ref)
    keep = torch.arange(0, 96, 3)
    drafter = DraftModelDrafter(draft, 96, tree=True, vocab=keep)
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda *a: [proposed.extend(d[0][1:]) or d for d in propose(*a)]
    out, _, _ = speculative_generate(
        ssmspec.transform(copy.deepcopy(ref)), IDS, torch.ones_like(IDS), max_new_tokens=40, eos_token_ids=[],
        pad_token_id=0, drafter=drafter, tree_budget=8, num_draft_tokens=3,
    )  # fmt: skip
    assert torch.equal(out, want)
    assert proposed and set(proposed) <= set(keep.tolist())
    assert not isinstance(draft.get_output_embeddings(), TrimmedHead)
    trimmed = trim_vocab(draft, keep)
    logits = trimmed(input_ids=IDS).logits[0, -1]
    outside = torch.ones(96, dtype=torch.bool).index_fill_(0, keep, False)
    assert torch.isinf(logits[outside]).all() and torch.isfinite(logits[keep]).all()
    assert torch.isfinite(draft(input_ids=IDS).logits).all()
