// The fused kernel of dspark::multi_linear_kv_write (T <= 16, head_dim 64 or 128): the whole write (projection, K
// norm, RoPE, cache stores) of one head per CTA (or per cluster of S CTAs) on the register-streaming tile of
// multi_linear_direct.cuh (weights loaded from global memory straight into mma.sync fragments: no shared-memory ring,
// no barrier in the main loop), with KvWriteEpilogue of multi_linear_kv_write_kernels.cuh. Plain CUDA (no torch
// headers); the binding is multi_linear_kv_write.cu, the reference math custom_ops/linear/multi_linear_kv_write.py.
//
// A CTA has head_dim / 16 row warps times WK k-warps (a tile is one head: its rows are the head's K or V rows of the
// concatenated K/V rows, all of which exist); each lane keeps D chunks of 4 E columns in flight.
//
// The op launches kFusedKWarps, kFusedCols, kFusedDepth and one CTA per head. H200, benchmarks/kv_write_tune.cu
// (`regs`), one launch after an L2 flush, µs at T = 1 / 8 / 16: Qwen3-8B draft dims (80 heads of 128, K 4096) 30.0 /
// 31.0 / 32.1 against 34.8 / 36.6 / 36.7 for the previous tile (cp.async into a shared-memory ring, 141-153 KB, one
// CTA per SM); Qwen3-4B 22.8 / 23.0 / 24.4 against 26.8 / 27.4 / 28.9; hidden 7168, 160 heads of 64: 45.9 / 47.4 /
// 51.8 against 53.0 / 53.1 / 57.4. Clusters of 2 or 4, 1 k-warp, or 16 / 32 columns per lane were slower.
#pragma once

#include "linear/multi_linear_direct.cuh"
#include "linear/multi_linear_kv_write_kernels.cuh"

namespace dspark {
namespace mlinear {

constexpr int kFusedKWarps = 2;  // k-warps per row warp
constexpr int kFusedCols = 8;    // columns per lane and chunk (a 16-byte vector)
constexpr int kFusedDepth = 4;   // chunks in flight per lane

template <int V, int WK>
__host__ __device__ constexpr int fused_threads() {
  return direct_threads<2 * V, WK>();
}

// Shared memory: the fp32 bias [head_dim], the tile [8 NT][tile_pitch(head_dim)], the epilogue's staging area.
template <int V, int NT>
__host__ __device__ constexpr int fused_smem_bytes() {
  return direct_smem_bytes<2 * V, NT, KvWriteEpilogue<V>>();
}

template <typename T, int V, int NT, int WK = kFusedKWarps, int E = kFusedCols, int D = kFusedDepth>
__global__ void __launch_bounds__(fused_threads<V, WK>())
    kv_write_fused_kernel(const __grid_constant__ KvWriteArgs args) {
  direct_tile<T, 2 * V, NT, WK, E, D, true, KvWriteEpilogue<V>>(args);
}

}  // namespace mlinear
}  // namespace dspark
