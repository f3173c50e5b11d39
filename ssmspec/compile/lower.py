"""Captured steps compiled whole on a CPU: the compiler a `StepGraph` hands the ATen graph it recorded.

On a GPU a captured step is a CUDA graph; on a CPU the same step (the same static tensors, the same contract) is
recorded once as an FX graph of its ATen ops (ssmspec.compile.graphs) and compiled here by Inductor with its C++
wrapper, after ssmspec's passes (depthwise convolutions unrolled so that Inductor fuses them; float32 matrix products
of 2 to SMALL_MATMUL_ROWS rows pointed at ssmspec's CPU kernel), with one-row products as Inductor's loops
(`OPTIONS`). A replay is then one call into the compiled code: no Python between the ops, no guards, no op dispatch
but the C++ dispatcher's call of that kernel. The model's parameters and buffers are the graph's constants, read where
they live on every call (a weight changed in place is seen).

Compiled graphs are kept per model, keyed by the graph's code and its inputs' layouts, so a step recorded again over
another call's buffers reuses its compilation; Inductor's on-disk cache (`TORCHINDUCTOR_CACHE_DIR`) serves the same
graphs to a new process in seconds instead of a compilation's tens of seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
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
# products stay Inductor's loops, fused with the work around them: through the kernel, compiled plain decoding on
# held-out code ran at 0.88x on the embedded Bamba (13 of 16 alternated rounds slower) and 1.01x on the target
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


def _decompose_pass() -> Any:
    """Inductor's decompose_mm_pass module, whose thresholds a compilation sets and whose defaults `options_for` reads
    (torch internals: named here)."""
    from torch._inductor.fx_passes import decompose_mem_bound_mm

    return decompose_mem_bound_mm


@contextlib.contextmanager
def _decomposition(options: dict[str, Any]) -> Iterator[None]:
    """The decompose_mm_pass thresholds of `options` in force while Inductor compiles."""
    module = _decompose_pass()
    settings = options.get("post_grad_fusion_options", {}).get("decompose_mm_pass") or {}
    with _DECOMPOSING:
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
        split_product_rows(gm, SPLIT_ROWS)
        options = self.options_for(gm)
        if (self.inductor and self.kernels and all(t.device.type == "cpu" for t in inputs)
                and rows_linears(gm, SMALL_MATMUL_ROWS, rewrite=False) and cpu_linear.available()):  # fmt: skip
            rows_linears(gm, SMALL_MATMUL_ROWS)  # (a step without such products does not wait for the kernel's build)
        for node in gm.graph.nodes:  # (the recorder's shapes, for the passes above; Inductor traces its own)
            node.meta.pop("val", None)
        key = (gm.code, tuple((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) for t in inputs))
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compiled[key] = self._compile(gm, inputs, options)
        return compiled

    def options_for(self, gm: fx.GraphModule) -> dict[str, Any]:
        """The Inductor settings `gm` compiles with: `options`, and in a step whose matrix products have at most
        WIDE_ROWS rows (their shapes as recorded), one of them wider than Inductor computes in its loops, every
        product as Inductor's loops (WIDE_OPTIONS)."""
        shapes = matmul_shapes(gm)
        settings = self.options.get("post_grad_fusion_options", {}).get("decompose_mm_pass")
        if settings is None or not shapes or max(rows for rows, _ in shapes) > WIDE_ROWS:
            return self.options
        default = _decompose_pass().CPU_MAX_OTHER_DIMENSION_DECOMPOSITION
        limit = settings.get("cpu_max_other_dimension_decomposition", default)
        if all(width <= limit for _, width in shapes):
            return self.options
        fusion = dict(self.options["post_grad_fusion_options"])
        fusion["decompose_mm_pass"] = {**WIDE_OPTIONS, **settings}
        return {**self.options, "post_grad_fusion_options": fusion}

    def _compile(self, gm: fx.GraphModule, inputs: list[torch.Tensor], options: dict[str, Any]) -> Callable[..., Any]:
        if not self.inductor:
            self.compilations += 1
            return gm
        from torch._guards import TracingContext, tracing
        from torch._inductor.compile_fx import compile_fx
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        start = time.perf_counter()
        bar = tqdm(total=1, desc=f"ssmspec: compiling a step ({len(gm.graph.nodes)} ops)", disable=not self.progress,
                   leave=False)  # fmt: skip
        try:
            # a tracing context with a shape environment, as Dynamo gives Inductor: its FX graph cache keys on it
            # (and its wrapper's intermediate buffers as raw pointers: ssmspec.compile.wrapper)
            with (tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))), torch.no_grad(),
                  _decomposition(options), wrapper.rewriting()):  # fmt: skip
                compiled = compile_fx(gm, inputs, config_patches=dict(options))
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
