"""Batching rules: rewrite one branch's op so that it runs on all K branches at once (a leading dim of K).

Every tensor that a branch computes from its GEMM block gets a new leading dimension of size K in the batched
graph. An op of one branch is rewritten by its *kind*:

| kind        | ops (aten)                                             | rewrite                                      |
|-------------|--------------------------------------------------------|----------------------------------------------|
| pointwise   | add, mul, rsqrt, pow, convert_element_type, where, ... | batched operands get unit dims after K so    |
|             |                                                        | they broadcast; per-branch leaves are        |
|             |                                                        | stacked `[K, ...]`; shared operands as is    |
| dim         | mean, sum, amax, slice, select, unsqueeze, cat, split, | non-negative dims + 1                        |
|             | transpose, softmax, ...                                |                                              |
| shape       | view, reshape, _unsafe_view, expand                    | size list gets K (or -1 for expand) in front |
| permute     | permute                                                | `[0] + [d + 1 ...]`                          |
| index       | index.Tensor with shared indices                       | `[None] + indices`                           |
| getitem     | getitem of a split/unbind                              | unchanged                                    |

Anything else (GEMMs, mutations, ops mixing branches) is not batchable and ends a branch's region.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from dspark_fx.passes.graph_utils import aten, call, tensor_val

prims = torch.ops.prims

_POINTWISE = {
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.rsqrt, aten.sqrt, aten.pow, aten.exp, aten.log,
    aten.cos, aten.sin, aten.tanh, aten.sigmoid, aten.reciprocal, aten.abs, aten.maximum, aten.minimum,
    aten.where, aten.clamp, aten.clamp_min, aten.clamp_max, aten.clone, aten._to_copy, aten.alias,
    aten.square, aten.silu, aten.relu, aten.erf, aten.sign, prims.convert_element_type,
}  # fmt: skip
_DIM_OPS = {
    aten.mean, aten.sum, aten.amax, aten.amin, aten.prod, aten.var, aten._softmax, aten._log_softmax,
    aten.cumsum, aten.slice, aten.select, aten.unsqueeze, aten.squeeze, aten.cat, aten.stack, aten.split,
    aten.split_with_sizes, aten.unbind, aten.transpose, aten.flip,
}  # fmt: skip
_REDUCTIONS = {aten.mean, aten.sum, aten.amax, aten.amin, aten.var}
_SHAPE_OPS = {aten.view, aten.reshape, aten._unsafe_view, aten.expand}


def _packet(node: fx.Node):
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target


def is_batchable(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    packet = _packet(node)
    if packet in _POINTWISE or packet in _SHAPE_OPS or packet is aten.permute or packet is aten.index:
        return True
    return packet in _DIM_OPS


@dataclass
class Operand:
    """How one tensor input of a branch op is provided in the batched graph."""

    kind: str  # "batched" (a [K, ...] node), "shared" (same node for all branches), "leaf" (one per branch)
    node: fx.Node | None = None
    leaves: tuple[fx.Node, ...] = ()


class BatchError(RuntimeError):
    """An op that the rules cannot batch in this form (the branch keeps its own op)."""


def _rank(node: fx.Node) -> int:
    return tensor_val(node).dim()


def _shift(dim: int) -> int:
    return dim + 1 if dim >= 0 else dim


def batch_op(graph: fx.Graph, node: fx.Node, operand: Callable[[fx.Node], Operand], k: int) -> fx.Node:
    """Emit the batched version of `node` (one branch's op); `operand` says how each tensor input is provided."""
    if node.target is operator.getitem:
        source = operand(node.args[0])
        return call(graph, operator.getitem, (source.node, node.args[1]))
    if not isinstance(node.target, torch._ops.OpOverload):
        raise BatchError(f"{node.target} is not an ATen op")
    names = [a.name for a in node.target._schema.arguments]
    kwargs = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    packet = _packet(node)
    if packet in _POINTWISE:
        return _pointwise(graph, node, kwargs, operand, k)
    first = next(v for v in kwargs.values() if _is_tensor_node(v) or _is_node_list(v))
    rank = _rank(first[0] if isinstance(first, (list, tuple)) else first)
    kwargs = {name: _tensor_arg(graph, value, operand, k, name) for name, value in kwargs.items()}
    if packet in _SHAPE_OPS:
        key = "size" if "size" in kwargs else "shape"
        kwargs[key] = [-1 if packet is aten.expand else k, *kwargs[key]]
    elif packet is aten.permute:
        kwargs["dims"] = [0] + [d % rank + 1 for d in kwargs["dims"]]
    elif packet is aten.index:
        kwargs["indices"] = [None, *kwargs["indices"]]
    elif packet in _DIM_OPS:
        _shift_dims(kwargs, packet, rank)
    return _call_by_name(graph, node.target, kwargs)


def _call_by_name(graph: fx.Graph, target, kwargs: dict) -> fx.Node:
    """Call an op with schema-named arguments: positional ones in schema order (aten rejects `self=`)."""
    args = []
    for argument in target._schema.arguments:
        if argument.kwarg_only or argument.name not in kwargs:
            break
        args.append(kwargs.pop(argument.name))
    return call(graph, target, tuple(args), kwargs)


def _shift_dims(kwargs: dict, packet, rank: int) -> None:
    for name in ("dim", "dims", "dim0", "dim1"):
        if name not in kwargs:
            continue
        value = kwargs[name]
        if value is None or value == []:
            if packet not in _REDUCTIONS:
                raise BatchError(f"{packet} over all dims")
            kwargs[name] = list(range(1, rank + 1))
        elif isinstance(value, (list, tuple)):
            kwargs[name] = [_shift(d) for d in value]
        else:
            kwargs[name] = _shift(value)


def _is_tensor_node(value: object) -> bool:
    return isinstance(value, fx.Node) and tensor_val(value) is not None


def _is_node_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and any(_is_tensor_node(v) for v in value)


def _tensor_arg(graph: fx.Graph, value, operand: Callable[[fx.Node], Operand], k: int, name: str):
    """Batched form of a non-pointwise op's argument. Index tensors must be shared and stay as they are; every
    other tensor becomes `[K, ...]`: batched as is, shared expanded, per-branch leaves stacked."""
    if _is_node_list(value):
        return [_tensor_arg(graph, v, operand, k, name) for v in value]
    if not _is_tensor_node(value):
        return value
    op = operand(value)
    if name == "indices":
        if op.kind != "shared":
            raise BatchError("indices computed per branch")
        return value
    return op.node if op.kind == "batched" else _broadcast_to_batch(graph, op, k)


def _broadcast_to_batch(graph: fx.Graph, op: Operand, k: int) -> fx.Node:
    """A `[K, ...]` node from a shared node (expanded) or from per-branch leaves (stacked)."""
    if op.kind == "leaf":
        return _stack(graph, op.leaves)
    unsqueezed = call(graph, aten.unsqueeze.default, (op.node, 0))
    return call(graph, aten.expand.default, (unsqueezed, [k] + [-1] * _rank(op.node)))


def _stack(graph: fx.Graph, leaves: tuple[fx.Node, ...]) -> fx.Node:
    """`[K, ...]` from the per-branch leaves, as `cat` of unsqueezes (post-grad graphs hold no `stack`)."""
    return call(graph, aten.cat.default, ([call(graph, aten.unsqueeze.default, (leaf, 0)) for leaf in leaves], 0))


def _pointwise(graph: fx.Graph, node: fx.Node, kwargs: dict, operand: Callable[[fx.Node], Operand], k: int):
    out_rank = tensor_val(node).dim()

    def lift(value):
        if not _is_tensor_node(value):
            return value
        op = operand(value)
        if op.kind == "shared":
            return op.node
        batched = op.node if op.kind == "batched" else _stack(graph, op.leaves)
        for _ in range(out_rank - _rank(value)):
            batched = call(graph, aten.unsqueeze.default, (batched, 1))
        return batched

    kwargs = {name: [lift(v) for v in val] if _is_node_list(val) else lift(val) for name, val in kwargs.items()}
    return _call_by_name(graph, node.target, kwargs)
