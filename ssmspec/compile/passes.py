"""FX passes run by the `ssmspec` torch.compile backend on each Dynamo graph.

- `fold_conv_padding`: the conv seam returns [zeros | node outputs] because HF slices the last N columns;
  in a graph the cat + slice pair is dead work, so the slice's users read the tree op's output directly.
- `lower_tree_ops`: swap each reference tree op (torch.ops.ssmspec.*) for its Triton kernel
  (torch.ops.ssmspec_kernels.*, a triton_op Inductor sees), for the backend's `kernels=True` (on CPU that
  needs TRITON_INTERPRET=1). By default the reference ops stay in the graph and their CUDA implementation
  picks kernel or reference by measurement (ssmspec.kernels.select).
- `prepack_linears`: on a CPU, each float32 / bfloat16 linear becomes `ssmspec::packed_linear` (oneDNN on a weight
  packed once, ssmspec.linear): Inductor's extern matmul is MKL's sgemm, which reads the weight at half speed
  for 2-16 rows, so a compiled verify step would pay it again.
- `inline_tree_ops`: where the reference runs anyway (CPU, or the "reference" policy), replace each traceable
  tree op by its plain PyTorch function, so that Inductor traces through it and fuses its elementwise work
  with the mixer's ops around it instead of calling an opaque op (on a small model's CPU step the opaque
  ops cost as much as the projections).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

TREE_OP_NAMESPACE = "ssmspec"


def is_tree_op(node: fx.Node) -> bool:
    """A call of one of ssmspec's reference custom ops."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == TREE_OP_NAMESPACE
    )


def _shape(node: fx.Node) -> tuple | None:
    val = node.meta.get("example_value", node.meta.get("val"))
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _equals_minus(start, n) -> bool:
    """Whether a slice start (int, SymInt or graph node of one) is provably -n."""
    if isinstance(start, fx.Node):
        start = start.meta.get("example_value", start.meta.get("val"))
    if start is None:
        return False
    if isinstance(start, int) and isinstance(n, int):
        return start == -n
    try:
        return bool(statically_known_true(start == -n))
    except Exception:  # noqa: BLE001 - symbols from unrelated shape environments: not provable
        return False


def fold_conv_padding(gm: fx.GraphModule) -> int:
    """Replace `cat([zeros, conv_out], -1)[:, :, -M:]` by `conv_out`; returns the number of folds.

    The seam pads the N node outputs with the committed columns, and the mixer slices its own sequence
    length M, which is the number of tree nodes: M == N. Where the graph proves it (static or equal
    symbolic sizes) the slice disappears; where M is a different symbol (some mixers take it from another
    tensor's shape) the slice reads `conv_out[:, :, -M:]` instead, equal to the padded slice for M <= N.
    Either way the zeros and the cat are gone."""
    folded = 0
    conv = torch.ops.ssmspec.tree_causal_conv1d.default
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not conv:
            continue
        shape = _shape(node)
        if shape is None:
            continue
        n = shape[-1]  # an int, or a SymInt when the tree size is dynamic
        for cat in list(node.users):
            if cat.target is not torch.cat or cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0) not in (
                -1,
                2,
            ):
                continue
            parts = cat.args[0]
            if len(parts) != 2 or parts[1] is not node:
                continue
            for sl in list(cat.users):
                idx = sl.args[1] if sl.target is operator.getitem else None
                if not (isinstance(idx, tuple) and len(idx) == 3 and idx[:2] == (slice(None), slice(None))):
                    continue
                end = idx[2]
                if not (isinstance(end, slice) and end.stop is None and end.step is None):
                    continue
                if _equals_minus(end.start, n):
                    sl.replace_all_uses_with(node)
                    gm.graph.erase_node(sl)
                else:
                    sl.replace_input_with(cat, node)
                folded += 1
            if not cat.users:
                zeros = parts[0]
                gm.graph.erase_node(cat)
                if isinstance(zeros, fx.Node) and not zeros.users:
                    gm.graph.erase_node(zeros)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def prepack_linears(gm: fx.GraphModule) -> int:
    """Point every CPU float32 / bfloat16 `linear` call of the graph whose weight may pack (ssmspec.linear's size
    rule) at `ssmspec::packed_linear`; returns how many. The op packs each weight once (kept on the weight) and
    takes F.linear wherever oneDNN would not pay off (the row count is known when it runs)."""
    from ssmspec import linear as packed

    if not packed.available():
        return 0
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (torch._C._nn.linear, torch.nn.functional.linear):
            continue
        if node.kwargs or len(node.args) not in (2, 3):
            continue
        vals = [a.meta.get("example_value", a.meta.get("val")) if isinstance(a, fx.Node) else a for a in node.args]
        x, w = vals[0], vals[1]
        if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) or w.device.type != "cpu":
            continue
        if w.dtype not in packed.packed_dtypes() or x.dtype != w.dtype:
            continue
        if w.numel() * w.element_size() < min(packed.PACK_MIN_BYTES, packed.PACK_MIN_BYTES_ROWS):
            continue  # small: F.linear at every row count, left to Inductor
        node.target = torch.ops.ssmspec.packed_linear.default
        node.args = (*node.args, None) if len(node.args) == 2 else node.args
        count += 1
    if count:
        gm.recompile()
    return count


def unroll_depthwise_convs(gm: fx.GraphModule) -> int:
    """Rewrite each 1-D depthwise convolution of an ATen graph (`aten.convolution`, one input channel per group,
    stride and dilation 1: the short convs of Mamba, Mamba2, GDN and LFM2 mixers, HF's decode path included) as
    the sum of its K shifted, per-channel scaled input slices; returns how many. Inductor then fuses it with the
    elementwise work around it, where it would call oneDNN's convolution (on a small model's decode step a tenth
    of a millisecond a layer, more than the rest of the layer's elementwise work). Nodes need their value's
    shape in `meta["val"]` (a real, fake or meta tensor)."""
    aten = torch.ops.aten
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.convolution.default or len(node.args) != 9:
            continue
        x, w, b, stride, padding, dilation, transposed, _, groups = node.args
        xv, wv = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, w))
        if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)) or xv.dim() != 3 or wv.dim() != 3:
            continue
        channels, k = wv.shape[0], wv.shape[2]
        if transposed or wv.shape[1] != 1 or groups != channels or xv.shape[1] != channels:
            continue
        if list(stride) != [1] or list(dilation) != [1] or len(padding) != 1 or k > 16:
            continue
        length = xv.shape[2] + 2 * padding[0] - k + 1
        graph = gm.graph
        with graph.inserting_before(node):
            xp = graph.call_function(aten.constant_pad_nd.default, (x, [padding[0]] * 2, 0.0)) if padding[0] else x
            out = None
            for i in range(k):  # w[:, :, i] is [C, 1]: each channel's tap, broadcast over the positions
                window = graph.call_function(aten.slice.Tensor, (xp, 2, i, i + length))
                term = graph.call_function(aten.mul.Tensor, (window, graph.call_function(aten.select.int, (w, 2, i))))
                out = term if out is None else graph.call_function(aten.add.Tensor, (out, term))
            if b is not None:
                out = graph.call_function(
                    aten.add.Tensor, (out, graph.call_function(aten.view.default, (b, [channels, 1])))
                )
        out.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _input_tensors(node: fx.Node) -> list[torch.Tensor]:
    """The example (or fake) tensors a call takes, as Dynamo recorded them."""
    vals = [a.meta.get("example_value", a.meta.get("val")) for a in node.all_input_nodes]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def _float64(node: fx.Node) -> bool:
    """Whether the call takes float64 CUDA tensors (which the kernels leave to the reference)."""
    return any(v.dtype == torch.float64 and v.is_cuda for v in _input_tensors(node))


def lower_tree_ops(gm: fx.GraphModule) -> int:
    """Point every tree-op call at its Triton kernel (float64 calls on CUDA keep the reference: ssmspec.kernels
    routes them to the reference by design); returns the number of calls lowered."""
    from ssmspec.kernels import KERNELS

    lowered = 0
    for node in gm.graph.nodes:
        if is_tree_op(node) and node.target in KERNELS and not _float64(node):
            node.target = KERNELS[node.target]
            lowered += 1
    if lowered:
        gm.recompile()
    return lowered


def inline_tree_ops(gm: fx.GraphModule, *, on_cuda: bool) -> int:
    """Replace calls of traceable reference tree ops by their plain functions (the graph then holds the
    reference's own torch calls once traced); with `on_cuda` False, CUDA calls keep the op (their CUDA
    implementation chooses kernel or reference by measurement). Returns the number of calls inlined."""
    from ssmspec.ops import traceable_reference

    inlined = 0
    for node in gm.graph.nodes:
        if not is_tree_op(node) or (not on_cuda and any(v.is_cuda for v in _input_tensors(node))):
            continue
        fn = traceable_reference(node.target)
        if fn is not None:
            node.target = fn
            inlined += 1
    if inlined:
        gm.recompile()
    return inlined


# ---------------------------------------------------------------- a workaround for a torch bug
# torch 2.11's Inductor lowers a cumsum over a long axis (HF's Mamba2 chunked path: 256-token chunks) to a split
# scan whose Triton codegen fails in `get_block_shape` (InductorError: TypeError: list indices must be integers
# or slices, not NoneType), bf16 prefill and some float32 shapes. Inductor always splits scans it can
# (config.split_reductions does not apply to them), so the backend's retry hides each floating-point cumsum
# behind an opaque op: Inductor calls ATen's cumsum for it and compiles the rest of the graph as before.
@torch.library.custom_op("ssmspec_compat::cumsum", mutates_args=())
def opaque_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.cumsum of a floating-point tensor, opaque to Inductor (see `opaque_cumsums`)."""
    return torch.cumsum(x, dim)


@opaque_cumsum.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def opaque_cumsums(gm: fx.GraphModule) -> int:
    """Replace each floating-point cumsum without a dtype argument (torch.cumsum, Tensor.cumsum) by the opaque
    op; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        is_call = node.op == "call_function" and node.target in (torch.cumsum, torch.ops.aten.cumsum.default)
        is_method = node.op == "call_method" and node.target == "cumsum"
        if not (is_call or is_method) or set(node.kwargs) - {"dim"} or len(node.args) > 2:
            continue
        x = node.args[0]
        val = x.meta.get("example_value", x.meta.get("val")) if isinstance(x, fx.Node) else None
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or not isinstance(dim, int):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.ssmspec_compat.cumsum.default, (x, dim))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


def _replace(node: fx.Node, result: fx.Node, value) -> None:
    """`result` (its value's shape `value`, for later passes) in place of `node`, which is removed."""
    result.meta["val"] = value
    node.replace_all_uses_with(result)
    node.graph.erase_node(node)


def _finished(gm: fx.GraphModule, count: int) -> int:
    """After a pass that rewrote `count` nodes: the graph checked and its code regenerated where it changed."""
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def matmul_operands(node: fx.Node) -> tuple[object, object, object] | None:
    """(bias, left, right) of a matrix product call, `mm` (bias None) or `addmm`; None for any other node."""
    aten = torch.ops.aten
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
        return None
    if node.target is aten.mm.default:
        return None, *node.args[:2]
    return node.args[0], *node.args[1:3]


def _plain_products(graph: fx.Graph) -> list[tuple[fx.Node, tuple[object, object, object]]]:
    """Each matrix product of `graph` (`mm`, `addmm`) with its default beta and alpha, and its (bias, left, right); an
    `addmm` given either is left out (left to Inductor). A list: a pass may rewrite the graph as it goes."""
    products = []
    for node in graph.nodes:
        operands = matmul_operands(node)
        if operands is not None and not node.kwargs and len(node.args) == (2 if operands[0] is None else 3):
            products.append((node, operands))
    return products


def rows_linears(
    gm: fx.GraphModule, max_rows: int, min_rows: int = 2, rewrite: bool = True, large: int | None = None
) -> int:  # fmt: skip
    """Point each float32 matrix product of `min_rows` to `max_rows` rows of a recorded CPU step (`mm`, `addmm` with
    a 1-D bias; shapes in `meta["val"]`) at `ssmspec_cpu::rows_linear` (ssmspec.kernels.cpu_linear, which must be
    loaded), and with `large`, each one of 1 to `max_rows` rows whose weight has at least `large` elements; returns
    how many. Inductor's own loops sum each output in one dependent chain, a row at a time; the kernel keeps several
    sums in flight and reads each weight from memory once for all rows (measured: ssmspec.compile.lower,
    SMALL_MATMUL_ROWS and KERNEL_WEIGHTS). `rewrite=False` only counts them (the graph as it was; the kernel need not
    be loaded)."""
    aten = torch.ops.aten
    graph = gm.graph
    count = 0
    for node, (bias, a, b) in _plain_products(graph):
        av, bv, out = (x.meta.get("val") if isinstance(x, fx.Node) else None for x in (a, b, node))
        if not all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in (av, bv, out)):
            continue
        if {av.dtype, bv.dtype, out.dtype} != {torch.float32}:
            continue
        least = 1 if large is not None and bv.numel() >= large else min_rows
        if not least <= av.shape[0] <= max_rows:
            continue
        if bias is not None:
            biasv = bias.meta.get("val") if isinstance(bias, fx.Node) else None
            if not (isinstance(biasv, torch.Tensor) and biasv.dim() == 1 and biasv.dtype == torch.float32):
                continue
        if not rewrite:
            count += 1
            continue
        with graph.inserting_before(node):
            weight = graph.call_function(aten.t.default, (b,))  # [N, K]: a linear's weight as it is stored
            result = graph.call_function(torch.ops.ssmspec_cpu.rows_linear.default, (a, weight, bias))
        _replace(node, result, out)
        count += 1
    return _finished(gm, count) if rewrite else count


def small_bmms_as_sums(gm: fx.GraphModule, max_inner: int, max_outputs: int) -> int:
    """Rewrite each batched matrix product of a recorded CPU step (`bmm`, `baddbmm` and its in-place form, default
    beta and alpha; shapes in `meta["val"]`) whose inner dimension is at most `max_inner` (a tree's or a path's nodes)
    or whose output has at most `max_outputs` elements, as a broadcast product summed over its inner dimension; returns
    how many. Inductor then computes it in its own loops, fused with the work around it, where it would call MKL's
    batched GEMM: an external call splits the step's one parallel region in two (each a fork and join of the threads,
    on a small model's step more than the product itself)."""
    aten = torch.ops.aten
    targets = {aten.bmm.default: 0, aten.baddbmm.default: 1, aten.baddbmm_.default: 1}
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        first = targets[node.target]
        if node.kwargs or len(node.args) != first + 2:
            continue
        a, b = node.args[first], node.args[first + 1]
        av, bv, out = (x.meta.get("val") if isinstance(x, fx.Node) else None for x in (a, b, node))
        if not all(isinstance(v, torch.Tensor) and v.dim() == 3 for v in (av, bv, out)):
            continue
        if not out.dtype.is_floating_point or (av.shape[2] > max_inner and out.numel() > max_outputs):
            continue
        with graph.inserting_before(node):
            left = graph.call_function(aten.unsqueeze.default, (a, 3))  # [Bt, M, K, 1]
            right = graph.call_function(aten.unsqueeze.default, (b, 1))  # [Bt, 1, K, N]
            product = graph.call_function(aten.mul.Tensor, (left, right))
            summed = graph.call_function(aten.sum.dim_IntList, (product, [2]))
            if node.target is aten.bmm.default:
                result = summed
            elif node.target is aten.baddbmm.default:
                result = graph.call_function(aten.add.Tensor, (node.args[0], summed))
            else:
                result = graph.call_function(aten.add_.Tensor, (node.args[0], summed))
        _replace(node, result, out)
        count += 1
    return _finished(gm, count)


def short_cumsums_unrolled(gm: fx.GraphModule, max_length: int) -> int:
    """Rewrite each floating-point `cumsum` of a recorded CPU step over a dimension of at most `max_length` (a path
    of a few nodes) as its running sum, term by term in ATen's own order and accumulation type (float64 for float32,
    float32 for 16-bit types: the same values, bit for bit); returns how many. Inductor has no scan on a CPU: it calls
    ATen's cumsum, an external call that splits the step's one parallel region."""
    aten = torch.ops.aten
    accumulate = {torch.float32: torch.float64, torch.float16: torch.float32, torch.bfloat16: torch.float32,
                  torch.float64: torch.float64}  # fmt: skip
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.cumsum.default or node.kwargs or len(node.args) != 2:
            continue
        x, dim = node.args
        xv, out = x.meta.get("val") if isinstance(x, fx.Node) else None, node.meta.get("val")
        if not isinstance(xv, torch.Tensor) or xv.dtype not in accumulate or not isinstance(out, torch.Tensor):
            continue
        dim = dim % xv.dim()
        length = xv.shape[dim]
        if not 1 <= length <= max_length:
            continue
        acc_dtype = accumulate[xv.dtype]
        with graph.inserting_before(node):
            terms, total = [], None
            for i in range(length):
                term = graph.call_function(aten.select.int, (x, dim, i))
                term = graph.call_function(aten._to_copy.default, (term,), {"dtype": acc_dtype})
                total = term if total is None else graph.call_function(aten.add.Tensor, (total, term))
                terms.append(graph.call_function(aten._to_copy.default, (total,), {"dtype": xv.dtype}))
            result = graph.call_function(aten.stack.default, (terms, dim))
        _replace(node, result, out)
        count += 1
    return _finished(gm, count)


def split_product_rows(gm: fx.GraphModule, max_rows: int, min_rows: int = 2, below: int | None = None) -> int:
    """Rewrite each matrix product of `min_rows` to `max_rows` rows (`mm`, `addmm` with default beta and alpha) of a
    recorded CPU step as one product per row, concatenated (with `below`, only those whose weight has fewer elements,
    or whose weight's shape is not recorded); returns how many. Inductor computes a one-row product in its own loops,
    and the rows' loops, reading the same weight over the same ranges, fuse into one pass over it with a sum per row
    in flight."""
    aten = torch.ops.aten
    graph = gm.graph
    count = 0
    for node, (bias, a, b) in _plain_products(graph):
        av, out = a.meta.get("val") if isinstance(a, fx.Node) else None, node.meta.get("val")
        if not (isinstance(av, torch.Tensor) and av.dim() == 2 and min_rows <= av.shape[0] <= max_rows):
            continue
        bv = b.meta.get("val") if isinstance(b, fx.Node) else None
        if below is not None and isinstance(bv, torch.Tensor) and bv.numel() >= below:
            continue
        with graph.inserting_before(node):
            parts = []
            for i in range(av.shape[0]):
                row = graph.call_function(aten.slice.Tensor, (a, 0, i, i + 1))
                row.meta["val"] = av[i : i + 1]
                args = (row, b) if bias is None else (bias, row, b)
                part = graph.call_function(node.target, args)
                part.meta["val"] = out[i : i + 1]
                parts.append(part)
            result = graph.call_function(aten.cat.default, (parts, 0))
        _replace(node, result, out)
        count += 1
    return _finished(gm, count)
