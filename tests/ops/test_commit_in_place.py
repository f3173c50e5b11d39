"""The eager commits that write committed states in place (all layers at once where the cache keeps them stacked,
else layer by layer) equal the commit ops they replace (ssd_state_at, conv_window), for chains, trees, padded
(static-shape) paths and batches; `stacked` finds a stack only where the states really are its consecutive rows."""

from __future__ import annotations

import pytest
import torch

from ssmspec.ops import COMMITS, Record, conv_window, ssd_state_at, tree_ssd
from ssmspec.ops import conv as conv_ops
from ssmspec.ops._common import stacked
from ssmspec.tree import TokenTree

D64 = torch.float64


def _trees(b: int) -> TokenTree:
    rows = [[-1, 0, 0, 1, 1, 2, 5], [-1, 0, 1, 0, 3, 4, 5], [-1, 0, 1, 2, 3, 4, 5]]
    return TokenTree.from_lists([[0] * 7] * b, rows[:b])


def _targets(states: list[torch.Tensor], stack: bool) -> list[torch.Tensor]:
    """The committed states as the cache holds them: rows of one stacked tensor, or separate tensors."""
    if not stack:
        return [s.clone() for s in states]
    base = torch.stack(states)
    return [base[i] for i in range(len(states))]


def _path(tree: TokenTree, last: list[int], width: int | None):
    return tree.paths(torch.tensor(last), width)


@pytest.mark.parametrize("stack", [True, False])
@pytest.mark.parametrize(("b", "last", "width"), [(1, [6], None), (1, [3], 7), (2, [6, 4], None), (3, [5, 2, 6], 7)])
def test_ssd_in_place_commit_equals_replay_op(stack, b, last, width):
    g = torch.Generator().manual_seed(b + len(last) + (width or 0))
    tree = _trees(b)
    n, layers, h, p, grp, s = tree.num_nodes, 3, 4, 3, 2, 5
    records, h0s = [], []
    for _ in range(layers):
        rec = {
            "x": torch.randn(b, n, h, p, generator=g, dtype=D64), "dt": torch.randn(b, n, h, generator=g, dtype=D64),
            "A": -torch.rand(h, generator=g, dtype=D64) - 0.5, "Bm": torch.randn(b, n, grp, s, generator=g, dtype=D64),
            "dt_bias": torch.randn(h, generator=g, dtype=D64), "ancestor_mask": tree.ancestor_mask,
            "dt_softplus": True, "dt_min": 0.0, "dt_max": float("inf"),
        }  # fmt: skip
        h0 = torch.randn(b, h, p, s, generator=g, dtype=D64)
        records.append(rec)
        h0s.append(h0)
    targets = _targets(h0s, stack)
    assert (stacked(targets) is not None) == stack
    items = [(t, Record("ssd", i, 0, replay={**rec, "h0": t})) for i, (t, rec) in enumerate(zip(targets, records))]
    path, lengths = _path(tree, last, width)
    rows = torch.arange(b)
    want = [
        ssd_state_at(r["x"], r["dt"], r["A"], r["Bm"], r["dt_bias"], h0, tree.ancestor_mask[rows, torch.tensor(last)],
                     True, 0.0, float("inf"))
        for r, h0 in zip(records, h0s)
    ]  # fmt: skip
    COMMITS["ssd"](items, path, lengths, torch.tensor(last))
    for got, expected in zip(targets, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("stack", [True, False])
@pytest.mark.parametrize(("b", "last", "width"), [(1, [6], None), (1, [1], 7), (2, [6, 0], None), (3, [5, 2, 6], 7)])
def test_conv_in_place_commit_equals_window_op(stack, b, last, width, compiled, monkeypatch):
    """`compiled`: as a step compiled whole on a CPU records it (a column at a time)."""
    if compiled:
        monkeypatch.setattr(conv_ops, "static", lambda: True)
    g = torch.Generator().manual_seed(7 * b + len(last))
    tree = _trees(b)
    n, layers, c, s = tree.num_nodes, 3, 5, 4
    committed = [torch.randn(b, c, s, generator=g, dtype=D64) for _ in range(layers)]
    nodes = [torch.randn(b, c, n, generator=g, dtype=D64) for _ in range(layers)]
    targets = _targets(committed, stack)
    # [committed | nodes] as the cache records it: time-major memory, in one stacked buffer when the states are
    exts = torch.stack([torch.cat([cm, nd], -1).transpose(1, 2) for cm, nd in zip(committed, nodes)])
    ext = [exts[i].transpose(1, 2) if stack else exts[i].transpose(1, 2).clone() for i in range(layers)]
    items = [(t, Record("conv", i, 0, replay={"nodes": nd, "ext": e}))
             for i, (t, nd, e) in enumerate(zip(targets, nodes, ext))]  # fmt: skip
    path, lengths = _path(tree, last, width)
    with monkeypatch.context() as eager:
        eager.setattr(conv_ops, "static", lambda: False)
        want = [conv_window(cm, nd, path, lengths) for cm, nd in zip(committed, nodes)]
    COMMITS["conv"](items, path, lengths, torch.tensor(last))
    for got, expected in zip(targets, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_stacked_needs_consecutive_rows_of_one_tensor():
    base = torch.zeros(4, 2, 3)
    assert stacked([base[1], base[2], base[3]]).data_ptr() == base[1].data_ptr()
    assert stacked([base[1], base[2], base[3]]).shape == (3, 2, 3)
    assert stacked([base[0], base[2]]) is None  # a gap
    assert stacked([base[2], base[1]]) is None  # out of order
    assert stacked([base[0], torch.zeros(2, 3)]) is None  # another tensor
    assert stacked([base[0]]) is None  # nothing to gain from one
    assert stacked([base[0, :, :2], base[1, :, :2]]) is None  # slices of rows, not rows


def test_window_index_on_the_host_equals_the_tensor_version():
    from ssmspec.ops.conv import _window_index_tensors, window_index

    tree = _trees(3)
    for last, width in (([6, 4, 0], None), ([1, 2, 6], 7), ([0, 0, 0], None)):
        path, lengths = _path(tree, last, width)
        for s in (1, 3, 4, 6):
            assert torch.equal(window_index(s, path, lengths), _window_index_tensors(s, path, lengths))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("groups", "d_shape", "bias"), [(1, "h", True), (2, "hp", False), (4, None, True)])
def test_one_node_step_equals_tree_op_and_replay(dtype, groups, d_shape, bias):
    """ssd_step_ (a one-node tree verified and committed in one, in place) gives the tree op's output and the
    replay commit's state, for grouped B/C, D per head or per channel or none, with and without dt_bias, inputs in
    every dtype users run (the state in the compute dtype, as the cache keeps it)."""
    from ssmspec.ops.ssd import ssd_step_

    g = torch.Generator().manual_seed(groups)
    b, h, p, s = 3, 4, 3, 5
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(b, 1, h, p, generator=g, dtype=D64).to(dtype)
    dt = torch.randn(b, 1, h, generator=g, dtype=D64).to(dtype)
    A = -torch.rand(h, generator=g, dtype=D64) - 0.5
    Bm, Cm = (torch.randn(b, 1, groups, s, generator=g, dtype=D64).to(dtype) for _ in range(2))
    D = {"h": torch.randn(h, generator=g, dtype=D64), "hp": torch.randn(h, p, generator=g, dtype=D64), None: None}
    D = D[d_shape]
    dt_bias = torch.randn(h, generator=g, dtype=D64) if bias else None
    h0 = torch.randn(b, h, p, s, generator=g, dtype=cd)
    one = TokenTree.chain(torch.zeros(b, 1, dtype=torch.long))
    want_y, _ = tree_ssd(x, dt, A, Bm, Cm, D, dt_bias, h0, one.ancestor_mask, True, 0.0, float("inf"), False)
    want_h = ssd_state_at(x, dt, A, Bm, dt_bias, h0, one.ancestor_mask[:, 0], True, 0.0, float("inf"))
    state = h0.clone()
    y = ssd_step_(x, dt, A, Bm, Cm, D, dt_bias, state, True, 0.0, float("inf"))
    tol = 1e-12 if cd == torch.float64 else 1e-5
    assert y.dtype == want_y.dtype and y.shape == want_y.shape
    torch.testing.assert_close(y, want_y, rtol=tol, atol=tol)
    torch.testing.assert_close(state, want_h, rtol=tol, atol=tol)
    assert not torch.equal(state, h0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "s", "k"), [(1, 3, 4), (3, 3, 4), (2, 5, 3)])
@pytest.mark.parametrize("activation", ["silu", ""])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_step_is_the_tree_conv_of_one_node(dtype, b, s, k, activation, bias):
    """A plain step's conv reads its taps in place (the last K columns): the same values as the tree conv gathering
    them by ancestor index, bit for bit, whatever the committed columns beyond the width (s >= k - 1)."""
    from ssmspec.ops.conv import conv_step, tree_causal_conv1d

    g = torch.Generator().manual_seed(b * 10 + s)
    c = 24
    x_ext = torch.randn(b, s + 1, c, generator=g).to(dtype).transpose(1, 2)  # time-major, as the cache builds it
    weight = torch.randn(c, k, generator=g).to(dtype)
    b_ = torch.randn(c, generator=g).to(dtype) if bias else None
    ancestors = TokenTree.from_lists([[0]] * b, [[-1]] * b).ancestors(k)
    want = tree_causal_conv1d(x_ext, weight, b_, ancestors, activation)
    got = conv_step(x_ext, weight, b_, activation)
    assert got.dtype == want.dtype and got.shape == want.shape == (b, c, 1)
    assert torch.equal(got, want)
