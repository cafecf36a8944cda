"""Graph normalization that makes per-layer copies of the same computation one node.

Before (each layer re-derives the shared cos table view; positions gathers repeated):

    cos_0 = unsqueeze(cos, 1)    k_0 = mul(kn_0, cos_0)
    cos_1 = unsqueeze(cos, 1)    k_1 = mul(kn_1, cos_1)

After common-subexpression elimination of pure nodes:

    cos_u = unsqueeze(cos, 1)    k_0 = mul(kn_0, cos_u)    k_1 = mul(kn_1, cos_u)

The horizontal fusion compares branches by node identity for everything they share, so this runs first.

Only ATen/prims ops (and `getitem`, symbolic-size arithmetic) whose schema writes nothing are merged, and of those
never: random ops; allocations (`empty`, `empty_like`, ...: each is a buffer of its own that a later op may fill);
a value whose storage (itself, its base or a view of either) some op of the graph writes (an `.out` buffer, an
in-place op's input, a cache copied into), nor a value read from such storage (it differs before and after the
write). Two returned values that become one (or views of one) are returned as one and a copy: the caller gets two
tensors, as from eager (a training graph returns its saved values, too). A custom op of another
namespace may have effects its schema does not declare (a dummy-output cache write) and is never merged.
Arguments match by type as well as value: `True`, `1` and `1.0` are three keys (`x + True` on a bool tensor stays
bool, `x + 1` is int64), as are `0.0` and `-0.0`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from dspark_fx.passes.graph_utils import aten, call, is_pure, storage_family, written_args

_ALLOCATIONS = frozenset(
    (aten.empty, aten.empty_like, aten.empty_strided, aten.empty_permuted, aten.new_empty, aten.new_empty_strided)
)
_NAMESPACES = ("aten", "prims")


def _key(value: Any) -> Any:
    """A hashable key of an argument that tells types apart (True, 1 and 1.0 compare equal in Python)."""
    if isinstance(value, fx.Node):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, (float, complex)):
        return (type(value).__name__, repr(value))  # repr: -0.0 is not 0.0, and a nan matches a nan
    hash(value)
    return (type(value), value)


def _mergeable(node: fx.Node, written: set[fx.Node]) -> bool:
    if not is_pure(node) or node in written or any(i in written for i in node.all_input_nodes):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in _NAMESPACES and target.overloadpacket not in _ALLOCATIONS
    return True


def eliminate_common_subexpressions(graph: fx.Graph) -> int:
    """Merge pure call_function nodes with the same target and arguments (see the module docstring for what is
    never merged); returns how many were removed."""
    writers = [n for n in graph.nodes if written_args(n)]
    written = storage_family([*writers, *(a for n in writers for a in written_args(n))])
    apart = _output_groups(graph)
    seen: dict[Any, fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if not _mergeable(node, written):
            continue
        try:
            key = (node.target, _key(node.args), _key(node.kwargs))
        except TypeError:
            continue
        kept = seen.setdefault(key, node)
        if kept is node:
            continue
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        removed += 1
    _keep_outputs_apart(graph, apart)
    return removed


def _output_groups(graph: fx.Graph) -> list[int | None]:
    """For each returned value (flattened), the first returned value it shares storage with (itself if none)."""
    (output,) = graph.find_nodes(op="output")
    flat = tree_leaves(output.args)
    families = [storage_family([v]) if isinstance(v, fx.Node) else set() for v in flat]
    return [
        next(i for i in range(j + 1) if families[i] & families[j]) if families[j] else None for j in range(len(flat))
    ]


def _keep_outputs_apart(graph: fx.Graph, groups: list[int | None]) -> None:
    """A returned value that now shares storage with another one it did not share it with in eager (the two were
    merged, or views of merged values) is returned as a copy: the caller gets two tensors, as from eager."""
    (output,) = graph.find_nodes(op="output")
    flat, spec = tree_flatten(output.args)
    families: list[set[fx.Node]] = []
    for j, value in enumerate(flat):
        family = storage_family([value]) if isinstance(value, fx.Node) else set()
        if any(groups[i] != groups[j] and family & families[i] for i in range(j)):
            with graph.inserting_before(output):
                flat[j] = call(graph, aten.clone.default, (value,))
            family = {flat[j]}
        families.append(family)
    output.args = tree_unflatten(flat, spec)
