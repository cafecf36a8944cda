"""dspark DeepSeek-V4 norm/RoPE/FP8 ops and the FlashMLA V4 cache writes: fp64 formulas, byte layout, registration.

CPU tests check the CPU reference (the op on CPU) against fp64 formulas (tests/flashmla_cases.py); CUDA tests check
the kernels against the CPU reference with the acceptance thresholds of docs/ops.md ("FlashMLA V4 cache layout").
"""

import math

import pytest
import torch
from flashmla_cases import (
    EPS,
    MAX_POS,
    _assert_cache_acceptance,
    _check_bf16_close,
    _check_indexer_fp64,
    _check_nope_bytes,
    _fp8_ordinal,
    _fp64_k_rows,
    _fp64_norm_rope_rows,
    _fp64_q_rows,
    _gen,
    _k_inputs,
    _slot_bytes,
    _sylvester,
    _tol,
    _written_mask,
    negative_nan,
)
from helpers import LayoutKeepingMove
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import custom_ops  # noqa: F401  (registers torch.ops.dspark.*)
from custom_ops.flashmla import writes as fw
from custom_ops.layouts.fp8 import dequantize_flashmla_cache, flashmla_page_bytes, quantize_tiles_ue8m0
from custom_ops.layouts.norm import walsh_hadamard
from custom_ops.layouts.rope import precompute_freqs
from dspark_fx.testing import reinplacing_misses

ops = torch.ops.dspark


# ---------------------------------------------------------------------------------------------- fixtures


# ---------------------------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(("page_size", "page_bytes"), [(256, 149760), (64, 37440), (2, 1728), (1, 1152)])
def test_page_bytes(page_size, page_bytes):
    assert flashmla_page_bytes(page_size) == page_bytes


@pytest.mark.parametrize("page_size", [0, 3, 48, -4])
def test_page_bytes_rejects_non_power_of_two(page_size):
    with pytest.raises(ValueError, match="page_size"):
        flashmla_page_bytes(page_size)


def test_precompute_freqs_plain():
    freqs = precompute_freqs(1024, base=10000.0)
    assert freqs.shape == (1024, 64) and freqs.dtype == torch.float32
    p = torch.arange(1024, dtype=torch.float64)[:, None]
    f = 10000.0 ** (-torch.arange(32, dtype=torch.float64) * 2 / 64)
    ang = p * f
    torch.testing.assert_close(freqs[:, 0::2].double(), torch.cos(ang), atol=1e-3, rtol=0)
    torch.testing.assert_close(freqs[:, 1::2].double(), torch.sin(ang), atol=1e-3, rtol=0)


def test_precompute_freqs_yarn():
    base, orig, factor, fast, slow = 160000.0, 65536, 16.0, 32.0, 1.0
    freqs = precompute_freqs(256, base=base, original_seq_len=orig, factor=factor, beta_fast=fast, beta_slow=slow)
    j = torch.arange(32, dtype=torch.float64)
    f = base ** (-2 * j / 64)

    def corr(r):
        return 64 * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), 63)
    ramp = ((j - low) / (high - low)).clamp(0, 1)
    f = f / factor * ramp + f * (1 - ramp)
    ang = torch.arange(256, dtype=torch.float64)[:, None] * f
    torch.testing.assert_close(freqs[:, 0::2].double(), torch.cos(ang), atol=2e-4, rtol=0)
    torch.testing.assert_close(freqs[:, 1::2].double(), torch.sin(ang), atol=2e-4, rtol=0)
    assert not torch.allclose(freqs, precompute_freqs(256, base=base))


def test_ue8m0_rounds_up():
    y = torch.zeros(4, 448)
    y[0, :64] = 448.0  # scale exactly 1 -> e = 127
    y[1, :64] = 448.0 * 1.5  # scale 1.5 -> rounded up to 2 (e = 128), not down to 1
    y[2, :64] = 1e-9  # amax floor 1e-4
    y[3, 0] = -896.0
    codes, e = quantize_tiles_ue8m0(y)
    assert e[0, 0] == 127 and e[1, 0] == 128 and e[3, 0] == 128
    assert e[2, 0] == math.ceil(math.log2(1e-4 / 448)) + 127
    assert codes[1, 0] == 0x7A  # 672 / 2 = 336, a tie between 320 and 352: RNE gives 320 = 0x7A, no saturation
    assert codes[3, 0] == 0xFE  # -896 / 2 = -448


def test_ue8m0_non_finite_values():
    """A NaN is left out of its tile's amax and coded as the positive e4m3 NaN (0x7F, also with its sign bit set); an
    infinity counts as the largest finite fp32 and is coded +-448: the scale stays finite, the tile's finite values
    keep their signs, the other tiles do not change."""
    g = _gen(21)
    base = (torch.rand(448, generator=g) + 0.5) * torch.where(torch.rand(448, generator=g) < 0.5, -1.0, 1.0)
    rows = base.repeat(5, 1)
    rows[0, 5] = float("nan")
    rows[1, 5:6] = negative_nan(torch.float32)
    rows[2, 5], rows[3, 5], rows[4, 5] = float("inf"), float("-inf"), 0.0
    codes, e = quantize_tiles_ue8m0(rows)
    others = torch.arange(448) != 5
    for r in (0, 1):
        assert torch.equal(e[r], e[4]) and codes[r, 5] == 0x7F
        assert torch.equal(codes[r, others], codes[4, others])
    top = 127 + math.ceil(math.log2(torch.finfo(torch.float32).max / 448))  # 247
    assert e[2, 0] == e[3, 0] == top and codes[2, 5] == 0x7E and codes[3, 5] == 0xFE
    tile0 = torch.arange(64) != 5
    for r in (2, 3):
        assert torch.equal(e[r, 1:], e[4, 1:]) and torch.equal(codes[r, 64:], codes[4, 64:])
        assert torch.equal(codes[r, :64][tile0], torch.where(base[:64][tile0] < 0, 0x80, 0x00).to(torch.uint8))


# ---------------------------------------------------------------------------------------------- fused K write


@pytest.mark.parametrize("page_size", [1, 2, 64, 256])
@pytest.mark.parametrize(("pos_dtype", "loc_dtype"), [(torch.int64, torch.int32), (torch.int32, torch.int64)])
def test_k_write_matches_fp64_and_layout(page_size, pos_dtype, loc_dtype):
    kv, weight, freqs, pos, loc, cache = _k_inputs(37, page_size=page_size, pos_dtype=pos_dtype, loc_dtype=loc_dtype)
    before = cache.clone()
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, page_size)

    mask = _written_mask(cache, page_size, loc)
    assert torch.equal(cache[~mask], before[~mask])  # other slots, scale pad byte, page tail, skipped rows
    keep = loc >= 0
    values, scales = _slot_bytes(cache, page_size, loc[keep])
    nope64, rope64, terms64 = _fp64_k_rows(kv[keep], weight, EPS, freqs, pos[keep])
    _check_nope_bytes(values, scales, nope64)
    _check_bf16_close(values[:, 448:].contiguous().view(torch.bfloat16), rope64, terms64)
    deq = dequantize_flashmla_cache(cache, page_size, loc[keep])
    rel = (deq[:, :448].double() - nope64).abs() / nope64.abs().clamp(min=1e-6)
    assert rel.mean() < 0.03


def test_k_write_strided_equals_contiguous():
    kv, weight, freqs, pos, loc, cache = _k_inputs(64, row_stride=1536)
    cache2 = cache.clone()
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, 64)
    ops.fused_k_norm_rope_flashmla(kv.contiguous(), weight, EPS, freqs, pos, loc, cache2, 64)
    assert kv.stride(0) == 1536
    assert torch.equal(cache, cache2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_k_write_other_dtypes(dtype):
    kv, weight, freqs, pos, loc, cache = _k_inputs(16, dtype=dtype, skip_every=0)
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, 64)
    values, scales = _slot_bytes(cache, 64, loc)
    nope64, rope64, terms64 = _fp64_k_rows(kv, weight, EPS, freqs, pos)
    _check_nope_bytes(values, scales, nope64)
    _check_bf16_close(values[:, 448:].contiguous().view(torch.bfloat16), rope64, terms64)


@pytest.mark.parametrize("b", [0, 1])
def test_k_write_tiny_batches(b):
    kv, weight, freqs, pos, loc, cache = _k_inputs(b, skip_every=0)
    before = cache.clone()
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, 64)
    assert int((cache != before).sum()) <= 583 * b
    if b:
        values, _ = _slot_bytes(cache, 64, loc)
        _, rope64, terms64 = _fp64_k_rows(kv, weight, EPS, freqs, pos)
        _check_bf16_close(values[:, 448:].contiguous().view(torch.bfloat16), rope64, terms64)


def test_k_write_all_rows_skipped_changes_nothing():
    kv, weight, freqs, pos, loc, cache = _k_inputs(8, skip_every=1)
    before = cache.clone()
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, 64)
    assert torch.equal(cache, before)


def test_fused_vs_unfused_value_space():
    kv, weight, freqs, pos, loc, cache = _k_inputs(40, skip_every=0)
    cache_unfused = cache.clone()
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, 64)
    normed = kv.contiguous()
    ops.fused_norm_rope_inplace(normed, weight, EPS, freqs, pos)
    ops.store_flashmla_cache(normed, loc, cache_unfused, 64)
    a = dequantize_flashmla_cache(cache, 64, loc)
    b = dequantize_flashmla_cache(cache_unfused, 64, loc)
    nope64, rope64, _ = _fp64_k_rows(kv, weight, EPS, freqs, pos)
    for d, rope_atol in ((a, 1e-5), (b, 2e-2)):  # unfused: rope of bf16-rounded inputs, rounded again
        rel = (d[:, :448].double() - nope64).abs() / nope64.abs().clamp(min=1e-3)
        assert rel.mean() < 0.03
        torch.testing.assert_close(d[:, 448:].double(), rope64, rtol=2**-6, atol=rope_atol)


# ---------------------------------------------------------------------------------------------- other ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_q_norm_rope_matches_fp64(dtype, pos_dtype):
    g = _gen(1)
    b, h = 5, 3
    q = torch.randn(b, h, 512, generator=g).to(dtype)
    wide = torch.full((b, h + 2, 512), float("nan"), dtype=dtype)
    q_out = wide[:, 1 : h + 1]  # a head slice of a wider buffer: batch stride 5*512
    freqs = precompute_freqs(MAX_POS)
    pos = torch.randint(0, MAX_POS, (b,), generator=g).to(pos_dtype)
    ops.fused_q_norm_rope(q, q_out, EPS, freqs, pos)
    assert wide[:, 0].isnan().all() and wide[:, h + 1].isnan().all()
    want = _fp64_q_rows(q, EPS, freqs, pos)
    # rope is rounded twice (of the DType-rounded norm output): absolute slack of a few ulps of O(1) values
    torch.testing.assert_close(q_out.double(), want, rtol=2 * _tol(dtype), atol=4 * _tol(dtype))
    # the rounding points: nope = DType(x*nf) exactly as the reference computes it
    ref = torch.empty_like(q)
    fw.fused_q_norm_rope_reference(q, ref, EPS, freqs, pos)
    assert torch.equal(ref, q_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_norm_rope_inplace_matches_fp64(dtype):
    kv, weight, freqs, pos, _, _ = _k_inputs(9, dtype=dtype, row_stride=512)
    want = _fp64_norm_rope_rows(kv, weight, EPS, freqs, pos)
    ops.fused_norm_rope_inplace(kv, weight, EPS, freqs, pos)
    torch.testing.assert_close(kv.double(), want, rtol=2 * _tol(dtype), atol=4 * _tol(dtype))


@pytest.mark.parametrize("page_size", [1, 64])
def test_store_matches_fp64_and_layout(page_size):
    kv, _, _, _, loc, cache = _k_inputs(23, page_size=page_size, loc_dtype=torch.int64)
    before = cache.clone()
    ops.store_flashmla_cache(kv, loc, cache, page_size)
    mask = _written_mask(cache, page_size, loc)
    assert torch.equal(cache[~mask], before[~mask])
    keep = loc >= 0
    values, scales = _slot_bytes(cache, page_size, loc[keep])
    assert torch.equal(values[:, 448:], kv[keep][:, 448:].contiguous().view(torch.uint8))  # rope bytes exact
    _check_nope_bytes(values, scales, kv[keep][:, :448].double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_matches_fp64(dtype):
    g = _gen(2)
    b, h = 6, 4
    q = torch.randn(b, h, 128, generator=g).to(dtype)
    weight = torch.randn(b, h, generator=g).to(dtype)
    freqs = precompute_freqs(MAX_POS)
    pos = torch.randint(0, MAX_POS, (b,), generator=g)
    ws = 128**-0.5 * 64**-0.5
    q_fp8, w_out = ops.fused_q_indexer_rope_hadamard_quant(q, weight, ws, freqs, pos)
    assert q_fp8.dtype == torch.float8_e4m3fn and q_fp8.shape == (b, h, 128)
    assert w_out.dtype == torch.float32 and w_out.shape == (b, h, 1)
    _check_indexer_fp64(q_fp8, w_out, q, weight, ws, freqs, pos)


def test_walsh_hadamard_natural_order():
    x = torch.randn(3, 128, dtype=torch.float64)
    torch.testing.assert_close(walsh_hadamard(x), x @ _sylvester(128).T)


# ---------------------------------------------------------------------------------------------- registration


def _op_cases():
    kv, weight, freqs, pos, loc, cache = _k_inputs(6, page_size=2)
    g = _gen(3)
    q = torch.randn(3, 2, 512, generator=g)
    qi = torch.randn(3, 2, 128, generator=g, dtype=torch.float32)
    return {
        "fused_k_norm_rope_flashmla": (kv, weight, EPS, freqs, pos, loc, cache, 2),
        "fused_q_norm_rope": (q, torch.empty_like(q), EPS, freqs, pos[:3]),
        "fused_norm_rope_inplace": (kv.contiguous(), weight, EPS, freqs, pos),
        "store_flashmla_cache": (kv, loc, cache.clone(), 2),
        "fused_q_indexer_rope_hadamard_quant": (qi, torch.randn(3, 2, generator=g), 0.01, freqs, pos[:3]),
    }


@pytest.mark.parametrize("name", list(_op_cases()))
def test_opcheck(name):
    torch.library.opcheck(getattr(ops, name).default, _op_cases()[name])


def test_opcheck_indexer_with_a_transposed_weight():
    """`weight` may have any strides; `weights_out` keeps the contiguous strides the fake impl reports."""
    qi, weight, *rest = _op_cases()["fused_q_indexer_rope_hadamard_quant"]
    torch.library.opcheck(ops.fused_q_indexer_rope_hadamard_quant.default, (qi, weight.t().contiguous().t(), *rest))


def test_q_norm_rope_compiles_with_a_data_dependent_row_count():
    """A row count read from a tensor inside a compiled graph (an unbacked SymInt): the fake impl's row-overlap
    check does not guard on it; the output equals eager's."""
    g = _gen(8)
    q = torch.randn(6, 4, 512, generator=g)
    freqs, pos = precompute_freqs(MAX_POS), torch.randint(0, MAX_POS, (6,), generator=g)

    def rotate(count: torch.Tensor) -> torch.Tensor:
        n = count.item()
        torch._check(n >= 0)
        torch._check(n <= 6)
        out = torch.empty(n, 4, 512)
        ops.fused_q_norm_rope(q[:n], out, EPS, freqs, pos[:n])
        return out

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(rotate, backend="aot_eager", fullgraph=True)(torch.tensor(5))
    assert torch.equal(compiled, rotate(torch.tensor(5)))


def test_q_norm_rope_into_the_other_half_of_one_buffer_with_a_data_dependent_row_count():
    """q and q_out the two halves of one `[B, 2, H, 512]` buffer (no byte shared) with an unbacked B: the fake impl's
    shared-memory check does not guard on B (it raised GuardOnDataDependentSymNode); in place is accepted too."""
    env = ShapeEnv()
    freqs, pos = precompute_freqs(MAX_POS), torch.randint(0, MAX_POS, (6,))
    with FakeTensorMode(shape_env=env) as mode:
        fake_freqs = mode.from_tensor(freqs)  # before the unbacked size (torch 2.11 wants no symbol pending then)
        rows = env.create_unbacked_symint()
        torch._check(rows >= 0)
        buf = torch.empty(rows, 2, 4, 512)
        fake_pos = torch.empty(rows, dtype=pos.dtype)
        ops.fused_q_norm_rope(buf[:, 0], buf[:, 1], EPS, fake_freqs, fake_pos)
        q = torch.empty(rows, 4, 512)
        ops.fused_q_norm_rope(q, q, EPS, fake_freqs, fake_pos)


def _mutating_calls():
    return {
        "fused_k_norm_rope_flashmla": lambda kv, w, f, p, loc, c: ops.fused_k_norm_rope_flashmla(
            kv, w, EPS, f, p, loc, c, 2
        ),
        "fused_norm_rope_inplace": lambda kv, w, f, p, loc, c: ops.fused_norm_rope_inplace(kv, w, EPS, f, p),
        "store_flashmla_cache": lambda kv, w, f, p, loc, c: ops.store_flashmla_cache(kv, loc, c, 2),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_mutating_calls()))
def test_compile_fullgraph_no_clone(name):
    call = _mutating_calls()[name]
    kv, weight, freqs, pos, loc, cache = _k_inputs(6, page_size=2)
    kv = kv.contiguous()
    args_eager = (kv.clone(), weight, freqs, pos, loc, cache.clone())
    args_comp = (kv.clone(), weight, freqs, pos, loc, cache.clone())
    call(*args_eager)
    torch._dynamo.reset()
    counters.clear()
    with reinplacing_misses() as misses:
        _, code = run_and_get_code(torch.compile(call, fullgraph=True), *args_comp)
    src = "\n".join(code)
    assert f"torch.ops.dspark.{name}.default(" in src
    assert "clone" not in src and "copy_" not in src
    assert misses["tensors"] == 0
    assert torch.equal(args_eager[0], args_comp[0]) and torch.equal(args_eager[5], args_comp[5])


@pytest.mark.slow
def test_compile_fullgraph_q_ops():
    def f(q, q_out, qi, w, freqs, pos):
        ops.fused_q_norm_rope(q, q_out, EPS, freqs, pos)
        return ops.fused_q_indexer_rope_hadamard_quant(qi, w, 0.01, freqs, pos)

    g = _gen(4)
    q = torch.randn(3, 2, 512, generator=g)
    qi, w = torch.randn(3, 2, 128, generator=g), torch.randn(3, 2, generator=g)
    freqs, pos = precompute_freqs(MAX_POS), torch.tensor([0, 5, 300])
    out_e, out_c = torch.empty_like(q), torch.empty_like(q)
    want = f(q, out_e, qi, w, freqs, pos)
    torch._dynamo.reset()
    counters.clear()
    got, code = run_and_get_code(torch.compile(f, fullgraph=True), q, out_c, qi, w, freqs, pos)
    src = "\n".join(code)
    assert "clone" not in src and "copy_" not in src
    assert torch.equal(out_e, out_c)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


def _bad_k_cases():
    kv, weight, freqs, pos, loc, cache = _k_inputs(4, page_size=2)
    wide = torch.zeros(cache.shape[0], cache.shape[1] + 16, dtype=torch.uint8)[:, : cache.shape[1]]
    return [
        ("kv int", dict(kv=kv.to(torch.int32)), TypeError, "kv must have dtype"),
        ("head_dim", dict(kv=torch.randn(4, 256)), ValueError, r"kv must have shape \(B, 512\)"),
        ("inner stride", dict(kv=torch.randn(512, 4).t()), ValueError, "kv must have a unit stride"),
        ("weight dtype", dict(weight=weight.float()), TypeError, "weight must have dtype"),
        ("weight shape", dict(weight=weight[:256]), ValueError, "weight must have shape"),
        ("freqs shape", dict(freqs=freqs[:, :32].contiguous()), ValueError, "freqs must have shape"),
        ("freqs dtype", dict(freqs=freqs.double()), TypeError, "freqs must have dtype"),
        ("positions dtype", dict(positions=pos.float()), TypeError, "positions must have dtype"),
        ("positions len", dict(positions=pos[:3]), ValueError, "positions must have shape"),
        ("out_loc len", dict(out_loc=loc[:2]), ValueError, "out_loc must have shape"),
        ("out_loc dtype", dict(out_loc=loc.to(torch.int16)), TypeError, "out_loc must have dtype"),
        ("page not pow2", dict(page_size=3), ValueError, "page_size must be a power of two"),
        ("cache bytes", dict(page_size=4), ValueError, "kvcache must have shape"),
        ("cache dtype", dict(kvcache=cache.to(torch.int8)), TypeError, "kvcache must have dtype"),
        ("cache row stride", dict(kvcache=wide), ValueError, "row stride == page bytes"),
        ("device", dict(kvcache=cache.to("meta")), ValueError, "kvcache must be on cpu"),
    ], dict(kv=kv, weight=weight, eps=EPS, freqs=freqs, positions=pos, out_loc=loc, kvcache=cache, page_size=2)


@pytest.mark.parametrize("case", range(16))
def test_k_write_bad_inputs(case):
    cases, base = _bad_k_cases()
    _, change, exc, match = cases[case]
    args = {**base, **change}
    with pytest.raises(exc, match=match):
        ops.fused_k_norm_rope_flashmla(*args.values())


def test_other_ops_bad_inputs():
    freqs, pos = precompute_freqs(MAX_POS), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="q_out must have shape"):
        ops.fused_q_norm_rope(torch.randn(2, 3, 512), torch.empty(2, 2, 512), EPS, freqs, pos)
    with pytest.raises(TypeError, match="q_out must have dtype"):
        ops.fused_q_norm_rope(torch.randn(2, 3, 512), torch.empty(2, 3, 512, dtype=torch.bfloat16), EPS, freqs, pos)
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, 128\)"):
        ops.fused_q_indexer_rope_hadamard_quant(torch.randn(2, 3, 64), torch.randn(2, 3), 0.1, freqs, pos)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.fused_q_indexer_rope_hadamard_quant(torch.randn(2, 3, 128), torch.randn(3, 2), 0.1, freqs, pos)
    with pytest.raises(ValueError, match=r"kv must have shape \(B, 512\)"):
        ops.fused_norm_rope_inplace(torch.randn(2, 576), torch.randn(512), EPS, freqs, pos)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        ops.fused_norm_rope_inplace(torch.randn(2, 512), torch.randn(512), -1.0, freqs, pos)
    with pytest.raises(ValueError, match="kvcache must have strides"):
        ops.store_flashmla_cache(torch.randn(2, 512), pos, torch.zeros(1152, 2, dtype=torch.uint8).t(), 1)


def test_cuda_entry_and_build_errors():
    from custom_ops import _build

    for name in _op_cases():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dspark::{name}", "CompositeExplicitAutograd")
    key = _build.build_key()
    assert len(key) == 16 and key == _build.build_key() and key in str(_build.library_path())
    if torch.version.cuda is None:
        with pytest.raises(_build.BuildError, match="no CUDA support"):
            _build.load()


# ---------------------------------------------------------------------------------------------- CUDA


def _cuda(*ts):
    """CUDA copies keeping strides and storage offsets (kv is a column slice of a wider buffer)."""
    move = LayoutKeepingMove("cuda")
    return tuple(move(t) for t in ts)


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 2, 64, 256])
@pytest.mark.parametrize("b", [1, 7, 300, 4096])
def test_cuda_k_write_matches_reference(b, page_size):
    # every 5th row skipped, except the only row of b = 1 (skipping it would leave no row to compare)
    kv, weight, freqs, pos, loc, cache = _k_inputs(b, page_size=page_size, seed=b, skip_every=5 if b > 1 else 0)
    before = cache.clone()
    want = cache.clone()
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, want, page_size)
    got = cache.cuda()
    ops.fused_k_norm_rope_flashmla(*_cuda(kv, weight, EPS, freqs, pos, loc), got, page_size)
    _assert_cache_acceptance(got.cpu(), want, before, page_size, loc)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("row_stride", [1536, 512, 513])  # 513: unaligned rows, the scalar-load kernel
@pytest.mark.parametrize(("pos_dtype", "loc_dtype"), [(torch.int64, torch.int32), (torch.int32, torch.int64)])
def test_cuda_k_write_dtypes_strides(dtype, row_stride, pos_dtype, loc_dtype):
    kv, weight, freqs, pos, loc, cache = _k_inputs(
        300, dtype=dtype, row_stride=row_stride, pos_dtype=pos_dtype, loc_dtype=loc_dtype, seed=7
    )
    before = cache.clone()
    want = cache.clone()
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, want, 64)
    got = cache.cuda()
    moved = _cuda(kv, weight, EPS, freqs, pos, loc)
    assert moved[0].stride() == (row_stride, 1) and moved[0].storage_offset() == row_stride - 512
    ops.fused_k_norm_rope_flashmla(*moved, got, 64)
    _assert_cache_acceptance(got.cpu(), want, before, 64, loc)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [2, 256])
def test_cuda_store_matches_reference(dtype, page_size):
    kv, _, _, _, loc, cache = _k_inputs(777, dtype=dtype, page_size=page_size, seed=11)
    before = cache.clone()
    want = cache.clone()
    ops.store_flashmla_cache(kv, loc, want, page_size)
    got = cache.cuda()
    ops.store_flashmla_cache(kv.cuda(), loc.cuda(), got, page_size)
    _assert_cache_acceptance(got.cpu(), want, before, page_size, loc)


def _assert_rows_close(got, want, dtype):
    torch.testing.assert_close(got.double(), want.double(), rtol=2 * _tol(dtype), atol=4 * _tol(dtype))
    assert (got == want).float().mean() >= 0.999


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [1, 8, 64])
def test_cuda_q_norm_rope_matches_reference(dtype, heads):
    g = _gen(heads)
    b = 37
    q = torch.randn(b, heads, 512, generator=g).to(dtype)
    freqs = precompute_freqs(MAX_POS)
    pos = torch.randint(0, MAX_POS, (b,), generator=g).to(torch.int32)
    want = torch.empty_like(q)
    ops.fused_q_norm_rope(q, want, EPS, freqs, pos)
    wide = torch.full((b, heads + 3, 512), float("nan"), dtype=dtype, device="cuda")
    ops.fused_q_norm_rope(q.cuda(), wide[:, 2 : heads + 2], EPS, freqs.cuda(), pos.cuda())
    wide = wide.cpu()
    assert wide[:, :2].isnan().all() and wide[:, heads + 2 :].isnan().all()
    _assert_rows_close(wide[:, 2 : heads + 2], want, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_norm_rope_inplace_matches_reference(dtype):
    kv, weight, freqs, pos, _, _ = _k_inputs(1000, dtype=dtype, row_stride=512, seed=5)
    got = kv.cuda()
    ops.fused_norm_rope_inplace(kv, weight, EPS, freqs, pos)
    ops.fused_norm_rope_inplace(got, *_cuda(weight, EPS, freqs, pos))
    _assert_rows_close(got.cpu(), kv, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_indexer_matches_reference(dtype):
    g = _gen(9)
    b, h = 129, 64
    q = torch.randn(b, h, 128, generator=g).to(dtype)
    weight = torch.randn(b, h, generator=g).to(dtype)
    freqs = precompute_freqs(MAX_POS)
    pos = torch.randint(0, MAX_POS, (b,), generator=g)
    ws = 128**-0.5 * 64**-0.5
    want_q, want_w = ops.fused_q_indexer_rope_hadamard_quant(q, weight, ws, freqs, pos)
    got_q, got_w = ops.fused_q_indexer_rope_hadamard_quant(*_cuda(q, weight, ws, freqs, pos))
    got_q, got_w = got_q.cpu(), got_w.cpu()
    assert ((_fp8_ordinal(got_q.view(torch.uint8)) - _fp8_ordinal(want_q.view(torch.uint8))).abs() <= 1).all()
    assert (got_q.view(torch.uint8) == want_q.view(torch.uint8)).float().mean() >= 0.99
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)


@pytest.mark.cuda
def test_cuda_empty_batch_and_bad_inputs():
    kv, weight, freqs, pos, loc, cache = _cuda(*_k_inputs(0))
    before = cache.clone()
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, 64)
    torch.cuda.synchronize()
    assert torch.equal(cache, before)
    kv, weight, freqs, pos, loc, cache = _cuda(*_k_inputs(4, page_size=2))
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, 3)
    with pytest.raises(TypeError, match="kv must have dtype"):
        ops.fused_k_norm_rope_flashmla(kv.int(), weight, EPS, freqs, pos, loc, cache, 2)
    with pytest.raises(ValueError, match="kvcache must be on cuda"):
        ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache.cpu(), 2)
    with pytest.raises(ValueError, match=r"kv must have shape \(B, 512\)"):
        ops.store_flashmla_cache(kv[:, :256], loc, cache, 2)


@pytest.mark.cuda
def test_cuda_registered_from_cpp_after_first_use():
    from custom_ops import _build

    kv, weight, freqs, pos, loc, cache = _cuda(*_k_inputs(3))
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, 64)
    assert _build.is_loaded()
    for name in _op_cases():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dspark::{name}", "CUDA")


@pytest.mark.cuda
def test_cuda_graph_capture_replay():
    b, page_size = 64, 256
    static = _cuda(*_k_inputs(b, page_size=page_size, seed=1))
    kv, weight, freqs, pos, loc, cache = static
    q = torch.randn(b, 4, 512, device="cuda", dtype=torch.bfloat16)
    q_out = torch.empty_like(q)
    qi = torch.randn(b, 8, 128, device="cuda", dtype=torch.bfloat16)
    qw = torch.randn(b, 8, device="cuda", dtype=torch.bfloat16)
    normed = torch.empty(b, 512, device="cuda", dtype=torch.bfloat16)
    cache_unfused = cache.clone()

    def step():
        ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, page_size)
        ops.fused_q_norm_rope(q, q_out, EPS, freqs, pos)
        normed.copy_(kv)
        ops.fused_norm_rope_inplace(normed, weight, EPS, freqs, pos)
        ops.store_flashmla_cache(normed, loc, cache_unfused, page_size)
        return ops.fused_q_indexer_rope_hadamard_quant(qi, qw, 0.01, freqs, pos)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture (first use builds/loads the library)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()

    new = _cuda(*_k_inputs(b, page_size=page_size, seed=2))
    for dst, src in zip(static, new, strict=True):
        if isinstance(dst, torch.Tensor) and dst is not freqs:
            dst.copy_(src)
    q.copy_(torch.randn_like(q))
    qi.copy_(torch.randn_like(qi))
    cache_unfused.copy_(cache)
    snapshot = [t.clone() for t in (cache, cache_unfused)]
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in (cache, cache_unfused, q_out, *graph_out)]

    cache.copy_(snapshot[0])
    cache_unfused.copy_(snapshot[1])
    eager_out = step()
    torch.cuda.synchronize()
    for r, e in zip(replayed, (cache, cache_unfused, q_out, *eager_out), strict=True):
        assert torch.equal(
            r.view(torch.uint8) if r.dtype == torch.float8_e4m3fn else r,
            e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e,
        )


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_compile_fullgraph_no_clone():
    kv, weight, freqs, pos, loc, cache = _cuda(*_k_inputs(32, page_size=64, seed=3))
    want = cache.clone()
    ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, want, 64)

    def f(kv, weight, freqs, pos, loc, cache):
        ops.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs, pos, loc, cache, 64)

    torch._dynamo.reset()
    counters.clear()
    with reinplacing_misses() as misses:
        _, code = run_and_get_code(torch.compile(f, fullgraph=True), kv, weight, freqs, pos, loc, cache)
    src = "\n".join(code)
    assert "clone" not in src and "copy_" not in src
    assert misses["tensors"] == 0
    assert torch.equal(cache, want)
