"""Token recycling and calibrated best-first drafts: the successor table and calibration, the best-first tree
against brute force, what the engine tells the drafter (the target's own top-k, checked against HF's forward),
exactness through generate (greedy token-exact, sampling by chi-square), and the settings it refuses."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ssmspec
from ssmspec.speculate import calibration
from ssmspec.speculate.drafters import PromptLookupDrafter
from ssmspec.speculate.engine import speculative_generate
from ssmspec.speculate.recycling import Calibration, SuccessorTable, Trie, best_first
from ssmspec.testing.distribution import sampling_p_value, tiny_sampling_setup
from ssmspec.testing.strategies import cached_tiny_model


def test_successor_table_prefers_the_pair_and_falls_back_to_the_token():
    table = SuccessorTable(2)
    assert table.successors(1, 2) == [] and not table.knows(1, 2)
    table.learn(None, 2, [5, 6, 7], [0.5, 0.3, 0.1])  # k = 2: the third is dropped
    table.learn(1, 2, [8, 9], [0.6, 0.2])
    assert table.successors(1, 2) == [(8, 0.6), (9, 0.2)]  # the pair
    assert table.successors(3, 2) == [(8, 0.6), (9, 0.2)]  # unseen pair: the token's latest observation
    table.learn(None, 2, [5, 6, 7], [0.5, 0.3, 0.1])
    assert table.successors(3, 2) == [(5, 0.5), (6, 0.3)] and table.successors(1, 2)[0] == (8, 0.6)
    assert table.knows(1, 2) and not table.knows(3, 2) and table.knows(None, 2)
    with pytest.raises(ValueError, match="k >= 1"):
        SuccessorTable(0)


def test_calibration_moves_from_its_prior_to_what_it_observes():
    cal = Calibration(prior_weight=2.0)
    feature = Calibration.feature(share=1.0, prob=0.0)
    assert cal.estimate(feature) == pytest.approx(0.8 * 0.95)  # the prior: 0.8 x the share's bucket edge
    for _ in range(98):
        cal.update(feature, accepted=False)
    assert cal.estimate(feature) == pytest.approx(2 * 0.8 * 0.95 / 100)
    other = Calibration.feature(share=0.0, prob=0.62)
    assert cal.estimate(other) == pytest.approx(0.5)  # untouched bucket: its own prior
    assert Calibration.feature(0.0, 0.0) == (0, 0) and Calibration.feature(1.0, 1.0) == (5, 6)


def _candidates(trie, table, prev, node_token, trie_node):
    """Independent statement of the candidates after a node: trie children (vote shares) and recycled successors."""
    out = {}
    if trie_node >= 0 and trie_node in trie.kids:
        total = sum(trie.weight[k] for k in trie.kids[trie_node])
        out = {trie.tokens[k]: [trie.weight[k] / total, 0.0, k] for k in trie.kids[trie_node]}
    for tok, p in table.successors(prev, node_token):
        out.setdefault(tok, [0.0, 0.0, -1])[1] = p
    return out


@given(
    conts=st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.floats(0.1, 4.0)), max_size=5),
    learned=st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True)),
                     max_size=6),
    max_nodes=st.integers(1, 10), max_depth=st.integers(1, 4), chain=st.booleans(),
)  # fmt: skip
def test_best_first_takes_the_likeliest_paths(conts, learned, max_nodes, max_depth, chain):
    """A tree keeps the `max_nodes` candidates with the highest estimated path probabilities (brute force over
    every candidate path within the depth); a chain follows the likeliest child from the root."""
    table = SuccessorTable(3)
    for tok, succ in learned:
        table.learn(None, tok, succ, [0.9 / (i + 1) for i in range(len(succ))])
    cal = Calibration()
    trie = Trie(0, conts)
    tokens, parents, paths, features, logps = best_first(None, trie, table, cal, max_nodes, max_depth, chain)
    assert len(tokens) <= max_nodes + 1 and parents[0] == -1 and all(0 <= p < t for t, p in enumerate(parents) if t)
    assert len(set(paths)) == len(paths)  # siblings differ
    depth = [0] * len(tokens)
    for t in range(1, len(tokens)):
        depth[t] = depth[parents[t]] + 1
    assert max(depth) <= max_depth

    def logp(cand):
        return math.log(cal.estimate(Calibration.feature(cand[0], cand[1])))

    # every candidate path (prev token, token, trie node, log prob, depth), expanded exhaustively
    every, frontier = [], [(None, 0, 0, 0.0, 0)]
    while frontier:
        prev, tok, at, lp, d = frontier.pop()
        if d >= max_depth:
            continue
        for child, cand in _candidates(trie, table, prev, tok, at).items():
            node = (tok, child, cand[2], lp + logp(cand), d + 1)
            every.append(node[3])
            frontier.append(node)
    got = []
    lp = [0.0] * len(tokens)
    for t in range(1, len(tokens)):
        lp[t] = lp[parents[t]] + math.log(cal.estimate(features[t]))
        got.append(lp[t])
    assert logps == pytest.approx(lp)
    if chain:
        assert all(parents[t] == t - 1 for t in range(1, len(tokens)))
        return
    want = sorted(every, reverse=True)[:max_nodes]
    assert sorted(got, reverse=True) == pytest.approx(want)


class Spy(PromptLookupDrafter):
    """Records what the engine tells the drafter."""

    def __init__(self, **kwargs):
        super().__init__(2, **kwargs)
        self.prompts, self.steps = [], []

    def observe_prompt(self, row, tokens, tops):
        self.prompts.append((row, list(tokens), tops))
        super().observe_prompt(row, tokens, tops)

    def observe(self, row, context, draft, tops, emitted):
        self.steps.append((row, list(context), draft, tops, list(emitted)))
        super().observe(row, context, draft, tops, emitted)


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_the_drafter_is_told_the_targets_own_top_k(family):
    """After the prefill, the top-k after every real prompt token; after every step, after every verified node
    (accepted or not), each checked against HF's forward of the node's own context. The output is HF greedy."""
    ref = cached_tiny_model(family)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 0, 9, 10, 11, 9, 10, 11, 9, 10]])
    mask = (ids != 0).long()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                        pad_token_id=0)  # fmt: skip
    spy = Spy(tree=True, recycle=3)
    out, stats, _ = speculative_generate(
        ssmspec.transform(copy.deepcopy(ref)), ids, mask, max_new_tokens=16, eos_token_ids=[], pad_token_id=0,
        drafter=spy, tree_budget=6, num_draft_tokens=3,
    )  # fmt: skip
    assert torch.equal(out, want)

    def top(context):
        with torch.no_grad():
            probs = ref(torch.tensor([context])).logits[0, -1].double().softmax(-1)
        p, i = probs.topk(3)
        return i.tolist(), p.tolist()

    assert sorted(r for r, *_ in spy.prompts) == [0, 1]
    for row, tokens, tops in spy.prompts:
        assert tokens == ids[row][mask[row].bool()].tolist() and len(tops) == len(tokens)
        for i in (0, len(tokens) // 2, len(tokens) - 1):
            want_ids, want_p = top(tokens[: i + 1])
            assert tops[i][0] == want_ids and tops[i][1] == pytest.approx(want_p, abs=1e-6)
    assert len(spy.steps) >= stats.verify_steps and any(len(d[0]) > 2 for _, _, d, _, _ in spy.steps)
    checked = 0
    for _row, context, (tokens, parents), tops, _emitted in spy.steps:
        assert len(tops) == len(tokens)
        for t in range(len(tokens)):
            path, node = [], t
            while node > 0:
                path.append(tokens[node])
                node = parents[node]
            want_ids, want_p = top(context + path[::-1])
            assert tops[t][0] == want_ids and tops[t][1] == pytest.approx(want_p, abs=1e-6)
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("family", ["mamba2", "bamba", "qwen3_next"])
@pytest.mark.parametrize("tree", [False, True])
def test_recycling_is_token_exact(family, tree):
    ref = cached_tiny_model(family)
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4], [0, 0, 0, 7, 8, 9, 7, 8]])
    mask = (ids != 0).long()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    model = ssmspec.transform(copy.deepcopy(ref))
    for static in (False, True):
        spec = ssmspec.SpecConfig(
            tree=tree, tree_budget=8, num_draft_tokens=4, recycle=4, static_shapes=static, adaptive=False
        )  # verification, not the policy
        out = model.generate(ids, attention_mask=mask, max_new_tokens=30, speculation=spec,
                             return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(out.sequences, want)
        assert max(out.spec_stats["tree_nodes_per_step"]) > 1  # drafts were verified


def test_calibration_learns_during_generate():
    """Every step feeds back which drafted nodes the target tested and accepted."""
    ref = cached_tiny_model("mamba2")
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    drafter = PromptLookupDrafter(2, tree=True, recycle=4)
    model = ssmspec.transform(copy.deepcopy(ref))
    speculative_generate(model, ids, torch.ones_like(ids), max_new_tokens=30, eos_token_ids=[], pad_token_id=0,
                         drafter=drafter, tree_budget=8, num_draft_tokens=4)  # fmt: skip
    tested = sum(n for _, n in drafter.calibration._counts.values())
    accepted = sum(a for a, _ in drafter.calibration._counts.values())
    assert tested > 10 and 0 < accepted < tested


def test_recycling_sampling_matches_hf_sampling():
    """Recycled drafts are deterministic proposals: speculative sampling with them stays lossless (chi-square
    against HF's own sampling, as tests/speculate/test_sampling.py)."""
    target, _, prompt = tiny_sampling_setup(16)
    model = ssmspec.transform(copy.deepcopy(target))
    spec = ssmspec.SpecConfig(tree=True, tree_budget=6, num_draft_tokens=3, recycle=3, adaptive=False)
    p, stats = sampling_p_value(target, model, prompt, samples=3000, do_sample=True, speculation=spec,
                                temperature=1.0, top_k=0)  # fmt: skip
    assert stats["accepted_tokens"] > 300
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_refused_settings_name_themselves():
    with pytest.raises(ValueError, match="recycle must be >= 0"):
        ssmspec.SpecConfig(recycle=-1)
    with pytest.raises(ValueError, match="recycle.*'prompt_lookup'"):
        ssmspec.SpecConfig(drafter="draft_model", recycle=4)
    with pytest.raises(ValueError, match="recycle and SpecConfig.ahead"):
        ssmspec.SpecConfig(recycle=4, ahead=2)
    with pytest.raises(TypeError, match="recycle"):
        ssmspec.SpecConfig(recycle=2.5)
    with pytest.raises(ValueError, match="recycle must be >= 0"):
        PromptLookupDrafter(2, recycle=-2)


def test_goodput_size_keeps_the_best_prefix():
    """Expected tokens (1 + the kept nodes' path probabilities) per unit of cost, over every prefix."""
    from ssmspec.speculate.recycling import goodput_size

    logp = [0.0] + [math.log(p) for p in (0.9, 0.8, 0.5, 0.1, 0.05)]
    flat = lambda n: 1.0  # noqa: E731 - nodes are free: keep them all
    assert goodput_size(logp, flat) == 6
    steep = lambda n: 1.0 + 0.5 * (n - 1)  # noqa: E731 - each node costs half a decode step
    # goodputs: 1, 1.9/1.5, 2.7/2, 3.2/2.5, 3.3/3, 3.35/3.5 -> the best is 2 drafted nodes (1.35)
    assert goodput_size(logp, steep) == 3
    assert goodput_size(logp, lambda n: 1.0 if n == 1 else 10.0) == 1  # drafting never pays: plain decoding


def test_adaptive_recycling_sizes_its_trees_by_cost():
    """With SpecConfig(adaptive=True) the recycling drafter sizes each tree from its calibrated estimates and
    the model's measured cost curve; a steep curve makes the trees smaller; the output stays HF greedy."""
    ref = cached_tiny_model("mamba2")
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    want = ref.generate(ids, max_new_tokens=30, do_sample=False)
    model = ssmspec.transform(copy.deepcopy(ref))
    nodes = {}
    for name, curve in {"flat": {1: 1.0, 32: 1.0}, "steep": {1: 1.0, 2: 3.0, 32: 40.0}}.items():
        calibration.fixed(model, 1, curve)  # the measured curve, replaced
        spec = ssmspec.SpecConfig(tree=True, tree_budget=8, num_draft_tokens=4, recycle=4, adaptive=True)
        out = model.generate(ids, max_new_tokens=30, speculation=spec, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want)
        nodes[name] = out.spec_stats["tree_nodes_per_step"]
    assert max(nodes["flat"]) == 9 and max(nodes["steep"]) < max(nodes["flat"])
