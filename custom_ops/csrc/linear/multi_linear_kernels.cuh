// Decode-sized multi-weight GEMM of dspark::multi_linear: out[t, r] = sum_k x[t, k] * W(r)[k] (+ bias(r)), where
// r runs over the concatenated rows of several weights, read in place. Plain CUDA (no torch headers): the torch
// binding is multi_linear.cu; tests/test_multi_linear_emulation.py compiles this header for the host.
//
// Work decomposition
//   Output rows (the concatenated weight rows) are cut into CTA tiles of kRows = 16 * MT * WR rows; a tile may span
//   several weights (each lane resolves its own rows). A cluster of S CTAs (S = the split, 1..8) owns one tile and
//   splits K S ways; inside a CTA, WR x WK warps split the tile's rows WR ways (16 * MT rows per warp, all tokens) and
//   the CTA's K range WK ways. Every warp therefore streams a distinct [16 * MT, K / (S * WK)] block of weights once.
//   Partial sums are reduced in shared memory (the WK warps, in turn) and then across the cluster through distributed
//   shared memory (each CTA sums an equal share of the tile's outputs over the S CTAs, adds the bias, rounds once and
//   writes). No global workspace, no counters, no memset: nothing outlives the launch, so any number of launches may
//   run concurrently and the kernel is CUDA-graph capturable.
//
// Tensor cores, "swap AB": mma.sync m16n8k16 with the weight rows as M (16 rows per m-tile), tokens as N (8 per
// n-tile, NT n-tiles = up to 8 * NT tokens) and K = 16 per MMA, fp32 accumulators. PTX fragment layouts (.bf16/.f16,
// "row.col"), with group = lane / 4 (groupID) and quad = lane % 4 (threadID_in_group):
//   A (16 x 16, 4 x .b32):  a0,a1: (row group,     k 2*quad + {0,1})    a2,a3: (row group + 8, k 2*quad + {0,1})
//                           a4,a5: (row group,     k 2*quad + 8 + {0,1}) a6,a7: (row group + 8, k 2*quad + 8 + {0,1})
//                           register j holds elements a(2j) (low half) and a(2j+1) (high half).
//   B (16 x 8, 2 x .b32):   b0,b1: (k 2*quad + {0,1}, col group)       b2,b3: (k 2*quad + 8 + {0,1}, col group)
//   C/D (16 x 8, 4 x f32):  c0,c1: (row group, col 2*quad + {0,1})     c2,c3: (row group + 8, col 2*quad + {0,1})
// K permutation: a dot product does not depend on the order of K, so any bijection between the MMA's logical k and
// physical columns works if A and B use the same one. A warp step covers 32 physical columns [32 s, 32 s + 32); lane
// (group, quad) loads 8 consecutive elements [32 s + 8 quad, +8) with one 16-byte load from each of: weight row
// `group`, weight row `group + 8` (of each m-tile) and token `group` (of each n-tile). Elements 0..3 of those vectors
// feed the step's first MMA and elements 4..7 its second: logical k {2q, 2q+1, 2q+8, 2q+9} = physical
// 32 s + 8 q + {0, 1, 2, 3} (first MMA) or + {4, 5, 6, 7} (second MMA). So with the loaded uint4s Wg, Wg8, X:
//   first MMA:  A = {Wg.x, Wg8.x, Wg.y, Wg8.y}, B = {X.x, X.y}
//   second MMA: A = {Wg.z, Wg8.z, Wg.w, Wg8.w}, B = {X.z, X.w}
// Every weight byte is loaded once, 16 bytes per lane, and read back by the same lane: no ldmatrix, no swizzle, no
// barrier between warps.
//
// Loads: the WR row warps that share a K range (a "k-group") stream their weights AND the matching activation
// columns through the group's ring of D shared-memory stages with cp.async.cg (16 bytes per lane, L1 bypassed,
// zero-filled past K), D - 1 steps in flight while they multiply the oldest stage. Each warp copies its own weight
// rows; the step's activation vectors are copied once per group (n-tile n by row warp n % WR) and read by all WR
// warps, so a group reads T * 64 bytes of activation per step for 16 * MT * WR rows of weights: the taller the
// group, the less L2 traffic per weight byte (what larger T needs). A named barrier per step (WR > 1 only) makes the
// other warps' copies visible and keeps the slot being refilled free. In-flight bytes cost no registers and the
// compiler cannot sink them towards their use (it did with plain loads into registers). The activation travels in
// the same ring because a separate register prefetch of it, one step ahead, put one L2 round trip on every step's
// critical path (measured on the H200: 51-70 % of the copy rate, flat from M = 1 to 16). Rows past the last
// row and tokens past the last token are never read (their ring vectors are zero-filled; their results are never
// stored): with M = 1 the clamped copies of token 0 that lanes of 7 other groups issued to one address made the
// kernel up to 2x slower. Columns past K (only in a ragged last step, K % 32 != 0) read as zeros too. K must be a
// multiple of 8 and every weight row 16-byte aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/pdl.cuh"

namespace dspark {
namespace mlinear {

constexpr int kMaxSegments = 64;  // weights per launch (kernel-parameter table; more weights: more launches)
constexpr int kMaxTokens = 64;    // 8 n-tiles of 8 tokens
constexpr int kStepCols = 32;     // K columns per warp step: 4 lanes x 8 elements
constexpr int kMaxSplit = 8;      // portable cluster size
constexpr int kMaxSmemBytes = 227 * 1024;  // dynamic shared memory per CTA on sm_90 (opt-in above 48 KB)

// Everything a launch reads, passed by value as a __grid_constant__ kernel parameter (no host sync, no device
// table): the launch covers output columns [0, segment_end[num_segments - 1]) of `out`.
struct Params {
  const void* x;      // [tokens, k], unit inner stride, 16-byte aligned rows
  int64_t x_stride;   // elements between tokens
  void* out;          // [tokens, out_stride] column 0 of this launch
  int64_t out_stride;
  int tokens;         // 1..kMaxTokens
  int k;              // multiple of 8
  int num_segments;   // 1..kMaxSegments, every segment has >= 1 row
  int64_t segment_end[kMaxSegments];    // exclusive end row of segment i in the launch's concatenated rows
  const void* weight[kMaxSegments];     // first row of segment i, 16-byte aligned
  int64_t weight_stride[kMaxSegments];  // elements between rows, a multiple of 8 (unless the segment has one row)
  const void* bias[kMaxSegments];       // bias of the segment's first row, or nullptr
  int64_t bias_stride[kMaxSegments];
};

// A tile configuration: MT m-tiles per warp, WR x WK warps per CTA, D shared-memory stages per warp (D - 1 steps of
// 32 columns in flight).
struct Variant {
  int m_tiles;
  int row_warps;
  int k_warps;
  int stages;
};

// The configurations compiled in; `_multi_linear_variant` and the sweep address them by index. Chosen on the H200
// with benchmarks/multi_linear_tune.cu (the groups of benchmarks/multi_linear.py, M 1..64, splits 1..8, twelve
// configurations): each of these was the fastest, or within 2 %, for some group and token count; default_variant
// picks among them by group size.
constexpr Variant kVariants[] = {
    {4, 1, 4, 4},  // 64 rows, 4 warps splitting K: groups of about one tile per SM
    {1, 1, 4, 8},  // 16 rows: groups too small for 64-row tiles on every eighth SM
    {2, 1, 4, 8},  // 32 rows: groups with fewer 64-row tiles than SMs
    {2, 2, 2, 4},  // 64 rows, 2 x 2 warps sharing the activation: groups of >= 2 tiles per SM
    {2, 4, 2, 4},  // 128 rows, 4 x 2 warps
};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

__host__ __device__ constexpr int cta_rows(const Variant& v) { return 16 * v.m_tiles * v.row_warps; }
__host__ __device__ constexpr int cta_threads(const Variant& v) { return 32 * v.row_warps * v.k_warps; }
// Row pitch (floats) of the [token][row] partial tile in shared memory: pitch = 4 (mod 16) puts the 32 lanes of an
// accumulator store (rows group + const, tokens 2 * quad + const) in 32 different banks.
__host__ __device__ constexpr int tile_pitch(int rows) { return rows + 4; }
// One ring stage of one k-group, in 16-byte vectors: [WR][MT][2][32 lanes] weight vectors, then [NT][32 lanes]
// activation vectors.
__host__ __device__ constexpr int stage_vectors(int row_warps, int m_tiles, int n_tiles) {
  return (2 * row_warps * m_tiles + n_tiles) * 32;
}
// Shared memory: the tile's fp32 bias [rows], then either the k-groups' rings [WK][D][stage] (main loop) or the fp32
// partial tile [8 * n_tiles][pitch] (epilogue).
__host__ __device__ constexpr int ring_bytes(const Variant& v, int n_tiles) {
  return v.k_warps * v.stages * stage_vectors(v.row_warps, v.m_tiles, n_tiles) * 16;
}
__host__ __device__ constexpr int tile_bytes(const Variant& v, int n_tiles) {
  return 8 * n_tiles * tile_pitch(cta_rows(v)) * 4;
}
__host__ __device__ constexpr int smem_bytes(const Variant& v, int n_tiles) {
  return cta_rows(v) * 4 +
         (ring_bytes(v, n_tiles) > tile_bytes(v, n_tiles) ? ring_bytes(v, n_tiles) : tile_bytes(v, n_tiles));
}

// ------------------------------------------------------------------------------------------------ device primitives

// Hooks: on the GPU these are single instructions; DSPARK_KERNEL_EMULATION (the host build of the tests) supplies
// emu_* functions instead. The remaining branch is the host pass of nvcc, which never runs device code.

// 16 bytes from global `src` to shared `dst`, asynchronously (L1 bypassed); zeros instead when !live (nothing read).
__device__ __forceinline__ void copy_async16(uint4* dst, const void* src, bool live) {
#if defined(__CUDA_ARCH__)
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(to), "l"(src), "r"(live ? 16 : 0)
               : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_copy_async(dst, src, 16, live);
#endif
}

// Closes the group of copies issued since the last commit.
__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;" ::: "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_commit_copies();
#endif
}

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_wait_copies(kPending);
#endif
}

// D = A * B + D for one m16n8k16 tile (fragments as in the header comment).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_mma_16816(std::is_same_v<T, __nv_bfloat16>, d, a0, a1, a2, a3, b0, b1);
#endif
}

// This CTA's cluster: its index in the grid (= the tile), its rank in the cluster and the cluster size (= split).
struct ClusterCoord {
  unsigned id;
  unsigned rank;
  unsigned size;
};

__device__ __forceinline__ ClusterCoord cluster_coord() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ClusterCoord c;
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(c.id));
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(c.rank));
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(c.size));
  return c;
#elif defined(DSPARK_KERNEL_EMULATION)
  ClusterCoord c;
  emu_cluster_coord(c.id, c.rank, c.size);
  return c;
#else
  return {blockIdx.x, 0, 1};
#endif
}

// Every thread of the cluster arrives; shared-memory writes before it are visible to the whole cluster after it.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_cluster_sync();
#else
  __syncthreads();
#endif
}

// The address of `local` (this CTA's shared memory) in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ const float* cluster_peer(const float* local, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t peer;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(peer) : "l"(local), "r"(rank));
  return reinterpret_cast<const float*>(peer);
#elif defined(DSPARK_KERNEL_EMULATION)
  return emu_cluster_peer(local, rank);
#else
  return local;
#endif
}

__device__ __forceinline__ float* cta_smem() {
#if defined(DSPARK_KERNEL_EMULATION)
  return emu_cta_smem();
#else
  extern __shared__ float4 dynamic_smem[];
  return reinterpret_cast<float*>(dynamic_smem);
#endif
}

// Barrier `id` (1..15; 0 is __syncthreads) of `threads` threads (whole warps) of this CTA; orders their shared-memory
// accesses like __syncthreads.
__device__ __forceinline__ void group_barrier(int id, int threads) {
#if defined(__CUDA_ARCH__)
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_group_barrier(id, threads);
#endif
}

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return __float2half_rn(v);
  }
}

// ------------------------------------------------------------------------------------------------ segments

// The segment holding concatenated row `row` (< the launch's rows): the first i with row < segment_end[i].
// Segments are non-empty, so segment_end is strictly increasing.
__device__ __forceinline__ int find_segment(const Params& p, int64_t row) {
  int lo = 0, hi = p.num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (row < p.segment_end[mid]) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

__device__ __forceinline__ int64_t row_in_segment(const Params& p, int segment, int64_t row) {
  return row - (segment == 0 ? 0 : p.segment_end[segment - 1]);
}

template <typename T>
__device__ __forceinline__ const T* weight_row(const Params& p, int64_t row) {
  const int s = find_segment(p, row);
  return static_cast<const T*>(p.weight[s]) + row_in_segment(p, s, row) * p.weight_stride[s];
}

template <typename T>
__device__ __forceinline__ float bias_of_row(const Params& p, int64_t row) {
  const int s = find_segment(p, row);
  if (p.bias[s] == nullptr) return 0.f;
  return to_float(static_cast<const T*>(p.bias[s])[row_in_segment(p, s, row) * p.bias_stride[s]]);
}

// ------------------------------------------------------------------------------------------------ kernel

// The rows and tokens a lane copies, and which of them exist (the others are zero-filled, never read).
template <typename T, int MT, int NT>
struct LaneSources {
  const T* w[MT][2];
  bool w_live[MT][2];
  const T* x[NT];
  bool x_live[NT];
};

// Where a warp's vectors live in its k-group's ring [D][stage]: slot `slot`, then its own [MT][2][32] weight vectors
// (row warp `row_warp`) and the group's shared [NT][32] activation vectors.
template <int MT, int NT, int WR>
struct RingView {
  uint4* ring;
  int row_warp;
  __device__ __forceinline__ uint4* weights(int slot) const {
    return ring + slot * stage_vectors(WR, MT, NT) + row_warp * 2 * MT * 32;
  }
  __device__ __forceinline__ uint4* activation(int slot) const {
    return ring + slot * stage_vectors(WR, MT, NT) + 2 * WR * MT * 32;
  }
};

// Issues this lane's copies of step `step` into ring slot `slot`: its 16 bytes of rows group and group + 8 of each
// of the warp's m-tiles, and of token group of the n-tiles this row warp copies for the group (n % WR == row_warp);
// zeros for lanes past K.
template <typename T, int MT, int NT, int WR>
__device__ __forceinline__ void copy_step(const RingView<MT, NT, WR>& ring, int slot,
                                          const LaneSources<T, MT, NT>& src, int step, int k, int lane, int quad) {
  const int64_t col = static_cast<int64_t>(step) * kStepCols;
  const bool live = col + 8 * quad < k;
  const int64_t at = live ? col : 0;
  uint4* w = ring.weights(slot);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) copy_async16(w + (m * 2 + h) * 32 + lane, src.w[m][h] + at, live && src.w_live[m][h]);
  }
  uint4* x = ring.activation(slot);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    if (n % WR == ring.row_warp) copy_async16(x + n * 32 + lane, src.x[n] + at, live && src.x_live[n]);
  }
}

// acc += W(step) x(step)^T for one step: 2 MMAs per (m-tile, n-tile), fragments as in the header comment.
template <typename T, int MT, int NT>
__device__ __forceinline__ void mma_step(float (&acc)[MT][NT][4], const uint4 (&wv)[MT][2], const uint4 (&xv)[NT]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const uint4& lo = wv[m][0];
      const uint4& hi = wv[m][1];
      mma_16816<T>(acc[m][n], lo.x, hi.x, lo.y, hi.y, xv[n].x, xv[n].y);
      mma_16816<T>(acc[m][n], lo.z, hi.z, lo.w, hi.w, xv[n].z, xv[n].w);
    }
  }
}

// Steps [begin, end) of one warp of a k-group (every warp of the group runs the same steps): D - 1 steps of weight
// and activation copies in flight ahead of the step being multiplied. Slot of step s: (s - begin) % D; the slot
// refilled in iteration s is the one read in iteration s - 1, by this lane only (WR == 1) or by the whole group,
// which has passed this iteration's barrier after reading it. Hooks of the epilogue: `after_start` once the first
// copies are in flight, `halfway` once, in the middle of the steps (after them if there are none); copies they
// issue join the current group and are waited for with the rest.
template <typename T, int MT, int NT, int WR, int D, typename AfterStart, typename Halfway>
__device__ __forceinline__ void warp_steps(float (&acc)[MT][NT][4], const RingView<MT, NT, WR>& ring,
                                           const LaneSources<T, MT, NT>& src, int begin, int end, int k, int lane,
                                           int quad, int barrier_id, AfterStart&& after_start, Halfway&& halfway) {
  static_assert(D >= 2 && (D & (D - 1)) == 0, "the stage count must be a power of two");
#pragma unroll
  for (int d = 0; d < D - 1; ++d) {
    if (begin + d < end) copy_step<T, MT, NT, WR>(ring, d, src, begin + d, k, lane, quad);
    commit_copies();
  }
  after_start();
  if (begin >= end) halfway();
  const int middle = begin + (end - begin) / 2;
  for (int s = begin; s < end; ++s) {
    if (s == middle) halfway();
    wait_copies<D - 2>();
    if constexpr (WR > 1) group_barrier(barrier_id, 32 * WR);  // the other warps' activation copies have landed
    const int slot = (s - begin) & (D - 1);
    const uint4* w = ring.weights(slot);
    const uint4* x = ring.activation(slot);
    uint4 wv[MT][2];
    uint4 xv[NT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) wv[m][h] = w[(m * 2 + h) * 32 + lane];
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) xv[n] = x[n * 32 + lane];
    if (s + D - 1 < end) copy_step<T, MT, NT, WR>(ring, (slot + D - 1) & (D - 1), src, s + D - 1, k, lane, quad);
    commit_copies();
    mma_step<T, MT, NT>(acc, wv, xv);
  }
  commit_copies();  // a warp without steps ran `halfway` after its last commit: its copies join a group too
  wait_copies<0>();
}

// Writes the tile's outputs [elem_begin, elem_end) (element e = token * kRows + row): bias + the partial sums of
// the `sources` CTAs of the cluster, rounded once.
template <typename T, int kRows, int kThreads>
__device__ __forceinline__ void store_outputs(const Params& p, const float* tile, const float* bias, int64_t row0,
                                              int rows, int elem_begin, int elem_end, unsigned sources) {
  constexpr int kPitch = tile_pitch(kRows);
  T* out = static_cast<T*>(p.out);
  for (int e = elem_begin + static_cast<int>(threadIdx.x); e < elem_end; e += kThreads) {
    const int token = e / kRows, r = e % kRows;
    if (r >= rows) continue;
    float sum = bias[r];
    if (sources == 1) {
      sum += tile[token * kPitch + r];
    } else {
      for (unsigned q = 0; q < sources; ++q) sum += cluster_peer(tile, q)[token * kPitch + r];
    }
    out[token * p.out_stride + row0 + r] = from_float<T>(sum);
  }
}

// The epilogue of the plain op: bias + the partial sums of the cluster's CTAs, rounded once, stored to `out`.
// An epilogue type names the kernel's argument type (`Args`), where its GEMM parameters are (`gemm`) and what the
// CTA does with its finished partial tile (`finish`); multi_linear_kv_write_kernels.cuh has the other one.
//
// An epilogue may also stage data of its own in shared memory past the ring/tile region (`extra_bytes` for a tile
// of kTokens tokens): `prefetch` runs once the main loop's first copies are in flight and returns raw loaded values
// (registers, no arithmetic on them, so nothing waits for them there), `stage` runs halfway through the main loop,
// when they have arrived, and may write `extra` and issue asynchronous copies into it; both are complete when
// `finish` runs.
struct StoreEpilogue {
  using Args = Params;
  struct Prefetch {};
  static __host__ __device__ constexpr int extra_bytes(int) { return 0; }
  static __device__ __forceinline__ const Params& gemm(const Args& args) { return args; }
  template <typename T, int kTokens>
  static __device__ __forceinline__ Prefetch prefetch(const Args&, int64_t) {
    return {};
  }
  template <typename T, int kTokens>
  static __device__ __forceinline__ void stage(const Args&, const Prefetch&, float*, int64_t) {}

  // The tile [tokens][kPitch] (this CTA's partial sums) and the fp32 bias [kRows] are in shared memory; `rows` of
  // the tile exist.
  template <typename T, int kRows, int kTokens, int kThreads>
  static __device__ __forceinline__ void finish(const Args& p, const float* tile, const float* bias, const float*,
                                                int64_t row0, int rows, const ClusterCoord& cluster) {
    const int elements = (p.tokens < kTokens ? p.tokens : kTokens) * kRows;
    if (cluster.size == 1) {
      store_outputs<T, kRows, kThreads>(p, tile, bias, row0, rows, 0, elements, 1);
      return;
    }
    // Across the cluster: CTA `rank` finishes an equal share of the tile from all S partial tiles. The second
    // barrier keeps every CTA's shared memory alive until all peers have read it.
    cluster_sync();
    const int share_begin = static_cast<int>(static_cast<int64_t>(elements) * cluster.rank / cluster.size);
    const int share_end = static_cast<int>(static_cast<int64_t>(elements) * (cluster.rank + 1) / cluster.size);
    store_outputs<T, kRows, kThreads>(p, tile, bias, row0, rows, share_begin, share_end, cluster.size);
    cluster_sync();
  }
};

// A warp's accumulators into the fp32 tile [tokens][kPitch] (C fragments: m-tile m holds rows (m0 + m) * 16 +
// group and + 8, n-tile n tokens n * 8 + 2 * quad and + 1): stored if `first`, else added to what is there.
template <int MT, int NT, int kPitch>
__device__ __forceinline__ void add_to_tile(float* tile, const float (&acc)[MT][NT][4], int m0, int lane, bool first) {
  const int group = lane / 4, quad = lane % 4;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float& slot = tile[(n * 8 + 2 * quad + (i & 1)) * kPitch + (m0 + m) * 16 + group + 8 * (i >> 1)];
        slot = first ? acc[m][n][i] : slot + acc[m][n][i];
      }
    }
  }
}

template <typename T, int MT, int NT, int WR, int WK, int D, typename Epilogue = StoreEpilogue>
__global__ void __launch_bounds__(32 * WR * WK)
    multi_linear_kernel(const __grid_constant__ typename Epilogue::Args args) {
  constexpr int kRows = 16 * MT * WR, kTokens = 8 * NT, kThreads = 32 * WR * WK, kPitch = tile_pitch(kRows);
  constexpr Variant kVariant{MT, WR, WK, D};
  const Params& p = Epilogue::gemm(args);
  float* bias = cta_smem();                                    // [kRows] fp32 bias of the tile's rows (0: none)
  uint4* rings = reinterpret_cast<uint4*>(bias + kRows);        // main loop: [WK][D][stage]
  float* tile = bias + kRows;                                   // epilogue: [kTokens][kPitch] fp32 partial sums
  float* extra = cta_smem() + (smem_bytes(kVariant, NT) / 4);   // the epilogue's own staging area
  const ClusterCoord cluster = cluster_coord();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int row_warp = warp % WR, k_warp = warp / WR;
  const int group = lane / 4, quad = lane % 4;
  const int64_t total_rows = p.segment_end[p.num_segments - 1];
  const int64_t row0 = static_cast<int64_t>(cluster.id) * kRows;
  // A tile past the last row has no work: it returns before forming any pointer from its rows (an epilogue would
  // resolve them to a layer past the last). The host launches none, but in the code a GPU runs without clusters (the
  // portable PTX: every CTA is a cluster of one, numbered by blockIdx.x) a split launch's CTAs are tiles of their own.
  if (row0 >= total_rows) return;

  LaneSources<T, MT, NT> src;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + (row_warp * MT + m) * 16 + h * 8 + group;
      src.w_live[m][h] = row < total_rows;
      src.w[m][h] = weight_row<T>(p, row < total_rows ? row : total_rows - 1) + 8 * quad;
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int token = n * 8 + group;
    src.x_live[n] = token < p.tokens;
    src.x[n] = static_cast<const T*>(p.x) + (token < p.tokens ? token : 0) * p.x_stride + 8 * quad;
  }

  pdl_wait();
  for (int r = static_cast<int>(threadIdx.x); r < kRows; r += kThreads) {
    bias[r] = row0 + r < total_rows ? bias_of_row<T>(p, row0 + r) : 0.f;
  }

  // This warp's K range: the full steps split evenly over the cluster's S * WK warps of this row group; the last one
  // also takes the ragged step.
  const int full_steps = p.k / kStepCols;
  const int parts = static_cast<int>(cluster.size) * WK, part = static_cast<int>(cluster.rank) * WK + k_warp;
  const int begin = static_cast<int>(static_cast<int64_t>(full_steps) * part / parts);
  const int end_full = static_cast<int>(static_cast<int64_t>(full_steps) * (part + 1) / parts);
  const int end = end_full + (part == parts - 1 && p.k % kStepCols != 0 ? 1 : 0);

  float acc[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.f;
    }
  }
  const RingView<MT, NT, WR> ring{rings + k_warp * D * stage_vectors(WR, MT, NT), row_warp};
  typename Epilogue::Prefetch prefetched{};
  warp_steps<T, MT, NT, WR, D>(
      acc, ring, src, begin, end, p.k, lane, quad, 1 + k_warp,
      [&] { prefetched = Epilogue::template prefetch<T, kTokens>(args, row0); },
      [&] { Epilogue::template stage<T, kTokens>(args, prefetched, extra, row0); });
  pdl_launch_next();
  __syncthreads();  // every ring is drained before the tile overwrites them; the epilogue's staging is visible

  // The CTA's partial tile: the WK warps of each row group add their accumulators in turn.
#pragma unroll
  for (int j = 0; j < WK; ++j) {
    if (k_warp == j) add_to_tile<MT, NT, kPitch>(tile, acc, row_warp * MT, lane, j == 0);
    __syncthreads();
  }

  const int64_t rows_left = total_rows - row0;
  const int rows = rows_left < kRows ? static_cast<int>(rows_left) : kRows;
  Epilogue::template finish<T, kRows, kTokens, kThreads>(args, tile, bias, extra, row0, rows, cluster);
}

// ------------------------------------------------------------------------------------------------ launch shape

using KernelFn = void (*)(Params);

// n-tiles (of 8 tokens) for `tokens` <= kMaxTokens: 1, 2, 4 or 8.
inline int token_tiles(int tokens) { return tokens <= 8 ? 1 : tokens <= 16 ? 2 : tokens <= 32 ? 4 : 8; }

template <typename T, int V, int NT>
KernelFn kernel_instance() {
  constexpr Variant v = kVariants[V];
  static_assert(smem_bytes(v, NT) <= kMaxSmemBytes, "a CTA must fit the opt-in shared-memory limit of sm_90");
  static_assert(v.k_warps <= 15, "one named barrier per k-group: ids 1..15");
  return &multi_linear_kernel<T, v.m_tiles, NT, v.row_warps, v.k_warps, v.stages>;
}

template <typename T, int V>
KernelFn variant_kernel(int n_tiles) {
  switch (n_tiles) {
    case 1:
      return kernel_instance<T, V, 1>();
    case 2:
      return kernel_instance<T, V, 2>();
    case 4:
      return kernel_instance<T, V, 4>();
    default:
      return kernel_instance<T, V, 8>();
  }
}

template <typename T, int... V>
KernelFn select_kernel(int variant, int n_tiles, std::integer_sequence<int, V...>) {
  KernelFn f = nullptr;
  ((variant == V ? (f = variant_kernel<T, V>(n_tiles), 0) : 0), ...);
  return f;
}

// The kernel of variant `variant` (0..kNumVariants-1) for element type T and `tokens` tokens.
template <typename T>
KernelFn kernel_for(int variant, int tokens) {
  return select_kernel<T>(variant, token_tiles(tokens), std::make_integer_sequence<int, kNumVariants>{});
}

// ------------------------------------------------------------------------------------------------ default choice

// The variant the op uses when none is forced, by the number of 64-row tiles of the group (measured on the H200 with
// benchmarks/multi_linear_tune.cu, M 1..32, K 4096 and 12288): 16-row tiles while the group gives fewer than one
// 64-row tile per 8 SMs, 32-row tiles while it gives fewer than one per SM (for K <= 8192: with longer rows the
// 64-row tiles with a split K won), 2 x 2 warps sharing the activation from two tiles per SM on, else 64 rows.
inline int default_variant(int64_t total_rows, int k, int sm_count) {
  constexpr int kRows64 = 0, kRows16 = 1, kRows32 = 2, kShared = 3;
  const int64_t tiles = (total_rows + 63) / 64;
  if (tiles * 8 < sm_count) return kRows16;
  if (tiles < sm_count && k <= 8192) return kRows32;
  return tiles >= 2 * sm_count ? kShared : kRows64;
}

// Cluster split when none is forced: splitting K across CTAs costs a cross-CTA reduction and measured slower
// whenever the tiles already give about every other SM a CTA, so double it only while the grid has fewer CTAs than
// half the SMs and every warp would still get at least D steps (a full ring) after doubling.
inline int auto_split(const Variant& v, int64_t total_rows, int k, int sm_count) {
  const int64_t tiles = (total_rows + cta_rows(v) - 1) / cta_rows(v);
  const int64_t steps = k / kStepCols;
  int split = 1;
  while (split < kMaxSplit && 2 * tiles * split < sm_count && steps / (2 * split * v.k_warps) >= v.stages) split *= 2;
  return split;
}

}  // namespace mlinear
}  // namespace dspark
