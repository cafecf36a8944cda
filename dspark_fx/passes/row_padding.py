"""Undo the zero rows that Inductor's `pad_mm` adds to a GEMM's activation, so that the GEMMs read the activation
itself again.

On CUDA, with a static token count that is not a multiple of the alignment, Inductor's joint-graph pass `pad_mm` may
pad the activation's rows (it times both forms when the graph is compiled, so whether it pads can differ from one
compile to the next) and slice the product back to the rows it had. The K/V-write lowering and the GEMM grouping
then see every layer's projection read a padded copy, and its K/V a slice of a taller product, and keep them. This
step runs before both.

Before (per GEMM; `r` zero rows appended to `x`, `[T, K]`):

    xp = constant_pad_nd(x, [0, 0, 0, r], 0.0)
    y  = mm(xp, w)                          # or addmm(bias, xp, w), a bias of one row
    k  = slice(y, 0, 0, -r)                 # rows [0, T): exactly mm(x, w)

After:

    k  = mm(x, w)

Only that form is undone: zero padding of the rows alone (not of K), a bias that does not have those rows, and a
GEMM whose every user takes back exactly the first T rows (provably, from the shapes). Anything else stays as it is.
Like every step of the fusion, a graph in which nothing is fused is handed back as it came, padding included.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dspark_fx.passes.graph_utils import aten, call, gemm_activation, tensor_val

_GEMMS = (aten.mm.default, aten.addmm.default)


def remove_row_padding(graph: fx.Graph) -> int:
    """Rewrite every `mm`/`addmm` on a row-padded activation whose users slice the padding off (see the module
    docstring); returns how many GEMMs now read the activation itself."""
    undone = 0
    for pad in list(graph.find_nodes(op="call_function", target=aten.constant_pad_nd.default)):
        x = _rows_padded(pad)
        if x is None:
            continue
        for gemm in [u for u in pad.users if _unpaddable(u, pad, x)]:
            args = tuple(x if a is pad else a for a in gemm.args)
            with graph.inserting_before(gemm):
                plain = call(graph, gemm.target, args, dict(gemm.kwargs))
            plain.meta.update({k: v for k, v in gemm.meta.items() if k != "val"})
            for user in list(gemm.users):
                user.replace_all_uses_with(plain)
                graph.erase_node(user)
            graph.erase_node(gemm)
            undone += 1
        if not pad.users:
            graph.erase_node(pad)
    return undone


def _rows_padded(pad: fx.Node) -> fx.Node | None:
    """The activation `x` if `pad` is `constant_pad_nd(x, [0, 0, 0, r], 0)` of a 2-D `x` (zero rows appended, nothing
    else), else None."""
    x, spec = pad.args[0], pad.args[1]
    value = pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("value", 0)
    x_val = tensor_val(x)
    if x_val is None or x_val.dim() != 2 or value != 0 or len(spec) != 4 or list(spec[:3]) != [0, 0, 0]:
        return None
    return x


def _unpaddable(gemm: fx.Node, pad: fx.Node, x: fx.Node) -> bool:
    """Whether `gemm` reads `pad` as its activation only, has no bias of the padded row count, and every user of it
    is a slice of dim 0 that keeps exactly rows [0, T) of T = `x`'s rows."""
    if gemm.target not in _GEMMS or gemm_activation(gemm) is not pad:
        return False
    if sum(a is pad for a in gemm.args) != 1 or any(v is pad for v in gemm.kwargs.values()):
        return False
    rows = tensor_val(x).shape[0]
    if gemm.target is aten.addmm.default:
        bias = tensor_val(gemm.args[0])
        if bias is None or (bias.dim() == 2 and not statically_known_true(bias.shape[0] == 1)):
            return False
    return bool(gemm.users) and all(_takes_first_rows(u, rows) for u in gemm.users)


def _takes_first_rows(user: fx.Node, rows) -> bool:
    if user.target is not aten.slice.Tensor:
        return False
    dim, start, step = (
        user.args[i] if len(user.args) > i else user.kwargs.get(name, default)
        for i, name, default in ((1, "dim", 0), (2, "start", None), (4, "step", 1))
    )
    value = tensor_val(user)
    return (
        dim == 0
        and start in (0, None)
        and step == 1
        and value is not None
        and statically_known_true(value.shape[0] == rows)
    )
