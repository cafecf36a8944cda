"""Element-wise symbolic values of graph nodes: what every element of a written K/V value is computed from.

A node's value is a numpy array of expression ids, one per element, at a small concrete token count (`TOKENS`
rows for a symbolic T; a static T above it is read as `TOKENS` wherever it is a size, as `kv_write_check` does).
An expression is a polynomial over atoms with float coefficients, interned in an `Algebra`:

- `("leaf", node, flat)`: element `flat` of a value the evaluation does not look into (a GEMM output, a placeholder,
  the result of an op without a rule below);
- `("gather", source, row, col)`: element `col` of row `row` (an expression of the index tensor) of `source`,
  read by `source[index]`, `index_select` or `embedding` (the source is not evaluated: a table of any size);
- `("base", expr)` raised to a power in a monomial: `sqrt`, `rsqrt`, `reciprocal` and division by a non-monomial
  (the base of such a power is positive wherever the graph computes it: `mean(x²) + eps`);
- `("fn", name, expr)`: `cos`, `sin`, `exp` of an expression;
- `("cast", dtype, expr)`: a cast that rounds where the op would not (`rounds`): it stays in the expression, so a
  proof through it fails and the report names it.

Every op with a rule is one entry of `_RULES`: views, permutes, slices, cats, stacks, splits, selects, expands,
complex views, `slice_scatter` and `x[..., index]` by a constant index (what `roll` decomposes to: an `index` by
`(iota + shift) % width`) are index maps on the id arrays (numpy does them); `iota`, and `fmod`, `remainder` and
comparisons of constants, give constants (a comparison 1.0 / 0.0), so `where` over such a mask is an element-wise
choice; sums, products, powers, means, casts, the functions and matrix products of a small inner dim act on the
expressions. Complex tensors are their real view (a trailing dim of 2),
and a complex product expands into its real and imaginary parts. So `split`/`chunk`/`unbind` and slices, `stack` and
`cat`, `transpose` and `permute`, `view_as_complex(x) * freqs_cis` and its real-pair form, `x / sqrt(m)` and `x *
rsqrt(m)`, `sum / d` and `mean` all give the same expressions: one proof serves every spelling.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy
import torch
import torch.fx as fx

from dspark_fx.passes.graph_utils import aten, op_name, tensor_val
from dspark_fx.passes.kv_write_check import keeps_values

prims = torch.ops.prims

TOKENS = 2  # rows of the evaluation: token-mixing shows, and the arrays stay small
MAX_ELEMENTS = 1 << 16  # elements of one evaluated value, at most

Poly = tuple  # ((monomial, coef), ...) sorted; monomial = ((atom id, exponent), ...) sorted


class Unevaluable(Exception):
    """A node the evaluation cannot follow (the message says which and why)."""


class Algebra:
    """Interned polynomials over interned atoms."""

    def __init__(self) -> None:
        self.polys: list[Poly] = []
        self._poly_ids: dict[Poly, int] = {}
        self.atoms: list[tuple] = []
        self._atom_ids: dict[tuple, int] = {}
        self._memo: dict[tuple, int] = {}
        self.zero = self.const(0.0)
        self.one = self.const(1.0)

    # -- construction ---------------------------------------------------------------------------------------------

    def intern(self, terms: dict) -> int:
        """The id of the polynomial `{monomial: coefficient}` (zero coefficients dropped)."""
        poly = tuple(sorted((m, float(c)) for m, c in terms.items() if c != 0.0))
        found = self._poly_ids.get(poly)
        if found is None:
            found = self._poly_ids[poly] = len(self.polys)
            self.polys.append(poly)
        return found

    def const(self, c: float) -> int:
        return self.intern({(): float(c)})

    def atom(self, key: tuple) -> int:
        """The expression `1 * atom`."""
        aid = self._atom_ids.get(key)
        if aid is None:
            aid = self._atom_ids[key] = len(self.atoms)
            self.atoms.append(key)
        return self.intern({((aid, 1.0),): 1.0})

    def atom_id(self, key: tuple) -> int | None:
        return self._atom_ids.get(key)

    # -- queries --------------------------------------------------------------------------------------------------

    def constant(self, e: int) -> float | None:
        poly = self.polys[e]
        if not poly:
            return 0.0
        if len(poly) == 1 and poly[0][0] == ():
            return poly[0][1]
        return None

    def single_atom(self, e: int) -> tuple | None:
        """The atom key if `e` is `1 * atom`."""
        poly = self.polys[e]
        if len(poly) == 1 and poly[0][1] == 1.0 and len(poly[0][0]) == 1 and poly[0][0][0][1] == 1.0:
            return self.atoms[poly[0][0][0][0]]
        return None

    # -- arithmetic -----------------------------------------------------------------------------------------------

    def _cached(self, key: tuple, fn: Callable[[], int]) -> int:
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = fn()
        return found

    def add(self, a: int, b: int, sign: float = 1.0) -> int:
        def run() -> int:
            out = dict(self.polys[a])
            for m, c in self.polys[b]:
                out[m] = out.get(m, 0.0) + sign * c
            return self.intern(out)

        return self._cached(("add", a, b, sign), run)

    def total(self, terms: Any) -> int:
        """The sum of the expressions `terms`, in one pass: the same polynomial as adding them one by one from zero
        (each monomial's coefficients are added in the same order), without building every partial sum."""
        out: dict = {}
        for e in terms:
            for m, c in self.polys[e]:
                out[m] = out.get(m, 0.0) + c
        return self.intern(out)

    def scale(self, a: int, c: float) -> int:
        return self._cached(("scale", a, c), lambda: self.intern({m: k * c for m, k in self.polys[a]}))

    def mul(self, a: int, b: int) -> int:
        if a > b:
            a, b = b, a

        def run() -> int:
            out: dict = {}
            for ma, ca in self.polys[a]:
                for mb, cb in self.polys[b]:
                    m = _mono_mul(ma, mb)
                    out[m] = out.get(m, 0.0) + ca * cb
            return self.intern(out)

        return self._cached(("mul", a, b), run)

    def power(self, a: int, p: float) -> int:
        def run() -> int:
            c = self.constant(a)
            if c is not None:
                return self.const(c**p)
            if float(p).is_integer() and 0 <= p <= 4:
                out = self.one
                for _ in range(int(p)):
                    out = self.mul(out, a)
                return out
            poly = self.polys[a]
            if len(poly) == 1 and (p.is_integer() or all(self.atoms[i][0] == "base" for i, _ in poly[0][0])):
                ((mono, coef),) = poly
                if coef > 0 or float(p).is_integer():
                    return self.intern({tuple((i, k * p) for i, k in mono): coef**p})
            aid = self.atom_id(("base", a))
            if aid is None:
                self.atom(("base", a))
                aid = self.atom_id(("base", a))
            return self.intern({((aid, float(p)),): 1.0})

        return self._cached(("pow", a, float(p)), run)

    def fn(self, name: str, a: int) -> int:
        c = self.constant(a)
        if c is not None:
            return self.const(getattr(math, name)(c))
        return self.atom(("fn", name, a))


def _mono_mul(a: tuple, b: tuple) -> tuple:
    if not a:
        return b
    if not b:
        return a
    out = dict(a)
    for i, k in b:
        out[i] = out.get(i, 0.0) + k
    return tuple(sorted((i, k) for i, k in out.items() if k != 0.0))


@dataclass(frozen=True)
class Sym:
    """A tensor's element expressions; a complex tensor is held as its real view (trailing dim of 2)."""

    ids: np.ndarray
    complex: bool = False


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_COPIES = (aten.alias.default, aten.clone.default, aten.contiguous.default, aten.lift_fresh_copy.default)
_FUNCTIONS = {aten.cos.default: "cos", aten.sin.default: "sin", aten.exp.default: "exp"}
_POWERS = {aten.rsqrt.default: -0.5, aten.sqrt.default: 0.5, aten.reciprocal.default: -1.0}


class Evaluation:
    """Symbolic values of the nodes of one graph, on demand (memoized)."""

    def __init__(self, tokens: Any, model: torch.dtype, opaque: set[fx.Node], shrink: bool = True) -> None:
        # the token count's symbols are `TOKENS`; other symbols (a table's rows under dynamic=True) their values
        self.token_symbols = tokens.node.expr.free_symbols if isinstance(tokens, torch.SymInt) else set()
        self.alg = Algebra()
        self.model = model
        self.opaque = opaque  # nodes held as leaves (the GEMMs)
        self.memo: dict[fx.Node, Any] = {}
        self.gathers: dict[int, fx.Node] = {}  # gather atom id -> the index node it read
        self.casts: dict[int, fx.Node] = {}  # cast atom id -> the cast node
        self.static_tokens = tokens if shrink and isinstance(tokens, int) and tokens > TOKENS else None
        self.tokens = TOKENS if self.static_tokens is not None else self.size(tokens)

    # -- sizes ----------------------------------------------------------------------------------------------------

    def size(self, size: Any) -> int:
        """A concrete size: the token count's symbols are `TOKENS` (a token count `4 * s` has 8 rows then), the
        others their current values."""
        if isinstance(size, fx.Node):
            size = size.meta.get("val")
        if isinstance(size, torch.SymInt):
            expr = size.node.expr
            shape_env = size.node.shape_env
            hints = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val  # torch >= 2.13's name
            binding = {
                s: sympy.Integer(TOKENS) if s in self.token_symbols else hints.get(s, s) for s in expr.free_symbols
            }
            expr = expr.xreplace(binding)
            if not expr.is_number:
                raise Unevaluable(f"the size {size} has no value")
            return int(expr)
        return int(size)

    def shape(self, node: fx.Node) -> tuple[int, ...]:
        """A leaf's shape: its first dim of a static T's size reads as the token count."""
        val = tensor_val(node)
        if val is None:
            raise Unevaluable(f"{node.name} holds no tensor")
        return tuple(self.shape_arg(val.shape))

    def shape_arg(self, arg: Any) -> list[int]:
        """A view's or expand's size list: the first size equal to a static T reads as the token count (the token
        dim comes first in the layouts a write is computed in); a wrong reading fails to reshape."""
        sizes = [self.size(s) for s in arg]
        if self.static_tokens is not None and self.static_tokens in sizes:
            sizes[sizes.index(self.static_tokens)] = self.tokens
        return sizes

    def view_shapes(self, arg: Any) -> list[list[int]]:
        """The readings of a view's size list to try in turn: `shape_arg`'s, then, under a static T, one where the
        first size that is a multiple k·T of it reads as k times the token count (the token dim flattened with
        others: `k.reshape(-1, head_dim)` over T tokens of k heads has T·k rows). A wrong reading fails to reshape,
        or gives an expression the lowering's self-check refutes."""
        shapes = [self.shape_arg(arg)]
        if self.static_tokens is not None:
            sizes = [self.size(s) for s in arg]
            multiple = next(
                (i for i, s in enumerate(sizes) if s > self.static_tokens and s % self.static_tokens == 0), None
            )
            if multiple is not None:
                sizes[multiple] = sizes[multiple] // self.static_tokens * self.tokens
                shapes.append(sizes)
        return shapes

    def token_axis(self, node: Any, sym: Sym, d: int) -> bool:
        """Whether dim `d` of `node`'s value (held as `sym`) runs over the tokens: its size involves a symbolic T,
        or the evaluation holds it shorter than it is (a static T read as `TOKENS`). The evaluation sees only the
        first `TOKENS` rows of such a dim, so an op that treats its rows apart (a slice of some of them, a mask or
        an index over them) cannot be followed: rows past the evaluated ones could be computed otherwise."""
        val = tensor_val(node) if isinstance(node, fx.Node) else None
        if val is None or d >= val.dim():
            return True
        size = val.shape[d]
        if isinstance(size, torch.SymInt):
            return bool(size.node.expr.free_symbols & self.token_symbols)
        return sym.ids.shape[d] != int(size)

    # -- values ---------------------------------------------------------------------------------------------------

    def __call__(self, node: Any) -> Any:
        if not isinstance(node, fx.Node):
            return node
        if node not in self.memo:
            self.memo[node] = self._value(node)
        return self.memo[node]

    def leaf(self, node: fx.Node) -> Sym:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise Unevaluable(f"{node.name} holds no tensor")
        shape = self.shape(node) + ((2,) if val.is_complex() else ())
        count = math.prod(shape)
        if count > MAX_ELEMENTS:
            raise Unevaluable(f"{node.name} ({op_name(node)}) has {count} elements to follow")
        ids = np.array([self.alg.atom(("leaf", node, i)) for i in range(count)], dtype=np.int64)
        return Sym(ids.reshape(shape), val.is_complex())

    def _value(self, node: fx.Node) -> Any:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr.free_symbols & self.token_symbols:
            return None  # a number computed from T used as a value: the evaluation's T is not the call's
        if isinstance(val, (torch.SymInt, int, float, bool)):
            return self.size(val) if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool) else val
        rule = _RULES.get(node.target) if node.op == "call_function" and node not in self.opaque else None
        if rule is None:
            return self.leaf(node) if isinstance(val, torch.Tensor) else None
        try:
            out = rule(self, node)
        except (ValueError, IndexError, TypeError) as err:  # shapes the evaluation cannot follow: never a crash
            raise Unevaluable(f"{node.name} ({op_name(node)}) cannot be followed: {err}") from None
        if out is None:
            return self.leaf(node)
        for sym in out if isinstance(out, list) else [out]:
            if sym.ids.size > MAX_ELEMENTS:
                raise Unevaluable(f"{node.name} ({op_name(node)}) has {sym.ids.size} elements to follow")
        return out

    def arg(self, node: fx.Node, i: int, default: Any = None) -> Any:
        a = node.args[i] if len(node.args) > i else default
        return self(a) if isinstance(a, fx.Node) else a

    def elementwise(self, fn: Callable[..., int], *syms: Sym) -> Sym:
        arrays = np.broadcast_arrays(*(s.ids for s in syms))
        flat = [a.reshape(-1) for a in arrays]
        out = np.fromiter((fn(*ids) for ids in zip(*flat, strict=True)), dtype=np.int64, count=flat[0].size)
        return Sym(out.reshape(arrays[0].shape))

    def as_sym(self, a: Any) -> Sym | None:
        if isinstance(a, Sym):
            return a
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return Sym(np.array(self.alg.const(float(a)), dtype=np.int64))
        return None

    def rounds(self, src: torch.dtype, dst: torch.dtype) -> bool:
        """Whether a float cast rounds where the op would not: it keeps every value, or it rounds a value at least
        as precise as the model dtype to the model dtype (the rounding the op's tolerance covers), else it rounds."""
        return not (keeps_values(src, dst) or (dst == self.model and keeps_values(self.model, src)))


# ---- the rules: one per op -------------------------------------------------------------------------------------------


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _real_dim(sym: Sym, d: int) -> int:
    """The dim of the held (real view) array for dim `d` of the tensor."""
    return _dim(d, sym.ids.ndim - (1 if sym.complex else 0))


def _same(ev: Evaluation, node: fx.Node) -> Sym | None:
    return ev.arg(node, 0)


def _view(ev: Evaluation, node: fx.Node) -> Sym | None:
    x = ev.arg(node, 0)
    tail = (2,) if x.complex else ()
    for shape in ev.view_shapes(node.args[1]):
        try:
            return Sym(x.ids.reshape(*shape, *tail), x.complex)
        except ValueError:
            continue
    raise Unevaluable(f"{node.name} ({op_name(node)}) does not reshape the evaluated value")


def _permute(ev: Evaluation, node: fx.Node) -> Sym:
    x = ev.arg(node, 0)
    rank = x.ids.ndim - x.complex
    dims = [_dim(d, rank) for d in node.args[1]] + ([rank] if x.complex else [])
    return Sym(x.ids.transpose(dims), x.complex)


def _transpose(ev: Evaluation, node: fx.Node) -> Sym:
    x = ev.arg(node, 0)
    a, b = (_real_dim(x, d) for d in node.args[1:3]) if node.target is aten.transpose.int else (0, 1)
    return Sym(np.swapaxes(x.ids, a, b), x.complex)


def _unsqueeze(ev: Evaluation, node: fx.Node) -> Sym:
    x = ev.arg(node, 0)
    return Sym(np.expand_dims(x.ids, _dim(node.args[1], x.ids.ndim - x.complex + 1)), x.complex)


def _squeeze(ev: Evaluation, node: fx.Node) -> Sym:
    x = ev.arg(node, 0)
    rank = x.ids.ndim - x.complex
    if len(node.args) < 2:
        dims = [d for d in range(rank) if x.ids.shape[d] == 1]
    else:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = [_dim(d, rank) for d in dims if x.ids.shape[_dim(d, rank)] == 1]
    return Sym(np.squeeze(x.ids, tuple(dims)) if dims else x.ids, x.complex)


def _expand(ev: Evaluation, node: fx.Node) -> Sym:
    x = ev.arg(node, 0)
    shape = ev.shape_arg(node.args[1])
    lead = len(shape) - (x.ids.ndim - x.complex)
    shape = [x.ids.shape[i - lead] if s == -1 else s for i, s in enumerate(shape)]
    return Sym(np.broadcast_to(x.ids, (*shape, *((2,) if x.complex else ()))), x.complex)


def _open_end(stop: Any) -> bool:
    """Whether a slice's stop is none (`x[a:]`: None, or the largest int64 a graph spells it with)."""
    return stop is None or (isinstance(stop, int) and stop >= 2**62)


def whole_range(source: Any, d: int, start: Any, stop: Any, step: Any) -> bool:
    """Whether `[start:stop:step]` along dim `d` of `source` takes every row of it."""
    val = tensor_val(source)
    start, stop = (b.meta.get("val") if isinstance(b, fx.Node) else b for b in (start, stop))
    if start not in (None, 0) or step not in (None, 1):
        return False
    if _open_end(stop):
        return True
    return val is not None and d < val.dim() and same_size(stop, val.shape[d])


def same_size(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) are the same expression."""
    exprs = [v.node.expr if isinstance(v, torch.SymInt) else sympy.Integer(v) for v in (a, b) if v is not None]
    return len(exprs) == 2 and sympy.simplify(exprs[0] - exprs[1]) == 0


def _rows_apart(node: fx.Node, what: str) -> Unevaluable:
    return Unevaluable(
        f"{node.name} ({op_name(node)}) {what} of the token dim: rows past the evaluated ones could differ"
    )


def _slice(ev: Evaluation, node: fx.Node) -> Sym:
    x = ev.arg(node, 0)
    _, dim, start, stop, step = (*node.args, *(0, None, None, 1)[len(node.args) - 1 :])
    d = _real_dim(x, dim)
    if ev.token_axis(node.args[0], x, d) and not whole_range(node.args[0], d, start, stop, step):
        raise _rows_apart(node, "takes some rows")
    start = None if start is None else ev.size(start)
    stop = None if _open_end(stop) else ev.size(stop)
    index = [slice(None)] * x.ids.ndim
    index[d] = slice(start, stop, step)
    return Sym(x.ids[tuple(index)], x.complex)


def _select(ev: Evaluation, node: fx.Node) -> Sym:
    """Row `i` of the token dim is row `i` at any T (an index past the evaluated rows fails to take); a row counted
    from the end is not."""
    x = ev.arg(node, 0)
    index = ev.size(node.args[2])
    if index < 0 and ev.token_axis(node.args[0], x, _real_dim(x, node.args[1])):
        raise _rows_apart(node, "takes a row counted from the end")
    return Sym(np.take(x.ids, index, axis=_real_dim(x, node.args[1])), x.complex)


def _cat(ev: Evaluation, node: fx.Node) -> Sym | None:
    pieces = [(n, ev(n)) for n in node.args[0]]
    parts = [p for _, p in pieces if p.ids.size or p.ids.ndim > 1]  # cat drops 1-D empty tensors
    if not parts or len({p.complex for p in parts}) != 1:
        return None
    d = _real_dim(parts[0], node.args[1] if len(node.args) > 1 else 0)
    if any(ev.token_axis(n, p, d) for n, p in pieces):
        raise _rows_apart(node, "joins pieces")
    return Sym(np.concatenate([p.ids for p in parts], axis=d), parts[0].complex)


def _stack(ev: Evaluation, node: fx.Node) -> Sym | None:
    parts = [ev(p) for p in node.args[0]]
    if len({p.complex for p in parts}) != 1:
        return None
    rank = parts[0].ids.ndim - parts[0].complex + 1
    d = _dim(node.args[1] if len(node.args) > 1 else 0, rank)
    return Sym(np.stack([p.ids for p in parts], axis=d), parts[0].complex)


def _split(ev: Evaluation, node: fx.Node) -> list[Sym]:
    x = ev.arg(node, 0)
    d = _real_dim(x, node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0))
    if ev.token_axis(node.args[0], x, d):
        raise _rows_apart(node, "splits the rows")
    width = x.ids.shape[d]
    sizes = node.args[1]
    if node.target is aten.split.Tensor:
        step = ev.size(sizes)
        sizes = [min(step, width - s) for s in range(0, width, step)] or [0]
    cuts = np.cumsum([ev.size(s) for s in sizes])[:-1]
    return [Sym(p, x.complex) for p in np.split(x.ids, cuts, axis=d)]


def _unbind(ev: Evaluation, node: fx.Node) -> list[Sym]:
    x = ev.arg(node, 0)
    d = _real_dim(x, node.args[1] if len(node.args) > 1 else 0)
    if ev.token_axis(node.args[0], x, d):
        raise _rows_apart(node, "takes the rows one by one")
    return [Sym(np.take(x.ids, i, axis=d), x.complex) for i in range(x.ids.shape[d])]


def _getitem(ev: Evaluation, node: fx.Node) -> Sym | None:
    parts = ev.arg(node, 0)
    return parts[node.args[1]] if isinstance(parts, list) else None


def _view_as_complex(ev: Evaluation, node: fx.Node) -> Sym:
    return Sym(ev.arg(node, 0).ids, True)


def _view_as_real(ev: Evaluation, node: fx.Node) -> Sym:
    return Sym(ev.arg(node, 0).ids, False)


_FILLS = {
    aten.zeros_like.default: 0.0,
    aten.ones_like.default: 1.0,
    aten.zeros.default: 0.0,
    aten.ones.default: 1.0,
    aten.full_like.default: None,
    aten.full.default: None,
}


def _filled(ev: Evaluation, node: fx.Node) -> Sym | None:
    """A constant tensor (`ones_like`, `full`, ...): every element the same constant."""
    value = _FILLS[node.target]
    if value is None:
        value = node.args[1]
    val = tensor_val(node)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or val is None or val.is_complex():
        return None
    return Sym(np.full(ev.shape(node), ev.alg.const(float(value)), dtype=np.int64))


def _complex(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`complex(re, im)`, or `polar(abs, angle)` = `(abs cos angle, abs sin angle)`."""
    a, b = (ev.as_sym(ev.arg(node, i)) for i in (0, 1))
    if a is None or b is None or a.complex or b.complex:
        return None
    if node.target is aten.polar.default:
        alg = ev.alg
        cos = ev.elementwise(lambda r, t: alg.mul(r, alg.fn("cos", t)), a, b)
        a, b = cos, ev.elementwise(lambda r, t: alg.mul(r, alg.fn("sin", t)), a, b)
    re, im = np.broadcast_arrays(a.ids, b.ids)
    return Sym(np.stack([re, im], axis=-1), True)


def _gather(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`source[index]` along dim 0 (`index`, `index_select(source, 0, index)`, `embedding(source, index)`)."""
    if node.target is aten.index.Tensor:
        source, indices = node.args[0], node.args[1]
        if len(indices) != 1 or not isinstance(indices[0], fx.Node):
            return None
        index = indices[0]
    elif node.target is aten.index_select.default:
        source, dim, index = node.args[:3]
        if dim != 0:
            return None
    else:
        source, index = node.args[:2]
    index_val = tensor_val(index)
    if index_val is None or index_val.dtype not in (torch.int32, torch.int64):
        return None
    rows = ev(index).ids
    src_val = tensor_val(source)
    row_shape = tuple(ev.size(s) for s in src_val.shape[1:]) + ((2,) if src_val.is_complex() else ())
    width = math.prod(row_shape)
    out = np.empty((rows.size, width), dtype=np.int64)
    for r, row in enumerate(rows.reshape(-1)):
        for c in range(width):
            out[r, c] = ev.alg.atom(("gather", source, int(row), c))
            ev.gathers.setdefault(ev.alg.atom_id(("gather", source, int(row), c)), index)
    return Sym(out.reshape(*rows.shape, *row_shape), src_val.is_complex())


def _constants(ev: Evaluation, sym: Sym | None) -> np.ndarray | None:
    """The values of `sym` if every element is a constant (an index computed from `iota`, a mask), else None."""
    if sym is None or sym.complex:
        return None
    values = [ev.alg.constant(int(e)) for e in sym.ids.reshape(-1)]
    if any(v is None for v in values):
        return None
    return np.array(values, dtype=np.float64).reshape(sym.ids.shape)


def _const_sym(ev: Evaluation, values: np.ndarray) -> Sym:
    flat = [ev.alg.const(float(v)) for v in values.reshape(-1)]
    return Sym(np.array(flat, dtype=np.int64).reshape(values.shape))


def _iota(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`prims.iota(length, start, step)` (what `arange` decomposes to): constants, except over the tokens (a length
    of T, symbolic or static): a leaf, as the token index must be (the evaluation sees only its first rows)."""
    length = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else node.args[0]
    if isinstance(length, torch.SymInt) and length.node.expr.free_symbols & ev.token_symbols:
        return None  # the token index: rows past the evaluated ones hold other values
    if ev.static_tokens is not None and length == ev.static_tokens:
        return None
    length = ev.size(length)
    start, step = node.kwargs.get("start", 0), node.kwargs.get("step", 1)
    if not all(isinstance(v, int) for v in (start, step)):
        return None
    return _const_sym(ev, start + step * np.arange(length, dtype=np.float64))


_CONSTANT_OPS = {
    aten.fmod.Scalar: np.fmod,
    aten.remainder.Scalar: np.remainder,
    aten.lt.Scalar: np.less,
    aten.le.Scalar: np.less_equal,
    aten.gt.Scalar: np.greater,
    aten.ge.Scalar: np.greater_equal,
    aten.eq.Scalar: np.equal,
    aten.ne.Scalar: np.not_equal,
}


def _on_constants(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`fmod`, `remainder` and comparisons of constant values (index arithmetic, masks; a mask holds 1.0 / 0.0); of
    anything else a leaf."""
    values, other = _constants(ev, ev.arg(node, 0)), node.args[1]
    if values is None or not isinstance(other, (int, float)) or isinstance(other, bool):
        return None
    return _const_sym(ev, _CONSTANT_OPS[node.target](values, other).astype(np.float64))


def _where(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`where(mask, a, b)` with a constant mask: an element-wise choice (a mask read from data is a leaf)."""
    mask = _constants(ev, ev.arg(node, 0))
    a, b = (ev.as_sym(ev.arg(node, i)) for i in (1, 2))
    if mask is None or a is None or b is None or a.complex or b.complex:
        return None
    mask, a_ids, b_ids = np.broadcast_arrays(mask, a.ids, b.ids)
    return Sym(np.where(mask != 0, a_ids, b_ids))


def _index(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`x[index]` along the first dim: `_gather` (a table read without evaluating it). `x[..., index]` along a later
    dim with a constant index (what `roll` decomposes to): an index map."""
    indices = node.args[1]
    given = [i for i, index in enumerate(indices) if index is not None]
    if given == [0]:
        return _gather(ev, node)
    index_val = tensor_val(indices[given[0]]) if len(given) == 1 else None
    if index_val is None or index_val.dtype not in (torch.int32, torch.int64):
        return None
    x, values = ev.arg(node, 0), _constants(ev, ev(indices[given[0]]))
    if x.complex or values is None:
        return None
    if ev.token_axis(node.args[0], x, given[0]):
        raise _rows_apart(node, "reorders the rows")
    return Sym(np.take(x.ids, values.astype(np.int64), axis=given[0]))


def _slice_scatter(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`slice_scatter(x, src, dim, start, end, step)`: `x` with `src` in the slice, an index map."""
    x, src = ev.arg(node, 0), ev.arg(node, 1)
    if x.complex or src.complex:
        return None
    dim, start, end, step = (
        node.args[i] if len(node.args) > i else node.kwargs.get(name, default)
        for i, name, default in ((2, "dim", 0), (3, "start", None), (4, "end", None), (5, "step", 1))
    )
    d = _dim(dim, x.ids.ndim)
    if ev.token_axis(node.args[0], x, d) and not whole_range(node.args[0], d, start, end, step):
        raise _rows_apart(node, "writes some rows")
    index = [slice(None)] * x.ids.ndim
    stop = None if _open_end(end) else ev.size(end)
    index[d] = slice(None if start is None else ev.size(start), stop, step)
    out = x.ids.copy()
    out[tuple(index)] = src.ids
    return Sym(out)


def _binary(op: str) -> Callable[[Evaluation, fx.Node], Sym | None]:
    def rule(ev: Evaluation, node: fx.Node) -> Sym | None:
        a, b = (ev.as_sym(ev.arg(node, i)) for i in (0, 1))
        if a is None or b is None:
            return None
        alpha = node.kwargs.get("alpha", 1)
        alg = ev.alg
        if op == "mul" and (a.complex or b.complex):
            return _complex_mul(ev, a, b)
        if (a.complex or b.complex) and (a.complex != b.complex or op == "div"):
            return None
        fn: Callable[[int, int], int]
        if op == "add":
            fn = (lambda x, y: alg.add(x, alg.scale(y, alpha))) if alpha != 1 else alg.add
        elif op == "sub":
            fn = lambda x, y: alg.add(x, alg.scale(y, alpha), -1.0)
        elif op == "mul":
            fn = alg.mul
        else:
            fn = lambda x, y: alg.mul(x, alg.power(y, -1.0))
        out = ev.elementwise(fn, a, b)
        return Sym(out.ids, a.complex)

    return rule


def _complex_mul(ev: Evaluation, a: Sym, b: Sym) -> Sym | None:
    alg = ev.alg
    if not (a.complex and b.complex):
        scalar, z = (a, b) if b.complex else (b, a)
        return Sym(ev.elementwise(alg.mul, Sym(scalar.ids[..., None]), z).ids, True)
    ar, ai, br, bi = (Sym(s.ids[..., k]) for s in (a, b) for k in (0, 1))
    re = ev.elementwise(lambda w, x, y, z: alg.add(alg.mul(w, y), alg.mul(x, z), -1.0), ar, ai, br, bi)
    im = ev.elementwise(lambda w, x, y, z: alg.add(alg.mul(w, z), alg.mul(x, y)), ar, ai, br, bi)
    return Sym(np.stack([re.ids, im.ids], axis=-1), True)


def _neg(ev: Evaluation, node: fx.Node) -> Sym:
    x = ev.arg(node, 0)
    return Sym(ev.elementwise(lambda e: ev.alg.scale(e, -1.0), x).ids, x.complex)


def _power_rule(ev: Evaluation, node: fx.Node) -> Sym | None:
    x = ev.arg(node, 0)
    if x.complex:
        return None
    p = _POWERS.get(node.target, node.args[1] if len(node.args) > 1 else None)
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        return None
    return ev.elementwise(lambda e: ev.alg.power(e, float(p)), x)


def _function(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`cos`, `sin`, `exp` of an expression; a leaf (the graph's own values) where the argument is computed through a
    float cast that rounds, even one the proof leaves out elsewhere (`Evaluation.rounds`): an angle rounded to bf16
    is off by up to |angle| / 256 radians, which no tolerance on values covers."""
    x = ev.arg(node, 0)
    if x.complex or _rounded_on_the_way(ev, node.args[0]):
        return None
    return ev.elementwise(lambda e: ev.alg.fn(_FUNCTIONS[node.target], e), x)


def _rounds(cast: fx.Node) -> bool:
    """Whether a float-to-float cast node does not keep every value."""
    src, dst = tensor_val(cast.args[0]), tensor_val(cast)
    if src is None or dst is None or not (src.dtype.is_floating_point and dst.dtype.is_floating_point):
        return False
    return not keeps_values(src.dtype, dst.dtype)


def _rounded_on_the_way(ev: Evaluation, arg: Any) -> bool:
    """Whether a float cast that does not keep every value is among the nodes `arg` is computed from (down to the
    leaves the evaluation holds opaque)."""
    seen, todo = set(), [arg]
    while todo:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen or node in ev.opaque or node.op != "call_function":
            continue
        seen.add(node)
        if node.target in (prims.convert_element_type.default, aten._to_copy.default) and _rounds(node):
            return True
        todo.extend(node.all_input_nodes)
    return False


def _reduce(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`sum` / `mean` over dims (`keepdim` as the node says; no dtype argument)."""
    x = ev.arg(node, 0)
    if x.complex or node.kwargs.get("dtype") is not None or len(node.args) < 2:
        return None
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = tuple(sorted(_dim(d, x.ids.ndim) for d in node.args[1]))
    if any(ev.token_axis(node.args[0], x, d) for d in dims):
        raise _rows_apart(node, "sums over the rows")
    moved = np.moveaxis(x.ids, dims, tuple(range(x.ids.ndim - len(dims), x.ids.ndim)))
    count = math.prod(x.ids.shape[d] for d in dims)
    flat = moved.reshape(*moved.shape[: moved.ndim - len(dims)], count)
    alg = ev.alg
    out = np.empty(flat.shape[:-1], dtype=np.int64)
    for index in np.ndindex(out.shape):
        total = alg.total(int(e) for e in flat[index])
        out[index] = alg.scale(total, 1.0 / count) if node.target is aten.mean.dim else total
    if keep:
        for d in dims:
            out = np.expand_dims(out, d)
    return Sym(out)


MAX_INNER = 4  # the inner dim of an `mm` / `bmm` the evaluation expands, at most


def _matmul(ev: Evaluation, node: fx.Node) -> Sym | None:
    """`mm` / `bmm` with a small inner dim, as sums of products (HF computes its RoPE angles as the outer product
    `inv_freq @ positions`, an inner dim of 1); a larger one (a projection) stays a leaf."""
    a, b = ev.arg(node, 0), ev.arg(node, 1)
    if a.complex or b.complex or a.ids.shape[-1] > MAX_INNER:
        return None
    if ev.token_axis(node.args[0], a, a.ids.ndim - 1):
        raise _rows_apart(node, "sums over the rows")
    alg = ev.alg
    batch, (rows, inner), cols = a.ids.shape[:-2], a.ids.shape[-2:], b.ids.shape[-1]
    out = np.empty((*batch, rows, cols), dtype=np.int64)
    for index in np.ndindex(out.shape):
        *at, i, j = index
        out[index] = alg.total(alg.mul(int(a.ids[(*at, i, k)]), int(b.ids[(*at, k, j)])) for k in range(inner))
    return Sym(out)


def _cast(ev: Evaluation, node: fx.Node) -> Sym | None:
    x = ev.arg(node, 0)
    src = tensor_val(node.args[0])
    dst = node.args[1] if node.target is prims.convert_element_type.default else node.kwargs.get("dtype")
    if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype", "layout", "device"}:
        return None
    if src is None or dst is None or dst == src.dtype:
        return x
    if src.is_complex() or dst.is_complex:
        return None
    if src.dtype.is_floating_point and dst.is_floating_point and not ev.rounds(src.dtype, dst):
        return x

    def cast(e: int) -> int:
        out = ev.alg.atom(("cast", str(dst), e))
        ev.casts.setdefault(ev.alg.atom_id(("cast", str(dst), e)), node)
        return out

    return ev.elementwise(cast, x)


def _copy(ev: Evaluation, node: fx.Node) -> Sym | None:
    dst, src = ev.arg(node, 0), ev.arg(node, 1)
    if tensor_val(node.args[0]).dtype != tensor_val(node.args[1]).dtype:
        return None
    return Sym(np.broadcast_to(src.ids, dst.ids.shape), src.complex)


_RULES: dict[Any, Callable[[Evaluation, fx.Node], Any]] = {
    **dict.fromkeys(_COPIES, _same),
    **dict.fromkeys(_VIEWS, _view),
    aten.permute.default: _permute,
    aten.transpose.int: _transpose,
    aten.t.default: _transpose,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.cat.default: _cat,
    aten.stack.default: _stack,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.unbind.int: _unbind,
    operator.getitem: _getitem,
    aten.view_as_complex.default: _view_as_complex,
    aten.view_as_real.default: _view_as_real,
    **dict.fromkeys(_FILLS, _filled),
    aten.complex.default: _complex,
    aten.polar.default: _complex,
    aten.index.Tensor: _index,
    aten.index_select.default: _gather,
    aten.embedding.default: _gather,
    aten.add.Tensor: _binary("add"),
    aten.add.Scalar: _binary("add"),
    aten.sub.Tensor: _binary("sub"),
    aten.sub.Scalar: _binary("sub"),
    aten.mul.Tensor: _binary("mul"),
    aten.mul.Scalar: _binary("mul"),
    aten.div.Tensor: _binary("div"),
    aten.div.Scalar: _binary("div"),
    aten.neg.default: _neg,
    aten.pow.Tensor_Scalar: _power_rule,
    **dict.fromkeys(_POWERS, _power_rule),
    **dict.fromkeys(_FUNCTIONS, _function),
    aten.mm.default: _matmul,
    aten.bmm.default: _matmul,
    aten.mean.dim: _reduce,
    aten.sum.dim_IntList: _reduce,
    prims.convert_element_type.default: _cast,
    aten._to_copy.default: _cast,
    aten.copy.default: _copy,
    prims.iota.default: _iota,
    **dict.fromkeys(_CONSTANT_OPS, _on_constants),
    aten.where.self: _where,
    aten.slice_scatter.default: _slice_scatter,
}
