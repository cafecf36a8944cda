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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.fx as fx

from dspark_fx.config import DsparkConfig
from dspark_fx.passes import branch_regions, gemm_branches
from dspark_fx.passes.batch_class import batch_class
from dspark_fx.passes.batching import BatchError
from dspark_fx.passes.branch_classes import select_classes
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
    for cls in selection.classes:
        try:
            classes.append(batch_class(graph, fused, regions, cls))
        except BatchError as err:
            unbatched += [UnbatchedBranch(i, f"batching failed: {err}") for i in cls.members]
        except Exception as err:  # a rule bug must not break the compile: these branches keep their own ops
            log.warning("dspark_fx: unexpected error while batching branches %s", cls.members, exc_info=True)
            why = f"batching failed: unexpected {type(err).__name__}: {err}"
            unbatched += [UnbatchedBranch(i, why) for i in cls.members]
    return GroupBatching(classes, unbatched)
