"""Prepacked linears (ssmspec.linear): nn.Linear outside ssmspec's runner, oneDNN on a packed weight inside it
(float32 / bfloat16 on a CPU, no autograd); the packed copy follows the weight and is never copied or pickled;
transform installs them transactionally and `prepack=False` leaves the linears alone."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ssmspec
from ssmspec import linear
from ssmspec.speculate.runner import ModelRunner
from ssmspec.testing.configs import UNSUPPORTED_FAMILIES, build_tiny_model
from ssmspec.testing.strategies import cached_tiny_model

pytestmark = pytest.mark.skipif(not linear.available(), reason="this torch has no oneDNN (mkldnn) linear")


@pytest.fixture(autouse=True)
def every_size_packs(monkeypatch):
    """These tests' tiny weights would stay on F.linear (it is cheaper below a size, tested on its own below)."""
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)
    monkeypatch.setattr(linear, "PACK_MIN_BYTES_ROWS", 0)


def _packed(out_features: int = 40, in_features: int = 24, dtype=torch.float32, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    assert linear.install(lin) == [lin] and type(lin) is linear.PackedLinear
    return lin


def _uses_packed(lin: nn.Module) -> bool:
    cache = lin.weight.__dict__.get("_ssmspec_packed")
    return cache is not None and cache.weight is not None


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_packed_linear_matches_f_linear_inside_the_runner_context_only(rows):
    lin = _packed()
    x = torch.randn(3, rows, 24)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias)) and not _uses_packed(lin)
        with linear.prepacked(True):
            got = lin(x)
        assert _uses_packed(lin)
        with linear.prepacked(False):
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    want = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert got.shape == (3, rows, 40) and got.dtype == torch.float32


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 1)])
def test_one_or_two_rows_are_padded_and_get_the_bits_a_larger_batch_gives_them(shape):
    """Fewer than PAD_ROWS rows run padded with zero rows (oneDNN's packed kernel for 1-2 rows is the slower one):
    each row's result is the one it gets in a batch of 5 rows, bit for bit, in the input's shape."""
    lin = _packed()
    x = torch.randn(*shape, 24)
    rows = shape[0] * shape[1]
    big = torch.cat([x.reshape(rows, 24), torch.randn(5, 24)])
    with torch.no_grad(), linear.prepacked(True):
        got, want = lin(x), lin(big)[:rows]
    assert linear.PAD_ROWS > rows and got.shape == (*shape, 40)
    assert torch.equal(got.reshape(rows, 40), want)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=0, atol=1e-5)


def test_packed_linear_bfloat16_and_no_bias():
    """bfloat16 packs where the CPU has oneDNN's bf16 path; elsewhere (AVX2 only: packing raises there) it stays
    on F.linear, bit for bit."""
    lin = _packed(dtype=torch.bfloat16, bias=False)
    x = torch.randn(2, 7, 24).to(torch.bfloat16)
    with torch.no_grad(), linear.prepacked(True):
        got = lin(x)
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (torch.bfloat16 in linear.packed_dtypes()) is supported
    assert _uses_packed(lin) is supported and got.dtype == torch.bfloat16
    if not supported:
        assert torch.equal(got, F.linear(x, lin.weight))
    torch.testing.assert_close(got.float(), F.linear(x.float(), lin.weight.float()), rtol=2e-2, atol=2e-2)


def test_weight_changes_repack_and_other_dtypes_or_autograd_take_f_linear():
    lin = _packed()
    x = torch.randn(4, 24)
    with linear.prepacked(True):
        with torch.no_grad():
            before = lin(x)
            lin.weight.add_(1.0)  # in place: the weight's version changes
            after = lin(x)
            torch.testing.assert_close(after, F.linear(x, lin.weight, lin.bias), rtol=0, atol=1e-5)
            assert not torch.allclose(before, after)
            lin.weight = nn.Parameter(torch.zeros_like(lin.weight))  # a new tensor
            torch.testing.assert_close(lin(x), lin.bias.expand(4, -1), rtol=0, atol=0)
        out = lin(x)  # autograd on: F.linear, gradients flow
        out.sum().backward()
        assert lin.weight.grad is not None
        with torch.no_grad():
            lin(x)
        assert _uses_packed(lin)
        lin.double()  # cast: the packed float32 copy is stale and goes
        with torch.no_grad():
            assert torch.equal(lin(x.double()), F.linear(x.double(), lin.weight, lin.bias))
        assert "_ssmspec_packed" not in lin.weight.__dict__
        double = _packed(dtype=torch.float64)
        xd = torch.randn(3, 24, dtype=torch.float64)
        with torch.no_grad():
            assert torch.equal(double(xd), F.linear(xd, double.weight, double.bias)) and not _uses_packed(double)


def test_packed_weights_are_not_copied_or_pickled():
    lin = _packed()
    x = torch.randn(2, 24)
    with torch.no_grad(), linear.prepacked(True):
        want = lin(x)
        for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
            assert type(clone) is linear.PackedLinear and not _uses_packed(clone)
            torch.testing.assert_close(clone(x), want, rtol=0, atol=0)
    assert set(lin.state_dict()) == {"weight", "bias"}


def test_transform_installs_packed_linears_and_the_runner_uses_them():
    ref = cached_tiny_model("mamba2", dtype=torch.float32)
    model = ssmspec.transform(copy.deepcopy(ref))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is linear.PackedLinear for m in linears)
    for m in linears:  # the probe's runner packed them: start again
        m.weight.__dict__.pop("_ssmspec_packed")
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)  # a plain forward stays HF's
        assert not any(_uses_packed(m) for m in linears)
        runner = ModelRunner(model)
        got = runner.prefill(ids, torch.ones_like(ids))
    assert runner.prepack and all(_uses_packed(m) for m in linears)
    torch.testing.assert_close(got, ref(ids).logits[:, -1], rtol=1e-4, atol=1e-4)


def test_prepack_false_keeps_nn_linear_and_can_be_switched():
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2")), prepack=False)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert not ModelRunner(model).prepack
    ssmspec.transform(model)  # already transformed: left as it was (prepack not given)
    assert not ModelRunner(model).prepack
    ssmspec.transform(model, prepack=True)  # turns them on
    assert ModelRunner(model).prepack
    ssmspec.transform(model, prepack=False)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("family", UNSUPPORTED_FAMILIES)
def test_a_refused_transform_leaves_the_linears_as_they_were(family):
    model = build_tiny_model(family)
    before = [type(m) for m in model.modules() if isinstance(m, nn.Linear)]  # (subclasses too: DeepSeek-V4's)
    with pytest.raises(ssmspec.UnsupportedModelError):
        ssmspec.transform(model)
    assert [type(m) for m in model.modules() if isinstance(m, nn.Linear)] == before and nn.Linear in before


def test_small_weights_stay_on_f_linear_and_big_ones_pack_by_row_count(monkeypatch):
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 40 * 24 * 4 + 1)  # one row: above this weight
    monkeypatch.setattr(linear, "PACK_MIN_BYTES_ROWS", 40 * 24 * 4)  # 2+ rows: this weight packs
    lin = _packed()
    with torch.no_grad(), linear.prepacked(True):
        one = torch.randn(1, 24)
        assert torch.equal(lin(one), F.linear(one, lin.weight, lin.bias)) and not _uses_packed(lin)
        lin(torch.randn(2, 3, 24))
        assert _uses_packed(lin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_backend_points_cpu_linears_at_the_packed_op(dtype):
    """Compiled with the ssmspec backend, float32 / bfloat16 CPU linears call ssmspec::packed_linear (the packed
    copy found on the parameter the graph receives); float64 ones stay F.linear; output exact (float64) or
    within float32 rounding of HF greedy's logits."""
    from ssmspec.compile.backend import STATS

    torch._dynamo.reset()
    ref = cached_tiny_model("mamba2", dtype=dtype)
    model = ssmspec.transform(copy.deepcopy(ref))
    before = STATS.packed
    model.compile(backend="ssmspec", options={"inductor": False})
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = model(ids).logits
    packed = STATS.packed - before
    if dtype == torch.float64:
        assert packed == 0 and torch.equal(got, ref(ids).logits)
    else:
        assert packed > 0
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert any(_uses_packed(m) for m in linears)
        torch.testing.assert_close(got, ref(ids).logits, rtol=1e-4, atol=1e-4)
    want = ref.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=8, prompt_lookup_num_tokens=3), want)
    torch._dynamo.reset()
