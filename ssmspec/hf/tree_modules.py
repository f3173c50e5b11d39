"""Trees on the generic path: a model whose token-mixing modules all have tree forms verifies a whole draft tree in
one forward of HF's own code, the tree's nodes fed as a sequence.

Every other module of such a model works token by token, so only the token mixers have to know the tree. In a tree
verification its instance forward computes every node after its own path: with the module's tree op where it has
one (xLSTM: ssmspec.ops.mlstm, all nodes in one set of masked products, in the module's inference mode), else by
running the module's own forward once per node, on that node's slice of the inputs and its parent's state, cast
to the cache's dtype as HF's loop stores every step's state in its cache (node for node HF's decode step). The
module then hands the cache its committed state back unchanged; the commit writes the accepted node's state into
the cache's own tensors: the tree op's state at that node, or for the stepping form the state kept from the
verification where the nodes' states fit in `KEEP_BYTES` (all layers together, the first nodes first), else
replayed from the deepest kept node of the accepted path (one step per node and layer). The transform-time
probe checks trees by value against HF's decode steps before they are used (ssmspec.probe.probe_generic_trees).

A module whose state is not handed in and out of its forward has a whole verification forward of its own
(`Kind.tree_forward`): RWKV's time mixing and channel mixing, whose token shift reads the parent's input and
whose WKV recurrence runs as a tree op (ssmspec.ops.wkv), the shared state list written only at the commit;
MiniMax's lightning attention (its recurrence as a tree op, ssmspec.ops.lightning) and its softmax attention (HF's
attention function over the cached keys and the tree's, masked by the tree's ancestors, each node's rotary
position its depth; the commit appends the accepted path's keys and values); ZAYA's attention, whose q/k
convolution reads each node's path and whose delayed values its parent's.

Coupling to transformers, and only here: the class `xLSTMBackend` of transformers' xLSTM (its forward's argument
names: per-token `query`, `key`, `value`, `igate`, `fgate` along dim 2, the state `c_initial`, `n_initial`,
`m_initial`, returning `(h, (c, n, m))`; its config's `mode`, `eps` and `inference_state_dtype`, which its decode
step uses), and `xLSTMCache.seqlen_offset` (a token counter its forward advances); RWKV's `RwkvSelfAttention` and
`RwkvFeedForward` (`forward(hidden, state)`, their `time_shift` submodule, which `install` wraps in one that follows
the tree inside a verification and whose first position HF's code overwrites with the cached shift state,
`extract_key_value`, `output`, `time_decay`, `time_first`, `layer_id`, and the model's state list: [0] channel-
mixing shift, [1] time-mixing shift, [2:5] the WKV numerator, denominator and log scale, each [B, C, layers]);
MiniMax's `MiniMaxLightningAttention` (`qkv_proj`, `act_fn`, `norm`, `output_gate`, `out_proj`, `slope_rate`,
`head_dim`, `num_attention_heads`, `layer_idx`; the cache's `get_linear_cache` / `set_linear_cache`) and
`MiniMaxAttention` (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `scaling`, `head_dim`, the `position_embeddings`
argument, its modeling module's `apply_rotary_pos_emb`, `ALL_ATTENTION_FUNCTIONS`, `eager_attention_forward`;
the cache layer's `keys` / `values` and `update`); ZAYA's `ZayaAttention` (its `qkv_proj`'s `q_proj`, `k_proj`,
`v_proj_current`, `v_proj_delayed`, `conv_qk_depthwise`, `conv_qk_grouped`, `conv_kernel_size`, `head_dim`,
`num_key_value_groups`, the residual q/k arithmetic of its forward; `qk_norm`, `o_proj`, `scaling`,
`sliding_window`; its modeling module's `repeat_kv`; the attention mask dict's "causal" and "conv" entries; the
cache's `get_conv_state` / `update_conv_state` / `get_recurrent_state` / `update_recurrent_state`); RecurrentGemma's
`RecurrentGemmaRecurrentBlock` (`linear_x`, `linear_y`, `act_fn`, `conv_1d` and `conv1d_width`, `linear_out`, its
`rg_lru`'s gate weights and biases, `recurrent_param`, `num_attention_heads`, `block_width` and the arithmetic of
its forward up to the scan; the state on the modules, `conv1d_state` and `rg_lru.recurrent_states`, which
ssmspec.hf.generic.HFState hands in) and `RecurrentGemmaAttention` (as MiniMax's, its `rotary_emb` and
`sliding_window` its own).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ssmspec.hf import instance, masks
from ssmspec.ops.lightning import run_tree_lightning
from ssmspec.ops.mlstm import run_mlstm_state_at, run_tree_mlstm
from ssmspec.ops.rglru import run_tree_rglru
from ssmspec.ops.wkv import run_tree_wkv
from ssmspec.tree import TokenTree

# (HF zeroes a padded position's projections; a tree form verifies unpadded rows)
_PADDED_ROW = "a tree verification of a padded row"


def _no_state(module: object) -> RuntimeError:
    """A tree form called without the committed state it starts from."""
    return RuntimeError(f"{type(module).__name__}: a tree verification needs the committed state")


# a tree op for a module kind: (module, bound arguments, committed state, ancestors [1, N, N] bool) -> (every
# node's output, the state at a path [1, N] bool -> the state tuple), or None where it does not apply to this call
TreeOp = Callable[..., "tuple[torch.Tensor, Callable] | None"]
# a module's whole forward in a tree verification: (module, bound arguments, the tree being verified) -> (what its
# forward returns, a function that writes the state at a path [node indices, root first] into the model's cache)
TreeForward = Callable[..., "tuple[Any, Callable[[list[int]], None]]"]


@dataclass(frozen=True)
class Kind:
    """A recurrence module class with a one-token form: which forward arguments are per-token inputs (and along
    which dim), which are the initial state, and which cache attributes count tokens fed."""

    module: str  # the module's class, "module.path:ClassName"
    inputs: dict[str, int]  # per-token argument -> its sequence dim
    state: tuple[str, ...]  # initial-state arguments, in the order the forward returns the final state
    counters: tuple[str, ...] = ()  # cache attributes (tensors) that count the tokens a forward fed
    tree_op: TreeOp | None = None  # all nodes at once (else the module's forward once per node)
    tree_forward: TreeForward | None = None  # the module's own verification forward (its state not handed in)
    on_install: Callable[[nn.Module, Any], None] | None = None  # (module, its TreeStepForward): at install
    on_uninstall: Callable[[nn.Module], None] | None = None  # undoes on_install


def _xlstm_tree_op(module: nn.Module, arguments: dict[str, Any], state: tuple, ancestors: torch.Tensor):
    """xLSTM's backend in its inference mode (its decode step `mlstm_recurrent_step_native` with the config's eps,
    its state kept in `inference_state_dtype`): ssmspec.ops.mlstm for every node, the state at the accepted node
    in the decode step's state dtype. Not for a float64 model whose decode step rounds its state to a narrower
    dtype after every token (the config's default float32): the tree op does not round between nodes, so it would
    differ from HF's steps at that rounding, and float64 speculation is exact (the module's own steps run it)."""
    config = module.config
    if "inference" not in str(arguments.get("mode") or config.mode):
        return None
    q, k, v, i, f = (arguments[n] for n in ("query", "key", "value", "igate", "fgate"))
    dtype = getattr(torch, config.inference_state_dtype)
    if q.dtype == torch.float64 and dtype != torch.float64:
        return None
    c0, n0, m0 = state
    h = run_tree_mlstm(q, k, v, i, f, c0, n0, m0, ancestors, float(config.eps))

    def state_at(path: torch.Tensor) -> tuple:
        return tuple(s.to(dtype) for s in run_mlstm_state_at(k, v, i, f, c0, n0, m0, path))

    return h, state_at


class _ParentShift(nn.Module):
    """RWKV's token shift, given to its time and channel mixing at install: HF's own shift (`shift`) except inside a
    tree verification of its module on this thread, where each node's previous input is its parent's (the root's,
    node 0, is the cached shift state, which HF's code writes over position 0). Installed for good rather than
    swapped in for a call, so that a plain forward of the same model on another thread keeps HF's shift."""

    def __init__(self, shift: nn.Module, step: TreeStepForward) -> None:
        super().__init__()
        self.shift = shift
        self.step = step  # not a module: the forward whose verification this shift follows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ctx: _Verifying | None = getattr(_LOCAL, "verifying", None)
        if ctx is None or id(self.step) not in ctx.steps:
            return self.shift(hidden)
        return hidden[:, ctx.tensors(hidden.device)[0][0].clamp(min=0)]


def _rwkv_install(module: nn.Module, step: TreeStepForward) -> None:
    module.time_shift = _ParentShift(module.time_shift, step)


def _rwkv_uninstall(module: nn.Module) -> None:
    if isinstance(module.time_shift, _ParentShift):
        module.time_shift = module.time_shift.shift


@contextlib.contextmanager
def _rwkv_tree_call(module: nn.Module, arguments: dict[str, Any], tree: _Verifying, slot: int):
    """Within: HF's code of `module` may run on the tree (its `time_shift` follows the tree); the shift state
    `state[slot]` that HF's code overwrites with the last fed input is put back after (the cache keeps its
    committed state until the commit)."""
    state = arguments.get("state")
    if state is None:
        raise _no_state(module)
    if any(p < 0 for p in tree.parents[1:]) or tree.parents[0] != -1:
        raise RuntimeError(f"{type(module).__name__}: a tree verification needs one root, fed first")
    if not isinstance(module.time_shift, _ParentShift):
        raise RuntimeError(f"{type(module).__name__}: its token shift is not the tree form's (installed by transform)")
    layer = module.layer_id
    saved = state[slot][:, :, layer].clone()
    try:
        yield state
    finally:
        state[slot][:, :, layer] = saved


def _rwkv_channel_mixing(module: nn.Module, arguments: dict[str, Any], tree: _Verifying):
    """RwkvFeedForward on a tree: HF's forward with the tree's token shift; the commit writes the accepted node's
    input as the shift state."""
    hidden, layer = arguments["hidden"], module.layer_id
    with _rwkv_tree_call(module, arguments, tree, 0) as state:
        out = type(module).forward(module, **arguments)

    def write(path: list[int]) -> None:
        state[0][:, :, layer] = hidden[:, path[-1]]

    return out, write


def _rwkv_time_mixing(module: nn.Module, arguments: dict[str, Any], tree: _Verifying):
    """RwkvSelfAttention on a tree: HF's key / value / receptance with the tree's token shift, the WKV recurrence
    as a tree op (ssmspec.ops.wkv: HF's decode step node by node, level by level); the commit writes the accepted
    node's input as the shift state and its WKV state."""
    hidden, layer = arguments["hidden"], module.layer_id
    with _rwkv_tree_call(module, arguments, tree, 1) as state:
        receptance, key, value, _ = module.extract_key_value(hidden, state=state)
    parents, depth = tree.tensors(hidden.device)
    b = hidden.shape[0]
    start = torch.stack([s[:, :, layer] for s in state[2:5]], dim=1)  # [B, 3, C]
    wkv, nodes = run_tree_wkv(
        key, value, module.time_decay, module.time_first, start, parents.expand(b, -1), depth.expand(b, -1)
    )

    def write(path: list[int]) -> None:
        state[1][:, :, layer] = hidden[:, path[-1]]
        for i in range(3):
            state[2 + i][:, :, layer] = nodes[:, path[-1], i]

    return (module.output(receptance * wkv), state), write


def _visible_past(mask: Any, b: int, past: int, device: torch.device) -> torch.Tensor:
    """[B, past] which cached keys HF's own mask for this forward lets its first token (the tree's root) see: pads
    hidden (and what a sliding window drops for the root; deeper nodes drop more, masks.allowed). HF's mask is a
    4-D boolean (True: seen) or additive one, or None where nothing is hidden."""
    if mask is None:
        return torch.ones(b, past, dtype=torch.bool, device=device)
    row = mask[:, 0, 0, :past]
    return (row if row.dtype == torch.bool else row == 0).expand(b, past)


def _minimax_lightning(module: nn.Module, arguments: dict[str, Any], tree: _Verifying):
    """MiniMaxLightningAttention on a tree: HF's projections, its decode step's recurrence as a tree op
    (ssmspec.ops.lightning), HF's norm, gate and output projection; the commit replays the recurrence along the
    accepted path and writes its state as the layer's linear cache."""
    hidden, cache = arguments["hidden_states"], arguments.get("past_key_values")
    layer = module.layer_idx
    start = cache.get_linear_cache(layer) if cache is not None else None
    if not isinstance(start, torch.Tensor):
        raise _no_state(module)
    mask = arguments.get("attention_mask")
    if mask is not None and not bool(mask.all()):  # HF zeroes padded positions' projections
        raise RuntimeError(f"{type(module).__name__}: {_PADDED_ROW}")
    b, n, _ = hidden.shape
    qkv = module.act_fn(module.qkv_proj(hidden)).reshape(b, n, module.num_attention_heads, 3 * module.head_dim)
    q, k, v = (x.transpose(1, 2) for x in torch.split(qkv, module.head_dim, dim=3))
    parents, depth = tree.tensors(hidden.device)
    ratio = torch.exp(-module.slope_rate)
    out, _ = run_tree_lightning(q, k, v, ratio, start, parents.expand(b, -1), depth.expand(b, -1))
    out = module.norm(out.transpose(1, 2).reshape(b, n, module.num_attention_heads * module.head_dim))
    out = module.out_proj(torch.sigmoid(module.output_gate(hidden)) * out)

    def write(path: list[int]) -> None:
        # replayed along the path (the tree op's own products, so its node state bit for bit) rather than kept from
        # the verification: every node's [heads, D, E] state of every layer would stay alive until the commit
        state = start
        for u in path:
            state = ratio * state + torch.matmul(k[:, :, u, :, None], v[:, :, u, None, :])
        cache.set_linear_cache(layer, state.contiguous())

    return (out, start), write


def _attend(
    module: nn.Module, rotary: tuple, q, k, v, past: tuple, mask: Any, tree: _Verifying, window: int | None
) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """HF's attention function of `module`'s modeling module over the layer's cached keys `past` and the tree's
    nodes (q, k, v [B, heads, N, head dim], before the rotary embedding, which is applied here with `rotary`,
    each node's (cos, sin) at the position HF's loop gives it: the committed length + its depth), masked by what
    HF's `mask` lets the root see of the cached keys, the tree's ancestors and the sliding `window`. Returns
    (output, HF's attention weights, the keys as rotated: what the cache keeps)."""
    if module.config._attn_implementation not in ("eager", "sdpa"):
        raise RuntimeError(f"{type(module).__name__}: tree masks need eager or sdpa attention")
    hf = sys.modules[type(module).__module__]
    parents, _ = tree.tensors(q.device)
    q, k = hf.apply_rotary_pos_emb(q, k, *rotary)
    b = q.shape[0]
    shape = TokenTree(parents.expand(b, -1), parents.expand(b, -1))
    allow = masks.allowed(_visible_past(mask, b, past[0].shape[2], q.device), shape, window)
    attention = hf.ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, hf.eager_attention_forward)
    out, weights = attention(
        module, q, torch.cat([past[0], k], 2), torch.cat([past[1], v], 2), masks.additive(allow, q.dtype),
        dropout=0.0, scaling=module.scaling, sliding_window=window,
    )  # fmt: skip
    return out, weights, k


def _at_depth(arguments: dict[str, Any], tree: _Verifying) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's (cos, sin) from the `position_embeddings` HF's model computed for the fed positions: those of
    a chain, so a node's position (the committed length + its depth) is fed position `depth`."""
    cos, sin = arguments["position_embeddings"]
    depth = tree.tensors(cos.device)[1][0]
    return cos[:, depth], sin[:, depth]


def _tree_attention(module: nn.Module, arguments: dict[str, Any], tree: _Verifying):
    """A softmax attention layer (MiniMax's, RecurrentGemma's) on a tree: HF's projections, the rotary embedding at
    each node's position (the committed length + its depth: from the `position_embeddings` the model computed for
    the fed positions, or, for a module with a `rotary_emb` of its own, from its `position_ids`), HF's attention
    function over the layer's cached keys and the tree's, masked by the tree's ancestors (and the layer's sliding
    window), the cache untouched; the commit appends the accepted path's keys and values."""
    hidden, cache = arguments["hidden_states"], arguments.get("past_key_values")
    layer = cache.layers[module.layer_idx] if cache is not None else None
    past_k, past_v = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(past_k, torch.Tensor) or past_k.numel() == 0:
        raise RuntimeError(f"{type(module).__name__}: a tree verification needs the committed keys")
    b, n, _ = hidden.shape
    shape = (b, n, -1, module.head_dim)
    q, k, v = (proj(hidden).view(shape).transpose(1, 2) for proj in (module.q_proj, module.k_proj, module.v_proj))
    if arguments.get("position_embeddings") is not None:
        rotary = _at_depth(arguments, tree)
    else:
        rotary = module.rotary_emb(v, _node_positions(arguments["position_ids"], tree))
    window = getattr(module, "sliding_window", None) or getattr(module.config, "sliding_window", None)
    mask = arguments.get("attention_mask")
    out, weights, k = _attend(module, rotary, q, k, v, (past_k, past_v), mask, tree, window)
    out = module.o_proj(out.reshape(b, n, -1).contiguous())

    def write(path: list[int]) -> None:
        cache.update(k[:, :, path], v[:, :, path], module.layer_idx)

    return (out, weights), write


def _path_windows(parents: list[int], cached: int, width: int) -> list[list[int]]:
    """Per node, the `width` positions a causal window ending at the node reads, in a sequence of `cached` cached
    columns followed by the tree's nodes (node u at `cached + u`): the node's path back from it, then the cache."""
    out = []
    for t in range(len(parents)):
        path, u = [], t
        while u >= 0 and len(path) < width:
            path.append(cached + u)
            u = parents[u]
        path += list(range(cached - 1, cached - 1 - (width - len(path)), -1))
        out.append(path[::-1])
    return out


def _zaya_attention(module: nn.Module, arguments: dict[str, Any], tree: _Verifying):
    """ZayaAttention on a tree (its compressed convolutional attention): HF's q/k projections and residuals, the
    q/k convolutions over each node's path (its window gathered from the path and the cached conv state), the
    delayed half of each value head from the node's parent (the root's: the cached one), HF's q/k norm, the rotary
    embedding of each node's depth, HF's attention function over the cached keys and the tree's, masked by the
    tree's ancestors and the layer's sliding window; the cache untouched. The commit writes the conv state and the
    delayed value at the accepted node and appends the accepted path's keys and values."""
    hidden, cache = arguments["hidden_states"], arguments.get("past_key_values")
    proj, layer = module.qkv_proj, module.layer_idx
    conv_mask = (arguments.get("attention_mask") or {}).get("conv")
    if conv_mask is not None and not bool(conv_mask.all()):  # HF zeroes padded positions before the convolution
        raise RuntimeError(f"{type(module).__name__}: {_PADDED_ROW}")
    cached_qk = cache.get_conv_state(layer) if cache is not None else None
    cached_v = cache.get_recurrent_state(layer) if cache is not None else None
    past_k, past_v = getattr(cache.layers[layer], "keys", None), getattr(cache.layers[layer], "values", None)
    if any(not isinstance(x, torch.Tensor) or x.numel() == 0 for x in (cached_qk, cached_v, past_k)):
        raise _no_state(module)
    hf = sys.modules[type(module).__module__]
    b, n, _ = hidden.shape
    shape = (b, n, -1, proj.head_dim)
    queries, keys = proj.q_proj(hidden), proj.k_proj(hidden)
    q_res = queries.view(*shape)
    k_res = hf.repeat_kv(keys.view(*shape).transpose(1, 2), proj.num_key_value_groups).transpose(1, 2)
    q_res = (q_res + k_res) * 0.5
    k_res = q_res.view(b, n, -1, proj.num_key_value_groups, proj.head_dim).mean(dim=-2)
    width = proj.conv_kernel_size
    columns = torch.cat([cached_qk, torch.cat([queries, keys], dim=-1).transpose(1, 2)], dim=-1)  # [B, C, K + N]
    windows = _path_windows(tree.parents, width, width + 1)  # per node, its K + 1 columns
    qk = columns[:, :, torch.tensor(windows, device=hidden.device)]  # [B, C, N, K + 1]
    qk = qk.permute(0, 2, 1, 3).reshape(b * n, columns.shape[1], width + 1)
    qk = proj.conv_qk_grouped(proj.conv_qk_depthwise(qk)).reshape(b, n, -1)
    q_size = q_res.shape[-2] * q_res.shape[-1]
    query, key = qk[..., :q_size].view(*shape) + q_res, qk[..., q_size:].view(*shape) + k_res
    delayed = proj.v_proj_delayed(hidden)
    parents, _ = tree.tensors(hidden.device)
    before = torch.cat([cached_v.unsqueeze(1), delayed], dim=1)[:, parents[0] + 1]  # the parent's delayed value
    value = torch.cat([proj.v_proj_current(hidden), before], dim=-1).view(*shape)
    query, key = module.qk_norm(query, key)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    causal = (arguments.get("attention_mask") or {}).get("causal")
    out, weights, k = _attend(
        module, _at_depth(arguments, tree), q, k, v, (past_k, past_v), causal, tree, module.sliding_window
    )
    out = module.o_proj(out.reshape(b, n, -1))

    def write(path: list[int]) -> None:
        last = path[-1]
        keep = windows[last][1:]  # the window's last K columns: the conv state after the node
        cache.update_conv_state(columns[:, :, keep].contiguous(), layer)
        cache.update_recurrent_state(delayed[:, last].contiguous(), layer)
        cache.update(k[:, :, path], v[:, :, path], layer)

    return (out, weights), write


def _node_positions(positions: torch.Tensor, tree: _Verifying) -> torch.Tensor:
    """[B, N] each node's position: the fed root's + its depth (what HF's loop gives the node's token)."""
    return positions[:, :1] + tree.tensors(positions.device)[1]


def _griffin_recurrent_block(module: nn.Module, arguments: dict[str, Any], tree: _Verifying):
    """RecurrentGemmaRecurrentBlock on a tree (its state on the module: the conv window `conv1d_state` and the RG-LRU
    state `rg_lru.recurrent_states`, handed in by ssmspec.hf.generic.HFState): HF's projections, its decode step's
    convolution over each node's window (the node's path, then the cached columns), the RG-LRU's gates as its
    forward computes them and its recurrence as a tree op (ssmspec.ops.rglru, float32 as HF accumulates), HF's
    output gate and projection; the module's state untouched. The commit writes the window and the RG-LRU state
    at the accepted node into the module's state tensors."""
    hidden, positions = arguments["input_states"], arguments["position_ids"]
    lru = module.rg_lru
    conv_state, start = module.conv1d_state, lru.recurrent_states
    b, n, _ = hidden.shape
    if not arguments.get("use_cache", True) or conv_state is None or start is None or start.shape[0] != b:
        raise _no_state(module)
    y = module.act_fn(module.linear_y(hidden))
    columns = torch.cat([conv_state, module.linear_x(hidden).transpose(1, 2)], dim=-1)  # [B, C, K - 1 + N]
    width = module.conv1d_width
    windows = _path_windows(tree.parents, width - 1, width)  # per node, its K columns
    taps = columns[:, :, torch.tensor(windows, device=hidden.device)]  # [B, C, N, K]
    x = (taps * module.conv_1d.weight[:, 0, None, :]).sum(dim=-1) + module.conv_1d.bias[:, None]  # HF's decode step
    decay, x = _rglru_inputs(lru, x.transpose(1, 2), _node_positions(positions, tree))
    parents, depth = tree.tensors(hidden.device)
    out, states = run_tree_rglru(decay, x, start, parents.expand(b, -1), depth.expand(b, -1))
    out = module.linear_out(out * y)

    def write(path: list[int]) -> None:
        conv_state.copy_(columns[:, :, windows[path[-1]][1:]])
        start.copy_(states[:, path[-1]])

    return (out, None), write


def _rglru_inputs(lru: nn.Module, activations: torch.Tensor, positions: torch.Tensor) -> tuple:
    """RecurrentGemmaRglru's forward up to its scan, per token (no state involved): the decay a_t and the gated,
    normalized input x_t of each token of `activations` [B, N, C] at `positions` [B, N] (a position 0 resets)."""
    b, n, width = activations.shape
    reset = positions[:, :, None] == 0
    act = activations.reshape(b * n, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)
    gates = []
    for weight, bias in ((lru.input_gate_weight, lru.input_gate_bias),
                         (lru.recurrent_gate_weight, lru.recurrent_gate_bias)):  # fmt: skip
        gates.append(torch.sigmoid(torch.baddbmm(bias[:, None, :], act, weight).transpose(0, 1).reshape(b, n, width)))
    input_gate, recurrent_gate = gates
    log_decay = -8.0 * recurrent_gate * nn.functional.softplus(lru.recurrent_param)
    decay, decay_square = torch.exp(log_decay), torch.exp(2 * log_decay)
    multiplier = torch.sqrt(1 - decay_square)
    multiplier = reset + ~reset * multiplier
    return decay * ~reset, activations * input_gate * multiplier.type(activations.dtype)


def _whole(module: str, forward: TreeForward, hidden: str = "hidden_states", **hooks: Any) -> Kind:
    """The kind of a module with a whole verification forward of its own (its per-token input `hidden`, dim 1)."""
    return Kind(module, inputs={hidden: 1}, state=(), tree_forward=forward, **hooks)


KINDS = (
    Kind(
        "transformers.models.xlstm.modeling_xlstm:xLSTMBackend",
        inputs={"query": 2, "key": 2, "value": 2, "igate": 2, "fgate": 2},
        state=("c_initial", "n_initial", "m_initial"),
        counters=("seqlen_offset",),
        tree_op=_xlstm_tree_op,
    ),
    _whole("transformers.models.rwkv.modeling_rwkv:RwkvSelfAttention", _rwkv_time_mixing, "hidden",
           on_install=_rwkv_install, on_uninstall=_rwkv_uninstall),
    _whole("transformers.models.rwkv.modeling_rwkv:RwkvFeedForward", _rwkv_channel_mixing, "hidden",
           on_install=_rwkv_install, on_uninstall=_rwkv_uninstall),
    _whole("transformers.models.minimax.modeling_minimax:MiniMaxLightningAttention", _minimax_lightning),
    _whole("transformers.models.minimax.modeling_minimax:MiniMaxAttention", _tree_attention),
    _whole("transformers.models.zaya.modeling_zaya:ZayaAttention", _zaya_attention),
    _whole("transformers.models.recurrent_gemma.modeling_recurrent_gemma:RecurrentGemmaRecurrentBlock",
           _griffin_recurrent_block, "input_states"),
    _whole("transformers.models.recurrent_gemma.modeling_recurrent_gemma:RecurrentGemmaAttention",
           _tree_attention),
)  # fmt: skip


def kind_of(module: nn.Module) -> Kind | None:
    cls = type(module)
    name = f"{cls.__module__}:{cls.__qualname__}"
    return next((k for k in KINDS if k.module == name), None)


# the nodes' states a tree verification keeps for its commit, all layers together (beyond: replayed at the commit)
KEEP_BYTES = 256 * 2**20


@dataclass
class Replay:
    """What one module call of a tree verification leaves for the commit: the committed state (the cache's own
    tensors, handed in by the model), the per-token inputs of every node, the other arguments, the states of
    the nodes kept."""

    step: TreeStepForward
    arguments: dict[str, Any]
    state: tuple[torch.Tensor, ...]
    kept: dict[int, tuple] = field(default_factory=dict)
    state_at: Callable | None = None  # the tree op's state at a path (then nothing is kept or replayed)
    write: Callable[[list[int]], None] | None = None  # a tree forward's commit (then nothing else is done)


@dataclass
class _Verifying:
    """The tree being verified on this thread: each fed token's parent (-1: the committed state) and the module
    calls that saw it."""

    parents: list[int]
    steps: set[int]  # id() of the model's TreeStepForward objects this context is for
    replays: list[Replay] = field(default_factory=list)
    _ancestors: torch.Tensor | None = None
    _tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(parents, depth), each [1, N] long."""
        if self._tensors is None:
            depth: list[int] = []
            for p in self.parents:
                depth.append(depth[p] + 1 if p >= 0 else 0)
            self._tensors = torch.tensor([self.parents]), torch.tensor([depth])
        return self._tensors[0].to(device), self._tensors[1].to(device)

    def ancestors(self, device: torch.device) -> torch.Tensor:
        """[1, N, N] bool: node t's root-to-node path in row t (t included)."""
        if self._ancestors is None:
            rows: list[list[bool]] = []
            for t, p in enumerate(self.parents):
                row = list(rows[p]) if p >= 0 else [False] * len(self.parents)
                row[t] = True
                rows.append(row)
            self._ancestors = torch.tensor([rows], dtype=torch.bool)
        return self._ancestors.to(device)


_LOCAL = threading.local()


class TreeStepForward:
    """A recurrence module's instance forward: the class's own outside a tree verification; inside, one call of it
    per tree node on its parent's state (HF's decode step, node for node). Picklable (no closures)."""

    def __init__(self, module: nn.Module, kind: Kind) -> None:
        self.module = module
        self.kind = kind

    def _bind(self, args, kwargs) -> dict[str, Any]:
        bound = inspect.signature(type(self.module).forward).bind(self.module, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(arguments)))  # self
        return arguments

    def call(self, arguments: dict[str, Any], t: int, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple]:
        """The class's forward on node t's slice of the inputs after `state`; returns (its output, its state)."""
        one = dict(arguments)
        for name, dim in self.kind.inputs.items():
            one[name] = arguments[name].narrow(dim, t, 1)
        one.update(zip(self.kind.state, state))
        out = type(self.module).forward(self.module, **one)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple)):
            raise RuntimeError(f"{type(self.module).__name__}.forward returned no state to verify a tree with")
        return out

    def __call__(self, *args, **kwargs):
        ctx: _Verifying | None = getattr(_LOCAL, "verifying", None)
        if ctx is None or id(self) not in ctx.steps:
            return type(self.module).forward(self.module, *args, **kwargs)
        arguments = self._bind(args, kwargs)
        n = arguments[next(iter(self.kind.inputs))].shape[self.kind.inputs[next(iter(self.kind.inputs))]]
        if n != len(ctx.parents):
            raise RuntimeError(f"{type(self.module).__name__}: {n} tokens for a tree of {len(ctx.parents)} nodes")
        if self.kind.tree_forward is not None:
            out, write = self.kind.tree_forward(self.module, arguments, ctx)
            ctx.replays.append(Replay(self, arguments, (), write=write))
            return out
        committed = tuple(arguments[name] for name in self.kind.state)
        if any(s is None for s in committed):
            raise _no_state(self.module)
        if self.kind.tree_op is not None:
            fast = self.kind.tree_op(self.module, arguments, committed, ctx.ancestors(committed[0].device))
            if fast is not None:
                h, state_at = fast
                ctx.replays.append(Replay(self, arguments, committed, state_at=state_at))
                return h, committed
        last_child = {p: t for t, p in enumerate(ctx.parents)}  # where a node's state is no longer needed
        states: dict[int, tuple] = {-1: committed}
        replay = Replay(self, arguments, committed)
        size = sum(s.numel() * 4 for s in committed)  # a step's state: float32 at least
        keep = KEEP_BYTES // max(1, size * len(ctx.steps))  # the first `keep` nodes' states stay for the commit
        outs = []
        dim = self.kind.inputs[next(iter(self.kind.inputs))]
        for t, p in enumerate(ctx.parents):
            h, state = self.call(arguments, t, cast_like(states[p], committed))
            outs.append(h)
            if t in last_child:
                states[t] = state
            if t < keep:
                replay.kept[t] = state
            if p >= 0 and last_child[p] == t:
                del states[p]
        ctx.replays.append(replay)
        # the cache keeps the committed state until the commit: the model copies what it is handed back into it
        return torch.cat(outs, dim=dim), committed


def cast_like(state: tuple, like: tuple[torch.Tensor, ...]) -> tuple:
    """`state` in the cache's dtypes: what HF's loop stores after each step and reads at the next."""
    return tuple(s.to(c.dtype) for s, c in zip(state, like))


def install(model: nn.Module) -> list[TreeStepForward]:
    """Give every module of a known kind (KINDS) a TreeStepForward; returns them (none: the model has no tree
    form on the generic path), inside accelerate's hook where it has one (ssmspec.hf.instance). A module whose forward
    is already replaced on the instance is left alone."""
    steps = []
    for module in model.modules():
        kind = kind_of(module)
        current = instance.own_forward(module)
        if isinstance(current, TreeStepForward):
            steps.append(current)
        elif kind is not None and current is None:
            step = TreeStepForward(module, kind)
            instance.set_own_forward(module, step)
            if kind.on_install is not None:
                kind.on_install(module, step)
            steps.append(step)
    return steps


def uninstall(model: nn.Module) -> None:
    for module in list(model.modules()):
        step = instance.own_forward(module)
        if isinstance(step, TreeStepForward):
            if step.kind.on_uninstall is not None:
                step.kind.on_uninstall(module)
            instance.restore_own_forward(module)


def installed(model: nn.Module) -> list[TreeStepForward]:
    return [s for m in model.modules() if isinstance(s := instance.own_forward(m), TreeStepForward)]


@contextlib.contextmanager
def verifying(steps: list[TreeStepForward], parents: list[int]) -> Iterator[list[Replay]]:
    """Within: the model's forward verifies the tree `parents` (its tokens fed in node order, each parent before
    its children; -1: the committed state). Yields the replays the commit needs."""
    outer = getattr(_LOCAL, "verifying", None)
    ctx = _Verifying(list(parents), {id(s) for s in steps})
    _LOCAL.verifying = ctx
    try:
        yield ctx.replays
    finally:
        _LOCAL.verifying = outer


@torch.no_grad()
def commit(replays: list[Replay], path: list[int]) -> None:
    """Advance every verified module's committed state over the accepted `path` (node indices, root first) and
    write it into the cache's own tensors: from the deepest node of the path whose state was kept, the rest
    replayed."""
    for r in replays:
        if r.write is not None:
            r.write(path)
            continue
        if r.state_at is not None:
            on_path = torch.zeros(1, r.arguments[next(iter(r.step.kind.inputs))].shape[2], dtype=torch.bool)
            on_path[0, path] = True
            for target, new in zip(r.state, r.state_at(on_path.to(r.state[0].device))):
                target.copy_(new)
            continue
        start = max((i + 1 for i, t in enumerate(path) if t in r.kept), default=0)
        state = r.kept[path[start - 1]] if start else r.state
        for t in path[start:]:
            _, state = r.step.call(r.arguments, t, cast_like(state, r.state))
        for target, new in zip(r.state, state):
            target.copy_(new)


def counters(cache: Any) -> dict[str, torch.Tensor]:
    """The token counters of `cache` (KINDS' `counters`), copied: what `set_counters` puts back."""
    names = {n for k in KINDS for n in k.counters}
    return {n: v.clone() for n in names if isinstance(v := getattr(cache, n, None), torch.Tensor)}


def set_counters(cache: Any, before: dict[str, torch.Tensor], fed: int) -> None:
    """The counters as if `fed` tokens were fed after `before` (the accepted path, not the whole tree)."""
    for name, value in before.items():
        getattr(cache, name).copy_(value + fed)
