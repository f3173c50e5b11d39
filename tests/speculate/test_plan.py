"""A call's plan (ssmspec.speculate.plan): one immutable record of what `model.generate(...)` runs and why, the loop
run from it alone; `ssmspec.explain` and `ssmspec plan` print it without running the call."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import ssmspec
from ssmspec.cli import main
from ssmspec.errors import UnsupportedSettingError
from ssmspec.speculate import plan as spec_plan
from ssmspec.speculate.config import SpecConfig
from ssmspec.speculate.drafters.head import DraftHead
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.plan import LoopSettings
from ssmspec.testing.strategies import cached_tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])


def _model(family: str = "mamba2", head: bool = False):
    ref = cached_tiny_model(family)
    draft_head = None
    if head:
        hidden = ref.config.get_text_config().hidden_size
        draft_head = DraftHead(hidden, hidden, ref.config.get_text_config().vocab_size)
    return ref, ssmspec.transform(copy.deepcopy(ref), draft_head=draft_head)


@pytest.fixture
def small_heads(monkeypatch):
    """The tiny models' draft heads count as small (they hold more of a tiny model than HEAD_MAX_SHARE)."""
    monkeypatch.setattr(spec_plan, "HEAD_MAX_SHARE", 1.0)


def _plan(model, **kwargs):
    call = model._speculative_call(None, kwargs.pop("prompt_lookup_num_tokens", None), None,
                                   kwargs.pop("speculation", None))  # fmt: skip
    return spec_plan.plan_call(model, IDS, None, kwargs=kwargs, **call)


def test_the_loop_runs_the_plans_settings_and_the_plan_cannot_change(monkeypatch, small_heads):
    """generate hands the engine the plan's LoopSettings (nothing read of the model on the way), the output is HF's;
    a plan is frozen."""
    ref, model = _model(head=True)
    plan = _plan(model, max_new_tokens=12)
    assert (plan.spec.drafter, plan.settings.adaptive, plan.settings.generic) == ("draft_head", True, False)
    assert (plan.settings.tree_budget, plan.settings.num_draft_tokens) == (plan.spec.tree_budget,
                                                                          plan.spec.num_draft_tokens)  # fmt: skip
    seen = []

    def recording(*args, settings, **kwargs):
        seen.append(settings)
        return speculative_generate(*args, settings=settings, **kwargs)

    monkeypatch.setattr("ssmspec.speculate.generate.speculative_generate", recording)
    out = model.generate(IDS, max_new_tokens=12)
    assert torch.equal(out, ref.generate(IDS, max_new_tokens=12, do_sample=False))
    assert seen == [plan.settings]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.settings = LoopSettings()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.settings.tree_budget = 1  # type: ignore[misc]


def test_the_plan_says_what_runs_and_why(small_heads):
    """Each choice of the call has a line, its value the one the loop runs: drafter, sizes, path, policy, steps."""
    _, model = _model(head=True)
    lines = dict(_plan(model, max_new_tokens=12).reasons)
    assert set(lines) == {"call", "drafter", "sizes", "path", "policy", "steps"}
    assert lines["drafter"].startswith("draft_head: the model's draft head")
    assert "24 nodes, 8 deep (the drafter's default" in lines["sizes"] and lines["path"].startswith("seams")
    assert lines["policy"].startswith("adaptive") and lines["steps"].startswith("eager (inference_mode)")
    sampled = dict(_plan(model, max_new_tokens=12, do_sample=True).reasons)
    assert "4 nodes, 4 deep" in sampled["sizes"] and sampled["call"].endswith("sampling")
    lookup = dict(_plan(model, max_new_tokens=12, prompt_lookup_num_tokens=3).reasons)
    assert "3 deep (prompt_lookup_num_tokens deep" in lookup["sizes"]
    plain = dict(_plan(model, max_new_tokens=12, speculation=ssmspec.SpecConfig(drafter="none")).reasons)
    assert plain["drafter"].startswith("none: asked for") and "sizes" not in plain
    assert plain["policy"].startswith("plain decoding")
    _, without = _model()
    assert dict(_plan(without, max_new_tokens=12).reasons)["drafter"].startswith("prompt_lookup: n-gram lookup")


def test_a_large_head_drafts_only_when_sampling():
    """drafter "auto" drafts greedily with a head only where it is small against the model (HEAD_MAX_SHARE: a level
    costs about that share of a step) and says why not; a sampled call drafts with a trained draft head whatever its
    size (n-gram drafts are seldom accepted by sampled tokens); asked for, the head drafts greedily too."""
    from ssmspec.hf.mtp import size_share

    ref, model = _model(head=True)
    assert size_share(model.ssmspec_draft_head, model) > spec_plan.HEAD_MAX_SHARE
    greedy = _plan(model, max_new_tokens=12)
    assert greedy.spec.drafter == "prompt_lookup"
    assert dict(greedy.reasons)["drafter"] == (
        f"prompt_lookup: the model's draft head holds over {spec_plan.HEAD_MAX_SHARE:.0%} of its parameters: n-gram "
        "lookup"
    )
    assert _plan(model, max_new_tokens=12, do_sample=True).spec.drafter == "draft_head"
    asked = ssmspec.SpecConfig(drafter="draft_head")
    assert _plan(model, max_new_tokens=12, speculation=asked).spec.drafter == "draft_head"
    assert torch.equal(model.generate(IDS, max_new_tokens=12), ref.generate(IDS, max_new_tokens=12, do_sample=False))


def test_explain_prints_the_plan_refuses_as_generate_and_names_hfs_own_generate():
    _, model = _model()
    text = ssmspec.explain(model, IDS, max_new_tokens=8)
    assert text.splitlines()[0].startswith("call") and "drafter  prompt_lookup" in text
    assert ssmspec.explain(model, IDS, max_new_tokens=8, num_beams=2).startswith("HF's own generate: ")
    assert ssmspec.explain(model, IDS, speculation=False) == "HF's own generate (speculation=False)"
    with pytest.raises(UnsupportedSettingError, match="num_beams"):
        ssmspec.explain(model, IDS, max_new_tokens=8, num_beams=2, speculation=True)
    with pytest.raises(UnsupportedSettingError, match="num_beams"):
        model.generate(IDS, max_new_tokens=8, num_beams=2, speculation=True)
    with pytest.raises(TypeError, match="transformed"):
        ssmspec.explain(cached_tiny_model("mamba2"), IDS)


def test_the_engine_takes_settings_or_their_fields_by_name():
    _, model = _model()
    kw = dict(max_new_tokens=4, eos_token_ids=[], pad_token_id=0, drafter=ssmspec.speculate.drafters.NoDrafter())
    with pytest.raises(TypeError, match="unexpected keyword argument 'tree_size'"):
        speculative_generate(model, IDS, torch.ones_like(IDS), tree_size=4, **kw)
    with pytest.raises(TypeError, match="give one"):
        speculative_generate(model, IDS, torch.ones_like(IDS), settings=LoopSettings(), tree_budget=4, **kw)
    by_name, _, _ = speculative_generate(model, IDS, torch.ones_like(IDS), tree_budget=0, **kw)
    given, _, _ = speculative_generate(model, IDS, torch.ones_like(IDS), settings=LoopSettings(), **kw)
    assert torch.equal(by_name, given)


def test_ssmspec_plan_and_generate_explain(capsys):
    """`ssmspec plan` prints the default call's plan and generates nothing; `generate --explain` prints it on stderr
    before the continuation; sampling options without --sample are a usage error."""
    assert main(["plan", "def add(a, b):\n", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr()  # (the embedded target's head holds 13% of it: within HEAD_MAX_SHARE, fused)
    assert out.out.splitlines()[1] == "drafter  draft_head: the model's draft head, fused with n-gram lookup"
    assert "verify steps" not in out.err
    assert main(["plan", "def f():\n", "--sample", "--temperature", "0.7", "--chain"]) == 0
    out = capsys.readouterr().out
    assert "sampling" in out.splitlines()[0] and "a chain of" in out
    assert main(["generate", "def f():\n", "--max-new-tokens", "6", "--explain"]) == 0
    out = capsys.readouterr()
    assert "drafter  draft_head" in out.err and "verify steps" in out.err and out.out.strip()
    assert main(["plan", "def f():\n", "--top-p", "0.9"]) == 2
    assert "add --sample" in capsys.readouterr().err


def test_a_model_with_compiled_steps_plans_captured_steps_and_its_heads_chains(small_heads, monkeypatch):
    """On a model whose steps are captured and compiled (`transform(compile=True)` on a CPU: here its recorded graphs
    without Inductor), the plan captures and replays every step under no_grad with static shapes; drafter "auto" drafts
    a greedy call with the head's argmax chains (defaults.HEAD_CHAIN, each depth one compiled call), and a sampled one
    decodes plainly unless it asks for drafts, saying why; a head over HEAD_MAX_SHARE leaves n-grams. Greedy output
    identical to HF's."""
    from ssmspec.compile.lower import StepCompiler
    from ssmspec.speculate.defaults import HEAD_CHAIN

    ref, model = _model(head=True)
    model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    model.ssmspec_graphs = True
    plan = _plan(model, max_new_tokens=12)
    assert plan.settings.graphs and plan.settings.static_shapes and not plan.inference
    lines = dict(plan.reasons)
    assert lines["drafter"].startswith("draft_head: the model's draft head: its argmax chains, each one compiled call")
    assert (plan.spec.tree, plan.spec.num_draft_tokens) == (False, HEAD_CHAIN.num_draft_tokens)
    assert lines["steps"].startswith("captured and compiled whole, replayed (no_grad)")
    assert torch.equal(model.generate(IDS, max_new_tokens=12), ref.generate(IDS, max_new_tokens=12, do_sample=False))
    # a sampled call decodes plainly (its drafted steps verify and commit apart); asked for, it drafts
    sampled = _plan(model, max_new_tokens=12, do_sample=True)
    assert dict(sampled.reasons)["drafter"].startswith("none: a sampled call on steps compiled whole decodes plainly")
    assert sampled.spec.drafter == "none" and sampled.settings.num_draft_tokens == 0
    asked = _plan(model, max_new_tokens=12, do_sample=True, speculation=SpecConfig(drafter="prompt_lookup"))
    assert asked.spec.drafter == "prompt_lookup" and asked.settings.num_draft_tokens > 0
    looked_up = _plan(model, max_new_tokens=12, do_sample=True, prompt_lookup_num_tokens=4)
    assert looked_up.spec.drafter == "prompt_lookup" and looked_up.spec.num_draft_tokens == 4
    monkeypatch.setattr(spec_plan, "HEAD_MAX_SHARE", 0.0)
    assert dict(_plan(model, max_new_tokens=12).reasons)["drafter"].startswith("prompt_lookup: the model's draft head")


def test_n_gram_lookup_on_compiled_steps_drafts_chains_when_greedy():
    """On a model whose steps are compiled whole, n-gram lookup's greedy default for one prompt drafts adaptive chains
    (defaults.NGRAM_CHAIN: a tree is verified padded to its bucket there), `prompt_lookup_num_tokens=k` chains k deep;
    a sampled call that asks for n-grams and a batch keep the tree's shape, and the same model eager drafts NGRAM's
    trees. Greedy output identical to HF's."""
    from ssmspec.compile.lower import StepCompiler
    from ssmspec.speculate.defaults import NGRAM, NGRAM_CHAIN

    ref, model = _model()
    eager = _plan(model, max_new_tokens=12)
    assert eager.spec.tree and (eager.spec.tree_budget, eager.spec.num_draft_tokens) == (
        NGRAM.tree_budget, NGRAM.num_draft_tokens)  # fmt: skip
    model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    model.ssmspec_graphs = True
    plan = _plan(model, max_new_tokens=12)
    assert plan.spec.drafter == "prompt_lookup" and not plan.spec.tree and plan.spec.adaptive
    chain = (NGRAM_CHAIN.tree_budget, NGRAM_CHAIN.num_draft_tokens)
    assert (plan.spec.tree_budget, plan.spec.num_draft_tokens) == chain
    assert "chains" in dict(plan.reasons)["sizes"]
    deep = _plan(model, max_new_tokens=12, prompt_lookup_num_tokens=6)
    assert not deep.spec.tree and deep.spec.num_draft_tokens == 6 and deep.spec.tree_budget == 6
    sampled = _plan(model, max_new_tokens=12, do_sample=True, prompt_lookup_num_tokens=4)
    assert sampled.spec.tree and sampled.spec.num_draft_tokens == 4
    two = spec_plan.plan_call(model, IDS.repeat(2, 1), None, kwargs={"max_new_tokens": 12},
                              **model._speculative_call(None, None, None, None))  # fmt: skip
    assert two.spec.tree and two.spec.num_draft_tokens == NGRAM.num_draft_tokens  # (a batch keeps the trees)
    assert torch.equal(model.generate(IDS, max_new_tokens=12), ref.generate(IDS, max_new_tokens=12, do_sample=False))


def test_a_greedy_call_on_compiled_steps_prices_against_its_own_plain_steps(monkeypatch):
    """The adaptive policy of a greedy call on steps compiled whole prices and judges drafts against the plain steps
    the loop takes (`Goodput(loop_base=True)`: a compiled step the calibration times alone is up to twice as slow); an
    eager call's keeps the calibrated base."""
    from ssmspec.compile.lower import StepCompiler
    from ssmspec.speculate import policy

    made = []
    for_call = policy.AdaptiveDepth.for_call

    def kept(*args, **kwargs):
        made.append(for_call(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(policy.AdaptiveDepth, "for_call", kept)
    ref, model = _model()
    expected = ref.generate(IDS, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(IDS, max_new_tokens=12), expected)
    model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    model.ssmspec_graphs = True
    assert torch.equal(model.generate(IDS, max_new_tokens=12), expected)
    assert [depth.goodput.loop_base for depth in made] == [False, True]


def test_the_runner_compiles_as_the_plan_found_the_model_compiled(small_heads):
    """How the target was compiled is read once, by the plan: the runner it opens compiles its captured steps with
    the plan's step compiler, and one opened with settings that say "not compiled" records them on the op tape,
    whatever the model's attributes say."""
    from ssmspec.compile.lower import StepCompiler
    from ssmspec.compiled import CompiledAs
    from ssmspec.speculate.engine import open_runner

    _, model = _model(head=True)
    compiler = model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    model.ssmspec_graphs = True
    plan = _plan(model, max_new_tokens=12)
    assert plan.settings.compiled.step_compiler is compiler
    runner = open_runner(model, plan.settings, max_new_tokens=12, capture_features=False)
    assert runner.compiler is compiler and not runner.prepack
    tape = dataclasses.replace(plan.settings, compiled=CompiledAs())
    runner = open_runner(model, tape, max_new_tokens=12, capture_features=False)
    assert runner.compiler is None and not runner.fuse_single_nodes


def test_a_default_calls_plain_steps_ask_the_drafter_nothing(monkeypatch, small_heads):
    """A plain step of the default call (a head fused with n-grams; the adaptive policy chose depth 0 and no shadow)
    asks its drafter for nothing: only the steps that draft, and shadow drafts, call `propose` and `ahead`."""
    from ssmspec.speculate.drafters.fused import FusedDrafter
    from ssmspec.speculate.step.propose import Proposer

    ref, model = _model(head=True)
    ids = torch.randint(1, 50, (4, 9), generator=torch.Generator().manual_seed(0))
    steps, drafting, asked = [], [], []
    step, propose, ahead = Proposer.propose, FusedDrafter.propose, FusedDrafter.ahead

    def counted(self, plan, rows):
        steps.append(plan)
        before = len(asked)
        out = step(self, plan, rows)
        if len(asked) > before:
            drafting.append(plan)
        return out

    monkeypatch.setattr(Proposer, "propose", counted)
    monkeypatch.setattr(FusedDrafter, "propose", lambda self, *a: asked.append("propose") or propose(self, *a))
    monkeypatch.setattr(FusedDrafter, "ahead", lambda self, *a: asked.append("ahead") or ahead(self, *a))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24)
    assert torch.equal(out, ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False))
    plain = [p for p in steps if p.depth == 0 and not p.shadow]
    assert plain, "the policy took no plain step: nothing checked"
    assert all(p.depth > 0 or p.shadow for p in drafting), "a plain step asked the drafter"
