"""The DeepSeek-V4 compression CUDA kernels, compiled for the host and checked on CPU.

The kernel headers (`custom_ops/csrc/dsv4/dsv4_compress*_kernels.cuh`) are plain CUDA without torch. Here they are
compiled with g++ against a small shim of the CUDA built-ins they use (one fiber per CUDA thread, barriers
for `__syncthreads` and warp shuffles, bf16 / e4m3 conversions with round-to-nearest-even) and run on CPU
tensors. This checks the kernels' indexing, plan handling and write/compress ordering on machines without a GPU:
the planners must write the composite planners' bytes, compression must reproduce the fp64 whole-sequence ground
truth through prefill / extend / decode sessions, and the store must write the CPU reference's bytes. Numerics of
the real GPU (fast exp, FMA contraction) are checked by the CUDA tests. Skipped without a C++20 compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import random

import dsv4_cases as ref
import pytest
import torch
from dsv4_cases import (
    STORE_FREQS,
    STORE_PAGE,
    Session,
    assert_same_store_coding,
    audit_skipped_requests,
    corruption_case,
    make_inputs,
    plan_corruptions,
    planner_problem_stages,
    plant_non_finite_rows,
    run_compress,
    store_case,
    storing_rows,
)
from dsv4_emulation_shim import SHIM
from emulation_build import compile_emulation

import custom_ops  # noqa: F401
from custom_ops.dsv4 import compressor
from custom_ops.dsv4 import plan as cp
from custom_ops.dsv4.common import read_compress_plan, read_decode_plan
from custom_ops.dsv4.store import compress_norm_rope_store

pytestmark = (
    pytest.mark.slow
)  # a kernel emulation builds a C++ library (seconds cold): the full run, or this file alone when editing a kernel

DRIVER = r"""
#include "dsv4/dsv4_compress_plan_kernels.cuh"
#include "dsv4/dsv4_compress_store_kernels.cuh"
#include <type_traits>
#include <vector>
using namespace dspark::dsv4;

// Runs `blocks` blocks one after the other, each with `threads` fibers (or sequentially if `serial`).
template <typename F>
static void launch(int64_t blocks, int threads, bool serial, F&& kernel) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (serial) {
      for (int t = 0; t < threads; ++t) { gridDim.x = blocks; blockIdx.x = b; threadIdx.x = t; kernel(); }
      continue;
    }
    EmuBarrier block(threads);
    std::vector<std::unique_ptr<EmuBarrier>> warps;
    std::vector<double> lanes(threads);
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<EmuBarrier>(32));
    emu_launch_threads(size_t(threads), [&](size_t t) {
      gridDim.x = blocks; blockIdx.x = b; threadIdx.x = t;
      g_block = &block; g_warp = warps[t / 32].get(); g_lanes = &lanes[t / 32 * 32];
      kernel();
    });
  }
}
static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// SM count the c128 launch shape is chosen for (c128_splits), set from Python to exercise every channel split;
// the split counts used since the last emu_take_splits (a bit mask of the powers of two) tell Python which ran.
static int g_num_sms = 132;
static int g_splits_seen = 0;
extern "C" void emu_set_num_sms(int n) { g_num_sms = n; }
extern "C" int emu_take_splits() { const int seen = g_splits_seen; g_splits_seen = 0; return seen; }
static void launch_c128(int64_t rows, int d, void (*kernel)(CompressArgs, int), const CompressArgs& a) {
  const int splits = c128_splits(rows, d, g_num_sms);
  if (rows > 0) g_splits_seen |= splits;
  launch(rows * splits, kC128Threads, false, [&] { kernel(a, splits); });
}

extern "C" void emu_offline(int c4, int decode, int state_bf16, int vec, void* state, int64_t state_rows,
                            const float* input, int64_t input_rows, int64_t in_stride, float* out, const float* ape,
                            const void* plan, int rows, const void* plan_w, int rows_w, int d) {
  const CompressArgs a{state, input, out, ape, plan, in_stride, state_rows, input_rows, rows, d};
  const CompressArgs w{state, input, nullptr, ape, plan_w, in_stride, state_rows, input_rows, rows_w, d};
  const int64_t warps_per_row = d / kSplit, width = (c4 ? 4 : 2) * d;
  auto run = [&](auto ts, auto kv) {
    using TS = decltype(ts);
    constexpr bool V = decltype(kv)::value;
    const int64_t c4_blocks = cdiv(rows * warps_per_row * 32, kC4Threads);
    if (c4 && decode) launch(c4_blocks, kC4Threads, true, [&] { c4_kernel<true, TS, float, V>(a); });
    if (c4 && !decode) launch(c4_blocks, kC4Threads, true, [&] { c4_kernel<false, TS, float, V>(a); });
    if (!c4 && decode) launch_c128(rows, d, c128_kernel<C128Mode::kDecode, TS, float, V>, a);
    if (!c4 && !decode) launch_c128(rows, d, c128_kernel<C128Mode::kPrefill, TS, float, V>, a);
    if (!decode) {
      const int64_t copy_blocks = std::min<int64_t>(cdiv(rows_w * 32, kCopyThreads), 3);  // grid-stride loop
      launch(copy_blocks, kCopyThreads, true, [&] { write_rows_kernel<TS, float, V>(w, width); });
    }
  };
  auto pick = [&](auto ts) { if (vec) run(ts, std::true_type{}); else run(ts, std::false_type{}); };
  if (state_bf16) pick(__nv_bfloat16{}); else pick(float{});
}

extern "C" void emu_online(int decode, float* state, int64_t state_rows, const float* input, int64_t input_rows,
                           int64_t in_stride, float* out, const float* ape, const void* plan, int rows,
                           const void* plan_w, int rows_w, int d) {
  const CompressArgs a{state, input, out, ape, plan, in_stride, state_rows, input_rows, rows, d};
  const CompressArgs w{state, input, nullptr, ape, plan_w, in_stride, state_rows, input_rows, rows_w, d};
  if (decode) {
    launch(cdiv(rows * d / 4, kCopyThreads), kCopyThreads, true, [&] { online_decode_kernel<float, true>(a); });
    return;
  }
  launch_c128(rows, d, c128_kernel<C128Mode::kOnlineCompress, float, float, true>, a);
  launch_c128(rows_w, d, c128_kernel<C128Mode::kOnlineWrite, float, float, true>, w);
}

extern "C" void emu_plan(int online, int prefill, const int64_t* seq, const int64_t* ext, const int64_t* rid,
                         const int64_t* r2t, int64_t r2t_rows, int64_t r2t_cols, const int64_t* f2s, int64_t f2s_len,
                         int64_t batch, int ratio, int ring, int swa, int64_t n, int64_t rows_c, int64_t rows_w,
                         int64_t* ends, void* plan_c, void* plan_w, int64_t seq_max, int64_t rid_hi, int64_t swa_hi,
                         unsigned long long* problem) {
  PlanDecodeArgs d{};
  d.seq_lens = {seq, true};
  d.rids = {rid, true};
  d.req_to_token = {r2t, true};
  d.full_to_state = {f2s, true};
  d.r2t_rows = r2t_rows; d.r2t_cols = r2t_cols; d.f2s_len = f2s_len; d.batch = batch;
  d.ratio = ratio; d.ring = ring; d.swa_page = swa;
  d.seq_max = seq_max; d.rid_hi = rid_hi; d.swa_hi = swa_hi; d.problem = problem;
  d.out = static_cast<DecodePlan*>(plan_c);
  if (!prefill) {
    launch(cdiv(batch, kPlanThreads), kPlanThreads, true, [&] {
      if (online) plan_decode_kernel<true>(d); else plan_decode_kernel<false>(d);
    });
    return;
  }
  PlanPrefillArgs a{d, {ext, true}, n, rows_c, rows_w, ends, static_cast<CompressPlan*>(plan_c), plan_w};
  launch(1, kPrefillThreads, false, [&] {
    if (online) plan_prefill_kernel<true>(a); else plan_prefill_kernel<false>(a);
  });
}

extern "C" void emu_store(const float* kv, const uint8_t* plan, const float* w, float eps, const float* freqs,
                          const int64_t* out_loc, int64_t loc_len, uint8_t* cache, int64_t page_bytes, int log2ps,
                          int64_t num_slots, int64_t max_pos, int64_t rows, int ratio, int decode, int d, int fp4) {
  const StoreArgs a{kv,    plan,       w,      eps,       freqs,   out_loc, true, loc_len,     cache,
                    page_bytes, log2ps, num_slots, max_pos, rows, ratio, bool(decode)};
  launch(cdiv(rows, kStoreWarps), kStoreThreads, false, [&] {
    if (d == 512) store_flashmla_kernel(a);
    else if (fp4) store_indexer_kernel<true>(a);
    else store_indexer_kernel<false>(a);
  });
}
"""


@pytest.fixture(scope="module")
def emu(emulation_cache):
    return compile_emulation(emulation_cache, SHIM, DRIVER, "dsv4emu")


i64, i32 = ctypes.c_int64, ctypes.c_int


def _p(t: torch.Tensor | None):
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def _i64(t: torch.Tensor | None):
    return None if t is None else t.long().contiguous()


def _tensor_args(state, kv, out, ape, plan, plan_w):
    """The arguments emu_offline and emu_online share, after their flags."""
    return (
        _p(state),
        i64(state.shape[0]),
        _p(kv),
        i64(kv.shape[0]),
        i64(kv.stride(0)),
        _p(out),
        _p(ape),
        _p(plan),
        i32(plan.shape[0]),
        _p(plan_w),
        i32(plan_w.shape[0]),
        i32(ape.shape[1]),
    )


def _emu_offline(emu, decode, state, kv, ape, plan, plan_w, ratio, vec=True):
    """An emulated offline compress op (outputs start as NaN)."""
    out = torch.full((plan.shape[0], ape.shape[1]), float("nan"))
    plan_w = plan_w if plan_w is not None else torch.zeros(0, 8, dtype=torch.uint8)
    flags = (i32(ratio == 4), i32(decode), i32(state.dtype == torch.bfloat16), i32(vec))
    emu.emu_offline(*flags, *_tensor_args(state, kv, out, ape, plan, plan_w))
    return out


def _emu_online(emu, decode, state, kv, ape, plan, plan_w):
    """An emulated online compress op (outputs start as NaN)."""
    out = torch.full((plan.shape[0], ape.shape[1]), float("nan"))
    plan_w = plan_w if plan_w is not None else torch.zeros(0, 16, dtype=torch.uint8)
    emu.emu_online(i32(decode), *_tensor_args(state, kv, out, ape, plan, plan_w))
    return out


def _install(emu, monkeypatch, vec: bool = True, num_sms: int = 132) -> None:
    """Route the Session driver's compress calls to the emulated kernels; the c128 launch shape is chosen as for a
    GPU with `num_sms` SMs."""
    emu.emu_set_num_sms(i32(num_sms))
    monkeypatch.setattr(
        ref, "compress_decode", lambda s, kv, ape, plan, r: _emu_offline(emu, 1, s, kv, ape, plan, None, r, vec)
    )
    monkeypatch.setattr(
        ref, "compress_prefill", lambda s, kv, ape, pc, pw, r: _emu_offline(emu, 0, s, kv, ape, pc, pw, r, vec)
    )
    monkeypatch.setattr(
        ref, "online_compress_decode", lambda s, kv, ape, plan: _emu_online(emu, 1, s, kv, ape, plan, None)
    )
    monkeypatch.setattr(
        ref, "online_compress_prefill", lambda s, kv, ape, pc, pw: _emu_online(emu, 0, s, kv, ape, pc, pw)
    )


def _random_session(ratio, mode, online, d, seed, state_dtype=torch.float32, long=False) -> Session:
    rng = random.Random(seed)
    lengths = [rng.randint(300, 420) if long else rng.randint(2 * ratio, 3 * ratio + 7) for _ in range(3)]
    kvs, ape = make_inputs(ratio, d, lengths, seed=seed, bf16_exact=state_dtype == torch.bfloat16)
    s = Session(kvs, ape, ratio, mode, online=online, state_dtype=state_dtype, seed=seed)
    while s.cur != lengths:
        left = [n - c for n, c in zip(lengths, s.cur, strict=True)]
        if rng.random() < 0.4:
            s.decode([x > 0 and rng.random() < 0.75 for x in left])
        else:
            choices = [0, 1, rng.randint(1, ratio + 3), rng.randint(1, 2 * ratio + 9), rng.randint(1, 300)]
            s.extend([min(x, rng.choice(choices)) for x in left], pad=rng.randint(0, 2))
    s.check()
    return s


@pytest.mark.parametrize(
    ("ratio", "mode", "state_dtype", "vec", "d", "num_sms"),
    [
        (4, "ring", torch.float32, True, 128, 132),
        (4, "paged", torch.bfloat16, True, 128, 132),
        (4, "ring", torch.float32, False, 128, 132),
        (128, "paged", torch.float32, True, 128, 132),
        (128, "ring", torch.bfloat16, False, 128, 132),
        (128, "ring", torch.float32, True, 512, 6),  # 1 or 2 channel splits: 3 requests, so 3+ plan rows per call
    ],
)
def test_emulated_compress_kernels_match_fp64(emu, monkeypatch, ratio, mode, state_dtype, vec, d, num_sms):
    _install(emu, monkeypatch, vec, num_sms)
    _random_session(ratio, mode, False, d, seed=ratio, state_dtype=state_dtype, long=ratio == 4)


@pytest.mark.parametrize(("d", "num_sms"), [(128, 132), (512, 6)])
def test_emulated_online_kernels_match_fp64(emu, monkeypatch, d, num_sms):
    _install(emu, monkeypatch, num_sms=num_sms)
    _random_session(128, "ring", True, d, seed=3, long=True)


@pytest.mark.parametrize(("online", "mode"), [(False, "paged"), (True, "ring")])
def test_emulated_c128_decode_closes_windows_with_4_channel_splits(emu, monkeypatch, online, mode):
    """One request extends to the last token but one of a window and decodes the token that closes it, twice: the
    c128 decode kernels' entries are checked (the random sessions close c128 windows only in extends). Head dim 512
    on 6 SMs with 1-2 plan rows per call: every c128 launch (offline compress, online prefill) splits the channels
    4 ways."""
    _install(emu, monkeypatch, num_sms=6)
    kvs, ape = make_inputs(128, 512, [256], seed=11)
    s = Session(kvs, ape, 128, mode, online=online, seed=11)
    emu.emu_take_splits()
    for _ in range(2):
        s.extend([127], pad=1)
        s.decode()
    assert s.decode_entries == 2
    assert emu.emu_take_splits() == 4, "a c128 launch ran with other than 4 channel splits"
    s.check()


def _emu_compress(emu, online, decode, state, kv, ape, plans, ratio):
    plan_w = None if decode else plans[1]
    if online:
        return _emu_online(emu, decode, state, kv, ape, plans[0], plan_w)
    return _emu_offline(emu, decode, state, kv, ape, plans[0], plan_w, ratio)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(("ratio", "online"), [(4, False), (128, False), (128, True)])
def test_emulated_compress_kernels_skip_out_of_range_plan_rows(emu, ratio, online, decode):
    """A plan row that would read or write outside the state or the input: the CPU path raises naming the field;
    the kernels skip the row and leave exactly what the CPU path leaves for the plan with that row neutralized."""
    g = torch.Generator().manual_seed(ratio + 2 * online + decode)
    state, kv, ape, plans = corruption_case(ratio, online, decode, g)
    for field, corrupt in plan_corruptions(ratio, online, decode, state, kv):
        bad, good = [p.clone() for p in plans], [p.clone() for p in plans]
        corrupt([p.view(torch.int32) for p in bad], [p.view(torch.int32) for p in good])
        before = state.clone()
        with pytest.raises(ValueError, match=rf"\]\.{field} = -?\d+ is out of range"):
            run_compress(online, decode, state, kv, ape, bad, ratio)
        assert torch.equal(state, before), "the CPU path wrote before raising"
        want_state = state.clone()
        want = run_compress(online, decode, want_state, kv, ape, good, ratio)
        assert want.any(), f"{field}: no entry left to compare"
        got_state = state.clone()
        got = _emu_compress(emu, online, decode, got_state, kv, ape, bad, ratio)
        exact = 1e-5 if online else 0.0
        torch.testing.assert_close(got_state, want_state, atol=exact, rtol=exact, msg=field)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=field)


def _emu_plans(emu, online, prefill, seq, ext, rid, r2t, f2s, ratio, ring, swa, n, like_c, like_w, check):
    """Run an emulated planner kernel; returns its plans and, with `check`, the reported (rank, flat index)."""
    seq, ext, rid, r2t, f2s = (_i64(t) for t in (seq, ext, rid, r2t, f2s))
    got_c = torch.empty_like(like_c)
    got_w = torch.empty_like(like_w) if like_w is not None else None
    ends = torch.empty(seq.shape[0], dtype=torch.int64)
    rows, cols = r2t.shape if r2t is not None else (0, 0)
    addr = None if online else cp._Addressing(r2t, f2s, ratio, ring, swa)
    seq_max, rid_hi = cp._seq_limit(addr)[0], cp._request_limit(addr)[0]
    swa_hi = (cp.STATE_ROWS // ring) * swa if r2t is not None else 0
    problem = torch.tensor([NO_PROBLEM], dtype=torch.int64)
    emu.emu_plan(
        i32(online),
        i32(prefill),
        _p(seq),
        _p(ext),
        _p(rid),
        _p(r2t),
        i64(rows),
        i64(cols),
        _p(f2s),
        i64(f2s.shape[0] if f2s is not None else 0),
        i64(seq.shape[0]),
        i32(ratio),
        i32(ring),
        i32(swa),
        i64(n),
        i64(like_c.shape[0]),
        i64(like_w.shape[0] if like_w is not None else 0),
        _p(ends),
        _p(got_c),
        _p(got_w),
        i64(seq_max),
        i64(rid_hi),
        i64(swa_hi),
        _p(problem if check else None),
    )
    key = int(problem)
    reported = None if key == NO_PROBLEM else (key >> 56, key & ((1 << 56) - 1))
    return got_c, got_w, reported


NO_PROBLEM = 2**63 - 1


def _expect_problem(problems: cp.Problems, reported) -> None:
    """The kernel reported the CPU path's first problem (rank and flat index)."""
    first = problems.first()
    assert reported == (None if first is None else (first.rank, first.flat)), (reported, first)


def _check_planners(emu, seq, ext, rid, tables, ratio, ring, n, check) -> None:
    """The emulated offline planners write the bytes of the CUDA-semantics reference and, with `check`, report its
    first problem."""
    swa = 256 if tables[0] is not None else 0
    want, problems = cp.decode_plan_unchecked(seq, rid, *tables, ratio, ring, swa)
    got, _, reported = _emu_plans(emu, 0, 0, seq, ext, rid, *tables, ratio, ring, swa, 0, want, None, check)
    assert torch.equal(got, want)
    if check:
        _expect_problem(problems, reported)
    (want_c, want_w), problems = cp.prefill_plan_unchecked(seq, ext, rid, *tables, ratio, ring, swa, n)
    got_c, got_w, reported = _emu_plans(emu, 0, 1, seq, ext, rid, *tables, ratio, ring, swa, n, want_c, want_w, check)
    assert torch.equal(got_c, want_c) and torch.equal(got_w, want_w)
    if check:
        _expect_problem(problems, reported)


def _check_online_planners(emu, seq, ext, rid, n, check) -> None:
    want, problems = cp.online_decode_plan_unchecked(seq, rid)
    got, _, reported = _emu_plans(emu, 1, 0, seq, ext, rid, None, None, 128, 1, 0, 0, want, None, check)
    assert torch.equal(got, want)
    if check:
        _expect_problem(problems, reported)
    (want_c, want_w), problems = cp.online_prefill_plan_unchecked(seq, ext, rid, n)
    got_c, got_w, reported = _emu_plans(emu, 1, 1, seq, ext, rid, None, None, 128, 1, 0, n, want_c, want_w, check)
    assert torch.equal(got_c, want_c) and torch.equal(got_w, want_w)
    if check:
        _expect_problem(problems, reported)


@pytest.mark.parametrize("batch", [0, 3, 1100])
def test_emulated_planner_kernels_write_the_reference_bytes(emu, batch):
    """Random batches whose positions partly run past the page table (rows skipped, the first one reported)."""
    g = torch.Generator().manual_seed(batch)
    seq = torch.randint(0, 1500, (batch,), generator=g)
    ext = torch.minimum(seq, torch.randint(0, 300 if batch < 100 else 20, (batch,), generator=g))
    rid = torch.randint(-1, 10, (batch,), generator=g).to(torch.int32)
    n = int(ext.sum()) + 3
    r2t = (torch.arange(10)[:, None] * 2048 + torch.arange(1024)).to(torch.int32)
    full = torch.arange(10 * 2048)
    f2s = torch.randperm(80, generator=g)[full // 256] * 256 + full % 256
    f2s[::131] = -1
    check = batch < 100  # checking mode costs a second pass over the requests
    for ratio, ring in ((4, 8), (128, 256)):
        for tables in ((None, None), (r2t, f2s)):
            _check_planners(emu, seq, ext, rid, tables, ratio, ring, n, check)
    _check_online_planners(emu, seq, ext, rid, n, check)


def test_emulated_planners_skip_and_report_out_of_range_values(emu):
    """The kernels skip exactly the rows the reference skips and report the problem the CPU path raises."""
    ranks = []
    for seq, ext, rid, r2t, f2s, n in planner_problem_stages():
        ranks.append(cp.prefill_plan_unchecked(seq, ext, rid, r2t, f2s, 4, 8, 256, n)[1].first().rank)
        for ratio, ring in ((4, 8), (128, 128)):
            for tables in ((None, None), (r2t, f2s)):
                _check_planners(emu, seq, ext, rid, tables, ratio, ring, n, True)
        _check_online_planners(emu, seq, ext, rid, n, True)
    assert ranks == list(range(7))


def _emu_store(emu, kv, plan, w, freqs, out_loc, cache, decode, fp4, ratio=4, eps=1e-6) -> None:
    out_loc = out_loc.long().contiguous()
    emu.emu_store(
        _p(kv),
        _p(plan),
        _p(w),
        ctypes.c_float(eps),
        _p(freqs),
        _p(out_loc),
        i64(out_loc.shape[0]),
        _p(cache),
        i64(cache.shape[1]),
        i32(STORE_PAGE.bit_length() - 1),
        i64(cache.shape[0] * STORE_PAGE),
        i64(freqs.shape[0]),
        i64(kv.shape[0]),
        i32(ratio),
        i32(decode),
        i32(kv.shape[1]),
        i32(fp4),
    )


STORE_LAYOUTS = [(512, False), (128, False), (128, True)]


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(("d", "fp4"), STORE_LAYOUTS)
def test_emulated_store_kernels_write_the_reference_bytes(emu, d, fp4, decode):
    kv, plan, w, out_loc, cache = store_case(d, fp4, decode)
    before = cache.clone()
    want = cache.clone()
    compress_norm_rope_store(kv, plan, w, 1e-6, STORE_FREQS, out_loc, want, STORE_PAGE, 4, decode, fp4)
    assert not torch.equal(want, before)
    _emu_store(emu, kv, plan, w, STORE_FREQS, out_loc, cache, decode, fp4)
    assert torch.equal(cache, want)


@pytest.mark.parametrize(("d", "fp4"), STORE_LAYOUTS)
def test_emulated_store_kernels_code_non_finite_rows_as_the_reference(emu, d, fp4):
    """Rows with a NaN or an infinity (normalized: NaN, or zeros and a NaN): the kernel writes the reference's
    scale bytes (made from the amax without the NaN) and codes the same values (an FP4 NaN coded 0)."""
    kv, plan, w, out_loc, cache = store_case(d, fp4, False)
    slots = plant_non_finite_rows(kv, plan, out_loc, False)
    want = cache.clone()
    compress_norm_rope_store(kv, plan, w, 1e-6, STORE_FREQS, out_loc, want, STORE_PAGE, 4, False, fp4)
    _emu_store(emu, kv, plan, w, STORE_FREQS, out_loc, cache, False, fp4)
    assert_same_store_coding(cache, want, slots, d, fp4)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(("d", "fp4"), STORE_LAYOUTS)
def test_emulated_store_kernels_skip_slots_past_the_cache(emu, d, fp4, decode):
    """Slots at the cache's end, 2^40 and 2^62 + 5 (whose byte offset overflows int64 and used to land in another
    page): the CPU path raises naming out_loc; the kernel writes the CPU path's bytes for those slots set to -1."""
    kv, plan, w, out_loc, cache = store_case(d, fp4, decode)
    rows, source = storing_rows(plan, out_loc, decode)
    picks = source[rows[torch.tensor([0, 1, -1])]]
    bad = out_loc.clone()
    bad[picks] = torch.tensor([32 * STORE_PAGE, 2**40, 2**62 + 5])
    with pytest.raises(ValueError, match=rf"out_loc\[\d+\] = \d+ is out of range: expected < {32 * STORE_PAGE} "):
        compress_norm_rope_store(kv, plan, w, 1e-6, STORE_FREQS, bad, cache.clone(), STORE_PAGE, 4, decode, fp4)
    want = cache.clone()
    compress_norm_rope_store(
        kv, plan, w, 1e-6, STORE_FREQS, bad.masked_fill(bad >= 32 * STORE_PAGE, -1), want, STORE_PAGE, 4, decode, fp4
    )
    _emu_store(emu, kv, plan, w, STORE_FREQS, bad, cache, decode, fp4)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(("d", "fp4"), STORE_LAYOUTS)
def test_emulated_store_kernels_skip_positions_past_freqs(emu, d, fp4, decode):
    """A RoPE position past the freqs table: the CPU path raises naming the plan's seq_len; the kernel skips the row
    (it used to read past the table)."""
    kv, plan, w, out_loc, cache = store_case(d, fp4, decode)
    rows, source = storing_rows(plan, out_loc, decode)
    pos = read_compress_plan(plan).seq_len[rows] - 4 if not decode else read_decode_plan(plan).seq_len[rows] - 4
    max_pos = int(pos.median())
    freqs = STORE_FREQS[:max_pos].contiguous()
    with pytest.raises(ValueError, match=r"plan\[\d+\]\.seq_len = \d+ is out of range"):
        compress_norm_rope_store(kv, plan, w, 1e-6, freqs, out_loc, cache.clone(), STORE_PAGE, 4, decode, fp4)
    skipped = out_loc.clone()
    skipped[source[rows[pos >= max_pos]]] = -1
    want = cache.clone()
    compress_norm_rope_store(kv, plan, w, 1e-6, freqs, skipped, want, STORE_PAGE, 4, decode, fp4)
    assert not torch.equal(want, cache)
    _emu_store(emu, kv, plan, w, freqs, out_loc, cache, decode, fp4)
    assert torch.equal(cache, want)


@contextlib.contextmanager
def _compressor_on_kernels(emu):
    """`DSV4Compressor` as on CUDA without checking mode: no value checks, its ops routed to the emulated kernels."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compressor, "must_check_values", lambda t: False)
        mp.setattr(compressor, "compress_decode", lambda s, kv, a, p, r: _emu_offline(emu, 1, s, kv, a, p, None, r))
        mp.setattr(
            compressor, "compress_prefill", lambda s, kv, a, pc, pw, r: _emu_offline(emu, 0, s, kv, a, pc, pw, r)
        )
        mp.setattr(compressor, "online_compress_decode", lambda s, kv, a, p: _emu_online(emu, 1, s, kv, a, p, None))
        mp.setattr(
            compressor, "online_compress_prefill", lambda s, kv, a, pc, pw: _emu_online(emu, 0, s, kv, a, pc, pw)
        )

        def store(kv, plan, w, eps, freqs, out_loc, cache, page_size, ratio, decode, fp4=False):
            assert page_size == STORE_PAGE
            _emu_store(emu, kv, plan, w, freqs, out_loc, cache, decode, fp4, ratio, eps)

        mp.setattr(compressor, "compress_norm_rope_store", store)
        yield


@pytest.mark.parametrize(
    ("ratio", "online", "d"), [(4, False, 512), (4, False, 128), (128, False, 128), (128, True, 128)]
)
def test_emulated_compressor_skips_requests_past_the_state_and_reports_them_invalid(emu, ratio, online, d):
    """A request past the state (and a padding request, and a -1 slot) through prefill and decode steps with the
    compressor's CUDA semantics on the emulated kernels: its rows are invalid with zero entries, nothing of it is read
    or written (state and cache equal the CPU run without it; its slots keep the poison byte for byte). On the base
    code its rows were valid, windows 0 and 2 (c4) with zero entries, and the store wrote them."""
    emu.emu_set_num_sms(i32(132))
    audit_skipped_requests(ratio, online, d, "cpu", functools.partial(_compressor_on_kernels, emu))
