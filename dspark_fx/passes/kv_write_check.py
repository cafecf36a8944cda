"""The numeric self-check of a `dspark::multi_linear_kv_write` lowering, at compile time.

`kv_write` proves symbolically that what the graph writes into each cache is the op's formula. Before it replaces
the nodes, this module tests the proof: it evaluates the real nodes from the activation (and the weights, norm
weights, tables, positions they read) to each written value on random fp64 tensors, evaluates the op's formula
(`custom_ops.linear.multi_linear_kv_write.layer_kv`, the function the CPU reference runs) in fp64 on the operands
the lowering passes to the op, and compares. Anything beyond fp64 round-off means the lowering is not made.

The evaluation holds every float value in fp64. A value of the model dtype (the activation's and caches'), or of a
dtype that represents every model-dtype value (fp32 in a bf16 model), is exact there: the op computes in fp32 and
rounds when it stores (on CUDA's GEMM path also before the norm), within the tolerance it documents against
eager's per-step rounding. A value of any other float dtype (fp8, fp16 in a bf16 model, bf16 in an fp32 model) is
rounded through that dtype, as eager rounds it; the op does not, so a cast the proof wrongly left out shows as a
difference of that dtype's precision.

Sizes: the token count T is evaluated at 3 tokens. A symbolic T is bound to 3 (other symbols take their current
values). A static T above `STATIC_AS_IS` (a prefill graph of 4096 tokens would take seconds and gigabytes in fp64)
is read as 3 wherever it is a size: every dim of a leaf that equals T, and the first size equal to T in each shape
argument of a view or factory; each evaluated value must then have its graph shape with T read as 3, else the check
evaluates at T itself. The activation's and weights' inner
dim `K` shrinks to at most 16 (only the GEMM reads it), and a table read only by `table[positions]` to at most 64
rows (random positions stay below every such table's rows). A check that would evaluate more than `MAX_ELEMENTS`
elements is not run and the lowering is not made: the check stays a few milliseconds.
"""

from __future__ import annotations

import math
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_map

from custom_ops.linear.multi_linear_kv_write import layer_kv, rope_rows
from dspark_fx.passes.graph_utils import aten, is_pure, tensor_val

MAX_ELEMENTS = 1 << 22  # fp64 elements of the random inputs plus the written values, summed
CHECK_TOKENS = 3  # tokens of the check
STATIC_AS_IS = 16  # a static token count up to this is evaluated as it is
# ops whose int arguments are sizes: a static T among them is read as CHECK_TOKENS
_SHAPE_OPS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.arange.default,
    aten.arange.start,
    torch.ops.prims.iota.default,
    aten.full.default,
    aten.empty.memory_format,
    aten.zeros.default,
    aten.ones.default,
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
}
MAX_K = 16  # the GEMMs' inner dim, at most
MAX_TABLE_ROWS = 64
RTOL = 1e-9  # fp64 round-off of these small sums is ~1e-15; the smallest difference to catch (eps 1e-5 vs 1e-6
# on unit-variance K) is ~5e-6


class _Unevaluable(Exception):
    """The check cannot evaluate the graph (the message says why)."""


class _SizeClash(Exception):
    """A static token count read as `CHECK_TOKENS` gave a value another shape: another size equals T."""


def self_check(op: fx.Node, layers: list[tuple[fx.Node, fx.Node]], activation: fx.Node) -> str:
    """Why the op node `op` does not compute what the graph writes ("" if it agrees to fp64 round-off). `layers`:
    per layer of the op, the `[T, heads, head_dim]` K and V values the graph writes into its caches."""
    # The pass runs under the graph's fake mode and the Python dispatcher; the check needs real tensors, fast, and
    # on one thread (waking the intra-op pool for a [3, 16] fp64 GEMM can take longer than the whole check).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with unset_fake_temporarily(), no_python_dispatcher():
            return _check(op, layers, activation)
    finally:
        torch.set_num_threads(threads)


def _check(op: fx.Node, layers: list[tuple[fx.Node, fx.Node]], activation: fx.Node) -> str:
    model = tensor_val(activation).dtype
    values = [n for kv in layers for n in kv]
    try:
        try:
            env = _Evaluation(op, activation, model, shrink=True).run(values)
        except _SizeClash:
            env = _Evaluation(op, activation, model, shrink=False).run(values)
    except _Unevaluable as err:
        return f"the numeric self-check cannot run: {err}"
    (_, kw, ks, kb, vw, vs, vb, norm_w, eps, tables, positions, neox, *_, heads, head_dim, _) = op.args
    x = env[activation]
    pos = env[positions] if tables else None
    for i, (k_node, v_node) in enumerate(layers):
        k, v = layer_kv(
            x,
            (env[kw[i]], ks[i], _opt(env, kb[i])),
            (env[vw[i]], vs[i], _opt(env, vb[i])),
            (_opt(env, norm_w[i]), eps[i]) if eps else None,
            rope_rows(env[tables[i]], pos) if tables else None,
            neox,
            heads,
            head_dim,
        )
        for what, node, want in (("K", k_node, k), ("V", v_node, v)):
            why = _differ(env[node], want)
            if why:
                return (
                    f"the numeric self-check refuses it: on random fp64 inputs layer {i}'s {what} ({node.name}) {why}"
                )
    return ""


def _opt(env: dict, node: Any) -> torch.Tensor | None:
    return None if node is None else env[node]


def _differ(got: torch.Tensor, want: torch.Tensor) -> str:
    """How the graph's value `got` differs from the op's `want` ("" if only by fp64 round-off). A `[T, heads *
    head_dim]` value (written to a flat cache) is compared as `[T, heads, head_dim]`."""
    if got.dim() == 2 and want.dim() == 3 and got.shape == (want.shape[0], want.shape[1] * want.shape[2]):
        got = got.unflatten(1, want.shape[1:])
    if got.shape != want.shape:
        return f"has shape {tuple(got.shape)}, the op's formula {tuple(want.shape)}"
    finite_got, finite_want = bool(torch.isfinite(got).all()), bool(torch.isfinite(want).all())
    if not (finite_got and finite_want):
        return "has non-finite values, the op's formula " + ("none" if finite_want else "too")
    if not got.numel():
        return ""
    err, scale = (got - want).abs().max().item(), max(want.abs().max().item(), 1.0)
    return f"differs from the op's formula by {err:.3g} (|values| up to {scale:.3g})" if err > RTOL * scale else ""


class _Evaluation:
    """Real fp64 values of the nodes the check needs, from random leaves."""

    def __init__(self, op: fx.Node, activation: fx.Node, model: torch.dtype, shrink: bool) -> None:
        self.op, self.activation = op, activation
        self.exact = {model, *(d for d in (torch.float32, torch.float64) if keeps_values(model, d))}
        self.gen = torch.Generator().manual_seed(0)
        tokens = tensor_val(activation).shape[0]
        self.binding: dict = {}
        self.static_tokens: int | None = None  # a static T read as CHECK_TOKENS
        if isinstance(tokens, torch.SymInt) and isinstance(tokens.node.expr, sympy.Symbol):
            self.binding[tokens.node.expr] = sympy.Integer(CHECK_TOKENS)
        elif shrink and isinstance(tokens, int) and tokens > STATIC_AS_IS:
            self.static_tokens = tokens
        self.full_k = tensor_val(activation).shape[1]
        self.k = min(self._size(self.full_k), MAX_K)
        self.weights = {*op.args[1], *op.args[4]}
        self.operands = {n for i in (1, 3, 4, 6, 7, 9) for n in op.args[i] if isinstance(n, fx.Node)}
        self.elements = 0

    def run(self, values: list[fx.Node]) -> dict[fx.Node, Any]:
        args = self.op.args
        operands = [*args[1], *args[3], *args[4], *args[6], *args[7], *args[9], args[10]]
        targets = [*values, self.activation, *(n for n in operands if isinstance(n, fx.Node))]
        needed = self._needed(targets)
        order = [n for n in self.activation.graph.nodes if n in needed]
        if sum(math.prod(self._shape(v)) for v in values) > MAX_ELEMENTS:
            raise _Unevaluable(f"the written values alone exceed {MAX_ELEMENTS} elements (T = {self._tokens()})")
        bound = self._index_bound(order)
        env: dict[fx.Node, Any] = {}
        for node in order:
            if node is self.activation or node.op != "call_function":
                env[node] = self._leaf(node, bound)
            else:
                env[node] = self._call(node, env)
            if self.elements > MAX_ELEMENTS:
                raise _Unevaluable(f"more than {MAX_ELEMENTS} elements to evaluate (T = {self._tokens()})")
        return env

    def _tokens(self) -> int:
        return self._size(tensor_val(self.activation).shape[0])

    def _needed(self, targets: list[fx.Node]) -> set[fx.Node]:
        out, todo = set(), list(targets)
        while todo:
            node = todo.pop()
            if node in out:
                continue
            out.add(node)
            if node is self.activation or node.op != "call_function":
                continue
            if not is_pure(node):
                raise _Unevaluable(f"{node.name} ({node.target}) is not a pure function of its inputs")
            todo.extend(node.all_input_nodes)
        return out

    def _size(self, size: Any) -> int:
        """A concrete size: the check's token count for the activation's symbol, current values for the others."""
        if isinstance(size, int):
            return size
        shape_env = size.node.shape_env
        hints = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val  # the name of torch >= 2.13
        expr = size.node.expr.xreplace(self.binding).xreplace(hints)
        if not expr.is_number:
            raise _Unevaluable(f"the size {size} has no value to evaluate it at")
        return int(expr)

    def _shaped_as(self, out: torch.Tensor, node: fx.Node) -> bool:
        """`out` has `node`'s graph shape as the check reads it: a dim of T's size may be the token dim (read as
        CHECK_TOKENS) or another of that size; a dim of K's size may have shrunk with K."""
        graph_shape = [self._size(size) for size in tensor_val(node).shape]
        return out.dim() == len(graph_shape) and all(
            got == size
            or (size == self.static_tokens and got == CHECK_TOKENS)
            or (size == self.full_k and got == self.k)
            for got, size in zip(out.shape, graph_shape, strict=True)
        )

    def _token_size(self, arg: Any) -> Any:
        """A shape argument with its first size equal to the static T read as CHECK_TOKENS: the token dim comes
        before any other dim of that size in the layouts the lowering proves ([T, heads, head_dim], [T, W],
        [B, T, heads, head_dim]). A wrong reading fails to evaluate (then the check runs at T itself) or gives
        values that differ from the op's (then the lowering is refused): it never passes a wrong proof."""
        if self.static_tokens is None:
            return arg
        if type(arg) is int:
            return CHECK_TOKENS if arg == self.static_tokens else arg
        if isinstance(arg, (list, tuple)) and self.static_tokens in arg:
            sizes = list(arg)
            sizes[sizes.index(self.static_tokens)] = CHECK_TOKENS
            return type(arg)(sizes)
        return arg

    def _shape(self, node: fx.Node) -> list[int]:
        """`node`'s shape in the check: concrete sizes, and a static T read as CHECK_TOKENS in a value that has
        token rows (anything but the op's weights, biases, norm weights and tables)."""
        val = tensor_val(node)
        shape = [] if val is None else [self._size(s) for s in val.shape]
        return shape if node in self.operands else self._token_size(shape)

    def _index_bound(self, order: list[fx.Node]) -> int:
        """Random index values stay below the rows of every tensor the needed nodes index (`tensor[index]`)."""
        rows = [MAX_TABLE_ROWS]
        for node in order:
            if node.target is aten.index.Tensor:
                source = node.args[0]
                size = self._shape(source)[0]
                rows.append(min(size, MAX_TABLE_ROWS) if self._table(source) else size)
        return max(min(rows), 1)

    def _table(self, node: fx.Node) -> bool:
        """A placeholder read only as `node[index]` (rows beyond the random positions are never read)."""
        users = [u for u in node.users if u is not self.op]
        return node.op == "placeholder" and all(
            u.target is aten.index.Tensor and u.args[0] is node and len(u.args[1]) == 1 for u in users
        )

    def _leaf(self, node: fx.Node, bound: int) -> Any:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            return self._size(val)
        if isinstance(val, (bool, int, float)):
            return val
        if not isinstance(val, torch.Tensor):
            raise _Unevaluable(f"{node.name} ({node.op}) holds no tensor or size")
        shape = self._shape(node)
        if node is self.activation or node in self.weights:
            shape[1] = self.k
        elif self._table(node) and shape:
            shape[0] = min(shape[0], MAX_TABLE_ROWS)
        self.elements += math.prod(shape)
        if val.dtype.is_complex:  # complex64 parts are fp32 values: exact in every model dtype's evaluation
            parts = torch.randn([*shape, 2], generator=self.gen, dtype=torch.float64)
            return torch.view_as_complex(parts)
        if val.dtype.is_floating_point:
            scale = 1 / math.sqrt(self.k) if node in self.weights else 1.0
            return self._round(torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale, val.dtype)
        if val.dtype == torch.bool:
            return torch.rand(shape, generator=self.gen) < 0.5
        return torch.randint(0, bound, shape, generator=self.gen, dtype=val.dtype)

    def _round(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`t` (fp64) as a value of `dtype` holds it: exact for the model dtype and wider, else rounded."""
        return t if dtype in self.exact else t.to(dtype).to(torch.float64)

    def _call(self, node: fx.Node, env: dict) -> Any:
        def real(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return env[a]
            if isinstance(a, torch.dtype) and a.is_floating_point:
                return torch.float64
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        args, kwargs = tree_map(real, node.args), tree_map(real, node.kwargs)
        if self.static_tokens is not None and node.target in _SHAPE_OPS:
            args = tuple(self._token_size(a) for a in args)
        try:
            out = node.target(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            if self.static_tokens is not None:
                raise _SizeClash from None
            raise _Unevaluable(f"{node.name} ({node.target}) fails on the check's inputs: {err}") from None
        if self.static_tokens is not None and isinstance(out, torch.Tensor) and not self._shaped_as(out, node):
            raise _SizeClash
        return self._rounded(out, node.meta.get("val"))

    def _rounded(self, out: Any, val: Any) -> Any:
        if isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor):
            if val.dtype.is_floating_point:
                self.elements += out.numel()
                return self._round(out.to(torch.float64), val.dtype)
            return out
        if isinstance(out, (list, tuple)) and isinstance(val, (list, tuple)) and len(out) == len(val):
            return type(out)(self._rounded(o, v) for o, v in zip(out, val, strict=True))
        return out


def keeps_values(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether `dst` represents every value of `src`: at least as many significand bits, a max at least as large and
    a subnormal step at most as large (bf16 -> fp32, fp16 -> fp32, fp32 -> fp64, fp8 -> bf16; not bf16 <-> fp16)."""
    if src == dst:
        return True
    try:
        s, d = torch.finfo(src), torch.finfo(dst)
    except TypeError:  # packed sub-byte dtypes have no finfo
        return False
    return d.eps <= s.eps and d.max >= s.max and d.smallest_normal * d.eps <= s.smallest_normal * s.eps
