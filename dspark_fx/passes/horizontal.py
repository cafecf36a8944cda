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

This module only drives the steps: normalize (CSE, `normalize`; Inductor's zero rows under GEMM activations
undone, `row_padding`) → GEMMs on frozen weights (Inductor freezing) in
the unfrozen shape (`frozen`) → lower cache writes (`kv_write`) → find the GEMMs grouped by activation
(`gemm_branches`) → for each group (on CUDA only up to `DsparkConfig.max_fused_rows` rows, a symbolic count
guarded, so a dynamic model compiles one graph per side of the limit): rewrite its GEMMs into one multi-linear
(`gemm_branches`), then batch the per-branch regions (`batch_group`: regions of `branch_regions`, classes of
identical branches of `branch_classes`, batched ops of each class by `batch_class` with the rules of
`batching`/`batch_rules`) → the views below a fused GEMM become reshapes (its column blocks and branch slices have
other strides) → consumers that read memory (custom ops, the outputs) get the eager strides back (`layouts`) → the
report. Anything that does not fit is left as it was and reported, and a graph in which nothing is rewritten is
handed back exactly as it came (not even normalized); an unexpected error while batching a class
leaves that class unbatched (reported, and logged as a warning), never a failed compile.
"""

from __future__ import annotations

import torch.fx as fx
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.symbolic_shapes import guard_or_true

from dspark_fx.config import DsparkConfig
from dspark_fx.passes import branch_regions, gemm_branches, kv_write
from dspark_fx.passes.batch_group import batch_group
from dspark_fx.passes.frozen import expose_frozen_weights
from dspark_fx.passes.graph_utils import aten, copy_graph, restore_graph, tensor_val, views_to_reshapes
from dspark_fx.passes.layouts import EagerLayouts
from dspark_fx.passes.names import Namer
from dspark_fx.passes.normalize import eliminate_common_subexpressions
from dspark_fx.passes.row_padding import remove_row_padding
from dspark_fx.report import FusionReport, GroupReport, KVKept, KVKeptReason, Rejection

# Devices on which a GEMM group fuses only up to `DsparkConfig.max_fused_rows` rows (measured on an H200).
ROW_LIMITED_DEVICES = ("cuda",)
# Devices on which a lone GEMM (`DsparkConfig.skinny_linears`) goes through `dspark::multi_linear`: where the op has a
# small-T kernel that beats cuBLAS and takes cuBLAS otherwise. Elsewhere the op is its reference, slower than the
# `addmm` Inductor emits and opaque to its fusions (CPU, a 256 -> 512 -> 256 MLP: 1.80x torch.compile's time at
# T = 1, 1.37x at T = 64 when routed; BENCHMARKS.md, benchmarks/lone_linears.py).
LONE_GEMM_DEVICES = ("cuda",)
# Devices on which GEMM groups fuse by default (`DsparkConfig.fuse_on_cpu` adds the CPU): where the op's CUDA path
# reads the weights faster than separate GEMMs. On CPU the op is its reference, and a draft step measured 4-18 %
# slower than under plain torch.compile (BENCHMARKS.md, "On the CPU the pass made the draft step slower").
GROUP_GEMM_DEVICES = ("cuda",)


def fuse_kv_branches(
    graph: fx.Graph, config: DsparkConfig, input_names: list[str] | None = None, is_inference: bool | None = None
) -> FusionReport:
    report = FusionReport()
    snapshot = copy_graph(graph)
    names = Namer(graph, input_names)
    eager_layouts = EagerLayouts(graph)
    eliminate_common_subexpressions(graph)
    remove_row_padding(graph)
    frozen = expose_frozen_weights(graph)
    added_terms = gemm_branches.split_added_terms(graph)
    if config.kv_write_op != "never":
        lowering = kv_write.lower_kv_writes(graph, config, names)
        returned = _writes_after_graph(graph, names, is_inference)
        report.kv_writes, report.kv_kept = lowering.lowered, lowering.kept + returned
    scan = gemm_branches.find_groups(graph, names)
    report.rejected += scan.rejected
    for group in scan.groups:
        group = gemm_branches.refresh_activation(group)
        if len(group.branches) >= config.min_branches:
            why_not = _not_fused_on_device(group, config) or _above_row_limit(group, config)
            if why_not:
                report.rejected.extend(Rejection(b.describe(names), why_not) for b in group.branches)
            else:
                report.groups.append(_fuse_group(graph, group, config, names))
        elif len(group.branches) == 1 and config.skinny_linears and _routes_lone_gemms(group):
            (branch,) = group.branches
            gemm_branches.narrow_to_used_columns(branch)
            report.routed.append(f"{branch.describe(names)} on {names.of(group.activation)}")
            gemm_branches.rewrite_group(graph, group.branches)
        else:
            why = f"{len(group.branches)} fusable GEMM(s) on {names.of(group.activation)}, fewer than min_branches"
            report.rejected.extend(Rejection(b.describe(names), why) for b in group.branches)
    if report.groups or report.routed or report.kv_writes:
        gemm_branches.rejoin_added_terms(graph, added_terms)
        fused = [n for n in graph.nodes if n.target is gemm_branches.MULTI_LINEAR]
        views_to_reshapes(list(branch_regions.descendants(graph, fused)))
        eliminate_common_subexpressions(graph)
        eager_layouts.restore(graph)
        stable_topological_sort(graph)
        graph.lint()
    else:  # nothing rewritten: the graph as it came (the normalization alone can change Inductor's kernels)
        restore_graph(graph, snapshot)
    frozen.settle(graph)
    return report


_INPUT_UPDATES = (
    aten.index_put.default,
    aten.index_copy.default,
    aten.slice_scatter.default,
    aten.select_scatter.default,
)


def _writes_after_graph(graph: fx.Graph, names: Namer, is_inference: bool | None) -> list[KVKept]:
    """Why updates of caches that the graph returns instead of writing cannot be lowered. After a training graph
    (grad enabled, a parameter or an input requiring grad) AOTAutograd writes the new values of mutated inputs; an
    inference graph writes them itself (`copy_`), and only those writes are lowered, so there a returned update is the
    model's own out-of-place update (`cache.index_put(...)` returned), which writes no cache. `is_inference`: which
    graph this is (None: not known, both are said). A backward graph's outputs are gradients: an update of an output's
    gradient (`tangents_<i>`, the gradient of a cache written with values that require grad: its written rows
    zeroed) is no cache write."""
    copied = {n.args[0] for n in graph.nodes if n.target is aten.copy_.default}
    caches = []
    for value in (a for out in graph.find_nodes(op="output") for a in out.all_input_nodes):
        base = value
        while base.target in (*_INPUT_UPDATES, aten.clone.default, aten.alias.default):
            base = base.args[0]
        tangent = base.name.startswith("tangents_")
        if value.target in _INPUT_UPDATES and base.op == "placeholder" and base not in copied and not tangent:
            caches.append(names.of(base))
    if not caches:
        return []
    returned = (
        "the model updates them out of place (the result of index_put / index_copy / a scatter is returned, the "
        "cache itself is not written), so there is no write to lower; write the cache in place (cache[loc] = k, "
        "index_put_, index_copy_) for the write to be lowered"
    )
    training = (
        "a training graph: grad is enabled and a parameter or an input requires grad, and AOTAutograd writes them "
        "after the graph, so there is no write to lower; compile under torch.no_grad() or torch.inference_mode()"
    )
    head = f"writes to {', '.join(caches)}: the graph returns their new values, it does not write them"
    if is_inference:
        return [KVKept("", KVKeptReason.RETURNED, f"{head}: {returned}")]
    if is_inference is None:
        return [KVKept("", KVKeptReason.TRAINING_GRAPH, f"{head}: either {training}; or {returned}")]
    return [KVKept("", KVKeptReason.TRAINING_GRAPH, f"{head} ({training})")]


def _routes_lone_gemms(group: gemm_branches.GemmGroup) -> bool:
    """Whether a lone GEMM on this group's activation goes through the op (`LONE_GEMM_DEVICES`)."""
    return tensor_val(group.activation).device.type in LONE_GEMM_DEVICES


def group_gemm_devices(config: DsparkConfig) -> tuple[str, ...]:
    """The device types on which GEMM groups fuse: `GROUP_GEMM_DEVICES`, and the CPU with `fuse_on_cpu`."""
    return (*GROUP_GEMM_DEVICES, "cpu") if config.fuse_on_cpu else GROUP_GEMM_DEVICES


def _not_fused_on_device(group: gemm_branches.GemmGroup, config: DsparkConfig) -> str:
    """Why a GEMM group is not fused on its activation's device (`group_gemm_devices`), or ""."""
    device = tensor_val(group.activation).device.type
    if device in group_gemm_devices(config):
        return ""
    if device == "cpu":
        return (
            "on cpu: dspark::multi_linear is its reference there, measured slower than Inductor's GEMMs, so the GEMMs "
            "stay (DsparkConfig(fuse_on_cpu=True) fuses them)"
        )
    return f"on {device}: dspark::multi_linear has no kernel there (only its reference), so the GEMMs stay"


def _above_row_limit(group: gemm_branches.GemmGroup, config: DsparkConfig) -> str:
    """Why a GEMM group on a CUDA activation with more rows than `config.max_fused_rows` is not fused, or "" for
    any other group. A symbolic row count is guarded (Dynamo keeps the graph for the side of the limit it was
    compiled for and compiles the other side's once, when a call crosses it); a data-dependent one counts as within
    the limit."""
    value = tensor_val(group.activation)
    rows = value.shape[0]
    if value.device.type not in ROW_LIMITED_DEVICES or guard_or_true(rows <= config.max_fused_rows):
        return ""
    return (
        f"rows above max_fused_rows (this graph is for {rows} > {config.max_fused_rows} rows) on CUDA: the per-layer "
        "GEMMs stay (measured faster than one fused GEMM at these sizes)"
    )


def _fuse_group(graph: fx.Graph, group: gemm_branches.GemmGroup, config: DsparkConfig, names: Namer) -> GroupReport:
    branches = group.branches
    for branch in branches:
        gemm_branches.narrow_to_used_columns(branch)
    in_features = int(tensor_val(group.activation).shape[1])
    itemsize = tensor_val(branches[0].node).dtype.itemsize
    weight_bytes = sum(b.row_count * (in_features + (b.bias is not None)) * itemsize for b in branches)
    report = GroupReport(names.of(group.activation), [b.describe(names) for b in branches], weight_bytes)
    fused = gemm_branches.rewrite_group(graph, branches)
    if config.batch_regions:
        batching = batch_group(graph, fused, branches, config)
        report.classes, report.unbatched = batching.classes, batching.unbatched
    return report
