"""What one written K or V value computes, read off its symbolic elements (`kv_symbolic`), and the proof that it is
the op's formula.

The op writes, for token t, head h and element j of a layer (`layer_kv` in `custom_ops.linear.multi_linear_kv_write`):

    x[t, h, j] = P[t, c0 + h*d + j]                                  a column block of a GEMM on the activation
    n[t, h, j] = x[t, h, j] * (sum_i x[t, h, i]² / d + eps)^-1/2 * w[j]     k_norm (optional; w optional)
    K[t, h, j] = n[j] cos[t, j'] - n[j + R/2] sin[t, j']  ... (neox pairs (j, j + R/2); GPT-J pairs (2i, 2i + 1))
    K[t, h, j] = n[t, h, j]                                            j >= R (the part RoPE leaves as it is)
    V[t, h, j] = P[t, c0' + h*d + j]

Each written element is a polynomial; every monomial holds exactly one projection element `P` (the GEMM outputs on
the activation are the evaluation's leaves). Grouping by that element gives each written element as
`sum_c P[t, c] * coef_c`; the coefficients are then divided by the norm's `(...)^-1/2` (its base must be the mean
of the squares of the head's own columns plus a constant: eps), by the norm weight's form (`w[j]`, Gemma's
`1 + w[j]`, or none; the weight of element j is read where j is a plain element, or tried from the `[d]` leaves the
coefficients hold), and what is left must be 1 for an element RoPE leaves as it is, and for a rotated pair `(a, b)`
`(cos, -sin)` and `(cos, sin)` with the same two expressions, equal across heads. Those per-token cos/sin
expressions are what the op's table rows must hold (`kv_tables`). Nothing here depends on how the graph spelled it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

from dspark_fx.passes.graph_utils import aten, gemm_activation, op_name, tensor_val
from dspark_fx.passes.kv_symbolic import Evaluation, Sym, same_size

_GEMMS = (aten.mm.default, aten.addmm.default, aten.bmm.default)  # a leaf of these is another projection
_LAYER_NORMS = (aten.native_layer_norm.default, aten.var_mean.correction)


class NotTheFormula(Exception):
    """The written value is not the op's formula: `kind` ("projection", "unevaluable", "norm", "rope", "tables",
    "cast", "layout"), the message says why, `node` is the graph node where that shows (if one does)."""

    def __init__(self, kind: str, message: str, node: fx.Node | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.node = node


@dataclass(frozen=True)
class Norm:
    eps: float
    weight: fx.Node | None  # the `[head_dim]` leaf the weight is read from, or None (no weight)
    gemma: bool  # the weight is `1 + w`


@dataclass(frozen=True)
class Rope:
    rot: int  # rotated elements per head
    neox: bool
    cos: np.ndarray  # [tokens, rot / 2] expression ids: what the op's table row must hold
    sin: np.ndarray


@dataclass(frozen=True)
class Written:
    """One written value, as the op computes it."""

    gemm: fx.Node
    column: int  # the GEMM output column of element [t, 0, 0]
    heads: int
    head_dim: int
    norm: Norm | None
    rope: Rope | None

    @property
    def transformed(self) -> bool:
        return self.norm is not None or self.rope is not None


def normed_size(ev: Evaluation, value: fx.Node) -> int | None:
    """How many elements the k_norm of `value`'s first element means over (its head_dim), None without a norm."""
    sym = ev(value)
    if sym is None or not sym.ids.size:
        return None
    alg = ev.alg
    for mono, _ in alg.polys[int(sym.ids.reshape(-1)[0])][:1]:
        for aid, k in mono:
            if alg.atoms[aid][0] == "base" and k == -0.5:
                return sum(1 for m, _ in alg.polys[alg.atoms[aid][1]] if m != ())
    return None


def read_written(ev: Evaluation, value: fx.Node, gemms: set[fx.Node], heads: int, head_dim: int) -> Written:
    """What `value` (`[T, heads, head_dim]`, or `[T, heads * head_dim]`) computes; raises `NotTheFormula`."""
    sym = ev(value)
    if sym is None or sym.ids.size != ev.tokens * heads * head_dim or sym.complex:
        product = _product_of_projected(value, gemms, head_dim)
        if product is not None:
            raise NotTheFormula(
                "unevaluable",
                f"{value.name} is computed through {product.name} ({op_name(product)}), a product per head of a "
                "value that already reads the projection (such as a rotation written `k @ R`), not a projection of "
                "the tokens: the pass follows K from its projection through elementwise ops, views, norms and index "
                "or slice rotations, not through a product by a matrix",
                product,
            )
        raise NotTheFormula("layout", f"{value.name} is not a [T, {heads}, {head_dim}] value", value)
    ids = sym.ids.reshape(ev.tokens, heads, head_dim)
    terms = _Terms(ev, gemms, value)
    rows = [[[terms.of(int(ids[t, h, j])) for j in range(head_dim)] for h in range(heads)] for t in range(ev.tokens)]
    gemm, column = terms.block(rows, head_dim)
    # each term keyed by its element's index within the head instead of its (token, GEMM column)
    local = [
        [[{c - column - h * head_dim: k for (_, c), k in e.items()} for e in row] for h, row in enumerate(hrows)]
        for hrows in rows
    ]
    norm_eps = _strip_norm(ev, local, gemm, column, head_dim, value)
    if norm_eps is not None and ev.model == torch.float16:
        _squares_in_float32(ev, value, gemm)
    return _with_weight_and_rope(ev, local, gemm, column, head_dim, norm_eps, value)


def _squares_in_float32(ev: Evaluation, value: fx.Node, gemm: fx.Node) -> None:
    """An fp16 model's norm must square the projection in a wider dtype: in float16 a square overflows above
    |k| = 256, giving a zero or NaN K in eager, where the op computes in fp32 and would write finite values (bf16 has
    fp32's range; fp32 models compute so). Raises `NotTheFormula` naming the first float16 node on the way to `value`
    that holds a square of the projection."""
    alg = ev.alg

    def degree(e: int) -> float:
        return max(
            (
                sum(k for aid, k in mono if alg.atoms[aid][0] == "leaf" and alg.atoms[aid][1] is gemm)
                for mono, _ in alg.polys[e]
            ),
            default=0.0,
        )

    seen: set[fx.Node] = set()
    todo = [value]
    found: list[fx.Node] = []
    while todo:
        node = todo.pop()
        if node in seen or node is gemm:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
        val, sym = tensor_val(node), ev.memo.get(node)
        if val is None or val.dtype != torch.float16 or not isinstance(sym, Sym):
            continue
        if any(degree(int(e)) >= 2 for e in np.unique(sym.ids)):
            found.append(node)
    if found:
        order = {n: i for i, n in enumerate(value.graph.nodes)}
        node = min(found, key=order.__getitem__)
        raise NotTheFormula(
            "norm",
            f"{node.name} ({op_name(node)}) computes the norm's squares of the projection in torch.float16, where "
            "they overflow above |k| = 256 and eager then writes zeros or NaN; "
            "the op squares and sums in fp32, so an fp16 model is lowered where its norm does so too (e.g. "
            "`k.float().pow(2).mean(-1, keepdim=True)`, as Qwen3's RMSNorm does)",
            node,
        )


def _product_of_projected(value: fx.Node, gemms: set[fx.Node], head_dim: int) -> fx.Node | None:
    """The GEMM of `gemms` that is no projection of `value`'s tokens but a product per head: its activation is
    `[rows, head_dim]` with other rows than `value` has tokens (K times a matrix, such as a rotation written `k @ R`,
    taken for the GEMM of the normed K), if any."""
    tokens = tensor_val(value)
    if tokens is None or tokens.dim() == 0:
        return None
    for gemm in sorted(gemms, key=lambda n: n.name):
        act = tensor_val(gemm_activation(gemm))
        if (
            act is not None
            and act.dim() == 2
            and same_size(act.shape[1], head_dim)
            and not same_size(act.shape[0], tokens.shape[0])
        ):
            return gemm
    return None


class _Terms:
    """Written elements as `{(t, column): coefficient id}` over the projection elements they read."""

    def __init__(self, ev: Evaluation, gemms: set[fx.Node], value: fx.Node) -> None:
        self.ev, self.gemms, self.value = ev, gemms, value
        self.gemm: fx.Node | None = None

    def of(self, e: int) -> dict[tuple[int, int], int]:
        alg = self.ev.alg
        grouped: dict[tuple[int, int], dict] = {}
        for mono, coef in alg.polys[e]:
            found = [(i, k) for i, k in mono if alg.atoms[i][0] == "leaf" and alg.atoms[i][1] in self.gemms]
            if len(found) != 1 or found[0][1] != 1.0:
                raise self._why(e, found)
            (aid, _), node = found[0], alg.atoms[found[0][0]][1]
            if self.gemm is None:
                self.gemm = node
            elif node is not self.gemm:
                raise NotTheFormula(
                    "projection", f"{self.value.name} reads two GEMMs ({self.gemm.name}, {node.name})", node
                )
            width = self.ev.shape(node)[1]
            key = divmod(alg.atoms[aid][2], width)
            rest = tuple(m for m in mono if m[0] != aid)
            grouped.setdefault(key, {})[rest] = coef
        return {key: alg.intern(poly) for key, poly in grouped.items()}

    def _why(self, e: int, found: list) -> NotTheFormula:
        alg = self.ev.alg
        casts = [
            self.ev.casts[aid]
            for aid in _atoms_in(alg, e)
            if alg.atoms[aid][0] == "cast" and self._reads_projection(alg.atoms[aid][2])
        ]
        if casts:
            order = {n: i for i, n in enumerate(self.value.graph.nodes)}
            node = min(casts, key=order.__getitem__)  # the first rounding on the way
            src, dst = node.args[0].meta["val"].dtype, node.meta["val"].dtype
            return NotTheFormula(
                "cast",
                f"{node.name} casts {src} to {dst}, a rounding the op does not make (only casts that keep every "
                f"value and roundings to the model dtype {self.ev.model} may be left out)",
                node,
            )
        if not found:
            unfollowed = [
                alg.atoms[aid][1]
                for aid in _atoms_in(alg, e)
                if alg.atoms[aid][0] == "leaf"
                and alg.atoms[aid][1].op == "call_function"
                and alg.atoms[aid][1].target not in _GEMMS
            ]
            layer_norms = [n for n in unfollowed if _layer_norm(n) is not None]
            if layer_norms:
                node = layer_norms[0]
                return NotTheFormula(
                    "norm",
                    f"{self.value.name}: the norm subtracts the mean of the normed elements before it scales them (a "
                    f"LayerNorm: it reads {node.name}, an output of {_layer_norm(node).name} "
                    f"({op_name(_layer_norm(node))})), where the op's k_norm is an RMSNorm, which scales the elements "
                    "as they are and adds no bias",
                    node,
                )
            if unfollowed:
                node = unfollowed[0]
                return NotTheFormula(
                    "unevaluable",
                    f"an element of {self.value.name} has a term without a projection element: it reads {node.name} "
                    f"({op_name(node)}), a value the pass does not follow (an op without a rule, or one whose "
                    "operands are not constants where the rule needs them, such as an index read from a tensor)",
                    node,
                )
            return NotTheFormula(
                "projection", f"an element of {self.value.name} has a term without a projection element", self.value
            )
        return NotTheFormula(
            "projection", f"an element of {self.value.name} is not linear in the projection elements", self.value
        )

    def _reads_projection(self, e: int) -> bool:
        alg = self.ev.alg
        return any(alg.atoms[a][0] == "leaf" and alg.atoms[a][1] in self.gemms for a in _atoms_in(alg, e))

    def block(self, rows: list, head_dim: int) -> tuple[fx.Node, int]:
        """The GEMM and the column of element [0, 0, 0]: head h, token t reads columns `column + h*d + [0, d)`
        of token t."""
        if self.gemm is None:
            raise NotTheFormula("projection", f"{self.value.name} reads no GEMM output", self.value)
        cols = [c for e in rows[0][0] for (_, c) in e]
        column = min(cols)
        for t, hrows in enumerate(rows):
            for h, row in enumerate(hrows):
                lo = column + h * head_dim
                for e in row:
                    if any(tt != t or not lo <= c < lo + head_dim for tt, c in e):
                        raise NotTheFormula(
                            "projection",
                            f"{self.value.name}[{t}, {h}] reads GEMM columns or tokens outside head {h}'s block of "
                            f"token {t} (heads are columns {column} + h * {head_dim} of {self.gemm.name})",
                            self.value,
                        )
        return self.gemm, column


def _layer_norm(node: fx.Node) -> fx.Node | None:
    """The op of a LayerNorm that `node` is an output of (through `getitem`): `native_layer_norm`, or the `var_mean`
    of its decomposition (the mean it subtracts, the variance it scales by), else None."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node if node.target in _LAYER_NORMS else None


def _atoms_in(alg, e: int) -> list[int]:
    """Atom ids in expression `e`, looking into base, function and cast arguments too."""
    out, todo, seen = [], [e], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        for mono, _ in alg.polys[x]:
            for aid, _ in mono:
                out.append(aid)
                atom = alg.atoms[aid]
                if atom[0] in ("base", "fn", "cast"):
                    todo.append(atom[-1])
    return out


def _strip_norm(ev: Evaluation, local: list, gemm: fx.Node, column: int, d: int, value: fx.Node) -> float | None:
    """Divide every coefficient by its head's `(mean of squares + eps)^-1/2`; the eps, or None without a norm."""
    alg = ev.alg
    eps_seen: set[float] = set()
    normed: set[bool] = set()
    for t, hrows in enumerate(local):
        for h, row in enumerate(hrows):
            base = _norm_base(ev, row)
            normed.add(base is not None)
            if base is None:
                continue
            base_id, base_atom = base
            eps_seen.add(_norm_eps(ev, base_id, gemm, column + h * d, d, t, value))
            for e in row:
                for j, k in e.items():
                    poly = alg.polys[k]
                    if not all((base_atom, -0.5) in mono for mono, _ in poly):
                        raise NotTheFormula("norm", f"{value.name}: not every term of a head is normed alike", value)
                    e[j] = alg.intern({tuple(m for m in mono if m != (base_atom, -0.5)): c for mono, c in poly})
    if len(normed) != 1:
        raise NotTheFormula("norm", f"{value.name}: some heads or tokens are normed and others not", value)
    if len(eps_seen) > 1:
        raise NotTheFormula("norm", f"{value.name}: heads are normed with different eps {sorted(eps_seen)}", value)
    return eps_seen.pop() if eps_seen else None


def _norm_base(ev: Evaluation, row: list) -> tuple[int, int] | None:
    """`(base expression, atom id)` of the `base^-1/2` factor in the first term of a head, if any."""
    alg = ev.alg
    first = next(iter(row[0].values()))
    for mono, _ in alg.polys[first]:
        for aid, k in mono:
            if alg.atoms[aid][0] == "base" and k == -0.5:
                return alg.atoms[aid][1], aid
    return None


def _norm_eps(ev: Evaluation, base: int, gemm: fx.Node, lo: int, d: int, t: int, value: fx.Node) -> float:
    """The eps of `mean over the head's own columns of P² + eps`, or `NotTheFormula`."""
    alg = ev.alg
    width = ev.shape(gemm)[1]
    want = {t * width + lo + j for j in range(d)}
    eps, seen = 0.0, set()
    for mono, coef in alg.polys[base]:
        if mono == ():
            eps = coef
            continue
        if not any(alg.atoms[i][0] == "leaf" and alg.atoms[i][1] is gemm for i, _ in mono):
            leaf = _graph_node(ev, mono) or value
            raise NotTheFormula("norm", f"{value.name}: the norm's eps is not a constant but {_eps_source(leaf)}", leaf)
        atom = alg.atoms[mono[0][0]] if len(mono) == 1 else None
        if atom is None or atom[0] != "leaf" or atom[1] is not gemm or mono[0][1] != 2.0 or atom[2] not in want:
            raise NotTheFormula(
                "norm",
                f"{value.name}: the norm's mean is not over the squares of one head's {d} elements (it reads "
                "other values, e.g. over the heads instead of head_dim, or after the rotation)",
                value,
            )
        if coef != 1.0 / d:
            raise NotTheFormula("norm", f"{value.name}: the norm divides the sum of squares by {1 / coef:g}, not {d}")
        seen.add(atom[2])
    if seen != want:
        raise NotTheFormula("norm", f"{value.name}: the norm's mean reads {len(seen)} of the head's {d} elements")
    return eps


def _eps_source(leaf: fx.Node) -> str:
    """Where a norm's eps that is not a constant comes from, and what makes it one. Dynamo passes a Python float
    attribute it does not specialize as a 0-d fp64 tensor input; any other tensor is the model's own."""
    val = leaf.meta.get("val")
    if leaf.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.float64:
        return (
            f"a value of the graph ({leaf.name}); Dynamo makes a Python float attribute a graph input under "
            "dynamic=True: compile with dynamic=None (the token count still becomes symbolic at a second size) or "
            "torch._dynamo.config.specialize_float=True"
        )
    return (
        f"read from a tensor ({leaf.name}), a value that may change between calls: the op takes eps as a number "
        "fixed at compile time; hold it as a Python float (e.g. `self.eps = 1e-6`)"
    )


def _graph_node(ev: Evaluation, mono: tuple) -> fx.Node | None:
    """The first graph node a monomial reads: a leaf's node, looking through casts (an unspecialized float eps is
    a graph input cast to fp32)."""
    for aid, _ in mono:
        atom = ev.alg.atoms[aid]
        if atom[0] == "leaf":
            return atom[1]
        if atom[0] == "cast":
            inner = (_graph_node(ev, m) for m, _ in ev.alg.polys[atom[2]])
            return next((n for n in inner if n is not None), ev.casts.get(aid))
    return None


def _weight_forms(ev: Evaluation, local: list, d: int) -> list[tuple[fx.Node | None, bool]]:
    """Candidate norm weight forms: none, then `w[j]` and `1 + w[j]` for each `[d]` leaf the coefficients read."""
    alg = ev.alg
    nodes: dict[fx.Node, None] = {}
    for e in local[0][0]:
        for k in e.values():
            for mono, _ in alg.polys[k]:
                for aid, _ in mono:
                    atom = alg.atoms[aid]
                    if atom[0] == "leaf" and ev.shape(atom[1]) == (d,):
                        nodes[atom[1]] = None
    return [(None, False)] + [(n, g) for n in nodes for g in (False, True)]


def _divide(ev: Evaluation, k: int, weight: fx.Node | None, gemma: bool, j: int) -> int | None:
    """`k / w[j]` (or `/ (1 + w[j])`) if that divides it and leaves no element of `w`, else None."""
    alg = ev.alg
    if weight is None:
        out = k
    else:
        aid = alg.atom_id(("leaf", weight, j))
        if aid is None:
            return None
        poly = alg.polys[k]
        if not gemma:
            if not all((aid, 1.0) in mono for mono, _ in poly):
                return None
            out = alg.intern({tuple(m for m in mono if m != (aid, 1.0)): c for mono, c in poly})
        else:
            out = alg.intern({mono: c for mono, c in poly if all(i != aid for i, _ in mono)})
            if alg.mul(out, alg.add(alg.one, alg.atom(("leaf", weight, j)))) != k:
                return None
        if any(alg.atoms[i][0] == "leaf" and alg.atoms[i][1] is weight for i in _atoms_in(alg, out)):
            return None
    return out


def _with_weight_and_rope(
    ev: Evaluation, local: list, gemm: fx.Node, column: int, d: int, eps: float | None, value: fx.Node
) -> Written:
    heads = len(local[0])
    forms = [(None, False)] if eps is None else _weight_forms(ev, local, d)
    why: NotTheFormula | None = None
    for weight, gemma in forms:
        rest = []
        for hrows in local:
            rest.append([])
            for row in hrows:
                divided = [{j: _divide(ev, k, weight, gemma, j) for j, k in e.items()} for e in row]
                if any(k is None for e in divided for k in e.values()):
                    break
                rest[-1].append(divided)
            else:
                continue
            break
        else:
            try:
                rope = _rope(ev, rest, d, value)
            except NotTheFormula as err:
                why = err if err.kind == "tables" else why or err  # the halves: all else fitted
                continue
            norm = Norm(eps, weight, gemma) if eps is not None else None
            return Written(gemm, column, heads, d, norm, rope)
    for apart in (_heads_scaled_apart(ev, local, value), _heads_rotated_apart(local, value)):
        if apart is not None:
            raise apart
    if why is not None:
        raise why
    raise NotTheFormula("norm", f"{value.name}: the norm weight is neither w[j], 1 + w[j] nor absent", value)


def _heads_scaled_apart(ev: Evaluation, local: list, value: fx.Node) -> NotTheFormula | None:
    """Why no norm weight and rotation fit, where an element's factor differs between two heads by a value the graph
    holds or computes (a `[heads, head_dim]` norm weight, a scale the evaluation does not follow, such as
    `F.normalize`'s norm): the op applies one norm and one rotation to every head. None where every head's factors
    are the same, or differ only in cos/sin (functions and table reads: the RoPE's own message says more) or in the
    elements they mix (`_heads_rotated_apart`)."""
    alg = ev.alg
    for hrows in local:
        for h in range(1, len(hrows)):
            for j, (first, other) in enumerate(zip(hrows[0], hrows[h], strict=True)):
                if first == other or set(first) != set(other):
                    continue
                read = [
                    alg.atoms[aid][1]
                    for k in (*first.values(), *other.values())
                    for mono, _ in alg.polys[k]
                    for aid, _ in mono
                    if alg.atoms[aid][0] == "leaf"
                ]
                if read:
                    computed = list(dict.fromkeys(n for n in read if n.op == "call_function"))
                    names = [f"{n.name} ({op_name(n)})" for n in computed]
                    names += ["a graph input"] if len(computed) < len(set(read)) else []
                    return NotTheFormula(
                        "norm",
                        f"{value.name}: element {j} of heads 0 and {h} is scaled by different values read from "
                        f"{' and '.join(names)}: the op applies one RMSNorm (over each head's own elements, with one "
                        "[head_dim] weight) and one rotation to every head",
                        (computed or read)[0],
                    )
    return None


def _heads_rotated_apart(local: list, value: fx.Node) -> NotTheFormula | None:
    """Why no rotation fits, where an element of one head mixes other elements of its head than the same element of
    another head (a RoPE of some heads only): the op rotates every head alike. Else None."""
    for hrows in local:
        for h in range(1, len(hrows)):
            for j, (first, other) in enumerate(zip(hrows[0], hrows[h], strict=True)):
                if set(first) != set(other):
                    return NotTheFormula(
                        "rope",
                        f"{value.name}: element {j} of head 0 mixes elements {sorted(first)} of its head, of head {h} "
                        f"elements {sorted(other)}: the op rotates every head alike (a RoPE of some heads only is not "
                        "its formula)",
                        value,
                    )
    return None


def _rope(ev: Evaluation, rest: list, d: int, value: fx.Node) -> Rope | None:
    """The rotation the coefficients left after the norm make, or None if every element is its own."""
    alg = ev.alg
    plain = [
        all(rest[t][h][j] == {j: alg.one} for t in range(len(rest)) for h in range(len(rest[0]))) for j in range(d)
    ]
    rot = max((j + 1 for j in range(d) if not plain[j]), default=0)
    if rot == 0:
        return None
    if rot % 2:
        raise NotTheFormula("rope", f"{value.name}: elements 0..{rot - 1} of a head mix, an odd count: not a RoPE")
    half = rot // 2
    problems = []
    for neox in (True, False):
        pairs = [(i, i + half) if neox else (2 * i, 2 * i + 1) for i in range(half)]
        try:
            cos, sin = _pairs(ev, rest, pairs)
        except NotTheFormula as err:
            problems.append(str(err))
            continue
        return Rope(rot, neox, cos, sin)
    apart = _halves_apart(ev, rest, half, value)
    if apart is not None:
        raise apart
    raise NotTheFormula(
        "rope",
        f"{value.name}: the first {rot} elements of a head are neither a neox nor a GPT-J rotation "
        f"({problems[0]}; GPT-J: {problems[1]})",
        value,
    )


def _halves_apart(ev: Evaluation, rest: list, half: int, value: fx.Node) -> NotTheFormula | None:
    """Why a neox rotation does not fit, where elements 0 and `half` take their cos from two elements of one value
    (a `[T, head_dim]` cos input, a `cat(freqs, freqs).cos()` table read at the positions): the op turns each pair
    by one angle, and the graph does not show that the value's two halves hold the same numbers. Else None."""
    first, second = rest[0][0][0], rest[0][0][half]
    if set(first) != {0, half} or set(second) != {0, half} or first[0] == second[half]:
        return None
    a, b = _element_read(ev, first[0]), _element_read(ev, second[half])
    if a is None or b is None or a[0] is not b[0]:
        return None
    return NotTheFormula(
        "tables",
        f"{value.name}: elements 0 and {half} of a head take their cos from elements {a[1]} and {b[1]} of one "
        "value, where the op turns both by one angle, and nothing in the graph shows that its two halves hold the "
        "same numbers (as a cat(freqs, freqs) table does): give it the first half only, or compute cos/sin in the "
        "graph from the positions",
        a[0],
    )


def _element_read(ev: Evaluation, e: int) -> tuple[fx.Node, int] | None:
    """`(node, column)` where `e` is one element of a value the evaluation does not look into (a leaf, or a row of
    a table read at an index), through casts; else None."""
    atom = ev.alg.single_atom(e)
    while atom is not None and atom[0] == "cast":
        atom = ev.alg.single_atom(atom[2])
    if atom is None or atom[0] not in ("leaf", "gather"):
        return None
    if atom[0] == "gather":
        return atom[1], atom[3]
    return atom[1], atom[2] % ev.shape(atom[1])[-1]


def _pairs(ev: Evaluation, rest: list, pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    alg = ev.alg
    tokens, heads = len(rest), len(rest[0])
    cos = np.empty((tokens, len(pairs)), dtype=np.int64)
    sin = np.empty((tokens, len(pairs)), dtype=np.int64)
    for t in range(tokens):
        for i, (a, b) in enumerate(pairs):
            for h in range(heads):
                ea, eb = rest[t][h][a], rest[t][h][b]
                if set(ea) != {a, b} or set(eb) != {a, b}:
                    raise NotTheFormula("rope", f"elements {a} and {b} are not two-term sums of each other")
                c, s = ea[a], alg.scale(ea[b], -1.0)
                if eb[b] != c:
                    raise NotTheFormula("rope", f"elements ({a}, {b}) do not take the same cos factor")
                if eb[a] != s:
                    raise NotTheFormula("rope", f"elements ({a}, {b}) are not (a cos - b sin, b cos + a sin)")
                if h == 0:
                    cos[t, i], sin[t, i] = c, s
                elif (cos[t, i], sin[t, i]) != (c, s):
                    raise NotTheFormula("rope", f"heads 0 and {h} rotate elements ({a}, {b}) by different angles")
    return cos, sin
