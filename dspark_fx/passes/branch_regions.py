"""Per-branch regions after the shared GEMM, and which branches compute exactly the same thing.

A branch's *region* grows forward from its GEMM column block: a node joins while it is batchable (see
`batching.py`) and every tensor input is either in the region, a node that does not depend on the fused GEMM
(shared positions, cos/sin tables, norm weights), or a symbolic size. It stops at GEMMs, mutations (cache
writes) and ops that mix branches — including an op that reads another branch's values (dependent branches).

Two branches are *aligned* when their regions match node for node: same op, same constants (eps, rope style
as op structure), the same shared nodes, per-branch leaves of the same form (a parameter, possibly cast or
viewed, small enough to stack), and the same value shapes. An alignment may cover only part of the reference
region (nodes downstream of a difference stay unmatched); `branch_classes` picks the classes from the alignments.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch.fx as fx
from torch.utils._pytree import tree_flatten

from dspark_fx.passes.batching import is_batchable
from dspark_fx.passes.graph_utils import aten, op_name, shape_key, tensor_val

_LEAF_OPS = {
    aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.slice.Tensor, aten.expand.default,
    aten.permute.default, aten.clone.default, aten._to_copy.default, aten.squeeze.dim,
}  # fmt: skip


def leaf_signature(node: fx.Node, max_numel: int) -> str | None:
    """A description of a per-branch leaf (parameter, optionally cast/viewed), or None if it is not one."""
    val = tensor_val(node)
    if val is None or not all(isinstance(s, int) for s in val.shape) or val.numel() > max_numel:
        return None
    if node.op in ("placeholder", "get_attr"):  # a parameter, or a frozen constant
        return f"param{shape_key(node)}"
    if node.op != "call_function":
        return None
    is_cast = op_name(node) == "prims.convert_element_type"
    if node.target not in _LEAF_OPS and not is_cast:
        return None
    flat, _ = tree_flatten((node.args[1:], node.kwargs))
    if any(isinstance(a, fx.Node) for a in flat) or not isinstance(node.args[0], fx.Node):
        return None
    inner = leaf_signature(node.args[0], max_numel)
    return None if inner is None else f"{op_name(node)}({inner},{flat})"


@dataclass
class Region:
    root: fx.Node
    nodes: list[fx.Node] = field(default_factory=list)  # topological order, root first
    members: set[fx.Node] = field(default_factory=set)


def grow_region(graph: fx.Graph, root: fx.Node, tainted: set[fx.Node]) -> Region:
    """The nodes after `root` computed only from `root` and untainted inputs, by batchable ops."""
    region = Region(root, [root], {root})
    started = False
    for node in graph.nodes:
        if node is root:
            started = True
            continue
        if not started or node not in tainted or not is_batchable(node):
            continue
        inputs = node.all_input_nodes
        if any(i in region.members for i in inputs) and all(i in region.members or i not in tainted for i in inputs):
            region.nodes.append(node)
            region.members.add(node)
    return region


def descendants(graph: fx.Graph, sources: list[fx.Node]) -> set[fx.Node]:
    out = set(sources)
    for node in graph.nodes:
        if node not in out and any(i in out for i in node.all_input_nodes):
            out.add(node)
    return out


@dataclass
class Alignment:
    mapping: dict[fx.Node, fx.Node]  # reference node -> other branch's node, for every node that matched
    mismatch: str = ""  # the first reference node without a counterpart
    # why a reference node whose inputs matched has no counterpart: "" when the other branch has no op there or
    # another op, else what alone kept an equal op apart (a per-branch input above max_leaf_numel)
    differences: dict[fx.Node, str] = field(default_factory=dict)

    def covers(self, nodes: set[fx.Node]) -> bool:
        return nodes <= self.mapping.keys()


def align(ref: Region, other: Region, max_leaf_numel: int) -> Alignment:
    """Match `other`'s region to `ref`'s node for node. A node matches when an equal op of the other branch
    reads the counterparts of its inputs; nodes downstream of a difference stay unmatched."""
    alignment = Alignment({ref.root: other.root})
    mapping = alignment.mapping
    taken = {other.root}
    for node in ref.nodes[1:]:
        anchor = next((i for i in node.all_input_nodes if i in mapping), None)
        match, why = None, ""
        if anchor is not None:
            for user in mapping[anchor].users:
                if user not in other.members or user in taken:
                    continue
                difference = _op_difference(node, user, ref, mapping, max_leaf_numel)
                if difference is None:
                    match = user
                    break
                why = why or difference
            if match is None:
                alignment.differences[node] = why
        if match is None:
            alignment.mismatch = alignment.mismatch or f"{op_name(node)} ({node.name}) has no equal counterpart" + (
                f" ({why})" if why else ""
            )
            continue
        mapping[node] = match
        taken.add(match)
    if not alignment.mismatch and len(mapping) != len(other.nodes):
        alignment.mismatch = "the other branch computes more ops"
    return alignment


def _op_difference(a: fx.Node, b: fx.Node, ref: Region, mapping: dict, max_leaf_numel: int) -> str | None:
    """None when `b` computes what `a` does; otherwise "" (another op) or what alone kept them apart."""
    if a.target != b.target or shape_key(a) != shape_key(b):
        return ""
    flat_a, spec_a = tree_flatten((a.args, a.kwargs))
    flat_b, spec_b = tree_flatten((b.args, b.kwargs))
    if spec_a != spec_b:
        return ""
    for x, y in zip(flat_a, flat_b, strict=True):
        if isinstance(x, fx.Node):
            if not isinstance(y, fx.Node):
                return ""
            if x in ref.members:
                if mapping.get(x) is not y:
                    return ""
            elif x is not y:
                sig = leaf_signature(x, max_leaf_numel)
                if sig is None or sig != leaf_signature(y, max_leaf_numel):
                    return _leaf_size_difference(x, y, max_leaf_numel)
        elif type(x) is not type(y) or (repr(x) != repr(y) if isinstance(x, (float, complex)) else x != y):
            return ""  # repr: -0.0 is not 0.0 (x * -0.0 keeps signs apart), and a nan matches a nan
    return None


def _leaf_size_difference(x: fx.Node, y: fx.Node, max_leaf_numel: int) -> str:
    """Why per-branch inputs `x` and `y` did not match, when only their size did it ("" otherwise)."""
    unbounded = leaf_signature(x, sys.maxsize)
    if unbounded is None or unbounded != leaf_signature(y, sys.maxsize):
        return ""
    numel = tensor_val(x).numel()
    return f"a per-branch input of {numel} elements, above max_leaf_numel ({max_leaf_numel}), is not stacked"
