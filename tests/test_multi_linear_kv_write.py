"""dspark::multi_linear_kv_write on CPU: the op against an fp64 formula written here, untouched cache bytes, errors.

The fp64 formula (`fp64_kv`, `written_tokens`) is independent of `custom_ops.multi_linear_kv_write`: einsum
projections, RMSNorm and a loop over the rotated pairs in float64, and a plain Python walk over `cache_loc` /
`commit_lens`. Covered: neox and GPT-J, partial and full rotary, no RoPE, per-layer tables, biases (mixed per
layer), per-layer eps, norm with / without weight / off, index dtypes, 1-D and `[B, W]` + `commit_lens` slots,
negative slots, K/V from one fused weight or from separate ones, strided and transposed `x` and weights, strided and
aliasing-but-disjoint caches, T = 0 / 1 / odd, one and several layers, fp32 / bf16 / fp16. Caches are poisoned
(random values and NaNs): written rows must be fully rewritten, every other byte of the cache buffers must stay.
Then the argument table (CPU and fake impl, nothing modified), the index-value errors, opcheck, torch.compile
(caches mutated in place, no copy) and parity with `dspark_fx.reference_draft.DraftKVWriter`.

`tests/test_multi_linear_kv_write_cuda.py` reuses `Spec`, `make_case` and the fp64 formula for the CUDA kernel.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace

import pytest
import torch
from helpers import draft_inputs, small_config
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

import custom_ops  # noqa: F401  (registers torch.ops.dspark.*)
from custom_ops.multi_linear_kv_write import multi_linear_kv_write_reference
from dspark_fx.reference_draft import DraftKVWriter

op = torch.ops.dspark.multi_linear_kv_write

EPS = (1e-6, 0.25, 0.0, 2.0, 1e-3)  # per-layer eps, cycled: a kernel using one layer's eps for all fails
NEGATIVE = (-1, -2, -(2**31), -7)  # negative slots (int32-safe), cycled
NEGATIVE_INT64 = -(2**40)
NAN = float("nan")


# ---------------------------------------------------------------------------------------------- cases


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
    x_layout: str = "contiguous"  # "contiguous", "strided" (inner stride 2), "transposed", "offset", "row-strided"
    cache_layout: str = "separate"  # see CACHE_LAYOUTS
    pos_dtype: torch.dtype = torch.int64
    loc_dtype: torch.dtype = torch.int64
    window: int = 0  # 0: 1-D cache_loc; W > 0: cache_loc [T / W, W] with commit_lens
    commit: tuple[int, ...] = (1,)  # commit_lens pattern, cycled over the rows
    negative: tuple[int, ...] = ()  # tokens whose slot is negative (skipped)
    table_rows: int = 64  # rows of layer 0's cos/sin table (layer i has 5 * i more)
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

    def call(self, fn=op) -> None:
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


CACHE_LAYOUTS = ("separate", "padded", "heads-major", "inner-strided", "interleaved", "stacked")


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
            tables.append((2.4 * torch.rand(rows, spec.rot, generator=gen) - 1.2).to(device))
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


# ---------------------------------------------------------------------------------------------- fp64 formula


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
            table = args["cos_sin_caches"][i].cpu().double()
            k = _fp64_rope(k, table[args["positions"].cpu().long()], args["is_neox"])
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


def check_result(case: Case, before: list[torch.Tensor], tolerance=None) -> None:
    """After the op ran on `case` (caches `before` it: `bits` of the bases): written rows match the fp64 formula,
    every other byte of the cache buffers is unchanged."""
    args = case.args
    written = written_tokens(args)
    for base, mask, old in zip(case.bases, written_masks(case, written), before, strict=True):
        assert torch.equal(bits(base)[~mask], old[~mask]), "a byte outside the written rows changed"
    rtol, atol_scale = tolerance or TOLERANCE[case.spec.dtype]
    tokens = [t for t, _ in written]
    slots = torch.tensor([s for _, s in written], dtype=torch.long)
    for i, (k64, v64) in enumerate(fp64_kv(args)):
        for cache, want in ((args["k_caches"][i], k64), (args["v_caches"][i], v64)):
            assert_rows_close(cache.cpu()[slots], want[tokens], rtol, atol_scale)


def run_and_check(case: Case) -> None:
    before = [bits(b) for b in case.bases]
    case.call()
    check_result(case, before)


# ---------------------------------------------------------------------------------------------- fp64 parity


CONFIGS = {
    "default": Spec(),
    "gptj": Spec(neox=False),
    "partial neox": Spec(rot=6),
    "partial gptj": Spec(rot=6, neox=False),
    "no rope": Spec(rot=None),
    "norm with fp32 weight": Spec(norm="fp32-weight", neox=False),
    "norm without weight": Spec(norm="no-weight"),
    "no norm": Spec(norm="off", neox=False),
    "no norm, no rope": Spec(norm="off", rot=None),
    "all biases": Spec(bias=(True,)),
    "no biases": Spec(bias=(False,), rot=8, neox=False),
    "separate weights": Spec(proj="separate", bias=(False, True)),
    "row offsets": Spec(proj="offset", bias=(True, True, False)),
    "int32 indices": Spec(pos_dtype=torch.int32, loc_dtype=torch.int32, neox=False),
    "int32 positions": Spec(pos_dtype=torch.int32, rot=10),
    "int32 slots": Spec(loc_dtype=torch.int32),
    "negative slots": Spec(negative=(0, 3, 6), neox=False),
    "int64 huge negative slot": Spec(tokens=9, negative=(0, 1, 2, 3, 8)),
    "all slots negative": Spec(negative=tuple(range(7))),
    "commit": Spec(tokens=12, window=4, commit=(2, 0, 7)),
    "commit int32, per row": Spec(tokens=16, window=4, commit=(4, 1, 3, -1), loc_dtype=torch.int32, neox=False),
    "commit + negative slots": Spec(tokens=12, window=3, commit=(3, 2, 9, 1), negative=(0, 4, 11), rot=6),
    "commit all zero": Spec(tokens=8, window=4, commit=(0,)),
    "commit width 1": Spec(tokens=5, window=1, commit=(1, 0)),
    "T = 0": Spec(tokens=0),
    "T = 0 commit": Spec(tokens=0, window=4),
    "T = 1": Spec(tokens=1, neox=False),
    "T = 1 commit": Spec(tokens=1, window=1, commit=(1,)),
    "odd T": Spec(tokens=13, slots=20),
    "one layer": Spec(layers=1, rot=4),
    "five layers": Spec(layers=5, bias=(True, False, False), neox=False, rot=12),
    "head_dim 64": Spec(heads=1, head_dim=64, hidden=24, rot=32, layers=2),
    "head_dim 128": Spec(heads=1, head_dim=128, hidden=16, rot=64, layers=2, neox=False),
    "odd head_dim": Spec(head_dim=15, rot=None),
    "K = 1": Spec(hidden=1),
    "strided x": Spec(x_layout="strided"),
    "transposed x": Spec(x_layout="transposed", neox=False),
    "offset x": Spec(x_layout="offset", proj="separate"),
    "row-strided weights": Spec(weight_layout="row-strided"),
    "transposed weights": Spec(weight_layout="transposed", proj="separate", neox=False),
    "transposed fused weight": Spec(weight_layout="transposed", rot=6),
    **{f"{layout} caches": Spec(cache_layout=layout, tokens=9) for layout in CACHE_LAYOUTS[1:]},
    "everything strided": Spec(
        tokens=15,
        window=5,
        commit=(5, 2, 0),
        negative=(1, 6),
        neox=False,
        rot=6,
        x_layout="strided",
        weight_layout="row-strided",
        cache_layout="interleaved",
        pos_dtype=torch.int32,
        loc_dtype=torch.int32,
        bias=(False, True, True),
        norm="fp32-weight",
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_fp64_formula(name, dtype):
    run_and_check(make_case(replace(CONFIGS[name], dtype=dtype)))


def test_reference_is_the_registered_cpu_kernel():
    spec = CONFIGS["everything strided"]
    a, b = make_case(spec), make_case(spec)
    a.call()
    b.call(multi_linear_kv_write_reference)
    for x, y in zip(a.bases, b.bases, strict=True):
        assert torch.equal(bits(x), bits(y))


def test_every_written_row_and_nothing_else():
    """Sanity of the test itself: the masks cover exactly the rows of the written tokens, and a case writes some."""
    case = make_case(CONFIGS["commit + negative slots"])
    written = written_tokens(case.args)
    assert 0 < len(written) < case.spec.tokens
    masks = written_masks(case, written)
    per_slot = case.spec.kv * 2 * case.spec.layers
    assert sum(int(m.sum()) for m in masks) == len(written) * per_slot


def test_duplicate_slots_leave_one_tokens_row():
    """Two written tokens addressing one slot: the slot holds one of the two tokens' rows."""
    case = make_case(Spec(tokens=6, neox=False))
    case.args["cache_loc"][4] = case.args["cache_loc"][1]
    case.call()
    slot = int(case.args["cache_loc"][1])
    for i, (k64, v64) in enumerate(fp64_kv(case.args)):
        for cache, want in ((case.args["k_caches"][i], k64), (case.args["v_caches"][i], v64)):
            got = cache[slot].double()
            assert any(torch.allclose(got, want[t], rtol=1e-5, atol=1e-5) for t in (1, 4))


def test_in_place_weight_update_is_seen():
    case = make_case(Spec(proj="separate", bias=(False,), rot=None, norm="off"), fresh_weights=True)
    case.call()
    slot = int(case.args["cache_loc"][0])
    before = case.args["v_caches"][1][slot].clone()
    with torch.no_grad():
        case.args["v_weights"][1].mul_(-2)
    case.call()
    torch.testing.assert_close(case.args["v_caches"][1][slot], -2 * before, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- DraftKVWriter


def _draft_args(model: DraftKVWriter, positions, cache_loc, commit_lens, ctx) -> dict:
    """The op's arguments that reproduce `model` (its weights, tables and caches, read in place)."""
    cfg = model.cfg
    kw, ks, kb, vw, vs, vb = [], [], [], [], [], []
    for layer in model.layers:
        if cfg.proj == "kv_separate":
            kw.append(layer.k_proj.weight), ks.append(0), kb.append(layer.k_proj.bias)
            vw.append(layer.v_proj.weight), vs.append(0), vb.append(layer.v_proj.bias)
        else:
            w, b = layer.qkv_proj.weight, layer.qkv_proj.bias
            kw.append(w), ks.append(cfg.q_size), kb.append(b)
            vw.append(w), vs.append(cfg.q_size + cfg.kv_size), vb.append(b)
    caches = model.caches()
    return dict(
        x=ctx,
        k_weights=kw,
        k_row_starts=ks,
        k_biases=kb,
        v_weights=vw,
        v_row_starts=vs,
        v_biases=vb,
        k_norm_weights=[layer.k_norm_weight for layer in model.layers],
        k_norm_eps=[layer.eps for layer in model.layers],
        cos_sin_caches=[getattr(model, f"cos_sin_{j}") for j in model.table_of_layer],
        positions=positions,
        is_neox=cfg.rope_style == "neox",
        k_caches=[k for k, _ in caches],
        v_caches=[v for _, v in caches],
        cache_loc=cache_loc,
        commit_lens=commit_lens,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )


@pytest.mark.parametrize(
    "options",
    [
        dict(write="cache_loc"),
        dict(write="cache_loc", rope_style="gptj", rotary_dim=8, proj="kv_separate", qkv_bias=True),
        dict(write="commit", qkv_bias=(True, False, True), eps=(1e-6, 1e-2, 0.5), rope_theta=(1e4, 1e6, 1e4)),
        dict(write="commit", rope_style="gptj", rotary_dim=6, norm="rms_norm", proj="qkv_split", qkv_bias=True),
    ],
    ids=["cache_loc", "cache_loc gptj partial separate", "commit per-layer", "commit gptj partial qkv_split"],
)
def test_reference_matches_the_draft_model(options):
    """The op (fp32) writes what `DraftKVWriter` (fp32) writes, for both of its cache-writing modes."""
    cfg = small_config(**options)
    model = DraftKVWriter(cfg)
    gen = torch.Generator().manual_seed(5)
    for k_cache, v_cache in model.caches():
        k_cache.copy_(poison(k_cache.shape, k_cache.dtype, gen))
        v_cache.copy_(poison(v_cache.shape, v_cache.dtype, gen))
    inputs = draft_inputs(cfg, 11, seed=3)
    ctx, positions, cache_loc = inputs[:3]
    commit_lens = inputs[3] if cfg.write == "commit" else None
    expected = [t.clone() for kv in model.caches() for t in kv]
    with torch.no_grad():
        model(*inputs)
    want = [t.clone() for kv in model.caches() for t in kv]
    for cache, old in zip([t for kv in model.caches() for t in kv], expected, strict=True):
        cache.copy_(old)
    with torch.no_grad():
        op(*_draft_args(model, positions, cache_loc, commit_lens, ctx).values())
    got = [t for kv in model.caches() for t in kv]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.equal(g.isnan(), w.isnan())


# ---------------------------------------------------------------------------------------------- argument errors


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
        ("cos_sin_caches 1-D", _entry("cos_sin_caches", 0, lambda a: _like(a, 8)), ValueError, r"cos_sin_caches\[0\] "),
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


def _fake_args(args: dict, mode: FakeTensorMode) -> dict:
    def conv(v):
        if isinstance(v, torch.Tensor):
            return mode.from_tensor(v)
        if isinstance(v, list):
            return [conv(t) for t in v]
        return v

    return {k: conv(v) for k, v in args.items()}


def cache_bits(args: dict) -> list[torch.Tensor]:
    """`bits` of every cache argument that holds data (not the meta ones of the device cases)."""
    return [bits(c) for c in (*args["k_caches"], *args["v_caches"]) if c.device.type != "meta"]


def expect_error(args: dict, error: type, start: str) -> str:
    """Call the op, expect `error` whose message is the op's prefix then `start` (a regex); no cache changed."""
    before = cache_bits(args)
    with pytest.raises(error) as info:
        op(*args.values())
    message = str(info.value).splitlines()[0]
    assert re.match(rf"multi_linear_kv_write: {start}", message), message
    after = cache_bits(args)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "a cache changed before the error"
    return message


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_arguments_raise_before_any_write(case):
    """Each structural error: its class, a message naming the argument first, no cache changed; the fake impl
    (torch.compile) raises the same message."""
    _, change, error, start = case
    base = make_case(BAD)
    args = {**base.args, **change(base.args)}
    message = expect_error(args, error, start)
    with FakeTensorMode() as mode, pytest.raises(error) as fake:
        op(*_fake_args(args, mode).values())
    assert str(fake.value).splitlines()[0] == message


def test_disjoint_views_of_one_buffer_are_accepted():
    """Caches may be views of one buffer when no element is shared, also under the fake impl; any shared element
    is an error (the table above)."""
    for layout in ("interleaved", "stacked", "heads-major"):
        case = make_case(replace(BAD, cache_layout=layout))
        run_and_check(case)
        with FakeTensorMode() as mode:
            op(*_fake_args(case.args, mode).values())
    case = make_case(BAD)
    halves = torch.zeros(BAD.slots, BAD.heads, 2, BAD.head_dim)  # K and V heads side by side inside a slot
    case.args["k_caches"][0], case.args["v_caches"][0] = halves[:, :, 0], halves[:, :, 1]
    case.call()
    assert halves.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- index values


def _slot_message(index: str, value: int, slots: int) -> str:
    return (
        f"cache_loc[{index}] = {value} is out of range: cache slots are [0, {slots}) (negative entries skip the token)"
    )


def _position_message(index: int, value: int, rows: int) -> str:
    return (
        f"positions[{index}] = {value} is out of range: positions must be in [0, {rows}), a row of every "
        "cos_sin_caches table"
    )


def _set(key: str, entries: dict, dtype=None):
    def change(args):
        t = args[key].clone()
        for index, value in entries.items():
            t[index] = value
        return {key: t if dtype is None else t.to(dtype)}

    return change


S = BAD.slots
ROWS = BAD.table_rows  # layer 1's table has 5 more rows: positions must fit layer 0's
VALUE_CASES = [
    ("slot = S", BAD, _set("cache_loc", {3: S}), _slot_message("3", S, S)),
    ("slot after a negative", BAD, _set("cache_loc", {0: -1, 4: S + 7}), _slot_message("4", S + 7, S)),
    ("int32 slot", BAD, _set("cache_loc", {2: 2**31 - 1}, torch.int32), _slot_message("2", 2**31 - 1, S)),
    ("huge int64 slot", BAD, _set("cache_loc", {5: 2**62}), _slot_message("5", 2**62, S)),
    (
        "masked [B, W] slot",
        replace(BAD, window=3, commit=(1, 0)),
        _set("cache_loc", {(1, 2): S}),
        _slot_message("1, 2", S, S),
    ),
    (
        "slot of a negative-slot token's neighbour",
        replace(BAD, negative=(1,)),
        _set("cache_loc", {0: S}),
        _slot_message("0", S, S),
    ),
    ("position -1", BAD, _set("positions", {1: -1}), _position_message(1, -1, ROWS)),
    (
        "position = rows of the shorter table",
        BAD,
        _set("positions", {0: ROWS - 1, 3: ROWS}),
        _position_message(3, ROWS, ROWS),
    ),
    ("int32 position", BAD, _set("positions", {4: 2**31 - 1}, torch.int32), _position_message(4, 2**31 - 1, ROWS)),
    (
        "position of a skipped token",
        replace(BAD, negative=(2,)),
        _set("positions", {2: ROWS + 100}),
        _position_message(2, ROWS + 100, ROWS),
    ),
    (
        "slot before position",
        BAD,
        lambda a: {**_set("positions", {0: -5})(a), **_set("cache_loc", {5: S})(a)},
        _slot_message("5", S, S),
    ),
]


@pytest.mark.parametrize("case", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_out_of_range_index_raises_before_any_write(case):
    _, spec, change, message = case
    base = make_case(spec)
    base.args.update(change(base.args))
    before = [bits(b) for b in base.bases]
    with pytest.raises(ValueError, match=re.escape(message)):
        base.call()
    assert all(torch.equal(bits(b), old) for b, old in zip(base.bases, before, strict=True))


def test_zero_slot_caches():
    case = make_case(replace(BAD, slots=0, tokens=0))
    case.call()
    case = make_case(BAD)
    for key in ("k_caches", "v_caches"):
        case.args[key] = [c[:0] for c in case.args[key]]
    with pytest.raises(ValueError, match=re.escape(_slot_message("0", int(case.args["cache_loc"][0]), 0))):
        case.call()
    case.args["cache_loc"] = -1 - case.args["cache_loc"]
    case.call()  # every token skipped


def test_positions_unchecked_without_rope():
    """Without RoPE the positions index nothing: any value is fine."""
    case = make_case(replace(BAD, rot=None))
    case.args["positions"][:] = torch.tensor([-1, 2**40, 0, -(2**62), 7, 5])
    run_and_check(case)


def test_fake_impl_reads_no_index_values():
    case = make_case(BAD)
    case.args["cache_loc"][0] = 2**62
    case.args["positions"][1] = -1
    with FakeTensorMode() as mode:
        op(*_fake_args(case.args, mode).values())


# ---------------------------------------------------------------------------------------------- opcheck, compile


OPCHECK = {
    "1-D slots, biases, norm weights": Spec(tokens=5, layers=2),
    "[B, W] slots, no biases or norm weights": Spec(
        tokens=6, layers=2, window=3, commit=(2, 3), bias=(False,), norm="no-weight", neox=False, rot=6
    ),
    "no norm, no rope, negative slots": Spec(tokens=4, layers=1, norm="off", rot=None, negative=(1,)),
    "stacked caches, T = 0": Spec(tokens=0, layers=2, cache_layout="stacked"),
}


@pytest.mark.parametrize("name", list(OPCHECK))
def test_opcheck(name):
    case = make_case(OPCHECK[name])
    torch.library.opcheck(op, tuple(case.args.values()))


def test_symbolic_tokens_under_compile():
    """The fake impl with a symbolic T (aot_eager, dynamic shapes): one graph serves several token counts and writes
    what the eager op writes."""
    spec = Spec(tokens=12, layers=2, window=4, commit=(2, 5, 0), negative=(1,))  # sizes unlike any other dim
    first = make_case(spec)
    static = {k: v for k, v in first.args.items() if k not in ("x", "positions", "cache_loc", "commit_lens")}

    def write(x, positions, cache_loc, commit_lens, *bases):
        k_caches, v_caches = first.views(list(bases))
        args = dict(first.args, x=x, positions=positions, cache_loc=cache_loc, commit_lens=commit_lens)
        op(*dict(args, k_caches=k_caches, v_caches=v_caches).values())

    torch._dynamo.reset()
    compiled = torch.compile(write, backend="aot_eager", dynamic=True, fullgraph=True)
    for i, tokens in enumerate((12, 20, 28)):
        got, want = (make_case(replace(spec, tokens=tokens, seed=tokens)) for _ in range(2))
        for case in (got, want):
            case.args.update({k: v for k, v in static.items() if k not in ("k_caches", "v_caches")})
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            compiled(got.args["x"], got.args["positions"], got.args["cache_loc"], got.args["commit_lens"], *got.bases)
        want.call()
        for a, b in zip(got.bases, want.bases, strict=True):
            assert torch.equal(bits(a), bits(b))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["separate", "stacked"])
def test_compile_fullgraph_writes_caches_in_place(layout):
    """Inductor calls the op on the caches themselves: no clone or copy of a cache in the generated code, nothing
    reported as a missed re-inplacing, and the caches hold what the eager op writes. `stacked`: the caches are views
    of one buffer taken inside the compiled function."""
    spec = Spec(tokens=8, layers=2, window=4, commit=(3, 4), negative=(2,), cache_layout=layout)
    eager, compiled_case = make_case(spec), make_case(spec)
    eager.call()
    args = compiled_case.args

    def step(x, positions, cache_loc, commit_lens, *bases):
        k_caches, v_caches = compiled_case.views(list(bases))
        a = dict(args, x=x, positions=positions, cache_loc=cache_loc, commit_lens=commit_lens)
        op(*dict(a, k_caches=k_caches, v_caches=v_caches).values())

    torch._dynamo.reset()
    counters.clear()
    # no FX graph / AOT cache: an entry compiled for caches that alias each other would clone them
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _, code = run_and_get_code(
            torch.compile(step, fullgraph=True),
            args["x"],
            args["positions"],
            args["cache_loc"],
            args["commit_lens"],
            *compiled_case.bases,
        )
    src = "\n".join(code)
    assert "torch.ops.dspark.multi_linear_kv_write.default(" in src
    assert "clone" not in src and "copy_" not in src
    assert counters["inductor"]["possibly_missed_reinplacing_opportunities"] == 0
    for a, b in zip(compiled_case.bases, eager.bases, strict=True):
        assert torch.equal(bits(a), bits(b))


def test_cuda_calls_reach_the_library_entry():
    """CUDA calls go through the build-on-first-use entry (custom_ops._build) to the C++ binding."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dspark::multi_linear_kv_write", "CompositeExplicitAutograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dspark::multi_linear_kv_write", "CPU")
