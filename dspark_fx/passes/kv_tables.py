"""The op's cos/sin table operands for a proven rotation: the model's table as it is, or rows built in the graph.

`kv_spec` gives, per layer, the per-token cos and sin expressions `[tokens, R/2]` the op's table rows must hold.

- Direct: every cos element is element `i` and every sin element element `R/2 + i` of row `index[t]` of one fp32
  `[P, R]` placeholder read by `table[index]` (`index_select`, `embedding`), with one 1-D `index` for all layers:
  the op gets the tables and `index` as they are (the op's layout: `[cos | sin]` halves).
- Built: otherwise both halves are found in values the graph computes (`locate`: a node whose elements, along its
  token dim from row 0 and along one other dim with a constant step, are those expressions; the other dims fixed):
  the op gets `cat(cos rows, sin rows)` in fp32, `[T, R]`, read at `arange(T)`. Whatever the graph computed
  (gathered from any table, computed from `inv_freq` and the positions, a complex table's real and imaginary
  parts, cast to the model dtype) is what the op reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from dspark_fx.passes.batching import same_shape
from dspark_fx.passes.graph_utils import aten, call, tensor_val
from dspark_fx.passes.kv_symbolic import Evaluation, Sym

prims = torch.ops.prims


def direct_table(ev: Evaluation, cos: np.ndarray, sin: np.ndarray) -> tuple[fx.Node, fx.Node] | None:
    """`(table, index)` if the rows are `table[index]` in the op's layout, else None."""
    alg = ev.alg
    half = cos.shape[1]
    found: set[tuple[fx.Node, fx.Node]] = set()
    for t in range(cos.shape[0]):
        rows = set()
        for i in range(half):
            for e, col in ((cos[t, i], i), (sin[t, i], half + i)):
                atom = alg.single_atom(int(e))
                if atom is None or atom[0] != "gather" or atom[3] != col:
                    return None
                rows.add(atom[2])
                found.add((atom[1], ev.gathers[alg.atom_id(atom)]))
        if len(rows) != 1:
            return None
    if len(found) != 1:
        return None
    ((table, index),) = found
    table_val, index_val = tensor_val(table), tensor_val(index)
    if table.op not in ("placeholder", "get_attr") or table_val.dim() != 2 or table_val.dtype != torch.float32:
        return None
    if table_val.shape[1] != 2 * half or index_val is None or index_val.dim() != 1:
        return None
    return table, index


@dataclass(frozen=True)
class Located:
    """`count` elements of `node` (its real view if complex): row `t` along `token_dim`, element `i` at
    `index[col_dim] + i * step` along `col_dim`, every other dim at `index`."""

    node: fx.Node
    complex: bool
    index: tuple[int, ...]
    token_dim: int
    col_dim: int
    step: int
    count: int


def locate(ev: Evaluation, ids: np.ndarray, tokens: Any) -> Located | None:
    """A computed value holding `ids` (`[tokens, count]` expression ids) as a strided block, else None. The value
    evaluated last is taken first: the one nearest the rotation (e.g. cos after its cast to the model dtype, which
    is what eager multiplies by)."""
    for node, sym in reversed(ev.memo.items()):
        if not isinstance(sym, Sym) or sym.ids.ndim < 2:
            continue
        found = _block(sym, ids)
        if found is not None and _is_token_dim(node, sym, found[1], tokens):
            index, token_dim, col_dim, step = found
            return Located(node, sym.complex, index, token_dim, col_dim, step, ids.shape[1])
    return None


def _block(sym: Sym, ids: np.ndarray) -> tuple[tuple[int, ...], int, int, int] | None:
    arr = sym.ids
    rows, count = ids.shape
    for start in np.argwhere(arr == ids[0, 0])[:8]:
        start = tuple(int(s) for s in start)
        for token_dim in range(arr.ndim):
            if start[token_dim] != 0 or arr.shape[token_dim] != rows:
                continue
            for col_dim in range(arr.ndim):
                if col_dim == token_dim:
                    continue
                for step in _steps(arr, start, col_dim, ids[0, 1] if count > 1 else None):
                    if _holds(arr, ids, start, token_dim, col_dim, step):
                        return start, token_dim, col_dim, step
    return None


def _steps(arr: np.ndarray, start: tuple[int, ...], col_dim: int, second: Any) -> list[int]:
    if second is None:
        return [1]
    line = list(start)
    out = []
    for pos in range(start[col_dim] + 1, arr.shape[col_dim]):
        line[col_dim] = pos
        if arr[tuple(line)] == second:
            out.append(pos - start[col_dim])
    return out


def _holds(arr: np.ndarray, ids: np.ndarray, start: tuple, token_dim: int, col_dim: int, step: int) -> bool:
    rows, count = ids.shape
    if start[col_dim] + (count - 1) * step >= arr.shape[col_dim]:
        return False
    at = list(start)
    for t in range(rows):
        for i in range(count):
            at[token_dim], at[col_dim] = t, start[col_dim] + i * step
            if arr[tuple(at)] != ids[t, i]:
                return False
    return True


def _is_token_dim(node: fx.Node, sym: Sym, dim: int, tokens: Any) -> bool:
    """Dim `dim` of `node`'s value is the token dim: its graph size is the activation's token count."""
    val = tensor_val(node)
    if val is None or dim >= val.dim():
        return False
    return same_shape(val.shape[dim : dim + 1], (tokens,))


def emit_rows(graph: fx.Graph, where: Located) -> fx.Node:
    """`[T, count]` rows of `where` (graph nodes inserted at the current insert point)."""
    x = where.node
    if where.complex:
        x = _real_rows(graph, x)
    rank = len(where.index)
    for d in reversed(range(rank)):
        if d not in (where.token_dim, where.col_dim):
            x = call(graph, aten.select.int, (x, d, where.index[d]))
    if where.col_dim < where.token_dim:
        x = call(graph, aten.permute.default, (x, [1, 0]))
    lo = where.index[where.col_dim]
    if (lo, where.step, where.count) != (0, 1, tensor_val(x).shape[1]):
        x = call(graph, aten.slice.Tensor, (x, 1, lo, lo + (where.count - 1) * where.step + 1, where.step))
    return x


def _real_rows(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """`view_as_real(node)`; for rows gathered from a complex table (`freqs_cis[pos]`), the same rows gathered from
    the table's real view, which Inductor generates code for (it runs complex ops as fallback kernels)."""
    if node.target is aten.index.Tensor and len(node.args[1]) == 1:
        table = call(graph, aten.view_as_real.default, (node.args[0],))
        return call(graph, aten.index.Tensor, (table, node.args[1]))
    return call(graph, aten.view_as_real.default, (node,))


def built_table(graph: fx.Graph, cos: Located, sin: Located) -> fx.Node:
    """`cat(cos rows, sin rows)` in fp32: the `[T, R]` table read at `arange(T)`."""
    table = call(graph, aten.cat.default, ([emit_rows(graph, cos), emit_rows(graph, sin)], 1))
    if tensor_val(table).dtype != torch.float32:
        table = call(graph, prims.convert_element_type.default, (table, torch.float32))
    return table
