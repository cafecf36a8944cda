"""Lower the per-layer K/V cache writes of GEMMs on one activation to one `dspark::multi_linear_kv_write`.

Before (per layer l, all projecting `ctx`; K and V may come from one fused qkv GEMM and a split, or from two GEMMs):

    kv_l = mm(ctx, permute(slice(W_l, 0, q, q + 2kv), [1, 0]));   k_l, v_l = split(kv_l, [kv, kv], -1)
    x_l  = view(k_l, [T, h, d]);  n_l = mul(mul(x_l, rsqrt(add(mean(pow(x_l, 2), [-1], True), eps_l))), w_l)
    r_l  = cat([sub(mul(n1, cos), mul(n2, sin)), add(mul(n2, cos), mul(n1, sin))], -1)   # cos/sin: table_l[pos]
    copy_(k_cache_l, index_put(k_cache_l, [loc], r_l));   copy_(v_cache_l, index_put(v_cache_l, [loc], view(v_l)))

After (the weights, norm weights, tables and caches are the original placeholders: nothing is copied per call):

    dspark.multi_linear_kv_write(ctx, [W_0 ..], [q ..], [None ..], [W_0 ..], [q + kv ..], [None ..], [w_0 ..],
                                 [eps_0 ..], [table_0 ..], pos, True, [k_cache_0 ..], [v_cache_0 ..], loc,
                                 None, h, d, wrap_negative=True)

`wrap_negative=True`: a negative slot or table row counts from the end, as eager indexing does (without it the op
would skip a negative slot), so no kernel runs before the op to wrap them.

Write sites (each the only mutation of a cache placeholder, its new value read by nothing but the final `copy_`):
`index_put(cache, [loc], value)` (`cache[loc] = k`, `cache.index_copy_(0, loc, k)`); `slice_scatter(cache,
copy(slice(cache, 0, a, b), value), 0, a, b)` (`cache[a:b] = k`, `a >= 0`; the op gets `a + arange(T)`); and
`index_put(cache, [view(loc2d, [-1])], where(keep, value, index(cache, [view(loc2d, [-1])])))` with `keep =
view(lt(unsqueeze(arange(W), 0), unsqueeze(lens, 1)), [-1, 1, 1])` (rows `j < lens[b]` of `loc2d [B, W]`: the op's
`commit_lens`). There must be one slot per token (from the shapes, or a guard on the symbolic sizes: a write of one
token to several slots broadcasts in eager). The op takes the place of the first cache `copy_` (the end of the
graph), after every read of the old cache values, which must all come before it.

What is written must be, element for element, the op's formula applied to a column block of a GEMM on the shared
activation. K values are checked by a small symbolic evaluation: every element of the written `[T, h, d]` value is a
sum of terms `±1 * normed[t, head, j] * factor` (factor: a column of a per-token `[T, W]` cos/sin tensor), built
through slices, cats, negations, products, sums, unsqueezes and views; the sums must be the neox or GPT-J rotation
of the first `R` elements and the rest must pass through. `normed` is `x * rsqrt(mean(x², -1) + eps) (* w)` of the
`[T, h, d]` view of the block (copies in between do not change which values are combined, nor do the casts the op
makes no error by leaving out: one to a dtype that represents every value of the source, or one that rounds a value
at least as precise as the model dtype to the model dtype, which is the rounding the op's tolerance covers; any other
cast, e.g. an fp8 fake-quantization or a bf16 -> fp16 round trip, rounds where the op would not, and the write keeps
today's path, the cast named in the report). The cos/sin
columns a rotation reads must be the op's table layout: `table[positions]` rows of a `[P, R]` fp32 parameter
(`[cos | sin]` halves: passed as is), or per-token `cos`/`sin` tensors (HF `emb = cat(freqs, freqs)`; a column and
its duplicate are proven equal from the graph), from which `[T, R]` fp32 rows `cat(cos[:, :R/2], sin[:, :R/2])` are
built in the graph and read at `arange(T)`.

The op computes in fp32 and rounds K and V once, when stored; eager rounds the GEMM output and each step in the
model dtype, so a lowered bf16/fp16 model agrees with eager to that dtype's tolerance and an fp32 one to fp32
rounding. Whether to lower is `DsparkConfig.kv_write_op`: "auto" where the op's CUDA kernel runs (CUDA, bf16/fp16,
`K % 8 == 0`, `head_dim % 8 == 0` and `<= 256`, unit inner stride and 16-byte aligned rows of the caches, and a
CUDA kernel of the op in this build), "always"
wherever the semantics match (CPU: the fp32 reference), "never". A group of writes on one activation is lowered as a
whole or not at all; anything that does not match keeps today's path, with the reason in the report.

Before the writes are replaced, the op node is given its `meta["val"]` by running the op's fake impl on the operands'
fake values: the op's checks, and on CUDA the binding's layout rules (`_check_cuda_layout`), so operands the binding
would refuse at run time keep today's path instead. A cache's address beyond its storage offset is not known at
compile time: torch's allocators align storages to 16 bytes, and Inductor-compiled code copies an input whose address
turns out unaligned into an aligned clone (writing a mutated one back). Then `kv_write_check.self_check` evaluates
the graph's written values and the op's formula on random fp64 inputs; a difference beyond round-off keeps today's
path.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import custom_ops  # registers dspark::multi_linear_kv_write
from custom_ops.linear.multi_linear_kv_write import check_cuda_operands
from dspark_fx.config import DsparkConfig
from dspark_fx.passes import gemm_branches
from dspark_fx.passes.batching import same_shape
from dspark_fx.passes.branch_regions import descendants
from dspark_fx.passes.graph_utils import aten, call, is_pure, op_name, tensor_val
from dspark_fx.passes.kv_write_check import keeps_values, self_check
from dspark_fx.passes.names import Namer
from dspark_fx.report import KVWriteReport

KV_WRITE = torch.ops.dspark.multi_linear_kv_write.default
prims = torch.ops.prims

_GEMMS = (aten.mm.default, aten.addmm.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_COPIES = (aten.alias.default, aten.clone.default)
_UNARY = {aten.cos.default, aten.sin.default, aten.neg.default, aten.exp.default}
_ADDS = (aten.add.Tensor, aten.add.Scalar)
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_INT_MAX = 2**62


class _NoMatch(Exception):
    """The written value is not the op's formula (the reason is the message)."""


# ---- small graph helpers ---------------------------------------------------------------------------------------------


def _float_cast(node: fx.Node) -> tuple[torch.dtype, torch.dtype] | None:
    """`(source, target)` dtypes if `node` casts a float tensor to another float dtype."""
    if op_name(node) != "prims.convert_element_type":
        return None
    src = tensor_val(node.args[0])
    if src is None or not src.dtype.is_floating_point or not node.args[1].is_floating_point:
        return None
    return src.dtype, node.args[1]


def _lossless_cast(node: fx.Node, model: torch.dtype | None) -> bool:
    """A float cast the proof may leave out: it keeps every value, or it rounds a value at least as precise as the
    model dtype to the model dtype (eager rounds every step to it; the op rounds once, when it stores: the
    tolerance the op documents). Any other cast (to fp8, bf16 <-> fp16, fp32 -> bf16 in an fp32 model) is a
    rounding the op does not reproduce. `model` None: no cast may be left out."""
    cast = _float_cast(node)
    if cast is None or model is None:
        return False
    src, dst = cast
    return keeps_values(src, dst) or (dst == model and keeps_values(model, src))


def _strip(node: Any, model: torch.dtype | None) -> Any:
    """Skip aliases, copies and the float casts `_lossless_cast` allows: they do not change which values combine."""
    while isinstance(node, fx.Node) and (node.target in _COPIES or _lossless_cast(node, model)):
        node = node.args[0]
    return node


def _noop_row_slice(node: fx.Node) -> bool:
    if node.target is not aten.slice.Tensor or node.kwargs:
        return False
    _, dim, start, stop, step = gemm_branches._slice_args(node)
    return (
        dim == 0 and start in (0, None) and (stop is None or (isinstance(stop, int) and stop >= _INT_MAX)) and step == 1
    )


def _strip_rows(node: Any) -> Any:
    """Skip copies and `x[:]` row slices."""
    while isinstance(node, fx.Node) and (node.target in _COPIES or _noop_row_slice(node)):
        node = node.args[0]
    return node


def _static_tail(val: torch.Tensor, skip: int) -> tuple[int, ...] | None:
    tail = tuple(val.shape[skip:])
    return tail if all(isinstance(s, int) for s in tail) else None


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _ancestors(node: fx.Node) -> set[fx.Node]:
    out, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(n.all_input_nodes)
    return out


def _nearest_gemm(node: fx.Node) -> fx.Node | None:
    """The closest mm/addmm among `node`'s inputs (breadth first), if any."""
    seen, frontier = set(), [node]
    while frontier:
        nxt = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            if n.target in _GEMMS:
                return n
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return None


# ---- column equality of per-token cos/sin tensors --------------------------------------------------------------------


def _column_key(node: fx.Node, col: int) -> tuple:
    """A key for column `col` of a `[T, W]` tensor: two columns with equal keys hold equal values in every row.
    Walks back through value-preserving index maps (slices, cats, unsqueezes, expands, views over the non-token dims)
    and records the elementwise functions applied on the way (cos, sin, casts, products with constants)."""
    chain: list[Any] = []
    idx: tuple[int, ...] = (col,)
    while True:
        t, val = node.target, tensor_val(node)
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        src_val = tensor_val(src) if src is not None else None
        if val is None or (src_val is None and t is not aten.cat.default):
            break
        if t in _COPIES or _noop_row_slice(node):
            node = src
        elif node.kwargs:
            break  # only positional arguments are read below
        elif op_name(node) == "prims.convert_element_type" or t in _UNARY:
            chain.append((op_name(node), *node.args[1:]))
            node = src
        elif t in (aten.mul.Tensor, aten.div.Tensor) and isinstance(node.args[1], (int, float)):
            chain.append((op_name(node), float(node.args[1])))
            node = src
        elif t is aten.slice.Tensor and _dim(gemm_branches._slice_args(node)[1], val.dim()) >= 1:
            _, dim, start, _, step = gemm_branches._slice_args(node)
            dim = _dim(dim, val.dim())
            size = src_val.shape[dim]
            if not isinstance(size, int) or not isinstance(start, (int, type(None))):
                break
            start = slice(start, None).indices(size)[0]
            idx = (*idx[: dim - 1], start + idx[dim - 1] * step, *idx[dim:])
            node = src
        elif t is aten.cat.default and _dim(node.args[1] if len(node.args) > 1 else 0, val.dim()) >= 1:
            dim = _dim(node.args[1], val.dim())
            pos = idx[dim - 1]
            for piece in node.args[0]:
                width = tensor_val(piece).shape[dim]
                if not isinstance(width, int):
                    return (tuple(chain), node, idx)
                if pos < width:
                    break
                pos -= width
            idx, node = (*idx[: dim - 1], pos, *idx[dim:]), piece
        elif t is aten.unsqueeze.default and _dim(node.args[1], val.dim()) >= 1:
            dim = _dim(node.args[1], val.dim())
            idx, node = idx[: dim - 1] + idx[dim:], src
        elif t is aten.expand.default and src_val.dim() == val.dim():
            idx = tuple(0 if src_val.shape[d + 1] == 1 else i for d, i in enumerate(idx))
            node = src
        elif t in _VIEWS and same_shape(val.shape[:1], src_val.shape[:1]):
            out_tail, in_tail = _static_tail(val, 1), _static_tail(src_val, 1)
            if out_tail is None or in_tail is None:
                break
            flat = 0
            for i, size in zip(idx, out_tail, strict=True):
                flat = flat * size + i
            new = []
            for size in reversed(in_tail):
                new.append(flat % size)
                flat //= size
            idx, node = tuple(reversed(new)), src
        else:
            break
    return (tuple(chain), node, idx)


# ---- symbolic evaluation of a written K value ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Lin:
    """A `[T, h, *tail]` value: element e = sum of `coef * base[t, head, src] * factor` over `entries[e]`, where a
    factor is `(node, column)` of a per-token `[T, W]` tensor (or None) and `base` is one `[T, h, d]` node."""

    base: fx.Node
    tail: tuple[int, ...]
    entries: tuple[frozenset, ...]  # each a frozenset of ((src, factor), coef)

    @staticmethod
    def identity(node: fx.Node, d: int) -> _Lin:
        return _Lin(node, (d,), tuple(frozenset({((j, None), 1.0)}) for j in range(d)))


@dataclass(frozen=True)
class _Fac:
    """A `[T, 1, *tail]` view of a per-token `[T, W]` tensor `source` (unsqueezed at dim 1); entries are columns."""

    source: fx.Node
    tail: tuple[int, ...]
    cols: tuple[int, ...]


class _Evaluator:
    def __init__(self, tokens: Any, model: torch.dtype) -> None:
        self.tokens = tokens
        self.model = model
        self.memo: dict[fx.Node, Any] = {}
        self.rounding: list[fx.Node] = []  # casts it stopped at: they round, the op would not

    def __call__(self, node: Any) -> Any:
        if not isinstance(node, fx.Node):
            return node
        if node not in self.memo:
            self.memo[node] = self._eval(node)
        return self.memo[node]

    def _base(self, node: fx.Node) -> _Lin | None:
        val = tensor_val(node)
        if val is None or val.dim() != 3 or not val.dtype.is_floating_point or not isinstance(val.shape[2], int):
            return None
        if not same_shape(val.shape[:1], (self.tokens,)):
            return None
        return _Lin.identity(node, val.shape[2])

    def _eval(self, node: fx.Node) -> Any:
        try:
            out = self._op(node)
        except _NoMatch:
            out = None
        return out if out is not None else self._base(node)

    def _op(self, node: fx.Node) -> Any:
        t, val = node.target, tensor_val(node)
        if val is None:
            return None
        args = node.args
        if t in _COPIES or _lossless_cast(node, self.model):
            return self(args[0])
        if _float_cast(node) is not None:
            self.rounding.append(node)
            return None
        if node.kwargs and t not in (aten.add.Tensor, aten.sub.Tensor):
            return None  # only positional arguments are read below
        src = tensor_val(args[0]) if args and isinstance(args[0], fx.Node) else None
        if t is aten.unsqueeze.default and _dim(args[1], val.dim()) == 1 and src is not None and src.dim() == 2:
            if (
                src.dtype.is_floating_point
                and isinstance(src.shape[1], int)
                and same_shape(src.shape[:1], (self.tokens,))
            ):
                return _Fac(args[0], (src.shape[1],), tuple(range(src.shape[1])))
            return None
        x = self(args[0]) if args and isinstance(args[0], fx.Node) else None
        if t is aten.slice.Tensor:
            return self._slice(node, x)
        if t is aten.unsqueeze.default and isinstance(x, _Lin) and _dim(args[1], val.dim()) == val.dim() - 1:
            return _Lin(x.base, (*x.tail, 1), x.entries)
        if t in _VIEWS and isinstance(x, _Lin):
            tail = _static_tail(val, 2)
            if tail is None or val.dim() < 3 or not same_shape(val.shape[:2], tensor_val(args[0]).shape[:2]):
                return None
            return _Lin(x.base, tail, x.entries)
        if t is aten.cat.default:
            return self._cat(node)
        if t is aten.neg.default and isinstance(x, _Lin):
            return _scaled(x, -1.0)
        if t in (aten.mul.Tensor, aten.mul.Scalar) and len(args) == 2 and not node.kwargs:
            return self._mul(self(args[0]), self(args[1]))
        if t in (aten.add.Tensor, aten.sub.Tensor) and len(args) == 2 and node.kwargs.get("alpha", 1) == 1:
            a, b = self(args[0]), self(args[1])
            if isinstance(a, _Lin) and isinstance(b, _Lin) and a.base is b.base and a.tail == b.tail:
                sign = 1.0 if t is aten.add.Tensor else -1.0
                return _Lin(
                    a.base, a.tail, tuple(_merge(ea, eb, sign) for ea, eb in zip(a.entries, b.entries, strict=True))
                )
        return None

    def _slice(self, node: fx.Node, x: Any) -> Any:
        _, dim, start, stop, step = gemm_branches._slice_args(node)
        rank = tensor_val(node).dim()
        dim = _dim(dim, rank)
        if not isinstance(x, (_Lin, _Fac)):
            return None
        if dim < 2:
            no_op = start in (0, None) and (stop is None or (isinstance(stop, int) and stop >= _INT_MAX))
            return x if no_op and step == 1 else None
        if dim != rank - 1 or not all(isinstance(v, (int, type(None))) for v in (start, stop, step)):
            return None
        outer = len(x.entries if isinstance(x, _Lin) else x.cols) // x.tail[-1]
        picked = range(x.tail[-1])[slice(start, stop, step)]
        tail = (*x.tail[:-1], len(picked))
        items = x.entries if isinstance(x, _Lin) else x.cols
        new = tuple(items[o * x.tail[-1] + i] for o in range(outer) for i in picked)
        return _Lin(x.base, tail, new) if isinstance(x, _Lin) else _Fac(x.source, tail, new)

    def _cat(self, node: fx.Node) -> Any:
        pieces = [self(p) for p in node.args[0]]
        rank = tensor_val(node).dim()
        dim = _dim(node.args[1] if len(node.args) > 1 else 0, rank)
        if dim != rank - 1 or not pieces or not all(isinstance(p, _Lin) for p in pieces):
            return None
        base, lead = pieces[0].base, pieces[0].tail[:-1]
        if any(p.base is not base or p.tail[:-1] != lead for p in pieces):
            return None
        outer = len(pieces[0].entries) // pieces[0].tail[-1]
        entries = []
        for o in range(outer):
            for p in pieces:
                width = p.tail[-1]
                entries.extend(p.entries[o * width : (o + 1) * width])
        return _Lin(base, (*lead, sum(p.tail[-1] for p in pieces)), tuple(entries))

    def _mul(self, a: Any, b: Any) -> Any:
        if isinstance(b, _Lin) and not isinstance(a, _Lin):
            a, b = b, a
        if not isinstance(a, _Lin):
            return None
        if isinstance(b, (int, float)) and not isinstance(b, bool):
            return _scaled(a, float(b))
        if not isinstance(b, _Fac) or b.tail != a.tail:
            return None
        entries = []
        for entry, col in zip(a.entries, b.cols, strict=True):
            new = {}
            for (src, factor), coef in entry:
                if factor is not None:
                    return None
                new[(src, (b.source, col))] = coef
            entries.append(frozenset(new.items()))
        return _Lin(a.base, a.tail, tuple(entries))


def _scaled(x: _Lin, scale: float) -> _Lin:
    return _Lin(x.base, x.tail, tuple(frozenset((k, c * scale) for k, c in e) for e in x.entries))


def _merge(a: frozenset, b: frozenset, sign: float) -> frozenset:
    out = dict(a)
    for key, coef in b:
        out[key] = out.get(key, 0.0) + sign * coef
    return frozenset((k, c) for k, c in out.items() if c != 0.0)


# ---- what a written value computes -----------------------------------------------------------------------------------


@dataclass
class _Rope:
    rot: int
    neox: bool
    cos: tuple[fx.Node, int]  # per-token [T, W] tensor and its first cos column
    sin: tuple[fx.Node, int]


def _rope_of(lin: _Lin, d: int) -> _Rope | None:
    entries = lin.entries
    if lin.tail != (d,):
        raise _NoMatch(f"the written value has {lin.tail} elements per head, not the head's {d}")
    plain = [entries[j] == frozenset({((j, None), 1.0)}) for j in range(d)]
    rot = max((j + 1 for j in range(d) if not plain[j]), default=0)
    if rot == 0:
        return None
    if rot % 2:
        raise _NoMatch(f"elements 0..{rot - 1} of a head combine with others, an odd count: not a RoPE")
    half = rot // 2
    why = ""
    for neox in (True, False):
        pairs = [(j, j + half) if neox else (2 * j, 2 * j + 1) for j in range(half)]
        try:
            cos, sin = zip(*(_pair(entries, a, b) for a, b in pairs), strict=True)
        except _NoMatch as err:
            why = why or str(err)
            continue
        return _Rope(rot, neox, _columns(cos, "cos"), _columns(sin, "sin"))
    raise _NoMatch(f"the first {rot} elements of a head are neither a neox nor a GPT-J rotation ({why})")


def _pair(entries, a: int, b: int) -> tuple[tuple, tuple]:
    """`(a, b) -> (a c - b s, b c + a s)`: the two cos and the two sin factors, each pair proven equal."""
    ea, eb = dict(entries[a]), dict(entries[b])
    try:
        ((ca, c1),) = [(k, v) for k, v in ea.items() if k[0] == a]
        ((sa, s1),) = [(k, v) for k, v in ea.items() if k[0] == b]
        ((cb, c2),) = [(k, v) for k, v in eb.items() if k[0] == b]
        ((sb, s2),) = [(k, v) for k, v in eb.items() if k[0] == a]
    except ValueError:
        raise _NoMatch(f"elements {a} and {b} are not two-term sums of each other") from None
    if len(ea) != 2 or len(eb) != 2 or (c1, s1, c2, s2) != (1.0, -1.0, 1.0, 1.0):
        raise _NoMatch(f"elements ({a}, {b}) are not (a c - b s, b c + a s)")
    for f1, f2, what in ((ca[1], cb[1], "cos"), (sa[1], sb[1], "sin")):
        if None in (f1, f2):
            raise _NoMatch(f"element pair ({a}, {b}) has a term without a {what} factor")
        if f1 != f2 and _column_key(*f1) != _column_key(*f2):
            raise _NoMatch(f"element pair ({a}, {b}) reads {what} columns not provably equal: {f1[1]} and {f2[1]}")
    return ca[1], sa[1]


def _columns(factors: tuple, what: str) -> tuple[fx.Node, int]:
    sources = {f[0] for f in factors}
    cols = [f[1] for f in factors]
    if len(sources) != 1 or cols != list(range(cols[0], cols[0] + len(cols))):
        raise _NoMatch(f"the {what} factors are not consecutive columns of one per-token tensor")
    return factors[0][0], cols[0]


def _weight_leaf(node: Any, d: int, model: torch.dtype) -> fx.Node | None:
    leaf = _strip(node, model)
    val = tensor_val(leaf)
    if isinstance(leaf, fx.Node) and leaf.op == "placeholder" and val is not None and tuple(val.shape) == (d,):
        return leaf
    return None


def _norm_core(node: Any, model: torch.dtype) -> tuple[fx.Node, float] | None:
    """`(x, eps)` if `node` is `x * rsqrt(mean(x², -1, keepdim) + eps)` (either operand order)."""
    if not isinstance(node, fx.Node) or node.target is not aten.mul.Tensor or len(node.args) != 2:
        return None
    for x, r in (node.args, node.args[::-1]):
        r = _strip(r, model)
        if not isinstance(r, fx.Node) or r.target is not aten.rsqrt.default:
            continue
        add = _strip(r.args[0], model)
        if not isinstance(add, fx.Node) or add.target not in _ADDS or add.kwargs.get("alpha", 1) != 1:
            continue
        mean, eps = add.args if isinstance(add.args[1], (int, float)) else add.args[::-1]
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not isinstance(mean, fx.Node):
            continue
        mean = _strip(mean, model)
        if mean.target is not aten.mean.dim or not isinstance(x, fx.Node):
            continue
        rank = tensor_val(mean.args[0]).dim()
        dims = [_dim(d, rank) for d in mean.args[1]]
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        if dims != [rank - 1] or not keepdim or mean.kwargs.get("dtype") is not None:
            continue
        sq = _strip(mean.args[0], None)
        squares = (sq.target is aten.pow.Tensor_Scalar and sq.args[1] == 2) or (
            sq.target is aten.mul.Tensor and sq.args[0] is sq.args[1]
        )
        if not squares:
            continue
        y = sq.args[0]
        if _strip(y, model) is _strip(x, model):
            return x, float(eps)
    return None


@dataclass
class _Projection:
    gemm: gemm_branches.GemmBranch
    row_start: int  # weight row of the block's first column
    heads: int
    head_dim: int


def _projection(node: fx.Node, model: torch.dtype) -> _Projection:
    """The `[T, h, d]` view of a GEMM column block (GEMM output, a column slice or a split piece)."""
    view = _strip(node, model)
    val = tensor_val(view)
    if view.target not in _VIEWS or val is None or val.dim() != 3:
        raise _NoMatch(f"{op_name(view)} ({view.name}) is neither RMSNorm, RoPE nor a [T, heads, head_dim] view")
    heads, head_dim = val.shape[1:]
    block = _strip(view.args[0], None)
    width = tensor_val(block).shape[-1]
    if block.target in _GEMMS:
        gemm, col = block, 0
    elif block.target is operator.getitem and block.args[0].target in gemm_branches._SPLITS:
        split = block.args[0]
        gemm = split.args[0]
        if gemm_branches._split_dim(split) not in (1, -1) or not gemm_branches._constant_args(split):
            raise _NoMatch("the projection is split along another dim or by symbolic sizes")
        col = gemm_branches._split_bounds(split, int(tensor_val(gemm).shape[1]))[block.args[1]][0]
    elif block.target is aten.slice.Tensor and gemm_branches._constant_args(block) and not block.kwargs:
        gemm, dim, start, stop, step = gemm_branches._slice_args(block)
        if dim not in (1, -1) or step != 1:
            raise _NoMatch("the projection is a strided or row slice of the GEMM output")
        col = slice(start, stop).indices(int(tensor_val(gemm).shape[1]))[0]
    else:
        raise _NoMatch(f"the [T, heads, head_dim] view reads {op_name(block)} ({block.name}), not a GEMM column block")
    if gemm.target not in _GEMMS:
        raise _NoMatch(f"the projection comes from {op_name(gemm)}, not from a GEMM")
    branch = gemm_branches.match_gemm(gemm)
    if isinstance(branch, str):
        raise _NoMatch(f"its GEMM {gemm.name} does not fit the op: {branch}")
    if width != heads * head_dim:
        raise _NoMatch(f"the [T, {heads}, {head_dim}] view reads {width} columns")
    return _Projection(branch, branch.row_start + col, int(heads), int(head_dim))


# ---- write sites -----------------------------------------------------------------------------------------------------


@dataclass
class _Site:
    """One cache write: `copy_(cache, new)`; `value` is the `[T, h, d]` value written."""

    cache: fx.Node
    copy: fx.Node
    new: fx.Node
    value: fx.Node
    key: tuple  # ("index", loc) | ("slice", start, stop) | ("commit", loc2d, lens)
    nodes: list[fx.Node] = field(default_factory=list)  # site nodes that die with the write


def _find_sites(graph: fx.Graph) -> list[_Site]:
    copies = [n for n in graph.nodes if n.target is aten.copy_.default and n.args[0].op == "placeholder"]
    mutated: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            for arg in node.all_input_nodes:
                mutated[arg] = mutated.get(arg, 0) + 1
    sites = []
    for copy in copies:
        cache, new = copy.args[:2]
        if mutated.get(cache, 0) != 1 or len(new.users) != 1 or not isinstance(new, fx.Node):
            continue
        site = _index_site(cache, copy, new) or _slice_site(cache, copy, new)
        if site is not None:
            sites.append(site)
    return sites


def _index_site(cache: fx.Node, copy: fx.Node, new: fx.Node) -> _Site | None:
    if new.target is not aten.index_put.default or new.args[0] is not cache:
        return None
    accumulate = new.args[3] if len(new.args) > 3 else new.kwargs.get("accumulate", False)
    indices = new.args[1]
    if accumulate or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    loc, value = indices[0], new.args[2]
    loc_val = tensor_val(loc)
    if loc_val is None or loc_val.dim() != 1 or loc_val.dtype not in (torch.int32, torch.int64):
        return None
    if isinstance(value, fx.Node) and value.target is aten.where.self:
        commit = _commit(cache, loc, value)
        if commit is not None:
            return _Site(cache, copy, new, value.args[1], commit, [new, value, value.args[2]])
    nodes = [new]
    if isinstance(value, fx.Node) and value.target in _VIEWS and loc_val.shape[0] == 1:
        src = tensor_val(value.args[0])  # one token: `[1, h, d]` viewed as `[h, d]` (it broadcasts to the slot)
        if src is not None and src.dim() == 3 and src.shape[0] == 1 and tensor_val(value).shape == src.shape[1:]:
            nodes.append(value)
            value = value.args[0]
    return _Site(cache, copy, new, value, ("index", loc), nodes)


def _commit(cache: fx.Node, loc: fx.Node, where: fx.Node) -> tuple | None:
    """`("commit", loc2d, lens)` for `where(keep, value, cache[loc])`, `keep` = `arange(W) < lens[:, None]`."""
    keep, _, old = where.args
    if not (isinstance(old, fx.Node) and old.target is aten.index.Tensor and old.args[0] is cache):
        return None
    if len(old.args[1]) != 1 or old.args[1][0] is not loc or loc.target not in _VIEWS:
        return None
    loc2d, loc2d_val = loc.args[0], tensor_val(loc.args[0])
    if loc2d_val is None or loc2d_val.dim() != 2 or not isinstance(loc2d_val.shape[1], int):
        return None
    keep_val = tensor_val(keep)
    if keep.target not in _VIEWS or keep_val.dim() != 3 or tuple(keep_val.shape[1:]) != (1, 1):
        return None
    lt = keep.args[0]
    if lt.target is aten.lt.Tensor:
        row, lens = lt.args
    elif lt.target is aten.gt.Tensor:
        lens, row = lt.args
    else:
        return None
    if row.target is not aten.unsqueeze.default or _dim(row.args[1], 2) != 0:
        return None
    if lens.target is not aten.unsqueeze.default or _dim(lens.args[1], 2) != 1:
        return None
    lens = _strip_rows(lens.args[0])
    lens_val = tensor_val(lens)
    if lens_val is None or lens_val.dim() != 1 or lens_val.dtype not in (torch.int32, torch.int64):
        return None
    if not same_shape(lens_val.shape, loc2d_val.shape[:1]):
        return None
    if not _is_arange(row.args[0], loc2d_val.shape[1]):
        return None
    return ("commit", loc2d, lens)


def _is_arange(node: fx.Node, width: int) -> bool:
    """`arange(width)` (0, 1, ..., width - 1) as iota or arange."""
    if op_name(node) == "prims.iota":
        return node.args[0] == width and node.kwargs.get("start") == 0 and node.kwargs.get("step") == 1
    if node.target in _ARANGES:
        args = list(node.args) if node.target is not aten.arange.default else [0, *node.args]
        return args[:2] == [0, width] and (len(args) < 3 or args[2] == 1)
    return False


def _slice_site(cache: fx.Node, copy: fx.Node, new: fx.Node) -> _Site | None:
    if new.target is not aten.slice_scatter.default or new.args[0] is not cache or new.kwargs:
        return None
    args = (*new.args, *(0, None, None, 1)[len(new.args) - 2 :])
    _, src, dim, start, stop, step = args[:6]
    if dim != 0 or step != 1 or start is None or stop is None:
        return None
    if isinstance(start, int) and start < 0:
        return None
    if isinstance(start, fx.Node) and not statically_known_true(start.meta.get("val") >= 0):
        return None
    nodes = [new]
    value = src
    if src.target is aten.copy.default:
        dst, value = src.args
        if dst.target is not aten.slice.Tensor or dst.args[0] is not cache or len(src.users) != 1:
            return None
        if tensor_val(value).dtype != tensor_val(dst).dtype or not same_shape(
            tensor_val(value).shape, tensor_val(dst).shape
        ):
            return None
        nodes += [src, dst]
    return _Site(cache, copy, new, value, ("slice", start, stop), nodes)


# ---- one write: site + what it computes ------------------------------------------------------------------------------


@dataclass
class _Write:
    site: _Site
    proj: _Projection
    eps: float | None = None
    weight: fx.Node | None = None
    rope: _Rope | None = None

    @property
    def transformed(self) -> bool:
        return self.eps is not None or self.rope is not None


def _analyse(site: _Site, activation: fx.Node) -> _Write:
    cache_val = tensor_val(site.cache)
    value_val = tensor_val(site.value)
    if cache_val.dim() != 3 or value_val is None or value_val.dim() != 3:
        raise _NoMatch("not a [slots, heads, head_dim] cache written with a [T, heads, head_dim] value")
    if tuple(value_val.shape[1:]) != tuple(cache_val.shape[1:]) or value_val.dtype != cache_val.dtype:
        raise _NoMatch(f"the value written is {value_val.dtype}{list(value_val.shape)}")
    model = cache_val.dtype
    evaluator = _Evaluator(tensor_val(activation).shape[0], model)
    try:
        return _written(site, evaluator, int(cache_val.shape[2]), model)
    except _NoMatch as err:
        cast = _rounding_cast(site.value, activation, evaluator.rounding, model)
        if cast is None:
            raise
        src, dst = _float_cast(cast)
        raise _NoMatch(
            f"{cast.name} casts {src} to {dst}, a rounding the op does not make (only casts that keep every value and "
            f"roundings to the model dtype {model} may be left out): {err}"
        ) from None


def _rounding_cast(value: fx.Node, activation: fx.Node, seen: list[fx.Node], model: torch.dtype) -> fx.Node | None:
    """The first cast on the way from `activation` to `value` (or met by the evaluator: a cos/sin factor's) that
    rounds where the op would not."""
    graph = value.graph
    on_path = _ancestors(value) & descendants(graph, [activation])
    casts = [n for n in graph.nodes if n in on_path or n in seen]
    return next((n for n in casts if _float_cast(n) is not None and not _lossless_cast(n, model)), None)


def _written(site: _Site, evaluator: _Evaluator, d: int, model: torch.dtype) -> _Write:
    lin = evaluator(site.value)
    if not isinstance(lin, _Lin):
        raise _NoMatch("the value written is not a [T, heads, head_dim] tensor")
    rope = _rope_of(lin, d)
    base, weight = _strip(lin.base, model), None
    core = _norm_core(base, model)
    if core is None and base.target is aten.mul.Tensor and len(base.args) == 2:
        for a, w in (base.args, base.args[::-1]):
            leaf = _weight_leaf(w, d, model)
            if leaf is not None and (core := _norm_core(_strip(a, model), model)) is not None:
                weight = leaf
                break
    if core is None:
        return _Write(site, _projection(base, model), rope=rope)
    x, eps = core
    return _Write(site, _projection(x, model), eps, weight, rope)


# ---- the group of writes on one activation ---------------------------------------------------------------------------


class _Group:
    def __init__(self, activation: fx.Node) -> None:
        self.activation = activation
        self.writes: list[_Write] = []
        self.failed: list[str] = []


@dataclass(frozen=True)
class KVLowering:
    lowered: list[KVWriteReport]  # the groups of writes lowered to multi_linear_kv_write
    kept: list[str]  # the groups of writes kept on today's path, and why


def lower_kv_writes(graph: fx.Graph, config: DsparkConfig, names: Namer) -> KVLowering:
    """Lower every group of cache writes that fits."""
    groups: dict[fx.Node, _Group] = {}
    for site in _find_sites(graph):
        gemm = _nearest_gemm(site.value)
        if gemm is None:
            continue  # not a projection: no business of this pass
        activation = gemm.args[1] if gemm.target is aten.addmm.default else gemm.args[0]
        group = groups.setdefault(activation, _Group(activation))
        try:
            write = _analyse(site, activation)
            if write.proj.gemm.activation is not activation:
                raise _NoMatch("its projection reads another activation")
            group.writes.append(write)
        except _NoMatch as err:
            group.failed.append(f"write to {names.of(site.cache)}: {err}")
    lowered, kept = [], []
    for group in groups.values():
        where = names.of(group.activation)
        try:
            lowered.append(_emit(graph, group, _plan(graph, group, config, names), names))
        except _NoMatch as err:
            kept.append(f"{where}: {err}")
    return KVLowering(lowered, kept)


@dataclass
class _Plan:
    ks: list[_Write]
    vs: list[_Write]
    heads: int
    head_dim: int
    key: tuple
    rope: _Rope | None


def _plan(graph: fx.Graph, group: _Group, config: DsparkConfig, names: Namer) -> _Plan:
    if group.failed:
        raise _NoMatch("; ".join(group.failed))
    writes = group.writes
    ks = [w for w in writes if w.transformed]
    vs = [w for w in writes if not w.transformed]
    if not ks:  # no norm, no RoPE anywhere: any split into K and V computes the same
        ks, vs = vs[0::2], vs[1::2]
    if len(ks) != len(vs):
        raise _NoMatch(
            f"{len(ks)} normed/rotated (K) and {len(vs)} plain (V) cache writes: the op writes K and V of every layer"
        )
    shapes = {(w.proj.heads, w.proj.head_dim, tuple(tensor_val(w.site.cache).shape)) for w in writes}
    if len(shapes) != 1:
        raise _NoMatch(f"the caches or heads differ across layers: {sorted(str(s) for s in shapes)}")
    keys = {w.site.key for w in writes}
    if len(keys) != 1:
        raise _NoMatch("the layers write at different slots (cache_loc, slice or commit lengths)")
    tokens = tensor_val(group.activation).shape[0]
    key = next(iter(keys))
    slots = tensor_val(key[1]) if key[0] != "slice" else None
    if slots is not None and not _guard_equal(slots.numel(), tokens):
        raise _NoMatch(f"{names.of(key[1])} has {slots.numel()} slots for {tokens} tokens (eager would broadcast)")
    if len({w.eps is None for w in ks}) != 1:
        raise _NoMatch("some layers norm K and others do not (the op norms all layers or none)")
    ropes = [w.rope for w in ks]
    if any(r is None for r in ropes) and any(r is not None for r in ropes):
        raise _NoMatch("some layers rotate K and others do not (the op rotates all layers or none)")
    if ropes[0] is not None and len({(r.rot, r.neox) for r in ropes}) != 1:
        desc = sorted({f"{'neox' if r.neox else 'gptj'} R={r.rot}" for r in ropes})
        raise _NoMatch(f"the RoPE differs across layers ({', '.join(desc)}); the op rotates every layer alike")
    x_val = tensor_val(group.activation)
    if tensor_val(writes[0].site.cache).dtype != x_val.dtype:
        raise _NoMatch(f"the caches are {tensor_val(writes[0].site.cache).dtype}, the activation {x_val.dtype}")
    for w in ks:
        if w.weight is not None and tensor_val(w.weight).dtype not in (x_val.dtype, torch.float32):
            raise _NoMatch(f"the k_norm weight {names.of(w.weight)} is {tensor_val(w.weight).dtype}")
    heads, head_dim, _ = shapes.pop()
    _check_exclusive(group, names)
    _check_device(config, x_val, head_dim, [w.site.cache for w in writes])
    return _Plan(ks, vs, heads, head_dim, keys.pop(), ropes[0])


def _guard_equal(a: Any, b: Any) -> bool:
    """Whether two sizes are equal; when only the symbols' current values say so, a guard is installed (a call
    where they differ, e.g. one token broadcast to several slots, recompiles and keeps today's path)."""
    if statically_known_true(a == b):
        return True
    return bool(a == b)


def _check_exclusive(group: _Group, names: Namer) -> None:
    """Every node computing a written value only feeds the writes (the op returns nothing), and every other read of
    a cache comes before the writes."""
    inside: set[fx.Node] = set()
    for w in group.writes:
        gemm = w.proj.gemm.node
        chain = _ancestors(w.site.value) & descendants(gemm.graph, [gemm])
        inside |= chain | set(w.site.nodes) | {w.site.copy}
    order = {n: i for i, n in enumerate(group.activation.graph.nodes)}
    for node in sorted(inside, key=order.__getitem__):  # graph order: the reason names the same node every run
        for user in node.users:
            if user in inside:
                continue
            if user.target is operator.getitem and not user.users:
                continue  # an unused piece of a split (the Q part of a qkv GEMM)
            raise _NoMatch(
                f"{node.name} ({op_name(node)}) is also read by {user.name} ({op_name(user)}); the op returns nothing"
            )
    first = min(order[w.site.copy] for w in group.writes)
    for w in group.writes:
        for user in w.site.cache.users:
            if user not in inside and order[user] > first:
                raise _NoMatch(f"{names.of(w.site.cache)} is read by {user.name} after the writes")


@functools.cache
def has_cuda_kernel() -> bool:
    """A CUDA kernel of the op is registered, or its first-use entry is, the CUDA sources define the op and the
    library can be built here (`cuda_library_problem`)."""
    name = "dspark::multi_linear_kv_write"
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"):
        return True
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"):
        return False
    if custom_ops._build.cuda_library_problem():
        return False
    csrc = Path(custom_ops.__file__).parent / "csrc"
    return any("multi_linear_kv_write" in path.read_text() for path in csrc.rglob("*.c*"))


def kernel_mismatch(x_val: torch.Tensor, head_dim: int, caches: list[torch.Tensor]) -> str:
    """Why the op's CUDA kernel cannot run on these operands ("" if it can)."""
    if x_val.device.type != "cuda":
        return f"the tensors are on {x_val.device.type}"
    if not has_cuda_kernel():
        problem = custom_ops._build.cuda_library_problem()
        return (
            f"no CUDA kernel of the op can run: {problem}"
            if problem
            else "this build of custom_ops has no CUDA kernel of the op"
        )
    try:
        check_cuda_operands(x_val, head_dim, [(f"cache {i}", c) for i, c in enumerate(caches)])
    except (TypeError, ValueError) as err:
        return str(err)
    return ""


def _check_device(config: DsparkConfig, x_val: torch.Tensor, head_dim: int, caches: list[fx.Node]) -> None:
    if config.kv_write_op == "always" and x_val.device.type != "cuda":
        return
    why = kernel_mismatch(x_val, head_dim, [tensor_val(c) for c in caches])
    if not why:
        return
    if config.kv_write_op == "auto":
        raise _NoMatch(f"kv_write_op='auto' lowers only where the op's CUDA kernel runs: {why}")
    raise _NoMatch(f"the op's CUDA binding cannot take these operands: {why}")


# ---- emission --------------------------------------------------------------------------------------------------------


def _gathered_table(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """`(table, positions)` if `node` is `table[positions]` of a 2-D fp32 parameter/buffer."""
    node = _strip_rows(node)
    if node.target is not aten.index.Tensor or len(node.args[1]) != 1:
        return None
    table, pos = node.args[0], node.args[1][0]
    table_val, pos_val = tensor_val(table), tensor_val(pos)
    if table.op != "placeholder" or table_val.dim() != 2 or table_val.dtype != torch.float32:
        return None
    if pos_val is None or pos_val.dim() != 1 or pos_val.dtype not in (torch.int32, torch.int64):
        return None
    return table, pos


def _tables(graph: fx.Graph, ks: list[_Write], x: fx.Node, names: Namer):
    """(per-layer cos/sin tables, positions, description) for the op."""
    half = ks[0].rope.rot // 2
    direct = []
    for w in ks:
        rope = w.rope
        gathered = _gathered_table(rope.cos[0]) if rope.cos[0] is rope.sin[0] else None
        if gathered is None or rope.cos[1] != 0 or rope.sin[1] != half or tensor_val(gathered[0]).shape[1] != 2 * half:
            break
        direct.append(gathered)
    if (
        len(direct) == len(ks)
        and len({p for _, p in direct}) == 1
        and len({tensor_val(t).shape[0] for t, _ in direct}) == 1
    ):
        pos = direct[0][1]
        return [t for t, _ in direct], pos, "tables {} at " + names.of(pos)
    built: dict[tuple, fx.Node] = {}
    tables = []
    for w in ks:
        (cos, c0), (sin, s0) = w.rope.cos, w.rope.sin
        key = (cos, c0, sin, s0)
        if key not in built:
            parts = [
                call(graph, aten.slice.Tensor, (cos, 1, c0, c0 + half)),
                call(graph, aten.slice.Tensor, (sin, 1, s0, s0 + half)),
            ]
            table = call(graph, aten.cat.default, (parts, 1))
            if tensor_val(table).dtype != torch.float32:
                table = call(graph, prims.convert_element_type.default, (table, torch.float32))
            built[key] = table
        tables.append(built[key])
    positions = _arange_tokens(graph, x)
    return tables, positions, "fp32 [T, R] rows built in the graph from the model's per-token cos/sin, at arange(T)"


def _arange_tokens(graph: fx.Graph, x: fx.Node, start: Any = 0) -> fx.Node:
    """`start + arange(T)` for the rows of `x` (a symbolic T is read with sym_size: no recompile, no host sync).

    Emitted as `prims.iota`, what Inductor's decompositions make of an integer `arange`: the pass runs on the
    post-grad graph, where Inductor lowers `prims.iota` but not `aten.arange.default` (it decomposes that one
    before this point, and refuses it as a fallback)."""
    x_val = tensor_val(x)
    tokens = x_val.shape[0]
    if not isinstance(tokens, int):
        tokens = call(graph, aten.sym_size.int, (x, 0))
    kwargs = {"start": start, "step": 1, "dtype": torch.int64, "device": x_val.device, "requires_grad": False}
    return call(graph, prims.iota.default, (tokens,), kwargs)


def _emit(graph: fx.Graph, group: _Group, plan: _Plan, names: Namer) -> KVWriteReport:
    """Insert the op and remove the writes it replaces; if the op's fake impl refuses the operands or the numeric
    self-check finds the op computing something else, remove what was inserted and raise `_NoMatch`."""
    existing = set(graph.nodes)
    try:
        op, report = _insert_op(graph, group, plan, names)
        why = self_check(op, [(k.site.value, v.site.value) for k, v in zip(plan.ks, plan.vs, strict=True)], op.args[0])
        if why:
            raise _NoMatch(why)
    except _NoMatch:
        for node in reversed([n for n in graph.nodes if n not in existing]):
            graph.erase_node(node)
        raise
    dead = []
    for w in plan.ks + plan.vs:
        graph.erase_node(w.site.copy)
        dead += [*w.site.nodes, w.site.value]
    _erase_dead(graph, dead)
    return report


def _insert_op(graph: fx.Graph, group: _Group, plan: _Plan, names: Namer) -> tuple[fx.Node, KVWriteReport]:
    """The op node (before the first cache write), its `meta["val"]` from the op's fake impl, and its report."""
    ks, vs = plan.ks, plan.vs
    x = group.activation
    first_copy = min((w.site.copy for w in ks + vs), key=_position(graph))
    with graph.inserting_before(first_copy):
        kind = plan.key[0]
        commit_lens = None
        if kind == "index":
            loc = plan.key[1]
            write = f"index_put at {names.of(plan.key[1])} (a negative slot counts from the end, as in eager)"
        elif kind == "commit":
            loc = plan.key[1]
            commit_lens = plan.key[2]
            write = f"index_put at {names.of(plan.key[1])}[b, j] for j < {names.of(commit_lens)}[b] (commit_lens)"
        else:
            _, start, stop = plan.key
            loc = _arange_tokens(graph, x, start)
            write = f"slice [{_sym(start, names)}:{_sym(stop, names)}] (cache_loc = {_sym(start, names)} + arange(T))"
        if plan.rope is not None:
            tables, positions, where = _tables(graph, ks, x, names)
            names_of_tables = ", ".join(dict.fromkeys(names.of(t) for t in tables))
            rope = (
                f"{'neox' if plan.rope.neox else 'GPT-J'} RoPE on {plan.rope.rot} of {plan.head_dim} dims, "
                + where.format(names_of_tables)
            )
        else:
            flat_loc = loc if kind != "commit" else call(graph, aten.reshape.default, (loc, [-1]))
            tables, positions, rope = [], flat_loc, "no RoPE"
        has_norm = ks[0].eps is not None
        args = (
            x,
            [w.proj.gemm.weight for w in ks],
            [w.proj.row_start for w in ks],
            [w.proj.gemm.bias for w in ks],
            [w.proj.gemm.weight for w in vs],
            [w.proj.row_start for w in vs],
            [w.proj.gemm.bias for w in vs],
            [w.weight if has_norm else None for w in ks],
            [w.eps for w in ks] if has_norm else [],
            tables,
            positions,
            plan.rope.neox if plan.rope is not None else True,
            [w.site.cache for w in ks],
            [w.site.cache for w in vs],
            loc,
            commit_lens,
            plan.heads,
            plan.head_dim,
            True,
        )
        try:
            op = call(graph, KV_WRITE, args)
        except (TypeError, ValueError) as err:  # the op's checks: on CUDA, the binding's rules too
            raise _NoMatch(f"the op's fake impl refuses the operands: {err}") from None
    kv = plan.heads * plan.head_dim

    def rows(w: _Write) -> str:
        bias = " + bias" if w.proj.gemm.bias is not None else ""
        return f"{names.of(w.proj.gemm.weight)}[{w.proj.row_start}:{w.proj.row_start + kv}]{bias}"

    layers = [
        f"K {rows(k)} -> {names.of(k.site.cache)}, V {rows(v)} -> {names.of(v.site.cache)}"
        for k, v in zip(ks, vs, strict=True)
    ]
    if has_norm:
        present = [w.weight is not None for w in ks]
        weights = "weights" if all(present) else "no weight" if not any(present) else "weights on some layers"
        eps = list(dict.fromkeys(f"{w.eps:g}" for w in ks))
        norm = f"k_norm RMSNorm eps {eps[0] if len(eps) == 1 else [f'{w.eps:g}' for w in ks]} ({weights})"
    else:
        norm = "no k_norm"
    return op, KVWriteReport(names.of(x), layers, write, norm, rope)


def _sym(value: Any, names: Namer) -> str:
    return names.of(value) if isinstance(value, fx.Node) else str(value)


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase `nodes` and then their inputs, as long as they are pure and unused."""
    todo, erased = list(nodes), set()
    while todo:
        node = todo.pop()
        if node in erased or node.users or not is_pure(node):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        todo.extend(inputs)


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]
