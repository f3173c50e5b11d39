"""ModelRunner: one transformed model plus its SpecCache, with prefill / verify(tree) / commit.

Per-row positions follow HF's `cumsum(attention_mask) - 1` convention, continued by tree depth; the
attention masks come from the cache's slot layout (ssmspec.cache) and each layer's window (ssmspec.hf.masks).
One-node trees (nothing drafted) are always accepted: they run through HF's own decode path (nothing to commit)
or the tree path, whichever measured faster on the model (`ModelRunner.single_node_path`).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import EllipsisType
from typing import TYPE_CHECKING

import torch
from torch import nn

from ssmspec import linear as packed_linear
from ssmspec.compile.backend import CUDA_GRAPH_MODES, compile_mode
from ssmspec.compile.graphs import StepGraph
from ssmspec.compiled import CompiledAs, compiled_as
from ssmspec.errors import PENDING_TREE, CaptureError, UnsupportedModelError, batches_inexact, trees_inexact
from ssmspec.hf import attention as hf_attention
from ssmspec.hf import features
from ssmspec.hf import instance as hf_instance
from ssmspec.hf import masks as hf_masks
from ssmspec.hf.cache import SpecCache
from ssmspec.speculate.ties import near_tie_tolerance, near_ties
from ssmspec.tree import TokenTree
from ssmspec.verification import Verification, fold_states

if TYPE_CHECKING:  # (the step's types import the drafters, which import this module)
    from ssmspec.speculate.step import StepDraft


def cache_kwarg(model: nn.Module) -> str:
    """The name under which the model's forward takes its cache (past_key_values or cache_params)."""
    params = inspect.signature(model.forward).parameters
    for name in ("past_key_values", "cache_params"):
        if name in params:
            return name
    raise ValueError(f"{type(model).__name__}.forward takes neither past_key_values nor cache_params")


def bucket(n: int, largest: int | None = None) -> int:
    """The static node count a tree of n nodes is padded to: the next power of two, or `largest` (the biggest tree
    the drafter can make) where that power of two is more than half of it: a full tree is never padded, and no bucket
    sits just below the largest (a 16-node bucket beside a 17-node one was one more graph to compile and capture for
    trees one node smaller)."""
    up = 1 << max(0, n - 1).bit_length()
    return largest if largest is not None and n <= largest and 2 * up > largest else up


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a padded batch as HF's generate makes them: cumsum(mask) - 1, padding at 1."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def compiled_fold(model: nn.Module, options: dict | None):
    """A compiled model's commit: `fold_states` compiled with the model's own backend, mode and options (`options`,
    as `compiled_as` found them), once per model (kept on it), so that committing all layers is one compiled graph
    (one CUDA graph) without a host read. None for a model that was not compiled. Runners use it on CUDA only: on a
    CPU the eager commit (in place, all layers' states stacked, paths walked on the host) costs less than the
    compiled graph's guards and call (about 0.5 against 1.1 ms on the embedded target)."""
    if options is None:
        return None
    fold = model.__dict__.get("_ssmspec_compiled_commit")
    if fold is None:
        fold = model.__dict__["_ssmspec_compiled_commit"] = torch.compile(fold_states, **options)
    return fold


@dataclass
class Captured:
    """A captured verify step and its commit: its static tree (the inputs each replay is copied into), its graphs,
    and the K/V buffers' allocation they read (`SpecCache.kv_generation`)."""

    tree: TokenTree
    graph: StepGraph
    generation: int
    last: torch.Tensor  # [B] each row's last accepted node, the captured commit's input
    commit: StepGraph | None = None  # the bucket's commit, captured at its second commit (its first runs eagerly)
    committed: bool = False
    fused: bool = False  # a one-node step verified in place and committed inside the same graph
    drafts: int = 0  # the depth of the next chain a greedy step drafts in its graph (`ModelRunner.step_draft`)


@dataclass
class Workspace:
    """A call's static buffers and the steps captured over them, kept on the model between calls (`ModelRunner.release`)
    so that a later call with the same layout replays them instead of capturing (and, on a CPU, compiling) them again:
    its prefill's states are copied into these buffers (`SpecCache.adopt`)."""

    cache: SpecCache
    captured: dict[tuple, Captured]  # (batch, nodes), or (batch, nodes, "greedy") for `verify_greedy`'s steps
    pool: object = None  # the CUDA graphs' memory pool
    checked: set[int] = field(default_factory=set)  # the compiled steps whose every input was found its own (ids)


def _workspaces(model: nn.Module) -> tuple[threading.Lock, dict[tuple, list[Workspace]]]:
    """The model's idle workspaces by layout, and the lock that guards them (made once per model)."""
    store = model.__dict__.get("_ssmspec_workspaces")
    if store is None:
        store = model.__dict__.setdefault("_ssmspec_workspaces", (threading.Lock(), {}))
    return store


class ModelRunner:
    """Drive a (transformed) HF causal LM through prefill, tree verification and commit."""

    # a verify step that ran out of memory left nothing behind (the cache discards an interrupted verification): it
    # may be retried with a smaller tree
    retries_out_of_memory = True
    path = "seams"  # (the kernel seams' path; GenericRunner's is HF's forward)
    reruns = False  # a partial commit keeps the accepted path in the state: nothing is fed again

    def __init__(
        self, model: nn.Module, *, commit: str = "replay", decode_single_nodes: bool | None = None,
        static_shapes: bool = False, max_depth: int = 0, max_nodes: int | None = None, capacity: int | None = None,
        vocab: torch.Tensor | None = None, agreement: hf_instance.Agreement | None = None,
        static_kv: bool | None = None, capture_features: bool = False, graphs: bool = False,
        level_aligned: bool | None = None, compiled: CompiledAs | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.cache_kwarg = cache_kwarg(model)
        self.takes_positions = hf_instance.forward_takes(model, "position_ids")
        # (its LM head on the last positions only: a prefill's)
        self.takes_logits_to_keep = hf_instance.forward_takes(model, "logits_to_keep")
        self.commit_strategy = commit
        # one-node trees go through HF's decode path (True) or the tree path (False); None: whichever measures faster
        # on this model (`single_node_path`: once per model, batch size, dtype and device)
        self.decode_single_nodes = decode_single_nodes
        self.chooses_single_node_path = decode_single_nodes is None  # (the calibration may choose it: apply)
        self.dtype = next(model.parameters()).dtype
        self.device = hf_instance.input_device(model)  # (an offloaded embedding's weights are on meta)
        # the same timings on every process of a tensor-parallel model (a no-op otherwise): the choices they steer
        # must be the same everywhere; a draft model's runner takes its target's
        self.agreement = agreement if agreement is not None else hf_instance.Agreement(model)
        # the tree path's one-node trees advance the committed states as they are verified (`verify`), except under
        # CUDA graphs, whose graphs would then write inputs they do not own (skipped or copied; unmeasured)
        # a compiled model's prefill runs eagerly on a CPU: compiled for any prompt length it took 87-124 s a graph
        # to compile (211 of a 266 s warm-up on the embedded model) and ran no faster (20.2 against 20.5 ms for 128
        # tokens, 159 against 111 ms for 1,024); decode and verify steps, static, stay compiled
        # how the model was compiled: as the call's plan found it (`compiled`), or read from the model
        self.compiled = compiled = compiled if compiled is not None else compiled_as(model)
        self.eager_prefill = self.device.type == "cpu" and compiled.call is not None
        mode = compile_mode(compiled.options or {})
        self.in_place_single_nodes = not (self.device.type == "cuda" and mode in CUDA_GRAPH_MODES)
        self.info = getattr(model, "ssmspec_info", None)
        # a batch's trees laid out level by level (positions read from cache slots); None: as the model's probe found
        if level_aligned is None:
            level_aligned = bool(getattr(self.info, "slot_positions", False))
        self.level_aligned = level_aligned
        # static shapes (compiled / CUDA-graph verification): trees padded to a power-of-two node count, commits
        # over a fixed path length (max_depth + 1), so one compiled graph serves each bucket; the largest
        # bucket is `max_nodes` (the drafter's largest tree) rather than the power of two above it
        self.static_shapes = static_shapes
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        # attention K/V in preallocated buffers updated in place (ssmspec.hf.cache): `capacity` slots per row after the
        # prompt (default: 256, grown when a step would not fit); in eager mode the attention reads only the slots in
        # use. Not for models that read positions from cache slots (the probe saw them do it), nor in eager mode for
        # models with sliding-window layers (HF's layout keeps only the window, the buffers every slot): HF's layout.
        # `static_kv` False: HF's layout whatever the model (the probe, which finds whether it reads cache slots)
        self.capacity = None if self.level_aligned or static_kv is False else (capacity or 256)
        self.fold = compiled_fold(model, compiled.options) if self.device.type == "cuda" else None  # None: eager commit
        # logits of ids outside `vocab` read -inf (VocabTrim on a compiled draft, whose head is not swapped)
        self.dropped_ids: torch.Tensor | None = None
        if vocab is not None:
            kept = torch.as_tensor(vocab, dtype=torch.long, device=self.device)
            dropped = torch.ones(model.config.get_text_config().vocab_size, dtype=torch.bool, device=self.device)
            self.dropped_ids = dropped.index_fill_(0, kept, False)
        # the forwards of this runner run the model's prepacked linears (ssmspec.linear), where it has them: every
        # forward until `packed_sizes` says per tree size which of them and F.linear measured faster on this CPU
        # (measured with the cost curve, ssmspec.speculate.calibration.measure_cost)
        self.prepack = packed_linear.is_packed(model) and compiled.step_compiler is None  # (compiled: Inductor's)
        self.packed_sizes: dict[int, bool] | None = None
        # whether packed linears or F.linear may be chosen per tree size (the calibration measures which): eager, on
        # a CPU model with packed linears big enough to pack
        self.chooses_packing = (self.prepack and not static_shapes and self.device.type == "cpu"
                                and packed_linear.packs_any(model))  # fmt: skip
        # the target's features (its LM head's input) of the last forward's positions [B, N, H], for a drafter that
        # drafts from them (ssmspec.hf.features): kept only when `capture_features` is set
        self.capture_features = capture_features
        if capture_features:
            features.enable(model)
        self.features: torch.Tensor | None = None
        # the call's drafter's next chain as a greedy step drafts it in its graph (Drafter.step_draft), set by the
        # engine, and the chain per row the last greedy step drafted (`verify_greedy`)
        self.step_draft: StepDraft | None = None
        self.drafted: list[list[int]] | None = None
        self.cache: SpecCache | None = None
        self._pending: tuple[TokenTree, Verification | None] | None = None
        self._pending_capture: Captured | None = None  # the pending verification's captured step, if captured
        # captured verify steps (`graphs`): one StepGraph per (batch, nodes) bucket over static inputs, replayed every
        # step; every step then takes the tree path (HF's decode path and in-place one-node steps change the committed
        # state, which a captured step, run twice when captured on CUDA, must only read)
        self.graphs = graphs
        self.captured: dict[tuple, Captured] = {}
        self.captures = 0  # steps captured by this runner
        # on a CPU, the steps of a model compiled for them (`transform(compile=True)`) are compiled (one Inductor graph
        # each, ssmspec.compile.lower); otherwise the op tape records them
        self.compiler = self.compiled.step_compiler if graphs and self.device.type != "cuda" else None
        # a one-node step's verify and commit as one captured step (its tree is always accepted: verified in place),
        # where a capture runs the step once (a CUDA capture runs it twice: a warm-up and the capture)
        self.fuse_single_nodes = self.compiler is not None
        self.workspace: Workspace | None = None
        if graphs:
            self._refuse_graphs(static_shapes)
            self.decode_single_nodes, self.chooses_single_node_path = False, False
            self.in_place_single_nodes = False
        self._pool = None

    def choose(
        self,
        *,
        packed_sizes: dict[int, bool] | None | EllipsisType = ...,
        single_node_path: bool | None | EllipsisType = ...,
    ) -> None:
        """The calibration's choices (`step.Runner.choose`): linears per tree size, the one-node steps' path."""
        if packed_sizes is not ...:
            self.packed_sizes = packed_sizes
        if single_node_path is not ...:
            self.decode_single_nodes = single_node_path

    def _refuse_graphs(self, static_shapes: bool) -> None:
        """Captured steps need a layout whose every tensor keeps its address: refused, naming why, elsewhere."""
        why = None
        if not static_shapes:
            why = "captured verify steps need static shapes (SpecConfig.static_shapes=True)"
        elif self.level_aligned:
            why = "the model reads positions from cache slots (HF's K/V layout, rewritten every step)"
        elif self.capacity is None:
            why = "static K/V buffers are off for this runner"
        elif hf_instance.offloaded(self.model):
            why = ("its weights are offloaded (device_map to the CPU or disk): accelerate loads them inside every "
                   "forward, which a replayed step would not do")  # fmt: skip
        if why is not None:
            raise UnsupportedModelError(type(self.model).__name__, f"cannot capture its verify steps: {why}")

    def _call(self, input_ids, attention_mask, position_ids, eager: bool = False, keep: int = 0) -> torch.Tensor:
        """The model's logits for these tokens on this runner's cache (`eager`: without its compiled forward; `keep`:
        of the last `keep` positions only, where the model takes HF's logits_to_keep; 0: every position's)."""
        kwargs = {self.cache_kwarg: self.cache, "use_cache": True}
        if keep and self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if self.takes_positions:
            kwargs["position_ids"] = position_ids
        packed = packed_linear.packs(self.packed_sizes, input_ids.shape[1], self.prepack)
        with (packed_linear.prepacked(packed), hf_attention.grouping(),
              features.capturing(self.model, self.capture_features) as capture):  # fmt: skip
            call = hf_instance.uncompiled_call(self.model) if eager else self.model
            logits = call(input_ids=input_ids, **kwargs).logits
        if capture is not None:
            self.features = features.positions(capture, logits)
        if self.dropped_ids is not None:
            logits = logits.masked_fill(self.dropped_ids[: logits.shape[-1]], -float("inf"))
        return logits

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_positions: bool = False, keep: int = 1
    ) -> torch.Tensor:
        """Process the (padded) prompt with HF's own forward; returns the last position's logits [B, V] (the last
        `keep` positions' [B, keep, V], or every position's for `keep` 0, with `all_positions`). The LM head runs on
        the last `keep` positions only, where the model takes HF's logits_to_keep, as in HF's own prefill (features
        captured for a drafter are those positions')."""
        if input_ids.shape[0] > 1 and self.info is not None and not self.info.batches:
            raise UnsupportedModelError(type(self.model).__name__, batches_inexact(self.info.limits["batches"]))
        self.release()
        self.cache = SpecCache(self.model.config, commit=self.commit_strategy, state_dtype=self.dtype,
                               capacity=self.capacity, views=not self.static_shapes)  # fmt: skip
        self.cache.in_place_layout = self.graphs
        self.captured = {}  # (they read the previous call's cache)
        mask = attention_mask.to(torch.long)
        logits = self._call(input_ids, mask, positions_from_mask(mask), eager=self.eager_prefill, keep=keep)
        self.cache.start(mask)
        if self.graphs:
            self._take_workspace()
        return logits if all_positions else logits[:, -1]

    def _layout(self) -> tuple | None:
        """What a workspace must share with this call for its captured steps to serve it: the cache's tensors' shapes
        and dtypes and the runner's step sizes; None where this call's steps read something of its own (a trimmed
        vocabulary's mask)."""
        if self.dropped_ids is not None:
            return None
        return (self.cache.layout(), self.dtype, str(self.device), self.commit_strategy, self.max_depth,
                self.max_nodes, self.capture_features, self.compiler is not None)  # fmt: skip

    def _take_workspace(self) -> None:
        """Verify on an idle workspace of the model with this call's layout, its buffers loaded with the prefill's
        states (its captured steps replay for this call), else on this call's cache (kept as a workspace after)."""
        layout = self._layout()
        if layout is None:
            return
        lock, idle = _workspaces(self.model)
        with lock:
            free = idle.get(layout)
            workspace = free.pop() if free else None
        if workspace is None:
            pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
            workspace = Workspace(self.cache, {}, pool)
        else:
            workspace.cache.adopt(self.cache)
        self.workspace, self.cache, self.captured = workspace, workspace.cache, workspace.captured
        self._pool = workspace.pool

    def release(self) -> None:
        """Hand this call's workspace back to the model (its buffers and captured steps serve a later call); the runner
        keeps reading it until another call takes it. No-op without one."""
        workspace, self.workspace = self.workspace, None
        if workspace is None or self._pending is not None:
            return
        if not self._owned(workspace):
            return  # a step read a tensor of this call's own: not replayable for another call
        lock, idle = _workspaces(self.model)
        with lock:
            idle.setdefault(self._layout(), []).append(workspace)

    @staticmethod
    def _owned(workspace: Workspace) -> bool:
        """Whether every tensor the workspace's compiled steps read is its own: its cache's, a captured tree's, or what
        a captured step of it produced (each step checked once)."""
        graphs = [g for e in workspace.captured.values() for g in (e.graph, e.commit) if g is not None and g.inputs]
        new = [g for g in graphs if id(g) not in workspace.checked]
        if not new:
            return True
        owned = {t.untyped_storage().data_ptr() for t in workspace.cache.tensors()}
        for other in workspace.captured.values():  # (a commit reads its verify step's records: that graph's outputs)
            kept = [t for g in (other.graph, other.commit) if g is not None for t in g.kept]
            owned.update(t.untyped_storage().data_ptr() for t in (*other.tree.tensors(), other.last, *kept))
        if not all(t.untyped_storage().data_ptr() in owned for g in new for t in g.inputs):
            return False
        workspace.checked.update(id(g) for g in new)
        return True

    @property
    def n_real(self) -> torch.Tensor:
        """Tokens processed per row (padding excluded)."""
        return self.cache.n_real

    def padded_size(self, nodes: int) -> int:
        """The node count a tree of `nodes` nodes is verified with (its bucket, with static shapes)."""
        return bucket(nodes, self.max_nodes) if self.static_shapes and nodes > 1 else nodes

    def prepare(self, tree: TokenTree | Sequence[tuple[list[int], list[int]]]) -> TokenTree:
        """The tree to verify for `tree` (or per-row (tokens, parents) lists, built into one here), on the model's
        device: level-aligned for models that read positions from cache slots; with static shapes, padded
        (never-acceptable nodes) to its bucket's node count (`bucket`). A tree built on the host is prepared there
        and moved in one transfer."""
        if not isinstance(tree, TokenTree):
            tree = TokenTree.from_lists([tokens for tokens, _ in tree], [parents for _, parents in tree])
        if self.level_aligned and tree.batch_size > 1 and not tree.depth_is_index:
            tree = tree.level_aligned()
        if self.padded_size(tree.num_nodes) != tree.num_nodes:
            tree = tree.padded(self.padded_size(tree.num_nodes))
        return tree.to(self.device)

    def masks(self, tree: TokenTree):
        """The attention masks of a verify (or decode) step on `tree`, as the model takes them."""
        cache = self.cache
        if not cache.attention:
            return None
        if cache.static_kv:
            valid = cache.valid[:, : cache.visible(tree.num_nodes)]  # (eager: only the slots in use)
            allow = {w: hf_masks.allowed_static(valid, cache.block, tree, w) for w in cache.windows()}
        else:
            allow = {w: hf_masks.allowed(cache.window_view(w), tree, w) for w in cache.windows()}
        implementation = getattr(self.model.config, "_attn_implementation", None)
        masks = {window: hf_masks.for_attention(a, self.dtype, implementation) for window, a in allow.items()}
        return hf_masks.package(masks, recurrent=bool(cache.linear_layers()))

    def _decodes(self, tree: TokenTree) -> bool:
        """Whether `verify(tree)` runs HF's decode path instead of the tree path."""
        if tree.num_nodes != 1:
            return False
        if self.decode_single_nodes is None:
            self.decode_single_nodes = self.single_node_path()
        return self.decode_single_nodes

    @contextlib.contextmanager
    def tree_path(self) -> Iterator[None]:
        """Verify one-node trees through the tree path, recording for a commit, in this block (to discard them
        afterwards: HF's decode path and in-place verification update states in place)."""
        outer = self.decode_single_nodes, self.in_place_single_nodes
        self.decode_single_nodes, self.in_place_single_nodes = False, False
        try:
            yield
        finally:
            self.decode_single_nodes, self.in_place_single_nodes = outer

    @torch.no_grad()
    def single_node_path(self, repeats: int = 5) -> bool:
        """Whether one-node steps should take HF's decode path (True) or the tree path and a commit (False),
        measured on this runner's cache (every trial rolled back) the first time a model meets a batch size,
        dtype and device, then remembered on the model. HF's decode path runs its own fallbacks (on a CPU:
        a depthwise conv and an [H, P, S]-sized exp per layer for Mamba2), which the tree path beats on larger
        models (44 against 56 ms on a 24 x 768 Mamba2 in eager mode, about 31 against 45 ms compiled); on small ones
        they tie. A compiled model compiles its one-node tree graph for it, once. Both paths are exact; in
        float32 / bfloat16 they round differently (near-ties, counted in spec_stats)."""
        memo = self.model.__dict__.setdefault("_ssmspec_single_node_path", {})
        key = (int(self.cache.n_real.shape[0]), self.dtype, str(self.device), self.static_shapes)
        if key not in memo:
            memo[key] = self._measure_single_node(repeats)
        return memo[key]

    def _measure_single_node(self, repeats: int) -> bool:
        batch = self.cache.n_real.shape[0]
        root = TokenTree.chain(torch.zeros(batch, 1, dtype=torch.long, device=self.device))
        zero = torch.zeros(batch, dtype=torch.long, device=self.device)
        snap = self.snapshot()
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats + 1):  # the first round warms up
            for decodes in (True, False):
                self.decode_single_nodes = decodes
                t0 = time.perf_counter()
                self.verify(root)
                self.commit(zero)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                times[decodes].append(time.perf_counter() - t0)
                self.restore(snap)
        self.decode_single_nodes = None
        median = {k: sorted(v[1:])[len(v[1:]) // 2] for k, v in times.items()}
        tree_path, decode_path = self.agreement.seconds([median[False], median[True]])
        return not tree_path < 0.95 * decode_path  # the tree path only where it is clearly cheaper

    @torch.no_grad()
    def verify(self, tree: TokenTree) -> torch.Tensor:
        """Logits [B, N, V] for every node of the tree; committed state is untouched until `commit`."""
        if self._pending is not None:
            raise RuntimeError(PENDING_TREE)
        if not tree.depth_is_index and self.info is not None and not self.info.trees:
            raise UnsupportedModelError(type(self.model).__name__, trees_inexact(self.info.limits["trees"]))
        decodes = self._decodes(tree)  # (may measure which path, on this cache, once per model)
        self.cache.reserve(tree.num_nodes)
        if self.graphs:
            return self._replay(tree)
        positions = self.cache.n_real[:, None] + tree.depth
        attention = self.masks(tree)
        if decodes:
            # one node per row is always accepted: HF's own decode path (in-place state update) is exact by
            # definition, and on some models cheaper than the tree path plus a commit
            logits = self._call(tree.tokens, attention, positions)
            self.cache.after_decode()
            self._pending = (tree, None)
            return logits
        # a one-node tree is always accepted: where nothing will discard it, its ops advance the committed states as
        # they verify it (no records, no commit of theirs: at batch 4 on the embedded target the commit took 0.65 ms
        # of a 5.6 ms plain step)
        in_place = tree.num_nodes == 1 and self.in_place_single_nodes
        with self.cache.verifying(tree, in_place=in_place) as verification:
            logits = self._call(tree.tokens, attention, positions)
        self._pending = (tree, verification)
        return logits

    def _replay(self, tree: TokenTree) -> torch.Tensor:
        """`verify` as a captured step: the first tree of a (batch, nodes) bucket is captured with its own static
        inputs, every later one copied into them and the step replayed; the capture's Verification then holds the
        replay's records. Logits and features are copied out (the next replay overwrites the graph's)."""
        key = (tree.batch_size, tree.num_nodes)
        entry = self._bucket(key)
        if entry is None:
            static = tree.owned()
            last = tree.tokens.new_zeros(tree.batch_size)
            eager = self.device.type != "cuda"  # (on a CPU the op tape records the eager forward)
            fused = tree.num_nodes == 1 and self.fuse_single_nodes

            def step():
                with self.cache.verifying(static, in_place=fused) as verification:
                    positions = self.cache.n_real[:, None] + static.depth
                    logits = self._call(static.tokens, self.masks(static), positions, eager=eager)
                picks = None
                if fused:  # (always accepted)
                    verification.commit_static(last, 1, self.fold)
                    # the greedy choice and its near-tie, in the step: a plain greedy loop reads only these (`decode`)
                    ties = near_ties(logits[:, 0], near_tie_tolerance(self.dtype))
                    picks = torch.stack([logits[:, 0].argmax(-1), ties.long()])
                return logits, self.features, verification, picks

            entry = self._capture(key, static, last, step, fused)
            logits, feats, verification, _ = entry.graph.outputs
        else:
            entry.tree.copy_from(tree)
            logits, feats, verification, _ = entry.graph.replay()
            verification.reopen()
        self.features = feats.clone() if feats is not None else None
        if entry.fused:  # verified and committed: the host's bookkeeping of a one-node path
            verification.settle(1)
            self._pending = (tree, None)
        else:
            self._pending = (tree, verification)
            self._pending_capture = entry
        return logits.clone()

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """A plain greedy step as one replay of the batch's fused one-node step (a model whose steps are compiled on a
        CPU): `tokens` [B] each row's next input (any device tensor: copied into the step's input); returns [2, B]
        the target's argmax after it and whether its top two nearly tie (`near_ties`), read by the caller at once
        (the next replay overwrites it). The state is committed as the step runs. None where that step is not
        captured yet (`verify` and `commit` of a one-node tree capture it)."""
        if not self.fuse_single_nodes or self._pending is not None:
            return None
        entry = self.captured.get((int(self.cache.n_real.shape[0]), 1))
        if entry is None or entry.generation != self.cache.kv_generation:
            return None
        self.cache.reserve(1)
        if entry.generation != self.cache.kv_generation:  # the K/V buffers grew: `verify` captures it again
            return None
        entry.tree.tokens.copy_(tokens.view_as(entry.tree.tokens))
        _, feats, verification, picks = entry.graph.replay()
        verification.reopen()
        verification.settle(1)
        self.features = feats.clone() if feats is not None else None
        return picks

    @torch.no_grad()
    def verify_greedy(self, tree: TokenTree | Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """A greedy step (no logits processors) as one replay of the bucket's greedy step (a model whose steps are
        compiled on a CPU): the tree verified, each row's accepted path found on the device (`TokenTree.greedy_last`,
        the host walk's rule) and committed, in one compiled graph; one read. Returns per row the tokens the step
        emits (the target's choice after every node of the accepted path: the accepted drafts then the bonus token)
        and whether the target's top two nearly tie at each; with `capture_features`, `features` [B, W, H] holds the
        target's features along each row's path (root first, padded with its last node). A row is committed past a
        stop inside its path (EOS): its state is not read again. The bucket's first tree captures (compiles) the
        step.

        `tree`: a prepared tree (`prepare`), or per row a chain's tokens (root first), which refill a captured chain's
        tokens in place (nothing else of a chain changes between steps). With `step_draft` (and `capture_features`),
        the step drafts the next chain in its graph as well, from the features at each row's last accepted node and its
        bonus token, as deep as the bucket's tree (at most `max_depth`): `drafted` holds it per row, root first (None
        after a step without one). The calibration times these steps as calls run them, drafting included."""
        if not self.fuse_single_nodes:
            raise RuntimeError("greedy steps are compiled only on a CPU model whose steps are compiled")
        if self._pending is not None:
            raise RuntimeError(PENDING_TREE)
        chains = None if isinstance(tree, TokenTree) else [list(row) for row in tree]
        nodes = tree.num_nodes if chains is None else self.padded_size(max(len(row) for row in chains))
        batch = tree.batch_size if chains is None else len(chains)
        draft = self.step_draft if self.capture_features else None
        key = (batch, nodes, "greedy") + (() if draft is None else draft.key)
        self.cache.reserve(nodes)
        entry = self._bucket(key)
        if entry is not None and chains is not None and entry.tree.depth_is_index:
            entry.tree.refill_chains(chains)
            picks = entry.graph.replay()
        else:
            if chains is not None:
                tree = self.prepare([(row, list(range(-1, len(row) - 1))) for row in chains])
            if entry is None:
                entry = self._capture_greedy(tree, key, draft)
                picks = entry.graph.outputs
            else:
                entry.tree.copy_from(tree)
                picks = entry.graph.replay()
        picks, feats = picks
        self.features = feats.clone() if feats is not None else None
        rows = picks.tolist()
        drafts, width = entry.drafts, self.max_depth + 1  # (the capture's path width: `_capture_greedy`)
        self.drafted = [row[len(row) - drafts - 1 :] for row in rows] if drafts else None
        self.cache.settle_static(max(row[0] for row in rows))
        return [row[1 : 1 + row[0]] for row in rows], [row[1 + width : 1 + width + row[0]] for row in rows]

    def _capture_greedy(self, tree: TokenTree, key: tuple, draft: StepDraft | None = None) -> Captured:
        """Capture (compile) the greedy step of `tree`'s bucket and run it once (`verify_greedy`): its outputs
        [B, 1 + 2W (+ 1 + D)] per row its path's length, the target's choice at each of the path's W nodes and their
        near-ties (and with `draft`, its bonus token and the D tokens drafted after it), and the features along the
        path (or None)."""
        static = tree.owned()
        width, tolerance = self.max_depth + 1, near_tie_tolerance(self.dtype)
        drafts = min(tree.num_nodes - 1, self.max_depth) if draft is not None else 0
        if drafts:
            self.compiler.adopt(draft.module)

        def step():
            with self.cache.verifying(static) as verification:
                positions = self.cache.n_real[:, None] + static.depth
                logits = self._call(static.tokens, self.masks(static), positions, eager=True).float()
            target = logits.argmax(-1)  # (HF picks from float32 logits)
            ties = near_ties(logits, tolerance).long()
            path, lengths = verification.commit_static(static.greedy_last(target), width, self.fold)
            picks = torch.cat([lengths[:, None], torch.gather(target, 1, path), torch.gather(ties, 1, path)], 1)
            feats = self.features
            if feats is not None:  # (along each path: a drafter that drafts from them takes its last or all)
                feats = torch.gather(feats, 1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
            if drafts:  # the next chain, from the last accepted node (the path is padded with it) and the bonus token
                bonus = torch.gather(target, 1, path[:, -1:])
                picks = torch.cat([picks, bonus, draft(feats[:, -1], bonus[:, 0], drafts).to(picks.dtype)], 1)
            return picks, feats

        entry = self._capture(key, static, static.tokens.new_zeros(tree.batch_size), step, fused=True)
        entry.drafts = drafts
        return entry

    def _bucket(self, key: tuple) -> Captured | None:
        """The captured step of `key`, or None where there is none yet (every one is dropped once the K/V buffers grew:
        they read the old ones)."""
        entry = self.captured.get(key)
        if entry is not None and entry.generation != self.cache.kv_generation:
            self.captured.clear()
            entry = None
        return entry

    def _capture(self, key: tuple, static: TokenTree, last: torch.Tensor, step, fused: bool) -> Captured:
        """Capture `step` over `static` (the bucket's tree) as the captured step of `key`; its outputs are the graph's
        (`entry.graph.outputs`). A capture refused names the model, with a hint where one is known."""
        graph = StepGraph(self.device, self._pool, self.compiler)
        try:
            graph.capture(step)
        except CaptureError as e:
            raise CaptureError(f"{type(self.model).__name__}: {e}{hf_instance.capture_hint(str(e))}") from e
        entry = self.captured[key] = Captured(static, graph, self.cache.kv_generation, last, fused=fused)
        self.captures += 1
        return entry

    def _commit_captured(self, entry: Captured, verification: Verification, last: torch.Tensor):
        """`commit` of a captured step: the bucket's first commit runs eagerly (on CUDA it warms the commit up; a
        compiled CPU step, recorded as it runs, is captured at once), its second is captured, the later ones replay
        it; `last` is copied into the capture's input, the paths come back copied out of its outputs, and the host
        keeps only its bound of the slots in use."""
        width = self.max_depth + 1
        if not entry.committed and self.compiler is None:
            entry.committed = True
            return verification.commit(last, width, self.fold)
        longest = entry.tree.longest_path(last.tolist())  # (the tree's host copy: no device read)
        entry.last.copy_(last, non_blocking=True)
        if entry.commit is None:
            entry.commit = StepGraph(self.device, self._pool, self.compiler)
            path, lengths = entry.commit.capture(
                lambda: verification.commit_static(entry.last, width, self.fold), warmup=False
            )
            self.captures += 1
        else:
            path, lengths = entry.commit.replay()
        verification.settle(longest)
        return path.clone(), lengths.clone()

    def verify_bytes(self) -> int:
        """Bytes the pending verification holds until its commit (0 after a decode step)."""
        verification = self._pending[1] if self._pending is not None else None
        return verification.nbytes() if verification is not None else 0

    @torch.no_grad()
    def commit(self, last: torch.Tensor, hold: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance each row past root -> last[b] of the tree verified last; returns (path, lengths). `hold`: rows
        that have finished (nothing they compute is used any more) whose K/V slots stop advancing: in eager K/V
        buffers a finished row would otherwise take a slot a step until the batch's last row finishes."""
        tree, verification = self._pending
        self._pending = None
        entry, self._pending_capture = self._pending_capture, None
        held = self.cache.holding(hold)
        if verification is None:  # the decode step already advanced every row by its one token
            out = tree.paths(last, 1 if self.static_shapes else None)
        elif entry is not None:
            out = self._commit_captured(entry, verification, last)
        else:
            out = verification.commit(last, self.max_depth + 1 if self.static_shapes else None, self.fold)
        self.cache.hold(held)
        return out

    def discard(self) -> None:
        """Forget the tree verified last (its K/V slots are dropped; nothing else changed)."""
        if self._pending is not None:
            tree, verification = self._pending
            self._pending, self._pending_capture = None, None
            if verification is None:
                raise RuntimeError("a decode step cannot be discarded (HF's decode path updates states in place)")
            if verification.in_place:
                raise RuntimeError("a one-node step verified in place cannot be discarded (use `tree_path()`)")
            verification.discard()

    def snapshot(self) -> dict:
        """Everything needed to roll the runner back."""
        return self.cache.snapshot()

    def restore(self, snap: dict) -> None:
        """Roll back to a snapshot."""
        self.cache.restore(snap)
