"""One batching rule per op kind, and the preconditions under which each computes exactly the per-branch op.

A rule receives the op's arguments by schema name (defaults filled in), each tensor argument an `Operand`, and
emits nodes whose value is `[K] + the branch's value`. A precondition that does not hold raises `BatchError`
with a readable reason; the branch then keeps its own op. `batching.batch_op` checks every rule's result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from dspark_fx.passes.graph_utils import call, op_name, tensor_val

aten = torch.ops.aten
prims = torch.ops.prims


class BatchError(RuntimeError):
    """An op that the rules cannot batch in this form (the branches keep their own copies of it); `node` is the
    reference branch's op, when the error is about one."""

    def __init__(self, reason: str, node: fx.Node | None = None) -> None:
        super().__init__(reason)
        self.node = node


@dataclass(frozen=True)
class Operand:
    """How one tensor argument of a branch op is provided in the batched graph.

    `ref` is the reference branch's argument (its value has one branch's shape). `node` is the `[K, ...]` node
    ("batched") or the node every branch reads ("shared"); "leaf" holds one small per-branch node per branch.
    """

    kind: str  # "batched" | "shared" | "leaf"
    ref: fx.Node
    node: fx.Node | None = None
    leaves: tuple[fx.Node, ...] = ()

    @property
    def val(self) -> torch.Tensor:
        return tensor_val(self.ref)


class Batch:
    """What a rule needs to emit nodes: the graph, the branch op being batched and K."""

    def __init__(self, graph: fx.Graph, node: fx.Node, k: int) -> None:
        self.graph, self.node, self.k = graph, node, k

    def emit(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        return call(self.graph, target, args, kwargs)

    def emit_bound(self, op: torch._ops.OpOverload, bound: dict[str, Any]) -> fx.Node:
        """Call the branch's op `op` with schema-named arguments, passed the way the branch passed them: an
        argument left at its default and not given by the branch stays out (Inductor's lowerings do not take
        every schema default), positional ones up to the last one needed, kwarg-only ones by name."""
        arguments = op._schema.arguments
        given = {a.name for a in arguments[: len(self.node.args)] if not a.kwarg_only} | set(self.node.kwargs)
        needed = {
            a.name
            for a in arguments
            if a.name in bound and (a.name in given or not a.has_default_value() or _differs(bound[a.name], a))
        }
        positional = [a.name for a in arguments if not a.kwarg_only]
        last = max((i for i, name in enumerate(positional) if name in needed), default=-1)
        args = tuple(bound[name] for name in positional[: last + 1])
        kwargs = {a.name: bound[a.name] for a in arguments if a.kwarg_only and a.name in needed}
        return self.emit(op, args, kwargs)

    def batched(self, op: Operand) -> fx.Node:
        """The `[K, ...]` node of an operand: batched as is, shared expanded, per-branch leaves stacked."""
        if op.kind == "batched":
            return op.node
        if op.kind == "leaf":
            return self.emit(aten.cat.default, ([self.emit(aten.unsqueeze.default, (x, 0)) for x in op.leaves], 0))
        unsqueezed = self.emit(aten.unsqueeze.default, (op.node, 0))
        return self.emit(aten.expand.default, (unsqueezed, [self.k] + [-1] * op.val.dim()))

    def unsqueezed_after_k(self, node: fx.Node, count: int) -> fx.Node:
        for _ in range(count):
            node = self.emit(aten.unsqueeze.default, (node, 1))
        return node


Rule = Callable[[Batch, dict], fx.Node]


def _differs(value: Any, argument: torch._C.Argument) -> bool:
    return (
        isinstance(value, fx.Node) or type(value) is not type(argument.default_value) or value != argument.default_value
    )


def _self(batch: Batch, bound: dict) -> Operand:
    """The op's input tensor, which must be the batched branch value."""
    op = bound.get("self")
    if not isinstance(op, Operand) or op.kind != "batched":
        raise BatchError(f"{op_name(batch.node)} reads a per-branch value through an argument other than `self`")
    return op


# ---- pointwise ---------------------------------------------------------------------------------------------------

_POINTWISE = {
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.rsqrt, aten.sqrt, aten.pow, aten.exp, aten.log,
    aten.cos, aten.sin, aten.tanh, aten.sigmoid, aten.reciprocal, aten.abs, aten.maximum, aten.minimum,
    aten.where, aten.clamp, aten.clamp_min, aten.clamp_max, aten.clone, aten._to_copy, aten.alias,
    aten.square, aten.silu, aten.relu, aten.erf, aten.sign, prims.convert_element_type,
}  # fmt: skip
_KEEPS_LAYOUT = (None, torch.preserve_format, torch.contiguous_format)


def _pointwise(batch: Batch, bound: dict) -> fx.Node:
    """Operands broadcast right-aligned: a batched or stacked operand of rank r gets `out_rank - r` unit dims
    after K, so its branch slice lines up with the branch's operand; a shared operand broadcasts as it did."""
    if bound.get("memory_format") not in _KEEPS_LAYOUT:
        raise BatchError(f"{op_name(batch.node)} with memory_format={bound['memory_format']}")
    out = tensor_val(batch.node)
    out_rank = out.dim()

    def lift(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [lift(v) for v in value]
        if not isinstance(value, Operand):
            return value
        if value.kind == "shared":
            return value.node
        if value.val.dim() == 0 and value.val.dtype != out.dtype:
            raise BatchError(
                f"type promotion: {op_name(batch.node)} reads a 0-d {value.val.dtype} value per branch, which eager "
                f"reads as a scalar in the op's math type; stacked it would be cast to {out.dtype} first"
            )
        return batch.unsqueezed_after_k(batch.batched(value), out_rank - value.val.dim())

    return batch.emit_bound(batch.node.target, {name: lift(value) for name, value in bound.items()})


# ---- ops with dim arguments --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dims:
    names: tuple[str, ...] = ("dim",)
    new: bool = False  # the dim indexes the output (unsqueeze, stack): valid range is rank + 1
    reduction: bool = False  # None or [] means every dim


_REDUCE = _Dims(reduction=True)
_DIM_OPS: dict[Any, _Dims] = {
    aten.mean.dim: _REDUCE, aten.sum.dim_IntList: _REDUCE, aten.amax.default: _REDUCE, aten.amin.default: _REDUCE,
    aten.var.correction: _REDUCE, aten.var.dim: _REDUCE, aten.prod.dim_int: _Dims(),
    aten._softmax.default: _Dims(), aten._log_softmax.default: _Dims(), aten.cumsum.default: _Dims(),
    aten.slice.Tensor: _Dims(), aten.select.int: _Dims(), aten.split.Tensor: _Dims(),
    aten.split_with_sizes.default: _Dims(), aten.unbind.int: _Dims(), aten.squeeze.dim: _Dims(),
    aten.squeeze.dims: _Dims(), aten.flip.default: _Dims(("dims",)), aten.transpose.int: _Dims(("dim0", "dim1")),
    aten.index_select.default: _Dims(), aten.cat.default: _Dims(), aten.unsqueeze.default: _Dims(new=True),
    aten.stack.default: _Dims(new=True),
}  # fmt: skip


def _shifted(value: Any, rank: int, spec: _Dims, what: str) -> Any:
    """A branch's dim argument for the batched op: every dim made non-negative, then + 1 (K comes first)."""
    if spec.reduction and (value is None or (isinstance(value, (list, tuple)) and len(value) == 0)):
        if rank == 0:
            raise BatchError(f"{what} of a 0-d value")
        return list(range(1, rank + 1))
    if isinstance(value, (list, tuple)):
        return [_shifted(v, rank, _Dims(spec.names, spec.new), what) for v in value]
    limit = rank + 1 if spec.new else rank
    if not isinstance(value, int) or limit == 0 or not -limit <= value < limit:
        raise BatchError(f"{what} with dim {value} on a rank-{rank} value")
    return value % limit + 1


def _dim_op(batch: Batch, bound: dict) -> fx.Node:
    spec = _DIM_OPS[batch.node.target]
    what = op_name(batch.node)
    if "tensors" in bound:  # cat / stack: every input becomes [K, ...]
        ranks = {op.val.dim() if isinstance(op, Operand) else -1 for op in bound["tensors"]}
        if len(ranks) != 1 or -1 in ranks:
            raise BatchError(f"{what} of inputs of different ranks")
        rank = ranks.pop()
        bound["tensors"] = [batch.batched(op) for op in bound["tensors"]]
    else:
        rank = _self(batch, bound).val.dim()
        bound["self"] = bound["self"].node
    if batch.node.target is aten.index_select.default:  # the index must be the same for every branch
        bound["index"] = _shared_index(bound["index"], what)
    for name in spec.names:
        bound[name] = _shifted(bound[name], rank, spec, what)
    return batch.emit_bound(batch.node.target, bound)


def _full_reduction(batch: Batch, bound: dict) -> fx.Node:
    """`mean(x)`/`sum(x)` over every dim: the dim overload over dims 1..r (K is kept)."""
    x = _self(batch, bound)
    if x.val.dim() == 0:
        raise BatchError(f"{op_name(batch.node)} of a 0-d value")
    target = aten.mean.dim if batch.node.target is aten.mean.default else aten.sum.dim_IntList
    dims = list(range(1, x.val.dim() + 1))
    dtype = {"dtype": bound["dtype"]} if bound.get("dtype") is not None else {}
    return batch.emit(target, (x.node, dims), dtype)


def _squeeze_all(batch: Batch, bound: dict) -> fx.Node:
    """`squeeze(x)` drops the unit dims of a branch; the batched op names them (K must stay). The dims of static
    size 1 are dropped for sure; the branch's output rank shows that no symbolic size was 1."""
    x = _self(batch, bound)
    dims = [i + 1 for i, s in enumerate(x.val.shape) if isinstance(s, int) and s == 1]
    if tensor_val(batch.node).dim() != x.val.dim() - len(dims):
        raise BatchError("squeeze of a symbolic size that may be 1")
    return batch.emit(aten.squeeze.dims, (x.node, dims))


# ---- views -------------------------------------------------------------------------------------------------------


def _reshape(batch: Batch, bound: dict) -> fx.Node:
    """`view`/`_unsafe_view`/`reshape` to `[K, *size]`, emitted as `reshape`: the batched value is a strided
    view of the fused GEMM output, for which a `view` may not exist (the values are the same either way)."""
    x = _self(batch, bound)
    size = bound.get("size", bound.get("shape"))
    return batch.emit(aten.reshape.default, (x.node, [batch.k, *size]))


def _expand(batch: Batch, bound: dict) -> fx.Node:
    """`expand` aligns sizes from the right: the branch value first gets the target's rank (unit dims after K)."""
    x = _self(batch, bound)
    pad = len(bound["size"]) - x.val.dim()
    if pad < 0:
        raise BatchError("expand to a lower rank")
    node = batch.unsqueezed_after_k(x.node, pad)
    return batch.emit(aten.expand.default, (node, [-1, *bound["size"]]))


def _permute(batch: Batch, bound: dict) -> fx.Node:
    x = _self(batch, bound)
    rank = x.val.dim()
    dims = bound["dims"]
    if len(dims) != rank or sorted(d % rank for d in dims) != list(range(rank)):
        raise BatchError(f"permute {dims} of a rank-{rank} value")
    return batch.emit(aten.permute.default, (x.node, [0] + [d % rank + 1 for d in dims]))


# ---- advanced indexing -------------------------------------------------------------------------------------------


def _shared_index(op: Any, what: str) -> fx.Node:
    if not isinstance(op, Operand):
        raise BatchError(f"{what} with a non-tensor index")
    if op.kind != "shared":
        raise BatchError(f"{what} with an index that differs between branches")
    if op.val.dtype in (torch.bool, torch.uint8):
        raise BatchError(f"{what} with a boolean mask (data-dependent shape)")
    return op.node


def _index(batch: Batch, bound: dict) -> fx.Node:
    """`x[indices]` with integer index tensors shared by all branches, as `x_K[None, *indices]`.

    Advanced indexing puts the broadcast index dims where the first index tensor was when the index tensors are
    adjacent, and first of all when a slice separates them (`k[i0, :, i2]`). In the batched op the leading `None`
    keeps adjacent indices adjacent (K stays first); separated ones put their b broadcast dims before K, and a
    permute moves K back to the front.
    """
    x = _self(batch, bound)
    what = op_name(batch.node)
    entries = [None if op is None else _shared_index(op, what) for op in bound["indices"]]
    new = batch.emit(aten.index.Tensor, (x.node, [None, *entries]))
    positions = [i for i, e in enumerate(entries) if e is not None]
    if not positions or positions[-1] - positions[0] + 1 == len(positions):
        return new
    b = max(op.val.dim() for op in bound["indices"] if op is not None)
    rank = tensor_val(new).dim()
    return batch.emit(aten.permute.default, (new, [b, *range(b), *range(b + 1, rank)]))


_RULES: dict[Any, Rule] = {
    **dict.fromkeys(_DIM_OPS, _dim_op),
    aten.mean.default: _full_reduction,
    aten.sum.default: _full_reduction,
    aten.squeeze.default: _squeeze_all,
    aten.view.default: _reshape,
    aten._unsafe_view.default: _reshape,
    aten.reshape.default: _reshape,
    aten.expand.default: _expand,
    aten.permute.default: _permute,
    aten.index.Tensor: _index,
}


def rule_for(target: Any) -> Rule | None:
    """The batching rule for an op overload, or None when there is none (the op ends a branch region)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if target in _RULES:
        return _RULES[target]
    schema = target._schema
    single_output = len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
    if target.overloadpacket in _POINTWISE and single_output and not schema.is_mutable:
        return _pointwise
    return None
