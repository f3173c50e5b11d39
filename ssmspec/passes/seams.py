"""The seam rewrite pass: make a Hugging Face mixer tree-aware without re-implementing its forward.

Transformers routes the recurrence of every SSM-like mixer through a few kernel seams (functions decorated
with `use_kernel_func_from_hub_with_fallback`). This pass finds the seams a mixer's forward calls and gives
that module a copy of its own forward whose globals point those names at ssmspec wrappers. Outside tree
verification a wrapper calls the original seam unchanged (so plain forwards are bit-identical); inside
`SpecCache.verifying(tree)` it calls the matching ssmspec tree op, which reads the committed state and
records what `SpecCache.commit` needs. Projections, norms and gates around the seams stay HF's own code.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ssmspec import ops
from ssmspec.cache import RecurrentRecord, SpecCache, active_verify_cache
from ssmspec.errors import UnsupportedModelError
from ssmspec.ops._common import eager_fast_path, gather_nodes
from ssmspec.tree import TokenTree

tree_causal_conv1d, tree_delta_rule, tree_selective_scan, tree_ssd = map(
    eager_fast_path, (ops.tree_causal_conv1d, ops.tree_delta_rule, ops.tree_selective_scan, ops.tree_ssd)
)


# The mixer running now, for error messages (a plain holder, traceable by torch.compile).
class _Current:
    module = "?"


_CURRENT = _Current()

# Every seam name transformers uses for SSM-like recurrences (the kernel name given to the decorator).
KNOWN_SEAMS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "selective_scan_fn",
    "selective_state_update",
    "mamba_inner_fn",
    "mamba_chunk_scan_combined",
    "mamba_split_conv1d_scan_combined",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "chunk_kda",
    "fused_recurrent_kda",
)


def seam_name(fn: Any) -> str | None:
    """The kernel name of a function decorated with `use_kernel_func_from_hub_with_fallback`, else None."""
    code = getattr(fn, "__code__", None)
    if code is None or "func_name" not in code.co_freevars or fn.__closure__ is None:
        return None
    value = fn.__closure__[code.co_freevars.index("func_name")].cell_contents
    return value if value in KNOWN_SEAMS else None


# ------------------------------------------------------------------------------------------- handlers
def _chain_tree_for(path: torch.Tensor) -> TokenTree:
    return TokenTree.chain(torch.zeros_like(path))


def _replay_with(run: Callable[[torch.Tensor, TokenTree], torch.Tensor]) -> Callable:
    """Replay commit: re-run the recurrence on the gathered path (a chain) and keep each row's last state."""

    def replay(last: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        states = run(path, _chain_tree_for(path))
        return states[torch.arange(path.shape[0], device=path.device), lengths - 1]

    return replay


def _committed(cache: SpecCache, seam: str, expected: tuple[int, ...]) -> torch.Tensor | None:
    """The current layer's committed state, checked against the shape the seam call implies."""
    h0 = cache.committed_recurrent(cache.current_layer)
    if h0 is not None and tuple(h0.shape) != tuple(expected):
        raise UnsupportedModelError(
            _CURRENT.module,
            f"calls `{seam}` on a state of shape {tuple(expected)} but its cached recurrent state is "
            f"{tuple(h0.shape)} (e.g. one call per head on a slice of the state); ssmspec cannot tell which part "
            "of the state a call owns",
        )
    return h0


def _record(cache: SpecCache, seam: str, record: RecurrentRecord) -> None:
    if (cache.current_layer, 0) in cache._pending_rec:
        raise UnsupportedModelError(
            _CURRENT.module, f"calls the recurrence seam `{seam}` more than once per forward; not supported"
        )
    cache.record_recurrent(record)


def _conv_fn(cache: SpecCache, a: dict[str, Any]) -> torch.Tensor:
    x_ext, weight = a["hidden_states"], a["weight"]
    tree = cache.tree
    k = weight.shape[-1]
    out = tree_causal_conv1d(x_ext, weight, a.get("bias"), tree.ancestors(k), a.get("activation") or "")
    s = x_ext.shape[-1] - tree.num_nodes
    return torch.cat([out.new_zeros(out.shape[0], out.shape[1], s), out], dim=-1)


def _ssd(cache: SpecCache, a: dict[str, Any]):
    if a.get("z") is not None:
        raise UnsupportedModelError("mamba_chunk_scan_combined", "gated (z) chunk scan is not supported yet")
    tree = cache.tree
    lo, hi = a.get("dt_limit", (0.0, float("inf")))
    keep = cache.strategy == "materialize"
    x, dt, A, Bm, Cm = a["hidden_states"], a["dt"], a["A"], a["B"], a["C"]
    h0 = _committed(cache, "mamba_chunk_scan_combined", (x.shape[0], x.shape[2], x.shape[3], Bm.shape[-1]))
    D, bias, sp = a.get("D"), a.get("dt_bias"), bool(a.get("dt_softplus", False))
    y, states = tree_ssd(x, dt, A, Bm, Cm, D, bias, h0, tree.ancestor_mask, sp, float(lo), float(hi), keep)

    replay = dict(x=x, dt=dt, A=A, Bm=Bm, dt_bias=bias, h0=h0, ancestor_mask=tree.ancestor_mask,
                  dt_softplus=sp, dt_min=float(lo), dt_max=float(hi))  # fmt: skip
    _record(
        cache,
        "mamba_chunk_scan_combined",
        RecurrentRecord(states=states) if keep else RecurrentRecord(ssd=replay),
    )
    return (y, h0) if a.get("return_final_states", False) else y


def _selective_scan(cache: SpecCache, a: dict[str, Any]):
    tree = cache.tree
    keep = cache.strategy == "materialize"
    x, dt, A, Bm, Cm = a["hidden_states"], a["dt"], a["A"], a["B"], a["C"]
    h0 = _committed(cache, "selective_scan_fn", (x.shape[0], x.shape[1], A.shape[-1]))
    bias, sp = a.get("delta_bias"), bool(a.get("delta_softplus", False))
    y, states = tree_selective_scan(
        x, dt, A, Bm, Cm, a.get("D"), a.get("z"), bias, h0, tree.parents, tree.depth, sp, keep
    )

    def run(path: torch.Tensor, chain: TokenTree) -> torch.Tensor:
        g = functools.partial(_gather_last, idx=path)
        return tree_selective_scan(
            g(x), g(dt), A, g(Bm), g(Cm), None, None, bias, h0, chain.parents, chain.depth, sp, True
        )[1]

    _record(
        cache,
        "selective_scan_fn",
        RecurrentRecord(states=states) if keep else RecurrentRecord(replay=_replay_with(run)),
    )
    return (y, h0) if a.get("return_last_state", False) else y


def _gather_last(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, C, N] -> [B, C, M] along the node (last) dim."""
    return torch.gather(x, 2, idx[:, None, :].expand(x.shape[0], x.shape[1], idx.shape[1]))


def _delta_rule(cache: SpecCache, a: dict[str, Any]):
    tree = cache.tree
    keep = cache.strategy == "materialize"
    q, k, v, g_, beta = a["query"], a["key"], a["value"], a["g"], a["beta"]
    h0 = _committed(cache, "chunk_gated_delta_rule", (q.shape[0], v.shape[2], k.shape[3], v.shape[3]))
    l2 = bool(a.get("use_qk_l2norm_in_kernel", False))
    o, states = tree_delta_rule(q, k, v, g_, beta, h0, tree.parents, tree.depth, l2, keep)

    def run(path: torch.Tensor, chain: TokenTree) -> torch.Tensor:
        g = functools.partial(gather_nodes, idx=path)
        return tree_delta_rule(g(q), g(k), g(v), g(g_), g(beta), h0, chain.parents, chain.depth, l2, True)[1]

    _record(
        cache,
        "chunk_gated_delta_rule",
        RecurrentRecord(states=states) if keep else RecurrentRecord(replay=_replay_with(run)),
    )
    return o, (h0 if a.get("output_final_state", False) else None)


TREE_HANDLERS: dict[str, Callable[[SpecCache, dict[str, Any]], Any]] = {
    "causal_conv1d_fn": _conv_fn,
    "mamba_chunk_scan_combined": _ssd,
    "selective_scan_fn": _selective_scan,
    "chunk_gated_delta_rule": _delta_rule,
    "chunk_kda": _delta_rule,
}


def tree_aware(seam: Callable, name: str) -> Callable:
    """Wrap one seam: the original outside verification, the ssmspec tree op inside."""
    params = list(inspect.signature(seam).parameters.values())
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    handler = TREE_HANDLERS.get(name)

    @functools.wraps(seam)
    def wrapper(*args, **kwargs):
        cache = active_verify_cache()
        if cache is None:
            return seam(*args, **kwargs)
        if handler is None:
            raise RuntimeError(
                f"ssmspec: seam `{name}` was called during tree verification by {_CURRENT.module}; the mixer took a "
                "path ssmspec does not verify (please report this with the model's config)"
            )
        arguments = dict(defaults)
        arguments.update(zip(names, args))
        arguments.update(kwargs)
        return handler(cache, arguments)

    wrapper.__ssmspec_seam__ = name
    return wrapper


# ------------------------------------------------------------------------------------------- the pass
def _tracked(forward: Callable, path: str) -> Callable:
    """Remember which mixer is running, so that errors raised inside seams can name the module."""

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        outer, _CURRENT.module = _CURRENT.module, path
        try:
            return forward(self, *args, **kwargs)
        finally:
            _CURRENT.module = outer

    return run


def seams_called_by(module: nn.Module) -> dict[str, Callable]:
    """Global names in the module's forward body that are HF kernel seams -> the seam function."""
    fn = inspect.unwrap(type(module).forward)
    found = {}
    for name in fn.__code__.co_names:
        obj = fn.__globals__.get(name)
        if obj is not None and (seam_name(obj) is not None or hasattr(obj, "__ssmspec_seam__")):
            found[name] = obj
    return found


def _seam_of(fn: Callable) -> str:
    return getattr(fn, "__ssmspec_seam__", None) or seam_name(fn)


def rewrite_mixers(model: nn.Module) -> dict[str, list[str]]:
    """Make every module whose forward calls HF kernel seams tree-aware; returns {module path: [seam names]}.

    The seam names in the mixer's modeling module are pointed at ssmspec wrappers (once per module; a
    wrapper calls HF's function unchanged outside verification, so untransformed models of the family are
    unaffected), and the mixer instance gets a forward that records its path for error messages.
    """
    rewritten: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        seams = seams_called_by(module)
        if not seams:
            continue
        glb = inspect.unwrap(type(module).forward).__globals__
        for global_name, fn in seams.items():
            if not hasattr(fn, "__ssmspec_seam__"):
                glb[global_name] = tree_aware(fn, seam_name(fn))
        if not getattr(module, "__ssmspec_rewritten__", False):
            module.forward = types.MethodType(_tracked(type(module).forward, path), module)
            module.__ssmspec_rewritten__ = True
        rewritten[path] = sorted(_seam_of(f) for f in seams.values())
    return rewritten
