"""Emit the batched ops of one class of identical branches and point the branches' consumers at their slices.

Before (branches 0 and 1 of a class, column blocks of the multi-linear output `y`):

    k_0 = view(slice(y, 1, 0, w), [-1, h, d]);   n_0 = mul(k_0, w_0)   ->  consumers of n_0
    k_1 = view(slice(y, 1, w, 2w), [-1, h, d]);  n_1 = mul(k_1, w_1)   ->  consumers of n_1

After:

    kv = permute(view(slice(y, 1, 0, 2w), [-1, 2, w]), [1, 0, 2])        # [K, T, w], no copy
    k  = reshape(kv, [2, -1, h, d]);  n = mul(k, unsqueeze(unsqueeze(cat([w_0[None], w_1[None]]), 1), 1))
    consumers of n_0 read select(n, 0, 0); consumers of n_1 read select(n, 0, 1)

A batched value that leaves as a narrowing cast of a `cat` (fp32 RoPE halves cast to bf16 for the cache writes) is
emitted as the `cat` of the cast halves: the same values, and the batched kernel stores bf16 rows, not fp32 ones.

The per-branch values are strided slices of batched ones (the fusion turns the views below them into reshapes);
a value read through `as_strided` depends on its storage layout and is never batched. An op that no rule can
batch stays per branch with every op after it (the class batches the ops before it, the report says why).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.utils._pytree import tree_flatten, tree_unflatten

from dspark_fx.passes.batching import BatchError, Operand, batch_op
from dspark_fx.passes.branch_classes import BranchClass
from dspark_fx.passes.branch_regions import Region
from dspark_fx.passes.gemm_branches import FusedGemm
from dspark_fx.passes.graph_utils import aten, call, op_name, reads_storage_layout, tensor_val
from dspark_fx.report import ClassReport

prims = torch.ops.prims


@dataclass
class _Exit:
    """A value that leaves the batched ops: reference op `node`'s counterpart in class member `member` (an index
    into the class) is read by `users` outside the class; they will read `select(batched, 0, member)`."""

    node: fx.Node
    member: int
    users: list[fx.Node]


def batch_class(graph: fx.Graph, fused: FusedGemm, regions: list[Region], cls: BranchClass) -> ClassReport:
    """Batch a class (its column blocks are adjacent in `fused`). An op that no rule can batch stays per branch
    with every op after it (the class batches the ops before it); `BatchError` when no op is left to batch."""
    kept = list(cls.kept)
    while True:
        try:
            ops = _emit(graph, fused, regions, cls)
        except BatchError as err:
            if err.node not in cls.shared_ops:
                raise
            kept.append(f"{op_name(err.node)} ({err.node.name}): {err}")
            cls = replace(cls, shared_ops=cls.shared_ops - _with_dependents(err.node, regions[cls.members[0]]))
            if len(cls.shared_ops) < 2:  # only the GEMM block itself
                raise BatchError("; ".join(kept)) from None
            continue
        stable_topological_sort(graph)  # batched ops may read shared values defined after the class's first op
        return ClassReport(cls.members, ops, kept)


def _with_dependents(node: fx.Node, region: Region) -> set[fx.Node]:
    out = {node}
    for other in region.nodes:
        if any(i in out for i in other.all_input_nodes):
            out.add(other)
    return out


def _emit(graph: fx.Graph, fused: FusedGemm, regions: list[Region], cls: BranchClass) -> list[str]:
    """Batch the ops `cls.shared_ops` of the reference branch `cls.members[0]` for all members; returns the
    batched op names. On `BatchError` (naming the op it is about) or any other error the graph is left as it was."""
    members, alignments, shared_ops, blocks = cls.members, cls.alignments, cls.shared_ops, fused.blocks
    k = len(members)
    ref = regions[members[0]]
    nodes = [n for n in ref.nodes[1:] if n in shared_ops]
    start, stop = int(blocks[members[0]].args[2]), int(blocks[members[0]].args[3])
    counterparts = [{n: n for n in ref.nodes}] + [a.mapping for a in alignments[1:]]
    images = [{c[n] for n in shared_ops} for c in counterparts]
    exits = [
        _Exit(node, idx, [u for u in c[node].users if u not in images[idx]])
        for node in nodes
        for idx, c in enumerate(counterparts)
    ]
    exits = [e for e in exits if e.users]
    for e in exits:
        if tensor_val(e.node) is None:
            raise BatchError("a non-tensor value leaves the batched ops", e.node)
        if reads_storage_layout(counterparts[e.member][e.node]):
            raise BatchError("read through as_strided or a dtype view (its storage layout)", e.node)
    existing = set(graph.nodes)
    try:
        with graph.inserting_before(ref.nodes[1]):
            cols = call(graph, aten.slice.Tensor, (fused.node, 1, start, start + k * (stop - start)))
            viewed = call(graph, aten.view.default, (cols, [-1, k, stop - start]))
            batched = {ref.root: call(graph, aten.permute.default, (viewed, [1, 0, 2]))}
            for node in nodes:
                args, kwargs = _operands(node, [c[node] for c in counterparts], ref, batched)
                try:
                    batched[node] = batch_op(graph, node, args, kwargs, k)
                except BatchError as err:
                    err.node = err.node or node
                    raise
            for e in exits:
                batched[e.node] = _narrowed_before_cat(graph, batched[e.node])
            views = [call(graph, aten.select.int, (batched[e.node], 0, e.member)) for e in exits]
    except Exception:
        for node in reversed(list(graph.nodes)):
            if node not in existing and not node.users:
                graph.erase_node(node)
        raise
    for e, view in zip(exits, views, strict=True):
        for user in e.users:
            user.replace_input_with(counterparts[e.member][e.node], view)
    for member in members:
        for node in reversed(regions[member].nodes):
            if not node.users:
                graph.erase_node(node)
    return [op_name(n) for n in nodes]


_PASS_THROUGH = (aten.clone.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _narrowed_before_cat(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """`node`, or for a narrowing cast of a `cat` (through clones and views) read by nothing else, the `cat` of the
    cast parts, viewed as before (the same values). The batched value leaves for per-branch writes: Inductor inlines
    the cheap cast into each writer and stores the value before it, so casting before the `cat` halves what the
    batched kernel stores and the writers read (bf16 instead of fp32 rows)."""
    if node.target is not prims.convert_element_type.default or node.users:
        return node
    chain, source = [], node.args[0]
    while source.target in _PASS_THROUGH and len(source.users) == 1 and not source.kwargs:
        chain.append(source)
        source = source.args[0]
    dtype = node.args[1]
    if source.target is not aten.cat.default or len(source.users) != 1:
        return node
    if tensor_val(source).dtype.itemsize <= dtype.itemsize:
        return node
    parts, dim = source.args[0], source.args[1] if len(source.args) > 1 else 0
    out = call(
        graph, aten.cat.default, ([call(graph, prims.convert_element_type.default, (p, dtype)) for p in parts], dim)
    )
    for op in reversed(chain):
        out = call(graph, op.target, (out, *op.args[1:]))
    for dead in (node, *chain, source):
        graph.erase_node(dead)
    return out


def _operands(node: fx.Node, member_nodes: list[fx.Node], ref: Region, batched: dict) -> tuple[tuple, dict]:
    """`node`'s arguments with each tensor argument, *position by position*, replaced by an `Operand`: batched
    (a region value), shared (the same node in every branch) or per-branch leaves. (One reference node may stand
    for different leaves at two positions: `where(c, w_0, w_0)` against `where(c, w_1, w_2)`.)"""
    flats = [tree_flatten((m.args, m.kwargs))[0] for m in member_nodes]
    flat, spec = tree_flatten((node.args, node.kwargs))
    out = []
    for pos, value in enumerate(flat):
        if isinstance(value, fx.Node) and value in ref.members:
            out.append(Operand("batched", value, batched[value]))
        elif isinstance(value, fx.Node) and tensor_val(value) is not None:
            leaves = tuple(f[pos] for f in flats)
            shared = all(leaf is value for leaf in leaves)
            out.append(Operand("shared", value, value) if shared else Operand("leaf", value, leaves=leaves))
        else:
            out.append(value)
    args, kwargs = tree_unflatten(out, spec)
    return args, kwargs
