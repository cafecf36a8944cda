// compress_norm_rope_store kernels: RMSNorm -> RoPE -> FP8 store of compressed DeepSeek-V4 entries.
// Plain CUDA, no torch headers. Semantics: custom_ops/dsv4/store.py.
//
// The FP8 / UE8M0 / RoPE / norm / Hadamard primitives and the FlashMLA V4 layout constants come from
// common/layouts.cuh (the same numerics as the CPU references of custom_ops/layouts/, which the FlashMLA writes use):
// - D = 512: one warp per entry, lane l owns dims [16 l, 16 l + 16) (lanes 0..27 the 7 nope tiles, 28..31 RoPE);
//   the normed nope values are rounded to bf16 and back before the UE8M0 tile quantization.
// - D = 128 (indexer): one warp per entry, lane l owns dims [4 l, 4 l + 4); RoPE on lanes 16..31, Walsh-Hadamard
//   (stages 1, 2 in registers, 4..64 across lanes) times 1/sqrt(128), then FP8 with one plain fp32 scale per
//   entry, or (kFp4) e2m1 codes with one UE8M0 exponent per 32 dims (8 lanes), as in custom_ops/layouts/fp4.py.
#pragma once

#include "common/layouts.cuh"
#include "dsv4/dsv4_compress_kernels.cuh"

namespace dspark {
namespace dsv4 {

constexpr int kStoreWarps = 8;
constexpr int kStoreThreads = 32 * kStoreWarps;
constexpr int kFp4GroupLanes = 8;  // 32 dims per UE8M0 exponent
constexpr float kE2m1Max = 6.0f;

// e2m1 code of y * inv (inv a power of two): magnitude = number of thresholds strictly below min(|y * inv|, 6)
// (nearest e2m1 value, ties to the smaller), sign bit 0x8 only with a nonzero magnitude.
__device__ __forceinline__ uint32_t e2m1_code(float y, float inv) {
  const float a = fabsf(__fmul_rn(y, inv));
  const float v = a > kE2m1Max ? kE2m1Max : a;  // not fminf: a NaN stays NaN and gets magnitude 0 (layouts/fp4.py)
  const uint32_t magnitude = static_cast<uint32_t>((v > 0.25f) + (v > 0.75f) + (v > 1.25f) + (v > 1.75f) + (v > 2.5f) +
                                                   (v > 3.5f) + (v > 5.0f));
  return magnitude | (y < 0.0f && magnitude != 0u ? 0x8u : 0u);
}

struct StoreArgs {
  const float* kv;  // [rows, d] fp32 contiguous
  const uint8_t* plan;
  const float* weight;
  float eps;
  const float* freqs;  // [max_pos, 64]
  const void* out_loc;
  bool out_loc_64;
  int64_t out_loc_len;
  uint8_t* cache;
  int64_t page_bytes;
  int log2_page_size;
  int64_t num_slots;  // pages * page_size: slots at or past it are skipped, before any byte offset is formed
  int64_t max_pos;    // rows of freqs: entries whose RoPE position is not a row are skipped
  int64_t rows;
  int ratio;
  bool decode;
};

// Slot and RoPE position of plan row `row`; false if the row stores nothing (padding, no entry, a negative slot) or
// must be skipped (a slot outside the cache, an out_loc index or RoPE position that does not exist).
__device__ __forceinline__ bool store_target(const StoreArgs& a, int64_t row, int64_t& loc, int64_t& pos) {
  int64_t src;
  uint32_t seq_len;
  if (a.decode) {
    const DecodePlan p = reinterpret_cast<const DecodePlan*>(a.plan)[row];
    // c4 reads the page of read_page_0 (-1: no entry was made); c128 never reads it (-1 where that token is unmapped)
    if (p.write_loc < 0 || (a.ratio == 4 && p.read_page_0 < 0) || p.seq_len % static_cast<uint32_t>(a.ratio) != 0u) {
      return false;
    }
    seq_len = p.seq_len;
    src = row;
  } else {
    const CompressPlan p = reinterpret_cast<const CompressPlan*>(a.plan)[row];
    if (p.seq_len == kInvalid) return false;
    seq_len = p.seq_len;
    src = p.ragged_id;
  }
  if (seq_len < static_cast<uint32_t>(a.ratio) || src >= a.out_loc_len) return false;
  loc = load_index(a.out_loc, src, a.out_loc_64);
  pos = static_cast<int64_t>(seq_len) - a.ratio;
  return loc >= 0 && loc < a.num_slots && pos < a.max_pos;
}

__global__ void __launch_bounds__(kStoreThreads) store_flashmla_kernel(const StoreArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kStoreWarps + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  int64_t loc, pos;
  if (!store_target(a, row, loc, pos)) return;  // uniform across the warp
  const bool rope_lane = lane >= kRopeLane0;

  float x[kLaneElems];
  load_row<float, kLaneElems, true>(a.kv + row * kHeadDim + lane * kLaneElems, x);
  const float nf = norm_factor(x, a.eps);
  float w[kLaneElems];
  load_row<float, kLaneElems, true>(a.weight + lane * kLaneElems, w);
#pragma unroll
  for (int i = 0; i < kLaneElems; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], nf), w[i]);
  if (rope_lane) {
    float tab[kLaneElems];
    load_rope_table(a.freqs, pos, lane, tab);
    rotate_pairs(x, tab);
  } else {
#pragma unroll
    for (int i = 0; i < kLaneElems; ++i) x[i] = round_to<__nv_bfloat16>(x[i]);
  }
  store_flashmla_row(a.cache, a.page_bytes, a.log2_page_size, loc, lane, x);
}

template <bool kFp4>
__global__ void __launch_bounds__(kStoreThreads) store_indexer_kernel(const StoreArgs a) {
  constexpr int kPer = kIndexerDim / 32;                      // 4 dims per lane
  constexpr int kRopeLane = (kIndexerDim - kRopeDim) / kPer;  // 16
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kStoreWarps + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  int64_t loc, pos;
  if (!store_target(a, row, loc, pos)) return;

  const float4 v = reinterpret_cast<const float4*>(a.kv + row * kIndexerDim)[lane];
  float x[kPer] = {v.x, v.y, v.z, v.w};
  double ss = 0.0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) ss = fma(static_cast<double>(x[k]), static_cast<double>(x[k]), ss);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(kFullMask, ss, o);
  const float ms = __double2float_rn(ss * (1.0 / kIndexerDim));
  const float nf = __double2float_rn(1.0 / sqrt(static_cast<double>(__fadd_rn(ms, a.eps))));
  const float4 wv = reinterpret_cast<const float4*>(a.weight)[lane];
  const float w[kPer] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
  for (int k = 0; k < kPer; ++k) x[k] = __fmul_rn(__fmul_rn(x[k], nf), w[k]);
  if (lane >= kRopeLane) {
    const float4 f = *reinterpret_cast<const float4*>(a.freqs + pos * kRopeDim + (lane - kRopeLane) * kPer);
    const float t[kPer] = {f.x, f.y, f.z, f.w};
    rotate_pairs(x, t);
  }
  const int64_t page_size = int64_t{1} << a.log2_page_size;
  const int64_t slot = loc & (page_size - 1);
  uint8_t* page_ptr = a.cache + (loc >> a.log2_page_size) * a.page_bytes;
  if constexpr (kFp4) {
    const uint32_t e = ue8m0_exponent(hadamard128_amax<kFp4GroupLanes>(x, lane), kE2m1Max);
    const float inv = __uint_as_float((254u - e) << 23);
    const uint32_t codes = e2m1_code(x[0], inv) | (e2m1_code(x[1], inv) << 4) | (e2m1_code(x[2], inv) << 8) |
                           (e2m1_code(x[3], inv) << 12);
    reinterpret_cast<uint16_t*>(page_ptr + slot * (kIndexerDim / 2))[lane] = static_cast<uint16_t>(codes);
    if (lane % kFp4GroupLanes == 0) page_ptr[page_size * (kIndexerDim / 2) + slot * 4 + lane / kFp4GroupLanes] = e;
  } else {
    const float amax = hadamard128_amax(x, lane);
    const float scale = __fdiv_rn(clamp_amax(amax), kFp8Max);
    const uint32_t codes = fp8x2(__fdiv_rn(x[0], scale), __fdiv_rn(x[1], scale)) |
                           (fp8x2(__fdiv_rn(x[2], scale), __fdiv_rn(x[3], scale)) << 16);
    reinterpret_cast<uint32_t*>(page_ptr + slot * kIndexerDim)[lane] = codes;
    if (lane == 0) *reinterpret_cast<float*>(page_ptr + page_size * kIndexerDim + slot * 4) = scale;
  }
}

}  // namespace dsv4
}  // namespace dspark
