# ruff: noqa: E501 - SOURCE is generated C++ as Inductor writes it, long lines included
"""The compiled step's C++ wrapper with its kernel-only buffers as raw pointers (ssmspec.compile.wrapper)."""

from __future__ import annotations

import torch

from ssmspec.compile import wrapper
from ssmspec.compile.graphs import StepGraph
from ssmspec.compile.lower import StepCompiler

# the shape of Inductor's C++ wrapper (torch 2.13): buffers carved out of pools, views of them, kernel calls, an
# external call, the releases at the end
SOURCE = """#include <torch/csrc/inductor/cpp_wrapper/cpu.h>
extern "C" void cpp_fused_0(float* out_ptr0, const float* in_ptr0);
void inductor_entry_impl() {
    AtenTensorHandle pool0_handle;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(1, int_array_0, int_array_1, cached_torch_dtype_uint8, cached_torch_device_type_cpu, 0, &pool0_handle));
    RAIIAtenTensorHandle pool0(pool0_handle);
    AtenTensorHandle pool1_handle;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(1, int_array_0, int_array_1, cached_torch_dtype_uint8, cached_torch_device_type_cpu, 0, &pool1_handle));
    RAIIAtenTensorHandle pool1(pool1_handle);
    AtenTensorHandle tmp_tensor_handle_0;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch__alloc_from_pool(pool0, 64L + 8L*s0, cached_torch_dtype_float32, 2, int_array_2, int_array_3, &tmp_tensor_handle_0));
    auto buf0 = RAIIAtenTensorHandle(tmp_tensor_handle_0);
    AtenTensorHandle tmp_tensor_handle_1;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch__alloc_from_pool(pool0, 128L, cached_torch_dtype_int64, 1, int_array_4, int_array_4, &tmp_tensor_handle_1));
    auto buf1 = RAIIAtenTensorHandle(tmp_tensor_handle_1);
    auto buf2 = wrap_with_raii_handle_if_needed(reinterpret_tensor_wrapper(buf0, 2, int_array_5, int_array_6, 16L));  // alias
    auto buf3 = wrap_with_raii_handle_if_needed(reinterpret_tensor_wrapper(buf1, 1, int_array_7, int_array_7, 2L));  // alias
    AtenTensorHandle tmp_tensor_handle_2;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch__alloc_from_pool(pool1, 0L, cached_torch_dtype_float32, 1, int_array_4, int_array_4, &tmp_tensor_handle_2));
    auto buf4 = RAIIAtenTensorHandle(tmp_tensor_handle_2);
    cpp_fused_0((float*)(buf0.data_ptr()), (const float*)(buf2.data_ptr()));
    cpp_fused_0((float*)(buf4.data_ptr()), (const float*)(buf3.data_ptr()));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_argmax(buf1, 0, 0, &buf5_handle));
    pool1.reset();
    cpp_fused_0((float*)(buf4.data_ptr()), (const float*)(buf0.data_ptr()));
    pool0.reset(); buf0.reset(); buf1.reset(); buf2.reset(); buf3.reset(); buf4.reset();
}
"""


def test_buffers_only_kernels_use_become_pointers_into_their_pools():
    """buf0 (used by kernels and by its view buf2, itself kernels only) and buf2 (16 float32s in) become pointers;
    buf1 is an external call's argument and keeps its handle, and its view buf3, used by kernels only, points into
    its data; buf4's pool is released before its last use, so it keeps its handle."""
    out = wrapper.raw_buffers(SOURCE)
    assert wrapper.RAW_BUFFER in out and out.index(wrapper.RAW_BUFFER) < out.index("extern")
    assert "SsmspecRawBuffer buf0{static_cast<char*>(pool0.data_ptr()) + (64L + 8L*s0)};" in out
    assert "SsmspecRawBuffer buf2{static_cast<char*>(buf0.data_ptr()) + 64};" in out
    assert "SsmspecRawBuffer buf3{static_cast<char*>(buf1.data_ptr()) + 16};" in out
    assert "auto buf1 = RAIIAtenTensorHandle(tmp_tensor_handle_1);" in out
    assert "auto buf4 = RAIIAtenTensorHandle(tmp_tensor_handle_2);" in out
    assert "tmp_tensor_handle_0" not in out  # (the rewritten buffer's handle declaration and allocation: gone)
    # every other line is as it was
    assert [
        line
        for line in SOURCE.split("\n")
        if "buf0" not in line and "buf2" not in line and "buf3" not in line and "tmp_tensor_handle_0" not in line
    ] == [  # fmt: skip
        line
        for line in out.split("\n")
        if line != wrapper.RAW_BUFFER and "buf0" not in line and "buf2" not in line and "buf3" not in line
    ]
    # a source without such buffers is left as it is
    plain = "void f() {\n    cpp_fused_0((float*)(arg0_1.data_ptr()));\n}\n"
    assert wrapper.raw_buffers(plain) == plain


def test_a_compiled_steps_wrapper_is_rewritten_and_keeps_its_values(monkeypatch):
    """End to end: Inductor compiles a recorded step with its wrapper through `raw_buffers` (some buffers rewritten),
    and the compiled step computes what the eager step does."""
    seen = []
    original = wrapper.raw_buffers

    def spy(code: str) -> str:
        out = original(code)
        seen.append(out)
        return out

    monkeypatch.setattr(wrapper, "raw_buffers", spy)
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24)
    x = torch.randn(1, 40)

    def step():
        h = torch.relu(lin(x))
        return (h * h.sum()).softmax(-1), h.argmax(-1)

    compiler = StepCompiler(lin, progress=False, options={"fx_graph_cache": False})
    graph = StepGraph(torch.device("cpu"), compiler=compiler)
    with torch.no_grad():
        out = graph.capture(step)
        x.copy_(torch.randn(1, 40))
        graph.replay()
        want = step()
    assert compiler.fallbacks == 0 and seen and "SsmspecRawBuffer buf" in seen[-1]
    torch.testing.assert_close(out[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1], want[1])
