"""Matrix products of a few rows on a CPU: `ssmspec_cpu::rows_linear(x, weight, bias)`, a C++ kernel (cpu_linear.cpp)
that a captured CPU step calls for its linears of 2 or more rows, and of one row with a large weight
(ssmspec.compile.passes.rows_linears; ssmspec.compile.lower.KERNEL_WEIGHTS).

Inductor's loops sum each output of a product in one chain of dependent vector additions, a row at a time: they run
at the adder's latency, and a verify step of k nodes pays k passes over every weight. The kernel keeps 8 sums in flight,
uses each weight vector it loads for up to 2 rows, reduces its sums 4 at a time, and runs every row over a tile of the
weight while it is in the core's cache, so the weight is read from memory once whatever the rows. Each output is summed
in the same order whatever the number of rows: a token's products are the same bit for bit in verify steps of any size.
Its reference is `F.linear` (`reference`). On a 2-core AVX2 CPU (the embedded models' four weight shapes, one and two
threads, two runs), 8 and 16 rows took 5-41% less time than with one reduction per output and 4 sums in flight; 1 to 4
rows, bound by reading the weight, about the same (single runs from 20% less to 35% more).

The source is compiled once per machine, torch version and vector instruction set, with the compiler and flags
Inductor uses for its own C++ (the toolchain a compiled CPU step needs anyway), into Inductor's cache directory
(`TORCHINDUCTOR_CACHE_DIR`): about 13 s the first time, a file load afterwards. Where it cannot be built (no
compiler, no vector instruction set) `available()` is False and the steps keep Inductor's loops.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

OP = "ssmspec_cpu::rows_linear"
SOURCE = Path(__file__).with_name("cpu_linear.cpp")
_LOCK = threading.Lock()
# "available": the op is loaded (or could not be), once per process; "error": why not, until a caller has warned of it;
# "started": a background build was started (`prepare`)
_STATE: dict[str, Any] = {}


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes: `x @ weight.T + bias`."""
    return F.linear(x, weight, bias)


def available() -> bool:
    """Whether `torch.ops.ssmspec_cpu.rows_linear` is loaded in this process (built first where it is not yet, or
    once the build `prepare` started has finished)."""
    _load_once()
    with _LOCK:
        error = _STATE.pop("error", None)
    if error is not None:
        warnings.warn(f"ssmspec: the CPU product kernel could not be built ({error}); compiled steps keep "
                      "Inductor's loops for their products", RuntimeWarning, stacklevel=2)  # fmt: skip
    return _STATE["available"]


def prepare() -> None:
    """Start building and loading the kernel in a background thread, where it is not loaded yet: the compiler runs in
    its own process meanwhile, so a step compiled without the kernel (a plain step: no product of 2 rows or more)
    overlaps the build (about 13 s on a 2-core CPU). `available()` waits for it."""
    with _LOCK:
        if "available" in _STATE or "started" in _STATE:
            return
        _STATE["started"] = True
    threading.Thread(target=_load_once, name="ssmspec-cpu-linear-build", daemon=True).start()


def _load_once() -> None:
    """Build and load the op unless done (by this process, once: every caller after the first waits for it)."""
    with _LOCK:
        if "available" not in _STATE:
            _load()


def _load() -> None:
    """Build and load the op (under _LOCK); a failure is kept for the next `available()` to warn of."""
    try:
        torch.ops.load_library(str(_build()))
        torch.library.register_fake(OP)(_fake)
        _STATE["available"] = True
    except Exception as e:  # noqa: BLE001 - no compiler, no vector ISA, a failed build: Inductor's loops
        _STATE["available"] = False
        _STATE["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


_ISA_LOCK = threading.Lock()
_ISA: dict[str, Any] = {}  # "isa": Inductor's vector ISA for this process, "alone": whether it was checked alone


def vector_isa() -> tuple[Any, bool]:
    """Inductor's vector instruction set for this CPU's C++ code (its `pick_vec_isa`), and whether it was found by
    checking only itself (torch internals: named here).

    Inductor picks the first instruction set its list names that the CPU has and that passes its check (a test
    program built and loaded), but checks every one the CPU has first: on a cold cache four builds (AMX, AVX-512 VNNI,
    AVX-512, AVX2) of about 5 s each, in every process that compiles. Where nothing narrows the choice (no
    ATEN_CPU_CAPABILITY, `cpp.simdlen` or `cpp.vec_isa_ok`), the first one the CPU has is checked alone with
    Inductor's own check; if it passes it is the one Inductor would pick, and True says so: a compilation with
    `cpp.vec_isa_ok` then picks it without building the others (ssmspec.compile.lower.isa_options)."""
    with _ISA_LOCK:
        if "isa" not in _ISA:
            _ISA["isa"], _ISA["alone"] = _pick_isa()
        return _ISA["isa"], _ISA["alone"]


def _pick_isa() -> tuple[Any, bool]:
    import os
    import platform
    import sys

    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as vec

    narrowed = (os.environ.get("ATEN_CPU_CAPABILITY") or config.cpp.simdlen is not None
                or config.cpp.vec_isa_ok is not None or config.is_fbcode())  # fmt: skip
    if narrowed or platform.machine() not in ("x86_64", "AMD64") or sys.platform not in ("linux", "win32"):
        return vec.pick_vec_isa(), False
    has = vec.x86_isa_checker()
    candidates = [isa for isa in vec.supported_vec_isa_list if all(flag in has for flag in str(isa).split())]
    if candidates and candidates[0]:  # (Inductor's check of that one set, cached on it)
        return candidates[0], True
    return vec.pick_vec_isa(), False


def _fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _build() -> Path:
    """The compiled library, built where this machine's cache does not have it (torch internals: Inductor's vector
    ISA and C++ builder, named here)."""
    from filelock import FileLock
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    isa, _ = vector_isa()
    if not isa:
        raise RuntimeError("no vector instruction set Inductor supports on this CPU")
    source = SOURCE.read_text()
    key = hashlib.sha256(f"{source}|{torch.__version__}|{isa}|{isa.build_arch_flags()}".encode()).hexdigest()[:16]
    out = Path(cache_dir()) / "ssmspec" / f"cpu_linear_{key}"
    out.mkdir(parents=True, exist_ok=True)
    name = "ssmspec_cpu_linear"
    with FileLock(str(out / "build.lock")):
        options = CppTorchOptions(vec_isa=isa, include_pytorch=True)
        builder = CppBuilder(name=name, sources=[str(SOURCE)], BuildOption=options, output_dir=str(out))
        target = Path(builder.get_target_file_path())
        if not target.exists():
            builder.build()
        if not target.exists():
            raise RuntimeError(f"the build left no {target.name}")
    return target


__all__ = ["OP", "available", "prepare", "reference", "vector_isa"]
