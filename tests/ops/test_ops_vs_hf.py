"""Each reference tree op on a chain equals the Hugging Face fallback it replaces; on trees it equals a
sequential per-node evaluation; and the commit ops pick the right states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba.modeling_mamba import mamba_selective_scan
from transformers.models.mamba2.modeling_mamba2 import causal_conv1d_fn, mamba2_chunk_scan
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from ssmspec.ops import conv_window, gather_states, tree_causal_conv1d, tree_delta_rule, tree_selective_scan, tree_ssd
from ssmspec.ops.ssd import ssd_states_ref
from ssmspec.tree import TokenTree

D64 = torch.float64


def _tree() -> TokenTree:
    return TokenTree.from_lists([[0] * 7, [0] * 5], [[-1, 0, 0, 1, 1, 2, 5], [-1, 0, 1, 0, 3]])


def test_conv_chain_matches_hf():
    g = torch.Generator().manual_seed(0)
    b, c, k, n, s = 2, 6, 4, 5, 4
    state = torch.randn(b, c, s, generator=g, dtype=D64)
    x = torch.randn(b, c, n, generator=g, dtype=D64)
    w, bias = torch.randn(c, k, generator=g, dtype=D64), torch.randn(c, generator=g, dtype=D64)
    want = causal_conv1d_fn(torch.cat([state, x], -1), w, bias, activation="silu")[:, :, -n:]
    chain = TokenTree.chain(torch.zeros(b, n, dtype=torch.long))
    got = tree_causal_conv1d(torch.cat([state, x], -1), w, bias, chain.ancestors(k), "silu")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_conv_tree_equals_per_path_chain():
    g = torch.Generator().manual_seed(1)
    tree = _tree()
    b, n = tree.tokens.shape
    c, k, s = 3, 4, 4
    state = torch.randn(b, c, s, generator=g, dtype=D64)
    x = torch.randn(b, c, n, generator=g, dtype=D64)
    w = torch.randn(c, k, generator=g, dtype=D64)
    got = tree_causal_conv1d(torch.cat([state, x], -1), w, None, tree.ancestors(k), "")
    for r in range(b):
        for t in range(n):
            path, length = tree.paths(torch.tensor([t] * b))
            seq = torch.cat([state[r], x[r][:, path[r, : length[r]]]], -1)
            want = F.conv1d(seq[None], w[:, None], groups=c)[0, :, -1]
            torch.testing.assert_close(got[r, :, t], want, rtol=0, atol=1e-12)


def _ssd_inputs(g, b, n, h=4, p=3, grp=2, s=5):
    x = torch.randn(b, n, h, p, generator=g, dtype=D64)
    dt = torch.randn(b, n, h, generator=g, dtype=D64)
    A = -torch.rand(h, generator=g, dtype=D64) - 0.5
    Bm = torch.randn(b, n, grp, s, generator=g, dtype=D64)
    Cm = torch.randn(b, n, grp, s, generator=g, dtype=D64)
    D = torch.randn(h, generator=g, dtype=D64)
    bias = torch.randn(h, generator=g, dtype=D64)
    h0 = torch.randn(b, h, p, s, generator=g, dtype=D64)
    return x, dt, A, Bm, Cm, D, bias, h0


def test_ssd_chain_matches_hf_chunk_scan():
    g = torch.Generator().manual_seed(2)
    b, n = 2, 6
    x, dt, A, Bm, Cm, D, bias, h0 = _ssd_inputs(g, b, n)
    y_hf, final = mamba2_chunk_scan(
        x, dt, A, Bm, Cm, 4, D=D, dt_bias=bias, initial_states=h0, dt_softplus=True, return_final_states=True
    )
    chain = TokenTree.chain(torch.zeros(b, n, dtype=torch.long))
    y, states = tree_ssd(x, dt, A, Bm, Cm, D, bias, h0, chain.ancestor_mask, True, 0.0, float("inf"), True)
    # HF's fallback runs the scan in float32 even for float64 inputs: compare at float32 accuracy
    torch.testing.assert_close(y.float(), y_hf.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[:, -1].float(), final.float(), rtol=1e-4, atol=1e-4)


def test_ssd_masked_form_equals_sequential_tree():
    g = torch.Generator().manual_seed(3)
    tree = _tree()
    x, dt, A, Bm, Cm, D, bias, h0 = _ssd_inputs(g, *tree.tokens.shape)
    y, states = tree_ssd(x, dt, A, Bm, Cm, D, bias, h0, tree.ancestor_mask, True, 0.0, 3.0, True)
    want_states = ssd_states_ref(x, dt, A, Bm, Cm, bias, h0, tree.parents, dt_max=3.0)
    torch.testing.assert_close(states, want_states, rtol=0, atol=1e-12)
    ch = Cm.repeat_interleave(2, dim=2)
    want_y = torch.einsum("bthpn,bthn->bthp", want_states, ch) + D[:, None] * x
    torch.testing.assert_close(y, want_y, rtol=0, atol=1e-12)


@pytest.mark.parametrize("h0", [True, False])
def test_ssd_node_major_outputs_equal_the_batched_form(h0, monkeypatch):
    """A step compiled whole on a CPU computes the tree SSD's outputs node-major (broadcast products summed, as
    `ssmspec.ops.ssd` records them under a capture): the same outputs as the batched matmuls' form, contiguous."""
    from ssmspec.ops import ssd as ssd_ops

    g = torch.Generator().manual_seed(5)
    tree = _tree()
    x, dt, A, Bm, Cm, D, bias, h = _ssd_inputs(g, *tree.tokens.shape)
    h = h if h0 else None
    want, _ = tree_ssd(x, dt, A, Bm, Cm, D, bias, h, tree.ancestor_mask, True, 0.0, 3.0, False)
    monkeypatch.setattr(ssd_ops, "static", lambda: True)
    got, _ = ssd_ops._masked_ssd(x, dt, A, Bm, Cm, D, bias, h, *ssd_ops.ssd_masks(tree.ancestor_mask, x.dtype),
                                 True, 0.0, 3.0, False)  # fmt: skip
    assert got.is_contiguous() and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_selective_scan_chain_matches_hf():
    g = torch.Generator().manual_seed(4)
    b, d, n, s = 2, 6, 5, 4
    x = torch.randn(b, d, n, generator=g, dtype=D64)
    dt = torch.randn(b, d, n, generator=g, dtype=D64)
    A = -torch.rand(d, s, generator=g, dtype=D64)
    Bm, Cm = torch.randn(b, s, n, generator=g, dtype=D64), torch.randn(b, s, n, generator=g, dtype=D64)
    D, z, bias = torch.randn(d, generator=g, dtype=D64), torch.randn(b, d, n, generator=g, dtype=D64), None
    y_hf, last = mamba_selective_scan(
        x, dt, A, Bm, Cm, D=D, z=z, delta_bias=bias, delta_softplus=True, return_last_state=True
    )
    chain = TokenTree.chain(torch.zeros(b, n, dtype=torch.long))
    y, states = tree_selective_scan(x, dt, A, Bm, Cm, D, z, bias, None, chain.parents, chain.depth, True, True)
    # HF's fallback casts B to float32 (`B.float()`) even for float64 inputs: compare at float32 accuracy
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[:, -1], last, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_selective_scan_replay_equals_the_tree_scans_state_at_each_rows_accepted_node(dtype):
    """The commit replays every record of one shape at once: the state after row b's first `lengths[b]` path
    nodes equals the tree scan's own state at that node: the same products in the same order, so up to the last
    bit of a float32 `exp` (its vectorised and scalar paths may round differently)."""
    from ssmspec.ops.selective_scan import _along, replay_chains

    g = torch.Generator().manual_seed(6)
    tree, r, d, s = _tree(), 3, 5, 4
    b, n = tree.parents.shape
    x, dt = torch.randn(r, b, d, n, generator=g).to(dtype), torch.randn(r, b, d, n, generator=g).to(dtype)
    A, Bm = -torch.rand(r, d, s, generator=g), torch.randn(r, b, s, n, generator=g).to(dtype)
    bias, h0 = torch.randn(r, d, generator=g), torch.randn(r, b, d, s, generator=g)
    path = torch.stack([torch.tensor([0, 2, 5, 6]), torch.tensor([0, 3, 4, 0])])  # root-to-node paths
    lengths = torch.tensor([4, 3])
    got = replay_chains(
        torch.stack([_along(x[i], path) for i in range(r)]), torch.stack([_along(dt[i], path) for i in range(r)]),
        A, torch.stack([_along(Bm[i], path) for i in range(r)]), bias, h0, lengths, True,
    )  # fmt: skip
    for i in range(r):
        _, states = tree_selective_scan(
            x[i], dt[i], A[i], Bm[i], Bm[i], None, None, bias[i], h0[i], tree.parents, tree.depth, True, True
        )
        for row in range(b):
            want = states[row, path[row, lengths[row] - 1]]
            torch.testing.assert_close(got[i, row], want, rtol=2e-6, atol=2e-6, msg=f"record {i}, row {row}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_tree_wkv_equals_hfs_rwkv_decode_steps_on_every_path(dtype):
    """Every node's WKV output and state equal HF's one-token step (`rwkv_linear_attention_cpu`) run along the
    node's root-to-node path from the committed state, the state stored in float32 between tokens as HF's
    RWKV state list keeps it (its time_decay / time_first in float32 for a bf16 model, as HF loads them)."""
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    from ssmspec.ops.wkv import run_tree_wkv, tree_wkv

    g = torch.Generator().manual_seed(7)
    tree, c = _tree(), 8
    b, n = tree.parents.shape
    key, value = (3 * torch.randn(b, n, c, generator=g)).to(dtype), torch.randn(b, n, c, generator=g).to(dtype)
    params = torch.float32 if dtype == torch.bfloat16 else dtype
    decay, first = torch.randn(c, generator=g).to(params), torch.randn(c, generator=g).to(params)
    a0, b0, p0 = torch.randn(b, c, generator=g), torch.rand(b, c, generator=g) + 0.5, torch.randn(b, c, generator=g)
    out, states = run_tree_wkv(key, value, decay, first, torch.stack([a0, b0, p0], 1), tree.parents, tree.depth)
    op_out, op_states = tree_wkv(key, value, decay, first, torch.stack([a0, b0, p0], 1), tree.parents, tree.depth)
    assert torch.equal(out, op_out) and torch.equal(states, op_states)  # the eager fast path is the op
    assert out.dtype == dtype and states.dtype == torch.float32
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype != torch.bfloat16 else {}
    for row, size in enumerate((7, 5)):
        for node in range(size):
            path = tree.path_nodes(row, node)  # root first
            state = [a0[row : row + 1], b0[row : row + 1], p0[row : row + 1]]
            for t in path:
                y, new = rwkv_linear_attention_cpu(
                    decay, first, key[row : row + 1, t : t + 1], value[row : row + 1, t : t + 1], state, True
                )
                state = [s.to(torch.float32) for s in new]  # what HF's state list stores
            torch.testing.assert_close(out[row, node], y[0, 0], **tol)
            torch.testing.assert_close(states[row, node], torch.cat(state), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_tree_lightning_equals_minimaxs_decode_steps_on_every_path(dtype):
    """Every node's output and state equal HF MiniMax's one-token lightning-attention step (its cached branch:
    S = r S + k^T v, o = q S, in the model's dtype) run along the node's root-to-node path."""
    from ssmspec.ops.lightning import run_tree_lightning, tree_lightning

    g = torch.Generator().manual_seed(8)
    tree, h, d = _tree(), 2, 4
    b, n = tree.parents.shape
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(3))
    ratio = torch.exp(-torch.rand(h, 1, 1, generator=g)).to(dtype)
    s0 = torch.randn(b, h, d, d, generator=g).to(dtype)
    out, states = run_tree_lightning(q, k, v, ratio, s0, tree.parents, tree.depth)
    op_out, op_states = tree_lightning(q, k, v, ratio, s0, tree.parents, tree.depth)
    assert torch.equal(out, op_out) and torch.equal(states, op_states) and out.dtype == states.dtype == dtype
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    for row, size in enumerate((7, 5)):
        for node in range(size):
            path = tree.path_nodes(row, node)  # root first
            state = s0[row : row + 1]
            for t in path:  # HF's loop body, one token
                kv = torch.matmul(k[row : row + 1, :, t : t + 1].transpose(-1, -2), v[row : row + 1, :, t : t + 1])
                state = ratio * state + kv
                y = torch.matmul(q[row : row + 1, :, t : t + 1], state)
            torch.testing.assert_close(out[row, :, node], y[0, :, 0], **tol)
            torch.testing.assert_close(states[row, node], state[0], **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_tree_rglru_equals_recurrent_gemmas_decode_steps_on_every_path(dtype):
    """Every node's RG-LRU output and state equal HF RecurrentGemma's one-token scan (`_rnn_scan` in sampling
    mode: h = a h + x accumulated in float32, the output in the model's dtype) run along the node's path."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    from ssmspec.ops.rglru import run_tree_rglru, tree_rglru

    g = torch.Generator().manual_seed(9)
    tree, c = _tree(), 6
    b, n = tree.parents.shape
    decay, x = torch.rand(b, n, c, generator=g).to(dtype), torch.randn(b, n, c, generator=g).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    h0 = torch.randn(b, c, generator=g).to(acc)
    out, states = run_tree_rglru(decay, x, h0, tree.parents, tree.depth)
    op_out, op_states = tree_rglru(decay, x, h0, tree.parents, tree.depth)
    assert torch.equal(out, op_out) and torch.equal(states, op_states) and out.dtype == dtype
    scan = RecurrentGemmaRglru._rnn_scan
    no_reset = torch.zeros(1, 1, c, dtype=torch.bool)
    for row, size in enumerate((7, 5)):
        for node in range(size):
            path = tree.path_nodes(row, node)  # root first
            state = h0[row : row + 1]
            for t in path:  # HF's decode step, one token
                y, state = scan(
                    None, x[row : row + 1, t : t + 1], decay[row : row + 1, t : t + 1], no_reset, state, acc
                )
            assert torch.equal(out[row, node], y[0, 0]) and torch.equal(states[row, node], state[0])


def test_delta_rule_chain_matches_hf():
    g = torch.Generator().manual_seed(5)
    b, n, hk, h, k, v = 2, 5, 2, 4, 4, 3
    q, kk = torch.randn(b, n, hk, k, generator=g), torch.randn(b, n, hk, k, generator=g)
    vv = torch.randn(b, n, h, v, generator=g)
    gg = -torch.rand(b, n, h, generator=g)
    beta = torch.rand(b, n, h, generator=g)
    h0 = torch.randn(b, h, k, v, generator=g)
    o_hf, last = torch_recurrent_gated_delta_rule(
        q, kk, vv, gg, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    chain = TokenTree.chain(torch.zeros(b, n, dtype=torch.long))
    o, states = tree_delta_rule(q, kk, vv, gg, beta, h0, chain.parents, chain.depth, True, True)
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[:, -1], last, rtol=1e-5, atol=1e-5)


def test_tree_states_equal_per_path_chains():
    """Every node's state (delta rule, per-key-channel gate as in KDA) equals running its root path as a chain."""
    g = torch.Generator().manual_seed(6)
    tree = _tree()
    b, n = tree.tokens.shape
    q, kk = torch.randn(b, n, 2, 4, generator=g, dtype=D64), torch.randn(b, n, 2, 4, generator=g, dtype=D64)
    vv = torch.randn(b, n, 2, 3, generator=g, dtype=D64)
    gg = -torch.rand(b, n, 2, 4, generator=g, dtype=D64)
    beta = torch.rand(b, n, 2, generator=g, dtype=D64)
    _, states = tree_delta_rule(q, kk, vv, gg, beta, None, tree.parents, tree.depth, True, True)
    for t in range(n):
        path, lengths = tree.paths(torch.tensor([min(t, n - 1)] * b))
        for r in range(b):
            if t >= int((tree.acceptable[r]).sum()):
                continue
            idx = path[r, : lengths[r]]
            chain = TokenTree.chain(torch.zeros(1, len(idx), dtype=torch.long))
            sel = [a[r : r + 1, idx] for a in (q, kk, vv, gg, beta)]
            _, st = tree_delta_rule(*sel, None, chain.parents, chain.depth, True, True)
            torch.testing.assert_close(states[r, t], st[0, -1], rtol=0, atol=1e-12)


def test_commit_ops():
    committed = torch.arange(8.0).view(1, 2, 4)
    nodes = 100 + torch.arange(10.0).view(1, 2, 5)
    path, lengths = torch.tensor([[0, 2, 4]]), torch.tensor([3])
    got = conv_window(committed, nodes, path, lengths)
    assert got[0, 0].tolist() == [3.0, 100.0, 102.0, 104.0]
    got = conv_window(committed, nodes, torch.tensor([[0, 0, 0]]), torch.tensor([1]))
    assert got[0, 1].tolist() == [5.0, 6.0, 7.0, 105.0]
    states = torch.arange(24.0).view(2, 3, 4)
    assert gather_states(states, torch.tensor([2, 0])).tolist() == [states[0, 2].tolist(), states[1, 0].tolist()]


def test_chunked_prefill_from_initial_state_matches_hf_and_one_chunk():
    from ssmspec.ops.prefill import chunked_prefill

    g = torch.Generator().manual_seed(9)
    b, n = 2, 11
    x, dt, A, Bm, Cm, D, bias, h0 = _ssd_inputs(g, b, n)
    y_hf, final = mamba2_chunk_scan(x, dt, A, Bm, Cm, 4, D=D, dt_bias=bias, initial_states=h0, dt_softplus=True,
                                    return_final_states=True)  # fmt: skip
    ssd = dict(x=x, dt=dt, A=A, Bm=Bm, Cm=Cm, D=D, dt_bias=bias, dt_softplus=True, dt_min=0.0, dt_max=float("inf"))
    y, state = chunked_prefill("ssd", h0, chunk_size=4, **ssd)
    torch.testing.assert_close(y.float(), y_hf.float(), rtol=1e-4, atol=1e-4)  # HF computes in float32
    torch.testing.assert_close(state.float(), final.float(), rtol=1e-4, atol=1e-4)
    y1, state1 = chunked_prefill("ssd", h0, chunk_size=64, **ssd)
    torch.testing.assert_close(y, y1, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, state1, rtol=0, atol=1e-12)

    d, s = 5, 3
    xs, dts, zs = (torch.randn(b, d, n, generator=g, dtype=D64) for _ in range(3))
    As = -torch.rand(d, s, generator=g, dtype=D64)
    Bs, Cs = torch.randn(b, s, n, generator=g, dtype=D64), torch.randn(b, s, n, generator=g, dtype=D64)
    h0s = torch.randn(b, d, s, generator=g, dtype=D64)
    scan = dict(x=xs, dt=dts, A=As, Bm=Bs, Cm=Cs, D=None, z=zs, dt_bias=None, dt_softplus=True)
    ya, sa = chunked_prefill("selective_scan", h0s, chunk_size=4, **scan)
    yb, sb = chunked_prefill("selective_scan", h0s, chunk_size=64, **scan)
    torch.testing.assert_close(ya, yb, rtol=0, atol=1e-12)
    torch.testing.assert_close(sa, sb, rtol=0, atol=1e-12)

    q, k = torch.randn(b, n, 2, 4, generator=g), torch.randn(b, n, 2, 4, generator=g)
    v, gate = torch.randn(b, n, 2, 3, generator=g), -torch.rand(b, n, 2, generator=g)
    beta, hd = torch.rand(b, n, 2, generator=g), torch.randn(b, 2, 4, 3, generator=g)
    o_hf, last = torch_recurrent_gated_delta_rule(q, k, v, gate, beta, initial_state=hd, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)  # fmt: skip
    o, st = chunked_prefill("delta_rule", hd, chunk_size=4, q=q, k=k, v=v, g=gate, beta=beta, use_qk_l2norm=True)
    with pytest.raises(ValueError, match="op must be one of ssd, selective_scan, delta_rule"):
        chunked_prefill("conv", hd, q=q)
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, last, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(D64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_mlstm_tree_and_state_equal_hfs_decode_steps_on_every_path(dtype, tol):
    """The tree mLSTM (every node at once, masked by its ancestors) against HF's xLSTM decode step run node by node
    from each node's parent's state (kept in its state dtype, as HF's loop keeps it), on a batch of two trees with
    gates wide enough to move the stabilizer; the state at every node against the same steps. bfloat16: HF's step
    computes in bfloat16, the tree op in float32."""
    from transformers.models.xlstm.modeling_xlstm import mlstm_recurrent_step_native

    from ssmspec.ops.mlstm import mlstm_state_at, tree_mlstm

    g = torch.Generator().manual_seed(3)
    tree = _tree()
    b, n = tree.tokens.shape
    h, dk, dv = 3, 8, 6

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=D64) * scale).to(dtype)

    q, k, v = rand(b, h, n, dk), rand(b, h, n, dk), rand(b, h, n, dv)
    ig, fg = rand(b, h, n, scale=3), rand(b, h, n, scale=3)
    c0, n0, m0 = rand(b, h, dk, dv), rand(b, h, dk), rand(b, h, 1)
    state_dtype = D64 if dtype == D64 else torch.float32
    got = tree_mlstm(q, k, v, ig, fg, c0, n0, m0, tree.ancestor_mask, 1e-6)
    assert got.dtype == dtype
    for r in range(b):
        parents = tree.parents[r].tolist()
        states = {-1: (c0[r : r + 1], n0[r : r + 1], m0[r : r + 1])}
        for t in range(n):
            c, nn_, m = (s.to(dtype) for s in states[parents[t] if t else -1])
            want, states[t] = mlstm_recurrent_step_native(
                q[r : r + 1, :, t], k[r : r + 1, :, t], v[r : r + 1, :, t], ig[r : r + 1, :, t, None],
                fg[r : r + 1, :, t, None], c, nn_, m, eps=1e-6, dtype_state=state_dtype,
            )  # fmt: skip
            scale = want.double().abs().max()
            assert (got[r, :, t].double() - want[0].double()).abs().max() <= tol * scale, (r, t)
            path = tree.ancestor_mask[r : r + 1, t]
            at = mlstm_state_at(k[r : r + 1], v[r : r + 1], ig[r : r + 1], fg[r : r + 1], *states[-1], path)
            for x, y in zip(at, states[t]):
                assert (x.double() - y.double()).abs().max() <= tol * y.double().abs().max().clamp(min=1), (r, t)
