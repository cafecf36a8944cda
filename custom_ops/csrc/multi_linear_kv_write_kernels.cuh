// Kernels of dspark::multi_linear_kv_write: N layers' K/V projections, per-head RMSNorm and RoPE of K, and the cache
// writes. Plain CUDA (no torch headers); the binding is multi_linear_kv_write.cu, the reference math
// custom_ops/multi_linear_kv_write.py.
//
// Rows. The op's projections are one multi-weight GEMM over 2N segments of kv = heads * head_dim rows each, in the
// order K_0, V_0, K_1, V_1, ...: concatenated row r is element r % head_dim of head (r % kv) / head_dim of the K
// (segment even) or V (odd) block of layer r / (2 kv). Every segment is a whole number of heads, so a tile whose
// height is a multiple of head_dim and starts at a multiple of it holds whole heads.
//
// Two kernels:
//   * fused (T <= 64, head_dim 64 or 128): multi_linear_kernel of multi_linear_kernels.cuh with KvWriteEpilogue.
//     Its tiles are 64 (head_dim 64) or 128 rows (head_dim 128); after the split-K reduction the CTA's finished
//     tile sits in shared memory in fp32, and the epilogue writes each (token, head) of it straight into the cache
//     (one warp per unit): nothing but the weights, the activation and the written cache rows touch HBM.
//   * heads (any T; head_dim 64, 128 or 256): reads the projections that the GEMM path wrote to a [T, 2N kv] buffer
//     and does the same per-unit work, one warp per (token, head).
//
// Per (token, head) unit, in fp32 (each lane holds V = head_dim / 32 consecutive elements): the token's slot
// (cache_loc, or cache_loc_2d and commit_lens) and, with RoPE, its table row are read first; a negative or
// out-of-range slot, a masked commit column or a position outside the layer's table skips the unit (nothing is
// read through it, nothing written). K: sum of squares across the warp, scale = rsqrt(mean + eps), times the norm
// weight; RoPE pairs (j, j + R/2) (neox) or (2j, 2j + 1) (GPT-J) for j < R/2 through a warp-private row of shared
// memory; then every lane stores its V elements, rounded once, with one vector store.
#pragma once

#include "multi_linear_kernels.cuh"

namespace dspark {
namespace mlinear {

constexpr int kMaxLayers = kMaxSegments / 2;  // layers per launch: two GEMM segments (K, V) each
constexpr int kHeadWarps = 8;                 // warps per CTA of the heads kernel

// What the epilogue needs besides the GEMM: where each layer's K (kind 0) and V (kind 1) rows go and how K is normed
// and rotated. Index tensors are addressed through their strides; a flag says int64 (else int32).
struct KvWrite {
  void* cache[2][kMaxLayers];           // [kind][layer] first element of slot 0, head 0
  int64_t slot_stride[2][kMaxLayers];   // elements
  int64_t head_stride[2][kMaxLayers];   // elements (the head_dim elements of a head are contiguous)
  const void* norm_weight[kMaxLayers];  // [head_dim], nullptr: no weight
  int norm_fp32[kMaxLayers];            // norm_weight is fp32 (else the element type)
  float eps[kMaxLayers];
  const float* cos_sin[kMaxLayers];     // [rows][R]: cos in [0, R/2), sin in [R/2, R)
  int64_t table_rows[kMaxLayers];
  int64_t table_stride[kMaxLayers];
  const void* positions;
  int64_t positions_stride;
  int positions_int64;
  const void* loc;                      // token t = b * width + j reads loc[b * loc_stride0 + j * loc_stride1]
  int64_t loc_stride0, loc_stride1;
  int loc_int64;
  const void* commit_lens;              // nullptr: every column; else write only j < commit_lens[b]
  int64_t commit_stride;
  int commit_int64;
  int64_t width;
  int64_t slots;
  int heads, head_dim, rotary_dim;
  int neox, has_norm, has_rope;
};

struct KvWriteArgs {
  Params gemm;  // segments K_0, V_0, K_1, ... (adjacent ones may be merged: the row arithmetic does not need them)
  KvWrite kv;
};

__device__ __forceinline__ int64_t load_index(const void* base, int64_t offset, int is_int64) {
  return is_int64 ? static_cast<const int64_t*>(base)[offset] : static_cast<const int32_t*>(base)[offset];
}

template <typename T, int V>
__device__ __forceinline__ void store_row(T* dst, const float (&v)[V]);

template <>
__device__ __forceinline__ void store_row<__nv_bfloat16, 2>(__nv_bfloat16* dst, const float (&v)[2]) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v[0], v[1]);
}
template <>
__device__ __forceinline__ void store_row<__half, 2>(__half* dst, const float (&v)[2]) {
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v[0], v[1]);
}

// V = 4 or 8: pairs packed into 32-bit words, one 8- or 16-byte store.
template <typename T, int V>
__device__ __forceinline__ void store_row(T* dst, const float (&v)[V]) {
  static_assert(V == 4 || V == 8, "2, 4 or 8 elements per lane");
  uint32_t words[V / 2];
#pragma unroll
  for (int i = 0; i < V / 2; ++i) {
    const float pair[2] = {v[2 * i], v[2 * i + 1]};
    T packed[2];
    store_row<T, 2>(packed, pair);
    words[i] = *reinterpret_cast<const uint32_t*>(packed);
  }
  if constexpr (V == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The unit's cache slot and table row: false when the unit is skipped (whole-warp uniform).
__device__ __forceinline__ bool resolve_token(const KvWrite& kv, int layer, int token, int64_t& slot, int64_t& pos) {
  const int64_t b = token / kv.width, j = token % kv.width;
  if (kv.commit_lens != nullptr && j >= load_index(kv.commit_lens, b * kv.commit_stride, kv.commit_int64)) {
    return false;
  }
  slot = load_index(kv.loc, b * kv.loc_stride0 + j * kv.loc_stride1, kv.loc_int64);
  if (slot < 0 || slot >= kv.slots) return false;
  pos = 0;
  if (kv.has_rope) {
    pos = load_index(kv.positions, token * kv.positions_stride, kv.positions_int64);
    if (pos < 0 || pos >= kv.table_rows[layer]) return false;
  }
  return true;
}

// Writes one (token, head) unit whose fp32 projection this lane holds in v (elements lane * V + i), or nothing when
// the token is skipped. `row` is the head's first concatenated row; `scratch` is head_dim floats of shared memory
// only this warp uses (RoPE partners).
template <typename T, int V>
__device__ __forceinline__ void write_head(const KvWrite& kv, int token, int64_t row, float (&v)[V], float* scratch,
                                           int lane) {
  const int64_t kv_rows = static_cast<int64_t>(kv.heads) * kv.head_dim;
  const int64_t segment = row / kv_rows;
  const int layer = static_cast<int>(segment >> 1), kind = static_cast<int>(segment & 1);
  const int head = static_cast<int>((row % kv_rows) / kv.head_dim);
  int64_t slot, pos;
  if (!resolve_token(kv, layer, token, slot, pos)) return;
  const int e0 = lane * V;
  if (kind == 0 && kv.has_norm) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) ss += v[i] * v[i];
    const float scale = rsqrtf(warp_sum(ss) / static_cast<float>(kv.head_dim) + kv.eps[layer]);
    const void* w = kv.norm_weight[layer];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float g = 1.f;
      if (w != nullptr) g = kv.norm_fp32[layer] ? static_cast<const float*>(w)[e0 + i] : to_float(static_cast<const T*>(w)[e0 + i]);
      v[i] *= scale * g;
    }
  }
  if (kind == 0 && kv.has_rope) {
#pragma unroll
    for (int i = 0; i < V; ++i) scratch[e0 + i] = v[i];
    __syncwarp();
    const int half = kv.rotary_dim / 2;
    const float* table = kv.cos_sin[layer] + pos * kv.table_stride[layer];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int e = e0 + i;
      if (e >= kv.rotary_dim) continue;
      const int j = kv.neox ? (e < half ? e : e - half) : e / 2;
      const bool first = kv.neox ? e < half : (e & 1) == 0;
      const int partner = kv.neox ? (first ? e + half : e - half) : e ^ 1;
      const float c = table[j], s = table[half + j], other = scratch[partner];
      v[i] = first ? v[i] * c - other * s : v[i] * c + other * s;
    }
    __syncwarp();  // the scratch row is free for the warp's next unit
  }
  T* dst = static_cast<T*>(kv.cache[kind][layer]) + slot * kv.slot_stride[kind][layer] +
           head * kv.head_stride[kind][layer] + e0;
  store_row<T, V>(dst, v);
}

// The fused epilogue: the CTA's tile holds whole heads (kRows is a multiple of head_dim = 32 V); the units
// (token, head of the tile) are shared out over the cluster's CTAs and each CTA's warps. A unit's values are the
// bias plus the S partial tiles; the owner writes them back into its own tile slot, which no other CTA reads, and
// uses it as the RoPE scratch row.
template <int V>
struct KvWriteEpilogue {
  using Args = KvWriteArgs;
  static __device__ __forceinline__ const Params& gemm(const Args& args) { return args.gemm; }

  template <typename T, int kRows, int kTokens, int kThreads>
  static __device__ __forceinline__ void finish(const Args& args, float* tile, const float* bias, int64_t row0,
                                                int rows, const ClusterCoord& cluster) {
    constexpr int kHeadDim = 32 * V, kPitch = tile_pitch(kRows);
    static_assert(kRows % kHeadDim == 0, "a tile holds whole heads");
    const int tokens = args.gemm.tokens < kTokens ? args.gemm.tokens : kTokens;
    const int units = tokens * (rows / kHeadDim);
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    if (cluster.size > 1) cluster_sync();
    const int begin = static_cast<int>(static_cast<int64_t>(units) * cluster.rank / cluster.size);
    const int end = static_cast<int>(static_cast<int64_t>(units) * (cluster.rank + 1) / cluster.size);
    for (int u = begin + warp; u < end; u += kThreads / 32) {
      const int token = u / (rows / kHeadDim), r = (u % (rows / kHeadDim)) * kHeadDim;
      float* mine = tile + token * kPitch + r;
      float v[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int e = lane * V + i;
        float sum = bias[r + e];
        if (cluster.size == 1) {
          sum += mine[e];
        } else {
          for (unsigned q = 0; q < cluster.size; ++q) sum += cluster_peer(mine, q)[e];
        }
        v[i] = sum;
      }
      __syncwarp();  // every lane has read its sums before the row becomes the scratch row
      write_head<T, V>(args.kv, token, row0 + r, v, mine, lane);
    }
    if (cluster.size > 1) cluster_sync();
  }
};

// The heads kernel: unit u = token * (2 N heads) + h reads head h of token `token` from `projections` [T, ld].
template <typename T, int V>
__global__ void __launch_bounds__(32 * kHeadWarps)
    kv_write_heads_kernel(const __grid_constant__ KvWrite kv, const T* projections, int64_t ld, int tokens,
                          int layers) {
  __shared__ float scratch[kHeadWarps][32 * V];
  pdl_wait();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t heads = 2 * static_cast<int64_t>(layers) * kv.heads;
  const int64_t u = static_cast<int64_t>(blockIdx.x) * kHeadWarps + warp;
  if (u >= heads * tokens) return;
  const int token = static_cast<int>(u / heads);
  const int64_t row = (u % heads) * (32 * V);
  const T* src = projections + token * ld + row + lane * V;
  float v[V];
#pragma unroll
  for (int i = 0; i < V; ++i) v[i] = to_float(src[i]);
  write_head<T, V>(kv, token, row, v, scratch[warp], lane);
}

}  // namespace mlinear
}  // namespace dspark
