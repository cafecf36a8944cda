"""Batch the per-branch ops below one fused GEMM: grow each branch's region (`branch_regions`), split the branches
into classes (`branch_classes`), lay each class's column blocks out side by side in the multi-linear output and
emit each class's batched ops (`batch_class`).

Before (branch 1 norms with another eps, so branches 0 and 2 form the class):

    y = dspark.multi_linear(ctx, [W_0, W_1, W_2], [q, q, q], [w, w, w], [None ..])
    k_0 = view(slice(y, 1, 0, w), ..);   n_0 = norm(k_0, eps=1e-6)
    k_1 = view(slice(y, 1, w, 2w), ..);  n_1 = norm(k_1, eps=1e-5)
    k_2 = view(slice(y, 1, 2w, 3w), ..); n_2 = norm(k_2, eps=1e-6)

After:

    y = dspark.multi_linear(ctx, [W_0, W_2, W_1], [q, q, q], [w, w, w], [None ..])     # the class first
    n = norm(reshape(permute(view(slice(y, 1, 0, 2w), [-1, 2, w]), [1, 0, 2]), ..), eps=1e-6)
    n_0 = select(n, 0, 0);  n_2 = select(n, 0, 1)
    k_1 = view(slice(y, 1, 2w, 3w), ..); n_1 = norm(k_1, eps=1e-5)                      # its own ops

A branch in no class, or in a class whose batching fails, keeps its own ops (reported with the reason); an
unexpected error is logged as a warning and leaves those branches unbatched, never a failed compile.

On CUDA a class whose values end only in cache writes (the K/V writes that `kv_write` did not lower; through
pointwise, view, reduction or gather ops) keeps its per-branch ops: Inductor fuses each branch's norm/RoPE into its
write kernel (and the branches' kernels with each other), while a batched copy is stored and read again by the
writes, and its index math, once a `reshape` merges the branch dim with the token count, divides by the symbolic
token count per element. Measured on an H200
(Qwen3-8B draft, 5 layers, T = 4096) the batched copy made the fallback 1.04–1.7x slower than plain torch.compile
(BENCHMARKS.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.fx as fx

from dspark_fx.config import DsparkConfig
from dspark_fx.passes import branch_regions, gemm_branches
from dspark_fx.passes.batch_class import batch_class
from dspark_fx.passes.batching import BatchError, is_batchable
from dspark_fx.passes.branch_classes import BranchClass, select_classes
from dspark_fx.passes.branch_regions import Region
from dspark_fx.passes.graph_utils import aten, tensor_val
from dspark_fx.report import ClassReport, UnbatchedBranch

log = logging.getLogger("dspark_fx")


@dataclass(frozen=True)
class GroupBatching:
    classes: list[ClassReport]  # the classes batched
    unbatched: list[UnbatchedBranch]  # the branches that keep their own ops, and why


def batch_group(
    graph: fx.Graph, fused: gemm_branches.FusedGemm, branches: list[gemm_branches.GemmBranch], config: DsparkConfig
) -> GroupBatching:
    """Batch the identical per-branch ops of the branches of `fused` (one per `branches`, in that order)."""
    try:
        tainted = branch_regions.descendants(graph, [fused.node])
        regions = [branch_regions.grow_region(graph, block, tainted) for block in fused.blocks]
        selection = select_classes(regions, [b.row_count for b in branches], config)
    except Exception as err:  # analysis only: the graph is unchanged, every branch keeps its own ops
        log.warning("dspark_fx: unexpected error while comparing branches", exc_info=True)
        why = f"unexpected {type(err).__name__} while comparing branches: {err}"
        return GroupBatching([], [UnbatchedBranch(i, why) for i in range(len(branches))])
    in_class = [i for cls in selection.classes for i in cls.members]
    order = in_class + [i for i in range(len(branches)) if i not in in_class]
    gemm_branches.reorder_blocks(fused, branches, order)
    classes, unbatched = [], list(selection.unbatched)
    on_cuda = tensor_val(fused.node).device.type == "cuda"
    for cls in selection.classes:
        if on_cuda and _only_written(cls, regions):
            unbatched += [UnbatchedBranch(i, WRITTEN_PER_BRANCH) for i in cls.members]
            continue
        try:
            classes.append(batch_class(graph, fused, regions, cls))
        except BatchError as err:
            unbatched += [UnbatchedBranch(i, f"batching failed: {err}") for i in cls.members]
        except Exception as err:  # a rule bug must not break the compile: these branches keep their own ops
            log.warning("dspark_fx: unexpected error while batching branches %s", cls.members, exc_info=True)
            why = f"batching failed: unexpected {type(err).__name__}: {err}"
            unbatched += [UnbatchedBranch(i, why) for i in cls.members]
    return GroupBatching(classes, unbatched)


WRITTEN_PER_BRANCH = (
    "kept per branch on CUDA: its values end only in cache writes, and Inductor fuses each branch's ops into its "
    "write (a batched copy would be stored and read again)"
)
_WRITES = (
    aten.index_put.default,
    aten.index_put_.default,
    aten.index_copy.default,
    aten.index_copy_.default,
    aten.slice_scatter.default,
    aten.select_scatter.default,
    aten.copy_.default,
)
_COMPLEX_VIEWS = (aten.view_as_complex.default, aten.view_as_real.default)


def _only_written(cls: BranchClass, regions: list[Region]) -> bool:
    """Whether everything computed from the class's branches ends in cache writes (through ops Inductor fuses)."""
    return all(_ends_in_writes(regions[member]) for member in cls.members)


def _ends_in_writes(region: Region) -> bool:
    """Whether every value computed from `region` outside it is written to a cache, through pointwise, view,
    reduction or gather ops (those of the batching rules, complex views): nothing reaches the graph's outputs or a
    kernel that reads it from memory (a GEMM, a custom op)."""
    seen = set(region.members)
    stack = [user for node in region.nodes for user in node.users if user not in seen]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target in _WRITES and node.args[0] not in seen:  # writes a computed value into a cache
            continue
        if node.op != "call_function" or not (is_batchable(node) or node.target in _COMPLEX_VIEWS):
            return False
        stack.extend(node.users)
    return True
