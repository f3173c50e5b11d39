"""Captured steps compiled whole on a CPU: the compiler a `StepGraph` hands the ATen graph it recorded.

On a GPU a captured step is a CUDA graph; on a CPU the same step (the same static tensors, the same contract) is
recorded once as an FX graph of its ATen ops (ssmspec.compile.graphs) and compiled here by Inductor with its C++
wrapper, after ssmspec's passes (depthwise convolutions unrolled so that Inductor fuses them; float32 matrix products
of 2 to SMALL_MATMUL_ROWS rows, and those of 1 row with a large weight, pointed at ssmspec's CPU kernel), with other
one-row products as Inductor's loops (`OPTIONS`). A replay is then one call into the compiled code: no Python between
the ops, no guards, no op dispatch but the C++ dispatcher's call of that kernel. The model's parameters and buffers are
the graph's constants, read where they live on every call (a weight changed in place is seen).

Compiled graphs are kept per model, keyed by the graph's code and its inputs' layouts, so a step recorded again over
another call's buffers reuses its compilation; Inductor's on-disk cache (`TORCHINDUCTOR_CACHE_DIR`) serves the same
graphs to a new process in seconds instead of a compilation's tens of seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from tqdm.auto import tqdm

from ssmspec.compile import wrapper
from ssmspec.compile.passes import (
    matmul_operands,
    rows_linears,
    short_cumsums_unrolled,
    small_bmms_as_sums,
    split_product_rows,
    unroll_depthwise_convs,
)
from ssmspec.kernels import cpu_linear

# Inductor settings of a compiled step: the C++ wrapper (no Python wrapper's per-call cost), and matrix products of up
# to 32 rows (a step's linears over its few tokens, weights up to 2048 wide) as Inductor's own fused loops instead of
# calls into MKL. On the embedded 3M target (2-core CPU, tight loop) a plain step took 0.33-0.51 ms that way against
# 1.1-1.9 ms with MKL's sgemv and its OpenMP synchronisation per call; a 4-node verify step 0.73 ms against 2.57 ms
# (sgemm: 0.15 ms a product), a 16-node one 1.73 against 2.73. Those of float32 from 2 rows up call ssmspec's CPU kernel
# instead where it builds (ssmspec.kernels.cpu_linear, `StepCompiler(kernels=...)`): Inductor's loops sum each output
# in one dependent chain a row at a time, the kernel keeps 8 sums in flight and reads a weight from memory once for all
# rows (tight loop, 2-core AVX2 CPU: the embedded target's 4-, 8- and 16-node greedy steps 2.2, 3.3 and 5.8 plain steps
# against 2.7, 4.2 and 7.0; the 19.6M Nemotron-H's 2- and 4-node ones 1.33 and 1.71 against 1.66 and 2.16; 81 MB of
# weights streamed from memory, 8 and 16 rows 0.80 and 0.77 the time of 4-row groups each reading them). One-row
# products of small weights stay Inductor's loops, fused with the work around them: all of them through the kernel,
# compiled plain decoding on held-out code ran at 0.88x on the embedded Bamba (13 of 16 alternated rounds slower) and
# 1.01x on the target (large weights: KERNEL_WEIGHTS)
SMALL_MATMUL_ROWS = 32
# A verify step compiled whole is as fast as the fewest external calls let it be: each (a product through the kernel or
# MKL, ATen's cumsum or sort) ends the step's one OpenMP region and starts another, and its arguments go through the
# dispatcher. So before Inductor sees a step (ssmspec.compile.passes): batched products over a tree's or a path's nodes
# (the tree SSD's sums over ancestors, the replay commit's outer products) become broadcast products summed; cumsums
# over a path become running sums, in ATen's order and accumulation type; and products of 2 to SPLIT_ROWS rows become
# one-row products, whose loops Inductor fuses into one pass over the weight with a sum per row in flight. With the
# tree SSD's outputs computed node-major and the conv windows committed a column at a time (ssmspec.ops), a greedy step
# of 2 and 4 nodes on the embedded 3M target became one OpenMP region: 1.30 and 1.41 plain steps against 1.75 and 1.99
# (2-core AVX-512 CPU, alternated in one process); on the 19.6M Nemotron-H 1.07 and 1.23 against 1.18 and 1.42.
# Products of more rows stay the kernel's: at 8 rows split ones cost the medium model 1.94 plain steps against 1.70
SPLIT_ROWS = 4
# Products whose weight has at least KERNEL_WEIGHTS elements (2 MiB of float32) call the kernel from one row up, and
# are not split at 2 to SPLIT_ROWS rows: there a product is a long pass over its weight, the kernel's 8 sums in flight
# per loaded vector (one FMA each) take fewer instructions than Inductor's loops (a multiply and an add per row, one
# reduction per output and row), and its call's cost (the region it ends, the dispatcher) is small beside the pass.
# On the 19.6M Nemotron-H (in_proj 2192 x 512, MLP 1024 x 512 and 512 x 1024, LM head 2048 x 512; 2-core Xeon,
# steps alternated in one process, two runs), the plain step took 0.86-0.87 of its time, and a greedy step of 2, 4 and
# 8 nodes 0.85-0.88, 1.04-1.07 and 1.38-1.42 plain steps of before against 1.07-1.10, 1.43 and 1.45-1.46. On the 3M
# target, whose LM head alone is that large, the same within noise (0.99, 0.98, 1.05 against 1.00, 0.95, 1.04); taking
# its 1104 x 256 in_proj too (a quarter of it) made it slower (1.03, 1.00, 1.14 against 1.00, 0.95, 1.06)
KERNEL_WEIGHTS = 1 << 19
FUSED_BMM_INNER = 64
FUSED_BMM_OUTPUTS = 4096
UNROLLED_CUMSUM = 64
# A step's compilation (embedded 3M target, 2-core CPU, empty cache): the plain step about 25 s, each of the four verify
# buckets about 40 s, of which about 15 s are g++ on 400-460 kB of C++ (kernels and wrapper in one file at -O3) and
# the rest Inductor's Python (tracing, lowering, C++ code generation: cProfile). `cpp_wrapper_build_separate` compiles
# the wrapper (glue: allocations, kernel calls) at -O1 apart from the kernels at -O3: g++ 7-10 s a verify bucket,
# `transform(compile=True)` 167 s against 180 run back to back; compiled decoding alternated in one process: plain
# 1.03x, fixed 4-node chains 0.97x, the default call 1.01x (8 rounds: equal within noise)
# `memory_planning`: a step's intermediates are carved out of a few pooled allocations per call instead of one each
# (the embedded target's plain step: 79 allocations down to 4; the compiled call took 0.88x the time, alternated in
# one process, 16 of 20 rounds faster). With the near-tie check as fused reductions (ssmspec.speculate.ties), whole
# calls on 4 held-out prompts, alternated: compiled plain decoding (384 new tokens) 0.85x the time, 11 of 12 rounds
# faster; the default call (256) 0.89x, 8 of 10. Its cost is in compilation: cold `transform(compile=True)` of the
# target, empty caches, two runs each, 160 and 166 s against 145 and 165 s without it (g++ 61 s against 53-59)
OPTIONS = {
    "cpp_wrapper": True,
    "cpp_wrapper_build_separate": True,
    "memory_planning": True,
    "post_grad_custom_post_pass": wrapper.CACHE_KEY,  # (the wrapper's rewrite keys the cache: ssmspec.compile.wrapper)
    "post_grad_fusion_options": {"decompose_mm_pass": {"cpu_max_first_dimension_decomposition": SMALL_MATMUL_ROWS}},
}
# Products the kernel does not take (another dtype, no kernel built): Inductor leaves a product with a weight dimension
# over 2048 to MKL whatever its rows. In a step whose products have at most WIDE_ROWS rows, every weight is Inductor's
# loops too: they stream the weight once at memory speed, where MKL's sgemv of one row ran at a third of it. On the
# embedded 19.6M Nemotron-H (Mamba2 in_proj 512 x 2192, 2-core CPU) the plain step took 4.0 ms that way against 5.9 ms
# with MKL for those products (compiled plain decoding 295 against 173 tok/s on held-out code), and a greedy step of 2
# and 4 nodes 5.9 and 6.8 ms against 8.8 and 8.7. Beyond a few rows each output's sum is repeated per row, one dependent
# chain of adds each, where MKL's sgemm keeps the cores' FMA units busy: at 8 nodes the loops were still 7% faster on
# that model (8.9 ms against 9.6) and equal at 17, but a wide vocabulary's head at 8 rows is bound by those chains, so
# the products there stay MKL's
WIDE_ROWS = 4
WIDE_OPTIONS = {"cpu_max_other_dimension_decomposition": 1 << 30}
# Inductor reads the decomposition's thresholds from its config once, when it imports the pass: they are set on the
# pass's module for the length of a compilation (`_decomposition`), one compilation at a time in this process
_DECOMPOSING = threading.Lock()
# Compiling ahead (`StepCompiler.ahead`): a step's compilation is one core's work (Inductor's Python, then g++ on its
# C++), so a warm-up that compiled its steps one after another left the other cores idle. Inside `ahead`, each step
# recorded is sent to one of a few worker processes (one per core, started as the block begins, each compiling its
# steps in turn), which writes it to Inductor's on-disk cache; the warm-up goes on with the step run op by op, and
# loads every step from the cache when the block ends (about 0.5 s each), then measures its calibration on them.
# Cold `transform(compile=True)` of the embedded 3M target (empty caches, 2-core CPU, 5 steps): 83-99 s against 144 s
# one after another; the embedded Bamba 83 s; from a full cache 5.8 s, no worker started. The worker gets the
# recorded graph node for node with its shapes (`graph_data`), and points its products at the CPU kernel itself
# (`compile_step`): a verify step is handed over as it is recorded, not after the kernel's build (on 2 cores the
# workers were the bottleneck either way: 92-98 s against 94-99). What the first warm-up measured or captured on the
# model (`_MEASURED` in ssmspec.transform) is made anew by the second: measured on steps run op by op, it priced the
# default call's drafts wrong (0.74x compiled plain decoding, against 0.92-0.97x). On a 2-core Xeon (AVX-512, AMX),
# with Inductor's instruction-set check of one set instead of four (`isa_options`) and affine strides answered
# directly (`_affine_strides`), cold runs alternated with the code before them: 123-133 s against 149 s; from a full
# cache 9.2-9.3 s against 9.3-9.5
# A step whose tensors (the model's weights it reads, its static inputs) exceed AHEAD_MAX_BYTES compiles in process:
# a worker is handed a copy of them on disk
AHEAD_MAX_BYTES = 1 << 30
# at most this many workers (each a process with torch imported, about 0.5 GB), started at the first step handed to
# them; a step a worker compiled before, for this torch, graph, inputs' layouts, settings and constants' values (a
# marker in Inductor's cache directory), is loaded from the cache at once instead: a warm-up from a full cache starts
# no worker
AHEAD_WORKERS = 4


# Inductor's C++ code generation asks, for every index expression of every loop it vectorizes, its stride along the
# vectorized variable (`stride_at_vec_range`), and answers with sympy's general `simplify`: on a verify step of the
# embedded target (1,284 ops) about 5,800 such questions took 6 s of its 41 s compilation, nearly all of them about
# affine indices (`x0 + 256*x1 + 4096`), whose stride is the variable's coefficient. `_affine_strides` answers those
# directly and hands every other index (floor divisions, moduli, products of variables) to Inductor's own; the
# generated code is the same byte for byte (tests/test_compiled_steps.py)


def _stride_at_vec_range(original: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's `stride_at_vec_range` with affine indices answered directly (see above)."""
    import sympy

    def stride(index: Any, var: Any, vec_length: int | None = None) -> Any:
        if not isinstance(index, sympy.Expr):
            return original(index, var, vec_length)
        coefficient = 0
        for term in index.args if index.is_Add else (index,):
            if not term.has(var):
                continue  # (the same before and after a step of var: it cancels in the stride)
            if term == var:
                coefficient += 1
            elif term.is_Mul and len(term.args) == 2 and term.args[0].is_Integer and term.args[1] == var:
                coefficient += int(term.args[0])
            else:
                return original(index, var, vec_length)
        return sympy.Integer(coefficient)

    stride.ssmspec_original = original
    return stride


@contextlib.contextmanager
def _affine_strides() -> Iterator[None]:
    """`_stride_at_vec_range` in Inductor's C++ code generation while a step compiles (torch internals: named here),
    under _DECOMPOSING (one compilation at a time in this process)."""
    from torch._inductor.codegen import cpp

    original = getattr(cpp, "stride_at_vec_range", None)
    if original is None or hasattr(original, "ssmspec_original"):
        yield
        return
    cpp.stride_at_vec_range = _stride_at_vec_range(original)
    try:
        yield
    finally:
        cpp.stride_at_vec_range = original


def isa_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with `cpp.vec_isa_ok` where this CPU's vector instruction set was checked alone and is the one
    Inductor picks (ssmspec.kernels.cpu_linear.vector_isa): the same settings in every process of this machine, so
    that a worker's compilation and this process's load share a cache key, and no process builds Inductor's check of
    every other set. On the 2-core CPU, cold `transform(compile=True)` of the embedded target spent 20 s in those
    checks (4 builds), in the process recording the steps while the workers waited on them."""
    if "cpp.vec_isa_ok" in options or not cpu_linear.vector_isa()[1]:
        return options
    return {**options, "cpp.vec_isa_ok": True}


@contextlib.contextmanager
def _isa_list_kept(options: dict[str, Any]) -> Iterator[None]:
    """A compilation with `cpp.vec_isa_ok` (`isa_options`) leaves Inductor's cached list of valid instruction sets as
    it found it (torch internals: named here): one made under the setting, unchecked, is dropped, so that another
    compilation in this process without it checks them as it would have."""
    from torch._inductor import cpu_vec_isa

    cached = cpu_vec_isa.valid_vec_isa_list
    empty = options.get("cpp.vec_isa_ok") and hasattr(cached, "cache_info") and cached.cache_info().currsize == 0
    try:
        yield
    finally:
        if empty:
            cached.cache_clear()


def _decompose_pass() -> Any:
    """Inductor's decompose_mm_pass module, whose thresholds a compilation sets and whose defaults `options_for` reads
    (torch internals: named here)."""
    from torch._inductor.fx_passes import decompose_mem_bound_mm

    return decompose_mem_bound_mm


@contextlib.contextmanager
def _decomposition(options: dict[str, Any]) -> Iterator[None]:
    """The decompose_mm_pass thresholds of `options` in force while Inductor compiles (and `_affine_strides`)."""
    module = _decompose_pass()
    settings = options.get("post_grad_fusion_options", {}).get("decompose_mm_pass") or {}
    with _DECOMPOSING, _affine_strides():
        saved = {name: getattr(module, name) for name in settings if hasattr(module, name)}
        for name in saved:
            setattr(module, name, settings[name])
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(module, name, value)


class StepCompiler:
    """Compiles the steps `StepGraph` records for one model (ssmspec.compile.graphs.StepCompiler).

    Args:
        model: the model whose steps are compiled (its parameters and buffers become the graphs' constants).
        options: Inductor config settings on top of OPTIONS.
        progress: show a progress line while a step compiles (a first use of a batch size or tree size that the
            warm-up did not cover takes seconds, tens of seconds where Inductor's cache does not have it).
        inductor: False runs each recorded graph as it is, op by op from Python (the same graphs, inputs and
            outputs without Inductor's code generation: tests of the recording on every family, in seconds).
        kernels: float32 products of 2 to SMALL_MATMUL_ROWS rows call ssmspec's CPU kernel
            (ssmspec.kernels.cpu_linear) where it could be built; False: Inductor's loops.
    """

    def __init__(
        self, model: nn.Module, options: dict[str, Any] | None = None, progress: bool = True, inductor: bool = True,
        kernels: bool = True,
    ) -> None:  # fmt: skip
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        self.constants = {id(t): ("c_" + name.replace(".", "__"), t) for name, t in reversed(named)}
        self.options = {**OPTIONS, **(options or {})}
        self.progress = progress
        self.inductor = inductor
        self.kernels = kernels
        self._compiled: dict[tuple, Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self.compilations = 0  # graphs compiled (not found among the model's)
        self.compile_seconds = 0.0
        self.fallbacks = 0  # graphs Inductor failed on, run op by op from Python instead
        # id(module) -> (the module, held: its id stays its own; the prefix its constants are named with): `adopt`
        self._adopted: dict[int, tuple[nn.Module, str]] = {}
        self.handed_ahead = 0  # graphs handed to worker processes (`ahead`)
        self.compiled_ahead = 0  # of those, graphs a worker compiled and this process loaded from the cache
        self._ahead: list[_Pending] | None = None  # inside `ahead`: the steps handed to workers
        self._ahead_dir = ""
        self._pool: list[_Worker] = []
        self._workers = 0
        if inductor and kernels:
            cpu_linear.prepare()  # (built while the first steps compile: a plain step has no product it takes)

    def adopt(self, module: nn.Module) -> None:
        """Make `module`'s parameters and buffers constants of the graphs compiled from now on, as the model's are (a
        draft head that a greedy step drafts with in its own graph): read where they live rather than inputs of the
        step. Named by the order modules were adopted in (the same names in every process: Inductor's cache keys on
        the graph's code)."""
        with self._lock:
            if id(module) in self._adopted:
                return
            prefix = f"c_adopted{len(self._adopted)}__"
            self._adopted[id(module)] = (module, prefix)
            named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
            for name, t in reversed(named):
                self.constants.setdefault(id(t), (prefix + name.replace(".", "__"), t))

    def __call__(self, gm: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        """The compiled function of a recorded step (compiled once per graph and input layout)."""
        unroll_depthwise_convs(gm)
        small_bmms_as_sums(gm, FUSED_BMM_INNER, FUSED_BMM_OUTPUTS)
        short_cumsums_unrolled(gm, UNROLLED_CUMSUM)
        # (a large weight's products are left to `compile_step`, which points them at the kernel or splits them; a
        # graph run op by op, never compiled, is split here whole)
        split_product_rows(gm, SPLIT_ROWS, below=KERNEL_WEIGHTS if self.kernels and self.inductor else None)
        options = self.options_for(gm)
        key = (gm.code, tuple((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) for t in inputs))
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None and self._ahead is not None and _fits_a_worker(gm, inputs):
                marker = _marker(gm, inputs, options, self.kernels)
                if not marker.exists():  # (else in the cache already: loaded at once)
                    compiled = self._compiled[key] = self._submit(key, gm, inputs, options, marker)
            if compiled is None:
                compiled = self._compiled[key] = self._compile(gm, inputs, options)
        return compiled

    @contextlib.contextmanager
    def ahead(self, workers: int | None = None) -> Iterator[None]:
        """Compile the steps recorded inside the block side by side in worker processes (`workers` of them, default
        one per core, started as the block begins), running each step op by op meanwhile; when the block ends, wait
        for them and load each compiled step from Inductor's on-disk cache (a warm-up that records every step first:
        the module's notes on compiling ahead). With one core, without Inductor or its on-disk cache, the block
        compiles as outside it. A step whose worker failed is compiled by this process, as outside the block."""
        workers = min(_cores(), AHEAD_WORKERS) if workers is None else workers
        if not self.inductor or workers < 2 or self._ahead is not None or not _disk_cache():
            yield
            return
        folder = tempfile.mkdtemp(prefix="ssmspec-steps-")
        self._ahead, self._ahead_dir, self._workers = [], folder, workers
        try:
            yield
            pending, self._ahead = self._ahead, None
            self._finish(pending)
        finally:
            self._ahead = None
            for worker in self._pool:
                worker.close()
            self._pool = []
            with self._lock:  # (a block that failed: its steps not loaded are compiled anew when recorded again)
                for key in [k for k, f in self._compiled.items() if isinstance(f, _Pending) and f.compiled is None]:
                    del self._compiled[key]
            shutil.rmtree(folder, ignore_errors=True)

    def _submit(
        self, key: tuple, gm: fx.GraphModule, inputs: list[torch.Tensor], options: dict[str, Any], marker: Path
    ) -> Callable[..., Any]:  # fmt: skip
        """Hand a recorded step to the worker with the fewest steps in hand; it runs op by op until `_finish` loads
        it."""
        assert self._ahead is not None
        pending = _Pending(key, gm, inputs, options, Path(self._ahead_dir) / f"step{len(self._ahead)}.pt")
        pending.marker = marker
        try:
            torch.save({"graph": graph_data(gm), "inputs": inputs, "options": options, "kernels": self.kernels},
                       pending.job)  # fmt: skip
        except Exception:  # noqa: BLE001 - an argument the job file cannot hold: compiled here, as outside `ahead`
            return self._compile(gm, inputs, options)
        if not self._pool:
            self._pool = [_Worker(Path(self._ahead_dir) / f"worker{i}.log") for i in range(self._workers)]
        min(self._pool, key=lambda w: w.in_hand()).send(pending)
        self._ahead.append(pending)
        self.handed_ahead += 1
        return pending

    def _finish(self, pending: list[_Pending]) -> None:
        """Wait for the workers, loading each step as its worker is done with it (compiling it here where the worker
        failed, or where its result is not in the cache)."""
        from torch._dynamo.utils import counters

        bar = tqdm(total=len(pending), desc=f"ssmspec: compiling {len(pending)} steps, {len(self._pool)} at a time",
                   disable=not self.progress or not pending)  # fmt: skip
        waiting = list(pending)
        try:
            while waiting:
                done = [p for p in waiting if p.done.wait(0.02 if p is waiting[0] else 0)]
                if not done:  # (a worker gone while another process holds its pipes: its steps given back)
                    for worker in self._pool:
                        worker.check_exited()
                for p in done:
                    waiting.remove(p)
                    hits = counters["inductor"]["fxgraph_cache_hit"]
                    with self._lock:
                        p.compiled = self._compiled[p.key] = self._compile(p.gm, p.inputs, p.options)
                    if p.ok and counters["inductor"]["fxgraph_cache_hit"] > hits:
                        self.compiled_ahead += 1
                        with contextlib.suppress(OSError):
                            p.marker.parent.mkdir(parents=True, exist_ok=True)
                            p.marker.touch()
                    p.gm, p.inputs = None, []  # (what it ran op by op: the compiled step holds what it needs)
                    bar.update()
        finally:
            bar.close()

    def options_for(self, gm: fx.GraphModule) -> dict[str, Any]:
        """The Inductor settings `gm` compiles with: `options` (with `isa_options`), and in a step whose matrix
        products have at most WIDE_ROWS rows (their shapes as recorded), one of them wider than Inductor computes in
        its loops, every product as Inductor's loops (WIDE_OPTIONS)."""
        options = isa_options(self.options) if self.inductor else self.options
        shapes = matmul_shapes(gm)
        settings = options.get("post_grad_fusion_options", {}).get("decompose_mm_pass")
        if settings is None or not shapes or max(rows for rows, _ in shapes) > WIDE_ROWS:
            return options
        default = _decompose_pass().CPU_MAX_OTHER_DIMENSION_DECOMPOSITION
        limit = settings.get("cpu_max_other_dimension_decomposition", default)
        if all(width <= limit for _, width in shapes):
            return options
        fusion = dict(options["post_grad_fusion_options"])
        fusion["decompose_mm_pass"] = {**WIDE_OPTIONS, **settings}
        return {**options, "post_grad_fusion_options": fusion}

    def _compile(self, gm: fx.GraphModule, inputs: list[torch.Tensor], options: dict[str, Any]) -> Callable[..., Any]:
        if not self.inductor:
            self.compilations += 1
            return gm
        start = time.perf_counter()
        bar = tqdm(total=1, desc=f"ssmspec: compiling a step ({len(gm.graph.nodes)} ops)", disable=not self.progress,
                   leave=False)  # fmt: skip
        try:
            compiled = compile_step(gm, inputs, options, kernels=self.kernels)
        except Exception as e:  # noqa: BLE001 - any compiler failure: the graph still runs, op by op
            warnings.warn(
                f"ssmspec: Inductor failed on a captured step ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "running it op by op",
                RuntimeWarning,
                stacklevel=3,
            )
            self.fallbacks += 1
            compiled = gm
        finally:
            bar.close()
        self.compilations += 1
        self.compile_seconds += time.perf_counter() - start
        return compiled


def compile_step(
    gm: fx.GraphModule, inputs: list[torch.Tensor], options: dict[str, Any], kernels: bool = True
) -> Callable[..., Any]:  # fmt: skip
    """Inductor's compiled function of a recorded step (torch internals: named here), with `options` and ssmspec's
    wrapper rewrite, in this process or a worker's (ssmspec.compile.worker): the same graph, inputs and options give
    the same key in Inductor's on-disk cache. With `kernels`, its float32 products of 2 to SMALL_MATMUL_ROWS rows (of 1
    row up with a weight of KERNEL_WEIGHTS elements or more) call ssmspec's CPU kernel where it could be built (`gm`
    rewritten in place; where it could not, those of large weights are split: SPLIT_ROWS): decided here, so that
    recording a step never waits for the kernel's build (a warm-up records its verify steps while the kernel builds,
    and hands them to workers at once)."""
    on_cpu = all(t.device.type == "cpu" for t in inputs)
    if kernels and on_cpu and rows_linears(gm, SMALL_MATMUL_ROWS, rewrite=False, large=KERNEL_WEIGHTS):
        if cpu_linear.available():  # (a step without such products does not wait for the kernel's build)
            rows_linears(gm, SMALL_MATMUL_ROWS, large=KERNEL_WEIGHTS)
    split_product_rows(gm, SPLIT_ROWS)  # (what the kernel did not take: large weights' products where it is not built)
    for node in gm.graph.nodes:  # (the recorder's shapes, for the passes; Inductor traces its own)
        node.meta.pop("val", None)
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # a tracing context with a shape environment, as Dynamo gives Inductor: its FX graph cache keys on it (and its
    # wrapper's intermediate buffers as raw pointers: ssmspec.compile.wrapper)
    with (tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))), torch.no_grad(), _decomposition(options),
          wrapper.rewriting(), _isa_list_kept(options)):  # fmt: skip
        return compile_fx(gm, inputs, config_patches=dict(options))


def graph_data(gm: fx.GraphModule) -> dict[str, Any]:
    """A recorded step's graph as plain data for `torch.save` (a worker's job): its nodes, with ops named and their
    recorded shapes (meta tensors: the worker's passes read them), and the constants it reads. (Pickling the
    GraphModule itself re-traces its code when loaded, which folds the ops that read no input, an index built from
    `arange` among them, into constants: another graph, another key in Inductor's cache than the recording
    process's.)"""
    nodes = []
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            target = _Op(target._schema.name, target._overloadname)
        args, kwargs = (fx.node.map_aggregate(a, _packed_value) for a in (node.args, node.kwargs))
        nodes.append((node.op, node.name, target, args, kwargs, node.meta.get("val")))  # (shapes: meta tensors)
    return {"nodes": nodes, "constants": _constants(gm)}


def graph_from_data(state: dict[str, Any]) -> fx.GraphModule:
    """The graph `graph_data` describes, node for node."""
    graph, made = fx.Graph(), {}
    for op, name, target, args, kwargs, val in state["nodes"]:
        if isinstance(target, _Op):
            namespace, op_name = target.name.split("::")
            target = getattr(getattr(getattr(torch.ops, namespace), op_name), target.overload or "default")
        args, kwargs = (fx.node.map_aggregate(a, lambda v: _unpacked_value(v, made)) for a in (args, kwargs))
        made[name] = graph.create_node(op, target, args, kwargs, name=name)
        if val is not None:
            made[name].meta["val"] = val
    root = nn.Module()
    for name, t in state["constants"].items():
        root.register_buffer(name, t, persistent=False)
    return fx.GraphModule(root, graph)


def _constants(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The constants a recorded step reads (its `get_attr` nodes' tensors: the model's weights), by name."""
    return {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}


def _packed_value(value: Any) -> Any:
    """A node's argument as `graph_data` keeps it: a node by name, a memory format or layout by its name in torch
    (torch.save does not pickle them)."""
    if isinstance(value, fx.Node):
        return _Ref(value.name)
    if isinstance(value, torch.memory_format | torch.layout):
        return _TorchName(str(value).removeprefix("torch."))
    return value


def _unpacked_value(value: Any, made: dict[str, fx.Node]) -> Any:
    if isinstance(value, _Ref):
        return made[value.name]
    if isinstance(value, _TorchName):
        return getattr(torch, value.name)
    return value


@dataclasses.dataclass(frozen=True)
class _TorchName:
    """A memory format or layout by name (`graph_data`)."""

    name: str


@dataclasses.dataclass(frozen=True)
class _Op:
    """An op overload by name (`graph_data`): the op objects themselves do not pickle."""

    name: str
    overload: str


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A node's use of an earlier node (`graph_data`)."""

    name: str


class _Pending:
    """A step a worker process compiles (`StepCompiler.ahead`): called, it runs the recorded graph op by op until its
    compiled function is loaded, then that."""

    def __init__(
        self, key: tuple, gm: fx.GraphModule, inputs: list[torch.Tensor], options: dict[str, Any], job: Path
    ) -> None:  # fmt: skip
        self.key, self.gm, self.inputs, self.options, self.job = key, gm, inputs, options, job
        self.compiled: Callable[..., Any] | None = None
        self.marker: Path | None = None  # marked once compiled by a worker (`_marker`)
        self.done = threading.Event()  # the worker is done with it
        self.ok = False  # ... and compiled it

    def __call__(self, *args: torch.Tensor) -> Any:
        return (self.compiled if self.compiled is not None else self.gm)(*args)


# seconds a worker process may have exited before the steps it still holds are taken back (its answers were read)
EXITED_GRACE = 2.0


class _Worker:
    """A worker process (ssmspec.compile.worker) with this process's threads, Inductor cache and ssmspec: it is sent
    job files one line each and answers a line for each, read by a thread that marks the step done."""

    def __init__(self, log: Path) -> None:
        with open(log, "wb") as out:
            self.process = subprocess.Popen(_worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=out, env=_worker_env(), text=True)  # fmt: skip
        self.sent: dict[str, _Pending] = {}
        self.ended = False  # the process's output has ended: nothing sent from now on is answered
        self.exited = 0.0  # when the process was first found to have exited (`check_exited`)
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="ssmspec-step-worker", daemon=True).start()

    def in_hand(self) -> int:
        """The steps sent and not done."""
        with self._lock:
            return len(self.sent)

    def send(self, pending: _Pending) -> None:
        """Send a step's job; a worker that has ended leaves it done, not compiled (also where its output ended before
        this call: a write into its input need not fail then, and its reader will not answer)."""
        with self._lock:
            if self.ended:
                pending.done.set()
                return
            self.sent[str(pending.job)] = pending
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(f"{pending.job}\n")
            self.process.stdin.flush()
        except OSError:
            self._end()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            status, _, job = line.rstrip("\n").partition(" ")
            with self._lock:
                pending = self.sent.pop(job, None)
            if pending is not None:
                pending.ok = status == "ok"
                pending.done.set()
        self._end()

    def _end(self) -> None:
        """The process ended: every step in hand is done, not compiled."""
        with self._lock:
            left, self.sent, self.ended = list(self.sent.values()), {}, True
        for pending in left:
            pending.done.set()

    def check_exited(self) -> None:
        """Where the process exited EXITED_GRACE seconds ago and its output has not ended (another process may hold
        its pipe), every step still in hand is done, not compiled: a warm-up never waits for a worker that is gone."""
        if self.ended or self.process.poll() is None:
            return
        now = time.monotonic()
        self.exited = self.exited or now
        if now - self.exited >= EXITED_GRACE:
            self._end()

    def close(self) -> None:
        """End the process: at once where it still has steps in hand (a block that failed), else once it reads the
        end of its input."""
        if self.in_hand():
            self.process.kill()
        elif self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _disk_cache() -> bool:
    """Whether Inductor keeps compiled graphs in its on-disk cache, where a worker's compilation reaches this process
    (torch internals: named here)."""
    from torch._inductor import config

    return bool(config.fx_graph_cache) and not bool(getattr(config, "force_disable_caches", False))


def _worker_command() -> list[str]:
    """The command that starts a worker process: this Python, with this process's threads."""
    return [sys.executable, "-m", "ssmspec.compile.worker", "--threads", str(torch.get_num_threads())]


def _worker_env() -> dict[str, str]:
    """A worker's environment: this process's, with its Inductor cache directory and this ssmspec on the path."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir())
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else root
    return env


def _marker(gm: fx.GraphModule, inputs: list[torch.Tensor], options: dict[str, Any], kernels: bool) -> Path:
    """Where a worker's compilation of this step is marked as in Inductor's cache (AHEAD_WORKERS): keyed by torch's
    version, the graph's code, its inputs' layouts, the settings (`kernels`: compile_step's) and the constants'
    values."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    digest = hashlib.sha256(f"{torch.__version__}\n{gm.code}\n{_settings_text(options)}\n{kernels}".encode())
    for t in inputs:
        digest.update(repr((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)).encode())
    for name, t in _constants(gm).items():
        t = t.detach()
        digest.update(repr((name, tuple(t.shape), t.dtype)).encode())
        digest.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return Path(cache_dir()) / "ssmspec" / "steps" / digest.hexdigest()


def _settings_text(value: Any) -> str:
    """Inductor settings as text that is the same in every process: a custom pass by its own `uuid()`."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_settings_text(v)}" for k, v in sorted(value.items(), key=str)) + "}"
    if hasattr(value, "uuid"):
        return f"{type(value).__qualname__}/{value.uuid()}"
    return repr(value)


def _fits_a_worker(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> bool:
    """Whether a step's tensors (the constants it reads, its inputs), all on the CPU, are at most AHEAD_MAX_BYTES:
    a worker gets a copy of them on disk."""
    tensors = [*_constants(gm).values(), *inputs]
    if any(t.device.type != "cpu" for t in tensors):
        return False
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) <= AHEAD_MAX_BYTES


def matmul_shapes(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """(rows, widest other dimension) of each matrix product (`mm`, `addmm`) in a recorded graph, from the shapes the
    recorder left on its nodes (products whose shapes it does not know are left out)."""
    shapes = []
    for node in gm.graph.nodes:
        operands = matmul_operands(node)
        if operands is None:
            continue
        _, left, right = operands
        values = [arg.meta.get("val") if isinstance(arg, fx.Node) else None for arg in (left, right)]
        if all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in values):
            shapes.append((int(values[0].shape[0]), int(max(values[1].shape))))
    return shapes
