"""Graph normalization that makes per-layer copies of the same computation one node.

Before (each layer re-derives the shared cos table view; positions gathers repeated):

    cos_0 = unsqueeze(cos, 1)    k_0 = mul(kn_0, cos_0)
    cos_1 = unsqueeze(cos, 1)    k_1 = mul(kn_1, cos_1)

After common-subexpression elimination of pure nodes:

    cos_u = unsqueeze(cos, 1)    k_0 = mul(kn_0, cos_u)    k_1 = mul(kn_1, cos_u)

The horizontal fusion compares branches by node identity for everything they share, so this runs first.
Mutating and random ops are never merged.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from dspark_fx.passes.graph_utils import is_pure


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_hashable(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, float):
        return ("float", repr(value))
    hash(value)
    return value


def eliminate_common_subexpressions(graph: fx.Graph) -> int:
    """Merge pure call_function nodes with the same target and arguments; returns how many were removed."""
    seen: dict[Any, fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if not is_pure(node):
            continue
        try:
            key = (node.target, _hashable(node.args), _hashable(node.kwargs))
        except TypeError:
            continue
        kept = seen.setdefault(key, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            removed += 1
    return removed
