"""The CUDA built-ins the DeepSeek-V4 (and FlashMLA-write) kernel headers use, as host C++ headers (file name ->
text): one fiber per CUDA thread (`emulation_fibers.py`), barriers for `__syncthreads` and warp shuffles, bf16 /
e4m3 conversions with round-to-nearest-even. Used by tests/test_dsv4_kernel_emulation.py and
tests/test_flashmla_kernel_emulation.py.
"""

from __future__ import annotations

from emulation_fibers import FIBERS_H

SHIM = {
    "emu_fibers.h": FIBERS_H,
    "cuda_runtime.h": r"""
#pragma once
#include "emu_fibers.h"
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#define __global__
#define __device__
#define __host__
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
// Per emulated thread (a fiber's, emu_fibers.h), reached through the names CUDA code and the drivers use.
struct EmuLocals {
  Dim thread_idx, block_idx, grid_dim;
  EmuBarrier* block = nullptr;
  EmuBarrier* warp = nullptr;
  double* lanes = nullptr;
};
inline EmuLocals& emu_locals() { return emu_locals_of<EmuLocals>(); }
#define threadIdx (emu_locals().thread_idx)
#define blockIdx (emu_locals().block_idx)
#define gridDim (emu_locals().grid_dim)
#define g_block (emu_locals().block)
#define g_warp (emu_locals().warp)
#define g_lanes (emu_locals().lanes)
template <typename Body>
void emu_launch_threads(size_t count, Body body) { emu_launch<EmuLocals>(count, body); }
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
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;  // -0.0 keeps its sign, as the hardware conversion
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
