"""The DeepSeek-V4 compression CUDA kernels, compiled for the host and checked on CPU.

The kernel headers (`custom_ops/csrc/dsv4_compress*_kernels.cuh`) are plain CUDA without torch. Here they are
compiled with g++ against a small shim of the CUDA built-ins they use (one OS thread per CUDA thread, barriers
for `__syncthreads` and warp shuffles, bf16 / e4m3 conversions with round-to-nearest-even) and run on CPU
tensors. This checks the kernels' indexing, plan handling and write/compress ordering on machines without a GPU:
the planners must write the composite planners' bytes, compression must reproduce the fp64 whole-sequence ground
truth through prefill / extend / decode sessions, and the store must write the CPU reference's bytes. Numerics of
the real GPU (fast exp, FMA contraction) are checked by the CUDA tests. Skipped without a C++20 compiler.
"""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
from pathlib import Path

import dsv4_cases as ref
import pytest
import torch
from dsv4_cases import Session, make_inputs

import custom_ops  # noqa: F401
from custom_ops import dsv4_compress_plan as cp
from custom_ops.dsv4_compress_common import read_compress_plan, read_decode_plan
from custom_ops.dsv4_compress_plan import plan_decode, plan_online_decode, plan_online_prefill, plan_prefill
from custom_ops.dsv4_compress_store import cache_page_bytes, compress_norm_rope_store, row_slots, stored_rows
from custom_ops.rope import precompute_freqs

CSRC = Path(__file__).resolve().parents[1] / "custom_ops" / "csrc"

SHIM = {
    "cuda_runtime.h": r"""
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
struct Dim { unsigned x = 0; };
inline thread_local Dim threadIdx, blockIdx, gridDim;
inline thread_local std::barrier<>* g_block = nullptr;
inline thread_local std::barrier<>* g_warp = nullptr;
inline thread_local double* g_lanes = nullptr;
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline float __expf(float x) { return std::exp(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __double2float_rn(double d) { return float(d); }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
template <typename T> inline T lane_exchange(T v, int src, bool take) {
  const int lane = threadIdx.x & 31;
  std::memcpy(&g_lanes[lane], &v, sizeof(T));
  g_warp->arrive_and_wait();
  T r = v;
  if (take) std::memcpy(&r, &g_lanes[src], sizeof(T));
  g_warp->arrive_and_wait();
  return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int m) {
  return lane_exchange(v, (threadIdx.x & 31) ^ m, true);
}
template <typename T> inline T __shfl_up_sync(unsigned, T v, int o) {
  const int lane = threadIdx.x & 31;
  return lane_exchange(v, lane - o, lane >= o);
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  std::atomic_ref<unsigned long long> word(*p);
  unsigned long long old = word.load();
  while (v < old && !word.compare_exchange_weak(old, v)) {
  }
  return old;
}
using std::fmaxf;
using std::fminf;
""",
    "cuda_bf16.h": r"""
#pragma once
#include "cuda_runtime.h"
struct __nv_bfloat16 {
  uint16_t x;
  operator float() const { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {float(v.x), float(v.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
""",
    "cuda_fp16.h": r"""
#pragma once
#include "cuda_bf16.h"
struct __half { uint16_t x; };
inline float __half2float(__half) { return 0.f; }
inline __half __float2half_rn(float) { return __half{0}; }
""",
    "cuda_fp8.h": r"""
#pragma once
#include "cuda_runtime.h"
enum { __NV_SATFINITE = 1, __NV_E4M3 = 2 };
inline float e4m3_value(int code) {
  const int e = (code >> 3) & 0xF, m = code & 7;
  return e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
}
inline uint8_t e4m3_rne_satfinite(float v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = v < 0 ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a >= 448.f) return sign | 0x7E;
  int best = 0;
  float dist = 1e30f;
  for (int c = 0; c <= 0x7E; ++c) {
    const float d = std::fabs(e4m3_value(c) - a);
    if (d < dist || (d == dist && (c & 1) == 0)) { dist = d; best = c; }
  }
  return sign | best;
}
inline uint16_t __nv_cvt_float2_to_fp8x2(float2 v, int, int) {
  return uint16_t(e4m3_rne_satfinite(v.x)) | uint16_t(e4m3_rne_satfinite(v.y) << 8);
}
""",
}

DRIVER = r"""
#include "dsv4_compress_plan_kernels.cuh"
#include "dsv4_compress_store_kernels.cuh"
#include <thread>
#include <type_traits>
#include <vector>
using namespace dspark::dsv4;

// Runs `blocks` blocks one after the other, each with `threads` OS threads (or sequentially if `serial`).
template <typename F>
static void launch(int64_t blocks, int threads, bool serial, F&& kernel) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (serial) {
      for (int t = 0; t < threads; ++t) { gridDim.x = blocks; blockIdx.x = b; threadIdx.x = t; kernel(); }
      continue;
    }
    std::barrier<> block(threads);
    std::vector<std::barrier<>*> warps;
    std::vector<double> lanes(threads);
    for (int w = 0; w < threads / 32; ++w) warps.push_back(new std::barrier<>(32));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        gridDim.x = blocks; blockIdx.x = b; threadIdx.x = t;
        g_block = &block; g_warp = warps[t / 32]; g_lanes = &lanes[t / 32 * 32];
        kernel();
      });
    for (auto& th : pool) th.join();
    for (auto* w : warps) delete w;
  }
}
static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// SM count the c128 launch shape is chosen for (c128_splits), set from Python to exercise every channel split.
static int g_num_sms = 132;
extern "C" void emu_set_num_sms(int n) { g_num_sms = n; }
static void launch_c128(int64_t rows, int d, void (*kernel)(CompressArgs, int), const CompressArgs& a) {
  const int splits = c128_splits(rows, d, g_num_sms);
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
def emu(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++20 compiler")
    root = tmp_path_factory.mktemp("dsv4_emu")
    for name, text in SHIM.items():
        (root / name).write_text(text)
    (root / "driver.cpp").write_text(DRIVER)
    lib = root / "libdsv4emu.so"
    cmd = [
        cxx,
        "-std=c++20",
        "-O1",
        "-shared",
        "-fPIC",
        f"-I{root}",
        f"-I{CSRC}",
        str(root / "driver.cpp"),
        "-o",
        str(lib),
        "-lpthread",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 and "barrier" in res.stderr and "No such file" in res.stderr:
        pytest.skip("needs a C++20 standard library with <barrier>")
    assert res.returncode == 0, res.stderr[-4000:]
    return ctypes.CDLL(str(lib))


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
        (128, "ring", torch.float32, True, 512, 6),  # 1, 2 or 4 channel splits depending on the rows per call
    ],
)
def test_emulated_compress_kernels_match_fp64(emu, monkeypatch, ratio, mode, state_dtype, vec, d, num_sms):
    _install(emu, monkeypatch, vec, num_sms)
    _random_session(ratio, mode, False, d, seed=ratio, state_dtype=state_dtype, long=ratio == 4)


@pytest.mark.parametrize(("d", "num_sms"), [(128, 132), (512, 6)])
def test_emulated_online_kernels_match_fp64(emu, monkeypatch, d, num_sms):
    _install(emu, monkeypatch, num_sms=num_sms)
    _random_session(128, "ring", True, d, seed=3, long=True)


INVALID_C = [-1, 0, -1, -1]  # CompressPlan padding row as int32 words
INVALID_D = [-1, -1, -1, -1]  # DecodePlan padding row


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def decode_corruptions(ratio: int, online: bool, rows: int):
    """(field, corrupt): `corrupt(bad, neutral)` edits the int32 words of two copies of a decode plan: `bad` gets an
    out-of-range row, `neutral` the same row as the CPU path accepts it with the effect a skipping kernel has
    (padding; or, for a row whose window read is bad, a row that writes but does not close its window)."""
    if online:

        def loads(w):
            return (w[:, 1] >= 0) & ((w[:, 0] - 1) % 128 != 0)

        def write_loc(bad, good):
            r = _first(bad[0][:, 1] >= 0)
            bad[0][r, 1] = rows
            good[0][r] = torch.tensor(INVALID_D)

        def read_page_0(bad, good):
            r = _first(loads(bad[0]))
            bad[0][r, 2] = rows + 1
            good[0][r] = torch.tensor(INVALID_D)

        return [("write_loc", write_loc), ("read_page_0", read_page_0)]

    def emitting(w):
        return (w[:, 1] >= 0) & (w[:, 0] % ratio == 0)

    def write_loc(bad, good):
        r = _first(bad[0][:, 1] >= 0)
        bad[0][r, 1] = rows + 5
        good[0][r] = torch.tensor(INVALID_D)

    def page(col, value):
        def corrupt(bad, good):
            r = _first(emitting(bad[0]))
            bad[0][r, col] = value
            good[0][r, 0] += 1  # writes the row, closes no window

        return corrupt

    def not_last_row(bad, good):
        r = _first(emitting(bad[0]))
        bad[0][r, 1] -= 1
        good[0][r, 1] -= 1
        good[0][r, 0] += 1

    cases = [("write_loc", write_loc), ("read_page_1", page(3, rows // ratio + 3)), ("write_loc", not_last_row)]
    return [*cases, ("read_page_0", page(2, -7))] if ratio == 4 else cases


def prefill_corruptions(ratio: int, online: bool, rows: int, inputs: int):
    """As `decode_corruptions`, for the two plans of a prefill (every corrupted row becomes padding)."""
    window = 8 if ratio == 4 else 128

    def field(plan: int, col: int, value, pick=lambda w: w[:, 0] != -1, keep=0):
        """Set the bits of word `col` outside `keep` to `value` in the first row of `plan` that `pick` selects."""

        def corrupt(bad, good):
            r = _first(pick(bad[plan]))
            bad[plan][r, col] = (bad[plan][r, col] & keep) | value
            good[plan][r] = torch.tensor(INVALID_C if online or plan == 0 else [-1, -1])

        return corrupt

    def buffered(w):
        return (w[:, 0] != -1) & ((w[:, 1] >> 16) > 0)

    ragged = ("ragged_id", field(0, 1, inputs + 1, keep=~0xFFFF))
    buffer_len = field(0, 1, 0 if online else (window + 1) << 16, keep=0xFFFF)
    if online:
        return [
            ragged,
            ("buffer_len", buffer_len),
            ("buffer_len", field(1, 1, 129 << 16, keep=0xFFFF)),
            ("read_page_0", field(1, 2, rows)),
            ("read_page_1", field(0, 3, rows + 4)),
        ]
    return [
        ragged,
        ("buffer_len", buffer_len),
        ("ragged_id", field(0, 1, 0)),  # ragged id 0, buffer_len 0: the window starts before row 0
        ("read_page_1", field(0, 3, -2, buffered)),
        ("write_loc", field(1, 1, rows)),
        ("ragged_id", field(1, 0, inputs)),
    ]


def plan_corruptions(ratio: int, online: bool, decode: bool, state: torch.Tensor, kv: torch.Tensor):
    """`decode_corruptions` or `prefill_corruptions` for the buffers of a `corruption_case`."""
    if decode:
        return decode_corruptions(ratio, online, state.shape[0])
    return prefill_corruptions(ratio, online, state.shape[0], kv.shape[0])


def corruption_case(ratio: int, online: bool, decode: bool, g: torch.Generator):
    """A random state, input and ape, and valid plans of 3-4 requests."""
    d = 128
    window = 8 if ratio == 4 else 128
    ring = 1 if online else window
    state = torch.randn(5 * ring, 3 * d if online else (4 if ratio == 4 else 2) * d, generator=g)
    if online:
        state[:, d : 2 * d] = state[:, d : 2 * d].abs() + 1
    ape = torch.randn(window, d, generator=g)
    in_width = (4 if ratio == 4 else 2) * d
    r = ratio
    if decode:
        seq = torch.tensor([128, 200, 1, 129] if online else [r, 2 * r, 2 * r + 1, 3 * r])
        rid = torch.arange(4)
        plans = (plan_online_decode(seq, rid),) if online else (plan_decode(seq, rid, None, None, r, ring),)
        return state, torch.randn(4, in_width, generator=g), ape, plans
    seq, ext = ([300, 128, 5], [200, 128, 1]) if online else ([2 * r + 3, 3 * r, r + 1], [r + 5, 2 * r, 2])
    seq, ext, rid = torch.tensor(seq), torch.tensor(ext), torch.arange(3)
    n = int(ext.sum()) + 2
    plans = plan_online_prefill(seq, ext, rid, n) if online else plan_prefill(seq, ext, rid, None, None, r, ring, 0, n)
    return state, torch.randn(n, in_width, generator=g), ape, plans


def run_compress(online, decode, state, kv, ape, plans, ratio):
    """The registered compress op of (online, decode) on the tensors' device."""
    ops = torch.ops.dspark
    if online:
        op = ops.dsv4_online_compress_decode if decode else ops.dsv4_online_compress_prefill
        return op(state, kv, ape, *plans)
    op = ops.dsv4_compress_decode if decode else ops.dsv4_compress_prefill
    return op(state, kv, ape, *plans, ratio)


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


def planner_problem_stages():
    """Planner inputs (seq, ext, rid, r2t, f2s, num_q_tokens) with every kind of out-of-range value, fixed one kind
    at a time, so that stage k's first problem has rank k (ERR_*); the paged tables also hold unmapped entries."""
    g = torch.Generator().manual_seed(5)
    batch = 40
    seq = torch.randint(1, 600, (batch,), generator=g)
    ext = torch.minimum(seq, torch.randint(1, 40, (batch,), generator=g))
    rid = torch.arange(batch) % 11 - 1
    picks = torch.randperm(batch, generator=g)[:6].tolist()
    good_ext = ext.clone()
    ext[picks[0]], ext[picks[1]] = -3, 70000
    seq[picks[2]] = 2**40  # past int32 positions
    rid[picks[3]], rid[picks[4]] = 2**33 + 1, 2**62  # wrap in int32, overflow int64 when multiplied
    rid[picks[5]], seq[picks[5]] = 2, ext[picks[5]] - 1  # shorter than its extend
    r2t = (torch.arange(10)[:, None] * 1024 + torch.arange(1024)).to(torch.int64)
    r2t[3] = 10 * 1024 + 7  # past full_to_state
    f2s = torch.arange(10 * 1024)
    f2s[5 * 1024 : 6 * 1024] = 2**45  # state rows beyond int32
    f2s[7 * 1024 + 10 : 7 * 1024 + 500] = -1  # unmapped: skipped, never reported
    tokens = int(good_ext.sum())
    stages = [
        (lambda: None, tokens - 5),
        (lambda: ext.copy_(good_ext), tokens - 5),  # the extends end past num_q_tokens
        (lambda: None, tokens),  # a seq_len shorter than its extend
        (lambda: seq.copy_(torch.maximum(seq, ext)), tokens),  # a seq_len past int32
        (lambda: seq.copy_(seq.clamp(max=600)), tokens),  # request ids
        (lambda: rid.copy_(torch.where(rid > 9, -1, rid)), tokens),  # req_to_token entries (paged)
        (lambda: r2t[3].copy_(torch.arange(3 * 1024, 4 * 1024)), tokens),  # full_to_state entries (paged)
    ]
    for change, n in stages:
        change()
        yield seq.clone(), ext.clone(), rid.clone(), r2t.clone(), f2s.clone(), n


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


STORE_FREQS = precompute_freqs(4096, 64, 160000.0, original_seq_len=65536, factor=16.0)
STORE_PAGE = 16


def store_case(d: int, fp4: bool, decode: bool):
    """Random entries, their plan (ratio 4), out_loc (some negative) and a poisoned cache of 32 pages of 16."""
    g = torch.Generator().manual_seed(d + decode)
    if decode:
        seq = torch.randint(1, 3000, (24,), generator=g)
        seq[::2] = (seq[::2] // 4 + 1) * 4
        plan = plan_decode(seq, torch.arange(24), None, None, 4, 8)
        out_loc = torch.randperm(500, generator=g)[:24] - 10
    else:
        seq, ext = torch.tensor([300, 41]), torch.tensor([200, 41])
        plan, _ = plan_prefill(seq, ext, torch.arange(2), None, None, 4, 8, 0, 241)
        out_loc = torch.randperm(500, generator=g)[:241] - 10
    kv = torch.randn(plan.shape[0], d, generator=g) * 3
    w = torch.rand(d, generator=g) + 0.5
    cache = torch.randint(0, 256, (32, cache_page_bytes(d, STORE_PAGE, fp4)), dtype=torch.uint8, generator=g)
    return kv, plan, w, out_loc.long(), cache


def _emu_store(emu, kv, plan, w, freqs, out_loc, cache, decode, fp4) -> None:
    emu.emu_store(
        _p(kv),
        _p(plan),
        _p(w),
        ctypes.c_float(1e-6),
        _p(freqs),
        _p(out_loc),
        i64(out_loc.shape[0]),
        _p(cache),
        i64(cache.shape[1]),
        i32(STORE_PAGE.bit_length() - 1),
        i64(cache.shape[0] * STORE_PAGE),
        i64(freqs.shape[0]),
        i64(kv.shape[0]),
        i32(4),
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


def storing_rows(plan, out_loc, decode):
    """Plan rows that store, and the out_loc index of each."""
    rows = stored_rows(plan, 4, decode)
    stores = rows.valid & (row_slots(rows, out_loc) >= 0)
    return stores.nonzero().squeeze(1), rows.source


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
