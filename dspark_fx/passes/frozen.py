"""GEMMs on frozen weights (`torch._inductor.config.freezing = True`) in the shape the fusion matches.

Freezing runs before the post-grad passes: it turns the parameters into constants (`get_attr` nodes of the graph
module, `_frozen_param<i>`), constant-folds what is computed from them only, and concatenates the weights of up to
three GEMMs on one activation (Inductor's concat-linear freezing pattern; on CPU only with
`cpp.enable_concat_linear`). A GEMM's weight operand is therefore a `[K, N]` constant:

    mm(ctx, c)    c = permute(slice(W, 0, q, q + 2kv), [1, 0]), folded: a view of W's storage, strides (1, K)
    addmm(b, ctx, c) ...
    mm(ctx, c)    c = cat([w_0^T, w_1^T, w_2^T], 1), folded: a contiguous [K, 3 * 2kv] copy, the output split
    split_with_sizes(mm, [2kv, 2kv, 2kv], 1)   (torch 2.11: split(mm, 2kv, 1))

This pass gives each such GEMM the operand a parameter's GEMM has, `permute(w, [1, 0])` of an `[N, K]` weight `w`
with unit inner stride, and `w` is a new frozen constant: `c`'s transpose, a view of the same storage where `c` is
a transposed view, else a contiguous copy made once, now (the `[K, N]` constant is dropped when nothing else
reads it once the pass keeps its rewrite, so the weights are not held twice; where the pass restores the graph, the
new constant is dropped instead). A concatenated GEMM (a contiguous constant whose output is read
only through one column split) becomes one GEMM per used piece again, each on its row range of `w`:

    w = get_attr _frozen_param<j>        [3 * 2kv, K], strides (K, 1)
    mm_0 = mm(ctx, permute(slice(w, 0, 0, 2kv), [1, 0]))    mm_1 = mm(ctx, permute(slice(w, 0, 2kv, 4kv), ...))

so that a branch is one layer's GEMM as without freezing (the fusion then reads the rows of `w` in place). As
with any frozen constant, an in-place update of a parameter after compiling is not seen.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._inductor.constant_folding import replace_node_with_constant
from torch._subclasses.fake_tensor import FakeTensor

from dspark_fx.passes.gemm_branches import _split_bounds
from dspark_fx.passes.graph_utils import aten, call, propagate_val, tensor_val

_GEMMS = (aten.mm.default, aten.addmm.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


@dataclass
class FrozenWeights:
    """The constants `expose_frozen_weights` added to the graph module and those whose GEMMs it rewrote. Nothing is
    deleted until the pass knows whether its rewrite stays (`settle`): a graph restored as it came reads the old
    constants again."""

    module: fx.GraphModule | None = None
    added: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)

    def settle(self, graph: fx.Graph) -> None:
        """Drop what `graph` (the final graph) no longer reads: the replaced `[K, N]` constants where the rewrite
        stayed (so the weights are not held twice), the added ones where the graph was restored."""
        if self.module is None:
            return
        read = {n.target for n in graph.nodes if n.op == "get_attr"}
        for name in dict.fromkeys(self.added + self.replaced):
            if name not in read and "." not in name and hasattr(self.module, name):
                delattr(self.module, name)


def expose_frozen_weights(graph: fx.Graph) -> FrozenWeights:
    """Rewrite every GEMM whose weight operand is a frozen `[K, N]` constant (see the module docstring)."""
    gm = graph.owning_module
    frozen = FrozenWeights(gm)
    if gm is None:
        return frozen
    rows_of: dict[str, fx.Node] = {}  # constant name -> its [N, K] transpose
    for gemm in [n for n in graph.nodes if n.target in _GEMMS]:
        operand = gemm.args[-1]
        if not isinstance(operand, fx.Node) or operand.op != "get_attr" or tensor_val(operand) is None:
            continue
        constant = operator.attrgetter(operand.target)(gm)
        if not _real_matrix(constant):
            continue
        if operand.target not in rows_of:
            rows_of[operand.target] = _transposed_constant(graph, gm, operand, constant)
            frozen.added.append(rows_of[operand.target].target)
            frozen.replaced.append(operand.target)
        weight = rows_of[operand.target]
        with graph.inserting_before(gemm):
            gemm.args = (*gemm.args[:-1], call(graph, aten.permute.default, (weight, [1, 0])))
        split = _only_column_split(gemm)
        if constant.is_contiguous() and split is not None:
            _split_into_pieces(graph, gemm, split, weight)
        if not operand.users:
            graph.erase_node(operand)
    return frozen


def _real_matrix(value: object) -> bool:
    """A 2-D strided tensor with storage (not a fake, meta or mkldnn-packed one)."""
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, FakeTensor)
        and value.layout is torch.strided
        and value.device.type != "meta"
        and value.dim() == 2
    )


def _transposed_constant(graph: fx.Graph, gm: fx.GraphModule, operand: fx.Node, constant: torch.Tensor) -> fx.Node:
    """A new frozen constant `frozen_weight<i>` holding `constant.t()` with unit inner stride (a view of `constant`
    where it has one, else a contiguous copy)."""
    rows = constant.t()
    with graph.inserting_after(operand):
        transpose = call(graph, aten.permute.default, (operand, [1, 0]))
    target, args, kwargs = aten.alias.default, (transpose,), {}
    if rows.stride(1) != 1:
        rows = rows.contiguous()
        target, kwargs = aten.clone.default, {"memory_format": torch.contiguous_format}
    with graph.inserting_after(transpose):
        node = graph.create_node("call_function", target, args, kwargs, name="frozen_weight")
    propagate_val(graph, node)
    name = node.name
    replace_node_with_constant(gm, node, rows)
    graph.erase_node(transpose)
    return next(n for n in graph.nodes if n.op == "get_attr" and n.name == name)


def _only_column_split(gemm: fx.Node) -> fx.Node | None:
    """The split of `gemm`'s output along its columns, when that is its only reader (and only `getitem`s read it)."""
    if gemm.target is aten.addmm.default and gemm.kwargs:
        return None
    if len(gemm.users) != 1:
        return None
    (split,) = gemm.users
    if split.target not in _SPLITS or split.args[0] is not gemm:
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in (1, -1) or not all(isinstance(s, int) for s in torch.utils._pytree.tree_leaves(split.args[1])):
        return None
    if not all(u.target is operator.getitem for u in split.users):
        return None
    return split


def _split_into_pieces(graph: fx.Graph, gemm: fx.Node, split: fx.Node, weight: fx.Node) -> None:
    """One GEMM per used piece of `split`, on the piece's rows of `weight` (and of the bias)."""
    bounds = _split_bounds(split, int(tensor_val(gemm).shape[1]))
    bias = gemm.args[0] if gemm.target is aten.addmm.default else None
    activation = gemm.args[-2]
    for piece in list(split.users):
        start, stop = bounds[piece.args[1]]
        with graph.inserting_before(gemm):
            rows = call(graph, aten.slice.Tensor, (weight, 0, start, stop))
            operand = call(graph, aten.permute.default, (rows, [1, 0]))
            if bias is None:
                new = call(graph, aten.mm.default, (activation, operand))
            else:
                bias_rows = call(graph, aten.slice.Tensor, (bias, 0, start, stop))
                new = call(graph, aten.addmm.default, (bias_rows, activation, operand))
        piece.replace_all_uses_with(new)
        graph.erase_node(piece)
    graph.erase_node(split)
    old_operand = gemm.args[-1]
    graph.erase_node(gemm)
    graph.erase_node(old_operand)
