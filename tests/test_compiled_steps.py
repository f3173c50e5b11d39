"""Captured steps compiled whole on a CPU (ssmspec.compile.lower, `transform(compile=True)`): each step recorded once as
an FX graph of its ATen ops, compiled into one function, replayed over the same static buffers, kept with those
buffers for the model's later calls. Every family runs the recorded graphs as they are (the same recording, inputs,
outputs and replays, without Inductor's code generation, in seconds); a few run Inductor's compilation end to end."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import ssmspec
from ssmspec import SpecConfig
from ssmspec.compile import lower
from ssmspec.compile.graphs import StepGraph
from ssmspec.compile.lower import StepCompiler
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.runner import bucket
from ssmspec.testing.configs import _MOE_FAMILIES, SUPPORTED_FAMILIES
from ssmspec.testing.drafters import OracleDrafter
from ssmspec.testing.strategies import cached_tiny_model

CAPTURED = [f for f in SUPPORTED_FAMILIES if f not in ("inkling", "inkling2")]  # (positions from cache slots)
IDS = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


class Varying(OracleDrafter):
    """The reference continuation, right for a random number of tokens, with a random number of nodes: every step a
    different tree (and one-node steps among them), so replays see trees their capture did not."""

    def propose(self, contexts, max_nodes, max_depth):
        self.right_prefix = self.rng.randint(0, max_depth)
        self.distractors = self.rng.randint(0, 1)
        return super().propose(contexts, self.rng.randint(0, max_nodes), max_depth)


def _model(family: str, dtype=torch.float64):
    ref = cached_tiny_model(family, dtype=dtype)
    if family in _MOE_FAMILIES:  # HF's eager experts read the host (which experts a batch routes to)
        ref = copy.deepcopy(ref)
        ref.set_experts_implementation("batched_mm")
    return ref


def _recorded(ref):
    """A transformed copy whose captured steps are recorded graphs run without Inductor."""
    model = ssmspec.transform(copy.deepcopy(ref))
    model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    return model


def _speculate(model, ids, want, tokens, seed=0, decoding=None):
    return speculative_generate(
        model, ids, torch.ones_like(ids), max_new_tokens=tokens, eos_token_ids=[], pad_token_id=0,
        drafter=Varying([w.tolist() for w in want], vocab_size=96, seed=seed), tree_budget=7, num_draft_tokens=4,
        static_shapes=True, graphs=True, decoding=decoding,
    )  # fmt: skip


@pytest.mark.parametrize("family", CAPTURED)
def test_recorded_steps_equal_hf_greedy(family):
    """Every family (float64, a batch of two, a different tree every step): each bucket's greedy step (verified,
    accepted and committed in one graph) and the one-node step (verified and committed in one graph), recorded once and
    replayed for every later step of it, output identical to HF greedy; a second call replays the first call's steps
    over its buffers, recording none."""
    ref = _model(family)
    want = ref.generate(IDS, max_new_tokens=32, do_sample=False, eos_token_id=None)
    model = _recorded(ref)
    out, stats, runner = _speculate(model, IDS, want, 32)
    assert torch.equal(out, want)
    buckets = {bucket(n, 8) for n in stats.tree_nodes_per_step}
    assert set(runner.captured) == {(2, 1)} | {(2, n, "greedy") for n in buckets - {1}}
    graphs = [g for e in runner.captured.values() for g in (e.graph, e.commit) if g is not None]
    assert all(g.compiled is not None and g.tape is None and e.commit is None for e in runner.captured.values()
               for g in (e.graph,))  # fmt: skip
    assert len(graphs) == len(buckets)  # one graph a step
    assert runner.captured[(2, 1)].fused  # (the plain step's: verified in place)
    assert max(e.graph.replays for e in runner.captured.values()) >= 3
    assert stats.accepted_tokens > 0 and stats.verify_steps < 31  # (the drafts were accepted: fewer steps than tokens)
    out, _, again = _speculate(model, IDS, want, 32, seed=1)  # other trees, the same buckets
    assert torch.equal(out, want)
    assert again.captured is runner.captured and again.captures == 0 or set(again.captured) > set(runner.captured)


@pytest.mark.parametrize("family", ["mamba2", "bamba", "qwen3_next", "lfm2", "zamba2"])
def test_recorded_verify_steps_and_commits_equal_hf_greedy(family):
    """A call that needs every node's scores (here HF's `output_scores`) verifies and commits in two graphs per bucket:
    the verify step, then the commit of the path the host accepted; output and scores identical to HF greedy's."""
    from ssmspec.speculate.decoding import Decoding

    ref = _model(family)
    want = ref.generate(IDS, max_new_tokens=24, do_sample=False, eos_token_id=None, output_scores=True,
                        return_dict_in_generate=True)  # fmt: skip
    model = _recorded(ref)
    decoding = Decoding(output_scores=True)
    out, stats, runner = _speculate(model, IDS, want.sequences, 24, decoding=decoding)
    assert torch.equal(out, want.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(decoding.scores, want.scores, strict=True))
    drafted = {bucket(n, 8) for n in stats.tree_nodes_per_step} - {1}
    assert drafted and set(runner.captured) >= {(2, n) for n in drafted}
    assert all(runner.captured[(2, n)].commit is not None for n in drafted if runner.captured[(2, n)].graph.replays)


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_plain_greedy_steps_are_replays_of_the_one_node_step(family, monkeypatch):
    """Plain greedy decoding of a compiled model: after the step that captures it, every step is one replay of the
    fused one-node step and one read of its argmax (ModelRunner.decode), nothing else per token; rows that stop at
    different lengths (an EOS one row reaches first), a stopping criterion, a streamer and HF's counters as the
    general steps keep them; the output HF's."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from ssmspec.speculate.runner import ModelRunner

    class AtToken(StoppingCriteria):  # stops a row once it has generated `token` (HF's criteria contract)
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids[:, IDS.shape[1] :] == self.token).any(-1)

    ref = _model(family)
    free = ref.generate(IDS, max_new_tokens=24, do_sample=False, eos_token_id=None)
    eos = int(free[0, IDS.shape[1] + 6])  # row 0 stops by its 7th token at the latest (row 1 may generate it too)
    stop = int(free[1, IDS.shape[1] + 15])
    kwargs = {"max_new_tokens": 24, "eos_token_id": eos, "pad_token_id": 0}
    want = ref.generate(IDS, do_sample=False, stopping_criteria=StoppingCriteriaList([AtToken(stop)]), **kwargs)
    model = _recorded(ref)
    model.ssmspec_graphs = True  # (its calls capture their steps, as transform(compile=True) sets)
    decodes = []
    decode = ModelRunner.decode

    def counted(self, tokens):
        picks = decode(self, tokens)
        decodes.append(picks is not None)
        return picks

    monkeypatch.setattr(ModelRunner, "decode", counted)
    streamed = []

    class Streamer:
        def put(self, value):
            streamed.append(value.clone())

        def end(self):
            pass

    out = model.generate(IDS, speculation=SpecConfig(drafter="none"), return_dict_in_generate=True, streamer=Streamer(),
                         stopping_criteria=StoppingCriteriaList([AtToken(stop)]), **kwargs)  # fmt: skip
    assert torch.equal(out.sequences, want)
    stats = out.spec_stats
    new = want.shape[1] - IDS.shape[1]
    assert decodes[0] is False and all(decodes[1:]) and len(decodes) == new - 1  # the capture, then replays only
    assert stats["verify_steps"] == new - 1 and stats["accepted_tokens"] == 0  # (the prefill chose the first token)
    lengths = [next((i + 1 for i, t in enumerate(row) if t in (eos, stop)), len(row)) for row in want[:, 12:].tolist()]
    assert stats["emitted_tokens"] == sum(lengths) and min(lengths) < max(lengths)  # (one row stopped first)
    assert torch.equal(torch.stack(streamed[1:], dim=1), want[:, IDS.shape[1] :])  # (the prompt, then column by column)


def test_a_step_whose_drafter_proposed_nothing_is_a_replay_of_the_one_node_step(monkeypatch):
    """A drafting call whose drafter finds nothing to propose for a step (n-grams without a match) takes that step as
    the plain greedy step does, one replay of the fused one-node step and one read (ModelRunner.decode), not a verify
    step, a host acceptance and a commit; the output HF's."""
    from ssmspec.speculate.drafters import NoDrafter
    from ssmspec.speculate.runner import ModelRunner
    from ssmspec.speculate.step.verify import Verifier

    ref = _model("mamba2")
    want = ref.generate(IDS, max_new_tokens=16, do_sample=False, eos_token_id=None)
    model = _recorded(ref)
    decodes, verifies = [], []
    decode, verify = ModelRunner.decode, Verifier.verify
    monkeypatch.setattr(ModelRunner, "decode", lambda self, t: decodes.append(1) or decode(self, t))
    monkeypatch.setattr(Verifier, "verify", lambda self, *a: verifies.append(1) or verify(self, *a))
    out, stats, runner = speculative_generate(
        model, IDS, torch.ones_like(IDS), max_new_tokens=16, eos_token_ids=[], pad_token_id=0, drafter=NoDrafter(),
        tree_budget=4, num_draft_tokens=4, static_shapes=True, graphs=True,
    )  # fmt: skip
    assert torch.equal(out, want)
    assert len(verifies) == 1 and len(decodes) == stats.verify_steps == 15  # (the capture, then replays only)
    assert set(runner.captured) == {(2, 1)}


def test_an_adaptive_calls_plain_steps_and_shadow_drafts_replay_the_one_node_step(monkeypatch):
    """Where the adaptive depth decodes plainly, a compiled model's plain steps are replays of the fused one-node step,
    a shadow draft's too (the drafter drafts one level, the step replays, the shadow's hit is reported from the token
    the step chose); a step that drafts takes the general path; the output stays HF's."""
    from ssmspec.speculate import policy
    from ssmspec.speculate.runner import ModelRunner
    from ssmspec.speculate.step import StepReport

    ref = _model("mamba2")
    want = ref.generate(IDS[:1], max_new_tokens=30, do_sample=False, eos_token_id=None)
    model = _recorded(ref)
    model.ssmspec_graphs = True
    steps = iter(range(1000))

    def choose(self, rows, depth, budget):  # a plain step, a shadow every third, a drafted step every seventh
        i = next(steps)
        return (max(depth, 1), budget, 0) if i % 7 == 6 else (0, budget, 1 if i % 3 == 2 else 0)

    monkeypatch.setattr(policy.AdaptiveDepth, "choose", choose)
    reports, decodes = [], []
    plain, decode = StepReport.plain.__func__, ModelRunner.decode
    monkeypatch.setattr(StepReport, "plain", classmethod(lambda cls, *a: reports.append(plain(cls, *a)) or reports[-1]))
    monkeypatch.setattr(ModelRunner, "decode", lambda self, t: decodes.append(1) or decode(self, t))
    oracle = OracleDrafter([w.tolist() for w in want], vocab_size=96)
    monkeypatch.setattr("ssmspec.speculate.plan.build_drafter", lambda *a, **k: oracle)
    spec = SpecConfig(drafter="prompt_lookup", adaptive=True)
    out = model.generate(IDS[:1], max_new_tokens=30, eos_token_id=None, pad_token_id=0, speculation=spec,
                         return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, want)
    shadows = [r for r in reports if r.shadow]
    assert len(reports) >= 10 and shadows and all(r.shadow_hits == {0: True} for r in shadows)  # (the oracle is right)
    assert max(out.spec_stats["tree_nodes_per_step"]) > 1 and len(decodes) >= len(reports)


def test_plain_steps_the_policy_decided_ahead_run_back_to_back(monkeypatch):
    """Where drafts are far from paying, the policy decides runs of plain steps ahead (`StepPolicy.plain_run`): a
    compiled model takes them back to back, planned and observed once per run, not per step, with a row stopping at
    EOS inside a run; the output stays HF's."""
    from ssmspec.speculate import calibration, policy
    from ssmspec.testing.drafters import RandomDrafter

    ref = _model("mamba2")
    eos = int(ref.generate(IDS, max_new_tokens=30, do_sample=False, eos_token_id=None)[0, IDS.shape[1] + 17])
    want = ref.generate(IDS, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    model = _recorded(ref)
    model.ssmspec_graphs = True
    calibration.fixed(model, 2, {1: 1.0, 2: 3.0, 4: 5.0, 8: 9.0})  # (drafts far from paying, whatever is measured)
    plans, runs = [], []
    plan, observe_plain = policy.StepPolicy.plan, policy.StepPolicy.observe_plain
    monkeypatch.setattr(policy.StepPolicy, "plan", lambda self, rows: plans.append(1) or plan(self, rows))
    monkeypatch.setattr(policy.StepPolicy, "observe_plain",
                        lambda self, n, *a: runs.append(n) or observe_plain(self, n, *a))  # fmt: skip
    drafter = RandomDrafter(96, chain=True)
    monkeypatch.setattr("ssmspec.speculate.plan.build_drafter", lambda *a, **k: drafter)
    spec = SpecConfig(drafter="prompt_lookup", adaptive=True)
    out = model.generate(IDS, max_new_tokens=30, eos_token_id=eos, pad_token_id=0, speculation=spec,
                         return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, want)
    steps = out.spec_stats["verify_steps"]
    assert max(out.spec_stats["tree_nodes_per_step"]) == 1  # (never drafted)
    assert len(plans) + sum(runs) == steps and sum(runs) > steps // 2 and max(runs) >= 4


def test_a_draft_heads_features_come_out_of_the_compiled_greedy_steps(monkeypatch):
    """A draft head drafts from the target's features at the last committed position: on a compiled model they come
    out of the plain step's and the greedy step's graphs (the accepted path's, gathered in the graph). Before every
    proposal the head gets the feature whose LM-head argmax is the proposal's root; the steps are replays of one graph
    each; the output is HF's."""
    from ssmspec.speculate.drafters.head import DraftHead, HeadDrafter
    from ssmspec.speculate.runner import ModelRunner

    ref = _model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref), draft_head=DraftHead.for_model(ref).double())
    model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    model.ssmspec_graphs = True
    lm_head = model.get_output_embeddings()
    seen, roots, greedy = [], [], []

    class Recording(HeadDrafter):
        def observe_features(self, row, feature):
            seen.append(int(lm_head(feature).argmax()))
            super().observe_features(row, feature)

        def propose(self, contexts, max_nodes, max_depth):  # (the reference's tokens: long accepted paths)
            roots.append(contexts[0][-1])
            super().propose(contexts, max_nodes, max_depth)
            return oracle.propose(contexts, max_nodes, max_depth)

    verify_greedy = ModelRunner.verify_greedy
    monkeypatch.setattr(ModelRunner, "verify_greedy", lambda self, t: greedy.append(1) or verify_greedy(self, t))
    monkeypatch.setattr(HeadDrafter, "step_draft", lambda self: None)  # (the chain drafted on the host, from them)
    head = model.__dict__["ssmspec_draft_head"]
    monkeypatch.setattr("ssmspec.speculate.plan.build_drafter", lambda *a, **k: Recording(head, model))
    ids = IDS[:1]
    want = ref.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    oracle = Varying([w.tolist() for w in want], vocab_size=96)
    spec = SpecConfig(drafter="draft_head", tree_budget=6, num_draft_tokens=3, adaptive=False)
    out = model.generate(ids, max_new_tokens=20, eos_token_id=None, pad_token_id=0, speculation=spec,
                         return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, want)
    assert greedy and seen == roots and len(roots) >= len(greedy)
    assert out.spec_stats["accepted_tokens"] >= 4  # (paths of several nodes: the feature is their last node's)


def test_a_draft_heads_next_chain_is_drafted_in_the_compiled_greedy_step(monkeypatch):
    """On a model whose steps are compiled whole on a CPU, a draft head's next greedy chain is drafted in the greedy
    step's own graph, from the target's features at each row's last accepted node and its bonus token: every chain
    handed back is the head's own chain from those (float64, long accepted paths and rejected drafts, two rows), the
    head's next proposal is it (no features handed, no head call), and the output is HF's."""
    from ssmspec.hf import features
    from ssmspec.speculate.drafters.head import DraftHead, HeadChain, HeadDrafter
    from ssmspec.speculate.runner import ModelRunner

    ref = _model("mamba2")
    torch.manual_seed(0)
    model = ssmspec.transform(copy.deepcopy(ref), draft_head=DraftHead.for_model(ref).double())
    model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    model.ssmspec_graphs = True
    head = model.__dict__["ssmspec_draft_head"]
    chain = HeadChain(head, model.get_input_embeddings(), features.lm_head(model))
    checked, handed, served, expected, proposed, after = [], [], [], [], [], [0]
    verify_greedy = ModelRunner.verify_greedy

    def checking(self, tree):
        tokens, ties = verify_greedy(self, tree)
        if self.drafted is None:  # (a step that drafted nothing)
            return tokens, ties
        rows = torch.arange(len(tokens))
        last = self.features[rows, torch.tensor([len(t) - 1 for t in tokens])]  # (the path's last node)
        bonus = [t[-1] for t in tokens]
        want = chain(last, torch.tensor(bonus), len(self.drafted[0]) - 1).tolist()
        checked.append(self.drafted == [[b, *w] for b, w in zip(bonus, want)])
        after[0] = len(self.drafted[0]) - 1  # (as deep as the step's tree: its bucket's depth)
        return tokens, ties

    class Recording(HeadDrafter):
        def observe_features(self, row, feature):
            handed.append(row)
            super().observe_features(row, feature)

        def propose(self, contexts, max_nodes, max_depth):
            served.append(self.has_drafted(contexts, min(max_nodes, max_depth)))
            expected.append(after[0] >= min(max_nodes, max_depth))  # (the step before drafted as deep)
            after[0] = 0
            drafts = super().propose(contexts, max_nodes, max_depth)
            if served[-1]:
                proposed.append(all(d[0] == c[: len(d[0])] for d, c in zip(drafts, self.drafted[0])))
            # every other step the reference's own tokens: long accepted paths
            return oracle.propose(contexts, max_nodes, max_depth) if len(served) % 2 else drafts

    monkeypatch.setattr(ModelRunner, "verify_greedy", checking)
    monkeypatch.setattr("ssmspec.speculate.plan.build_drafter", lambda *a, **k: Recording(head, model, tree=False))
    want = ref.generate(IDS, max_new_tokens=20, do_sample=False, eos_token_id=None)
    oracle = Varying([w.tolist() for w in want], vocab_size=96)
    spec = SpecConfig(drafter="draft_head", tree=False, num_draft_tokens=3, adaptive=False)
    out = model.generate(IDS, max_new_tokens=20, eos_token_id=None, pad_token_id=0, speculation=spec,
                         return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, want)
    assert len(checked) >= 4 and all(checked)
    assert served == expected and sum(served) >= len(served) // 2 and proposed and all(proposed)
    assert len(handed) <= 2 * served.count(False)  # (features only for a proposal the chains could not serve)
    assert out.spec_stats["accepted_tokens"] >= 8  # (accepted paths: the chain is drafted from their last node)


def test_a_step_compiler_adopts_a_modules_tensors_as_constants_named_in_order():
    """`StepCompiler.adopt`: a draft head's parameters become constants of the steps recorded after it (read where they
    are, not inputs), named by the order modules were adopted in (the same graph code in every process); adopting
    one again changes nothing, and a recorded step reads them as constants."""
    model = _recorded(_model("mamba2"))
    compiler = model.__dict__["_ssmspec_step_compiler"]
    first, second = torch.nn.Linear(3, 2).double(), torch.nn.LayerNorm(3).double()
    before = dict(compiler.constants)
    for module in (first, second, first):
        compiler.adopt(module)
    added = {name: t for key, (name, t) in compiler.constants.items() if key not in before}
    assert added == {"c_adopted0__weight": first.weight, "c_adopted0__bias": first.bias,
                     "c_adopted1__weight": second.weight, "c_adopted1__bias": second.bias}  # fmt: skip
    x = torch.randn(1, 3, dtype=torch.float64)
    graph = StepGraph(torch.device("cpu"), compiler=compiler)
    with torch.no_grad():
        out = graph.capture(lambda: first(second(x))).clone()
        assert len(graph.inputs) == 1 and graph.inputs[0] is x and torch.equal(graph.replay(), out)


def test_an_mtp_layer_drafts_from_the_compiled_greedy_steps_paths(monkeypatch):
    """An MTP layer reads the target's features at every committed position: on a compiled model, those of each
    greedy step's accepted path come out of its graph. Chains and trees over a padded batch: the layer is handed the
    features an eager model hands it, position by position, and the output is HF's."""
    import tempfile

    import transformers

    from ssmspec.speculate.drafters.mtp import MTPDrafter
    from ssmspec.testing.mtp import MTP_FAMILIES, write_checkpoint

    with tempfile.TemporaryDirectory() as where:
        family = "nemotron_h" if "nemotron_h" in MTP_FAMILIES else MTP_FAMILIES[0]
        path = write_checkpoint(family, where)
        load = transformers.AutoModelForCausalLM.from_pretrained  # (batched experts: eager ones read the host)
        ref = load(path, dtype=torch.float64, experts_implementation="batched_mm").eval()
        eager = ssmspec.transform(load(path, dtype=torch.float64, experts_implementation="batched_mm").eval())
        model = ssmspec.transform(load(path, dtype=torch.float64, experts_implementation="batched_mm").eval())
    model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=False, inductor=False)
    model.ssmspec_graphs = True
    history = []
    observe, propose = MTPDrafter.observe_history, MTPDrafter.propose

    def oracle_propose(self, contexts, max_nodes, max_depth):  # (the reference's tokens: long accepted paths)
        propose(self, contexts, max_nodes, max_depth)
        return oracle.propose(contexts, max_nodes, max_depth)

    monkeypatch.setattr(MTPDrafter, "propose", oracle_propose)
    monkeypatch.setattr(
        MTPDrafter,
        "observe_history",
        lambda self, r, f: history[-1].extend((r, x) for x in f.clone()) or observe(self, r, f),
    )
    ids = torch.tensor([[5, 9, 17, 33, 9, 17, 33, 41, 7], [0, 0, 0, 12, 44, 12, 44, 61, 3]])
    mask = (ids != 0).long()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    real = [w[int((1 - mask[r]).sum()) :].tolist() for r, w in enumerate(want)]  # (the rows' real tokens)
    oracle = Varying(real, vocab_size=96)
    for tree in (False, True):
        spec = SpecConfig(drafter="mtp", tree=tree, tree_budget=8, num_draft_tokens=4, adaptive=False)
        seen = {}
        for name, m in (("eager", eager), ("compiled", model)):
            history.append([])
            out = m.generate(ids, attention_mask=mask, max_new_tokens=16, speculation=spec,
                             return_dict_in_generate=True)  # fmt: skip
            assert torch.equal(out.sequences, want)
            assert out.spec_stats["drafter"]["head_calls"] > 0 and out.spec_stats["accepted_tokens"] >= 4
            seen[name] = sorted(history.pop(), key=lambda item: item[0])  # (per row, in order)
        assert [r for r, _ in seen["compiled"]] == [r for r, _ in seen["eager"]]
        assert all(torch.allclose(a, b, atol=1e-8) for (_, a), (_, b) in zip(seen["compiled"], seen["eager"]))


def test_a_step_that_reads_a_tensor_of_its_call_is_not_kept_for_the_next():
    """A workspace is handed to a later call only if every tensor its steps read belongs to it (its cache, its captured
    trees, what its steps produced): a step reading anything else would read a stale tensor in the next call."""
    ref = _model("mamba2")
    want = ref.generate(IDS[:1], max_new_tokens=12, do_sample=False, eos_token_id=None)
    model = _recorded(ref)
    _, _, runner = _speculate(model, IDS[:1], want, 12)
    idle = model.__dict__["_ssmspec_workspaces"][1]
    assert [runner.captured is w.captured for ws in idle.values() for w in ws] == [True]
    runner.prefill(IDS[:1], torch.ones_like(IDS[:1]))  # takes the workspace again
    assert not any(idle.values())
    entry = next(iter(runner.captured.values()))
    entry.graph.inputs.append(torch.zeros(3))  # as if a step captured in this call had read a tensor of its own
    runner.workspace.checked.discard(id(entry.graph))
    runner.release()
    assert not any(idle.values())


def test_two_models_record_and_replay_in_two_threads():
    refs = [_model("mamba2"), _model("bamba")]
    wants = [r.generate(IDS[:1], max_new_tokens=16, do_sample=False, eos_token_id=None) for r in refs]
    models = [_recorded(r) for r in refs]
    outs: dict[int, torch.Tensor] = {}

    def run(i):
        with torch.no_grad():
            for _ in range(2):
                outs[i] = _speculate(models[i], IDS[:1], wants[i], 16)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(outs[i], wants[i]) for i in range(2))


def test_step_graph_compiles_a_recorded_step_into_one_function():
    """The recorder's graph: tensors read that no op produced are its inputs (a view of one made before the step reads
    its base), the model's parameters its constants; the tensors the step produced and its caller kept are its outputs,
    copied into the capture's by each replay; an in-place update of an input happens in the graph."""
    lin = torch.nn.Linear(4, 4, bias=False).double()
    base = torch.zeros(2, 4, dtype=torch.float64)
    state, x = base[1], torch.arange(4.0, dtype=torch.float64)
    seen: list[int] = []

    def step():
        seen.append(1)
        state.add_(lin(x))
        scratch = x * 3  # noqa: F841 - produced and dropped: not an output
        return state.sum() + 0

    compiler = StepCompiler(lin, progress=False, inductor=False)
    graph = StepGraph(torch.device("cpu"), compiler=compiler)
    with torch.no_grad():
        out = graph.capture(step)
    assert [id(t) for t in graph.inputs] == [id(x), id(base)] and len(graph.kept) == 1
    first = float(out)
    x.copy_(torch.ones(4))
    assert graph.replay() is out
    assert seen == [1] and compiler.compilations == 1
    with torch.no_grad():
        assert float(out) == pytest.approx(first + float(lin(torch.ones(4, dtype=torch.float64)).sum()))
    assert base[0].abs().sum() == 0  # only the view's rows were written


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _recording(compiler: StepCompiler, fn) -> torch.fx.GraphModule:
    """`fn`'s ops as the step recorder records them (with their shapes)."""
    from ssmspec.compile.graphs import _Recorder

    recorder = _Recorder(compiler.constants)
    with recorder, torch.no_grad():
        fn()
    return recorder.finish()[0]


def _targets(gm: torch.fx.GraphModule) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


def test_the_one_region_passes_keep_every_value():
    """The passes that keep a recorded step's ops in Inductor's loops (ssmspec.compile.passes) compute what the ops
    they replace did: batched products over a few nodes as broadcast products summed (the in-place form still
    updating its tensor), a path's cumsum as a running sum equal bit for bit in every dtype, a product of a few rows
    as one-row products; products they do not take stay as they were."""
    from ssmspec.compile.lower import FUSED_BMM_INNER, FUSED_BMM_OUTPUTS, SPLIT_ROWS, UNROLLED_CUMSUM
    from ssmspec.compile.passes import short_cumsums_unrolled, small_bmms_as_sums, split_product_rows

    aten = torch.ops.aten
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40)
    a, b, c = torch.randn(6, 32, 5), torch.randn(6, 5, 16), torch.randn(6, 32, 16)
    big_a, big_b = torch.randn(2, 80, FUSED_BMM_INNER + 1), torch.randn(2, FUSED_BMM_INNER + 1, 80)
    sums = [
        torch.randn(3, 9, 4, dtype=dtype) for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    ]
    few, many = torch.randn(SPLIT_ROWS - 1, 24), torch.randn(SPLIT_ROWS + 1, 24)
    state = torch.randn(6, 32, 16)
    inputs = [a, b, c, big_a, big_b, *sums, few, many, state]

    def step():
        state.baddbmm_(a, b)
        return (torch.bmm(a, b), torch.baddbmm(c, a, b), torch.bmm(big_a, big_b), *(s.cumsum(1) for s in sums),
                lin(few), lin(many))  # fmt: skip

    from ssmspec.compile.graphs import _Recorder

    recorder = _Recorder(StepCompiler(lin, progress=False).constants)
    with recorder, torch.no_grad():
        outs = step()
    gm, kept = recorder.finish()
    assert [id(t) for t in kept] == [id(t) for t in outs]
    assert {id(t) for t in recorder.inputs} == {id(t) for t in inputs}
    at = [i for i, t in enumerate(recorder.inputs) if t is state][0]

    def run(graph):
        fresh = [t.clone() for t in recorder.inputs]
        return graph(*fresh), fresh[at]

    want, want_state = run(gm)
    before = _targets(gm)
    assert small_bmms_as_sums(gm, FUSED_BMM_INNER, FUSED_BMM_OUTPUTS) == 3  # (the wide one stays MKL's)
    assert short_cumsums_unrolled(gm, UNROLLED_CUMSUM) == len(sums)
    assert split_product_rows(gm, SPLIT_ROWS) == 1
    after = _targets(gm)
    assert after.count(aten.bmm.default) == 1 and aten.baddbmm.default not in after
    assert aten.baddbmm_.default not in after and aten.cumsum.default not in after
    assert after.count(aten.addmm.default) == before.count(aten.addmm.default) + SPLIT_ROWS - 2
    got, got_state = run(gm)
    assert len(got) == len(want) == len(outs)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    for i, (x, y) in enumerate(zip(got, want)):
        if 3 <= i < 3 + len(sums):  # the running sums: ATen's order and accumulation, the same bits
            assert x.dtype == y.dtype and torch.equal(x, y), x.dtype
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_a_large_weights_products_call_the_kernel_from_one_row(monkeypatch):
    """A compiled step's products of a weight with KERNEL_WEIGHTS elements or more call ssmspec's CPU kernel at one row
    and at a few rows (not split), those of a smaller weight stay Inductor's loops at one row; the eager step's
    values."""
    monkeypatch.setattr(lower, "KERNEL_WEIGHTS", 24 * 40)
    torch.manual_seed(0)
    big, small = torch.nn.Linear(40, 24), torch.nn.Linear(40, 8)  # 960 and 320 weight elements
    one, few = torch.randn(1, 40), torch.randn(lower.SPLIT_ROWS, 40)
    model = torch.nn.ModuleList([big, small])

    def step():
        return big(one), small(one), big(few)

    graph = StepGraph(torch.device("cpu"), compiler=StepCompiler(model, progress=False))
    with torch.no_grad():
        out = graph.capture(step)
        one.copy_(torch.randn(1, 40))
        ops = _Ops()
        with ops:
            graph.compiled(*graph.inputs)
        assert [op for op in ops.ops if op != "aten.detach.default"] == ["ssmspec_cpu.rows_linear.default"] * 2
        graph.replay()
        for got, want in zip(out, step()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_products_of_a_few_rows_and_sums_over_nodes_compile_into_one_region():
    """A compiled step whose products have at most SPLIT_ROWS rows and whose batched products and cumsums run over a
    few nodes dispatches no op (one function of Inductor's loops: no kernel, MKL or ATen call between them), with the
    eager step's values."""
    from ssmspec.compile.lower import SPLIT_ROWS

    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24)
    x, nodes = torch.randn(SPLIT_ROWS, 40), torch.randn(4, 3, 24)

    def step():
        h = torch.relu(lin(x))  # [rows, 24]
        mixed = torch.bmm(nodes, h[:3].t().expand(4, 24, 3))  # [4, 3, 3]: over a few nodes
        return mixed.cumsum(1), h

    graph = StepGraph(torch.device("cpu"), compiler=StepCompiler(lin, progress=False))
    with torch.no_grad():
        out = graph.capture(step)
        x.copy_(torch.randn(SPLIT_ROWS, 40))
        ops = _Ops()
        with ops:
            graph.compiled(*graph.inputs)
        assert [op for op in ops.ops if op != "aten.detach.default"] == []
        graph.replay()
        for got, want in zip(out, step()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_wide_products_of_few_rows_are_inductors_loops():
    """A product with a weight dimension over Inductor's 2048 in a step of at most WIDE_ROWS rows compiles into the
    step's own loops (no MKL call: not a single ATen op dispatched by a replay), with the linear's values; a step of
    more rows keeps Inductor's limit (its products of wide weights stay MKL's), and a step without a wide product
    Inductor's settings as they are (the same compilation as before)."""
    from ssmspec.compile.lower import OPTIONS, WIDE_ROWS

    torch.manual_seed(0)
    lin, narrow = torch.nn.Linear(16, 2100), torch.nn.Linear(16, 2048)
    compiler = StepCompiler(torch.nn.ModuleList([lin, narrow]), progress=False)
    few, many = torch.randn(1, 16), torch.randn(WIDE_ROWS + 1, 16)
    fusion = compiler.options_for(_recording(compiler, lambda: narrow(lin(few)[:, :16])))["post_grad_fusion_options"]
    assert fusion["decompose_mm_pass"]["cpu_max_other_dimension_decomposition"] >= 2100
    assert compiler.options_for(_recording(compiler, lambda: lin(many))) == lower.isa_options(OPTIONS)
    assert compiler.options_for(_recording(compiler, lambda: narrow(few))) == lower.isa_options(OPTIONS)
    graph = StepGraph(torch.device("cpu"), compiler=compiler)
    with torch.no_grad():
        out = graph.capture(lambda: lin(few))
        few.copy_(torch.randn(1, 16))
        ops = _Ops()
        with ops:
            (result,) = graph.compiled(*graph.inputs)
        assert ops.count == 0, ops.ops
        torch.testing.assert_close(result, lin(few), rtol=1e-5, atol=1e-5)
        graph.replay()
        torch.testing.assert_close(out, lin(few), rtol=1e-5, atol=1e-5)


def test_products_of_a_few_rows_call_the_cpu_kernel():
    """A compiled float32 step's linear of SPLIT_ROWS + 1 to SMALL_MATMUL_ROWS rows calls ssmspec_cpu::rows_linear,
    the only op the compiled step dispatches beside its arguments' detach, with the linear's values; with
    `kernels=False` it does not call it."""
    from ssmspec.compile.lower import SPLIT_ROWS
    from ssmspec.kernels import cpu_linear

    assert cpu_linear.available()
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24)
    rows = SPLIT_ROWS + 1
    x = torch.randn(rows, 40)
    kernel = "ssmspec_cpu.rows_linear.default"
    for kernels in (True, False):
        graph = StepGraph(torch.device("cpu"), compiler=StepCompiler(lin, progress=False, kernels=kernels))
        with torch.no_grad():
            out = graph.capture(lambda: torch.relu(lin(x)))
            x.copy_(torch.randn(rows, 40))
            ops = _Ops()
            with ops:
                graph.compiled(*graph.inputs)
            if kernels:
                assert [op for op in ops.ops if op != "aten.detach.default"] == [kernel]
            else:
                assert kernel not in ops.ops
            graph.replay()
            torch.testing.assert_close(out, torch.relu(lin(x)), rtol=1e-5, atol=1e-5)


def test_affine_strides_are_answered_as_inductor_answers_them():
    """`_stride_at_vec_range` gives Inductor's own stride for every index, affine or not, along each variable, and
    asks Inductor only for those with a floor division, a modulus or a product of variables along the variable;
    `_affine_strides` puts it in place for a compilation and takes it out after."""
    import sympy
    from torch._inductor.codegen import cpp
    from torch._inductor.utils import sympy_index_symbol as sym
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    x0, x1, x2 = sym("x0"), sym("x1"), sym("x2")
    original = cpp.stride_at_vec_range
    asked = []
    fast = lower._stride_at_vec_range(lambda *a: asked.append(a[:2]) or original(*a))
    affine = [x0, x0 + 256 * x1 + 4096, 3 - x0, 16 * x1, sympy.Integer(7), 4 * x0 + 64 * x2 + x1, -2 * x1 + x0]
    other = [4 * x0 + 16 * FloorDiv(x1, 32), x0 + 4 * ModularIndexing(x1, 1, 4), x0 * x1 + x2, FloorDiv(x0, 16),
             4 * x0 - ModularIndexing(4 * x0, 1, 4) + 3]  # fmt: skip
    for index in affine + other:
        for var in (x0, x1, x2):
            got, want = fast(index, var, 16), original(index, var, 16)
            assert got == want, (index, var, got, want)
            assert ((index, var) in asked) == (index in other and any(
                t.has(var) and not (t == var or (t.is_Mul and t.args[0].is_Integer and t.args[1] == var))
                for t in (index.args if index.is_Add else (index,))
            ))  # fmt: skip
    assert asked and all(index in other for index, _ in asked)
    with lower._affine_strides():
        assert cpp.stride_at_vec_range.ssmspec_original is original
    assert cpp.stride_at_vec_range is original


def test_the_vector_isa_checked_alone_is_the_one_inductor_picks(monkeypatch):
    """Where `vector_isa` checked this CPU's first instruction set alone, it is the one Inductor's own pick (every set
    checked) returns, and `isa_options` lets a compilation skip the other checks; where ATEN_CPU_CAPABILITY narrows
    the choice it is Inductor's pick and no setting is added. A compilation under `cpp.vec_isa_ok` leaves Inductor's
    list of valid sets as it found it: unchecked ones made under it are dropped."""
    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as vec

    from ssmspec.kernels import cpu_linear

    isa, alone = cpu_linear.vector_isa()
    assert str(isa) == str(vec.pick_vec_isa())
    assert ("cpp.vec_isa_ok" in lower.isa_options(lower.OPTIONS)) == alone
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    narrowed, alone = cpu_linear._pick_isa()
    assert not alone and str(narrowed) == str(vec.pick_vec_isa())
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    checked = vec.valid_vec_isa_list()
    for before in (False, True):
        vec.valid_vec_isa_list.cache_clear()
        if before:
            vec.valid_vec_isa_list()
        with lower._isa_list_kept({"cpp.vec_isa_ok": True}), config.patch({"cpp.vec_isa_ok": True}):
            vec.valid_vec_isa_list()
        assert vec.valid_vec_isa_list.cache_info().currsize == int(before)
    assert [str(i) for i in vec.valid_vec_isa_list()] == [str(i) for i in checked]


def test_a_step_without_products_of_a_few_rows_does_not_wait_for_the_kernel(monkeypatch):
    """A step whose products have at most SPLIT_ROWS rows (a plain step at batch 1, a small tree's step) compiles
    without asking for the kernel, whose build (`cpu_linear.prepare`, started by the compiler) it overlaps; one with a
    product of more rows asks for it."""
    from ssmspec.compile.lower import SPLIT_ROWS
    from ssmspec.kernels import cpu_linear

    asked = []
    monkeypatch.setattr(cpu_linear, "available", lambda: asked.append(1) or False)
    monkeypatch.setattr(cpu_linear, "prepare", lambda: asked.append(0))
    lin = torch.nn.Linear(8, 4)
    compiler = StepCompiler(lin, progress=False)
    assert asked == [0]
    for rows, want in ((1, [0]), (SPLIT_ROWS, [0]), (SPLIT_ROWS + 1, [0, 1])):
        x = torch.randn(rows, 8)
        graph = StepGraph(torch.device("cpu"), compiler=compiler)
        with torch.no_grad():
            graph.capture(lambda x=x: torch.relu(lin(x)))
            graph.replay()
        assert asked == want


def _workers_that_fail(monkeypatch) -> None:
    """Worker processes start as /bin/false, which exits at once (not sys.executable: Inductor's checks of the vector
    instruction sets run it, and cache what they find for the process)."""
    monkeypatch.setattr(lower, "_worker_command", lambda: ["/bin/false"])


def test_a_step_handed_to_a_worker_is_recorded_without_waiting_for_the_kernel(monkeypatch):
    """Inside `ahead`, a step with a product of more than SPLIT_ROWS rows is handed to a worker as recorded, without
    asking for the kernel (whose build a warm-up's first verify step would otherwise wait for); the kernel is asked
    for where the step compiles (here the recording process, its worker unable to start)."""
    from ssmspec.compile.lower import SPLIT_ROWS
    from ssmspec.kernels import cpu_linear

    asked = []
    monkeypatch.setattr(cpu_linear, "available", lambda: asked.append(1) or False)
    monkeypatch.setattr(cpu_linear, "prepare", lambda: None)
    _workers_that_fail(monkeypatch)
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(SPLIT_ROWS + 1, 8)
    compiler = StepCompiler(lin, progress=False)
    graph = StepGraph(torch.device("cpu"), compiler=compiler)
    with torch.no_grad():
        with compiler.ahead(workers=2):
            out = graph.capture(lambda: torch.relu(lin(x)))
            assert compiler.handed_ahead == 1 and asked == []
        assert asked == [1] and compiler.compilations == 1
        x.copy_(torch.randn(SPLIT_ROWS + 1, 8))
        graph.replay()
        torch.testing.assert_close(out, torch.relu(lin(x)), rtol=1e-5, atol=1e-5)


def test_float32_steps_that_call_the_cpu_kernel_equal_hf_greedy():
    """A float32 model compiled whole (`transform(compile=...)`) whose drafted steps' products call the CPU kernel:
    greedy output equals HF's, or first differs where HF's top-2 logits are a float32 near-tie (the checker's rule)."""
    from ssmspec.speculate.ties import near_tie_tolerance
    from ssmspec.testing.check import CheckReport, _compare

    ref = _model("mamba2", dtype=torch.float32)
    spec = SpecConfig(num_draft_tokens=2, tree_budget=2, adaptive=False)  # (drafts every step: one bucket)
    model = ssmspec.transform(copy.deepcopy(ref), spec, compile={"progress": False})
    ids = IDS
    hf = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                      return_dict_in_generate=True, output_logits=True)  # fmt: skip
    ops = _Ops()
    with ops:
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16)
    assert "ssmspec_cpu.rows_linear.default" in ops.ops
    assert got.shape == hf.sequences.shape
    _compare(got, hf.sequences, torch.stack(hf.logits, 1), ids.shape[1], near_tie_tolerance(torch.float32),
             CheckReport(), "mamba2, float32, compiled steps calling the CPU kernel")  # fmt: skip


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_transform_compile_true_compiles_whole_steps(family, tmp_path, monkeypatch):
    """`transform(model, compile=True)` on a CPU: no Dynamo, the warm-up compiles the default call's steps with Inductor
    (each one function), the first request compiles nothing more, output identical to HF greedy (float64); the plain
    step of a model whose every op fuses runs without dispatching a single ATen op from Python. (An empty Inductor
    cache: every step compiled by the warm-up's workers.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    ref = _model(family)
    ids = IDS[:1]
    want = ref.generate(ids, max_new_tokens=20, do_sample=False)
    spec = SpecConfig(tree_budget=3, num_draft_tokens=2)  # (few buckets: each is an Inductor compilation)
    model = ssmspec.transform(copy.deepcopy(ref), spec, compile={"progress": False})
    compiler = model.__dict__["_ssmspec_step_compiler"]
    assert model._compiled_call_impl is None and model.ssmspec_graphs
    warm = compiler.compilations
    assert warm >= 3 and compiler.fallbacks == 0
    if lower._cores() > 1:  # compiled ahead, side by side in worker processes, and loaded from Inductor's cache
        assert compiler.handed_ahead == compiler.compiled_ahead == warm
    for _ in range(2):
        assert torch.equal(model.generate(ids, max_new_tokens=20), want)
    plain = model.generate(ids, max_new_tokens=20, speculation=SpecConfig(drafter="none"))
    assert torch.equal(plain, want)
    assert compiler.compilations <= warm + 1  # (the plain call's one-node step keeps no draft features)
    n = compiler.compilations
    model.generate(ids, max_new_tokens=20, speculation=SpecConfig(drafter="none"))
    assert compiler.compilations == n  # no recompilation
    if family == "mamba2":
        workspace = next(w for ws in model.__dict__["_ssmspec_workspaces"][1].values() for w in ws
                         if (1, 1) in w.captured and w.cache.n_real is not None)  # fmt: skip
        graph = workspace.captured[(1, 1)].graph
        ops = _Ops()
        with ops, torch.no_grad():
            graph.compiled(*graph.inputs)
        assert ops.count == 0, ops.ops


def _step_with_constant_ops():
    """A step over a static tensor whose recording has ops that read no input (an index built by `arange`, as a
    tree's is), a memory format among its arguments and a module's weight as a constant."""
    lin = torch.nn.Linear(4, 4, bias=False)
    x = torch.arange(8.0).view(2, 4)

    def step():
        index = torch.arange(2).flip(0)
        y = lin(x[index]).transpose(0, 1).clone(memory_format=torch.contiguous_format)
        return y * 2

    return lin, x, step


def test_a_recorded_step_is_the_same_graph_after_its_job_file():
    """A step handed to a worker goes through a file as plain data (`graph_data`): loaded back it is node for node
    the graph recorded (pickling the GraphModule instead re-traces it, folding the ops that read no input into
    constants: another graph, another key in Inductor's cache) and computes the same."""
    import io

    lin, x, step = _step_with_constant_ops()
    compiler = StepCompiler(lin, progress=False, inductor=False)
    kept = []
    gm = _recording(compiler, lambda: kept.append(step()))
    buffer = io.BytesIO()
    torch.save(lower.graph_data(gm), buffer)
    buffer.seek(0)
    loaded = lower.graph_from_data(torch.load(buffer, weights_only=False))
    assert loaded.code == gm.code
    shapes = [[tuple(v.shape) for v in pytree.tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)]
              for g in (gm, loaded) for n in g.graph.nodes]  # fmt: skip
    assert shapes[: len(shapes) // 2] == shapes[len(shapes) // 2 :] and any(shapes)  # (the worker's passes read them)
    assert "arange" in loaded.code and not any(n.target.startswith("_tensor_constant")
                                               for n in loaded.graph.nodes if n.op == "get_attr")  # fmt: skip
    inputs = [x]
    with torch.no_grad():
        assert torch.equal(loaded(*inputs)[0], gm(*inputs)[0])


def test_steps_recorded_ahead_compile_in_worker_processes_and_load_from_the_cache(tmp_path, monkeypatch):
    """Inside `StepCompiler.ahead` a recorded step is compiled by a worker process (into Inductor's on-disk cache)
    while it replays op by op; when the block ends this process loads it from the cache, and a replay is then the
    compiled function alone: no ATen op dispatched from Python. A later block meeting the same step starts no worker."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    lin, x, step = _step_with_constant_ops()
    compiler = StepCompiler(lin, progress=False, kernels=False)
    graph = StepGraph(torch.device("cpu"), compiler=compiler)
    with torch.no_grad():
        want = step().clone()
        with compiler.ahead(workers=2):
            out = graph.capture(step)
            assert torch.equal(out, want)
            assert torch.allclose(graph.replay(), want, rtol=1e-6, atol=1e-6)  # (op by op meanwhile)
        assert compiler.handed_ahead == compiler.compiled_ahead == compiler.compilations == 1
        ops = _Ops()
        with ops:
            graph.compiled(*graph.inputs)
        assert ops.count == 0, ops.ops
        x.mul_(-1)
        assert torch.allclose(graph.replay(), step(), rtol=1e-6, atol=1e-6)
        # a step a worker compiled before (marked in the cache's folder) is loaded at once: no worker
        again = StepCompiler(lin, progress=False, kernels=False)
        with again.ahead(workers=2):
            StepGraph(torch.device("cpu"), compiler=again).capture(step)
        assert again.handed_ahead == 0 and again.compilations == 1 and not again._pool


def test_a_step_whose_worker_fails_is_compiled_by_the_recording_process(monkeypatch):
    """A worker that cannot run (here: no interpreter) leaves its steps to this process, compiled as outside
    `ahead`, with the same result."""
    _workers_that_fail(monkeypatch)
    monkeypatch.setattr(lower, "compile_step", lambda gm, inputs, options, kernels=True: gm)  # (not under test)
    lin, x, step = _step_with_constant_ops()
    compiler = StepCompiler(lin, progress=False, kernels=False)
    graph = StepGraph(torch.device("cpu"), compiler=compiler)
    with torch.no_grad():
        with compiler.ahead(workers=2):
            graph.capture(step)
        assert compiler.handed_ahead == 1 and compiler.compiled_ahead == 0 and compiler.compilations == 1
        assert graph.compiled.compiled is not None
        assert torch.allclose(graph.replay(), step(), rtol=1e-6, atol=1e-6)  # (the products split into rows)


def test_a_step_sent_to_a_worker_whose_output_ended_is_done(monkeypatch, tmp_path):
    """A worker process whose output has ended answers nothing more: a step sent to it afterwards is done (not
    compiled) at once, even where the write into its input succeeds (a warm-up otherwise waits for it forever)."""
    import io

    from ssmspec.compile.lower import _Pending, _Worker

    _workers_that_fail(monkeypatch)
    worker = _Worker(tmp_path / "worker.log")
    worker.process.wait(timeout=30)
    for _ in range(500):  # its reader sees the end of its output
        if worker.ended:
            break
        time.sleep(0.01)
    assert worker.ended
    monkeypatch.setattr(worker.process, "stdin", io.StringIO())  # a write that does not fail
    pending = _Pending((), None, [], {}, tmp_path / "step0.pt")
    worker.send(pending)
    assert pending.done.wait(5) and not pending.ok and worker.in_hand() == 0
    worker.close()


def test_a_step_held_by_a_worker_that_exited_is_taken_back(monkeypatch, tmp_path):
    """A worker process that exited while another process holds its pipes (here a child it left behind) never answers
    and its output does not end: the steps it held are taken back (done, not compiled) once it has been gone a moment,
    so that `ahead` compiles them itself instead of waiting."""
    import os
    import signal
    import sys

    from ssmspec.compile.lower import _Pending, _Worker

    # (a child forked before the worker exits keeps its stdin and stdout; it writes its pid to the log and sleeps)
    leave = "import os, sys, time\np = os.fork()\nif p == 0:\n    time.sleep(60)\nelse:\n    print(p, file=sys.stderr)"
    monkeypatch.setattr(lower, "_worker_command", lambda: [sys.executable, "-c", leave])
    worker = _Worker(tmp_path / "worker.log")
    try:
        pending = _Pending((), None, [], {}, tmp_path / "step0.pt")
        worker.send(pending)
        worker.process.wait(timeout=30)
        assert not pending.done.wait(0.2) and not worker.ended  # (the child holds the pipes)
        deadline = time.monotonic() + 30
        while not pending.done.is_set() and time.monotonic() < deadline:
            worker.check_exited()
            time.sleep(0.05)
        assert pending.done.is_set() and not pending.ok and worker.in_hand() == 0
    finally:
        child = (tmp_path / "worker.log").read_text().strip()
        if child:
            os.kill(int(child), signal.SIGKILL)
        worker.close()
