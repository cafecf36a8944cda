// The register-streaming tile of the multi-weight GEMM: every lane loads its weights and activation from global
// memory straight into mma.sync fragments, no shared-memory ring and no barrier in the main loop. Plain CUDA (no torch
// headers). Two kernels run it: the K/V write's fused kernel (multi_linear_kv_write_fused.cuh, its norm/RoPE/cache
// epilogue on whole heads) and `multi_linear_direct_kernel` below (bias and store, the epilogue of
// multi_linear_kernel): the op compiles it as the variants of kDirectVariants, which only `_multi_linear_variant`
// runs (benchmarks/multi_linear.py's sweep and benchmarks/multi_linear_tune.cu measure them against the ring tile
// and cuBLAS).
//
// Fragments. Lane (group g = lane / 4, quad c = lane % 4) of a warp holds rows g and g + 8 of the warp's 16 rows and
// token g of each n-tile of 8 tokens. In a chunk of 4 E columns starting at `col` it loads the E columns
// col + c E .. col + c E + E - 1 of its two rows and of its token: E / 8 16-byte vectors each. Vector i of the rows
// and of the token feeds two m16n8k16 MMAs, (x, y) then (z, w): the MMA's k slots (2c, 2c + 1) and (2c + 8, 2c + 9)
// are the columns col + c E + 8 i + {0, 1} and {2, 3} (then {4, 5}, {6, 7}) in both operands, so the sum over k is
// the same sum in another order (multi_linear_kernels.cuh gives the fragment layouts).
//
// Work. Cluster `id` is tile `id`: rows id * 16 WR RS .. of the launch's concatenated rows (each row resolved to its
// weight segment on its own). A CTA has WR row warps of 16 rows times WK k-warps, and each lane keeps D chunks of
// loads in flight in registers. The cluster's S CTAs split the tile's K (RS = 1: the K chunks are split evenly over
// the cluster's S * WK k-parts) or its rows (RS = S > 1: CTA `rank` computes rows rank * 16 WR .. of the tile over the
// whole K, split over its WK k-warps, and leaves the other rows of its partial tile zero, so that the epilogue's sum
// of the cluster's partial tiles is the same as for a split K; more, smaller CTAs for a tile the epilogue must see
// whole, such as a head that is normed and rotated; only where clusters run: the sm_90a code). A lane's vectors past K
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

// Shared memory of a tile of 16 WR rows (the cluster's rows where it splits them): the fp32 bias [16 WR], the tile
// [8 NT][tile_pitch(16 WR)], the epilogue's staging area.
template <int WR, int NT, typename Epilogue>
__host__ __device__ constexpr int direct_smem_bytes() {
  return 4 * 16 * WR + 4 * 8 * NT * tile_pitch(16 * WR) + Epilogue::extra_bytes(8 * NT);
}

// One cluster's tile (see the header comment); the body of the kernels that run it.
template <typename T, int WR, int NT, int WK, int E, int D, bool kWholeTiles, typename Epilogue, int RS = 1>
__device__ __forceinline__ void direct_tile(const typename Epilogue::Args& args) {
  constexpr int kCtaRows = 16 * WR, kRows = RS * kCtaRows, kTokens = 8 * NT, kThreads = direct_threads<WR, WK>();
  constexpr int kVecs = E / 8, kCols = 4 * E, kPitch = tile_pitch(kRows);
  static_assert(E % 8 == 0 && D >= 1, "E is a multiple of 8");
  static_assert(RS >= 1 && RS <= kMaxSplit, "a row split is a cluster of at most kMaxSplit CTAs");
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
  const int first_row = RS > 1 ? static_cast<int>(cluster.rank) * kCtaRows : 0;  // this CTA's rows in the tile
  const int64_t r0 = row0 + first_row + row_warp * 16 + group;
  const bool live0 = kWholeTiles || r0 < total_rows;
  const T* w0 = weight_row<T>(p, live0 ? r0 : total_rows - 1) + quad * E;
  const bool live1 = kWholeTiles || r0 + 8 < total_rows;
  const T* w1 = weight_row<T>(p, live1 ? r0 + 8 : total_rows - 1) + quad * E;
  const int chunks = (p.k + kCols - 1) / kCols;
  const int parts = RS > 1 ? WK : static_cast<int>(cluster.size) * WK;
  const int part = RS > 1 ? k_warp : static_cast<int>(cluster.rank) * WK + k_warp;
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
  if constexpr (RS > 1) {  // the other CTAs' rows of this CTA's partial tile
    for (int i = static_cast<int>(threadIdx.x); i < kTokens * (kRows - kCtaRows); i += kThreads) {
      const int token = i / (kRows - kCtaRows), r = i % (kRows - kCtaRows);
      tile[token * kPitch + (r < first_row ? r : r + kCtaRows)] = 0.f;
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
    if (k_warp == j) add_to_tile<1, NT, kPitch>(tile, acc, first_row / 16 + row_warp, lane, j == 0);
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

// ------------------------------------------------------------------------------------------------ the op's variants

// A register-streaming configuration: WR row warps x WK k-warps, E columns per lane and chunk, D chunks in flight.
struct DirectVariant {
  int row_warps;
  int k_warps;
  int lane_cols;
  int depth;
};

// The configurations the op compiles: its variants kNumVariants .. kNumVariants + kNumDirectVariants - 1 of
// `_multi_linear_variant` (after the ring tile's kVariants), for the benchmark sweep and the tests; the op's default
// choice (default_variant) does not take them. 128, 64 and 32 rows, 8 or 16 warps, 4 chunks of 32 columns in flight:
// 89-118 registers without spills at 1 and 2 token tiles (ptxas, sm_90a). benchmarks/multi_linear_tune.cu times
// these and more against the ring tile and cuBLAS.
constexpr DirectVariant kDirectVariants[] = {
    {8, 2, 8, 4},  // 128 rows, 2 k-warps
    {4, 2, 8, 4},  // 64 rows, 2 k-warps
    {4, 4, 8, 4},  // 64 rows, 4 k-warps
    {2, 4, 8, 4},  // 32 rows, 4 k-warps
};
constexpr int kNumDirectVariants = sizeof(kDirectVariants) / sizeof(kDirectVariants[0]);
// Tokens the register-streaming tile takes: 1 or 2 n-tiles (more tokens' accumulators take the registers of the
// loads in flight).
constexpr int kDirectMaxTokens = 16;

__host__ __device__ constexpr int cta_rows(const DirectVariant& v) { return 16 * v.row_warps; }
__host__ __device__ constexpr int cta_threads(const DirectVariant& v) { return 32 * v.row_warps * v.k_warps; }

template <typename T, int V, int NT>
KernelFn direct_instance() {
  constexpr DirectVariant v = kDirectVariants[V];
  return &multi_linear_direct_kernel<T, v.row_warps, NT, v.k_warps, v.lane_cols, v.depth>;
}

template <int V>
constexpr int direct_variant_smem(int n_tiles) {
  constexpr DirectVariant v = kDirectVariants[V];
  return n_tiles == 1 ? direct_smem_bytes<v.row_warps, 1, StoreEpilogue>()
                      : direct_smem_bytes<v.row_warps, 2, StoreEpilogue>();
}

// The kernel and its shared memory for direct variant `index` (0..kNumDirectVariants-1) at `tokens` <=
// kDirectMaxTokens tokens.
struct DirectLaunch {
  KernelFn fn;
  int smem;
};

template <typename T, int... V>
DirectLaunch select_direct(int index, int n_tiles, std::integer_sequence<int, V...>) {
  DirectLaunch out{nullptr, 0};
  ((index == V ? (out = {n_tiles == 1 ? direct_instance<T, V, 1>() : direct_instance<T, V, 2>(),
                         direct_variant_smem<V>(n_tiles)},
                  0)
               : 0),
   ...);
  return out;
}

template <typename T>
DirectLaunch direct_launch(int index, int tokens) {
  return select_direct<T>(index, token_tiles(tokens), std::make_integer_sequence<int, kNumDirectVariants>{});
}

// Cluster split when none is forced, by the rule of auto_split: double it only while the grid has fewer CTAs than
// half the SMs and every k-part would still get at least `depth` chunks after doubling.
inline int direct_auto_split(const DirectVariant& v, int64_t total_rows, int k, int sm_count) {
  const int64_t tiles = (total_rows + cta_rows(v) - 1) / cta_rows(v);
  const int64_t chunks = (k + 4 * v.lane_cols - 1) / (4 * v.lane_cols);
  int split = 1;
  while (split < kMaxSplit && 2 * tiles * split < sm_count && chunks / (2 * split * v.k_warps) >= v.depth) split *= 2;
  return split;
}

}  // namespace mlinear
}  // namespace dspark
