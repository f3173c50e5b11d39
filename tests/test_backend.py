"""The `ssmspec` torch.compile backend: registered, finds and rewrites the tree ops, and a compiled
transformed model's greedy speculative output equals the eager one (and HF greedy) for every family."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

import ssmspec
from ssmspec.compile.backend import STATS
from ssmspec.hf import layers as hf_layers
from ssmspec.speculate.engine import eos_and_pad, speculative_generate
from ssmspec.testing import OracleDrafter
from ssmspec.testing.configs import SUPPORTED_FAMILIES
from ssmspec.testing.strategies import cached_tiny_model, capabilities


def _compiled_vs_eager(family: str, options: dict, device: str = "cpu") -> None:
    """On CUDA the models run there in float32 (float64 is routed to the references by design)."""
    torch._dynamo.reset()
    STATS.__init__()
    ref = cached_tiny_model(family)
    if device != "cpu":
        ref = copy.deepcopy(cached_tiny_model(family, dtype=torch.float32)).to(device)
    eager = ssmspec.transform(copy.deepcopy(ref))
    compiled = ssmspec.transform(copy.deepcopy(ref))
    compiled.compile(backend="ssmspec", options=options)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    # the HF-style API (prompt lookup: trees only where the n-gram matches) ...
    caps = capabilities(family)  # a chain-only family gets chains (trees are refused for it, by name)
    spec = ssmspec.SpecConfig(tree=caps.trees, num_draft_tokens=3, tree_budget=6, adaptive=False)
    assert torch.equal(eager.generate(ids, attention_mask=mask, max_new_tokens=8, speculation=spec), want)
    assert torch.equal(compiled.generate(ids, attention_mask=mask, max_new_tokens=8, speculation=spec), want)
    # ... and an oracle that drafts a multi-node tree every step (right chain + a wrong sibling per level)
    rows = [want[r, : ids.shape[1]][mask[r].bool()].tolist() + want[r, ids.shape[1] :].tolist() for r in range(2)]
    eos, pad = eos_and_pad(ref.generation_config)
    for model in (eager, compiled):
        got, _, _ = speculative_generate(
            model, ids, mask, max_new_tokens=8, eos_token_ids=eos, pad_token_id=pad,
            drafter=OracleDrafter(rows, vocab_size=96, right_prefix=2, distractors=int(caps.trees)), tree_budget=6,
            num_draft_tokens=3,
        )  # fmt: skip
        assert torch.equal(got, want)
    assert STATS.graphs > 0 and STATS.tree_ops > 0, "no tree op reached the backend"


_THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
# one family per kind of tree op in the `ci` profile (CI time: compiling a family costs 10-100 s on 2 cores):
# selective scan, SSD (pure, hybrid with attention), gated delta rule, KDA, short convs; every supported family
# (the chain-only inkling2, 99 s, among them) with HYPOTHESIS_PROFILE=thorough
_COMPILED_FAMILIES = (
    SUPPORTED_FAMILIES if _THOROUGH
    else ["mamba", "mamba2", "bamba", "qwen3_5", "kimi_linear", "lfm2"]
)  # fmt: skip


@pytest.mark.parametrize("family", _COMPILED_FAMILIES)
def test_compiled_equals_eager(family):
    """CPU: tree ops stay on their reference path; the graph passes still run (inductor off for CI time)."""
    _compiled_vs_eager(family, {"inductor": False})
    assert STATS.lowered == 0
    assert STATS.folded > 0  # the conv padding folded away


# qwen3_5 and qwen3_next share the gated delta rule; the cheaper one to compile in the `ci` profile
@pytest.mark.gpu  # (on CUDA the real kernels)
@pytest.mark.parametrize(
    "family", ["mamba", "mamba2", "kimi_linear", "lfm2"] + (["qwen3_5", "qwen3_next"] if _THOROUGH else ["qwen3_5"])
)
def test_compiled_with_kernels_forced_equals_eager(family):
    """The lowering to Triton kernels, exercised on CPU through the interpreter; with CUDA visible, the real
    kernels on CUDA (Triton cannot compile for CPU tensors outside the interpreter)."""
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    _compiled_vs_eager(family, {"inductor": False, "kernels": True}, "cuda" if torch.cuda.is_available() else "cpu")
    assert STATS.lowered == STATS.tree_ops > 0


def test_unknown_option_is_an_error():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown options"):
        torch.compile(lambda x: x + 1, backend="ssmspec", options={"fusion": False})(torch.ones(2))


def test_inductor_settings_pass_through_to_inductor(monkeypatch):
    """Options that are Inductor config settings (cpp_wrapper, ...) reach Inductor with the mode's settings."""
    import torch._inductor.compile_fx as fx_module

    seen = []
    real = fx_module.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(config_patches)
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(fx_module, "compile_fx", spy)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + 1, backend="ssmspec", options={"cpp_wrapper": True, "fuse": False})
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    assert seen == [{"cpp_wrapper": True}]
    torch._dynamo.reset()


def test_backend_registered_by_entry_point_in_a_fresh_interpreter():
    names = {ep.name for ep in entry_points(group="torch_dynamo_backends")}
    assert "ssmspec" in names
    code = (
        "import sys, torch\n"
        "out = torch.compile(lambda x: x * 2, backend='ssmspec', options={'inductor': False})(torch.ones(3))\n"
        "assert out.tolist() == [2.0, 2.0, 2.0] and 'ssmspec' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_kernel_policy_belongs_to_the_compiled_model(monkeypatch):
    """Compiling one model with `kernels=...` used to set a process-global policy, changing how every other
    model's eager probe and commits ran."""
    import ssmspec.speculate.generate as spec_generate
    from ssmspec.ops import kernel_policy

    torch._dynamo.reset()
    ref = cached_tiny_model("mamba2")
    compiled = ssmspec.transform(copy.deepcopy(ref))
    compiled.compile(backend="ssmspec", options={"kernels": "kernels", "inductor": False})
    other = ssmspec.transform(copy.deepcopy(ref))  # transformed (and probed) after the compile
    seen = []
    real = spec_generate.generate
    monkeypatch.setattr(spec_generate, "generate", lambda *a, **k: (seen.append(kernel_policy()), real(*a, **k))[1])
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    other.generate(ids, max_new_tokens=3, prompt_lookup_num_tokens=2)
    compiled.generate(ids, max_new_tokens=3, speculation=ssmspec.SpecConfig(drafter="none"))
    other.generate(ids, max_new_tokens=3, prompt_lookup_num_tokens=2)
    assert seen == ["reference", "kernels", "reference"]
    assert kernel_policy() == "reference"
    refused = copy.deepcopy(other)
    with pytest.raises(ValueError, match="kernels must be one of"):
        refused.compile(backend="ssmspec", options={"kernels": "fastest"})
    # a refused compile leaves the model as it was: not compiled, no static shapes, no compile settings
    assert refused._compiled_call_impl is None
    assert not {"ssmspec_static_shapes", "ssmspec_compile_options", "ssmspec_kernel_policy"} & set(vars(refused))


@pytest.mark.parametrize("when", ["compile", "first run"])
def test_inductor_failure_falls_back_per_graph(monkeypatch, when):
    """`model.compile(backend="ssmspec")` crashed user code where Inductor failed (torch 2.11's Triton codegen
    on HF's Mamba2 path in bf16). Now the failing graph runs without Inductor, with one warning naming it."""
    import torch._inductor.compile_fx as inductor

    from ssmspec.compile.backend import STATS

    def broken(gm, example_inputs, *args, **kwargs):
        if when == "compile":
            raise TypeError("list indices must be integers or slices, not NoneType")

        def run(*a):
            raise TypeError("list indices must be integers or slices, not NoneType")

        return run

    monkeypatch.setattr(inductor, "compile_fx", broken)
    torch._dynamo.reset()
    STATS.__init__()
    ref = cached_tiny_model("bamba")
    model = ssmspec.transform(copy.deepcopy(ref))
    model.compile(backend="ssmspec")
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    with pytest.warns(RuntimeWarning, match="Inductor failed on a graph .TypeError: list indices"):
        got = model.generate(
            ids, max_new_tokens=6, speculation=ssmspec.SpecConfig(tree=True, num_draft_tokens=3, adaptive=False)
        )
    assert torch.equal(got, want)
    assert STATS.fallbacks >= 1


@pytest.mark.parametrize("when", ["compile", "first run"])
def test_split_scan_bug_is_worked_around_with_an_opaque_cumsum(monkeypatch, when):
    """torch 2.11's Triton codegen of a split scan (the cumsum of HF's Mamba2 chunked path) fails in
    `get_block_shape`; the graph is compiled again with its cumsums opaque to Inductor (ATen's kernel), still
    through Inductor (no fallback), with one warning saying so, and the output stays exact."""
    import torch._inductor.compile_fx as inductor

    from ssmspec.compile.backend import STATS

    real = inductor.compile_fx
    seen = {"cumsum": 0, "opaque": 0}

    def split_scan_bug(gm, example_inputs, *args, **kwargs):
        targets = [n.target for n in gm.graph.nodes]
        if any(t in (torch.cumsum, "cumsum", torch.ops.aten.cumsum.default) for t in targets):
            seen["cumsum"] += 1
            if when == "compile":
                raise TypeError("list indices must be integers or slices, not NoneType")

            def run(*a):
                raise TypeError("list indices must be integers or slices, not NoneType")

            return run
        seen["opaque"] += torch.ops.ssmspec_compat.cumsum.default in targets
        return real(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", split_scan_bug)
    torch._dynamo.reset()
    STATS.__init__()
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    model.compile(backend="ssmspec", options={"kernels": "reference"})
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids).logits
        with pytest.warns(RuntimeWarning, match="ATen's cumsum"):
            got = model(ids).logits  # HF's chunked path, compiled (a compiled model's prompt runs eagerly on a CPU)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # (float32: Inductor rounds its own way)
    assert seen["cumsum"] >= 1 and seen["opaque"] >= 1
    assert STATS.fallbacks == 0 and STATS.workarounds == seen["cumsum"]


def test_traceable_references_are_inlined_for_inductor():
    """Where the reference runs anyway (CPU), the backend traces it into the graph so Inductor fuses it; the
    level-by-level references (data-dependent loops) stay ops. The rewritten graph computes the same."""
    from torch import fx

    from ssmspec.compile.passes import inline_tree_ops
    from ssmspec.ops.ssd import ssd_state_at

    g = torch.Generator().manual_seed(0)
    b, n, h, p, s = 2, 5, 4, 3, 6
    args = (torch.randn(b, n, h, p, generator=g), torch.randn(b, n, h, generator=g), -torch.rand(h, generator=g),
            torch.randn(b, n, 1, s, generator=g), torch.randn(h, generator=g), torch.randn(b, h, p, s, generator=g),
            torch.rand(b, n, generator=g) > 0.5)  # fmt: skip
    graph = fx.Graph()
    inputs = [graph.placeholder(f"a{i}") for i in range(len(args))]
    ssd = graph.call_function(torch.ops.ssmspec.ssd_state_at.default, (*inputs, True, 0.0, float("inf")))
    delta = graph.call_function(torch.ops.ssmspec.tree_delta_rule.default, ())  # never run, only rewritten
    graph.output(ssd)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert inline_tree_ops(gm, on_cuda=False) == 1
    assert delta.target is torch.ops.ssmspec.tree_delta_rule.default
    graph.erase_node(delta)
    gm.recompile()
    want = ssd_state_at(*args, True, 0.0, float("inf"))
    assert torch.equal(gm(*args), want)


def test_compiled_with_inductor_inlines_the_references(recwarn):
    """With Inductor on: every tree op of Mamba2 is inlined, and no graph falls back."""
    _compiled_vs_eager("mamba2", {})
    assert STATS.fallbacks == 0, [str(w.message) for w in recwarn]
    assert STATS.inlined == STATS.tree_ops > 0


def test_selective_scan_output_has_its_fakes_layout():
    """Inductor checks a custom op's real output strides against its fake's: Mamba1's tree scan returned a
    transposed y, so every compiled Mamba graph fell back to running without Inductor."""
    from ssmspec.ops.selective_scan import tree_selective_scan

    g = torch.Generator().manual_seed(0)
    b, d, n, s = 2, 6, 4, 3
    x, dt, z = (torch.randn(b, d, n, generator=g) for _ in range(3))
    bm, cm = torch.randn(b, s, n, generator=g), torch.randn(b, s, n, generator=g)
    parents = torch.tensor([[-1, 0, 0, 1]] * b)
    depth = torch.tensor([[0, 1, 1, 2]] * b)
    y, _ = tree_selective_scan(x, dt, -torch.rand(d, s, generator=g), bm, cm, torch.ones(d), z, None, None,
                               parents, depth, True, False)  # fmt: skip
    assert y.shape == x.shape and y.is_contiguous()


def test_a_compiled_model_commits_through_its_compiled_fold_on_cuda_only():
    """The commit between verifications (every layer's state replay) runs as one compiled function per
    compiled model on CUDA, made with the model's own backend and options; it leaves the same committed states
    as the eager commit. On a CPU, and for an eager model, the eager commit runs (cheaper there)."""
    from ssmspec.compiled import compiled_as
    from ssmspec.speculate.runner import ModelRunner, compiled_fold
    from ssmspec.tree import TokenTree

    torch._dynamo.reset()
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref))
    assert compiled_fold(model, compiled_as(model).options) is None
    model.compile(backend="ssmspec", options={"inductor": False})
    fold = compiled_fold(model, compiled_as(model).options)
    assert fold is not None and compiled_fold(model, compiled_as(model).options) is fold
    calls = []

    def spy(*args):
        calls.append(len(args[0]))
        return fold(*args)

    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    runners = [ModelRunner(model, static_shapes=True, max_depth=3, max_nodes=7) for _ in range(2)]
    assert all(r.fold is None for r in runners)  # a CPU model
    runners[0].fold = spy
    tree = TokenTree.from_lists([[5, 6, 7, 8, 9, 10]], [[-1, 0, 0, 1, 3, 2]])
    with torch.no_grad():
        for runner in runners:
            runner.prefill(ids, torch.ones_like(ids))
            for last in (4, 2, 5):
                runner.verify(tree)
                runner.commit(torch.tensor([last]))
    assert calls == [2, 2, 2]  # ssd and conv records, folded together
    states = [[t for d in hf_layers.state_dicts(layer).values() for t in d.values() if t is not None]
              for layer in (r.cache.layers[i] for r in runners for i in r.cache.recurrent)]  # fmt: skip
    half = len(states) // 2
    for a, b in zip(states[:half], states[half:]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    eos, pad = eos_and_pad(ref.generation_config)
    drafter = OracleDrafter([want[0].tolist()], vocab_size=96, right_prefix=2, distractors=1)
    model.__dict__["_ssmspec_compiled_commit"] = spy
    calls.clear()
    got, stats, _ = speculative_generate(
        model, ids, torch.ones_like(ids), max_new_tokens=12, eos_token_ids=eos, pad_token_id=pad, drafter=drafter,
        tree_budget=6, num_draft_tokens=3,
    )  # fmt: skip
    assert torch.equal(got, want) and calls == [] and sum(n > 1 for n in stats.tree_nodes_per_step) > 0


def test_a_model_with_a_draft_head_is_compiled_with_its_feature_hook():
    """A compiled forward calls the module hooks that were there when Dynamo traced it (it does not guard on them): a
    model with a draft head gets its LM head's feature hook before `compile`, so that a forward compiled before the
    first call that drafts from features (the prompt's, on CUDA, compiled by the warm-up) still hands them over."""
    from ssmspec.hf import features
    from ssmspec.speculate.drafters.head import DraftHead

    torch._dynamo.reset()
    ref = cached_tiny_model("mamba2")
    model = ssmspec.transform(copy.deepcopy(ref), draft_head=DraftHead.for_model(ref).double())
    model.compile(backend="ssmspec", options={"inductor": False})
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(ids)  # traced and compiled here, before any call captures features
        with features.capturing(model) as box:
            logits = model(ids).logits
        assert box.features is not None and box.features.shape[:-1] == logits.shape[:-1]
        torch.testing.assert_close(model.get_output_embeddings()(box.features).to(logits.dtype), logits)
