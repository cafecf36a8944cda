"""The horizontal KV-branch fusion: N parallel `kv_proj → k_norm → rope` branches on one input become one GEMM
plus one batched copy of the per-branch ops.

Before (per layer l, all reading `ctx`):

    kv_l = mm(ctx, permute(slice(W_l, 0, q, q + 2kv), [1, 0]))
    k_l  = reshape(split(kv_l)[0], [-1, h, d]);  n_l = mul(mul(k_l, rsqrt(add(mean(pow(k_l, 2)), eps))), w_l)
    r_l  = add(mul(n_l, cos), mul(cat([neg(n_l[.., d/2:]), n_l[.., :d/2]]), sin))
    index_put(k_cache_l, [loc], r_l)

After:

    y  = dspark.multi_linear(ctx, [W_0 .. W_N-1], [q ..], [2kv ..], [None ..])
    kv = permute(view(slice(y, 1, 0, N * 2kv), [-1, N, 2kv]), [1, 0, 2])   # [N, T, 2kv], no copy
    r  = the same ops once on kv (views as reshapes), with cat([w_0[None] .. w_N-1[None]]) for the norm weights
    index_put(k_cache_l, [loc], select(r, 0, l))                            # per-branch outputs are views

Where the branches end in per-layer K/V cache writes, `kv_write` first replaces GEMMs, norm, RoPE and writes
of all layers by one `dspark::multi_linear_kv_write` (`DsparkConfig.kv_write_op`: by default on CUDA only, where
the op has its kernel; see that module); the GEMMs it does not take are fused as below.

Steps: normalize (CSE) → lower cache writes (`kv_write`) → group GEMMs by activation (`gemm_branches`) → rewrite
each group into one multi-linear → grow per-branch regions and split them into classes of identical branches
(`branch_regions`) → emit the batched ops of each class (`batch_class`, with the rules of `batching`/`batch_rules`)
→ the views below a fused GEMM become reshapes (its column blocks and branch slices have other strides). Anything
that does not fit is left as it was and reported; an unexpected error while batching a class leaves that class
unbatched (reported, and logged as a warning), never a failed compile.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch.fx as fx
from torch._inductor.pattern_matcher import stable_topological_sort

from dspark_fx.config import DsparkConfig
from dspark_fx.passes import branch_regions, gemm_branches, kv_write
from dspark_fx.passes.batch_class import batch_class
from dspark_fx.passes.batching import BatchError
from dspark_fx.passes.graph_utils import aten, op_name, tensor_val, views_to_reshapes
from dspark_fx.passes.normalize import eliminate_common_subexpressions
from dspark_fx.report import ClassReport, FusionReport, GroupReport, Rejection

log = logging.getLogger("dspark_fx")


def fuse_kv_branches(graph: fx.Graph, config: DsparkConfig, input_names: list[str] | None = None) -> FusionReport:
    report = FusionReport()
    names = _Namer(graph, input_names)
    eliminate_common_subexpressions(graph)
    if config.kv_write_op != "never":
        report.kv_writes, report.kv_kept = kv_write.lower_kv_writes(graph, config, names)
    groups: dict[tuple, list[gemm_branches.GemmBranch]] = defaultdict(list)
    for node in list(graph.nodes):
        match = gemm_branches.match_gemm(node)
        if isinstance(match, str):
            report.rejected.append(Rejection(names.weight_of(node), match))
        elif match is not None:
            groups[(match.activation, match.dtype)].append(match)
    for (activation, _), branches in groups.items():
        if len(branches) >= config.min_branches:
            report.groups.append(_fuse_group(graph, branches, config, names))
        elif len(branches) == 1 and config.skinny_linears:
            gemm_branches.narrow_to_used_columns(branches[0])
            report.routed.append(f"{_describe(branches[0], names)} on {names.of(activation)}")
            gemm_branches.rewrite_group(graph, branches)
        else:
            why = f"{len(branches)} fusable GEMM(s) on {names.of(activation)}, fewer than min_branches"
            report.rejected.extend(Rejection(_describe(b, names), why) for b in branches)
    if report.groups or report.routed or report.kv_writes:
        fused = [n for n in graph.nodes if n.target is gemm_branches.MULTI_LINEAR]
        views_to_reshapes(list(branch_regions.descendants(graph, fused)))
        eliminate_common_subexpressions(graph)
        stable_topological_sort(graph)
        graph.lint()
    return report


def _describe(branch: gemm_branches.GemmBranch, names) -> str:
    """`weight[start:stop]` (+ bias) of a GEMM branch, by parameter name."""
    rows = f"{names.of(branch.weight)}[{branch.row_start}:{branch.row_start + branch.row_count}]"
    return rows + (" + bias" if branch.bias is not None else "")


def _fuse_group(graph: fx.Graph, branches: list, config: DsparkConfig, names) -> GroupReport:
    for branch in branches:
        gemm_branches.narrow_to_used_columns(branch)
    descriptions = [_describe(b, names) for b in branches]
    in_features = int(tensor_val(branches[0].activation).shape[1])
    itemsize = tensor_val(branches[0].node).dtype.itemsize
    weight_bytes = sum(b.row_count * (in_features + (b.bias is not None)) * itemsize for b in branches)
    fused, blocks = gemm_branches.rewrite_group(graph, branches)
    report = GroupReport(names.of(branches[0].activation), descriptions, weight_bytes)
    if not config.batch_regions:
        return report
    try:
        tainted = branch_regions.descendants(graph, [fused])
        regions = [branch_regions.grow_region(graph, block, tainted) for block in blocks]
        classes, unbatched = _classes(regions, [b.row_count for b in branches], config)
    except Exception as err:  # analysis only: the graph is unchanged, every branch keeps its own ops
        log.warning("dspark_fx: unexpected error while comparing branches", exc_info=True)
        report.unbatched = [
            (i, f"unexpected {type(err).__name__} while comparing branches: {err}") for i in range(len(branches))
        ]
        return report
    report.unbatched = unbatched
    in_class = [i for members, _, _ in classes for i in members]
    order = in_class + [i for i in range(len(branches)) if i not in in_class]
    _reorder_blocks(graph, fused, blocks, branches, order)
    for members, alignments, shared_ops in classes:
        try:
            report.classes.append(_batch(graph, fused, blocks, regions, members, alignments, shared_ops))
        except BatchError as err:
            report.unbatched += [(i, f"batching failed: {err}") for i in members]
        except Exception as err:  # a rule bug must not break the compile: these branches keep their own ops
            log.warning("dspark_fx: unexpected error while batching branches %s", members, exc_info=True)
            report.unbatched += [(i, f"batching failed: unexpected {type(err).__name__}: {err}") for i in members]
    return report


def _batch(graph, fused, blocks, regions, members, alignments, shared_ops) -> ClassReport:
    """Batch a class. An op that no rule can batch stays per branch with every op after it (the class batches
    the ops before it); `BatchError` when no op is left to batch."""
    kept = []
    while True:
        try:
            ops = batch_class(graph, fused, blocks, regions, members, alignments, shared_ops)
        except BatchError as err:
            if err.node not in shared_ops:
                raise
            kept.append(f"{op_name(err.node)} ({err.node.name}): {err}")
            shared_ops = shared_ops - _with_dependents(err.node, regions[members[0]])
            if len(shared_ops) < 2:  # only the GEMM block itself
                raise BatchError("; ".join(kept)) from None
            continue
        stable_topological_sort(graph)  # batched ops may read shared values defined after the class's first op
        return ClassReport(members, ops, kept)


def _with_dependents(node: fx.Node, region: branch_regions.Region) -> set[fx.Node]:
    out = {node}
    for other in region.nodes:
        if any(i in out for i in other.all_input_nodes):
            out.add(other)
    return out


def _classes(regions, widths, config):
    """Greedy classes of branches to batch together, each with the set of reference-branch ops they share.

    For a reference branch, every other branch aligns on some set of its ops; take the largest such set that at
    least `min_branches` branches share (ties: more branches). So a layer with another eps leaves the class and
    keeps its own norm, while branches that all differ only in a tail (masked cache writes) batch the common part.
    Leftover branches are tried as references later; branches in no class are reported with the first difference.
    """
    classes, unbatched, assigned, first_miss = [], [], set(), {}
    for r, ref in enumerate(regions):
        if r in assigned or len(ref.nodes) < 2:
            continue
        others = [j for j in range(r + 1, len(regions)) if j not in assigned and widths[j] == widths[r]]
        alignments = {j: branch_regions.align(ref, regions[j], config.max_leaf_numel) for j in others}
        for j, alignment in alignments.items():
            if alignment.mismatch:
                first_miss.setdefault(r, (j, alignment.mismatch))
                first_miss.setdefault(j, (r, alignment.mismatch))
        best = None
        for candidate in dict.fromkeys(frozenset(a.mapping) for a in alignments.values()):  # deterministic order
            members = [j for j, a in alignments.items() if a.covers(candidate)]
            score = (len(candidate), len(members))
            if len(members) + 1 >= config.min_branches and len(candidate) > 1 and (best is None or score > best[0]):
                best = (score, candidate, members)
        if best is None:
            continue
        _, shared_ops, members = best
        assigned.update([r, *members])
        classes.append(([r, *members], [None] + [alignments[j] for j in members], shared_ops))
    for i, region in enumerate(regions):
        if i not in assigned and len(region.nodes) > 1:
            j, why = first_miss.get(i, (None, "no other branch with the same output width computes the same ops"))
            unbatched.append((i, f"its ops differ from branch {j}'s: {why}" if j is not None else why))
    return classes, unbatched


def _reorder_blocks(graph: fx.Graph, fused: fx.Node, blocks, branches, order) -> None:
    """Lay the multi-linear output out so that every class's column blocks are adjacent."""
    if order == list(range(len(blocks))):
        return
    new_args = list(fused.args)
    for pos in range(1, 5):
        new_args[pos] = [fused.args[pos][i] for i in order]
    fused.args = tuple(new_args)
    col = 0
    for i in order:
        width = branches[i].row_count
        blocks[i].args = (fused, 1, col, col + width)
        col += width


class _Namer:
    """Readable names for report lines: placeholders get the Dynamo input names (parameter paths) if known."""

    def __init__(self, graph: fx.Graph, input_names: list[str] | None) -> None:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.names = {}
        if input_names and len(input_names) == len(placeholders):
            self.names = {p: _clean(name) for p, name in zip(placeholders, input_names, strict=True)}

    def of(self, node: fx.Node) -> str:
        return self.names.get(node, node.name)

    def weight_of(self, gemm: fx.Node) -> str:
        """A GEMM by the inputs (parameters, buffers) its weight operand is computed from; a weight computed by
        another GEMM names that GEMM by its own weight (`aten.mm(layers.0.k_proj.weight)`)."""
        weight = gemm.args[2] if gemm.target is aten.addmm.default else gemm.args[1]
        found, stack, seen = [], [weight], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, fx.Node) or node in seen:
                continue
            seen.add(node)
            if node.op in ("placeholder", "get_attr"):
                found.append(self.of(node) if node.op == "placeholder" else str(node.target))
            elif node.target in (aten.mm.default, aten.addmm.default):
                found.append(f"{op_name(node)}({self.weight_of(node)})")
            else:
                stack += reversed(node.all_input_nodes)
        return ", ".join(found) if found else gemm.name


def _clean(name: str) -> str:
    name = next((name[2:] for p in ("L_", "l_", "G_", "g_") if name.startswith(p)), name).removeprefix("self_")
    for part in ("_modules_", "_parameters_", "_buffers_"):
        name = name.replace(part, ".")
    for part in ("modules_", "parameters_", "buffers_", "self."):
        name = name.removeprefix(part)
    return name.rstrip("_")
