// The register-streaming tile of the multi-weight GEMM: every lane loads its weights and activation from global
// memory straight into mma.sync fragments, no shared-memory ring and no barrier in the main loop. Plain CUDA (no torch
// headers). Two kernels run it: the K/V write's fused kernel (multi_linear_kv_write_fused.cuh, its norm/RoPE/cache
// epilogue on whole heads) and `multi_linear_direct_kernel` below (bias and store, the epilogue of
// multi_linear_kernel; benchmarks/multi_linear_tune.cu measures it against that kernel; the op does not launch it: as
// op variants it was 1.2-1.5x slower than multi_linear_kernel on the H200, BENCHMARKS.md "Register-streaming
// variants").
//
// Fragments. Lane (group g = lane / 4, quad c = lane % 4) of a warp holds rows g and g + 8 of the warp's 16 rows and
// token g of each n-tile of 8 tokens. In a chunk of 4 E columns starting at `col` it loads the E columns
// col + c E .. col + c E + E - 1 of its two rows and of its token: E / 8 16-byte vectors each. Vector i of the rows
// and of the token feeds two m16n8k16 MMAs, (x, y) then (z, w): the MMA's k slots (2c, 2c + 1) and (2c + 8, 2c + 9)
// are the columns col + c E + 8 i + {0, 1} and {2, 3} (then {4, 5}, {6, 7}) in both operands, so the sum over k is
// the same sum in another order (multi_linear_kernels.cuh gives the fragment layouts).
//
// Work. Cluster `id` is tile `id`: rows id * 16 WR .. of the launch's concatenated rows (each row resolved to its
// weight segment on its own). A CTA has WR row warps of 16 rows times WK k-warps; the K chunks are split evenly over
// the cluster's S * WK k-parts, and each lane keeps D chunks of loads in flight in registers. A lane's vectors past K
// load nothing and count as zeros (K is a multiple of 8, so a vector is all in or all out); so do rows past the last
// row (never read; unless kWholeTiles: every tile's rows exist, as the K/V write's heads do, and no lane checks). After
// the loop the k-warps of a row warp add their accumulators into the CTA's fp32 tile in turn, and the epilogue's
// `finish` adds the bias and the cluster's partial tiles (distributed shared memory) and does the rest.
//
// Dependencies: before griddepcontrol.wait only L2 prefetches of the first chunks of weights (prefetch.global.L2
// returns nothing: the loads after the wait read L2, which is coherent, so a weight updated in place by the kernel
// before is read as updated); griddepcontrol.launch_dependents once the main loop is done.
#pragma once

#include "linear/multi_linear_kernels.cuh"

namespace dspark {
namespace mlinear {

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

template <int WR, int WK>
__host__ __device__ constexpr int direct_threads() {
  return 32 * WR * WK;
}

// Shared memory: the fp32 bias [16 WR], the tile [8 NT][tile_pitch(16 WR)], the epilogue's staging area.
template <int WR, int NT, typename Epilogue>
__host__ __device__ constexpr int direct_smem_bytes() {
  return 4 * 16 * WR + 4 * 8 * NT * tile_pitch(16 * WR) + Epilogue::extra_bytes(8 * NT);
}

// One cluster's tile (see the header comment); the body of the kernels that run it.
template <typename T, int WR, int NT, int WK, int E, int D, bool kWholeTiles, typename Epilogue>
__device__ __forceinline__ void direct_tile(const typename Epilogue::Args& args) {
  constexpr int kRows = 16 * WR, kTokens = 8 * NT, kThreads = direct_threads<WR, WK>();
  constexpr int kVecs = E / 8, kCols = 4 * E, kPitch = tile_pitch(kRows);
  static_assert(E % 8 == 0 && D >= 1, "E is a multiple of 8");
  const Params& p = Epilogue::gemm(args);
  float* bias = cta_smem();
  float* tile = bias + kRows;
  float* extra = tile + kTokens * kPitch;
  const ClusterCoord cluster = cluster_coord();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int row_warp = warp % WR, k_warp = warp / WR;
  const int group = lane / 4, quad = lane % 4;
  const int64_t row0 = static_cast<int64_t>(cluster.id) * kRows;
  // A cluster past the last tile returns before forming any pointer from its rows (the host launches none).
  if (row0 >= p.segment_end[p.num_segments - 1]) return;

  const int64_t total_rows = p.segment_end[p.num_segments - 1];
  const int64_t r0 = row0 + row_warp * 16 + group;
  const bool live0 = kWholeTiles || r0 < total_rows;
  const T* w0 = weight_row<T>(p, live0 ? r0 : total_rows - 1) + quad * E;
  const bool live1 = kWholeTiles || r0 + 8 < total_rows;
  const T* w1 = weight_row<T>(p, live1 ? r0 + 8 : total_rows - 1) + quad * E;
  const int chunks = (p.k + kCols - 1) / kCols;
  const int parts = static_cast<int>(cluster.size) * WK, part = static_cast<int>(cluster.rank) * WK + k_warp;
  const int begin = static_cast<int>(static_cast<int64_t>(chunks) * part / parts);
  const int end = static_cast<int>(static_cast<int64_t>(chunks) * (part + 1) / parts);
#pragma unroll
  for (int d = 0; d < D; ++d) {
    const int col = (begin + d) * kCols;
    if (begin + d < end && col + quad * E < p.k) {
      if (live0) prefetch_l2(w0 + col);
      if (live1) prefetch_l2(w1 + col);
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
      w[0][i] = live && live0 ? load_stream16(w0 + at) : make_uint4(0, 0, 0, 0);
      w[1][i] = live && live1 ? load_stream16(w1 + at) : make_uint4(0, 0, 0, 0);
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
  // The epilogue's own loads (the K/V write: indices, norm weight, cos/sin rows) start while the first chunks are
  // in flight.
  typename Epilogue::Prefetch prefetched = Epilogue::template prefetch<T, kTokens>(args, row0);
  for (int r = static_cast<int>(threadIdx.x); r < kRows; r += kThreads) {
    bias[r] = kWholeTiles || row0 + r < total_rows ? bias_of_row<T>(p, row0 + r) : 0.f;
  }
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
  wait_copies<0>();  // the epilogue's asynchronous copies
#pragma unroll
  for (int j = 0; j < WK; ++j) {
    if (k_warp == j) add_to_tile<1, NT, kPitch>(tile, acc, row_warp, lane, j == 0);
    __syncthreads();
  }
  const int64_t rows_left = total_rows - row0;
  const int rows = kWholeTiles || rows_left >= kRows ? kRows : static_cast<int>(rows_left);
  Epilogue::template finish<T, kRows, kTokens, kThreads>(args, tile, bias, extra, row0, rows, cluster);
}

// The multi-weight GEMM of dspark::multi_linear on the register-streaming tile: out = x W^T + bias, one tile of
// 16 WR rows per cluster of S CTAs (split K), launched with direct_threads<WR, WK>() threads and
// direct_smem_bytes<WR, NT, StoreEpilogue>() bytes of shared memory.
template <typename T, int WR, int NT, int WK, int E, int D>
__global__ void __launch_bounds__(direct_threads<WR, WK>()) multi_linear_direct_kernel(const __grid_constant__ Params p) {
  direct_tile<T, WR, NT, WK, E, D, false, StoreEpilogue>(p);
}

}  // namespace mlinear
}  // namespace dspark
