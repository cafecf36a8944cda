// EXPERIMENTAL (benchmarks/kv_write_tune.cu and the kernel emulation tests; no op launches it). A wide fused tile for
// dspark::multi_linear_kv_write (sm_90a): one head of 64 or 128 weight rows by up to 64 tokens per CTA, on the
// warpgroup MMA (wgmma.cuh beside it), with the op's fused epilogue (KvWriteEpilogue of
// custom_ops/csrc/linear/multi_linear_kv_write_kernels.cuh): projections, k_norm, RoPE and cache writes in one launch
// for up to 64 tokens. It was in the op behind an opt-in environment variable until it had been measured slower than
// the op's paths at every token count on the H200 and the H100 (than the fused kernel up to 16 tokens, than the GEMM
// path at 32 and 64: BENCHMARKS.md, "The wide fused tile" and "The wide tiles at 32 and 64 tokens on the H100"),
// bound by this single warpgroup's per-step barrier and per-thread copies; kv_write_wide_tma_kernel.cuh beside it is
// the same tile with a producer warp and tensor-map copies.
//
// Why a second fused tile: the mma.sync tile of multi_linear_kernels.cuh puts tokens on the MMA's N side (8 per
// n-tile) and re-reads its weight fragments from shared memory for every n-tile, so its shared-memory traffic
// grows with T; above 16 tokens it became slower than a GEMM plus the heads kernel (48.5 / 65.7 us at 32 / 64 tokens
// against 40.1 / 40.4 on the H200, Qwen3-8B draft dims). A warpgroup MMA of 64 tokens by the head's rows reads each
// shared-memory byte once per K step whatever T is, so one launch costs about the same at 1 and at 64 tokens.
//
// One CTA = one warpgroup (128 threads) = one head (kRows = head_dim rows of one layer's K or V segment; heads never
// straddle segments). The K loop walks chunks of 64 columns (128 bytes per row) through a ring of D shared-memory
// stages filled by cp.async (16 bytes per thread and copy; columns past K and tokens past T zero), each stage
// [64 tokens][128 B] of the activation then [kRows][128 B] of weights, both in the 128-byte swizzle, D - 2 chunks in
// flight while the warpgroup multiplies: four m64nNk16 MMAs per chunk (N = kRows), fp32 accumulators in registers,
// the MMAs of one chunk running while the warpgroup waits for the next. Every thread copies fixed 16-byte columns
// of fixed rows (thread t: column chunk t % 8 of rows t / 8 + 16 j), so its destinations and their swizzle are
// computed once. After the loop the accumulators go to the fp32 tile [64][tile_pitch(kRows)] over the drained ring
// and the epilogue writes each token's head into the caches, as the mma.sync tile's epilogue does (its cluster is
// one CTA). Programmatic dependent launch as there: the dependency wait before the first read, dependents released
// after the last copy.
#pragma once

#include "linear/multi_linear_kv_write_kernels.cuh"
#include "wgmma.cuh"

namespace dspark {
namespace mlinear {

constexpr int kWideTokens = 64;   // tokens per tile: the MMA's M
constexpr int kWideThreads = 128;  // one warpgroup
constexpr int kWideChunk = 64;    // K columns per stage: one 128-byte row of 2-byte elements
constexpr int kWideRowBytes = kWideChunk * 2;

// Ring stages: 7 for heads of 128 (168 KB: one CTA per SM, as the one-head tile), 5 for heads of 64 (80 KB: two CTAs
// per SM).
__host__ __device__ constexpr int wide_stages(int rows) { return rows == 128 ? 7 : 5; }
__host__ __device__ constexpr int wide_stage_bytes(int rows) { return (kWideTokens + rows) * kWideRowBytes; }
__host__ __device__ constexpr int wide_ring_bytes(int rows) { return wide_stages(rows) * wide_stage_bytes(rows); }
// Dynamic shared memory: up to 1 KB to align the ring to 1024 bytes, the ring (the fp32 tile after the loop), the
// tile's fp32 bias [rows], then the epilogue's staging area.
__host__ __device__ constexpr int wide_smem_bytes(int rows, int extra) {
  return 1024 + wide_ring_bytes(rows) + 4 * rows + extra;
}
static_assert(kWideTokens * tile_pitch(128) * 4 <= wide_ring_bytes(128), "the fp32 tile fits over the ring");
static_assert(kWideTokens * tile_pitch(64) * 4 <= wide_ring_bytes(64), "the fp32 tile fits over the ring");

template <typename T, int kRows>
__device__ __forceinline__ void wide_mma(float (&acc)[kRows / 2], uint64_t a, uint64_t b) {
  if constexpr (kRows == 128) {
    wgmma_m64n128k16<T>(acc, a, b, 1);
  } else {
    wgmma_m64n64k16<T>(acc, a, b, 1);
  }
}

// The warpgroup's accumulators (wgmma.cuh's layout: tokens as the MMA's rows) into the fp32 tile [kWideTokens][pitch]
// of the epilogue (`warp`, `lane`: the thread's place in the warpgroup).
template <int kRows>
__device__ __forceinline__ void store_accumulators(float* tile, const float (&acc)[kRows / 2], int warp, int lane) {
  constexpr int kPitch = tile_pitch(kRows);
  const int token = 16 * warp + lane / 4, column = 2 * (lane % 4);
#pragma unroll
  for (int i = 0; i < kRows / 8; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* row = tile + (token + 8 * h) * kPitch + 8 * i + column;
      row[0] = acc[4 * i + 2 * h];
      row[1] = acc[4 * i + 2 * h + 1];
    }
  }
}

// The epilogue of a wide tile on its kThreads threads, once the tile is complete and visible.
template <typename T, int kRows, int kThreads, typename Epilogue>
__device__ __forceinline__ void finish_wide(const typename Epilogue::Args& args, float* tile, const float* bias,
                                            const float* extra, int64_t row0, int64_t total_rows) {
  const int64_t rows_left = total_rows - row0;
  const int rows = rows_left < kRows ? static_cast<int>(rows_left) : kRows;
  Epilogue::template finish<T, kRows, kWideTokens, kThreads>(args, tile, bias, extra, row0, rows,
                                                              ClusterCoord{blockIdx.x, 0, 1});
}

template <typename T, int kRows, typename Epilogue>
__global__ void __launch_bounds__(kWideThreads, 1)
    wide_head_kernel(const __grid_constant__ typename Epilogue::Args args) {
#if DSPARK_WGMMA_CODE
  static_assert(kRows == 64 || kRows == 128, "a tile is one head of 64 or 128 rows");
  constexpr int D = wide_stages(kRows), kStage = wide_stage_bytes(kRows);
  constexpr int kRowGroups = kRows / 16, kTokenGroups = kWideTokens / 16;  // rows per thread: t / 8 + 16 j
  const Params& p = Epilogue::gemm(args);
  const int t = static_cast<int>(threadIdx.x), warp = t / 32, lane = t % 32;
  const int64_t total_rows = p.segment_end[p.num_segments - 1];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  if (row0 >= total_rows) return;  // the host launches none; no pointer is formed from rows past the last

  unsigned char* base = reinterpret_cast<unsigned char*>(cta_smem());
  const uint32_t base_addr = static_cast<uint32_t>(__cvta_generic_to_shared(base));
  unsigned char* ring = base + ((1024u - (base_addr & 1023u)) & 1023u);
  const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  float* tile = reinterpret_cast<float*>(ring);  // after the loop: [kWideTokens][tile_pitch(kRows)]
  float* bias = reinterpret_cast<float*>(ring + wide_ring_bytes(kRows));
  float* extra = bias + kRows;

  // This thread's copies: column chunk `part` of rows first + 16 j (weights) and tokens first + 16 j (activation),
  // stored at chunk part ^ (row % 8) of the row (row % 8 == first % 8 for all of them).
  const int part = t % 8, first = t / 8;
  const uint32_t swizzled = static_cast<uint32_t>(first * kWideRowBytes + ((part ^ (first % 8)) << 4));
  const int tokens = p.tokens < kWideTokens ? p.tokens : kWideTokens;
  const T* w_src[kRowGroups];
#pragma unroll
  for (int j = 0; j < kRowGroups; ++j) {
    const int64_t row = row0 + first + 16 * j;
    w_src[j] = weight_row<T>(p, row < total_rows ? row : total_rows - 1) + 8 * part;
  }
  const T* x_src[kTokenGroups];
#pragma unroll
  for (int j = 0; j < kTokenGroups; ++j) {
    const int token = first + 16 * j;
    x_src[j] = static_cast<const T*>(p.x) + (token < tokens ? token : 0) * p.x_stride + 8 * part;
  }
  // Tokens past T are never copied: their activation rows stay zero in every stage (their results are not stored).
  for (int i = t; i < D * kWideTokens * 8; i += kWideThreads) {
    const int stage = i / (kWideTokens * 8), token = (i / 8) % kWideTokens;
    if (token >= tokens) {
      *reinterpret_cast<uint4*>(ring + stage * kStage + token * kWideRowBytes + (i % 8) * 16) = make_uint4(0, 0, 0, 0);
    }
  }

  const int steps = (p.k + kWideChunk - 1) / kWideChunk;
  auto issue = [&](int step) {
    unsigned char* stage = ring + (step % D) * kStage;
    const int col = step * kWideChunk + 8 * part;
    const bool in_k = col < p.k;  // K is a multiple of 8: a 16-byte chunk is all in or all out
    const int64_t offset = in_k ? col - 8 * part : 0;
#pragma unroll
    for (int j = 0; j < kTokenGroups; ++j) {
      if (first + 16 * j < tokens) {
        copy_async16(reinterpret_cast<uint4*>(stage + swizzled + j * 16 * kWideRowBytes), x_src[j] + offset, in_k);
      }
    }
#pragma unroll
    for (int j = 0; j < kRowGroups; ++j) {
      const bool live = in_k && row0 + first + 16 * j < total_rows;
      copy_async16(reinterpret_cast<uint4*>(stage + kWideTokens * kWideRowBytes + swizzled + j * 16 * kWideRowBytes),
                   w_src[j] + offset, live);
    }
  };

  pdl_wait();
#pragma unroll 1
  for (int step = 0; step < D - 2; ++step) {
    if (step < steps) issue(step);
    commit_copies();
  }
  typename Epilogue::Prefetch prefetched = Epilogue::template prefetch<T, kWideTokens>(args, row0);
  for (int r = t; r < kRows; r += kWideThreads) {
    bias[r] = row0 + r < total_rows ? bias_of_row<T>(p, row0 + r) : 0.f;
  }

  // Step s: its copies landed, the barrier; then the copies of step s + D - 2 go to the slot of step s - 2, whose
  // MMAs every warp has waited for (in step s - 1, before the barrier), and the MMAs of step s start while those of
  // step s - 1 finish: D - 2 steps of copies and two of MMAs in flight.
  float acc[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    wait_copies<D - 3>();  // this thread's copies of `step` have landed
    fence_async_shared();
    __syncthreads();  // everyone's have, and every warp is past its wait for the MMAs of step - 2
    if (step == steps / 2) Epilogue::template stage<T, kWideTokens>(args, prefetched, extra, row0);
    if (step + D - 2 < steps) issue(step + D - 2);
    commit_copies();
    const uint32_t stage = ring_addr + static_cast<uint32_t>((step % D) * kStage);
    const uint64_t a = swizzle128_descriptor(stage);
    const uint64_t b = swizzle128_descriptor(stage + kWideTokens * kWideRowBytes);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kWideChunk / 16; ++k) wide_mma<T, kRows>(acc, a + 2 * k, b + 2 * k);
    wgmma_commit();
    wgmma_wait<1>();  // the MMAs of step - 1 are done (this warp's share)
  }
  wgmma_wait<0>();
  pin_accumulators(acc);
  wait_copies<0>();
  pdl_launch_next();
  __syncthreads();  // the ring is drained and no MMA reads it: the tile may overwrite it; the staging is visible

  store_accumulators<kRows>(tile, acc, warp, lane);
  __syncthreads();
  finish_wide<T, kRows, kWideThreads, Epilogue>(args, tile, bias, extra, row0, total_rows);
#endif
}

}  // namespace mlinear
}  // namespace dspark
