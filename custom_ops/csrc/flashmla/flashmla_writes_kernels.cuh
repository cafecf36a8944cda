// The FlashMLA write kernels: DeepSeek-V4 norm / RoPE / FP8 and the FlashMLA V4 paged-cache writes (binding:
// flashmla_writes.cu). Plain CUDA, no torch headers. The layout constants and the norm / RoPE / FP8 / Hadamard
// primitives are in common/layouts.cuh (shared with the DeepSeek-V4 store kernel).
//
// Numerics match the CPU references in custom_ops/flashmla/writes.py (see common/layouts.cuh).
//
// Index values are not validated on the host (docs/contract.md): a row whose slot or position is out of range is
// skipped by the whole warp before anything is read through that index (`flashmla_slot_in_range`,
// `position_in_range`); what the skipped row leaves is stated per kernel.
#pragma once

#include "common/layouts.cuh"

namespace dspark {

constexpr int kIndexerLaneElems = 4;  // 128 / 32
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = 32 * kWarpsPerBlock;
constexpr int kMinBlocksPerSM = 4;  // caps registers at 64 per thread: 32 resident warps per SM

struct FlashMLAWriteArgs {
  const void* kv;
  int64_t kv_row_stride;  // elements
  const void* weight;
  float eps;
  const float* freqs;
  int64_t max_pos;  // rows of freqs
  const void* positions;
  int64_t positions_stride;  // elements
  bool positions_64;
  const void* out_loc;
  int64_t out_loc_stride;  // elements
  bool out_loc_64;
  uint8_t* cache;
  int64_t num_pages;
  int64_t page_bytes;
  int log2_page_size;
  int64_t rows;
};

// kNormRope: fused_k_norm_rope_flashmla (RMSNorm with weight + RoPE, fp32 until quantization);
// otherwise store_flashmla_cache (rows already normed and roped).
template <typename T, bool kVec, bool kNormRope>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) flashmla_write_kernel(const FlashMLAWriteArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  // Skipped rows write nothing. The indices are the same on every lane, so the whole warp leaves together.
  const int64_t loc = load_index(a.out_loc, row * a.out_loc_stride, a.out_loc_64);
  if (!flashmla_slot_in_range(loc, a.num_pages, a.log2_page_size)) return;
  int64_t pos = 0;
  if constexpr (kNormRope) {
    pos = load_index(a.positions, row * a.positions_stride, a.positions_64);
    if (!position_in_range(pos, a.max_pos)) return;
  }
  const bool rope_lane = lane >= kRopeLane0;

  float x[kLaneElems];
  load_row<T, kLaneElems, kVec>(static_cast<const T*>(a.kv) + row * a.kv_row_stride + lane * kLaneElems, x);
  if constexpr (kNormRope) {
    const float nf = norm_factor(x, a.eps);
    float w[kLaneElems];
    load_row<T, kLaneElems, kVec>(static_cast<const T*>(a.weight) + lane * kLaneElems, w);
#pragma unroll
    for (int i = 0; i < kLaneElems; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], nf), w[i]);
    if (rope_lane) {
      float tab[kLaneElems];
      load_rope_table(a.freqs, pos, lane, tab);
      rotate_pairs(x, tab);
    }
  }
  store_flashmla_row(a.cache, a.page_bytes, a.log2_page_size, loc, lane, x);
}

struct NormRopeArgs {
  const void* in;
  int64_t in_stride_b, in_stride_h;  // elements
  void* out;                         // may equal `in` (fused_norm_rope_inplace)
  int64_t out_stride_b, out_stride_h;
  int heads;
  int64_t rows;  // B * heads
  const void* weight;  // read only when kWeight
  float eps;
  const float* freqs;
  int64_t max_pos;  // rows of freqs
  const void* positions;
  int64_t positions_stride;  // elements
  bool positions_64;
};

// kWeight: fused_norm_rope_inplace (y = DType(x*nf*w)); otherwise fused_q_norm_rope (y = DType(x*nf)).
// RoPE acts on the DType-rounded y and is rounded to DType again. A row whose position is out of range is not
// written (fused_q_norm_rope: that q_out row keeps its contents; fused_norm_rope_inplace: that kv row is unchanged).
template <typename T, bool kVec, bool kWeight>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) norm_rope_kernel(const NormRopeArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  const int64_t b = row / a.heads;
  const int64_t h = row - b * a.heads;
  const int64_t pos = load_index(a.positions, b * a.positions_stride, a.positions_64);
  if (!position_in_range(pos, a.max_pos)) return;  // the same on every lane
  const bool rope_lane = lane >= kRopeLane0;

  float x[kLaneElems];
  load_row<T, kLaneElems, kVec>(
      static_cast<const T*>(a.in) + b * a.in_stride_b + h * a.in_stride_h + lane * kLaneElems, x);
  const float nf = norm_factor(x, a.eps);
  if constexpr (kWeight) {
    float w[kLaneElems];
    load_row<T, kLaneElems, kVec>(static_cast<const T*>(a.weight) + lane * kLaneElems, w);
#pragma unroll
    for (int i = 0; i < kLaneElems; ++i) x[i] = round_to<T>(__fmul_rn(__fmul_rn(x[i], nf), w[i]));
  } else {
#pragma unroll
    for (int i = 0; i < kLaneElems; ++i) x[i] = round_to<T>(__fmul_rn(x[i], nf));
  }
  if (rope_lane) {
    float tab[kLaneElems];
    load_rope_table(a.freqs, pos, lane, tab);
    rotate_pairs(x, tab);
  }
  store_row<T, kLaneElems, kVec>(
      static_cast<T*>(a.out) + b * a.out_stride_b + h * a.out_stride_h + lane * kLaneElems, x);
}

struct IndexerArgs {
  const void* q;
  int64_t q_stride_b, q_stride_h;  // elements
  const void* weight;
  int64_t w_stride_b, w_stride_h;
  float weight_scale;
  const float* freqs;
  int64_t max_pos;  // rows of freqs
  const void* positions;
  int64_t positions_stride;  // elements
  bool positions_64;
  uint8_t* q_fp8;      // (rows, 128) contiguous
  float* weights_out;  // (rows,)
  int heads;
  int64_t rows;
};

// fused_q_indexer_rope_hadamard_quant: one warp per (token, head), lane l owns dims [4 l, 4 l + 4).
// A token whose position is out of range gets zero codes and a zero weight (its fresh outputs are defined).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) indexer_q_kernel(const IndexerArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  const int64_t b = row / a.heads;
  const int64_t h = row - b * a.heads;
  constexpr int kRopeLane = (kIndexerDim - kRopeDim) / kIndexerLaneElems;  // 16
  uint32_t* codes_out = reinterpret_cast<uint32_t*>(a.q_fp8 + row * kIndexerDim) + lane;
  const int64_t pos = load_index(a.positions, b * a.positions_stride, a.positions_64);
  if (!position_in_range(pos, a.max_pos)) {  // the same on every lane
    *codes_out = 0u;
    if (lane == 0) a.weights_out[row] = 0.0f;
    return;
  }

  float x[kIndexerLaneElems];
  const T* src = static_cast<const T*>(a.q) + b * a.q_stride_b + h * a.q_stride_h + lane * kIndexerLaneElems;
  if constexpr (kVec) {
    if constexpr (sizeof(T) == 4) {
      const float4 v = *reinterpret_cast<const float4*>(src);
      x[0] = v.x;
      x[1] = v.y;
      x[2] = v.z;
      x[3] = v.w;
    } else {
      const uint2 u = *reinterpret_cast<const uint2*>(src);
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int k = 0; k < kIndexerLaneElems; ++k) x[k] = Cvt<T>::to_float(e[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kIndexerLaneElems; ++k) x[k] = Cvt<T>::to_float(src[k]);
  }
  if (lane >= kRopeLane) {
    const float4 f = *reinterpret_cast<const float4*>(a.freqs + pos * kRopeDim + (lane - kRopeLane) * 4);
    const float t[4] = {f.x, f.y, f.z, f.w};
    rotate_pairs(x, t);
  }
  const float amax = hadamard128_amax(x, lane);
  const float scale = __fdiv_rn(clamp_amax(amax), kFp8Max);
  const float inv = __fdiv_rn(1.0f, scale);
  const uint32_t codes = fp8x2(__fmul_rn(x[0], inv), __fmul_rn(x[1], inv)) |
                         (fp8x2(__fmul_rn(x[2], inv), __fmul_rn(x[3], inv)) << 16);
  *codes_out = codes;
  if (lane == 0) {
    const float w = Cvt<T>::to_float(static_cast<const T*>(a.weight)[b * a.w_stride_b + h * a.w_stride_h]);
    a.weights_out[row] = __fmul_rn(__fmul_rn(w, a.weight_scale), scale);
  }
}

}  // namespace dspark
