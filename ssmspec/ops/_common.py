"""Shared by the op families: the custom-op registration, compute dtypes, level-by-level tree evaluation,
the seam-adapter and commit registries each family file fills in, and the materialize commit (a gather)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ssmspec.static import capturing

# "ssmspec::<op>" -> the plain PyTorch function behind that custom op
_REFERENCES: dict[str, Callable] = {}
# ops whose reference is traceable (no data-dependent shapes or Python control flow on tensor values): the
# ssmspec backend may inline them into a graph so that Inductor fuses them with the ops around them
_TRACEABLE: set[str] = set()


def reference_op(name: str, *, traceable: bool = True) -> Callable[[Callable], Callable]:
    """Register a function as custom op `ssmspec::<name>` and remember the plain function, so that a
    kernel dispatcher (ssmspec.kernels.select) can call the reference without going through the op.
    `traceable=False` marks references with data-dependent control flow (level-by-level evaluation)."""

    def wrap(fn: Callable) -> Callable:
        qualname = f"ssmspec::{name}"
        _REFERENCES[qualname] = fn
        if traceable:
            _TRACEABLE.add(qualname)
        return torch.library.custom_op(qualname, fn, mutates_args=())

    return wrap


def _qualname(op: torch._ops.OpOverload | str) -> str:
    return op if isinstance(op, str) else f"{op.namespace}::{op._opname}"


def traceable_reference(op: torch._ops.OpOverload) -> Callable | None:
    """The plain function behind a reference op if it can be traced into a graph (None otherwise)."""
    return reference_impl(op) if _qualname(op) in _TRACEABLE else None


def reference_impl(op: torch._ops.OpOverload | str) -> Callable:
    """The plain PyTorch function behind a reference op (an OpOverload or "ssmspec::name")."""
    name = _qualname(op)
    if name not in _REFERENCES:
        raise KeyError(f"{name} is not an ssmspec reference op; known: {sorted(_REFERENCES)}")
    return _REFERENCES[name]


def eager_reference(first: torch.Tensor) -> bool:
    """Whether a reference op called on `first` runs its Python function directly (`eager_fast_path`): eager, on a
    plain CPU tensor."""
    return not torch.compiler.is_compiling() and type(first) is torch.Tensor and first.device.type == "cpu"


def eager_fast_path(op: Callable) -> Callable:
    """Wrap a reference op so that eager calls on plain CPU tensors run its Python function directly.

    The custom-op dispatcher costs tens of microseconds per call, a visible share of a small model's
    step on a CPU. Under torch.compile, on CUDA (where ssmspec.kernels may be registered) and for tensor
    subclasses (fake tensors, ...) the call still goes through the op."""
    fn = reference_impl(op._qualname if hasattr(op, "_qualname") else op)

    def call(*args):
        return fn(*args) if eager_reference(args[0]) else op(*args)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """At least float32, float64 when any input is float64: recurrences never run in half precision."""
    # float32 promoted with any floating dtype but float64 stays float32 (a Python check: torch.promote_types is a
    # dispatched op, called for every tree op of every layer)
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def chain_structure(batch: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, depth), both [batch, n], of a chain of n nodes per row (parent t - 1, depth t)."""
    idx = torch.arange(n, device=device)
    return (idx - 1).expand(batch, n), idx.expand(batch, n)


def gather_nodes(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x: [B, N, *rest], idx: [B, M] -> [B, M, *rest]."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return x[rows, idx]


def levelwise_states(
    h0: torch.Tensor,
    parents: torch.Tensor,
    depth: torch.Tensor,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Node states of a recurrence h_t = step(h_parent(t), t), evaluated one tree level at a time.

    h0: [B, *S] committed state; parents/depth: [B, N]; step(prev [B, K, *S], idx [B, K]) returns the
    states of nodes idx given their parents' states. Each level processes only its own nodes (rows with
    fewer nodes on a level repeat one of them), so a tree costs O(N) node steps. Returns [B, N, *S].
    """
    b, n = parents.shape
    rows = torch.arange(b, device=parents.device)[:, None]
    if capturing():  # a captured step: no host plan (its shapes follow the tree), every node on every level
        return _levelwise_static(h0, parents, depth, step, rows)
    states = h0.new_empty(b, n, *h0.shape[1:])
    for d, (idx, up, valid) in enumerate(_level_plan(parents, depth)):
        prev = h0.unsqueeze(1).expand(b, idx.shape[1], *h0.shape[1:]) if d == 0 else states[rows, up]
        new = step(prev, idx)
        if valid is not None:
            new = torch.where(valid.view(*valid.shape, *([1] * (h0.ndim - 1))), new, states[rows, idx])
        states[rows, idx] = new
    return states


def _levelwise_static(h0, parents, depth, step, rows) -> torch.Tensor:
    """`levelwise_states` with tensor ops only: level d recomputes every node from its parent's state and keeps
    the nodes at depth d (N levels of N nodes: a captured step serves every tree of its bucket)."""
    b, n = parents.shape
    idx = torch.arange(n, device=parents.device).expand(b, n)
    up = parents.clamp(min=0)
    states = step(h0.unsqueeze(1).expand(b, n, *h0.shape[1:]), idx)  # right for the roots
    shape = (b, n) + (1,) * (h0.ndim - 1)
    for d in range(1, n):
        states = torch.where((depth == d).view(shape), step(states[rows, up], idx), states)
    return states


def _level_plan(
    parents: torch.Tensor, depth: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per tree level: its nodes in each row [B, K] (a row with fewer repeats its last one), their parents, and
    which are real (None: all; a row without a node on the level points at node 0 and is masked). Planned on the
    host in one read of the tree: a level then costs its recurrence step and two index operations."""
    par, dep = parents.tolist(), depth.tolist()
    levels: dict[int, list[list[int]]] = {}
    for r, row in enumerate(dep):
        for t, d in enumerate(row):
            levels.setdefault(d, [[] for _ in par])[r].append(t)
    plan = []
    for d in sorted(levels):
        nodes = levels[d]
        k = max(len(x) for x in nodes)
        idx = [x + x[-1:] * (k - len(x)) if x else [0] * k for x in nodes]
        up = [[max(par[r][t], 0) for t in row] for r, row in enumerate(idx)]
        missing = [not x for x in nodes]
        valid = None if not any(missing) else torch.tensor([[not m] * k for m in missing], device=parents.device)
        plan.append((torch.tensor(idx, device=parents.device), torch.tensor(up, device=parents.device), valid))
    return plan


# ------------------------------------------------------------------------------------------ seam adapters
class SeamCall(Protocol):
    """What a seam adapter sees of the verification in progress (ssmspec.hf.seams.MixerCall implements it):
    the tree, the commit strategy, the calling mixer's committed state, and a place to leave commit records.
    `in_place`: the tree is one node per row (always accepted), and an adapter may advance the committed state
    by it as it verifies instead of recording (a commit would replay that one node)."""

    module: str

    @property
    def tree(self) -> Any: ...

    @property
    def commit_strategy(self) -> str: ...

    @property
    def in_place(self) -> bool: ...

    def committed_state(self, seam: str, expected: tuple[int, ...]) -> torch.Tensor | None: ...

    def record(self, seam: str, kind: str, *, states: torch.Tensor | None = None, **replay: Any) -> None: ...

    def advanced(self, seam: str) -> None: ...


@dataclass(frozen=True)
class SeamAdapter:
    """How one HF kernel seam is verified on a tree.

    run(call, arguments) returns what the seam would return; `understands` are the arguments it reads,
    `ignores` those that cannot change the result (chunk sizes, backend switches). Any other argument
    given a non-default value makes the call fail closed (UnsupportedModelError names the argument)."""

    seam: str
    run: Callable[[SeamCall, dict[str, Any]], Any]
    understands: frozenset[str]
    ignores: frozenset[str] = frozenset()


@dataclass
class Record:
    """What a tree op left for commit, for one (layer, state index): every node's state (materialize) or
    the recurrence inputs to replay along the accepted path (replay). `part`: the slice [:, part] of the state
    that the op owns, where a mixer runs one op per head on a slice of its state (Zamba v1); None: all of it."""

    kind: str
    layer: int
    state_idx: int
    states: torch.Tensor | None = None
    replay: dict[str, Any] = field(default_factory=dict)
    part: int | None = None


# commit(items: [(committed state tensor to overwrite, Record)], path [B, M], lengths [B], last [B])
CommitFn = Callable[[list[tuple[torch.Tensor, Record]], torch.Tensor, torch.Tensor, torch.Tensor], None]

ADAPTERS: dict[str, SeamAdapter] = {}
COMMITS: dict[str, CommitFn] = {}


def seam_adapter(*seams: str, understands: tuple[str, ...], ignores: tuple[str, ...] = ()) -> Callable:
    """Register a function as the tree adapter of one or more HF kernel seams."""

    def wrap(fn: Callable) -> Callable:
        for seam in seams:
            ADAPTERS[seam] = SeamAdapter(seam, fn, frozenset(understands), frozenset(ignores))
        return fn

    return wrap


def commits(kind: str) -> Callable[[CommitFn], CommitFn]:
    """Register a function as the commit of every Record of this kind."""

    def wrap(fn: CommitFn) -> CommitFn:
        COMMITS[kind] = fn
        return fn

    return wrap


@reference_op("gather_states")
def gather_states(states: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Materialize commit: states [B,N,*S], last [B] -> each row's state at its last accepted node [B,*S]."""
    return states[torch.arange(states.shape[0], device=states.device), last].clone()


@gather_states.register_fake
def _(states, last):
    return states.new_empty(states.shape[0], *states.shape[2:])


gather_states_fast = eager_fast_path(gather_states)


def commit_materialized(items: list[tuple[torch.Tensor, Record]], last: torch.Tensor) -> list[tuple]:
    """Write the materialized records' states (gather at `last`); returns the items left to replay."""
    rest = []
    for target, rec in items:
        if rec.states is not None:
            target.copy_(gather_states_fast(rec.states, last).to(target.dtype))
        else:
            rest.append((target, rec))
    return rest


def in_place_commit(target: torch.Tensor) -> bool:
    """Whether a commit may write a committed state in place with plain PyTorch ops (eager, and no Triton
    kernel asked for: CPU, or the "reference" policy): fewer passes over the state and no copies. Compiled
    commits and kernel policies other than "reference" on CUDA go through the families' commit ops."""
    if torch.compiler.is_compiling():
        return False
    return target.device.type == "cpu" or kernel_policy() == "reference"


# ------------------------------------------------------------------------------------------ kernel policy
KERNEL_POLICIES = ("auto", "kernels", "reference")


class _Policy(threading.local):
    value: str = "reference"  # what a model that was not compiled with the ssmspec backend runs


_POLICY = _Policy()


def kernel_policy() -> str:
    """The kernel policy of the model running in this thread: "reference" (plain PyTorch ops), "kernels"
    (Triton kernels) or "auto" (per shape, whichever was measured faster; ssmspec.kernels.select)."""
    return _POLICY.value


@contextlib.contextmanager
def using_kernel_policy(policy: str | None) -> Iterator[None]:
    """Run a block under a model's kernel policy (None: leave the current one). Per thread, so compiling
    one model never changes how another runs."""
    if policy is None:
        yield
        return
    if policy not in KERNEL_POLICIES:
        raise ValueError(f"kernel policy must be one of {KERNEL_POLICIES}, got {policy!r}")
    outer, _POLICY.value = _POLICY.value, policy
    try:
        yield
    finally:
        _POLICY.value = outer


def stacked(targets: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive leading slices `targets` are, in order (`T[i], T[i + 1], ...` of one T:
    the cache keeps each family's states stacked, ssmspec.hf.layers.stack_states), else None. A commit updates
    it with one op instead of one per layer."""
    base = targets[0]._base
    if base is None or len(targets) < 2 or base.dim() != targets[0].dim() + 1:
        return None
    step, first = base.stride(0), targets[0].storage_offset() - base.storage_offset()
    if step == 0 or first % step:
        return None
    for j, t in enumerate(targets):
        if t._base is not base or t.storage_offset() != targets[0].storage_offset() + j * step:
            return None
        if t.shape != base.shape[1:] or t.stride() != base.stride()[1:]:
            return None
    return base[first // step : first // step + len(targets)]
