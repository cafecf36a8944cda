"""An Inductor lowering for `aten.sym_storage_offset`, so that an op writing into a view keeps the view's offset.

Inductor (torch 2.11 to 2.13) lowers `aten.sym_size.int` and `aten.sym_stride.int` to the values recorded on their
graph nodes, but has no lowering for `aten.sym_storage_offset`: it runs the op on a tensor rebuilt from the layout's
sizes and strides, whose storage offset is always 0. Under dynamic shapes, the graph a mutating custom op gets after
Inductor's re-inplacing spells each written view as `as_strided(base, size, stride, sym_storage_offset(view))`, so a
view such as `buf[1]` of a `[2, S, ...]` buffer with a symbolic `S` reached the op at offset 0: the op wrote `buf[0]`.
Nothing raises (a `dspark` op whose written views should not overlap finds them overlapping and refuses the call;
one with a single written view writes the wrong rows). With static shapes the offset is a number and nothing goes
wrong.

`ensure_storage_offset_lowering()` registers the missing lowering, which reads the offset recorded on the node as
the size and stride lowerings do. It runs from every `dspark` fake impl (`custom_ops._library.register_op`), i.e.
whenever a graph with these ops is traced (Dynamo, AOTAutograd, export: torch 2.13 runs the fake impl only while
Dynamo traces, before Inductor is imported), and registers once per process; it imports Inductor's lowering module
to do so (about a second, once). The lowering is Inductor's for every op in the process from then on: it only makes
the symbolic offset the value the graph recorded, which is what eager computes.
"""

from __future__ import annotations

import torch

__all__ = ["ensure_storage_offset_lowering", "storage_offset_lowering_registered"]

_registered = False


def storage_offset_lowering_registered() -> bool:
    """Whether this process registered the lowering."""
    return _registered


def ensure_storage_offset_lowering() -> None:
    """Register Inductor's lowering of `aten.sym_storage_offset`, once per process."""
    global _registered
    if _registered:
        return
    from torch._inductor import lowering
    from torch._inductor.virtualized import V

    def sym_storage_offset(tensor: object) -> object:
        value = V.graph.current_node.meta["val"]
        return value.node.expr if isinstance(value, torch.SymInt) else int(value)

    lowering.register_lowering(torch.ops.aten.sym_storage_offset.default)(sym_storage_offset)
    _registered = True
