"""Shared by the FlashMLA-write / norm-RoPE op tests: random inputs, fp64 formulas of the five ops (the Numerics
section of docs/ops.md), byte views of the FlashMLA V4 cache (its layout in docs/ops.md) and the CUDA acceptance
check (docs/ops.md, after the cache layout); for the input contract (docs/contract.md), the op table, the
`*_reference` oracles, the out-of-range row breakers and the table of structural errors (`structural_cases`, run by
tests/test_flashmla_contract.py and, through tests/bad_argument_cases.py, by tests/test_error_agreement.py)."""

from __future__ import annotations

import math

import torch

import custom_ops  # noqa: F401  (registers torch.ops.dspark.*)
from custom_ops.flashmla import writes as fw
from custom_ops.layouts.fp8 import dequantize_flashmla_cache, flashmla_page_bytes
from custom_ops.layouts.rope import precompute_freqs

EPS = 1e-6


MAX_POS = 512


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _k_inputs(
    b,
    *,
    page_size=64,
    dtype=torch.bfloat16,
    pos_dtype=torch.int64,
    loc_dtype=torch.int32,
    row_stride=1536,
    seed=0,
    skip_every=5,
):
    """Fresh random K inputs; kv is the last 512 columns of a (b, row_stride) buffer; the cache is poisoned. Rows 0,
    skip_every, 2 * skip_every, ... get negative slots (skipped rows); skip_every=0 keeps every row."""
    g = _gen(seed)
    kv = torch.randn(b, row_stride, generator=g).to(dtype)[:, row_stride - 512 :]
    weight = (1 + 0.3 * torch.randn(512, generator=g)).to(dtype)
    freqs = precompute_freqs(MAX_POS)
    positions = torch.randint(0, MAX_POS, (b,), generator=g).to(pos_dtype)
    num_pages = b // page_size + 2
    out_loc = torch.randperm(num_pages * page_size, generator=g)[:b]
    if skip_every:
        out_loc[::skip_every] = -1 - torch.arange(out_loc[::skip_every].numel())
    out_loc = out_loc.to(loc_dtype)
    cache = torch.randint(0, 256, (num_pages, flashmla_page_bytes(page_size)), generator=g, dtype=torch.uint8)
    return kv, weight, freqs, positions, out_loc, cache


def _slot_bytes(cache, page_size, loc):
    """Value (N, 576) and scale (N, 8) bytes of slots `loc`, addressed independently of the library."""
    loc = loc.long()
    page_bytes = cache.shape[1]
    page, off = loc // page_size, loc % page_size
    flat = cache.reshape(-1)
    vbase = page * page_bytes + off * 576
    sbase = page * page_bytes + page_size * 576 + off * 8
    return flat[vbase[:, None] + torch.arange(576)], flat[sbase[:, None] + torch.arange(8)]


def _written_mask(cache, page_size, loc):
    mask = torch.zeros(cache.numel(), dtype=torch.bool)
    loc = loc.long()[loc >= 0]
    page, off = loc // page_size, loc % page_size
    vbase = page * cache.shape[1] + off * 576
    sbase = page * cache.shape[1] + page_size * 576 + off * 8
    mask[(vbase[:, None] + torch.arange(576)).reshape(-1)] = True
    mask[(sbase[:, None] + torch.arange(7)).reshape(-1)] = True
    return mask.view_as(cache)


def _fp8_ordinal(codes):
    c = codes.to(torch.int32)
    return torch.where((c & 0x80) != 0, -(c & 0x7F), c & 0x7F)


def _fp64_rope(r, table_rows):
    c, s = table_rows[..., 0::2], table_rows[..., 1::2]
    re, im = r[..., 0::2], r[..., 1::2]
    return torch.stack([re * c - im * s, re * s + im * c], dim=-1).flatten(-2)


def _fp64_rope_terms(r, table_rows):
    """Per element of `_fp64_rope(r, table_rows)`, the sum of the magnitudes of the two products it adds."""
    c, s = table_rows[..., 0::2].abs(), table_rows[..., 1::2].abs()
    re, im = r[..., 0::2].abs(), r[..., 1::2].abs()
    return torch.stack([re * c + im * s, re * s + im * c], dim=-1).flatten(-2)


def _fp64_k_rows(kv, weight, eps, freqs, positions):
    """fp64 RMSNorm with weight + RoPE of (B, 512) rows: the nope dims, the rope dims, and the rope dims' terms
    (`_fp64_rope_terms`, for `_check_bf16_close`)."""
    x = kv.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * weight.double()
    table_rows = freqs.double()[positions.long()]
    return y[:, :448], _fp64_rope(y[:, 448:], table_rows), _fp64_rope_terms(y[:, 448:], table_rows)


def _fp64_q_rows(q, eps, freqs, positions):
    """fp64 weightless RMSNorm + RoPE of (B, H, 512) rows."""
    x = q.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return torch.cat([y[..., :448], _fp64_rope(y[..., 448:], freqs.double()[positions.long()][:, None, :])], -1)


def _fp64_norm_rope_rows(kv, weight, eps, freqs, positions):
    """fp64 RMSNorm with weight + RoPE of (B, 512) rows."""
    nope64, rope64, _ = _fp64_k_rows(kv, weight, eps, freqs, positions)
    return torch.cat([nope64, rope64], -1)


def _sylvester(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _check_indexer_fp64(q_fp8, w_out, q, weight, weight_scale, freqs, positions):
    """Indexer outputs against fp64: RoPE, Hadamard / sqrt(128), codes within FP8 rounding of y / scale."""
    x = q.double()
    x = torch.cat([x[..., :64], _fp64_rope(x[..., 64:], freqs.double()[positions.long()][:, None, :])], -1)
    y = x @ _sylvester(128).T / math.sqrt(128)
    scale = y.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448
    deq = q_fp8.double() * scale
    assert ((deq - y).abs() <= y.abs() * 2.0**-4 + scale * 2.0**-9 + 1e-12).all()
    torch.testing.assert_close(w_out.double(), weight.double()[..., None] * weight_scale * scale, rtol=1e-5, atol=0)


def _check_nope_bytes(values, scales, y64):
    """Scale bytes = ceil-UE8M0 of the fp64 amax, codes within one code of the fp64 quantization."""
    n = y64.shape[0]
    tiles = y64.reshape(n, 7, 64)
    sraw = tiles.abs().amax(-1).clamp(min=1e-4) / 448
    e64 = torch.ceil(torch.log2(sraw)) + 127
    e = scales[:, :7].long()
    assert (e == e64.long()).float().mean() >= 0.999
    assert ((e - e64.long()).abs() <= 1).all()
    q64 = (tiles * torch.pow(2.0, 127 - e.double())[..., None]).clamp(-448, 448)
    codes64 = q64.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, 448)
    assert ((_fp8_ordinal(values[:, :448]) - _fp8_ordinal(codes64)).abs() <= 1).all()
    deq = values[:, :448].view(torch.float8_e4m3fn).double().reshape(n, 7, 64) * torch.pow(2.0, e - 127.0)[..., None]
    step = torch.pow(2.0, e - 127.0 - 9)[..., None]
    assert ((deq - tiles).abs() <= tiles.abs() * 2.0**-4 + step).all()


def _check_bf16_close(got_bf16, want64, terms64):
    """bf16 RoPE values within one bf16 step of the fp64 formula, plus 8 fp32 rounding units of the terms the
    rotation adds (`terms64`, `_fp64_rope_terms`): the op rounds y = x * nf * w and each product in fp32 before its
    one bf16 rounding, so where a rotation cancels (|r0 c| close to |r1 s|) the result is far below its terms and
    those fp32 roundings can exceed its own bf16 step (a hypothesis example: -1.31e-6 against the formula's
    -1.33e-6, two bf16 steps there, with terms near 0.1)."""
    got = got_bf16.double()
    ulp = torch.pow(2.0, torch.floor(torch.log2(want64.abs().clamp(min=1e-30))) - 7)
    assert ((got - want64).abs() <= ulp + terms64 * 2.0**-21).all()


def _tol(dtype):
    return {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[dtype]


def _assert_cache_acceptance(got, want, before, page_size, loc, *, allow_empty=False):
    """Acceptance of a CUDA cache against the CPU reference cache (all on CPU; the thresholds of docs/ops.md,
    "FlashMLA V4 cache layout"). Fails when no slot of `loc` is written (nothing would be compared) unless the
    caller passes allow_empty=True."""
    mask = _written_mask(want, page_size, loc)
    assert torch.equal(got[~mask], before[~mask])  # untouched bytes
    keep = loc >= 0
    if not bool(keep.any()):
        assert allow_empty, "no slot is written: no row of the cache would be compared"
        return
    gv, gs = _slot_bytes(got, page_size, loc[keep])
    wv, ws = _slot_bytes(want, page_size, loc[keep])
    assert torch.equal(gv[:, 448:], wv[:, 448:])  # rope bytes exact
    assert (gs[:, :7] == ws[:, :7]).float().mean() >= 0.999
    assert ((_fp8_ordinal(gv[:, :448]) - _fp8_ordinal(wv[:, :448])).abs() <= 1).all()
    dg = dequantize_flashmla_cache(got, page_size, loc[keep])[:, :448]
    dw = dequantize_flashmla_cache(want, page_size, loc[keep])[:, :448]
    assert ((dg - dw).abs() / dw.abs().clamp(min=1e-6)).mean() <= 0.005
    assert (dg - dw).abs().max() <= 1.0


K_OPS = ("fused_k_norm_rope_flashmla", "store_flashmla_cache")


ROPE_OPS = (
    "fused_k_norm_rope_flashmla",
    "fused_q_norm_rope",
    "fused_norm_rope_inplace",
    "fused_q_indexer_rope_hadamard_quant",
)


ALL_OPS = (*ROPE_OPS, "store_flashmla_cache")


MUTATED = {
    "fused_k_norm_rope_flashmla": "kvcache",
    "store_flashmla_cache": "kvcache",
    "fused_q_norm_rope": "q_out",
    "fused_norm_rope_inplace": "kv",
}


REFERENCES = {
    "fused_k_norm_rope_flashmla": fw.fused_k_norm_rope_flashmla_reference,
    "store_flashmla_cache": fw.store_flashmla_cache_reference,
    "fused_q_norm_rope": fw.fused_q_norm_rope_reference,
    "fused_norm_rope_inplace": fw.fused_norm_rope_inplace_reference,
    "fused_q_indexer_rope_hadamard_quant": fw.fused_q_indexer_rope_hadamard_quant_reference,
}


HEADS = 3


PAGE_SIZE = 2


HUGE = 2**62  # slot * page_bytes wraps to slot % 2**62 * page_bytes in int64 for page_size 2 (1728 = 27 * 2**6)


def _inputs(name, b=8, seed=0, page_size=PAGE_SIZE):
    """Fresh random arguments of op `name` (CPU, schema order, every slot and position valid); the mutated tensor
    is poisoned (random cache bytes, NaN q_out) and `kv` is a row-strided view."""
    kv, weight, freqs, pos, loc, cache = _k_inputs(b, page_size=page_size, seed=seed, loc_dtype=torch.int64)
    g = _gen(seed + 1000)
    if name == "fused_k_norm_rope_flashmla":
        return dict(
            kv=kv, weight=weight, eps=EPS, freqs=freqs, positions=pos, out_loc=loc, kvcache=cache, page_size=page_size
        )
    if name == "store_flashmla_cache":
        return dict(kv=kv, out_loc=loc, kvcache=cache, page_size=page_size)
    if name == "fused_q_norm_rope":
        q = torch.randn(b, HEADS, 512, generator=g).to(torch.bfloat16)
        return dict(q=q, q_out=torch.full_like(q, float("nan")), eps=EPS, freqs=freqs, positions=pos)
    if name == "fused_norm_rope_inplace":
        return dict(kv=kv, weight=weight, eps=EPS, freqs=freqs, positions=pos)
    q = torch.randn(b, HEADS, 128, generator=g).to(torch.bfloat16)
    weight = torch.randn(b, HEADS, generator=g).to(torch.bfloat16)
    return dict(q=q, weight=weight, weight_scale=0.01, freqs=freqs, positions=pos)


def _bits(t):
    """Bit pattern of `t` (NaN poison compares equal to itself)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).cpu().clone()


def _unused_slot(args):
    """A slot of the cache that no row addresses (where a wrapped huge slot id would land)."""
    used = set(args["out_loc"].tolist())
    return next(s for s in range(args["kvcache"].shape[0] * args["page_size"]) if s not in used)


def _break_rows(name, args):
    """Make rows 1, 3, 5 and 7 out of range (positions -1 / max_pos, slots capacity / huge); returns the mask of
    the rows that stay valid."""
    valid = torch.ones(args["positions" if "positions" in args else "out_loc"].shape[0], dtype=torch.bool)
    if "positions" in args:
        args["positions"][1] = -1
        args["positions"][3] = MAX_POS
        valid[[1, 3]] = False
    if "out_loc" in args:
        capacity = args["kvcache"].shape[0] * args["page_size"]
        args["out_loc"][5] = capacity
        args["out_loc"][7] = HUGE + _unused_slot(args)
        valid[[5, 7]] = False
    return valid


def _effective_slots(args, valid):
    return torch.where(valid, args["out_loc"], -1)


def _assert_matches_reference(name, got, want, before, valid, args, *, allow_empty=True):
    """A kernel result `got` (on CPU) against the reference result `want` of the same inputs. allow_empty=False
    fails a case in which no row is compared (no valid row; for the cache writes, no written slot); the default
    allows it because the fuzz tests draw empty batches and batches of skipped rows."""
    if name in K_OPS:
        slots = _effective_slots(args, valid)
        _assert_cache_acceptance(got, want, before, args["page_size"], slots, allow_empty=allow_empty)
        return
    assert allow_empty or bool(valid.any()), "no valid row: no row of the output would be compared"
    if name in ("fused_q_norm_rope", "fused_norm_rope_inplace"):
        assert torch.equal(_bits(got[~valid]), _bits(before[~valid]))
        tol = _tol(got.dtype)
        torch.testing.assert_close(got[valid].double(), want[valid].double(), rtol=2 * tol, atol=4 * tol)
        if valid.any():  # bit for bit except rare rounding ties (a few elements of a small batch)
            assert (got[valid] == want[valid]).float().mean() >= 0.99
        return
    (got_q, got_w), (want_q, want_w) = got, want
    assert not _bits(got_q[~valid]).any() and not got_w[~valid].any()
    codes_got, codes_want = got_q[valid].view(torch.uint8), want_q[valid].view(torch.uint8)
    assert ((_fp8_ordinal(codes_got) - _fp8_ordinal(codes_want)).abs() <= 1).all()
    torch.testing.assert_close(got_w[valid], want_w[valid], rtol=1e-6, atol=0)


def _reference_result(name, args):
    ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out = REFERENCES[name](*ref.values())
    return ref[MUTATED[name]] if name in MUTATED else out


def offset_copy(t, elements):
    """A copy of `t` whose storage offset is `elements` (16-byte misaligned for small offsets)."""
    buf = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = buf[elements:].view(t.shape)
    view.copy_(t)
    return view


def inside(host: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in the first bytes of the contiguous `host` (a view of host's storage, host's values changed)."""
    nbytes = t.numel() * t.element_size()
    assert host.is_contiguous() and host.numel() * host.element_size() >= nbytes
    return host.view(-1).view(torch.uint8)[:nbytes].view(t.dtype).view(t.shape).copy_(t)


def _put_inside(args: dict, out: str, inp: str) -> dict:
    """`args[inp]` moved into the first bytes of the written `args[out]` (made contiguous first)."""
    host = args[out].contiguous()
    return {out: host, inp: inside(host, args[inp])}


def _shifted_q_out(args: dict) -> torch.Tensor:
    """`q` and `q_out` one row apart in one buffer (`args["q"]` replaced): each row written is the next one read."""
    q = args["q"]
    buf = torch.empty((q.shape[0] + 1, *q.shape[1:]), dtype=q.dtype, device=q.device)
    buf[:-1] = q
    args["q"] = buf[:-1]
    return buf[1:]


def _shared_memory_cases():
    """An input in the bytes of the tensor the op writes: the op raises naming both (as the DSV4 ops do)."""
    return [
        (
            f"{inp} inside {out}",
            op,
            lambda a, o=out, i=inp: _put_inside(a, o, i),
            ValueError,
            rf"{out}: must not share memory with {inp}",
        )
        for op, out, inp in [
            ("fused_k_norm_rope_flashmla", "kvcache", "out_loc"),
            ("fused_k_norm_rope_flashmla", "kvcache", "positions"),
            ("fused_k_norm_rope_flashmla", "kvcache", "weight"),
            ("store_flashmla_cache", "kvcache", "out_loc"),
            ("store_flashmla_cache", "kvcache", "kv"),
            ("fused_q_norm_rope", "q_out", "positions"),
            ("fused_norm_rope_inplace", "kv", "weight"),
            ("fused_norm_rope_inplace", "kv", "positions"),
        ]
    ] + [
        (
            "q_out one row after q",
            "fused_q_norm_rope",
            lambda a: {"q_out": _shifted_q_out(a)},
            ValueError,
            "q_out: must not share memory with q",
        )
    ]


def structural_cases():
    """(id, op, change(args) -> dict, exception, message regex): rules every impl (CPU, fake, CUDA) enforces."""
    return [
        (
            "cache misaligned",
            "fused_k_norm_rope_flashmla",
            lambda a: {"kvcache": offset_copy(a["kvcache"], 8)},
            ValueError,
            "kvcache must be 16-byte aligned",
        ),
        (
            "store cache misaligned",
            "store_flashmla_cache",
            lambda a: {"kvcache": offset_copy(a["kvcache"], 4)},
            ValueError,
            "kvcache must be 16-byte aligned",
        ),
        (
            "freqs misaligned",
            "fused_q_norm_rope",
            lambda a: {"freqs": offset_copy(a["freqs"], 2)},
            ValueError,
            "freqs must be 16-byte aligned",
        ),
        (
            "page_size too large",
            "fused_k_norm_rope_flashmla",
            lambda a: {"page_size": 2**31},
            ValueError,
            r"page_size must be a power of two in \[1, 2\*\*30\]",
        ),
        (
            "store page_size 2**62",
            "store_flashmla_cache",
            lambda a: {"page_size": 2**62},
            ValueError,
            r"page_size must be a power of two in \[1, 2\*\*30\]",
        ),
        (
            "eps inf",
            "fused_k_norm_rope_flashmla",
            lambda a: {"eps": float("inf")},
            ValueError,
            "eps must be finite and >= 0",
        ),
        ("eps nan", "fused_q_norm_rope", lambda a: {"eps": float("nan")}, ValueError, "eps must be finite and >= 0"),
        (
            "eps negative",
            "fused_norm_rope_inplace",
            lambda a: {"eps": -1e-6},
            ValueError,
            "eps must be finite and >= 0",
        ),
        (
            "weight_scale nan",
            "fused_q_indexer_rope_hadamard_quant",
            lambda a: {"weight_scale": float("nan")},
            ValueError,
            "weight_scale must be finite",
        ),
        (
            "weight_scale inf",
            "fused_q_indexer_rope_hadamard_quant",
            lambda a: {"weight_scale": float("inf")},
            ValueError,
            "weight_scale must be finite",
        ),
        (
            "weight_scale -inf",
            "fused_q_indexer_rope_hadamard_quant",
            lambda a: {"weight_scale": float("-inf")},
            ValueError,
            "weight_scale must be finite",
        ),
        (
            "q_out broadcast",
            "fused_q_norm_rope",
            lambda a: {"q_out": a["q_out"][:1].expand_as(a["q_out"])},
            ValueError,
            "q_out must not overlap itself",
        ),
        (
            "q_out heads overlap",
            "fused_q_norm_rope",
            lambda a: {"q_out": a["q_out"].as_strided(a["q_out"].shape, (HEADS * 512, 256, 1))},
            ValueError,
            "q_out must not overlap itself",
        ),
        (
            "kv rows overlap",
            "fused_norm_rope_inplace",
            lambda a: {"kv": a["kv"].as_strided(a["kv"].shape, (256, 1))},
            ValueError,
            "kv must not overlap itself",
        ),
        (
            "positions 2-D",
            "fused_norm_rope_inplace",
            lambda a: {"positions": a["positions"][:, None]},
            ValueError,
            "positions must have shape",
        ),
        (
            "out_loc float",
            "store_flashmla_cache",
            lambda a: {"out_loc": a["out_loc"].float()},
            TypeError,
            "out_loc must have dtype",
        ),
        (
            "indexer weight dtype",
            "fused_q_indexer_rope_hadamard_quant",
            lambda a: {"weight": a["weight"].float()},
            TypeError,
            "weight must have dtype",
        ),
        *_shared_memory_cases(),
    ]


QUANTIZING_OPS = ("fused_k_norm_rope_flashmla", "store_flashmla_cache", "fused_q_indexer_rope_hadamard_quant")

_NEGATIVE_NAN_BITS = {  # dtype: (the integer view, the bits of a quiet NaN with its sign bit set)
    torch.float32: (torch.int32, -(2**22)),
    torch.bfloat16: (torch.int16, -64),
    torch.float16: (torch.int16, -512),
}


def negative_nan(dtype: torch.dtype) -> torch.Tensor:
    """A one-element NaN of `dtype` with its sign bit set (torch's own conversions make positive ones)."""
    int_dtype, bits = _NEGATIVE_NAN_BITS[dtype]
    value = torch.tensor([bits], dtype=int_dtype).view(dtype)
    assert value.isnan().all() and value.view(int_dtype) < 0
    return value


def plant_non_finite(args: dict) -> list[int]:
    """Non-finite values in rows 1, 2, 3, 4 and 6 of the op's input row (`kv`, or head 0 of `q`): NaN, +inf, -inf, a
    NaN with its sign bit, and +inf and -inf in two tiles of one row; the element of row 7 in the last dims (the RoPE
    dims of a K row) is +inf. Rows 0 and 5 are the K inputs' skipped rows. Returns the rows changed."""
    src = args["kv"] if "kv" in args else args["q"][:, 0]
    src[1, 5] = float("nan")
    src[2, 5] = float("inf")
    src[3, 5] = float("-inf")
    src[4, 5:6] = negative_nan(src.dtype)
    src[6, 5], src[6, 70] = float("inf"), float("-inf")
    src[7, -3] = float("inf")
    return [1, 2, 3, 4, 6, 7]


def assert_same_non_finite_coding(name: str, got, want, args: dict, rows: list[int]) -> None:
    """The kernel's outputs for `rows` (all on CPU) code the same values as the reference's: the same UE8M0 exponent
    bytes, and decoded values equal, NaN where the reference has NaN (a NaN's payload aside)."""
    if name == "fused_q_indexer_rope_hadamard_quant":
        (got_q, got_w), (want_q, want_w) = got, want
        torch.testing.assert_close(got_q[rows].float(), want_q[rows].float(), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got_w[rows], want_w[rows], rtol=0, atol=0)
        return
    page_size, loc = args["page_size"], args["out_loc"][rows]
    assert bool((loc >= 0).all())
    _, got_scales = _slot_bytes(got, page_size, loc)
    _, want_scales = _slot_bytes(want, page_size, loc)
    assert torch.equal(got_scales[:, :7], want_scales[:, :7])
    decoded_got = dequantize_flashmla_cache(got, page_size, loc)
    decoded_want = dequantize_flashmla_cache(want, page_size, loc)
    torch.testing.assert_close(decoded_got, decoded_want, rtol=0, atol=0, equal_nan=True)
