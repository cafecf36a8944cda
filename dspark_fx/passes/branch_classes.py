"""Split the branches of one fused GEMM into classes of branches that compute the same ops (analysis only).

Regions (per-branch ops after the GEMM, `branch_regions`) of branches 0..3, where branch 2 norms with another eps
and branch 3 ends in a masked cache write:

    0: view → pow → mean → add(1e-6) → rsqrt → mul → mul(w_0) → cat ...
    1: view → pow → mean → add(1e-6) → rsqrt → mul → mul(w_1) → cat ...
    2: view → pow → mean → add(1e-5) ...                                    (differs from the add on)
    3: view → pow → mean → add(1e-6) → rsqrt → mul → mul(w_3) → cat ... → where

Classes: {0, 1, 3} sharing branch 0's ops (branch 3's `where` stays its own), and branch 2 alone, unbatched ("its
ops differ from branch 0's: aten.add ... has no equal counterpart"). Had branch 1's norm weight been above
`max_leaf_numel` elements, the class would share the ops up to the `mul(w)`, which would stay per branch, with the
reason in `BranchClass.kept`. Nothing in the graph changes here; `batch_class` emits the batched ops of each class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from dspark_fx.config import DsparkConfig
from dspark_fx.passes.branch_regions import Alignment, Region, align
from dspark_fx.passes.graph_utils import op_name
from dspark_fx.report import UnbatchedBranch


@dataclass(frozen=True)
class BranchClass:
    """Branches to batch together: `members[0]` is the reference branch, `alignments[i]` maps its ops to those of
    `members[i]` (None for the reference itself), `shared_ops` are the reference ops every member computes."""

    members: list[int]  # indices into the group's branches
    alignments: list[Alignment | None]
    shared_ops: frozenset[fx.Node]
    # reference ops right after the shared ones that some member computes differently, and why: they stay per
    # branch with every op after them (the report's "kept per branch" lines)
    kept: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClassSelection:
    classes: list[BranchClass]
    unbatched: list[UnbatchedBranch]  # branches with ops of their own in no class, with the first difference


def select_classes(regions: list[Region], widths: list[int], config: DsparkConfig) -> ClassSelection:
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
        alignments = {j: align(ref, regions[j], config.max_leaf_numel) for j in others}
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
        kept = _first_differences(ref, shared_ops, {j: alignments[j] for j in members})
        classes.append(BranchClass([r, *members], [None] + [alignments[j] for j in members], shared_ops, kept))
    for i, region in enumerate(regions):
        if i not in assigned and len(region.nodes) > 1:
            j, why = first_miss.get(i, (None, "no other branch with the same output width computes the same ops"))
            unbatched.append(UnbatchedBranch(i, f"its ops differ from branch {j}'s: {why}" if j is not None else why))
    return ClassSelection(classes, unbatched)


def _first_differences(
    ref: Region, shared_ops: frozenset[fx.Node], alignments: dict[int, Alignment]
) -> tuple[str, ...]:
    """For each reference op outside `shared_ops` whose inputs are all shared (or from outside the region), the
    member that computes it differently and why."""
    out = []
    for node in ref.nodes:
        if node in shared_ops or any(i in ref.members and i not in shared_ops for i in node.all_input_nodes):
            continue
        j, alignment = next((j, a) for j, a in alignments.items() if node not in a.mapping)
        why = alignment.differences.get(node) or f"branch {j} computes another op here"
        out.append(f"{op_name(node)} ({node.name}): {why}")
    return tuple(out)
