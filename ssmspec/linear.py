"""Prepacked linears for CPU: every nn.Linear of a transformed model reads its weight once per call, whatever
the number of rows, while ssmspec drives the model.

Why: on a CPU a decode step and a verify step are bound by reading the weights. PyTorch's `F.linear` (MKL
sgemm) reads them at about half the speed for 2-16 rows than for one (a 32000 x 768 head: 8.5 ms for 1 row,
17-19 ms for 2-16 on the 2-core CI machine), so verifying two tokens cost 1.6x one. oneDNN's linear on a
weight packed once for a large batch (`_reorder_linear_weight(w, 128)`) costs 4-6 ms for 1-16 rows and
also gives every row the same result whatever the row count.

What: `install(model)` gives each plain `nn.Linear` the class `PackedLinear` (same parameters, same state
dict, same pickling). Its forward is `F.linear` unless the calling thread is inside `prepacked(True)`, which
ssmspec's runner enters around its own forwards (prefill, decode, verify): there, on a CPU tensor of a
dtype oneDNN packs (float32, bfloat16) and without autograd, it runs oneDNN on a packed copy of the weight
(made on first use, remade when the weight changes: its version, address, dtype or device). Plain forwards
and HF's own `generate` therefore stay bit-identical to HF's; float64 and CUDA always take `F.linear`.
The packed copy costs as much memory again as the linear weights (`transform(..., prepack=False)` opts out).

Compiled with the ssmspec backend, a CPU graph's float32 / bfloat16 linears call the op `ssmspec::packed_linear`
instead (ssmspec.compile.passes.prepack_linears): Inductor's own extern matmul is MKL's, with the same
row-count penalty. The packed copy lives on the weight tensor, where the graph finds it.

This is the one place coupled to torch internals for linears: `torch.ops.mkldnn._reorder_linear_weight` and
`torch.ops.mkldnn._linear_pointwise` (private ops that Inductor's own weight prepacking emits).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# the batch size the weights are packed for: oneDNN picks its blocked layout from it; with 32 or more the
# packed linear is as fast for 1 row as for 16, and gives each row the same bits whatever the row count (with
# a hint of 1, 2-16 rows cost 1.5x one row)
PACK_BATCH = 128
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN's call costs ~18 us where F.linear's costs ~7: small weights stay on F.linear. Measured on the 2-core CI
# machine (float32): packed wins from about 2 MiB of weight at one row, from about 0.75 MiB
# at 2+ rows (where MKL reads the weight at half speed)
PACK_MIN_BYTES = 2 << 20
PACK_MIN_BYTES_ROWS = 3 << 18
# oneDNN's packed linear reads a weight slower for 2 rows than for 3 (another kernel below 3 rows): on the 2-core
# CI machine, float32, weights too big for its caches, a 3072 x 768 weight 557 us for 2 rows, 434 for 3 (1 row
# 508), a 32000 x 768 head 8.1 ms / 5.9 ms (1 row 6.7); a 2-node verify on a random 24 x 768 Mamba2 40.6 ms
# unpadded, 35.4 padded to 3 rows (1 node 37.1 -> 36.0, 3 nodes 35.2). Fewer rows are padded with zero rows to
# this many (a row's result does not depend on the row count: the weight is packed for PACK_BATCH rows)
PAD_ROWS = 3


# torch's distributed tensor (a weight sharded by tensor parallelism), where this torch build has it
_DTensor = None
if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor as _DTensor


class _Active(threading.local):
    on: bool = False


_ACTIVE = _Active()


@functools.cache
def packed_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN packs on this CPU: float32; bfloat16 where the CPU has oneDNN's bf16 path (AVX-512 BW /
    VL / DQ or AVX-NE-CONVERT; without it packing a bf16 weight raises). A property of the hardware, read once."""
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported() if available() else False  # torch internals, named here
    return tuple(d for d in PACKED_DTYPES if d != torch.bfloat16 or bf16)


def available() -> bool:
    """Whether this torch has oneDNN's packed linear (a CPU build with mkldnn)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@contextlib.contextmanager
def prepacked(enabled: bool) -> Iterator[None]:
    """Run a block with this thread's PackedLinears on their packed weights (`enabled`) or on F.linear."""
    outer, _ACTIVE.on = _ACTIVE.on, bool(enabled)
    try:
        yield
    finally:
        _ACTIVE.on = outer


class _Packed:
    """A packed weight and what it was packed from, kept on the weight tensor itself (so that a compiled graph,
    which receives the parameter, finds it too); never copied or pickled (remade on use)."""

    __slots__ = ("key", "weight")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.weight: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> _Packed:
        return _Packed()

    def __reduce__(self):
        return (_Packed, ())


def packable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether oneDNN's packed linear takes these (CPU, float32 / bfloat16 throughout, no autograd) and pays off
    (a weight big enough for the row count: PACK_MIN_BYTES, PACK_MIN_BYTES_ROWS)."""
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype != weight.dtype:
        return False
    if _DTensor is not None and (isinstance(weight, _DTensor) or isinstance(x, _DTensor)):
        return False  # a tensor-parallel shard (transformers' tp_plan): its forward's collectives are F.linear's
    if weight.dtype not in packed_dtypes() or (bias is not None and bias.dtype != weight.dtype):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if weight.numel() * weight.element_size() < (PACK_MIN_BYTES if rows == 1 else PACK_MIN_BYTES_ROWS):
        return False
    return not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of `weight`, made on first use and remade when the weight changed (address, version)."""
    cache = weight.__dict__.get("_ssmspec_packed")
    if cache is None:
        cache = weight.__dict__["_ssmspec_packed"] = _Packed()
    key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
    if cache.key != key:
        with torch.no_grad():
            cache.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH)
        cache.key = key
    return cache.weight


def linear_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the packed weight where oneDNN takes the arguments, else F.linear."""
    if not packable(x, weight, bias):
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:  # moved or cast: the copy is stale
            weight.__dict__.pop("_ssmspec_packed", None)
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if rows >= PAD_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight(weight), bias, "none", [], "")
    padded = torch.cat([x.reshape(rows, x.shape[-1]), x.new_zeros(PAD_ROWS - rows, x.shape[-1])])
    out = torch.ops.mkldnn._linear_pointwise(padded, packed_weight(weight), bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


@torch.library.custom_op("ssmspec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear_packed` as an op a compiled graph calls (the ssmspec backend's `prepack_linears` pass): the graph
    receives the parameter itself, so its packed copy is made once and kept on it."""
    return linear_packed(x, weight, bias)


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class PackedLinear(nn.Linear):
    """nn.Linear whose forward runs oneDNN on a packed copy of its weight inside `prepacked(True)` (see the
    module docstring); otherwise exactly nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and _ACTIVE.on:
            return linear_packed(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def install(model: nn.Module) -> list[nn.Module]:
    """Give every plain nn.Linear of the model (not subclasses: quantized or hooked linears keep theirs) the
    class PackedLinear; returns the modules changed (for `uninstall`). No-op where oneDNN is missing."""
    if not available():
        return []
    changed = []
    for module in model.modules():
        if type(module) is nn.Linear and "forward" not in module.__dict__:
            module.__class__ = PackedLinear
            changed.append(module)
    return changed


def uninstall(modules: list[nn.Module]) -> None:
    """Give the modules back the class nn.Linear and drop their packed weights."""
    for module in modules:
        if type(module) is PackedLinear:
            module.__class__ = nn.Linear
            module.weight.__dict__.pop("_ssmspec_packed", None)


def packs(choice: dict[int, bool] | None, nodes: int, default: bool) -> bool:
    """Whether a forward of `nodes` tokens per row runs on the packed weights: the choice measured for the smallest
    measured size >= `nodes` (ssmspec.speculate.calibration.measure_cost times both per tree size, on the running model:
    which of oneDNN's packed weight and MKL's F.linear is faster depends on the CPU); `default` where none was (a
    prefill, or nothing measured yet)."""
    if choice:
        for n in sorted(choice):
            if nodes <= n:
                return choice[n]
    return default


def packs_any(model: nn.Module) -> bool:
    """Whether any PackedLinear of the model has a weight oneDNN would pack for several rows (PACK_MIN_BYTES_ROWS, a
    dtype it packs): else packed or not, its forwards are the same."""
    return any(
        type(m) is PackedLinear
        and m.weight.dtype in packed_dtypes()
        and m.weight.numel() * m.weight.element_size() >= PACK_MIN_BYTES_ROWS
        for m in model.modules()
    )


def is_packed(model: nn.Module) -> bool:
    """Whether any linear of the model has the class PackedLinear."""
    return any(type(m) is PackedLinear for m in model.modules())
