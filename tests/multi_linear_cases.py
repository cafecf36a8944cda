"""Shared by the `multi_linear` and `multi_linear_kv_write` tests: `fp64_formula` (multi_linear in fp64); for
multi_linear_kv_write, input cases (`Spec` -> `make_case`, the same values on CPU and CUDA), an fp64 formula
written independently of `custom_ops.linear.multi_linear_kv_write` (`fp64_kv`, `written_tokens`: einsum projections,
RMSNorm and a loop over the rotated pairs in float64, a plain Python walk over `cache_loc` / `commit_lens`), byte
views of the caches, the argument-error table (`BAD_CASES`) and the rules only the CUDA binding has
(`CUDA_ONLY_CASES`); for multi_linear, valid arguments (`multi_linear_case`) and its argument-error table
(`MULTI_LINEAR_BAD_INPUTS`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

import custom_ops  # noqa: F401  (registers torch.ops.dspark.*)


def fp64_formula(x, weights, starts, counts, biases):
    """The op's result in fp64, written independently of `multi_linear_reference` (used by the CPU, CUDA and
    kernel-emulation tests)."""
    blocks = []
    for w, s, c, b in zip(weights, starts, counts, biases, strict=True):
        y = x.double() @ w[s : s + c].double().T
        blocks.append(y if b is None else y + b[s : s + c].double())
    return torch.cat(blocks, dim=1)


def multi_linear_case(tokens=5, dtype=torch.float32, seed=0):
    """Valid `multi_linear` arguments (CPU, schema order): x [tokens, 24], three weights of 40, 16 and 9 rows used
    at rows [8, 24), [0, 16) and [2, 9), a bias for the last two."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 24, generator=gen).to(dtype)
    weights = [torch.randn(rows, 24, generator=gen).to(dtype) for rows in (40, 16, 9)]
    biases = [None, torch.randn(16, generator=gen).to(dtype), torch.randn(9, generator=gen).to(dtype)]
    return x, weights, [8, 0, 2], [16, 16, 7], biases


def multi_linear_bad_args(mutate) -> list:
    """`multi_linear_case()` as a list of arguments (lists copied) after `mutate(args)` changed it in place."""
    args = list(multi_linear_case())
    args[1:] = [list(a) for a in args[1:]]
    mutate(args)
    return args


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    """`t` on another device than the case's CPU tensors (the CUDA tests put it on the CPU, the rest on CUDA)."""
    return t.to("meta")


# (id, mutate(args) in place, error class, message regex, the argument the message names) of `multi_linear` on
# `multi_linear_bad_args`: tests/test_multi_linear.py and, through tests/bad_argument_cases.py, the Python checks
# against the CUDA binding.
MULTI_LINEAR_BAD_INPUTS = [
    ("x 1-D", lambda a: a.__setitem__(0, a[0][0]), ValueError, "x must be 2-D", "x"),
    ("x dtype", lambda a: a.__setitem__(0, a[0].int()), TypeError, "x must be bfloat16, float16 or float32", "x"),
    ("no weights", lambda a: a.__setitem__(1, []), ValueError, "at least one", "weights"),
    (
        "row_starts length",
        lambda a: a.__setitem__(2, [8, 0]),
        ValueError,
        r"row_starts must hold one entry per weight \(3",
        "row_starts",
    ),
    (
        "row_counts length",
        lambda a: a.__setitem__(3, [16, 16, 7, 1]),
        ValueError,
        "row_counts must hold one entry per weight",
        "row_counts",
    ),
    ("biases length", lambda a: a.__setitem__(4, a[4][:2]), ValueError, "biases must hold one entry", "biases"),
    (
        "row range past the rows",
        lambda a: a.__setitem__(3, [16, 17, 7]),
        ValueError,
        r"row_starts\[1\] = 0: rows \[0, 17\) of weights\[1\]",
        "row_starts[1]",
    ),
    (
        "row_starts negative",
        lambda a: a.__setitem__(2, [8, -1, 2]),
        ValueError,
        r"row_starts\[1\] = -1: rows \[-1, 15\) of weights\[1\]",
        "row_starts[1]",
    ),
    ("row_counts negative", lambda a: a.__setitem__(3, [16, -1, 7]), ValueError, "must be >= 0", "row_counts[1]"),
    ("weights dtype", lambda a: a[1].__setitem__(0, a[1][0].double()), TypeError, r"weights\[0\] dtype", "weights[0]"),
    ("weights K", lambda a: a[1].__setitem__(2, a[1][2][:, :5]), ValueError, r"weights\[2\] must be", "weights[2]"),
    ("weights 1-D", lambda a: a[1].__setitem__(1, a[1][1][0]), ValueError, r"weights\[1\] must be", "weights[1]"),
    (
        "weights device",
        lambda a: a[1].__setitem__(1, _on_meta(a[1][1])),
        ValueError,
        r"weights\[1\] is on",
        "weights[1]",
    ),
    ("biases shape", lambda a: a[4].__setitem__(1, a[4][1][:3]), ValueError, r"biases\[1\] must be", "biases[1]"),
    ("biases 2-D", lambda a: a[4].__setitem__(1, a[4][1][:, None]), ValueError, r"biases\[1\] must be", "biases[1]"),
    ("biases dtype", lambda a: a[4].__setitem__(2, a[4][2].double()), TypeError, r"biases\[2\] dtype", "biases[2]"),
    (
        "biases device",
        lambda a: a[4].__setitem__(1, _on_meta(a[4][1])),
        ValueError,
        r"biases\[1\] is on",
        "biases[1]",
    ),
]


kv_write_op = torch.ops.dspark.multi_linear_kv_write


EPS = (1e-6, 0.25, 0.0, 2.0, 1e-3)  # per-layer eps, cycled: a kernel using one layer's eps for all fails
NEGATIVE = (-1, -2, -(2**31), -7)  # negative slots (int32-safe), cycled
NEGATIVE_INT64 = -(2**40)
NAN = float("nan")


@dataclass(frozen=True)
class Spec:
    """One configuration of the op's inputs (see `make_case`)."""

    tokens: int = 7
    hidden: int = 40
    layers: int = 3
    heads: int = 2
    head_dim: int = 16
    slots: int = 48
    dtype: torch.dtype = torch.float32
    rot: int | None = 16  # rotary dim R; None: no RoPE (empty cos_sin_caches)
    neox: bool = True
    norm: str = "weight"  # "weight" (as x), "fp32-weight", "no-weight" (None), "off" (empty k_norm_eps)
    bias: tuple[bool, ...] = (True, False)  # per layer, cycled
    proj: str = "fused"  # "fused": K and V rows of one qkv weight; "separate": [kv, K] weights; "offset": extra rows
    q_heads: int = 0  # query heads in the fused weight (0: 2 * heads)
    weight_layout: str = "contiguous"  # "contiguous", "row-strided" (column slice of a wider tensor), "transposed"
    x_layout: str = "contiguous"  # "contiguous", "strided" (inner stride 2), "transposed", "offset", "row-strided",
    # "misaligned" (contiguous, 2 bytes past a 16-byte boundary for bf16/fp16)
    cache_layout: str = "separate"  # see CACHE_LAYOUTS
    pos_dtype: torch.dtype = torch.int64
    loc_dtype: torch.dtype = torch.int64
    window: int = 0  # 0: 1-D cache_loc; W > 0: cache_loc [T / W, W] with commit_lens
    commit: tuple[int, ...] = (1,)  # commit_lens pattern, cycled over the rows
    negative: tuple[int, ...] = ()  # tokens whose slot is negative (skipped)
    table_rows: int = 64  # rows of layer 0's cos/sin table (layer i has 5 * i more)
    table_form: str = "halves"  # "halves" [P, R], "pairs" [P, R/2, 2] (a complex table's real view), "frequencies"
    seed: int = 0  # of everything but the weights
    weight_seed: int = 0

    @property
    def kv(self) -> int:
        return self.heads * self.head_dim


@dataclass
class Case:
    """The op's arguments in schema order, plus the buffers the caches are views of (`views(bases)` rebuilds the
    cache lists from any tensors shaped like `bases`, e.g. boolean masks)."""

    spec: Spec
    args: dict
    bases: list[torch.Tensor]
    views: object = field(repr=False)

    def call(self, fn=kv_write_op) -> None:
        fn(*self.args.values())


def _embed(t: torch.Tensor, layout: str, device) -> torch.Tensor:
    """2-D `t` (CPU) with the same values in `layout` on `device`; padding is NaN (never read)."""
    rows, cols = t.shape
    if layout == "contiguous":
        return t.to(device)
    if layout == "transposed":
        return t.t().contiguous().to(device).t()
    if layout == "strided":
        base = torch.full((rows, 2 * cols), NAN, dtype=t.dtype)
        base[:, ::2] = t
        return base.to(device)[:, ::2]
    if layout == "row-strided":
        base = torch.full((rows, cols + 16), NAN, dtype=t.dtype)
        base[:, :cols] = t
        return base.to(device)[:, :cols]
    if layout == "offset":
        base = torch.full((rows + 2, cols + 8), NAN, dtype=t.dtype)
        base[1 : rows + 1, 8:] = t
        return base.to(device)[1 : rows + 1, 8:]
    if layout == "misaligned":  # contiguous, one element into its buffer: not 16-byte aligned
        base = torch.full((rows * cols + 1,), NAN, dtype=t.dtype)
        base[1:] = t.flatten()
        return base.to(device)[1:].view(rows, cols)
    raise AssertionError(layout)


def _cache_bases(layout: str, n: int, s: int, h: int, d: int) -> tuple[list[tuple[int, ...]], object]:
    """(shapes of the buffers, views(buffers) -> (k_caches, v_caches)) of a cache layout."""
    if layout == "separate":
        return [(s, h, d)] * (2 * n), lambda b: (list(b[:n]), list(b[n:]))
    if layout == "padded":  # slot 0 of the buffer unused, 8 unused elements after every head row
        return [(s + 2, h, d + 8)] * (2 * n), lambda b: tuple(
            [t[1 : s + 1, :, :d] for t in part] for part in (b[:n], b[n:])
        )
    if layout == "heads-major":  # [heads, S, D] buffers: slot stride D, head stride S * D
        return [(h, s, d)] * (2 * n), lambda b: tuple([t.transpose(0, 1) for t in part] for part in (b[:n], b[n:]))
    if layout == "inner-strided":  # every other element (CPU only: the CUDA op needs a unit inner stride)
        return [(s, h, 2 * d)] * (2 * n), lambda b: tuple([t[..., ::2] for t in part] for part in (b[:n], b[n:]))
    if layout == "interleaved":  # one [N, S, 2, heads, D] buffer: K and V of a slot side by side
        return [(n, s, 2, h, d)], lambda b: ([b[0][i, :, 0] for i in range(n)], [b[0][i, :, 1] for i in range(n)])
    if layout == "stacked":  # one [2, N, S, heads, D] buffer
        return [(2, n, s, h, d)], lambda b: ([b[0][0, i] for i in range(n)], [b[0][1, i] for i in range(n)])
    raise AssertionError(layout)


def poison(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values of magnitude ~1000 with every fifth element NaN: a row left unwritten is never close to K/V."""
    t = torch.randn(shape, generator=gen) * 1000
    t.view(-1)[::5] = NAN
    return t.to(dtype)


@functools.lru_cache(maxsize=4)
def _weight_values(spec: Spec) -> tuple:
    """(k_weights, k_row_starts, k_biases, v_weights, v_row_starts, v_biases) of `spec` on CPU, contiguous (a fused
    weight is one tensor in both lists). Values ~ N(0, 1/K), biases ~ N(0, 1/4)."""
    gen = torch.Generator().manual_seed(1000 + spec.weight_seed)
    kv, hidden, dtype = spec.kv, spec.hidden, spec.dtype

    def weight(rows: int) -> torch.Tensor:
        return (torch.randn(rows, hidden, generator=gen) / hidden**0.5).to(dtype)

    def bias(rows: int, i: int) -> torch.Tensor | None:
        return (0.5 * torch.randn(rows, generator=gen)).to(dtype) if spec.bias[i % len(spec.bias)] else None

    kw, ks, kb, vw, vs, vb = [], [], [], [], [], []
    for i in range(spec.layers):
        if spec.proj == "fused":
            q = (spec.q_heads or 2 * spec.heads) * spec.head_dim
            w, b = weight(q + 2 * kv), bias(q + 2 * kv, i)
            kw.append(w), ks.append(q), kb.append(b), vw.append(w), vs.append(q + kv), vb.append(b)
        elif spec.proj == "separate":
            kw.append(weight(kv)), ks.append(0), kb.append(bias(kv, i))
            vw.append(weight(kv)), vs.append(0), vb.append(bias(kv, i))
        else:  # "offset": the used rows in the middle of a larger weight
            kw.append(weight(kv + 5)), ks.append(3), kb.append(bias(kv + 5, i))
            vw.append(weight(kv + 2)), vs.append(1), vb.append(bias(kv + 2, i))
    return kw, ks, kb, vw, vs, vb


def _place_weights(values: tuple, layout: str, device: str) -> tuple:
    """`_weight_values` on `device` in `layout` (a tensor shared by both lists stays shared)."""
    placed: dict[int, torch.Tensor] = {}

    def place(t: torch.Tensor | None, embed: bool) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in placed:
            placed[id(t)] = _embed(t, layout, device) if embed else t.to(device)
        return placed[id(t)]

    kw, ks, kb, vw, vs, vb = values
    return (
        [place(w, True) for w in kw],
        list(ks),
        [place(b, False) for b in kb],
        [place(w, True) for w in vw],
        list(vs),
        [place(b, False) for b in vb],
    )


@functools.lru_cache(maxsize=8)
def _weights(spec: Spec, device: str) -> tuple:
    """The weights of `spec` on `device`, shared by the cases of one `weights_key` (tests never modify them)."""
    return _place_weights(_weight_values(spec), spec.weight_layout, device)


def weights_key(spec: Spec) -> Spec:
    """`spec` without the fields the weights do not depend on (the `_weights` cache key)."""
    return Spec(
        hidden=spec.hidden,
        layers=spec.layers,
        heads=spec.heads,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
        bias=spec.bias,
        proj=spec.proj,
        q_heads=spec.q_heads,
        weight_layout=spec.weight_layout,
        weight_seed=spec.weight_seed,
    )


def make_case(spec: Spec, device: str = "cpu", fresh_weights: bool = False) -> Case:
    """Fresh random inputs of `spec` on `device` (generated on CPU, so CPU and CUDA cases of one spec are equal):
    distinct slots, none of the last four when there is room (then `spec.negative` tokens made negative), positions
    inside every table, poisoned caches. `fresh_weights`: weights of their own (for tests that modify them)."""
    gen = torch.Generator().manual_seed(spec.seed)
    n, t, dtype = spec.layers, spec.tokens, spec.dtype
    x = _embed(torch.randn(t, spec.hidden, generator=gen).to(dtype), spec.x_layout, device)
    key = weights_key(spec)
    if fresh_weights:
        kw, ks, kb, vw, vs, vb = _place_weights(_weight_values.__wrapped__(key), spec.weight_layout, device)
    else:
        kw, ks, kb, vw, vs, vb = _weights(key, device)
    eps = [EPS[i % len(EPS)] for i in range(n)] if spec.norm != "off" else []
    norm_weights = []
    for _ in range(n):
        w = 1 + 0.5 * torch.randn(spec.head_dim, generator=gen)
        w = w.to(torch.float32 if spec.norm == "fp32-weight" else dtype).to(device)
        norm_weights.append(w if spec.norm in ("weight", "fp32-weight") else None)
    tables = []
    if spec.rot is not None:
        for i in range(n):  # arbitrary values, not unit cos/sin pairs: a swapped or misread entry shows
            rows = spec.table_rows + 5 * i
            if spec.table_form == "frequencies":  # [R/2], angles up to a few hundred radians at these positions
                table = 8.0 * torch.rand(spec.rot // 2, generator=gen) / (i + 1)
            elif spec.table_form == "pairs":
                table = 2.4 * torch.rand(rows, spec.rot // 2, 2, generator=gen) - 1.2
            else:
                table = 2.4 * torch.rand(rows, spec.rot, generator=gen) - 1.2
            tables.append(table.to(device))
    positions = torch.randint(0, spec.table_rows, (t,), generator=gen).to(spec.pos_dtype).to(device)
    assert spec.slots >= t
    usable = spec.slots - 4 if spec.slots - 4 >= t else spec.slots  # the last slots free: a wrapped -1 shows
    loc = torch.randperm(usable, generator=gen)[:t]
    for j, tok in enumerate(spec.negative):
        loc[tok] = NEGATIVE[j % len(NEGATIVE)] if j % 5 != 4 or spec.loc_dtype == torch.int32 else NEGATIVE_INT64
    commit_lens = None
    if spec.window:
        assert t % spec.window == 0
        loc = loc.view(t // spec.window, spec.window)
        rows = t // spec.window
        commit_lens = torch.tensor([spec.commit[b % len(spec.commit)] for b in range(rows)], dtype=spec.loc_dtype)
        commit_lens = commit_lens.to(device)
    shapes, views = _cache_bases(spec.cache_layout, n, spec.slots, spec.heads, spec.head_dim)
    bases = [poison(shape, dtype, gen).to(device) for shape in shapes]
    k_caches, v_caches = views(bases)
    args = dict(
        x=x,
        k_weights=list(kw),
        k_row_starts=list(ks),
        k_biases=list(kb),
        v_weights=list(vw),
        v_row_starts=list(vs),
        v_biases=list(vb),
        k_norm_weights=norm_weights,
        k_norm_eps=eps,
        cos_sin_caches=tables,
        positions=positions,
        is_neox=spec.neox,
        k_caches=k_caches,
        v_caches=v_caches,
        cache_loc=loc.to(spec.loc_dtype).to(device),
        commit_lens=commit_lens,
        num_kv_heads=spec.heads,
        head_dim=spec.head_dim,
    )
    return Case(spec, args, bases, views)


def counted_from_the_end(case: Case, every: int = 3) -> Case:
    """`case` with its own copy of the caches, every `every`-th slot `l >= 0` given as `l - S` and position `p` as
    `p - P` (P: rows of the shortest table), and `wrap_negative=True`: the same writes, addressed as Python indexing
    does."""
    args = dict(case.args)
    slots = args["k_caches"][0].shape[0]
    loc = args["cache_loc"].clone()
    flat = loc.view(-1)
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[::every] = True
    flat[chosen & (flat >= 0)] -= slots
    args["cache_loc"] = loc
    if args["cos_sin_caches"] and args["cos_sin_caches"][0].dim() > 1:  # frequencies: positions are angles
        rows = min(t.shape[0] for t in args["cos_sin_caches"])
        positions = args["positions"].clone()
        positions[1::every] -= rows
        args["positions"] = positions
    bases = [b.clone() for b in case.bases]
    args["k_caches"], args["v_caches"] = case.views(bases)
    args["wrap_negative"] = True
    return Case(case.spec, args, bases, case.views)


def _fp64_rope(k: torch.Tensor, rows: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate pairs of the first R = rows.shape[1] dims of `k [T, heads, D]`; `rows [T, R]` = [cos | sin] halves."""
    half = rows.shape[1] // 2
    out = k.clone()
    for j in range(half):
        a, b = (j, j + half) if neox else (2 * j, 2 * j + 1)
        c, s = rows[:, None, j], rows[:, None, half + j]
        out[..., a] = k[..., a] * c - k[..., b] * s
        out[..., b] = k[..., b] * c + k[..., a] * s
    return out


def _fp64_factors(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`[T, R]` [cos | sin] rows in float64 of a table of any form (halves `[P, R]`, pairs `[P, R/2, 2]`,
    frequencies `[R/2]`: the angle is the fp32 product the op computes, its cos/sin taken in float64)."""
    table, pos = table.cpu(), positions.cpu()
    if table.dim() == 1:
        angles = (pos.float()[:, None] * table[None, :]).double()
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)
    rows = table.double()[pos.long()]
    return torch.cat([rows[..., 0], rows[..., 1]], dim=1) if table.dim() == 3 else rows


def fp64_kv(args: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (K, V) `[T, heads, head_dim]` in float64 for every token, from the op's formula."""
    x = args["x"].cpu().double()
    heads, dim = args["num_kv_heads"], args["head_dim"]
    kv = heads * dim
    out = []
    for i in range(len(args["k_weights"])):
        kv_pair = []
        for kind in ("k", "v"):
            w, start, b = args[f"{kind}_weights"][i], args[f"{kind}_row_starts"][i], args[f"{kind}_biases"][i]
            y = torch.einsum("tc,rc->tr", x, w[start : start + kv].cpu().double())
            if b is not None:
                y = y + b[start : start + kv].cpu().double()
            kv_pair.append(y.reshape(-1, heads, dim))
        k, v = kv_pair
        if args["k_norm_eps"]:
            k = k / torch.sqrt((k * k).sum(-1, keepdim=True) / dim + args["k_norm_eps"][i])
            if args["k_norm_weights"][i] is not None:
                k = k * args["k_norm_weights"][i].cpu().double()
        if args["cos_sin_caches"]:
            k = _fp64_rope(k, _fp64_factors(args["cos_sin_caches"][i], args["positions"]), args["is_neox"])
        out.append((k, v))
    return out


def written_tokens(args: dict) -> list[tuple[int, int]]:
    """(token, slot) of every token the op writes: slot >= 0 and, for [B, W] slots, column < commit_lens[row]."""
    loc = args["cache_loc"].cpu()
    width = loc.shape[1] if loc.dim() == 2 else None
    commit = args["commit_lens"].cpu().tolist() if args["commit_lens"] is not None else None
    out = []
    for t, slot in enumerate(loc.reshape(-1).tolist()):
        if slot >= 0 and (commit is None or t % width < commit[t // width]):
            out.append((t, slot))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of `t` on CPU (NaN poison compares equal to itself)."""
    return (
        t.detach()
        .cpu()
        .view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        .clone()
    )


def written_masks(case: Case, written: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Boolean masks shaped like `case.bases`: True on the elements of the rows the op writes."""
    masks = [torch.zeros(b.shape, dtype=torch.bool) for b in case.bases]
    k_masks, v_masks = case.views(masks)
    for km, vm in zip(k_masks, v_masks, strict=True):
        for _, slot in written:
            km[slot] = True
            vm[slot] = True
    return masks


CACHE_LAYOUTS = ("separate", "padded", "heads-major", "inner-strided", "interleaved", "stacked")


TOLERANCE = {  # (rtol, atol / max |expected|): fp32 math, then one rounding to the cache dtype (half an ulp)
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2**-8 + 2**-14, 1e-4),
    torch.float16: (2**-11 + 2**-17, 1e-4),
}


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol_scale: float) -> None:
    assert not got.isnan().any(), "a written row still holds poison"
    if want.numel():
        atol = atol_scale * want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def run_and_check(case: Case) -> None:
    """Run the op on `case`: written rows match the fp64 formula, every other byte of the cache buffers is
    unchanged."""
    before = [bits(b) for b in case.bases]
    case.call()
    args = case.args
    written = written_tokens(args)
    for base, mask, old in zip(case.bases, written_masks(case, written), before, strict=True):
        assert torch.equal(bits(base)[~mask], old[~mask]), "a byte outside the written rows changed"
    rtol, atol_scale = TOLERANCE[case.spec.dtype]
    tokens = [t for t, _ in written]
    slots = torch.tensor([s for _, s in written], dtype=torch.long)
    for i, (k64, v64) in enumerate(fp64_kv(args)):
        for cache, want in ((args["k_caches"][i], k64), (args["v_caches"][i], v64)):
            assert_rows_close(cache.cpu()[slots], want[tokens], rtol, atol_scale)


BAD = Spec(tokens=6, layers=2, hidden=24, rot=8)


def _like(a: dict, *shape, dtype=torch.float32) -> torch.Tensor:
    """Fresh random values on the case's device."""
    return torch.randn(*shape).to(dtype).to(a["x"].device)


def _elsewhere(t: torch.Tensor) -> torch.Tensor:
    """`t` on another device than the case's (meta for a CPU case, CPU for a CUDA one)."""
    return t.to("meta" if t.device.type == "cpu" else "cpu")


def _alias(t: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    """A tensor of `shape` over the first elements of `t`'s memory (`t` contiguous)."""
    flat = t.reshape(-1) if dtype is None else t.reshape(-1).view(dtype)
    return flat[: torch.Size(shape).numel()].view(shape)


def _cache_loc_over_cache_bytes(a: dict) -> dict:
    """k_caches[0] and an int64 cache_loc sharing their first bytes, at a byte offset where their storage offsets
    (counted in elements of different sizes) differ."""
    cache, loc = a["k_caches"][0], a["cache_loc"]
    pad, size = 64, cache.numel() * cache.element_size()
    buf = torch.zeros(pad + size, dtype=torch.uint8, device=cache.device)
    shared_cache = buf[pad:].view(cache.dtype).view(cache.shape)
    shared_cache.copy_(cache)
    shared_loc = buf[pad : pad + 8 * loc.numel()].view(torch.int64).view(loc.shape)
    shared_loc.copy_(loc)
    return {"k_caches": [shared_cache, *a["k_caches"][1:]], "cache_loc": shared_loc}


def _entry(name: str, i: int, value):
    """change(args): list argument `name` with entry i replaced by `value` (or `value(args)`)."""

    def change(a):
        values = list(a[name])
        values[i] = value(a) if callable(value) else value
        return {name: values}

    return change


def _cache(a: dict, *shape, dtype=None) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype or a["x"].dtype, device=a["x"].device)


def _shifted_caches(a: dict) -> dict:
    """K and V caches of layer 0 one slot apart in one buffer: V's slot s is K's slot s + 1."""
    s = BAD
    buf = _cache(a, s.slots + 1, s.heads, s.head_dim)
    return {"k_caches": [buf[:-1], a["k_caches"][1]], "v_caches": [buf[1:], a["v_caches"][1]]}


def _weight_in_cache(a: dict) -> dict:
    """Layer 0's K weight is a [kv, K] view of v_caches[1]."""
    w = _alias(a["v_caches"][1], (BAD.kv, BAD.hidden))
    return {"k_weights": [w, a["k_weights"][1]], "k_row_starts": [0, a["k_row_starts"][1]], "k_biases": [None, None]}


def _rows(a: dict, b: int, w: int, commit=None) -> dict:
    out = {
        "cache_loc": a["cache_loc"][: b * w].reshape(b, w)
        if b * w == BAD.tokens
        else _cache(a, b, w, dtype=torch.int64)
    }
    if commit is not None:
        out["commit_lens"] = commit
    return out


def _bad_cases():
    """(id, change(args) -> {arg: new value}, error class, regex the message must start with after the op's
    prefix: the argument's name). Device-agnostic: the CUDA tests run the same table."""
    s = BAD
    kv, d, slots, heads = s.kv, s.head_dim, s.slots, s.heads
    return [
        ("x 3-D", lambda a: {"x": a["x"][None]}, ValueError, "x "),
        ("x int", lambda a: {"x": a["x"].to(torch.int32)}, TypeError, "x "),
        ("x fp64", lambda a: {"x": a["x"].double()}, TypeError, "x "),
        ("no layers", lambda a: {"k_weights": []}, ValueError, "k_weights "),
        ("k_row_starts length", lambda a: {"k_row_starts": a["k_row_starts"][:1]}, ValueError, "k_row_starts "),
        ("k_biases length", lambda a: {"k_biases": [*a["k_biases"], None]}, ValueError, "k_biases "),
        ("v_weights length", lambda a: {"v_weights": a["v_weights"][:1]}, ValueError, "v_weights "),
        ("v_row_starts length", lambda a: {"v_row_starts": []}, ValueError, "v_row_starts "),
        ("v_biases length", lambda a: {"v_biases": [None]}, ValueError, "v_biases "),
        ("k_norm_weights length", lambda a: {"k_norm_weights": a["k_norm_weights"][:1]}, ValueError, "k_norm_weights "),
        ("k_norm_eps length", lambda a: {"k_norm_eps": [1e-6]}, ValueError, "k_norm_eps "),
        ("cos_sin_caches length", lambda a: {"cos_sin_caches": a["cos_sin_caches"][:1]}, ValueError, "cos_sin_caches "),
        ("k_caches length", lambda a: {"k_caches": a["k_caches"][:1]}, ValueError, "k_caches "),
        (
            "v_caches length",
            lambda a: {"v_caches": [*a["v_caches"], _cache(a, slots, heads, d)]},
            ValueError,
            "v_caches ",
        ),
        ("k_row_starts negative", _entry("k_row_starts", 1, -1), ValueError, r"k_row_starts\[1\] "),
        (
            "k_row_starts past the rows",
            _entry("k_row_starts", 0, lambda a: a["k_weights"][0].shape[0] - kv + 1),
            ValueError,
            r"k_row_starts\[0\] ",
        ),
        ("v_row_starts past the rows", _entry("v_row_starts", 1, 10**6), ValueError, r"v_row_starts\[1\] "),
        ("k_weights 1-D", _entry("k_weights", 0, lambda a: a["k_weights"][0][0]), ValueError, r"k_weights\[0\] "),
        ("k_weights K", _entry("k_weights", 1, lambda a: a["k_weights"][1][:, :-1]), ValueError, r"k_weights\[1\] "),
        ("v_weights dtype", _entry("v_weights", 0, lambda a: a["v_weights"][0].half()), TypeError, r"v_weights\[0\] "),
        (
            "v_weights device",
            _entry("v_weights", 1, lambda a: _elsewhere(a["v_weights"][1])),
            ValueError,
            r"v_weights\[1\] ",
        ),
        ("k_biases shape", _entry("k_biases", 0, lambda a: a["k_biases"][0][:-1]), ValueError, r"k_biases\[0\] "),
        ("k_biases dtype", _entry("k_biases", 0, lambda a: a["k_biases"][0].double()), TypeError, r"k_biases\[0\] "),
        (
            "v_biases device",
            _entry("v_biases", 0, lambda a: _elsewhere(a["v_biases"][0])),
            ValueError,
            r"v_biases\[0\] ",
        ),
        (
            "k_norm_weights shape",
            _entry("k_norm_weights", 1, lambda a: _like(a, d + 1)),
            ValueError,
            r"k_norm_weights\[1\] ",
        ),
        (
            "k_norm_weights dtype",
            _entry("k_norm_weights", 0, lambda a: _like(a, d, dtype=torch.float64)),
            TypeError,
            r"k_norm_weights\[0\] ",
        ),
        (
            "k_norm_weights device",
            _entry("k_norm_weights", 0, lambda a: _elsewhere(a["k_norm_weights"][0])),
            ValueError,
            r"k_norm_weights\[0\] ",
        ),
        ("k_norm_weights without eps", lambda a: {"k_norm_eps": []}, ValueError, r"k_norm_weights\[0\] "),
        ("k_norm_eps negative", lambda a: {"k_norm_eps": [1e-6, -1e-6]}, ValueError, r"k_norm_eps\[1\] "),
        ("k_norm_eps nan", lambda a: {"k_norm_eps": [NAN, 1e-6]}, ValueError, r"k_norm_eps\[0\] "),
        ("k_norm_eps inf", lambda a: {"k_norm_eps": [1e-6, float("inf")]}, ValueError, r"k_norm_eps\[1\] "),
        (
            "cos_sin_caches 4-D",
            _entry("cos_sin_caches", 0, lambda a: _like(a, 9, 2, 2, 2)),
            ValueError,
            r"cos_sin_caches\[0\] must be \[P, R\]",
        ),
        (
            "cos_sin_caches pairs of 3",
            lambda a: {"cos_sin_caches": [_like(a, 9, 4, 3)] * 2},
            ValueError,
            r"cos_sin_caches\[0\] must be \[P, R\]",
        ),
        (
            "cos_sin_caches forms mixed",
            _entry("cos_sin_caches", 1, lambda a: _like(a, a["cos_sin_caches"][0].shape[1] // 2)),
            ValueError,
            r"cos_sin_caches\[1\] is a \[R/2\] table \(frequencies\), layer 0's a \[P, R\] table",
        ),
        (
            "frequencies rotate more than head_dim",
            lambda a: {"cos_sin_caches": [_like(a, d // 2 + 1)] * 2},
            ValueError,
            r"cos_sin_caches\[0\] ",
        ),
        (
            "pairs rotary dim per layer",
            lambda a: {"cos_sin_caches": [_like(a, 9, 2, 2), _like(a, 9, 3, 2)]},
            ValueError,
            r"cos_sin_caches\[1\] ",
        ),
        (
            "cos_sin_caches fp64",
            _entry("cos_sin_caches", 1, lambda a: a["cos_sin_caches"][1].double()),
            TypeError,
            r"cos_sin_caches\[1\] ",
        ),
        (
            "cos_sin_caches bf16",
            _entry("cos_sin_caches", 0, lambda a: a["cos_sin_caches"][0].bfloat16()),
            TypeError,
            r"cos_sin_caches\[0\] ",
        ),
        (
            "cos_sin_caches device",
            _entry("cos_sin_caches", 1, lambda a: _elsewhere(a["cos_sin_caches"][1])),
            ValueError,
            r"cos_sin_caches\[1\] ",
        ),
        (
            "rotary dim odd",
            lambda a: {"cos_sin_caches": [c[:, :7] for c in a["cos_sin_caches"]]},
            ValueError,
            r"cos_sin_caches\[0\] ",
        ),
        (
            "rotary dim > head_dim",
            lambda a: {"cos_sin_caches": [_like(a, 9, d + 2)] * 2},
            ValueError,
            r"cos_sin_caches\[0\] ",
        ),
        ("rotary dim 0", lambda a: {"cos_sin_caches": [_like(a, 9, 0)] * 2}, ValueError, r"cos_sin_caches\[0\] "),
        (
            "rotary dim per layer",
            _entry("cos_sin_caches", 1, lambda a: _like(a, 64, 4)),
            ValueError,
            r"cos_sin_caches\[1\] ",
        ),
        ("positions length", lambda a: {"positions": a["positions"][:-1]}, ValueError, "positions "),
        ("positions 2-D", lambda a: {"positions": a["positions"][:, None]}, ValueError, "positions "),
        ("positions float", lambda a: {"positions": a["positions"].float()}, TypeError, "positions "),
        ("positions int16", lambda a: {"positions": a["positions"].to(torch.int16)}, TypeError, "positions "),
        ("positions device", lambda a: {"positions": _elsewhere(a["positions"])}, ValueError, "positions "),
        (
            "k_caches heads",
            _entry("k_caches", 1, lambda a: _cache(a, slots, heads + 1, d)),
            ValueError,
            r"k_caches\[1\] ",
        ),
        (
            "v_caches slots",
            _entry("v_caches", 0, lambda a: _cache(a, slots - 1, heads, d)),
            ValueError,
            r"v_caches\[0\] ",
        ),
        ("k_caches 2-D", _entry("k_caches", 0, lambda a: _cache(a, slots, kv)), ValueError, r"k_caches\[0\] "),
        (
            "v_caches dtype",
            _entry("v_caches", 1, lambda a: _cache(a, slots, heads, d, dtype=torch.float64)),
            TypeError,
            r"v_caches\[1\] ",
        ),
        (
            "k_caches device",
            _entry("k_caches", 1, lambda a: _elsewhere(a["k_caches"][1])),
            ValueError,
            r"k_caches\[1\] ",
        ),
        (
            "k_caches broadcast",
            _entry("k_caches", 0, lambda a: _cache(a, 1, heads, d).expand(slots, -1, -1)),
            ValueError,
            r"k_caches\[0\] must not overlap itself",
        ),
        (
            "v_caches heads overlap",
            _entry("v_caches", 1, lambda a: _cache(a, slots * d + 8).as_strided((slots, heads, d), (d, 8, 1))),
            ValueError,
            r"v_caches\[1\] must not overlap itself",
        ),
        (
            "v_caches is k_caches",
            _entry("v_caches", 1, lambda a: a["k_caches"][0]),
            ValueError,
            r"v_caches\[1\] shares memory with k_caches\[0\]",
        ),
        (
            "k_caches twice",
            _entry("k_caches", 1, lambda a: a["k_caches"][0]),
            ValueError,
            r"k_caches\[1\] shares memory with k_caches\[0\]",
        ),
        ("caches one slot apart", _shifted_caches, ValueError, r"v_caches\[0\] shares memory with k_caches\[0\]"),
        (
            "x inside a cache",
            lambda a: {"x": _alias(a["k_caches"][1], a["x"].shape)},
            ValueError,
            r"k_caches\[1\] shares memory with x",
        ),
        ("weight inside a cache", _weight_in_cache, ValueError, r"v_caches\[1\] shares memory with k_weights\[0\]"),
        (
            "cache_loc inside a cache",
            lambda a: {"cache_loc": _alias(a["k_caches"][0], (s.tokens,), torch.int32)},
            ValueError,
            r"k_caches\[0\] shares memory with cache_loc",
        ),
        (
            "cache_loc int64 over a cache's bytes",
            _cache_loc_over_cache_bytes,
            ValueError,
            r"k_caches\[0\] shares memory with cache_loc",
        ),
        ("cache_loc float", lambda a: {"cache_loc": a["cache_loc"].float()}, TypeError, "cache_loc "),
        ("cache_loc uint8", lambda a: {"cache_loc": a["cache_loc"].to(torch.uint8)}, TypeError, "cache_loc "),
        ("cache_loc length", lambda a: {"cache_loc": a["cache_loc"][:-1]}, ValueError, "cache_loc "),
        ("cache_loc 3-D", lambda a: {"cache_loc": a["cache_loc"].view(1, 2, 3)}, ValueError, "cache_loc "),
        ("cache_loc device", lambda a: {"cache_loc": _elsewhere(a["cache_loc"])}, ValueError, "cache_loc "),
        ("commit_lens with 1-D cache_loc", lambda a: {"commit_lens": a["cache_loc"][:1]}, ValueError, "commit_lens "),
        ("[B, W] cache_loc without commit_lens", lambda a: _rows(a, 2, 3), ValueError, "commit_lens "),
        ("[B, W] cache_loc, B * W != T", lambda a: _rows(a, 2, 2, a["cache_loc"][:2]), ValueError, "cache_loc "),
        ("commit_lens shape", lambda a: _rows(a, 2, 3, a["cache_loc"][:3]), ValueError, "commit_lens "),
        ("commit_lens float", lambda a: _rows(a, 2, 3, a["cache_loc"][:2].float()), TypeError, "commit_lens "),
        ("commit_lens device", lambda a: _rows(a, 2, 3, _elsewhere(a["cache_loc"][:2])), ValueError, "commit_lens "),
        ("num_kv_heads 0", lambda a: {"num_kv_heads": 0}, ValueError, "num_kv_heads "),
        ("num_kv_heads vs caches", lambda a: {"num_kv_heads": heads - 1}, ValueError, r"k_caches\[0\] "),
        ("head_dim negative", lambda a: {"head_dim": -d}, ValueError, "head_dim "),
    ]


BAD_CASES = _bad_cases()


def cache_bits(args: dict) -> list[torch.Tensor]:
    """`bits` of every cache argument that holds data (not the meta ones of the device cases)."""
    return [bits(c) for c in (*args["k_caches"], *args["v_caches"]) if c.device.type != "meta"]


CUDA_ONLY = Spec(tokens=6, layers=2, hidden=64, heads=2, head_dim=16, rot=8, dtype=torch.bfloat16)


def _cache_view(a: dict, shape, strides, offset=0) -> torch.Tensor:
    buf = torch.zeros(offset + 4096, dtype=a["x"].dtype, device=a["x"].device)
    return buf.as_strided(shape, strides, offset)


def _pairs_apart(rows: int, rot: int, device: torch.device) -> torch.Tensor:
    """A `[rows, R/2, 2]` pairs table whose cos and sin lie in two separate planes (strides `(R, 1, R/2)`)."""
    return torch.rand(rows, 2, rot // 2).transpose(1, 2).to(device)


def _cuda_only_cases():
    """(id, spec, change(args) or None, error class, a word the message must contain): inputs the CPU op accepts
    and the CUDA op rejects (csrc/multi_linear_kv_write.cu, check_cuda_layout and kv_table)."""
    s = CUDA_ONLY
    shape = (s.slots, s.heads, s.head_dim)
    d = s.head_dim

    def entry(name, i, make):
        def change(a):
            values = list(a[name])
            values[i] = make(a)
            return {name: values}

        return change

    return [
        ("fp32 x", replace(s, dtype=torch.float32), None, TypeError, "x"),
        ("K not a multiple of 8", replace(s, hidden=60), None, ValueError, "x"),
        ("head_dim not a multiple of 8", replace(s, head_dim=12), None, ValueError, "head_dim"),
        ("head_dim > 256", replace(s, heads=1, head_dim=264, rot=8), None, ValueError, "head_dim"),
        (
            "cache inner stride 2",
            s,
            entry("k_caches", 1, lambda a: _cache_view(a, shape, (2 * s.heads * d, 2 * d, 2))),
            ValueError,
            r"k_caches\[1\]",
        ),
        (
            "cache storage offset not 16-byte aligned",
            s,
            entry("v_caches", 0, lambda a: _cache_view(a, shape, (s.heads * d, d, 1), offset=1)),
            ValueError,
            r"v_caches\[0\]",
        ),
        (
            "cache head stride not 16-byte aligned",
            s,
            entry("k_caches", 0, lambda a: _cache_view(a, shape, (s.heads * (d + 4), d + 4, 1))),
            ValueError,
            r"k_caches\[0\]",
        ),
        (
            "cache slot stride not 16-byte aligned",
            s,
            entry("v_caches", 1, lambda a: _cache_view(a, shape, (s.heads * d + 4, d, 1))),
            ValueError,
            r"v_caches\[1\]",
        ),
        (
            "norm weight not contiguous",
            s,
            entry("k_norm_weights", 1, lambda a: (1 + torch.rand(2 * d)).to(a["x"].dtype).to(a["x"].device)[::2]),
            ValueError,
            r"k_norm_weights\[1\]",
        ),
        (
            "cos_sin table inner stride 2",
            s,
            entry("cos_sin_caches", 0, lambda a: torch.rand(s.table_rows, 2 * s.rot).to(a["x"].device)[:, ::2]),
            ValueError,
            r"cos_sin_caches\[0\]",
        ),
        (
            "pairs table with cos and sin apart",
            replace(s, table_form="pairs"),
            lambda a: {"cos_sin_caches": [_pairs_apart(s.table_rows, s.rot, a["x"].device)] * 2},
            ValueError,
            r"cos_sin_caches\[0\] must have a unit inner stride on CUDA \(a \[P, R/2, 2\] table",
        ),
        (
            "frequencies strided",
            replace(s, table_form="frequencies"),
            lambda a: {"cos_sin_caches": [torch.rand(s.rot).to(a["x"].device)[::2]] * 2},
            ValueError,
            r"cos_sin_caches\[0\] must have a unit inner stride on CUDA",
        ),
    ]


CUDA_ONLY_CASES = _cuda_only_cases()
