"""The C++ wrapper of a step compiled on a CPU, with its intermediate buffers as raw pointers.

Inductor's C++ wrapper makes a tensor handle for every intermediate buffer of a step (`aoti_torch__alloc_from_pool`,
a view carved out of a pooled allocation, and `reinterpret_tensor_wrapper` for a view of one), although most of them
are only ever handed to Inductor's own kernels as pointers. Each handle is a tensor made and freed per call: on the
embedded 3M target (2-core CPU) a plain step's wrapper took 72 us of its 248 (83 handles, one kernel), on the 19.6M
Nemotron-H 209 us of 2.2 ms (126). `raw_buffers` rewrites the wrapper's source so that a buffer whose every use is a
kernel's pointer (`buf.data_ptr()`) or its release (`buf.reset()`) is a pointer into its pool instead; any other use
(an external kernel's argument, a step's output, a view taken for one) keeps the handle. The pools outlive every
buffer carved from them (checked: a pool released before a buffer's last use keeps that buffer a handle).

`rewriting()` installs it for the compilations run inside it (Inductor picks its wrapper class per device from a
registry: torch internals, named here), and `CACHE_KEY` goes into their Inductor settings: a wrapper rewritten (or
not) is cached under its own key in Inductor's on-disk cache.

On the embedded 3M target (2-core CPU, 11 held-out prompts, 128 new tokens, alternated in one process) compiled plain
decoding ran 1.04x and 1.06x as fast with the rewritten wrappers in two runs (faster on 9 and 11 of the 11 prompts;
whole calls, eager prefill included), the default call 1.03x and 1.05x.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator
from typing import Any

from torch._inductor.custom_graph_pass import CustomGraphPass

# the struct a raw buffer is: what the wrapper asks of a buffer handed only to kernels
RAW_BUFFER = "struct SsmspecRawBuffer { void* p; void* data_ptr() const { return p; } void reset() { p = nullptr; } };"
ELEMENT_BYTES = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1,
}  # fmt: skip
_ALLOC = re.compile(
    r"^\s*AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch__alloc_from_pool\((?P<pool>\w+), (?P<offset>.+), "
    r"cached_torch_dtype_(?P<dtype>\w+), \d+, \w+, \w+, &(?P<tmp>tmp_tensor_handle_\d+)\)\);$"
)
_WRAP = re.compile(r"^\s*auto (?P<buf>buf\d+) = RAIIAtenTensorHandle\((?P<tmp>tmp_tensor_handle_\d+)\);$")
_VIEW = re.compile(
    r"^\s*auto (?P<buf>buf\d+) = wrap_with_raii_handle_if_needed\(reinterpret_tensor_wrapper\("
    r"(?P<base>buf\d+), \d+, \w+, \w+, (?P<offset>-?\d+)L?\)\);(?:\s*//.*)?$"
)
_NAME = re.compile(r"\b(buf\d+|pool\d+)\b")


def raw_buffers(code: str) -> str:
    """The wrapper's source with each buffer used only by kernels (and released) as a raw pointer into its pool (the
    module's docstring); the source as it was where nothing matches."""
    lines = code.split("\n")
    uses: dict[str, list[tuple[int, str]]] = {}  # name -> (line, how: "ptr", "reset", "other")
    for i, line in enumerate(lines):
        for m in _NAME.finditer(line):
            rest = line[m.end() :]
            how = "ptr" if rest.startswith(".data_ptr()") else "reset" if rest.startswith(".reset();") else "other"
            uses.setdefault(m.group(1), []).append((i, how))
    # candidates: buffer -> (line of its alloc, its handle's tmp name, pool, byte offset expression, dtype); and each
    # candidate's (and view's) line of declaration
    allocs, declared = {}, {}
    for i, line in enumerate(lines[:-1]):
        m, w = _ALLOC.match(line), _WRAP.match(lines[i + 1])
        if m and w and w.group("tmp") == m.group("tmp") and m.group("dtype") in ELEMENT_BYTES:
            allocs[w.group("buf")] = (i, m.group("tmp"), m.group("pool"), m.group("offset"), m.group("dtype"))
            declared[w.group("buf")] = i + 1
    views = {}
    for i, line in enumerate(lines):
        v = _VIEW.match(line)
        if v and v.group("base") in allocs:
            views[v.group("buf")] = (i, v.group("base"), int(v.group("offset")))
            declared[v.group("buf")] = i

    rewritten_views: set[int] = set()  # lines of views made raw: their base's use there becomes a pointer's

    def kernels_only(buf: str) -> bool:
        return all(i == declared[buf] or i in rewritten_views or how in ("ptr", "reset")
                   for i, how in uses.get(buf, []))  # fmt: skip

    def last_use(buf: str) -> int:
        return max((i for i, how in uses.get(buf, []) if how != "reset"), default=declared[buf])

    def pool_outlives(pool: str, last: int) -> bool:
        resets = [i for i, how in uses.get(pool, []) if how == "reset"]
        return bool(resets) and min(resets) > last

    raw = {}
    for buf, (i, base, offset) in views.items():  # (views first: a base used only by kernels and raw views is raw)
        _, _, pool, _, dtype = allocs[base]
        if not kernels_only(buf) or not pool_outlives(pool, last_use(buf)):
            continue
        # (the base's pointer: a handle's data or a raw buffer's, both valid here, and the same address)
        raw[buf] = (i, f"static_cast<char*>({base}.data_ptr()) + {offset * ELEMENT_BYTES[dtype]}")
        rewritten_views.add(i)
    for buf, (i, _, pool, offset, _) in allocs.items():
        if kernels_only(buf) and pool_outlives(pool, last_use(buf)):
            raw[buf] = (i, f"static_cast<char*>({pool}.data_ptr()) + ({offset})")
    if not raw:
        return code
    drop = set()
    for buf, (i, pointer) in raw.items():
        indent = re.match(r"\s*", lines[declared[buf]]).group(0)
        if buf in allocs:  # the alloc's two lines (the handle's declaration before them stays unused: dropped too)
            tmp = allocs[buf][1]
            if i > 0 and lines[i - 1].strip() == f"AtenTensorHandle {tmp};":
                drop.add(i - 1)
            drop.add(i)
        lines[declared[buf]] = f"{indent}SsmspecRawBuffer {buf}{{{pointer}}};"
    out = [line for i, line in enumerate(lines) if i not in drop]
    # the struct before the first function the wrapper defines (after its includes)
    first = next((i for i, line in enumerate(out) if line.startswith(("extern", "void", "namespace", "class"))), 0)
    out.insert(first, RAW_BUFFER)
    return "\n".join(out)


class _CacheKey(CustomGraphPass):
    """A post-grad pass that changes nothing: its uuid keys Inductor's cache on the wrapper's rewrite."""

    def __call__(self, graph: Any) -> None:
        return None

    def uuid(self) -> str:
        return "ssmspec.compile.wrapper.raw_buffers/1"


CACHE_KEY = _CacheKey()


@functools.cache
def _wrapper_class(base: type) -> type:
    """A subclass of Inductor's CPU C++ wrapper codegen whose generated wrapper goes through `raw_buffers` (made once
    per base class)."""

    class RawBufferWrapper(base):
        @staticmethod
        def create(*args: Any, **kwargs: Any) -> Any:
            # (Inductor's `create` makes its own class, whatever the registry holds: the instance's class swapped)
            made = base.create(*args, **kwargs)
            if type(made) is base:
                made.__class__ = RawBufferWrapper
            return made

        def generate(self, is_inference: bool) -> Any:
            result = super().generate(is_inference)
            if not (isinstance(result, tuple) and result and isinstance(getattr(result[0], "value", None), str)):
                return result  # (another Inductor: as it is)
            # (its line map, which only debugging reads, still points at the lines as generated)
            return (dataclasses.replace(result[0], value=raw_buffers(result[0].value)), *result[1:])

    return RawBufferWrapper


@contextlib.contextmanager
def rewriting() -> Iterator[None]:
    """Inductor's CPU C++ wrapper codegen replaced by `_wrapper_class`'s for the compilations run inside (callers
    hold the lock that runs one at a time: ssmspec.compile.lower)."""
    from torch._inductor.codegen.common import device_codegens, init_backend_registration

    init_backend_registration()
    entry = device_codegens.get("cpu")
    if entry is None or entry.cpp_wrapper_codegen is None:
        yield
        return
    saved = entry.cpp_wrapper_codegen
    entry.cpp_wrapper_codegen = _wrapper_class(saved)
    try:
        yield
    finally:
        entry.cpp_wrapper_codegen = saved
