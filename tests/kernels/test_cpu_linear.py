"""ssmspec_cpu::rows_linear (ssmspec.kernels.cpu_linear) against its reference, and the pass that points a recorded
step's products at it (ssmspec.compile.passes.rows_linears)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ssmspec.compile.passes import rows_linears
from ssmspec.kernels import cpu_linear


@pytest.fixture(scope="module", autouse=True)
def _built():
    # the machine that runs these tests compiles Inductor's C++ steps: it can build the kernel too
    assert cpu_linear.available(), "the CPU product kernel did not build (see the RuntimeWarning)"


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * math.sqrt(max(k, 1)))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 17])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 7), (8, 8), (13, 33), (37, 100), (64, 256), (3, 0), (1027, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_linear_equals_its_reference(rows, n, k, bias):
    """Every row count (the kernel takes rows 2 at a time, then a lone one, for each tile of 8 weight rows), weight
    rows off its tiles, reductions off its vector width (and empty), a product large enough to be split between
    threads, with and without a bias."""
    gen = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    _close(torch.ops.ssmspec_cpu.rows_linear(x, w, b), cpu_linear.reference(x, w, b), k)


def test_rows_linear_reads_strided_rows_and_weights():
    """Rows of a wider buffer (a row stride past their length), a weight read through a column slice or transposed
    twice, as Inductor hands them over."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(5, 90, generator=gen)
    x = wide[:, 10:74]  # stride (90, 1)
    w = torch.randn(48, 80, generator=gen)[:, :64]  # stride (80, 1)
    _close(torch.ops.ssmspec_cpu.rows_linear(x, w, None), cpu_linear.reference(x, w, None), 64)
    wt = torch.randn(64, 48, generator=gen).t()  # columns not contiguous: copied first
    _close(torch.ops.ssmspec_cpu.rows_linear(x, wt, None), cpu_linear.reference(x, wt, None), 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_rows_linear_refuses_other_dtypes(dtype):
    """float32 only: the pass leaves other products to Inductor, and a call with another dtype says so."""
    x, w = torch.randn(2, 8, dtype=dtype), torch.randn(3, 8, dtype=dtype)
    with pytest.raises(RuntimeError, match="float32 only"):
        torch.ops.ssmspec_cpu.rows_linear(x, w, None)


def test_rows_linear_refuses_mismatched_shapes():
    with pytest.raises(RuntimeError, match="x has 8 columns, weight 9"):
        torch.ops.ssmspec_cpu.rows_linear(torch.randn(2, 8), torch.randn(3, 9), None)
    with pytest.raises(RuntimeError, match=r"bias must be float32 of shape \[3\]"):
        torch.ops.ssmspec_cpu.rows_linear(torch.randn(2, 8), torch.randn(3, 8), torch.randn(4))


def test_the_pass_points_products_of_a_few_float32_rows_at_the_kernel():
    """mm and addmm (1-D bias) of 2 to max_rows float32 rows call the kernel, with the graph's values; one row, more
    than max_rows, float64 and a 2-D bias stay as they were (`min_rows=1` takes the one row too)."""
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    wd = w.double()

    def step(x3, x1, x9, xd, b2, b):
        return (torch.mm(x3, w.t()), torch.addmm(b, x3, w.t()), torch.mm(x1, w.t()), torch.mm(x9, w.t()),
                torch.mm(xd, wd.t()), torch.addmm(b2, x3, w.t()))  # fmt: skip

    args = (torch.randn(3, 40, generator=gen), torch.randn(1, 40, generator=gen), torch.randn(9, 40, generator=gen),
            torch.randn(3, 40, generator=gen, dtype=torch.float64), torch.randn(3, 24, generator=gen), b)  # fmt: skip
    gm = make_fx(step)(*args)
    want = gm(*args)
    kernel = torch.ops.ssmspec_cpu.rows_linear.default
    ones = make_fx(step)(*args)
    code = gm.code
    assert rows_linears(gm, max_rows=8, rewrite=False) == 2 and gm.code == code  # (counted, left as it was)
    assert rows_linears(gm, max_rows=8) == 2
    assert sum(node.target is kernel for node in gm.graph.nodes) == 2
    assert rows_linears(ones, max_rows=8, min_rows=1) == 3
    assert sum(node.target is kernel for node in ones.graph.nodes) == 3
    for module in (gm, ones):
        got = module(*args)
        for g, t in zip(got, want):
            torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-5)


def test_products_of_large_weights_take_the_kernel_from_one_row_and_are_not_split():
    """With `large`, a product whose weight has at least that many elements calls the kernel from one row up, one of a
    smaller weight only from `min_rows`; `split_product_rows(below=...)` splits only the smaller weights' products,
    and what it leaves unsplit it splits without `below`. Every value stays the graph's."""
    from ssmspec.compile.passes import split_product_rows

    gen = torch.Generator().manual_seed(5)
    big, small = torch.randn(48, 40, generator=gen), torch.randn(8, 40, generator=gen)  # 1,920 and 320 elements

    def step(x1, x3):
        return torch.mm(x1, big.t()), torch.mm(x1, small.t()), torch.mm(x3, big.t()), torch.mm(x3, small.t())

    args = (torch.randn(1, 40, generator=gen), torch.randn(3, 40, generator=gen))
    mm = torch.ops.aten.mm.default
    want = make_fx(step)(*args)(*args)
    taken = make_fx(step)(*args)
    assert rows_linears(taken, max_rows=8, rewrite=False, large=big.numel()) == 3  # (not the small weight's one row)
    assert rows_linears(taken, max_rows=8, large=big.numel()) == 3
    assert [n.target for n in taken.graph.nodes].count(mm) == 1
    split = make_fx(step)(*args)
    assert split_product_rows(split, 4, below=big.numel()) == 1  # (the small weight's 3 rows)
    assert split_product_rows(split, 4) == 1  # (then the large one's)
    assert [n.target for n in split.graph.nodes].count(mm) == 2 + 3 + 3
    for module in (taken, split):
        for g, t in zip(module(*args), want):
            torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(13, 33), (64, 256), (1027, 300), (2048, 8)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(threads, n, k):
    """Each output is summed in one order whatever the product's rows and threads: a row's result alone equals, bit
    for bit, its result among 2 to 17 rows, at any position (a token's products in verify steps of any size agree)."""
    gen = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(17, k, generator=gen)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([torch.ops.ssmspec_cpu.rows_linear(x[i : i + 1], w, b) for i in range(17)])
        for rows in (2, 3, 4, 5, 8, 17):
            for start in (0, 17 - rows):
                together = torch.ops.ssmspec_cpu.rows_linear(x[start : start + rows], w, b)
                assert torch.equal(together, alone[start : start + rows]), (rows, start)
    finally:
        torch.set_num_threads(saved)


def test_a_background_build_waits_for_its_caller_and_a_failed_one_is_warned_of_there(monkeypatch):
    """`prepare` builds in a thread once (a second call starts nothing); `available()` waits for it, and where the
    build failed warns of it in the calling thread, once, and leaves the steps Inductor's loops (False)."""
    monkeypatch.setattr(cpu_linear, "_STATE", {})
    builds = []

    def failing_build():
        builds.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_linear, "_build", failing_build)
    cpu_linear.prepare()
    cpu_linear.prepare()
    with pytest.warns(RuntimeWarning, match="could not be built .*no compiler here"):
        assert cpu_linear.available() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_linear.available() is False
    assert builds == [1]
