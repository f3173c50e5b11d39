"""What only a GPU can check (`pytest -m gpu`, skipped without CUDA): a captured step is a CUDA graph that keeps the
op tape's contract, `transform(m, compile=True)` compiles and captures on CUDA without falling back and without
recompiling later calls, and the backend runs the families' tiny models in bfloat16 there. The CPU-side twins of
these checks (the op tape, the backend with the interpreter) are in test_graphs.py, test_compiled_steps.py and
test_backend.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ssmspec
from ssmspec.compile.graphs import StepGraph
from ssmspec.compiled import compiled_as
from ssmspec.errors import CaptureError
from ssmspec.speculate.ties import near_tie_tolerance
from ssmspec.testing.check import CheckReport, _compare
from ssmspec.testing.strategies import cached_tiny_model, capabilities

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with -m gpu on a GPU machine)"),
]


def _step_on(device: str) -> list[torch.Tensor]:
    """A step that updates a static state in place and returns a temporary; captured, then replayed three times
    with new inputs copied in. Returns the state and the output after each replay."""
    state = torch.arange(6, dtype=torch.float32, device=device)
    x = torch.ones(6, device=device)

    def step():
        state.mul_(0.5).add_(x)
        return (state * 2).sum(0, keepdim=True)

    graph = StepGraph(torch.device(device))
    graph.capture(step, warmup=False)  # (the step advances its state: run once, as the first replay)
    seen = []
    for i in range(3):
        x.copy_(torch.full((6,), float(i), device=device))
        out = graph.replay()
        seen += [state.clone().cpu(), out.clone().cpu()]
    return seen


def test_a_cuda_graph_step_keeps_the_op_tapes_contract():
    """The same step captured on CUDA (a CUDA graph) and on the CPU (the op tape) leaves the same values after
    every replay: the capture's run, then each replay, updates the state in place and refreshes the output."""
    for got, want in zip(_step_on("cuda"), _step_on("cpu")):
        torch.testing.assert_close(got, want)


def test_a_host_read_while_capturing_on_cuda_is_refused():
    state = torch.ones(4, device="cuda")
    graph = StepGraph(torch.device("cuda"))
    with pytest.raises(CaptureError):
        graph.capture(lambda: state.add_(1) if state.sum().item() > 0 else state)


def test_compile_true_on_cuda_captures_without_fallback_and_equals_hf_greedy():
    """The embedded target (float32): `transform(m, compile=True)` compiles and captures with no warning of a
    fallback; the default call and plain decoding equal HF greedy; a second call compiles nothing new."""
    from ssmspec import models
    from ssmspec.bench import held_out_prompts
    from ssmspec.compile.backend import STATS

    ref, tok = models.load("mamba2-target")
    ref = ref.to("cuda")
    prompts = [p.to("cuda") for p in held_out_prompts(tok, 2, 64)]
    want = [ref.generate(p, max_new_tokens=24, do_sample=False) for p in prompts]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ssmspec.transform(copy.deepcopy(ref), compile={"progress": False})
    failures = [str(w.message) for w in caught if "fail" in str(w.message).lower()]
    assert not failures, failures
    how = compiled_as(model)
    assert how.compiled and how.graphs
    for p, w in zip(prompts, want):
        assert torch.equal(model.generate(p, max_new_tokens=24), w)
        assert torch.equal(model.generate(p, max_new_tokens=24, speculation=ssmspec.SpecConfig(drafter="none")), w)
    graphs = STATS.graphs
    for p, w in zip(prompts, want):
        assert torch.equal(model.generate(p, max_new_tokens=24), w)
    assert STATS.graphs == graphs, "a later call recompiled"


@pytest.mark.parametrize("family", ["mamba", "mamba2", "bamba", "qwen3_next", "kimi_linear", "lfm2"])
def test_the_backend_runs_each_kind_of_tree_op_in_bfloat16_on_cuda(family):
    """One family per kind of tree op, bfloat16 on CUDA under the ssmspec backend (kernels or references as
    selected by measurement): speculative greedy equals HF greedy, or first differs where HF's top-2 logits are a
    near-tie."""
    torch._dynamo.reset()
    ref = copy.deepcopy(cached_tiny_model(family, dtype=torch.bfloat16)).to("cuda")
    model = ssmspec.transform(copy.deepcopy(ref))
    model.compile(backend="ssmspec")
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1)).to("cuda")
    hf = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                      return_dict_in_generate=True, output_logits=True)  # fmt: skip
    spec = ssmspec.SpecConfig(tree=capabilities(family).trees, num_draft_tokens=3, tree_budget=6, adaptive=False)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, speculation=spec)
    assert got.shape == hf.sequences.shape
    # the checker's comparison: each row's first difference must fall at a near-tie of HF's logits, else it raises
    _compare(got, hf.sequences, torch.stack(hf.logits, 1), ids.shape[1], near_tie_tolerance(torch.bfloat16),
             CheckReport(), f"{family}, bfloat16 on CUDA under the backend")  # fmt: skip
