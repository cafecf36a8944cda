"""The op's cos/sin table operands for a proven rotation: the model's own table or frequencies, or rows built in the
graph.

`kv_spec` gives, per layer, the per-token cos and sin expressions `[tokens, R/2]` the op's factors must be.

- Direct (`direct_table`): the op reads what the model holds, in one of its table forms (`custom_ops.linear.
  multi_linear_kv_write`), at one 1-D `index` / `positions` for all layers:
  - halves: every cos element is element `i` and every sin element element `R/2 + i` of row `index[t]` of one fp32
    `[P, R]` placeholder read by `table[index]` (`index_select`, `embedding`);
  - pairs: elements `2i` and `2i + 1` of such a row of a complex `[P, R/2]` table (`freqs_cis[pos]`; the op gets
    its real view) or an fp32 `[P, R/2, 2]` one;
  - frequencies: `cos(float(p_t) * f_i)` and `sin(...)` of `R/2` frequencies `f` (fp32, or bf16 / fp16 cast to
    fp32 for the op) and one int tensor of T positions (`positions.float() * inv_freq`, or HF's `inv_freq @
    positions` matmul): the op computes them per token.
- Built: otherwise both halves are found in values the graph computes (`locate`: a node whose elements, along its
  token dim from row 0 and along one other dim with a constant step, are those expressions; the other dims fixed):
  the op gets `cat(cos rows, sin rows)` in fp32, `[T, R]`, read at `arange(T)`. Whatever the graph computed is what
  the op reads, one more kernel before it.
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


@dataclass(frozen=True)
class Direct:
    """The model's own `source` table (form `form`) read at the 1-D positions `index` (for frequencies: a tensor of T
    positions in any shape)."""

    source: fx.Node
    index: fx.Node
    form: str

    def emit(self, graph: fx.Graph) -> tuple[fx.Node, fx.Node]:
        """(the op's table operand, its positions operand), views inserted at the current insert point."""
        table, index = self.source, self.index
        if tensor_val(table).is_complex():
            table = call(graph, aten.view_as_real.default, (table,))
        elif self.form == "frequencies":
            if tensor_val(table).dim() != 1:
                table = call(graph, aten.view.default, (table, [-1]))
            if tensor_val(table).dtype != torch.float32:  # bf16 / fp16 frequencies: fp32 holds them exactly
                table = call(graph, prims.convert_element_type.default, (table, torch.float32))
        if tensor_val(index).dim() != 1:
            index = call(graph, aten.view.default, (index, [-1]))
        return table, index


def direct_table(ev: Evaluation, cos: np.ndarray, sin: np.ndarray, tokens: Any) -> Direct | None:
    """The model's table or frequencies holding the rows in an op form, else None (`tokens`: the graph's T)."""
    half = cos.shape[1]
    for form, columns in (("halves", lambda i: (i, half + i)), ("pairs", lambda i: (2 * i, 2 * i + 1))):
        found = _gathered(ev, cos, sin, columns)
        if found is not None and _table_holds(found[0], form, half) and _is_1d_index(found[1]):
            return Direct(found[0], found[1], form)
    return _frequencies(ev, cos, sin, tokens)


def scale_of(ev: Evaluation, cos: np.ndarray, sin: np.ndarray, tokens: Any) -> float | None:
    """`c` where the cos/sin factors are `c != 1` times values the op could read (a table, frequencies, per-token
    rows the graph computes): K scaled by a constant besides its norm and rotation, which the op does not do. Else
    None."""
    alg = ev.alg
    first = alg.polys[int(cos.reshape(-1)[0])]
    if len(first) != 1 or first[0][1] in (0.0, 1.0):
        return None
    c = first[0][1]
    unscale = np.vectorize(lambda e: alg.scale(int(e), 1.0 / c), otypes=[np.int64])
    cos, sin = unscale(cos), unscale(sin)
    readable = direct_table(ev, cos, sin, tokens) is not None
    return c if readable or (locate(ev, cos, tokens) is not None and locate(ev, sin, tokens) is not None) else None


def _gathered(ev: Evaluation, cos: np.ndarray, sin: np.ndarray, columns: Any) -> tuple[fx.Node, fx.Node] | None:
    """`(table, index)` if, for every token t, cos/sin element i are the elements `columns(i)` of row `index[t]` of
    one table (one gathered row per token, read at one index node of one element per token: not, say, the first
    token's row for every token, `table[index][0]`)."""
    alg = ev.alg
    found: set[tuple[fx.Node, fx.Node]] = set()
    token_rows = []
    for t in range(cos.shape[0]):
        rows = set()
        for i in range(cos.shape[1]):
            for e, col in zip((cos[t, i], sin[t, i]), columns(i), strict=True):
                atom = alg.single_atom(int(e))
                if atom is None or atom[0] != "gather" or atom[3] != col:
                    return None
                rows.add(atom[2])
                found.add((atom[1], ev.gathers[alg.atom_id(atom)]))
        if len(rows) != 1:
            return None
        token_rows.append(rows.pop())
    if len(found) != 1:
        return None
    table, index = next(iter(found))
    index_rows = ev(index).ids.reshape(-1)
    if index_rows.size != len(token_rows) or any(int(r) != row for r, row in zip(index_rows, token_rows, strict=True)):
        return None
    return table, index


def _table_holds(table: fx.Node, form: str, half: int) -> bool:
    val = tensor_val(table)
    if table.op not in ("placeholder", "get_attr") or val is None:
        return False
    if form == "halves":
        return val.dtype == torch.float32 and val.dim() == 2 and same_shape(val.shape[1:], (2 * half,))
    if val.dtype == torch.complex64:
        return val.dim() == 2 and same_shape(val.shape[1:], (half,))
    return val.dtype == torch.float32 and val.dim() == 3 and same_shape(val.shape[1:], (half, 2))


def _is_1d_index(index: fx.Node) -> bool:
    val = tensor_val(index)
    return val is not None and val.dim() == 1


def _frequencies(ev: Evaluation, cos: np.ndarray, sin: np.ndarray, tokens: Any) -> Direct | None:
    """Every cos/sin element `cos` / `sin` of `cast_fp32(p[t]) * f[i]`: one int node `p` holding the T positions
    (element t, any shape), one fp32 node `f` of R/2 elements (element i)."""
    alg = ev.alg
    half = cos.shape[1]
    found: set[tuple[fx.Node, fx.Node]] = set()
    for t in range(cos.shape[0]):
        for i in range(half):
            angle = None
            for e, name in ((cos[t, i], "cos"), (sin[t, i], "sin")):
                atom = alg.single_atom(int(e))
                if atom is None or atom[0] != "fn" or atom[1] != name or angle not in (None, atom[2]):
                    return None
                angle = atom[2]
            parts = _angle_parts(ev, angle)
            if parts is None:
                return None
            (pos, pos_flat), (freq, freq_flat) = parts
            if pos_flat != t or freq_flat != i:
                return None
            found.add((freq, pos))
    if len(found) != 1:
        return None
    ((freq, pos),) = found
    freq_val, pos_val = tensor_val(freq), tensor_val(pos)
    if freq_val.dtype not in _FREQUENCY_DTYPES or not same_shape((freq_val.numel(),), (half,)):
        return None
    if pos_val.dtype not in (torch.int32, torch.int64) or not same_shape((pos_val.numel(),), (tokens,)):
        return None
    return Direct(freq, pos, "frequencies")


_FREQUENCY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what an fp32 angle product reads exactly


def _angle_parts(ev: Evaluation, angle: int) -> tuple[tuple[fx.Node, int], tuple[fx.Node, int]] | None:
    """`((p, t), (f, i))` if `angle` is `1.0 * cast_fp32(p[t]) * f[i]` (leaves of an int and a float node)."""
    alg = ev.alg
    poly = alg.polys[angle]
    if len(poly) != 1 or poly[0][1] != 1.0 or len(poly[0][0]) != 2:
        return None
    atoms = [alg.atoms[a] for a, k in poly[0][0] if k == 1.0]
    casts = [a for a in atoms if a[0] == "cast" and a[1] == str(torch.float32)]
    leaves = [a for a in atoms if a[0] == "leaf"]
    if len(casts) != 1 or len(leaves) != 1:
        return None
    inner = alg.single_atom(casts[0][2])
    if inner is None or inner[0] != "leaf":
        return None
    return (inner[1], inner[2]), (leaves[0][1], leaves[0][2])


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
