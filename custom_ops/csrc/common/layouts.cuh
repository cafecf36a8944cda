// Device primitives shared by the FlashMLA write kernels (flashmla/) and the DeepSeek-V4 store kernel (dsv4/): the
// FlashMLA V4 layout constants, fp32 <-> bf16/fp16 conversion, row loads/stores, the RMSNorm factor, the interleaved
// RoPE rotation, FP8 e4m3 / UE8M0 quantization, the 584-byte cache row store and the 128-point Walsh-Hadamard
// transform. Plain CUDA, no torch headers: the device-side twin of custom_ops/layouts/ (fp8.py, rope.py, norm.py).
//
// Numerics match the CPU references (custom_ops/layouts/norm.py): sum of squares in fp64, ms = fp32(sum/D),
// nf = fp32(1/sqrt(fp64(fp32(ms + eps)))), then only separately rounded fp32 operations (__fmul_rn & co., so
// nvcc cannot contract them into FMAs); fp8 = e4m3 RNE with saturation; bf16/fp16 = RNE.
//
// Thread mapping of the 512-wide rows: one warp per row, lane l owns dims [16 l, 16 l + 16). Lanes 0..27 own
// the 7 nope tiles (4 lanes per 64-wide tile), lanes 28..31 the 64 RoPE dims (8 interleaved pairs each).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark {

constexpr int kHeadDim = 512;
constexpr int kNopeDim = 448;
constexpr int kRopeDim = 64;
constexpr int kValueBytes = 576;
constexpr int kScaleBytes = 8;
constexpr int kTokenBytes = kValueBytes + kScaleBytes;  // 584: one token's payload (layouts/fp8.py, TOKEN_BYTES)
constexpr int kLaneElems = 16;               // 512 / 32
constexpr int kRopeLane0 = kNopeDim / kLaneElems;  // 28
constexpr int kIndexerDim = 128;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;
constexpr float kFloatMax = 3.40282346638528859812e+38f;  // the largest finite fp32

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return Cvt<T>::to_float(Cvt<T>::from_float(v));
}

// N contiguous elements of T -> fp32; kVec: 16-byte loads (pointer 16-byte aligned, N * sizeof(T) % 16 == 0).
template <typename T, int N, bool kVec>
__device__ __forceinline__ void load_row(const T* p, float (&x)[N]) {
  if constexpr (kVec) {
    constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
    for (int v = 0; v < N / kPerVec; ++v) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[v];
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int k = 0; k < kPerVec; ++k) x[v * kPerVec + k] = Cvt<T>::to_float(e[k]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = Cvt<T>::to_float(p[i]);
  }
}

template <typename T, int N, bool kVec>
__device__ __forceinline__ void store_row(T* p, const float (&x)[N]) {
  if constexpr (kVec) {
    constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
    for (int v = 0; v < N / kPerVec; ++v) {
      uint4 u;
      T* e = reinterpret_cast<T*>(&u);
#pragma unroll
      for (int k = 0; k < kPerVec; ++k) e[k] = Cvt<T>::from_float(x[v * kPerVec + k]);
      reinterpret_cast<uint4*>(p)[v] = u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = Cvt<T>::from_float(x[i]);
  }
}

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Whether `loc` is a slot of a cache of `num_pages` pages of 2^log2_page_size slots: 0 <= loc < capacity. Compares
// the page index (a shift, no multiplication), so a huge slot id can never wrap into another page's offset.
__device__ __forceinline__ bool flashmla_slot_in_range(int64_t loc, int64_t num_pages, int log2_page_size) {
  return loc >= 0 && (loc >> log2_page_size) < num_pages;
}

// Whether `pos` is a row of a RoPE table with `max_pos` rows (positions have no sentinel).
__device__ __forceinline__ bool position_in_range(int64_t pos, int64_t max_pos) { return pos >= 0 && pos < max_pos; }

// Row norm factor (see the file header); every lane returns the same value (xor butterflies are symmetric).
__device__ __forceinline__ float norm_factor(const float (&x)[kLaneElems], float eps) {
  double ss = 0.0;
#pragma unroll
  for (int i = 0; i < kLaneElems; ++i) ss = fma(static_cast<double>(x[i]), static_cast<double>(x[i]), ss);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(kFullMask, ss, o);
  const float ms = __double2float_rn(ss * (1.0 / kHeadDim));
  return __double2float_rn(1.0 / sqrt(static_cast<double>(__fadd_rn(ms, eps))));
}

// 16 fp32 table entries [cos, sin, ...] of position `pos` (in range) for RoPE lane `lane` (>= kRopeLane0).
__device__ __forceinline__ void load_rope_table(const float* freqs, int64_t pos, int lane, float (&t)[kLaneElems]) {
  const float4* src = reinterpret_cast<const float4*>(freqs + pos * kRopeDim + (lane - kRopeLane0) * kLaneElems);
#pragma unroll
  for (int v = 0; v < kLaneElems / 4; ++v) {
    const float4 f = src[v];
    t[4 * v] = f.x;
    t[4 * v + 1] = f.y;
    t[4 * v + 2] = f.z;
    t[4 * v + 3] = f.w;
  }
}

template <int N>
__device__ __forceinline__ void rotate_pairs(float (&x)[N], const float (&t)[N]) {
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
    const float re = x[2 * k], im = x[2 * k + 1], c = t[2 * k], s = t[2 * k + 1];
    x[2 * k] = __fsub_rn(__fmul_rn(re, c), __fmul_rn(im, s));
    x[2 * k + 1] = __fadd_rn(__fmul_rn(re, s), __fmul_rn(im, c));
  }
}

__device__ __forceinline__ uint32_t fp8x2(float a, float b) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// The amax a scale is made from (layouts/fp8.py, finite_amax): at least 1e-4, an infinity counted as the largest
// finite fp32 (a NaN never gets here: the fmaxf reductions of the amax skip it), so every scale is finite.
__device__ __forceinline__ float clamp_amax(float amax) { return fminf(fmaxf(amax, kAmaxFloor), kFloatMax); }

// UE8M0 exponent of clamp_amax(amax) / qmax (448 for e4m3, 6 for e2m1), rounded up.
__device__ __forceinline__ uint32_t ue8m0_exponent(float amax, float qmax = kFp8Max) {
  const uint32_t bits = __float_as_uint(__fdiv_rn(clamp_amax(amax), qmax));
  return ((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u ? 1u : 0u);
}

// Quantize one 512-dim row, held as kLaneElems floats per lane (lanes < kRopeLane0: nope, the rest: rope), and
// write it into slot `loc` of the FlashMLA V4 paged cache: fp8 e4m3 nope codes with one UE8M0 scale byte per
// 64-dim tile (4 lanes), bf16 rope. The whole warp must call it (tile amax is reduced with shuffles). `loc` must be
// a slot of the cache: check it with flashmla_slot_in_range first (offsets are int64 and trust it).
__device__ __forceinline__ void store_flashmla_row(uint8_t* cache, int64_t page_bytes, int log2_page_size, int64_t loc,
                                                   int lane, const float (&x)[kLaneElems]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kLaneElems; ++i) amax = fmaxf(amax, fabsf(x[i]));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));

  const int64_t page_size = int64_t{1} << log2_page_size;
  const int64_t slot = loc & (page_size - 1);
  uint8_t* page_ptr = cache + (loc >> log2_page_size) * page_bytes;
  uint8_t* value = page_ptr + slot * kValueBytes;
  if (lane < kRopeLane0) {
    const uint32_t e = ue8m0_exponent(amax);
    const float inv = __uint_as_float((254u - e) << 23);
    uint4 codes;
    uint32_t* c = reinterpret_cast<uint32_t*>(&codes);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c[k] = fp8x2(__fmul_rn(x[4 * k], inv), __fmul_rn(x[4 * k + 1], inv)) |
             (fp8x2(__fmul_rn(x[4 * k + 2], inv), __fmul_rn(x[4 * k + 3], inv)) << 16);
    }
    reinterpret_cast<uint4*>(value)[lane] = codes;
    if ((lane & 3) == 0) page_ptr[page_size * kValueBytes + slot * kScaleBytes + (lane >> 2)] = static_cast<uint8_t>(e);
  } else {
    uint4 out[2];
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out);
#pragma unroll
    for (int k = 0; k < kLaneElems / 2; ++k) o[k] = __float22bfloat162_rn(make_float2(x[2 * k], x[2 * k + 1]));
    uint4* dst = reinterpret_cast<uint4*>(value + kNopeDim + (lane - kRopeLane0) * kLaneElems * 2);
    dst[0] = out[0];
    dst[1] = out[1];
  }
}

// 128-point Walsh-Hadamard transform of a row held as 4 floats per lane (lane l holds dims 4l .. 4l+3), scaled by
// 128^-0.5, in place; returns the absolute maximum over each group of kGroupLanes lanes (32: the whole row; 8: the
// 32 dims of an FP4 group). Stages h = 1, 2 run in registers, h = 4 .. 64 across lanes (lane bit h / 4). Every step
// rounds to fp32 (`__f*_rn`) so the CPU reference can match bit for bit.
template <int kGroupLanes = 32>
__device__ __forceinline__ float hadamard128_amax(float (&x)[4], int lane) {
  const float y0 = __fadd_rn(x[0], x[1]), y1 = __fsub_rn(x[0], x[1]);
  const float y2 = __fadd_rn(x[2], x[3]), y3 = __fsub_rn(x[2], x[3]);
  x[0] = __fadd_rn(y0, y2);
  x[1] = __fadd_rn(y1, y3);
  x[2] = __fsub_rn(y0, y2);
  x[3] = __fsub_rn(y1, y3);
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float other = __shfl_xor_sync(kFullMask, x[k], m);
      x[k] = upper ? __fsub_rn(other, x[k]) : __fadd_rn(x[k], other);
    }
  }
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[k] = __fmul_rn(x[k], 0.08838834764831845f);  // fp32(128 ** -0.5)
    amax = fmaxf(amax, fabsf(x[k]));
  }
#pragma unroll
  for (int o = kGroupLanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
  return amax;
}

}  // namespace dspark
