"""`ssmspec.transform(model, compile=True)`: the compile options that measured fastest, chosen for the user, and
a warm-up that compiles every graph before the first request; a failed compile leaves the model eager."""

from __future__ import annotations

import copy

import pytest
import torch

import ssmspec
from ssmspec.compile.backend import STATS
from ssmspec.testing.strategies import cached_tiny_model
from ssmspec.transform import compile_options

IDS = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])


def test_the_chosen_options_per_device():
    assert compile_options(torch.device("cpu")) == {"backend": "ssmspec", "options": {"cpp_wrapper": True}}
    # on CUDA Inductor alone: ssmspec captures the steps (SpecConfig.graphs), not torch's reduce-overhead mode
    assert compile_options(torch.device("cuda")) == {"backend": "ssmspec"}


def test_compile_true_warms_up_before_the_first_request():
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    want = ref.generate(IDS, max_new_tokens=24, do_sample=False)
    # the backend without Inductor: the same graphs (Dynamo traces each bucket), compiled in seconds
    model = ssmspec.transform(copy.deepcopy(ref), compile={"options": {"inductor": False}, "progress": False})
    assert model._compiled_call_impl is not None and model.ssmspec_static_shapes
    assert model.ssmspec_compile_options["options"] == {"cpp_wrapper": True, "inductor": False}
    cal = model._ssmspec_calibration[(1, "cpu")]  # every bucket verified by the warm-up, which completed it
    sizes = sorted(cal.curve())  # the powers of two, then the largest tree (no bucket just below it)
    assert cal.complete and sizes[:4] == [1, 2, 4, 8] and len(sizes) == 5 and sizes[-1] > 8
    graphs = STATS.graphs
    out = model.generate(IDS, max_new_tokens=24)
    assert torch.equal(out, want)
    assert STATS.graphs == graphs  # nothing left to compile for the first request at this batch size
    model.generate(torch.cat([IDS, IDS, IDS], 1), max_new_tokens=8)  # a prompt over one chunk: compiled too
    assert STATS.graphs == graphs
    assert model._ssmspec_calibration[(1, "cpu")] is cal and cal.complete


def test_a_failed_compile_leaves_the_model_eager_with_one_warning():
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    want = ref.generate(IDS, max_new_tokens=16, do_sample=False)
    with pytest.warns(UserWarning, match="running eager") as record:
        model = ssmspec.transform(copy.deepcopy(ref), compile={"backend": "no-such-backend", "progress": False})
    assert len([w for w in record if "running eager" in str(w.message)]) == 1
    assert model._compiled_call_impl is None and not getattr(model, "ssmspec_static_shapes", False)
    assert torch.equal(model.generate(IDS, max_new_tokens=16), want)


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_a_mode_with_options_compiles_on_a_cpu(recwarn, mode):
    """torch.compile refuses a mode and options together; transform(compile={"mode": ...}) adds options of its own on a
    CPU (Inductor's C++ wrapper), so the mode travels among the ssmspec backend's options instead of failing."""
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    want = ref.generate(IDS, max_new_tokens=12, do_sample=False)
    compile_kwargs = {"mode": mode, "options": {"inductor": False}, "progress": False}
    model = ssmspec.transform(copy.deepcopy(ref), compile=compile_kwargs)
    assert not [w for w in recwarn if "running eager" in str(w.message)]
    assert model._compiled_call_impl is not None
    assert model.ssmspec_compile_options["options"]["mode"] == mode and "mode" not in model.ssmspec_compile_options
    assert torch.equal(model.generate(IDS, max_new_tokens=12), want)


def test_other_backends_get_the_settings_a_mode_stands_for():
    from torch._inductor import list_mode_options

    from ssmspec.compile.backend import compile_mode, mode_and_options

    kwargs = mode_and_options({"backend": "inductor", "mode": "max-autotune", "options": {"cpp_wrapper": True}})
    assert "mode" not in kwargs and kwargs["options"] == {**list_mode_options("max-autotune"), "cpp_wrapper": True}
    assert mode_and_options({"mode": "reduce-overhead"}) == {"mode": "reduce-overhead"}  # alone: as given
    assert compile_mode({"backend": "ssmspec", "options": {"mode": "reduce-overhead"}}) == "reduce-overhead"


def test_no_graph_is_compiled_after_the_warm_up():
    """After transform(compile=True) returns, 200-token generates (greedy and sampling, batch 1 and 4, n-gram drafts
    and plain steps as the policy chooses) compile no new graph: every prefill length class, decode step, tree-size
    bucket and commit was compiled by the warm-up."""
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    model = ssmspec.transform(copy.deepcopy(ref), compile={"options": {"inductor": False}, "progress": False,
                                                             "warmup": (1, 4)})  # fmt: skip
    graphs = STATS.graphs
    vocab = ref.config.vocab_size
    for batch in (1, 4):
        ids = (torch.arange(batch * 20).view(batch, 20) % 7 * 3 + 5) % vocab  # repetitive: n-gram drafts accepted
        for sample in (False, True):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=200, do_sample=sample,
                           pad_token_id=0, generator=torch.Generator().manual_seed(batch))  # fmt: skip
            assert STATS.graphs == graphs, f"batch {batch}, do_sample={sample}: {STATS.graphs - graphs} new graphs"


def test_a_compiled_model_prefills_eagerly_on_a_cpu():
    """On a CPU the prompt runs through the model's eager forward (compiling it for any length cost minutes and ran
    no faster); the decode and verify steps run compiled; the output is HF greedy's."""
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    ids = torch.cat([IDS, IDS[:, :7]], 1)  # 19 tokens: longer than any compiled step
    want = ref.generate(ids, max_new_tokens=16, do_sample=False)
    model = ssmspec.transform(copy.deepcopy(ref), compile={"options": {"inductor": False}, "progress": False})
    compiled, lengths = model._compiled_call_impl, []

    def recording(*args, **kwargs):
        lengths.append(kwargs["input_ids"].shape[1])
        return compiled(*args, **kwargs)

    model._compiled_call_impl = recording
    assert torch.equal(model.generate(ids, max_new_tokens=16), want)
    assert lengths and ids.shape[1] not in lengths and max(lengths) <= 16  # steps compiled, the prompt not


def test_a_calibration_on_disk_leaves_no_graph_to_a_users_first_call(tmp_path, monkeypatch):
    """With calibrations kept on disk, a second compiled copy of a model still compiles every tree-size bucket in its
    warm-up (a compiled model's calibration is measured there, never read from disk)."""
    monkeypatch.setenv("SSMSPEC_CACHE", str(tmp_path))
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    options = {"options": {"inductor": False}, "progress": False}
    ssmspec.transform(copy.deepcopy(ref), compile=options).generate(IDS, max_new_tokens=24)
    torch._dynamo.reset()  # (a new process: nothing compiled)
    model = ssmspec.transform(copy.deepcopy(ref), compile=options)
    graphs = STATS.graphs
    model.generate(IDS, max_new_tokens=24, speculation=ssmspec.SpecConfig(adaptive=False))  # (trees every step)
    assert STATS.graphs == graphs
