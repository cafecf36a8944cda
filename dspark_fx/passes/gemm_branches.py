"""Find the GEMMs that share an activation (`find_groups`) and rewrite each group into one `dspark::multi_linear`
(`rewrite_group`).

Before (N layers, each projecting the same `ctx`; the weight may be a row slice of a fused qkv weight):

    w_0 = slice(W_0, 0, q, q + 2kv)    mm_0 = mm(ctx, permute(w_0, [1, 0]))    k_0, v_0 = split(mm_0)
    w_1 = slice(W_1, 0, q, q + 2kv)    mm_1 = addmm(b_1, ctx, permute(w_1, [1, 0]))  ...

After (the original weight tensors are read in place — nothing is concatenated per call):

    y    = dspark.multi_linear(ctx, [W_0, W_1, ...], [q, q, ...], [2kv, 2kv, ...], [None, b_1, ...])
    mm_0 = slice(y, 1, 0, 2kv)         mm_1 = slice(y, 1, 2kv, 4kv)    ...   (per-branch column blocks)

A column block is a strided view of `y` (the fusion turns the views below it into reshapes); a GEMM whose
output is read through `as_strided` never fuses.

A GEMM whose output is only read through column slices/splits (a fused qkv GEMM whose Q part is unused) is
narrowed to the used rows first. A GEMM whose weight is computed in the graph (dequantized, transposed twice,
...) is not a parameter row range and never fuses; it is reported with the reason.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

import custom_ops  # registers dspark::multi_linear
from custom_ops.linear.multi_linear import FLOAT_DTYPES
from dspark_fx.passes.graph_utils import aten, call, gemm_activation, op_name, reads_storage_layout, tensor_val
from dspark_fx.passes.names import Namer
from dspark_fx.report import Rejection

MULTI_LINEAR = torch.ops.dspark.multi_linear.default
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
_WEIGHT_SOURCES = ("placeholder", "get_attr")  # a graph input, or a frozen constant (`frozen.py`)


@dataclass
class GemmBranch:
    """One `mm`/`addmm` whose weight is rows `[row_start, row_start + row_count)` of `weight`, an `[out, in]`
    tensor: a parameter placeholder, or under freezing a frozen constant (`get_attr`) with unit inner stride."""

    node: fx.Node
    activation: fx.Node
    weight: fx.Node
    row_start: int
    row_count: int
    bias: fx.Node | None
    col_lo: int = 0  # the used column range of the GEMM output (narrowing)

    @property
    def dtype(self) -> torch.dtype:
        return tensor_val(self.node).dtype

    def describe(self, names: Namer) -> str:
        """`weight[start:stop]` (+ bias), by parameter name."""
        rows = f"{names.of(self.weight)}[{self.row_start}:{self.row_start + self.row_count}]"
        return rows + (" + bias" if self.bias is not None else "")


@dataclass(frozen=True)
class GemmGroup:
    """The fusable GEMMs that read one activation (of one dtype), in graph order."""

    activation: fx.Node
    branches: list[GemmBranch]


@dataclass(frozen=True)
class GemmScan:
    """The fusable GEMMs of a graph by activation, and the GEMMs that cannot fuse (with the reason)."""

    groups: list[GemmGroup]
    rejected: list[Rejection]


def find_groups(graph: fx.Graph, names: Namer) -> GemmScan:
    """Every GEMM of the graph, matched (`match_gemm`) and grouped by the activation it reads."""
    groups: dict[tuple, list[GemmBranch]] = defaultdict(list)
    rejected = []
    for node in graph.nodes:
        match = match_gemm(node)
        if isinstance(match, str):
            rejected.append(Rejection(names.weight_of(node), match))
        elif match is not None:
            groups[(match.activation, match.dtype)].append(match)
    return GemmScan([GemmGroup(activation, branches) for (activation, _), branches in groups.items()], rejected)


def refresh_activation(group: GemmGroup) -> GemmGroup:
    """`group` reading its activation as the graph holds it now: rewriting an earlier group replaces that group's
    GEMMs, and one of them may be this group's activation (`b(a(x))`: `a`'s GEMM is gone, `b` reads its block)."""
    activation = gemm_activation(group.branches[0].node)
    for branch in group.branches:
        branch.activation = activation
    return GemmGroup(activation, group.branches)


def _slice_args(node: fx.Node) -> tuple:
    """`(input, dim, start, stop, step)` of an `aten.slice.Tensor` node, defaults filled in."""
    return (*node.args, *(0, None, None, 1)[len(node.args) - 1 :])


@dataclass
class RowRange:
    """Rows `[start, stop)` of `base`: a placeholder (a parameter, or a buffer) or a frozen constant (`get_attr`)."""

    base: fx.Node
    start: int
    stop: int


def _row_range(node: fx.Node) -> RowRange | str:
    """The rows of a placeholder or constant that `node` is (all of them) or a unit-step row slice of, else a
    reason."""
    if node.op in _WEIGHT_SOURCES:
        val = tensor_val(node)
        return RowRange(node, 0, int(val.shape[0]))
    if node.target is aten.slice.Tensor:
        base, dim, start, stop, step = _slice_args(node)
        base_val = tensor_val(base)
        if base.op not in _WEIGHT_SOURCES or base_val is None:
            return f"weight is a slice of {op_name(base)} output, not of a parameter"
        if dim % base_val.dim() != 0 or step != 1:
            return "weight slice is not a unit-step row slice"
        if not all(isinstance(v, (int, type(None))) for v in (start, stop)):
            return "weight slice bounds are symbolic"
        rows = int(base_val.shape[0])
        start, stop = slice(start, stop).indices(rows)[:2]
        return RowRange(base, start, stop)
    return f"weight is computed by {op_name(node)} (quantized or transformed weights never fuse)"


def split_added_terms(graph: fx.Graph) -> list[fx.Node]:
    """`addmm(t, x, permute(W))` whose added term `t` is no bias of `W`'s rows (a residual, a computed shift: Inductor
    folds `mm + add` into `addmm` wherever the term broadcasts to the output) made `add(mm(x, permute(W)), t)`
    again, as the model wrote it, so the GEMM fuses as an `mm` does. Returns the new `mm` nodes (`rejoin_added_terms`
    makes those that did not fuse `addmm` again)."""
    split = []
    for node in [n for n in graph.nodes if n.target is aten.addmm.default and not n.kwargs and len(n.args) == 3]:
        why = match_gemm(node)
        if not isinstance(why, str) or not (why.startswith("bias: ") or why == _BIAS_ROWS):
            continue
        term, x, w_t = node.args
        with graph.inserting_before(node):
            product = call(graph, aten.mm.default, (x, w_t))
            if isinstance(match_gemm(product), str):
                graph.erase_node(product)
                continue
            total = call(graph, aten.add.Tensor, (product, term))
        for new in (product, total):
            new.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        split.append(product)
    return split


def rejoin_added_terms(graph: fx.Graph, split: list[fx.Node]) -> None:
    """`add(mm(x, w), t)` made `addmm(t, x, w)` again for each `mm` of `split_added_terms` still in the graph (it
    fused into nothing): one GEMM that adds its term, as Inductor had it."""
    live = set(graph.nodes)
    for product in split:
        if product not in live or product.target is not aten.mm.default or len(product.users) != 1:
            continue
        (total,) = product.users
        if total.target is not aten.add.Tensor or total.args[0] is not product or total.kwargs:
            continue
        with graph.inserting_before(total):
            rejoined = call(graph, aten.addmm.default, (total.args[1], *product.args))
        rejoined.meta["stack_trace"] = total.meta.get("stack_trace")
        total.replace_all_uses_with(rejoined)
        graph.erase_node(total)
        graph.erase_node(product)


_BIAS_ROWS = "bias rows do not match the weight rows"


def match_gemm(node: fx.Node) -> GemmBranch | str | None:
    """A `GemmBranch` for a fusable GEMM, a reason string for a GEMM that cannot fuse, None for other nodes."""
    if node.target is aten.mm.default:
        (x, w_t), bias = node.args, None
    elif node.target is aten.addmm.default:
        bias, x, w_t = node.args[:3]
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return "addmm with alpha/beta != 1"
    else:
        return None
    x_val, out_val = tensor_val(x), tensor_val(node)
    if x_val is None or out_val is None or not isinstance(w_t, fx.Node):
        return "operands carry no tensor metadata"
    if x_val.dtype not in FLOAT_DTYPES:
        return f"activation dtype {x_val.dtype}: dspark::multi_linear takes bfloat16, float16 and float32"
    if x_val.device.type == "cuda" and (problem := custom_ops._build.cuda_library_problem()):
        return problem  # the op on CUDA tensors would raise BuildError at its first call
    if reads_storage_layout(node):
        return "output is read through as_strided or a dtype view (depends on its storage layout)"
    if (w_t.target is aten.permute.default and list(w_t.args[1]) == [1, 0]) or w_t.target is aten.t.default:
        weight = w_t.args[0]
    else:
        operand = "the input named above" if w_t.op == "placeholder" else op_name(w_t)
        return f"weight operand is {operand}, not a transposed [out, in] weight"
    rows = _row_range(weight)
    if isinstance(rows, str):
        return rows
    if rows.stop <= rows.start:
        return "weight has no rows (a GEMM without output columns: nothing to read or share)"
    if tensor_val(rows.base).dtype != x_val.dtype:
        return f"weight dtype {tensor_val(rows.base).dtype} differs from activation dtype {x_val.dtype}"
    bias_rows = None
    if bias is not None:
        bias_rows = _row_range(bias) if isinstance(bias, fx.Node) else "bias is not a tensor"
        if isinstance(bias_rows, str):
            return "bias: " + bias_rows
        same_rows = (bias_rows.start, bias_rows.stop) == (rows.start, rows.stop)
        if not same_rows or tensor_val(bias_rows.base).shape != (tensor_val(rows.base).shape[0],):
            return _BIAS_ROWS
    bias_base = bias_rows.base if bias_rows is not None else None
    return GemmBranch(node, x, rows.base, rows.start, rows.stop - rows.start, bias_base)


def _used_columns(node: fx.Node) -> tuple[int, int] | None:
    """The column range of `node` (a [T, C] GEMM output) its users read, if all read through slices/splits."""
    width = int(tensor_val(node).shape[1])
    lo, hi = width, 0
    for user in node.users:
        if not _constant_args(user):
            return None
        if user.target is aten.slice.Tensor and _slice_args(user)[1] in (1, -1) and _slice_args(user)[4] == 1:
            start, stop = slice(*_slice_args(user)[2:4]).indices(width)[:2]
            if stop <= start:
                continue  # an empty slice reads no column (start may lie past stop: `y[:, 20:10]`)
        elif user.target in _SPLITS and _split_dim(user) in (1, -1):
            bounds = _split_bounds(user, width)
            used = [bounds[g.args[1]] for g in user.users if g.target is operator.getitem]
            if not used:
                continue
            start, stop = min(b[0] for b in used), max(b[1] for b in used)
        else:
            return None
        lo, hi = min(lo, start), max(hi, stop)
    return (lo, hi) if lo < hi else None


def _constant_args(node: fx.Node) -> bool:
    """No argument but the input is a node (symbolic slice bounds or split sizes cannot be narrowed to)."""
    rest = [*node.args[1:], *node.kwargs.values()]
    return not any(isinstance(a, fx.Node) for a in torch.utils._pytree.tree_leaves(rest))


def _split_dim(split: fx.Node) -> int:
    return split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)


def _split_bounds(split: fx.Node, width: int) -> list[tuple[int, int]]:
    sizes = split.args[1]
    if split.target is aten.split.Tensor:
        sizes = [min(sizes, width - s) for s in range(0, width, sizes)]
    bounds, col = [], 0
    for size in sizes:
        bounds.append((col, col + size))
        col += size
    return bounds


def narrow_to_used_columns(branch: GemmBranch) -> None:
    """Shrink the branch's row range to the output columns its users read (e.g. drop an unused Q part)."""
    used = _used_columns(branch.node)
    if used is None or used == (0, branch.row_count):
        return
    branch.col_lo = used[0]
    branch.row_start += used[0]
    branch.row_count = used[1] - used[0]


def _rewire_users(graph: fx.Graph, branch: GemmBranch, block: fx.Node) -> None:
    """Point the old GEMM's users at `block`, its (possibly narrowed) column block of the multi-linear output."""
    if branch.col_lo == 0 and branch.row_count == int(tensor_val(branch.node).shape[1]):
        branch.node.replace_all_uses_with(block)
        return
    width = int(tensor_val(branch.node).shape[1])
    for user in list(branch.node.users):
        pieces = []
        if user.target is aten.slice.Tensor:
            start, stop = slice(*_slice_args(user)[2:4]).indices(width)[:2]
            pieces.append((user, start, stop))
        else:
            bounds = _split_bounds(user, width)
            pieces += [(g, *bounds[g.args[1]]) for g in list(user.users) if g.target is operator.getitem]
        for old, start, stop in pieces:
            if stop <= start:  # empty: an empty slice of the block (rebased bounds could go negative and wrap)
                start = stop = branch.col_lo
            with graph.inserting_after(block):
                new = call(graph, aten.slice.Tensor, (block, 1, start - branch.col_lo, stop - branch.col_lo))
            old.replace_all_uses_with(new)
            graph.erase_node(old)
        if user.target is not aten.slice.Tensor and not user.users:  # a split whose getitems all went (a slice did)
            graph.erase_node(user)


@dataclass(frozen=True)
class FusedGemm:
    """The multi-linear that replaced a group's GEMMs, and each branch's column block of its output (a slice)."""

    node: fx.Node
    blocks: list[fx.Node]  # one per branch, in the order of the group's branches


def rewrite_group(graph: fx.Graph, branches: list[GemmBranch]) -> FusedGemm:
    """Replace the GEMMs of `branches` (one activation) by one multi-linear, their column blocks side by side."""
    first = min((b.node for b in branches), key=_position(graph))
    with graph.inserting_before(first):
        fused = call(
            graph,
            MULTI_LINEAR,
            (
                branches[0].activation,
                [b.weight for b in branches],
                [b.row_start for b in branches],
                [b.row_count for b in branches],
                [b.bias for b in branches],
            ),
        )
    blocks, col = [], 0
    anchor = fused
    for branch in branches:
        with graph.inserting_after(anchor):
            block = call(graph, aten.slice.Tensor, (fused, 1, col, col + branch.row_count))
        anchor = block
        col += branch.row_count
        _rewire_users(graph, branch, block)
        blocks.append(block)
    for branch in branches:
        _erase_with_dead_inputs(graph, branch.node)
    return FusedGemm(fused, blocks)


def reorder_blocks(fused: FusedGemm, branches: list[GemmBranch], order: list[int]) -> None:
    """Lay the multi-linear output out with the branches' column blocks in `order` (indices into `branches`)."""
    if order == list(range(len(fused.blocks))):
        return
    new_args = list(fused.node.args)
    for pos in range(1, 5):
        new_args[pos] = [fused.node.args[pos][i] for i in order]
    fused.node.args = tuple(new_args)
    col = 0
    for i in order:
        width = branches[i].row_count
        fused.blocks[i].args = (fused.node, 1, col, col + width)
        col += width


def _erase_with_dead_inputs(graph: fx.Graph, node: fx.Node) -> None:
    if node.users or node.op != "call_function":
        return
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for arg in inputs:
        _erase_with_dead_inputs(graph, arg)


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]
