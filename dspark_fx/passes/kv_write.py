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

Write sites (each the only mutation of a cache placeholder, or of a constant (`get_attr`: a buffer of an exported
model compiled by AOTInductor), its new value read by nothing but the final `copy_`):
`index_put(cache, [loc], value)` (`cache[loc] = k`, `cache.index_copy_(0, loc, k)`), or `scatter(cache, 0,
expand(view(loc, [T, 1, 1]), [T, h, d]), value)` (`cache.scatter_(0, loc.view(-1, 1, 1).expand_as(k), k)`: whole
rows, the same write but that eager raises on a negative slot); `slice_scatter(cache,
copy(slice(cache, 0, a, b), value), 0, a, b)` (`cache[a:b] = k`, `a >= 0`; the op gets `a + arange(T)`); and
`index_put(cache, [view(loc2d, [-1])], where(keep, value, index(cache, [view(loc2d, [-1])])))` with `keep =
view(lt(unsqueeze(arange(W), 0), unsqueeze(lens, 1)), [-1, 1, 1])` (rows `j < lens[b]` of `loc2d [B, W]`: the op's
`commit_lens`). Where the cache is written through a view, the op writes that view: `view(index_put(view(cache,
[-1, h, d]), [loc], value), cache.shape)` (a paged `[pages, page, h, d]` cache, `cache.view(-1, h, d)[loc] = k`),
and `index_put(cache, [None, None, loc], value)` of HF's static cache `[1, h, S, d]` (`cache.index_copy_(2, loc,
k)`; slots along another dim than the first, the other dims of size 1), whose cache and value the pass views as
`[S, h, d]` and `[T, h, d]`; and a paged cache written with two indices, `cache[loc // page, loc % page] = k`
(`_page_offset_site`), whose `view(-1, h, d)` the op writes at `loc`. Several caches in one buffer (`buf[i][loc] =
k_i` for distinct `i`: layers stacked in `[L, S, h, d]`, or vLLM's `[2, pages, page, h, d]` K and V of a layer; or
`buf[loc, i] = k_i`: K and V interleaved per slot in `[S, 2, h, d]`) are a chain of `select_scatter(prev, write_i,
dim, i)` along one dim ending in one `copy_`: each link is a site on `select(buf, dim, i)`, and they lower together
or not at all.
Other scatters of projections into a cache get a `KVKept` (`WRITE_FORM`). Where a group as a whole does not lower
because its layers differ, or because some of its writes are not the op's formula (`_lower_parts`), the layers the
op writes alike lower, one op per kind, and the other writes stay with their reasons. There must
be one slot per token (from the shapes, or a guard on the symbolic sizes: a write of one
token to several slots broadcasts in eager). The op takes the place of the first cache `copy_` (the end of the
graph), after every read of the old cache values, which must all come before it; where a tensor it reads is written
in place before that (`positions += 1` after the writes in the model: AOT writes a mutated input back at the end of
the graph, in input order), it moves before that write, or the writes are kept (`OPERAND_WRITTEN`) where the
model reads the tensor before and after a write, or where an operand is computed, or a cache used, after it.

What is written must be, element for element, the op's formula applied to a column block of a GEMM on the shared
activation, whatever the spelling. `kv_symbolic` evaluates every element of the written values (all writes of a
group share one evaluation) through one table of op rules; `kv_spec.read_written` reads off it the GEMM block, the
norm (eps, weight form) and the rotation (neox or GPT-J, R, and per token the cos/sin expressions), and proves
that each element is the formula; `kv_tables` gives the op its table operands: the model's fp32 `[P, R]` `[cos |
sin]` table at its positions where the rows are that, else `[T, R]` fp32 rows built in the graph from the values
the model computed, read at `arange(T)`. Casts are left out of the proof only where the op makes no error by leaving
them out: one to a dtype that represents every value of the source, or one that rounds a value at least as precise
as the model dtype to the model dtype (the rounding the op's tolerance covers); any other cast, e.g. an fp8
fake-quantization or a bf16 -> fp16 round trip, rounds where the op would not, and the write keeps today's path,
the cast named in the report. A write that does not lower gets a `KVKept` (a `KVKeptReason`, the details, the node
that stopped it and its source line).

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
from dspark_fx.passes.graph_utils import (
    aten,
    call,
    fake_mode_of,
    gemm_activation,
    is_pure,
    op_name,
    shape_key,
    source_line,
    storage_family,
    tensor_val,
    written_args,
)
from dspark_fx.passes.kv_spec import Norm, NotTheFormula, Rope, Written, normed_size, read_written
from dspark_fx.passes.kv_symbolic import Evaluation, Unevaluable, whole_range
from dspark_fx.passes.kv_tables import Direct, built_table, direct_table, locate, scale_of
from dspark_fx.passes.kv_write_check import STATIC_AS_IS, self_check
from dspark_fx.passes.names import Namer
from dspark_fx.report import KVKept, KVKeptReason, KVWriteReport

KV_WRITE = torch.ops.dspark.multi_linear_kv_write.default
prims = torch.ops.prims

_GEMMS = (aten.mm.default, aten.addmm.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_COPIES = (aten.alias.default, aten.clone.default)
_SCATTERS = (aten.index_put.default, aten.slice_scatter.default, aten.select_scatter.default, aten.scatter.src)
# writes into a cache reported as kept (`_other_write`) when none of the forms above matched, through any layout view
_ANY_SCATTER = (
    *_SCATTERS,
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    aten.scatter_add.default,
    aten.scatter_reduce.two,
    aten.index_add.default,
    aten.index_copy.default,
    aten.index_fill.int_Scalar,
    aten.masked_scatter.default,
    aten.as_strided_scatter.default,
    aten.diagonal_scatter.default,
)
_LAYOUT_VIEWS = (*_VIEWS, aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default)
_UNARY = {aten.cos.default, aten.sin.default, aten.neg.default, aten.exp.default}
_ADDS = (aten.add.Tensor, aten.add.Scalar)
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


class _NoMatch(Exception):
    """The writes do not lower: `reason`, the message (details), the node that stopped it, the cache it is about."""

    def __init__(
        self, reason: KVKeptReason, detail: str, node: fx.Node | None = None, cache: fx.Node | None = None
    ) -> None:
        super().__init__(detail)
        self.reason, self.node, self.cache = reason, node, cache

    def kept(self, activation: fx.Node, names: Namer) -> KVKept:
        node = self.node
        return KVKept(
            names.of(activation),
            self.reason,
            str(self),
            names.of(self.cache) if self.cache is not None else None,
            node.name if node is not None else None,
            _where(node, names) if node is not None else None,
        )


def _where(node: fx.Node, names: Namer) -> str | None:
    """The model's source line of `node`; a graph input (no source line) by its input name."""
    if node.op == "placeholder" and names.of(node) != node.name:
        return f"the graph input {names.of(node)}"
    return source_line(node)


_SPEC_REASONS = {
    "projection": KVKeptReason.NOT_A_PROJECTION,
    "unevaluable": KVKeptReason.UNEVALUABLE,
    "norm": KVKeptReason.NORM,
    "rope": KVKeptReason.ROPE,
    "tables": KVKeptReason.TABLES,
    "cast": KVKeptReason.ROUNDING_CAST,
    "layout": KVKeptReason.LAYOUT,
}


# ---- small graph helpers ---------------------------------------------------------------------------------------------


def _whole_slice_dim(node: fx.Node) -> int | None:
    """The dim of a slice that keeps all of it (`x[:]`, `x[:, :]`, unit step), else None."""
    if node.target is not aten.slice.Tensor or node.kwargs:
        return None
    base, dim, start, stop, step = gemm_branches._slice_args(node)
    val = tensor_val(base)
    return dim if whole_range(base, _dim(dim, val.dim()) if val is not None else dim, start, stop, step) else None


def _slice_scatter_args(node: fx.Node) -> tuple:
    """`(input, src, dim, start, end, step)` of an `aten.slice_scatter` node (positional), defaults filled in."""
    return (*node.args, *(0, None, None, 1)[len(node.args) - 2 :])


def _drop_whole_slices(graph: fx.Graph) -> None:
    """Replace a slice that keeps all of a dim by its input, and a `slice_scatter` over all of a dim by what it
    scatters, as Inductor's post-grad clean-up does before a custom pass runs. Without Inductor (`aot_eager`, and so
    `explain`) a write through `cache[:, 0]` of a cache with a symbolic size keeps them, between the links of a
    `select_scatter` chain, and the pass would see another graph than Inductor gives it."""
    for node in list(graph.nodes):
        if node.target is aten.slice_scatter.default and not node.kwargs:
            base, src, dim, start, stop, step = _slice_scatter_args(node)
            base_val, src_val = tensor_val(base), tensor_val(src)
            if (
                base_val is not None
                and src_val is not None
                and whole_range(base, _dim(dim, base_val.dim()), start, stop, step)
                and same_shape(base_val.shape, src_val.shape)
                and base_val.dtype == src_val.dtype
            ):
                node.replace_all_uses_with(src)
                graph.erase_node(node)
        elif _whole_slice_dim(node) is not None and tensor_val(node.args[0]) is not None:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _noop_row_slice(node: fx.Node) -> bool:
    return _whole_slice_dim(node) == 0


def _strip_full_slices(node: Any) -> Any:
    """Skip slices that keep all of a dim, of any dim."""
    while isinstance(node, fx.Node) and _whole_slice_dim(node) is not None:
        node = node.args[0]
    return node


def _strip_rows(node: Any) -> Any:
    """Skip copies and `x[:]` row slices."""
    while isinstance(node, fx.Node) and (node.target in _COPIES or _noop_row_slice(node)):
        node = node.args[0]
    return node


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


# ---- write sites -----------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Site:
    """One cache write: `copy_(cache, new)`; `value` is the `[T, h, d]` value written into `target`, the
    `[S, h, d]` (or `[S, h * d]`) cache itself or a view of it (`_paged_site`, `_slot_dim_site`)."""

    cache: fx.Node
    copy: fx.Node
    new: fx.Node
    value: fx.Node
    key: tuple  # ("index", loc) | ("slice", start, stop) | ("commit", loc2d, lens)
    nodes: list[fx.Node] = field(default_factory=list)  # site nodes that die with the write
    target: fx.Node | None = None  # the written `[S, ...]` tensor: `cache` where None
    inserted: list[fx.Node] = field(default_factory=list)  # views the pass inserted to read the write
    rebased: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)  # (select, its input before `_stacked_sites`)

    def __post_init__(self) -> None:
        self.target = self.target if self.target is not None else self.cache


def _find_sites(graph: fx.Graph) -> tuple[list[_Site], list[fx.Node]]:
    """The write sites, and the other scatter-like writes into cache placeholders (`copy_` nodes: `index_put`,
    `slice_scatter` or a view of one written back) in forms the op does not take."""
    copies = [n for n in graph.nodes if n.target is aten.copy_.default and n.args[0].op in ("placeholder", "get_attr")]
    mutated: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            for arg in node.all_input_nodes:
                mutated[arg] = mutated.get(arg, 0) + 1
    sites, others = [], []
    for copy in copies:
        cache, new = copy.args[:2]
        if not isinstance(new, fx.Node) or not _have_vals(cache):
            continue
        found = None
        if mutated.get(cache, 0) == 1 and len(new.users) == 1:
            found = _one_site(graph, cache, copy, new)
            found = [found] if found is not None else _stacked_sites(graph, cache, copy, new)
        if found:
            sites += found
        elif _strip_layout_views(new).target in _ANY_SCATTER:
            others.append(copy)
    return sites, others


def _one_site(graph: fx.Graph, cache: fx.Node, copy: fx.Node, new: fx.Node) -> _Site | None:
    return (
        _index_site(cache, copy, new)
        or _slice_site(cache, copy, new)
        or _paged_site(cache, copy, new)
        or _slot_dim_site(graph, cache, copy, new)
        or _page_offset_site(graph, cache, copy, new)
    )


def _stacked_sites(graph: fx.Graph, cache: fx.Node, copy: fx.Node, new: fx.Node) -> list[_Site] | None:
    """Several caches in one buffer: `buf[i][loc] = k_i` for distinct `i` (layers stacked in one `[L, S, h, d]`
    buffer, or K and V of a layer in one `[2, ...]` buffer as vLLM keeps them), or `buf[loc, i] = k_i` (K and V
    interleaved per slot in one `[S, 2, h, d]` buffer, each an `[S, h, d]` view with a slot stride of `2 * h * d`),
    a chain `select_scatter(prev, write_i, dim, i)` along one dim ending in the buffer's `copy_`. Each link's write
    reads `select(prev, dim, i)`, which is `select(buf, dim, i)` since no earlier link writes slice `i`: the pass
    makes it read that (a rewrite that keeps every value), and each link is then a site of its own on that slice;
    they share the `copy_`."""
    links, node, dims = [], new, set()
    rank = tensor_val(cache).dim()
    while node is not cache:
        if not isinstance(node, fx.Node) or node.target is not aten.select_scatter.default or node.kwargs:
            return None
        prev, write, dim, index = node.args
        if not isinstance(dim, int) or not isinstance(index, int) or not isinstance(write, fx.Node):
            return None
        size = tensor_val(cache).shape[dim]
        if not isinstance(size, int):  # a size Dynamo made symbolic (dynamic=True): the index cannot be normalised
            return None
        dims.add(_dim(dim, rank))
        links.append((node, write, index % size))
        node = prev
    if len(links) < 2 or len(dims) != 1 or len({index for *_, index in links}) != len(links):
        return None
    (dim,) = dims
    sites: list[_Site] = []
    for scatter, write, index in reversed(links):
        prev = scatter.args[0]
        _unbind_as_selects(graph, prev, dim, rank)
        sub = _base_select(write, prev, dim, index)
        site = None
        if sub is not None:
            # the read of a commit's or a slice's old rows has a select of its own
            selects = [s for s in list(prev.users) if s.target is aten.select.int and s.args[1:] == sub.args[1:]]
            rebased = [(select, prev) for select in selects]
            for select in selects:
                select.replace_input_with(prev, cache)
            site = _one_site(graph, sub, copy, write)
            if site is None:
                _rebase_back(rebased, cache)
        if site is None:
            _unwind(graph, sites)
            return None
        site.cache, site.nodes, site.rebased = cache, [*site.nodes, scatter], rebased
        sites.append(site)
    return sites


def _unbind_as_selects(graph: fx.Graph, prev: fx.Node, dim: int, rank: int) -> None:
    """`getitem(unbind(prev, dim), i)` (vLLM's `key_cache, value_cache = kv_cache.unbind(0)`) made `select(prev,
    dim, i)`, the same view, so that a link's write is found from its select; it stays so whether the writes lower
    or not. `rank`: the buffer's (`prev` may be a node without a value, made by a user pass)."""
    for unbind in [u for u in prev.users if u.target is aten.unbind.int]:
        along = unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)
        if _dim(along, rank) != dim or any(u.target is not operator.getitem for u in unbind.users):
            continue
        for item in list(unbind.users):
            with graph.inserting_after(unbind):
                select = graph.call_function(aten.select.int, (prev, dim, item.args[1]))
            select.meta = dict(item.meta)
            item.replace_all_uses_with(select)
            graph.erase_node(item)
        graph.erase_node(unbind)


def _unwind(graph: fx.Graph, sites: list[_Site]) -> None:
    """Undo what finding `sites` changed in the graph: the views inserted, the selects made to read the buffer."""
    for site in sites:
        _rebase_back(site.rebased, site.cache)
    live = set(graph.nodes)
    _erase_dead(graph, [n for site in sites for n in site.inserted if n in live])


def _rebase_back(rebased: list[tuple[fx.Node, fx.Node]], cache: fx.Node) -> None:
    for select, prev in rebased:
        select.replace_input_with(cache, prev)


def _base_select(write: fx.Node, prev: fx.Node, dim: int, index: int) -> fx.Node | None:
    """The `select(prev, dim, index)` node a link's write starts from (its first argument, through views and
    scatters)."""
    node = write
    while isinstance(node, fx.Node) and (node.target in _VIEWS or node.target in _SCATTERS):
        node = node.args[0]
        if node.target is aten.select.int and node.args[0] is prev:
            break
    ok = isinstance(node, fx.Node) and node.target is aten.select.int and node.args[0] is prev
    if not ok or not _have_vals(prev, node):
        return None
    rank = tensor_val(prev).dim()
    if _dim(node.args[1], rank) != dim or node.args[2] % tensor_val(prev).shape[dim] != index:
        return None
    return node


def _have_vals(*nodes: Any) -> bool:
    return all(tensor_val(node) is not None for node in nodes)


def _chain(new: fx.Node) -> list[fx.Node]:
    """The views and scatters a cache's new value `new` is made of, down to its first write (each scatter's and
    view's first argument in turn; the views of the old cache below the first write are not in it)."""
    chain, node = [], new
    while isinstance(node, fx.Node) and (node.target in _LAYOUT_VIEWS or node.target in _ANY_SCATTER):
        chain.append(node)
        node = node.args[0]
    while chain and chain[-1].target not in _ANY_SCATTER:
        chain.pop()
    return chain


def _strip_layout_views(node: fx.Node) -> fx.Node:
    while node.target in _LAYOUT_VIEWS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _index_site(cache: fx.Node, copy: fx.Node, new: fx.Node, target: fx.Node | None = None) -> _Site | None:
    """`index_put(target, [loc], value)` written back to `cache` (`target`: the cache, or a view of it), or the same
    write as a `scatter` (`_scattered_rows`)."""
    target = cache if target is None else target
    if new.target is aten.scatter.src and new.args[0] is target and not new.kwargs:
        loc = _scattered_rows(target, new)
        return _indexed(cache, copy, new, target, loc, new.args[3]) if loc is not None else None
    if new.target is not aten.index_put.default or new.args[0] is not target:
        return None
    indices = new.args[1]
    if _accumulates(new) or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    return _indexed(cache, copy, new, target, indices[0], new.args[2])


def _scattered_rows(target: fx.Node, scatter: fx.Node) -> fx.Node | None:
    """The 1-D slot index `loc` of `scatter(target, 0, expand(view(loc, [T, 1, ..]), [T, *rows]), value)` with
    `value` of the index's shape (`cache.scatter_(0, loc.view(-1, 1, 1).expand_as(k), k)`): every element of row
    `i` of `value` goes to row `loc[i]` of `target`, which is `target[loc] = value`. Eager raises on a negative
    index here, where `target[loc] = value` counts it from the end, as the op then does."""
    _, dim, index, value = scatter.args
    if not isinstance(index, fx.Node) or index.target is not aten.expand.default:
        return None
    if not _have_vals(target, index, value):
        return None
    rank = tensor_val(target).dim()
    if not isinstance(dim, int) or dim % rank != 0 or tensor_val(index).dim() != rank:
        return None
    index_shape, rows = tensor_val(index).shape, tensor_val(target).shape[1:]
    if not same_shape(index_shape[1:], rows) or not same_shape(tensor_val(value).shape, index_shape):
        return None
    loc = index.args[0]  # of the index's rank: expand lines a lower-rank input up with the index's last dims
    if not isinstance(loc, fx.Node) or not _have_vals(loc) or tensor_val(loc).dim() != rank:
        return None
    while isinstance(loc, fx.Node) and _have_vals(loc) and tensor_val(loc).dim() > 1:
        if loc.target not in (*_VIEWS, aten.unsqueeze.default):
            return None
        if not same_shape(tensor_val(loc).shape, [index_shape[0], *[1] * (tensor_val(loc).dim() - 1)]):
            return None
        loc = loc.args[0]
    if not isinstance(loc, fx.Node) or not _slot_index(loc) or not same_shape(tensor_val(loc).shape, index_shape[:1]):
        return None
    return loc


def _accumulates(put: fx.Node) -> bool:
    return bool(put.args[3] if len(put.args) > 3 else put.kwargs.get("accumulate", False))


def _slot_index(loc: fx.Node) -> bool:
    loc_val = tensor_val(loc)
    return loc_val is not None and loc_val.dim() == 1 and loc_val.dtype in (torch.int32, torch.int64)


def _indexed(cache: fx.Node, copy: fx.Node, new: fx.Node, target: fx.Node, loc: fx.Node, value: Any) -> _Site | None:
    """The site of `target[loc] = value` (rows of `target` at the 1-D slot index `loc`), written back to `cache`."""
    if not _slot_index(loc) or not _have_vals(target):
        return None
    loc_val = tensor_val(loc)
    nodes = [new]
    value = _one_token_source(value, target, loc_val, nodes)
    if isinstance(value, fx.Node) and value.target is aten.where.self:
        commit = _commit(target, loc, value)
        if commit is not None:
            nodes += [value, value.args[2], *_other_alias(value.args[2].args[0], target)]
            value = _one_token_source(value.args[1], target, loc_val, nodes)
            return _Site(cache, copy, new, value, commit, nodes, target)
    return _Site(cache, copy, new, value, ("index", loc), nodes, target)


def _paged_site(cache: fx.Node, copy: fx.Node, new: fx.Node) -> _Site | None:
    """`cache.view(-1, h, d)[loc] = k` or `[a:b] = k` (a paged `[pages, page, h, d]` cache, or any cache written
    through one view): `view(index_put(view(cache), [loc], k), cache.shape)` (or a `slice_scatter`); the op writes
    the view."""
    inner = new.args[0] if new.target in _VIEWS else None
    if not isinstance(inner, fx.Node) or inner.target not in _SCATTERS or len(inner.users) != 1:
        return None
    target = inner.args[0]
    if not _have_vals(new, cache, target) or not same_shape(tensor_val(new).shape, tensor_val(cache).shape):
        return None
    if not (target.target in _VIEWS and target.args[0] is cache):
        return None
    if tensor_val(target).dim() not in (2, 3) or not _aliases(cache, target):
        return None
    site = _index_site(cache, copy, inner, target) or _slice_site(cache, copy, inner, target)
    if site is None or any(user not in site.nodes for user in target.users):
        return None  # the view is also read elsewhere (by the commit form's read of the old rows, for one)
    site.nodes += [new, target]
    return site


def _same_alias(node: Any, target: fx.Node) -> bool:
    """`node` is `target`, or another view (or select) of the same cache with the same shape (index) read only once
    (functionalization gives a write through `cache.view(...)` one view node for the read of the old rows, another
    for the write)."""
    if node is target:
        return True
    if not _have_vals(node, target) or target.op != "call_function" or len(node.users) != 1:
        return False
    if node.target is aten.select.int and target.target is aten.select.int:
        return node.args == target.args
    return (
        node.target in _VIEWS
        and target.target in _VIEWS
        and node.args[0] is target.args[0]
        and same_shape(tensor_val(node).shape, tensor_val(target).shape)
    )


def _other_alias(node: fx.Node, target: fx.Node) -> list[fx.Node]:
    """`[node]` if it is another view than `target` (a site node that dies with the write), else `[]`."""
    return [] if node is target else [node]


def _aliases(cache: fx.Node, target: fx.Node) -> bool:
    """Whether `target` (a view or a reshape of `cache`: Inductor's post-grad graphs have views as reshapes) is an
    alias of it: a reshape that must copy would give the op a copy to write."""
    return _viewable(cache, tensor_val(target).shape)


def _viewable(cache: fx.Node, shape: Any) -> bool:
    """Whether `cache` can be viewed (not copied) as `shape`."""
    with fake_mode_of(cache.graph):
        try:
            tensor_val(cache).view(shape)
        except (RuntimeError, ValueError):  # fake tensors raise the ValueError of torch._refs
            return False
    return True


def _slot_dim_site(graph: fx.Graph, cache: fx.Node, copy: fx.Node, new: fx.Node) -> _Site | None:
    """HF's static cache: `cache.index_copy_(2, loc, k)` into `[1, heads, S, d]` (`index_put(cache, [None, None,
    loc], k)`, `k [1, heads, T, d]`): slots along a dim other than the first. The op writes the view of the cache
    with the slots first and the size-1 dims dropped (`[S, heads, d]`, or `[S, d]`), the value viewed alike;
    these views are inserted here, before the write, and erased again if it does not lower."""
    if new.target is not aten.index_put.default or new.args[0] is not cache or _accumulates(new):
        return None
    indices, value = new.args[1], new.args[2]
    slot, loc = len(indices) - 1, indices[-1]
    if slot < 1 or any(i is not None for i in indices[:-1]) or not isinstance(loc, fx.Node) or not _slot_index(loc):
        return None
    if not _have_vals(cache, value):
        return None
    cache_val, value_val = tensor_val(cache), tensor_val(value)
    rank = cache_val.dim()
    if slot >= rank - 1:
        return None
    indexed = [*cache_val.shape[:slot], tensor_val(loc).shape[0], *cache_val.shape[slot + 1 :]]
    pad = rank - value_val.dim()  # leading dims of size 1 the value leaves out (it broadcasts right-aligned)
    if pad < 0 or not same_shape(indexed[:pad], [1] * pad):
        return None
    if not all(same_shape([value_val.shape[i - pad]], [cache_val.shape[i]]) for i in range(pad, rank) if i != slot):
        return None
    heads = [i for i in range(rank - 1) if i != slot and cache_val.shape[i] != 1]
    if len(heads) > 1:
        return None
    existing = set(graph.nodes)
    with graph.inserting_before(new):
        for _ in range(pad):
            value = call(graph, aten.unsqueeze.default, (value, 0))
        target, value = (_slots_first(graph, t, slot, heads) for t in (cache, value))
    inserted = [n for n in graph.nodes if n not in existing]
    for node in inserted:
        node.meta["stack_trace"] = new.meta.get("stack_trace")
    site = _indexed(cache, copy, new, target, loc, value)
    if site is None:
        for node in reversed(inserted):
            graph.erase_node(node)
        return None
    site.inserted = inserted
    return site


def _page_offset_site(graph: fx.Graph, cache: fx.Node, copy: fx.Node, new: fx.Node) -> _Site | None:
    """A paged `[pages, page, h, d]` (or `[pages, page, h * d]`) cache written with two indices, `cache[loc // page,
    loc % page] = k`: `index_put(cache, [div(loc, page, floor), remainder(loc, page)], k)`. That element is row `loc`
    of `cache.view(-1, h, d)`, for a negative `loc` too (eager counts its page from the end: page `pages + loc //
    page`, offset `loc % page`, i.e. row `S + loc`, where the op's index counts from the end as well), and a `loc`
    out of `[-S, S)` gives a page out of `[-pages, pages)`: out of range both ways. The op writes that view, inserted
    here before the write and erased again if it does not lower."""
    if new.target is not aten.index_put.default or new.args[0] is not cache or _accumulates(new):
        return None
    indices = new.args[1]
    if len(indices) != 2 or not all(isinstance(i, fx.Node) for i in indices) or not _have_vals(cache):
        return None
    cache_val = tensor_val(cache)
    if cache_val.dim() not in (3, 4):
        return None
    page = cache_val.shape[1]
    loc = _page_index(indices[0], page)
    if loc is None or _offset_index(indices[1], page) is not loc or not _slot_index(loc):
        return None
    rows = [-1, *cache_val.shape[2:]]
    if not _viewable(cache, rows):  # pages apart (a page of K, then one of V, ...): no [S, h, d] view to write
        return None
    with graph.inserting_before(new):
        target = call(graph, aten.view.default, (cache, rows))
    target.meta["stack_trace"] = new.meta.get("stack_trace")
    site = _indexed(cache, copy, new, target, loc, new.args[2])
    if site is None:
        graph.erase_node(target)
        return None
    site.nodes += [i for i in indices if len(i.users) == 1]
    site.inserted = [target]
    return site


def _page_index(node: fx.Node, page: Any) -> fx.Node | None:
    """`loc` of `loc // page` (`div(loc, page, rounding_mode="floor")` or `floor_divide`), else None."""
    floor = node.target is aten.div.Tensor_mode and node.kwargs.get("rounding_mode") == "floor"
    if not (floor or node.target in (aten.floor_divide.default, aten.floor_divide.Scalar)):
        return None
    return node.args[0] if _is_size(node.args[1], page) and isinstance(node.args[0], fx.Node) else None


def _offset_index(node: fx.Node, page: Any) -> fx.Node | None:
    """`loc` of `loc % page` (`remainder(loc, page)`), else None."""
    if node.target is not aten.remainder.Scalar or not _is_size(node.args[1], page):
        return None
    return node.args[0] if isinstance(node.args[0], fx.Node) else None


def _is_size(value: Any, size: Any) -> bool:
    """Whether `value` (an int argument) is statically `size`; a page size computed in the graph (`sym_size` of a
    dynamic cache) is not read, and such a write keeps its path."""
    return (
        isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) and statically_known_true(value == size)
    )


def _slots_first(graph: fx.Graph, node: fx.Node, slot: int, heads: list[int]) -> fx.Node:
    """`node` viewed with dim `slot` first, then the `heads` dim (if one), then the last dim; the other dims (of
    size 1) dropped."""
    rank = tensor_val(node).dim()
    for dim in reversed(range(rank - 1)):
        if dim != slot and dim not in heads:
            node = call(graph, aten.select.int, (node, dim, 0))
            slot, heads = slot - (dim < slot), [h - (dim < h) for h in heads]
    order = [slot, *heads, len(heads) + 1]
    return node if order == sorted(order) else call(graph, aten.permute.default, (node, order))


def _one_token_source(value: Any, cache: fx.Node, loc_val: torch.Tensor, nodes: list[fx.Node]) -> Any:
    """One token's `[1, h, d]` value viewed as `[h, d]` or `[d]` (it broadcasts to the slot): the `[1, h, d]`
    value (the view joins the site's nodes). Else `value`."""
    if not (isinstance(value, fx.Node) and value.target in _VIEWS and loc_val.numel() == 1):
        return value
    src = tensor_val(value.args[0])
    if src is None or tuple(src.shape) != (1, *tensor_val(cache).shape[1:]):
        return value
    nodes.append(value)
    return value.args[0]


def _commit(cache: fx.Node, loc: fx.Node, where: fx.Node) -> tuple | None:
    """`("commit", loc2d, lens)` for `where(keep, value, cache[loc])`, `keep` = `arange(W) < lens[:, None]`."""
    keep, _, old = where.args
    if not (isinstance(old, fx.Node) and old.target is aten.index.Tensor and _same_alias(old.args[0], cache)):
        return None
    if len(old.args[1]) != 1 or old.args[1][0] is not loc or loc.target not in _VIEWS:
        return None
    loc2d, loc2d_val = loc.args[0], tensor_val(loc.args[0])
    if loc2d_val is None or loc2d_val.dim() != 2:
        return None
    keep_val = tensor_val(keep)
    if (
        keep.target not in _VIEWS
        or keep_val.dim() != tensor_val(where).dim()
        or any(s != 1 for s in keep_val.shape[1:])
    ):
        return None
    lt = keep.args[0]
    while lt.target in _VIEWS and tensor_val(lt).dim() != 2:  # `keep.view(-1, 1, 1)`, then `.view(-1, 1)`
        lt = lt.args[0]
    if lt.target is aten.lt.Tensor:
        row, lens = lt.args
    elif lt.target is aten.gt.Tensor:
        lens, row = lt.args
    else:
        return None
    row, lens = _strip_full_slices(row), _strip_full_slices(lens)
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


def _is_arange(node: fx.Node, width: Any) -> bool:
    """`arange(width)` (0, 1, ..., width - 1) as iota or arange; `width` may be symbolic."""

    def size(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, fx.Node) else arg

    def same(a: Any, b: Any) -> bool:
        return isinstance(a, (int, torch.SymInt)) and statically_known_true(size(a) == b)

    if op_name(node) == "prims.iota":
        return same(size(node.args[0]), width) and node.kwargs.get("start") == 0 and node.kwargs.get("step") == 1
    if node.target in _ARANGES:
        args = list(node.args) if node.target is not aten.arange.default else [0, *node.args]
        return args[0] == 0 and same(size(args[1]), width) and (len(args) < 3 or args[2] == 1)
    return False


def _slice_site(cache: fx.Node, copy: fx.Node, new: fx.Node, target: fx.Node | None = None) -> _Site | None:
    """`slice_scatter(target, value, 0, a, b)` written back to `cache` (`target`: the cache, or a view of it)."""
    target = cache if target is None else target
    if new.target is not aten.slice_scatter.default or new.args[0] is not target or new.kwargs:
        return None
    _, src, dim, start, stop, step = _slice_scatter_args(new)
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
        if dst.target is not aten.slice.Tensor or not _same_alias(dst.args[0], target) or len(src.users) != 1:
            return None
        if tensor_val(value).dtype != tensor_val(dst).dtype or not same_shape(
            tensor_val(value).shape, tensor_val(dst).shape
        ):
            return None
        nodes += [src, dst, *_other_alias(dst.args[0], target)]
    return _Site(cache, copy, new, value, ("slice", start, stop), nodes, target)


# ---- one write: site + what it computes ------------------------------------------------------------------------------


@dataclass
class _Write:
    site: _Site
    written: Written
    branch: gemm_branches.GemmBranch

    @property
    def row_start(self) -> int:
        """The weight row of the block's first column."""
        return self.branch.row_start + self.written.column

    @property
    def transformed(self) -> bool:
        return self.written.transformed

    @property
    def norm(self) -> Norm | None:
        return self.written.norm

    @property
    def rope(self) -> Rope | None:
        return self.written.rope


class _Group:
    """The cache writes whose values come from GEMMs on one activation, and the symbolic evaluation they share."""

    def __init__(self, activation: fx.Node) -> None:
        self.activation = activation
        self.sites: list[_Site] = []
        self.writes: list[_Write] = []
        self.failed: list[_NoMatch] = []
        self.gemms = {n for n in activation.users if n.target in _GEMMS and gemm_activation(n) is activation}
        self.ev: Evaluation | None = None

    def subset(self, writes: list[_Write]) -> _Group:
        """A group of some of this group's analysed writes (sharing its evaluation)."""
        part = _Group(self.activation)
        part.ev = self.ev
        part.writes, part.sites = writes, [w.site for w in writes]
        return part

    def analyse(self) -> None:
        """Read every write; with a static token count read as `TOKENS` first, and as it is where that fails."""
        tokens = tensor_val(self.activation).shape[0]
        model = tensor_val(self.activation).dtype
        for shrink in (True, False):
            self.ev = Evaluation(tokens, model, self.gemms, shrink=shrink)
            for layout in self._head_layouts():
                self.writes, self.failed = [], []
                for site in self.sites:
                    try:
                        self.writes.append(self._analyse(site, layout))
                    except _NoMatch as err:
                        self.failed.append(err)
                if not self.failed:
                    return
            if self.ev.static_tokens is None or tokens > STATIC_AS_IS:
                return

    def _head_layouts(self) -> list[tuple[int, int] | None]:
        """The `(heads, head_dim)` layouts to read `[S, heads * head_dim]` caches with: the one the group shows
        (`_head_layout`), else every split of the width into heads of a size the op's kernel takes (a multiple of
        8 up to 256, smallest first: a head of several real heads can prove with cos/sin no table row holds): the
        proof decides, and any layout it proves computes the same values."""
        layout = self._head_layout()
        widths = {int(tensor_val(site.target).shape[1]) for site in self.sites if tensor_val(site.target).dim() == 2}
        if layout is not None or len(widths) != 1:
            return [layout]
        (width,) = widths
        sizes = [d for d in range(8, min(width, 256) + 1, 8) if width % d == 0]
        return [(width // d, d) for d in sizes] or [None]

    def _head_layout(self) -> tuple[int, int] | None:
        """`(heads, head_dim)` for the group's `[S, heads * head_dim]` caches: the `[S, heads, head_dim]` caches'
        layout, or the size of the k_norm of a flat cache's written value (its mean's element count)."""
        layouts = {tuple(int(s) for s in tensor_val(site.target).shape[1:]) for site in self.sites}
        layouts = {layout for layout in layouts if len(layout) == 2}
        for site in self.sites:
            if tensor_val(site.target).dim() == 2:
                try:
                    head_dim = normed_size(self.ev, site.value)
                except Unevaluable:
                    continue
                width = int(tensor_val(site.target).shape[1])
                if head_dim and width % head_dim == 0:
                    layouts.add((width // head_dim, head_dim))
        return layouts.pop() if len(layouts) == 1 else None

    def _analyse(self, site: _Site, layout: tuple[int, int] | None) -> _Write:
        if statically_known_true(tensor_val(self.activation).shape[0] == 0):
            raise _NoMatch(
                KVKeptReason.NO_TOKENS,
                "the activation has 0 rows (no tokens): the writes write nothing, and no element shows what they "
                "compute (a call with tokens compiles a graph of its own)",
                site.value,
                site.cache,
            )
        cache_val, value_val = tensor_val(site.target), tensor_val(site.value)
        flat = cache_val.dim() == 2 and value_val is not None and value_val.dim() == 2
        if not flat and (cache_val.dim() != 3 or value_val is None or value_val.dim() != 3):
            raise _NoMatch(
                KVKeptReason.LAYOUT,
                "not a [slots, heads, head_dim] or [slots, heads * head_dim] cache written with a [T, heads, "
                "head_dim] or [T, heads * head_dim] value",
                site.value,
                site.cache,
            )
        if tuple(value_val.shape[1:]) != tuple(cache_val.shape[1:]) or value_val.dtype != cache_val.dtype:
            raise _NoMatch(
                KVKeptReason.LAYOUT,
                f"the value written is {value_val.dtype}{list(value_val.shape)}",
                site.value,
                site.cache,
            )
        if flat:
            if layout is None or layout[0] * layout[1] != cache_val.shape[1]:
                raise _NoMatch(
                    KVKeptReason.LAYOUT,
                    f"the head size of the [S, {cache_val.shape[1]}] cache is not known (no k_norm, no "
                    "[S, heads, head_dim] cache of the same width on this activation, no split into heads of a "
                    "multiple of 8 elements up to 256 that the proof accepts)",
                    site.value,
                    site.cache,
                )
            heads, head_dim = layout
        else:
            heads, head_dim = (int(s) for s in cache_val.shape[1:])
        try:
            written = read_written(self.ev, site.value, self.gemms, heads, head_dim)
        except NotTheFormula as err:
            raise _NoMatch(_SPEC_REASONS[err.kind], str(err), err.node, site.cache) from None
        except Unevaluable as err:
            raise _NoMatch(KVKeptReason.UNEVALUABLE, str(err), site.value, site.cache) from None
        branch = gemm_branches.match_gemm(written.gemm)
        if not isinstance(branch, gemm_branches.GemmBranch):
            raise _NoMatch(
                KVKeptReason.NOT_A_PROJECTION,
                f"its GEMM {written.gemm.name} does not fit the op: {branch}",
                written.gemm,
                site.cache,
            )
        return _Write(site, written, branch)


# ---- the group of writes on one activation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLowering:
    lowered: list[KVWriteReport]  # the groups of writes lowered to multi_linear_kv_write
    kept: list[KVKept]  # the groups of writes kept on today's path, and why


def lower_kv_writes(graph: fx.Graph, config: DsparkConfig, names: Namer) -> KVLowering:
    """Lower every group of cache writes that fits."""
    groups: dict[fx.Node, _Group] = {}
    _drop_whole_slices(graph)
    sites, others = _find_sites(graph)
    activations = {}
    for site in sites:
        gemm = _nearest_gemm(site.value)
        activations[site] = None if gemm is None else gemm_activation(gemm)
    shared = {}  # the sites of one buffer (`_stacked_sites`) lower together or not at all: one activation
    for site in sites:
        shared.setdefault(site.copy, set()).add(activations[site])
    for site in sites:
        activation = activations[site]
        if activation is None:
            continue  # not a projection: no business of this pass
        if len(shared[site.copy]) > 1:
            if site.copy not in others:
                others.append(site.copy)
            continue
        groups.setdefault(activation, _Group(activation)).sites.append(site)
    lowered, kept = [], [_other_write(copy, names) for copy in others if _nearest_gemm(copy.args[1]) is not None]
    done: set[_Site] = set()
    for group in groups.values():
        group.analyse()
        kept += [err.kept(group.activation, names) for err in group.failed]
        whole = None
        if not group.failed:
            try:
                lowered.append(_emit(graph, group, _plan(graph, group, config, names), names))
                done.update(group.sites)
                continue
            except _NoMatch as err:
                whole = err
        if whole is None or whole.reason in (KVKeptReason.LAYERS_DIFFER, KVKeptReason.SLOTS):
            lowered_parts, part_kept = _lower_parts(graph, group, config, names)
            if lowered_parts:
                lowered += [report for report, _ in lowered_parts]
                kept += part_kept
                done.update(site for _, part in lowered_parts for site in part.sites)
                continue
        if whole is not None:
            kept.append(whole.kept(group.activation, names))
    _unwind(graph, [site for site in sites if site not in done])  # writes kept as they were
    return KVLowering(lowered, kept)


def _lower_parts(
    graph: fx.Graph, group: _Group, config: DsparkConfig, names: Namer
) -> tuple[list[tuple[KVWriteReport, _Group]], list[KVKept]]:
    """Per-layer fallback, where the group as a whole does not lower (its layers differ, or some of its writes do not
    read as the op's formula): its analysed writes in parts the op writes alike (`_parts`), each lowered on its own
    (one op per part; where some writes do not read as the op's formula, only parts with a normed or rotated K); the
    writes of the parts that do not lower stay as they are, with their reasons, and so do the writes in no part.
    Returns the parts lowered with their reports, and the kept writes' reasons (both empty if no part lowered)."""
    parts, leftover = _parts(group)
    if group.failed:  # some writes do not read as the op's formula: lower only parts with a normed or rotated K
        leftover += [w for part in parts if not any(w.transformed for w in part.writes) for w in part.writes]
        parts = [part for part in parts if any(w.transformed for w in part.writes)]
    lowered, kept = [], []
    for part in parts:
        try:
            report = _emit(graph, part, _plan(graph, part, config, names), names)
        except _NoMatch as err:
            if err.cache is None:
                err.cache = part.writes[0].site.cache
            kept.append(err.kept(group.activation, names))
            continue
        lowered.append((report, part))
    for w in leftover:
        kept.append(
            KVKept(
                names.of(group.activation),
                KVKeptReason.LAYERS_DIFFER,
                "not in a set of writes the op takes alike (a normed or rotated K with a plain V of the same shape "
                "and slots, or two plain writes) where other writes on this activation were lowered",
                names.of(w.site.cache),
            )
        )
    return (lowered, kept) if lowered else ([], [])


def _slot_key(w: _Write) -> tuple:
    """`w`'s slot key as compared across writes: nodes as they are, anything else (a slice bound, a SymInt under
    `dynamic=True`: it does not hash) as text."""
    return tuple(part if isinstance(part, fx.Node) or part is None else str(part) for part in w.site.key)


def _parts(group: _Group) -> tuple[list[_Group], list[_Write]]:
    """The group's analysed writes as K/V pairs in parts the op writes alike: K normed or not, rotated or not and
    how, the same cache shapes and slots, within a part (largest part first). A K (a normed or rotated write) pairs
    with a plain write into its own buffer where there is one (vLLM's `[2, ...]` K/V buffer: one `copy_`), else of
    its own GEMM (a fused k/v projection: the two must lower together, the GEMM's output feeding both), else with
    the plain write nearest to it in the graph (the V a model writes beside its K; any pairing computes the same);
    plain writes left over pair among themselves (no norm, no RoPE: either is the K). A part that takes some but not
    all the writes of one buffer (its sites share one `copy_`) is dropped. Also returns the writes in no part."""
    ks = [w for w in group.writes if w.transformed]
    plain = [w for w in group.writes if not w.transformed]
    order = {id(w): i for i, w in enumerate(group.writes)}
    pairs: list[tuple[_Write, _Write]] = []
    partners = (
        lambda k, v: v.site.copy is k.site.copy,  # K and V of one buffer (vLLM's [2, ...]): they lower together
        lambda k, v: v.branch.node is k.branch.node,  # one fused k/v GEMM: its output feeds both
        lambda k, v: True,
    )
    for partner in partners:
        for k in [k for k in ks if not any(k is a for a, _ in pairs)]:
            near = sorted(plain, key=lambda v: (abs(order[id(v)] - order[id(k)]), order[id(v)] < order[id(k)]))
            v = next((v for v in near if partner(k, v)), None)
            if v is not None:
                plain.remove(v)
                pairs.append((k, v))
    while len(plain) >= 2:
        a = plain.pop(0)
        b = next((v for v in plain if v.branch.node is a.branch.node), plain[0])
        plain.remove(b)
        pairs.append((a, b))
    by_kind: dict[tuple, list[tuple[_Write, _Write]]] = {}
    for k, v in pairs:
        rope = None if k.rope is None else (k.rope.rot, k.rope.neox)
        # as text: a dynamic cache's sizes or a slice's bounds are SymInts, which neither hash nor compare guard-free
        shapes = tuple((w.written.heads, w.written.head_dim, shape_key(w.site.target), _slot_key(w)) for w in (k, v))
        by_kind.setdefault((k.norm is None, k.rope is None, rope, shapes), []).append((k, v))
    sites_of: dict[fx.Node, set[_Site]] = {}
    for site in group.sites:
        sites_of.setdefault(site.copy, set()).add(site)
    parts = []
    for part in sorted(by_kind.values(), key=len, reverse=True):
        writes = [w for pair in part for w in pair]
        taken = {w.site for w in writes}
        if all(sites_of[site.copy] <= taken for site in taken):
            parts.append(group.subset(writes))
    placed = {id(w) for part in parts for w in part.writes}
    return parts, [w for w in group.writes if id(w) not in placed]


def _other_write(copy: fx.Node, names: Namer) -> KVKept:
    """A scatter into a cache, of values computed from a GEMM, in a form the op does not take."""
    cache, new = copy.args[:2]
    scatter = _strip_layout_views(new)
    chain = _chain(new)
    feeds = _ancestors(new)  # a select of an earlier write's value that a later write fills is not a read
    read = next((user for node in chain for user in node.users if user is not copy and user not in feeds), None)
    if read is not None:
        err = _NoMatch(
            KVKeptReason.CACHE_READ_AFTER,
            f"{names.of(cache)} is read by {read.name} ({op_name(read)}) after a write to it",
            read,
            cache,
        )
        return err.kept(gemm_activation(_nearest_gemm(new)), names)
    writes = sum(node.target in _ANY_SCATTER for node in chain)
    accumulate = scatter.args[3] if len(scatter.args) > 3 else scatter.kwargs.get("accumulate", False)
    adds = scatter.target is aten.index_put.default and accumulate is True
    err = _NoMatch(
        KVKeptReason.WRITE_FORM,
        (f"{writes} writes into one cache in a call, the last " if writes > 1 else "")
        + f"{op_name(scatter)}{' with accumulate=True (adding to the rows)' if adds else ''} into {names.of(cache)} "
        f"{list(tensor_val(cache).shape)}: the op writes "
        "rows at one slot per token (cache[loc] = k, index_copy_, index_put_, scatter_ of whole rows along the slot "
        "dim, cache[a:b] = k, cache[loc // page, loc % page] = k, the commit-where form) "
        "of an [S, heads, head_dim] or [S, heads * head_dim] cache, of a view of one, or along the slot dim of a "
        "cache whose other dims but heads and head_dim have size 1",
        scatter,
        cache,
    )
    return err.kept(gemm_activation(_nearest_gemm(new)), names)


@dataclass
class _Plan:
    ks: list[_Write]
    vs: list[_Write]
    heads: int
    head_dim: int
    key: tuple
    rope: Rope | None


def _plan(graph: fx.Graph, group: _Group, config: DsparkConfig, names: Namer) -> _Plan:
    writes = group.writes
    ks = [w for w in writes if w.transformed]
    vs = [w for w in writes if not w.transformed]
    if not ks:  # no norm, no RoPE anywhere: any split into K and V computes the same
        ks, vs = vs[0::2], vs[1::2]
    if len(ks) != len(vs):
        raise _unpaired(ks, vs, names)
    shapes = {(w.written.heads, w.written.head_dim, shape_key(w.site.target)) for w in writes}
    if len(shapes) != 1:
        raise _NoMatch(
            KVKeptReason.LAYERS_DIFFER, f"the caches or heads differ across layers: {sorted(str(s) for s in shapes)}"
        )
    keys = {_slot_key(w): w.site.key for w in writes}
    if len(keys) != 1:
        raise _NoMatch(KVKeptReason.SLOTS, "the layers write at different slots (cache_loc, slice or commit lengths)")
    tokens = tensor_val(group.activation).shape[0]
    key = next(iter(keys.values()))
    slots = tensor_val(key[1]) if key[0] != "slice" else None
    if slots is not None and not _guard_equal(slots.numel(), tokens):
        raise _NoMatch(
            KVKeptReason.SLOTS,
            f"{names.of(key[1])} has {slots.numel()} slots for {tokens} tokens: the op writes one slot per token",
        )
    if len({w.norm is None for w in ks}) != 1:
        raise _NoMatch(
            KVKeptReason.LAYERS_DIFFER, "some layers norm K and others do not (the op norms all layers or none)"
        )
    ropes = [w.rope for w in ks]
    if any(r is None for r in ropes) and any(r is not None for r in ropes):
        raise _NoMatch(
            KVKeptReason.LAYERS_DIFFER, "some layers rotate K and others do not (the op rotates all layers or none)"
        )
    if ropes[0] is not None and len({(r.rot, r.neox) for r in ropes}) != 1:
        desc = sorted({f"{'neox' if r.neox else 'gptj'} R={r.rot}" for r in ropes})
        raise _NoMatch(
            KVKeptReason.LAYERS_DIFFER,
            f"the RoPE differs across layers ({', '.join(desc)}); the op rotates every layer alike",
        )
    x_val = tensor_val(group.activation)
    if tensor_val(writes[0].site.target).dtype != x_val.dtype:
        raise _NoMatch(
            KVKeptReason.LAYOUT,
            f"the caches are {tensor_val(writes[0].site.target).dtype}, the activation {x_val.dtype}",
        )
    for w in ks:
        weight = w.norm.weight if w.norm is not None else None
        if weight is not None and tensor_val(weight).dtype not in (x_val.dtype, torch.float32):
            raise _NoMatch(KVKeptReason.NORM, f"the k_norm weight {names.of(weight)} is {tensor_val(weight).dtype}")
    heads, head_dim, _ = shapes.pop()
    _check_exclusive(group, names)
    _check_device(config, x_val, heads, head_dim, [w.site.target for w in writes])
    return _Plan(ks, vs, heads, head_dim, key, ropes[0])


def _unpaired(ks: list[_Write], vs: list[_Write], names: Namer) -> _NoMatch:
    """Why the normed/rotated (K) and plain (V) writes do not pair up by layer: a value written into more than one
    cache, V normed (writes normed but not rotated beside rotated ones), or else as many."""
    by_value: dict[fx.Node, list[_Write]] = {}
    for w in [*ks, *vs]:
        by_value.setdefault(w.site.value, []).append(w)
    twice = next((ws for ws in by_value.values() if len(ws) > 1), None)
    if twice is not None:
        caches = ", ".join(names.of(w.site.cache) for w in twice)
        return _NoMatch(
            KVKeptReason.VALUE_SHARED,
            f"{twice[0].site.value.name} is written into {len(twice)} caches ({caches}): the op writes each layer's K "
            "and V into one cache each",
            twice[0].site.value,
            twice[1].site.cache,
        )
    rotated = [w for w in ks if w.rope is not None]
    unrotated = [w for w in ks if w.rope is None]
    if rotated and unrotated and len(rotated) == len(unrotated) + len(vs):
        caches = ", ".join(names.of(w.site.cache) for w in unrotated)
        return _NoMatch(
            KVKeptReason.NORM,
            f"{len(unrotated)} cache writes are normed but not rotated ({caches}), beside {len(rotated)} rotated: a V "
            "with a norm, where the op writes V as projected",
            unrotated[0].site.value,
            unrotated[0].site.cache,
        )
    return _NoMatch(
        KVKeptReason.LAYERS_DIFFER,
        f"{len(ks)} normed/rotated (K) and {len(vs)} plain (V) cache writes: the op writes K and V of every layer, V "
        "as projected",
    )


def _guard_equal(a: Any, b: Any) -> bool:
    """Whether two sizes are equal; when only the symbols' current values say so, a guard is installed (a call
    where they differ, e.g. one token broadcast to several slots, recompiles and keeps today's path)."""
    if statically_known_true(a == b):
        return True
    return bool(a == b)


def _replaced_nodes(group: _Group) -> set[fx.Node]:
    """The nodes the op takes the place of: each write's value chain from its GEMM, its write site and `copy_`."""
    inside: set[fx.Node] = set()
    for w in group.writes:
        gemm = w.branch.node
        chain = _ancestors(w.site.value) & descendants(gemm.graph, [gemm])
        inside |= chain | set(w.site.nodes) | {w.site.copy}
    return inside


def _check_exclusive(group: _Group, names: Namer) -> None:
    """Every node computing a written value only feeds the writes (the op returns nothing), and every other read of
    a cache comes before the writes."""
    inside = _replaced_nodes(group)
    order = {n: i for i, n in enumerate(group.activation.graph.nodes)}
    for node in sorted(inside, key=order.__getitem__):  # graph order: the reason names the same node every run
        for user in node.users:
            if user in inside:
                continue
            if user.target is operator.getitem and not user.users:
                continue  # an unused piece of a split (the Q part of a qkv GEMM)
            raise _NoMatch(
                KVKeptReason.VALUE_SHARED,
                f"{node.name} ({op_name(node)}) is also read by {user.name} ({op_name(user)}); the op returns nothing",
                user,
            )
    first = min(order[w.site.copy] for w in group.writes)
    for w in group.writes:
        for user in w.site.cache.users:
            if user not in inside and order[user] > first:
                raise _NoMatch(
                    KVKeptReason.CACHE_READ_AFTER,
                    f"{names.of(w.site.cache)} is read by {user.name} after the writes",
                    user,
                    w.site.cache,
                )
    # The op writes a view of a buffer (a layer of a stacked cache) in place. A read of that buffer elsewhere in the
    # graph, even one before the writes, is a pointwise load Inductor may emit after the op (its dependency on the
    # view's write is not seen), reading the new rows: such writes stay where they are.
    allowed = inside | {view for w in group.writes for view in w.site.inserted}
    for w in group.writes:
        if w.site.target is not w.site.cache:
            read = _read_through_views(w.site.cache, allowed)
            if read is not None:
                raise _NoMatch(
                    KVKeptReason.VIEW_READ,
                    f"{names.of(w.site.cache)} is read by {read.name} ({op_name(read)}) in the graph that writes "
                    "into a view of it: Inductor could run that read after the op's write",
                    read,
                    w.site.cache,
                )


# ops that only view their input: a read of the cache is what consumes one of them
_PURE_VIEWS = (*_LAYOUT_VIEWS, aten.select.int, aten.slice.Tensor, aten.alias.default, aten.unbind.int,
               aten.squeeze.dim, aten.unsqueeze.default, operator.getitem)  # fmt: skip


def _read_through_views(cache: fx.Node, allowed: set[fx.Node]) -> fx.Node | None:
    """The first node outside `allowed` that consumes `cache` or a view of it (views followed), or None."""
    stack, seen = [cache], set()
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in allowed or user in seen:
                continue
            seen.add(user)
            if user.target not in _PURE_VIEWS:
                return user
            stack.append(user)
    return None


def has_cuda_kernel() -> bool:
    """A CUDA kernel of the op is registered, or its first-use entry is, the CUDA sources define the op and the
    library can be built here (`cuda_library_problem`)."""
    name = "dspark::multi_linear_kv_write"
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"):
        return True
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"):
        return False
    return not custom_ops._build.cuda_library_problem() and _sources_define_op()


@functools.cache
def _sources_define_op() -> bool:
    """The library's translation units define the op (read once, as bytes)."""
    return any(b"multi_linear_kv_write" in path.read_bytes() for path in custom_ops._build.source_files())


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


def _check_device(config: DsparkConfig, x_val: torch.Tensor, heads: int, head_dim: int, caches: list[fx.Node]) -> None:
    if config.kv_write_op == "always" and x_val.device.type != "cuda":
        return
    with fake_mode_of(caches[0].graph):  # a flat cache as the op gets it
        vals = [
            tensor_val(c) if tensor_val(c).dim() == 3 else tensor_val(c).unflatten(1, (heads, head_dim)) for c in caches
        ]
    why = kernel_mismatch(x_val, head_dim, vals)
    if not why:
        return
    if config.kv_write_op == "auto":
        raise _NoMatch(KVKeptReason.DEVICE, f"kv_write_op='auto' lowers only where the op's CUDA kernel runs: {why}")
    raise _NoMatch(KVKeptReason.DEVICE, f"the op's CUDA binding cannot take these operands: {why}")


# ---- emission --------------------------------------------------------------------------------------------------------


def _tables(graph: fx.Graph, group: _Group, ks: list[_Write], names: Namer) -> tuple[list[fx.Node], fx.Node, str]:
    """(per-layer cos/sin tables, positions, description) for the op (`kv_tables`)."""
    ev = group.ev
    tokens = tensor_val(group.activation).shape[0]
    direct = [direct_table(ev, w.rope.cos, w.rope.sin, tokens) for w in ks]
    if all(d is not None for d in direct) and _one_reading(direct):
        emitted = {d: d.emit(graph) for d in dict.fromkeys(direct)}
        sources = ", ".join(dict.fromkeys(names.of(d.source) for d in direct))
        what = {"halves": "tables", "pairs": "cos/sin pair tables"}.get(direct[0].form, "inverse frequencies")
        computed = " (cos/sin computed in the op)" if direct[0].form == "frequencies" else ""
        return (
            [emitted[d][0] for d in direct],
            emitted[direct[0]][1],
            f"{what} {sources}{computed} at {names.of(direct[0].index)}",
        )
    built: dict[tuple[bytes, bytes], fx.Node] = {}
    tables = []
    for i, w in enumerate(ks):
        key = (w.rope.cos.tobytes(), w.rope.sin.tobytes())
        if key not in built:
            cos, sin = locate(ev, w.rope.cos, tokens), locate(ev, w.rope.sin, tokens)
            scale = scale_of(ev, w.rope.cos, w.rope.sin, tokens) if cos is None or sin is None else None
            if scale is not None:
                raise _NoMatch(
                    KVKeptReason.NORM,
                    f"layer {i}'s K is scaled by {scale:g} besides its norm and rotation (its cos/sin factors are "
                    f"{scale:g} times values the op reads): the op writes the normed, rotated K without a scale",
                    w.site.value,
                    w.site.cache,
                )
            if cos is None or sin is None:
                raise _NoMatch(
                    KVKeptReason.TABLES,
                    f"layer {i}'s {'cos' if cos is None else 'sin'} values are not rows of a per-token value the graph "
                    "computes (the op reads one table row per token)",
                    w.site.value,
                    w.site.cache,
                )
            built[key] = built_table(graph, cos, sin)
        tables.append(built[key])
    positions = _arange_tokens(graph, group.activation)
    return tables, positions, "fp32 [T, R] rows built in the graph from the model's per-token cos/sin, at arange(T)"


def _one_reading(direct: list[Direct]) -> bool:
    """Every layer's table read in one form at one index, and (rows) the tables' rows the same size: no guard."""
    if len({(d.form, d.index) for d in direct}) != 1:
        return False
    return direct[0].form == "frequencies" or len({str(tensor_val(d.source).shape[0]) for d in direct}) == 1


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
        _before_operand_writes(graph, [n for n in graph.nodes if n not in existing], group, names)
        why = self_check(op, [(k.site.value, v.site.value) for k, v in zip(plan.ks, plan.vs, strict=True)], op.args[0])
        if why:
            raise _NoMatch(KVKeptReason.SELF_CHECK, why)
    except _NoMatch:
        for node in reversed([n for n in graph.nodes if n not in existing]):
            graph.erase_node(node)
        raise
    dead = []
    for copy in dict.fromkeys(w.site.copy for w in plan.ks + plan.vs):  # a buffer of several caches: one copy_
        graph.erase_node(copy)
    for w in plan.ks + plan.vs:
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
            tables, positions, where = _tables(graph, group, ks, names)
            rope = f"{'neox' if plan.rope.neox else 'GPT-J'} RoPE on {plan.rope.rot} of {plan.head_dim} dims, {where}"
        else:
            flat_loc = loc if kind != "commit" else call(graph, aten.reshape.default, (loc, [-1]))
            tables, positions, rope = [], flat_loc, "no RoPE"
        has_norm = ks[0].norm is not None
        args = (
            x,
            [w.branch.weight for w in ks],
            [w.row_start for w in ks],
            [w.branch.bias for w in ks],
            [w.branch.weight for w in vs],
            [w.row_start for w in vs],
            [w.branch.bias for w in vs],
            [_norm_weight(graph, w.norm) if has_norm else None for w in ks],
            [w.norm.eps for w in ks] if has_norm else [],
            tables,
            positions,
            plan.rope.neox if plan.rope is not None else True,
            [_cache_operand(graph, w, plan) for w in ks],
            [_cache_operand(graph, w, plan) for w in vs],
            loc,
            commit_lens,
            plan.heads,
            plan.head_dim,
            True,
        )
        _refuse_constants_requiring_grad(graph, args)
        try:
            op = call(graph, KV_WRITE, args)
        except (TypeError, ValueError) as err:  # the op's checks: on CUDA, the binding's rules too
            raise _NoMatch(KVKeptReason.OP_REFUSES, f"the op's fake impl refuses the operands: {err}") from None
    kv = plan.heads * plan.head_dim

    def rows(w: _Write) -> str:
        bias = " + bias" if w.branch.bias is not None else ""
        return f"{names.of(w.branch.weight)}[{w.row_start}:{w.row_start + kv}]{bias}"

    layers = [
        f"K {rows(k)} -> {names.of(k.site.cache)}, V {rows(v)} -> {names.of(v.site.cache)}"
        for k, v in zip(ks, vs, strict=True)
    ]
    if has_norm:
        present = [w.norm.weight is not None for w in ks]
        weights = "weights" if all(present) else "no weight" if not any(present) else "weights on some layers"
        weights += " as 1 + w" if any(w.norm.gemma for w in ks) else ""
        eps = list(dict.fromkeys(f"{w.norm.eps:g}" for w in ks))
        norm = f"k_norm RMSNorm eps {eps[0] if len(eps) == 1 else [f'{w.norm.eps:g}' for w in ks]} ({weights})"
    else:
        norm = "no k_norm"
    return op, KVWriteReport(names.of(x), layers, write, norm, rope)


def _before_operand_writes(graph: fx.Graph, emitted: list[fx.Node], group: _Group, names: Namer) -> None:
    """Move the op (with the nodes emitted for it, `emitted` in graph order, the op last) before the earliest node
    that writes in place into a tensor the op reads, where that write comes before the first cache write: AOT
    writes a mutated input back with a `copy_` at the end of the graph, so `positions.add_(1)` (or a weight or table
    updated) after the K/V writes in the model is a `copy_` that may come before the caches' ones, and the op there
    would read the new value. Only writes after the model's last read count (one before it, the model's reads saw
    too); where the model reads an operand both before and after a write, or the op cannot move before the write
    (an operand computed after it, or a cache read or written in between), the writes are kept."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    start = order[emitted[0]]
    inputs = dict.fromkeys(i for n in emitted for i in n.all_input_nodes if i not in emitted)
    caches = storage_family(dict.fromkeys(w.site.target for w in group.writes))
    computed = set().union(*(_ancestors(w.site.value) for w in group.writes))  # what the writes are computed from
    earliest: tuple[fx.Node, fx.Node] | None = None  # (writer, the operand it writes)
    for operand in inputs:
        if operand in caches:
            continue
        family = storage_family([operand])
        reads = [order[n] for n in computed if n not in family and family.intersection(n.all_input_nodes)]
        first_read, last_read = (min(reads), max(reads)) if reads else (start, order[operand])
        writers = [n for n in nodes[order[operand] + 1 :] if family.intersection(written_args(n))]
        twice = next((w for w in writers if first_read < order[w] < last_read), None)
        if twice is not None:
            raise _NoMatch(
                KVKeptReason.OPERAND_WRITTEN,
                f"{names.of(operand)} is read by the K/V computation before and after {twice.name} "
                f"({op_name(twice)}) writes it in place: the op reads it once",
                twice,
            )
        ahead = next((w for w in writers if start < order[w] < first_read), None)
        if ahead is not None:  # the model reads it after a write that comes after the op's place
            raise _NoMatch(
                KVKeptReason.OPERAND_WRITTEN,
                f"{names.of(operand)} is written in place by {ahead.name} ({op_name(ahead)}) after the first cache "
                "write and read by the K/V computation after that: the op, at the first cache write, would read it "
                "before the write",
                ahead,
            )
        first = next((w for w in writers if last_read < order[w] < start), None)  # the model read before it
        if first is not None and (earliest is None or order[first] < order[earliest[0]]):
            earliest = (first, operand)
    if earliest is None:
        return
    writer, operand = earliest
    written = f"{names.of(operand)} is written in place by {writer.name} ({op_name(writer)}) before the cache writes"
    late = next((i for i in inputs if order[i] >= order[writer]), None)
    if late is not None:
        raise _NoMatch(
            KVKeptReason.OPERAND_WRITTEN,
            f"{written}, and the op, which reads it, also reads {names.of(late)}, computed after that write",
            writer,
        )
    replaced = _replaced_nodes(group)
    for node in nodes[order[writer] : start]:
        touches = node in caches or caches.intersection(node.all_input_nodes) or caches.intersection(written_args(node))
        if touches and node not in replaced:
            raise _NoMatch(
                KVKeptReason.OPERAND_WRITTEN,
                f"{written}, and {node.name} ({op_name(node)}) uses a cache between that write and the cache "
                "writes: the op cannot move before it",
                node,
            )
    for node in emitted:
        writer.prepend(node)


def _refuse_constants_requiring_grad(graph: fx.Graph, args: tuple) -> None:
    """An operand that is a constant of the graph (`get_attr`: AOTInductor's parameters, frozen weights) reaches the
    op's autograd check as the module's own tensor when Inductor lowers the op: one that requires grad, with grad
    mode on (`aoti_compile_and_package` outside `torch.no_grad()`), makes the op refuse it there, failing the
    compile. Such writes keep their path, the report saying how to lower them."""
    module = graph.owning_module
    if not torch.is_grad_enabled() or module is None:
        return
    for node in torch.utils._pytree.tree_leaves(args):
        if isinstance(node, fx.Node) and node.op == "get_attr":
            value = operator.attrgetter(node.target)(module)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise _NoMatch(
                    KVKeptReason.OP_REFUSES,
                    f"the constant {node.target} requires grad and grad mode is on where Inductor runs the op (which "
                    "has no derivative) on it: compile under torch.no_grad() (an AOTInductor package too) to lower "
                    "the writes",
                    node,
                )


def _cache_operand(graph: fx.Graph, w: _Write, plan: _Plan) -> fx.Node:
    """The cache as the op takes it: `[S, heads, head_dim]` (a view of an `[S, heads * head_dim]` cache)."""
    cache = w.site.target
    if tensor_val(cache).dim() == 3:
        return cache
    return call(graph, aten.view.default, (cache, [tensor_val(cache).shape[0], plan.heads, plan.head_dim]))


def _norm_weight(graph: fx.Graph, norm: Norm) -> fx.Node | None:
    """The op's k_norm weight: the model's `w`, or `1 + w` (Gemma) computed in fp32."""
    if norm.weight is None or not norm.gemma:
        return norm.weight
    weight = call(graph, prims.convert_element_type.default, (norm.weight, torch.float32))
    return call(graph, aten.add.Tensor, (weight, 1.0))


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
