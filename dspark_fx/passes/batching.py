"""Batching rules: rewrite one branch's op so that it runs on all K branches at once (a leading dim of K).

Every tensor that a branch computes from its GEMM block gets a new leading dimension of size K in the batched
graph. An op of one branch is rewritten by its *kind* (`batch_rules.py` holds the rules):

| kind        | ops (aten)                                             | rewrite                                      |
|-------------|--------------------------------------------------------|----------------------------------------------|
| pointwise   | add, mul, rsqrt, pow, convert_element_type, where, ... | batched operands get unit dims after K so    |
|             |                                                        | they broadcast; per-branch leaves are        |
|             |                                                        | stacked `[K, ...]`; shared operands as is    |
| dim         | mean, sum, amax, var, slice, select, unsqueeze, cat,   | dims made non-negative, then + 1; a          |
|             | split, unbind, transpose, softmax, ...                 | reduction over all dims lists dims 1..r      |
| shape       | view, reshape, _unsafe_view                            | `reshape` to `[K, *size]` (the batched input |
|             |                                                        | is a strided view, a `view` may not exist)   |
| expand      | expand                                                 | unit dims after K up to the target rank,     |
|             |                                                        | then `[-1, *size]`                           |
| permute     | permute                                                | `[0] + [d + 1 ...]`                          |
| index       | index.Tensor with shared integer indices               | `[None] + indices`; indices separated by a   |
|             |                                                        | slice put their dims first, so K is permuted |
|             |                                                        | back to the front                            |
| getitem     | getitem of a split/unbind                              | unchanged                                    |

Every rule states its preconditions and raises `BatchError` with a reason when they do not hold, and `batch_op`
then checks the result of every rule: dtype and the *full* shape must be `[K] + the branch's shape` (each
element, for split/unbind). Anything else (GEMMs, mutations, ops mixing branches) is not batchable and ends a
branch's region.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dspark_fx.passes.batch_rules import Batch, BatchError, Operand, rule_for
from dspark_fx.passes.graph_utils import op_name

__all__ = ["RULE_CHECK", "BatchError", "Operand", "batch_op", "check_batched", "is_batchable"]

RULE_CHECK = "rule check failed:"  # a rule emitted a value that is not [K] + the branch's: caught, but a rule bug


def is_batchable(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target is operator.getitem or rule_for(node.target) is not None


def batch_op(graph: fx.Graph, node: fx.Node, args: tuple, kwargs: dict, k: int) -> fx.Node:
    """Emit the batched version of `node` (one branch's op). `args`/`kwargs` are the node's arguments with each
    tensor argument replaced by an `Operand`. Raises `BatchError` when the result would not be, for every branch,
    exactly what the branch's op computed."""
    batch = Batch(graph, node, k)
    if node.target is operator.getitem:
        source, index = args
        if not isinstance(source, Operand) or source.kind != "batched":
            raise BatchError("getitem of a value that is not batched")
        new = batch.emit(operator.getitem, (source.node, index))
    else:
        rule = rule_for(node.target)
        if rule is None:
            raise BatchError(f"no batching rule for {op_name(node)}")
        new = rule(batch, bind(node.target, args, kwargs))
    check_batched(new, node, k)
    return new


def bind(target: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in (a rule must see `dim=0` even when it was omitted)."""
    bound = {}
    for i, argument in enumerate(target._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def check_batched(new: fx.Node, node: fx.Node, k: int) -> None:
    """The batched value must be, element by element, `[K] + the branch's shape` with the branch's dtype."""
    want, got = node.meta.get("val"), new.meta.get("val")
    wants = list(want) if isinstance(want, (list, tuple)) else [want]
    gots = list(got) if isinstance(got, (list, tuple)) else [got]
    if isinstance(want, (list, tuple)) != isinstance(got, (list, tuple)) or len(wants) != len(gots):
        raise BatchError(
            f"{RULE_CHECK} batched {op_name(node)} gives {_describe(got)}, expected [{k}] + {_describe(want)}"
        )
    for w, g in zip(wants, gots, strict=True):
        if not isinstance(w, torch.Tensor) or not isinstance(g, torch.Tensor):
            raise BatchError(f"{op_name(node)} has a non-tensor value")
        if not same_shape(g.shape, (k, *w.shape)):
            raise BatchError(
                f"{RULE_CHECK} batched {op_name(node)} gives {_describe(got)}, expected [{k}] + {_describe(want)}"
            )
        if g.dtype != w.dtype:  # a 0-d operand (a full reduction, a scalar parameter) no longer is 0-d
            raise BatchError(f"type promotion: batched {op_name(node)} computes {g.dtype}, the branch {w.dtype}")


def same_shape(a: tuple, b: tuple) -> bool:
    """Equal shapes, comparing symbolic sizes without adding guards (unknown counts as different)."""
    if len(a) != len(b):
        return False
    return all(
        x == y if isinstance(x, int) and isinstance(y, int) else statically_known_true(x == y)
        for x, y in zip(a, b, strict=True)
    )


def _describe(val: object) -> str:
    if isinstance(val, torch.Tensor):
        return f"{val.dtype}{list(val.shape)}"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in val) + ")"
    return type(val).__name__
