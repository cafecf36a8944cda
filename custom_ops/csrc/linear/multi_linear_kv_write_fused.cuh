// The fused kernel of dspark::multi_linear_kv_write (T <= 16, head_dim 64 or 128): the whole write (projection, K
// norm, RoPE, cache stores) of one head per CTA (or per cluster of S CTAs), the weights loaded from global memory
// straight into mma.sync fragments: no shared memory, no barrier in the main loop. Plain CUDA (no torch headers); the
// epilogue is KvWriteEpilogue of multi_linear_kv_write_kernels.cuh, the binding multi_linear_kv_write.cu, the
// reference math custom_ops/linear/multi_linear_kv_write.py.
//
// Fragments. Lane (group g = lane / 4, quad c = lane % 4) of a warp holds rows g and g + 8 of the warp's 16 rows and
// token g of each n-tile of 8 tokens. In a chunk of 4 E columns starting at `col` it loads the E columns
// col + c E .. col + c E + E - 1 of its two rows and of its token: E / 8 16-byte vectors each. Vector i of the rows
// and of the token feeds two m16n8k16 MMAs, (x, y) then (z, w): the MMA's k slots (2c, 2c + 1) and (2c + 8, 2c + 9)
// are the columns col + c E + 8 i + {0, 1} and {2, 3} (then {4, 5}, {6, 7}) in both operands, so the sum over k is
// the same sum in another order.
//
// Work. Cluster `id` is head `id` (rows id * head_dim .. of the concatenated K/V rows; each row is resolved to its
// weight segment on its own). A CTA has head_dim / 16 row warps times WK k-warps; the K chunks are split evenly over
// the cluster's S * WK k-parts, and each lane keeps D chunks of loads in flight in registers. A lane's vectors past K
// load nothing and count as zeros (K is a multiple of 8, so a vector is all in or all out). After the loop the
// k-warps of a row warp add their accumulators into the CTA's fp32 tile in turn, and KvWriteEpilogue::finish adds
// the bias and the cluster's partial tiles (distributed shared memory), norms, rotates and stores.
//
// The op launches kFusedKWarps, kFusedCols, kFusedDepth and one CTA per head. H200, benchmarks/kv_write_tune.cu
// (`regs`), one launch after an L2 flush, µs at T = 1 / 8 / 16: Qwen3-8B draft dims (80 heads of 128, K 4096) 30.0 /
// 31.0 / 32.1 against 34.8 / 36.6 / 36.7 for the previous tile (cp.async into a shared-memory ring, 141-153 KB, one
// CTA per SM); Qwen3-4B 22.8 / 23.0 / 24.4 against 26.8 / 27.4 / 28.9; hidden 7168, 160 heads of 64: 45.9 / 47.4 /
// 51.8 against 53.0 / 53.1 / 57.4. Clusters of 2 or 4, 1 k-warp, or 16 / 32 columns per lane were slower.
//
// Dependencies: before griddepcontrol.wait only L2 prefetches of the first chunks of weights (prefetch.global.L2
// returns nothing: the loads after the wait read L2, which is coherent, so a weight updated in place by the kernel
// before is read as updated); griddepcontrol.launch_dependents once the main loop is done.
#pragma once

#include "linear/multi_linear_kv_write_kernels.cuh"

namespace dspark {
namespace mlinear {

constexpr int kFusedKWarps = 2;  // k-warps per row warp
constexpr int kFusedCols = 8;    // columns per lane and chunk (a 16-byte vector)
constexpr int kFusedDepth = 4;   // chunks in flight per lane

// 16 bytes of weights, read once: not kept in L1, 256-byte L2 lines.
__device__ __forceinline__ uint4 load_stream16(const void* p) {
#if defined(__CUDA_ARCH__)
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  return *static_cast<const uint4*>(p);
#endif
}

// 16 bytes of the activation, which every row warp of the CTA reads: through L1.
__device__ __forceinline__ uint4 load_shared16(const void* p) {
#if defined(__CUDA_ARCH__)
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  return *static_cast<const uint4*>(p);
#endif
}

// Asks L2 for the line at `p` (no data returned, nothing waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

template <int V, int WK>
__host__ __device__ constexpr int fused_threads() {
  return 32 * (32 * V / 16) * WK;
}

// Shared memory: the fp32 bias [head_dim], the tile [8 NT][tile_pitch(head_dim)], the epilogue's staging area.
template <int V, int NT>
__host__ __device__ constexpr int fused_smem_bytes() {
  return 4 * 32 * V + 4 * 8 * NT * tile_pitch(32 * V) + KvWriteEpilogue<V>::extra_bytes(8 * NT);
}

template <typename T, int V, int NT, int WK = kFusedKWarps, int E = kFusedCols, int D = kFusedDepth>
__global__ void __launch_bounds__(fused_threads<V, WK>())
    kv_write_fused_kernel(const __grid_constant__ KvWriteArgs args) {
  using Epilogue = KvWriteEpilogue<V>;
  constexpr int kRows = 32 * V, WR = kRows / 16, kTokens = 8 * NT, kThreads = fused_threads<V, WK>();
  constexpr int kVecs = E / 8, kCols = 4 * E, kPitch = tile_pitch(kRows);
  static_assert(E % 8 == 0 && D >= 1, "E is a multiple of 8");
  const Params& p = args.gemm;
  float* bias = cta_smem();
  float* tile = bias + kRows;
  float* extra = tile + kTokens * kPitch;
  const ClusterCoord cluster = cluster_coord();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int row_warp = warp % WR, k_warp = warp / WR;
  const int group = lane / 4, quad = lane % 4;
  const int64_t row0 = static_cast<int64_t>(cluster.id) * kRows;
  // A cluster past the last head returns before forming any pointer from its rows (the host launches none).
  if (row0 >= p.segment_end[p.num_segments - 1]) return;

  const T* w0 = weight_row<T>(p, row0 + row_warp * 16 + group) + quad * E;
  const T* w1 = weight_row<T>(p, row0 + row_warp * 16 + group + 8) + quad * E;
  const int chunks = (p.k + kCols - 1) / kCols;
  const int parts = static_cast<int>(cluster.size) * WK, part = static_cast<int>(cluster.rank) * WK + k_warp;
  const int begin = static_cast<int>(static_cast<int64_t>(chunks) * part / parts);
  const int end = static_cast<int>(static_cast<int64_t>(chunks) * (part + 1) / parts);
#pragma unroll
  for (int d = 0; d < D; ++d) {
    const int col = (begin + d) * kCols;
    if (begin + d < end && col + quad * E < p.k) {
      prefetch_l2(w0 + col);
      prefetch_l2(w1 + col);
    }
  }
  const T* xs[NT];
  bool x_live[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int token = n * 8 + group;
    x_live[n] = token < p.tokens;
    xs[n] = static_cast<const T*>(p.x) + (x_live[n] ? token : 0) * p.x_stride + quad * E;
  }

  uint4 wa[D][2][kVecs], xa[D][NT][kVecs];
  auto load_chunk = [&](int chunk, uint4 (&w)[2][kVecs], uint4 (&x)[NT][kVecs]) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int at = chunk * kCols + 8 * i;
      const bool live = at + quad * E < p.k;
      w[0][i] = live ? load_stream16(w0 + at) : make_uint4(0, 0, 0, 0);
      w[1][i] = live ? load_stream16(w1 + at) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int n = 0; n < NT; ++n) x[n][i] = live && x_live[n] ? load_shared16(xs[n] + at) : make_uint4(0, 0, 0, 0);
    }
  };
  float acc[1][NT][4] = {};
  pdl_wait();
#pragma unroll
  for (int d = 0; d < D; ++d) {
    if (begin + d < end) load_chunk(begin + d, wa[d], xa[d]);
  }
  // The epilogue's indices, norm weight and cos/sin rows load while the first chunks are in flight.
  typename Epilogue::Prefetch prefetched = Epilogue::template prefetch<T, kTokens>(args, row0);
  for (int r = static_cast<int>(threadIdx.x); r < kRows; r += kThreads) bias[r] = bias_of_row<T>(p, row0 + r);
  Epilogue::template stage<T, kTokens>(args, prefetched, extra, row0);
  commit_copies();
  for (int base = begin; base < end; base += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (base + d < end) {
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            const uint4& lo = wa[d][0][i];
            const uint4& hi = wa[d][1][i];
            mma_16816<T>(acc[0][n], lo.x, hi.x, lo.y, hi.y, xa[d][n][i].x, xa[d][n][i].y);
            mma_16816<T>(acc[0][n], lo.z, hi.z, lo.w, hi.w, xa[d][n][i].z, xa[d][n][i].w);
          }
        }
        if (base + d + D < end) load_chunk(base + d + D, wa[d], xa[d]);
      }
    }
  }
  pdl_launch_next();
  wait_copies<0>();  // the epilogue's cos/sin rows
#pragma unroll
  for (int j = 0; j < WK; ++j) {
    if (k_warp == j) add_to_tile<1, NT, kPitch>(tile, acc, row_warp, lane, j == 0);
    __syncthreads();
  }
  Epilogue::template finish<T, kRows, kTokens, kThreads>(args, tile, bias, extra, row0, kRows, cluster);
}

}  // namespace mlinear
}  // namespace dspark
