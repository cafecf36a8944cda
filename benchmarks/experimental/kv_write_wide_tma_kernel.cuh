// EXPERIMENTAL (benchmarks/kv_write_tune.cu only; not in the op). The wide fused tile of dspark::multi_linear_kv_write
// (kv_write_wide_kernel.cuh beside it: one head by 64 tokens on the warpgroup MMA, the fused
// epilogue) with its main loop warp-specialized: a producer warp loads each K chunk with two tensor-map copies
// (cp.async.bulk.tensor, 2-D boxes of 64 columns in the 128-byte swizzle: the activation's [64 tokens] box, whose
// rows past T the copy engine fills with zeros, and the head's [kRows] box of its weight segment) that complete on the
// chunk's "full" mbarrier; the consumer warpgroup waits on it, runs the chunk's four MMAs, and each of its warps
// releases the slot on its "empty" mbarrier once its MMAs of the chunk are done. No CTA barrier and no per-thread copy
// in the loop: what bounds that wide tile (BENCHMARKS.md, "The wide fused tile").
//
// Plain CUDA (the tensor-map type from cuda.h), sm_90a only like the wgmma primitives it uses; the CPU emulation of
// the kernel tests runs it too (tests/test_multi_linear_kv_write_emulation.py: MMAs reading shared memory only when
// a wait covers them, tensor-map copies landing late and out of order), which found a fault before any device
// run: the epilogue's staging copies were never committed to a group, so no wait covered them. On the H200 it writes
// the right values and is not faster than the op's paths where it would replace them (BENCHMARKS.md, "The wide tile
// with a producer warp and tensor-map copies"), so it stays out of the op.
#pragma once

#include <cuda.h>

#include "common/bulk_copy.cuh"
#include "kv_write_wide_kernel.cuh"

namespace dspark {
namespace mlinear {

constexpr int kTmaConsumerThreads = 128;                       // one warpgroup: warps 0-3
constexpr int kTmaThreads = kTmaConsumerThreads + 32;          // and the producer warp
constexpr int kTmaBoxBytesX = kWideTokens * kWideRowBytes;     // the activation box of one chunk

// The launch's argument: the epilogue's (GEMM parameters and cache table) and the tensor maps of the activation
// ([T, K], boxes of 64 x 64) and of every weight segment ([rows, K] from the segment's first row, boxes of kRows x 64).
template <typename Epilogue>
struct WideTmaArgs {
  typename Epilogue::Args base;
  CUtensorMap x_map;
  CUtensorMap w_map[kMaxSegments];
};

__host__ __device__ constexpr int wide_tma_smem_bytes(int rows, int stages, int extra) {
  return 1024 + stages * wide_stage_bytes(rows) + 2 * 8 * stages + 4 * rows + extra;
}

// Thread 0 makes the ring's D "full" barriers (one producer arrival each, plus the copies' bytes) and D "empty" ones
// (one arrival per consumer warp), then the CTA's barrier makes them visible to every thread; then the dependency
// wait, before any global read.
__device__ __forceinline__ void init_ring_barriers(uint64_t* full, uint64_t* empty, int D) {
  if (threadIdx.x == 0) {
    for (int d = 0; d < D; ++d) {
      mbar_init(full + d, 1);
      mbar_init(empty + d, kTmaConsumerThreads / 32);
    }
    mbar_init_fence();
  }
  __syncthreads();
  pdl_wait();
}

// Loads the 2-D box at (column c0, row r0) of `map` to `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int r0, uint64_t* bar) {
#if DSPARK_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          smem_address(dst)),
      "l"(map), "r"(c0), "r"(r0), "r"(smem_address(bar))
      : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_tma_load_2d(dst, map, c0, r0, bar);
#endif
}

// The consumer warpgroup's MMAs of the chunk in ring stage `stage` (shared address): the activation box, then the
// weights' box, four k16 steps; committed, and the previous chunk's MMAs (this warp's) waited for, so that its slot may
// be refilled.
template <typename T, int kRows>
__device__ __forceinline__ void multiply_stage(float (&acc)[kRows / 2], uint32_t stage) {
  const uint64_t a = swizzle128_descriptor(stage);
  const uint64_t b = swizzle128_descriptor(stage + kTmaBoxBytesX);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kWideChunk / 16; ++k) wide_mma<T, kRows>(acc, a + 2 * k, b + 2 * k);
  wgmma_commit();
  wgmma_wait<1>();
}

template <typename T, int kRows, int D, typename Epilogue>
__global__ void __launch_bounds__(kTmaThreads, 1)
    wide_tma_kernel(const __grid_constant__ WideTmaArgs<Epilogue> args) {
#if DSPARK_WGMMA_CODE
  static_assert(kRows == 64 || kRows == 128, "a tile is one head of 64 or 128 rows");
  constexpr int kStage = wide_stage_bytes(kRows);
  const typename Epilogue::Args& base = args.base;
  const Params& p = Epilogue::gemm(base);
  const int t = static_cast<int>(threadIdx.x), warp = t / 32, lane = t % 32;
  const int64_t total_rows = p.segment_end[p.num_segments - 1];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  if (row0 >= total_rows) return;

  unsigned char* raw = reinterpret_cast<unsigned char*>(cta_smem());
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  unsigned char* ring = raw + ((1024u - (raw_addr & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + D * kStage);
  uint64_t* empty = full + D;
  float* bias = reinterpret_cast<float*>(empty + D);
  float* extra = bias + kRows;
  float* tile = reinterpret_cast<float*>(ring);  // after the loop: [kWideTokens][tile_pitch(kRows)]
  const int steps = (p.k + kWideChunk - 1) / kWideChunk;
  init_ring_barriers(full, empty, D);

  // The producer: chunk s into slot s % D, once the slot's previous chunk is released (s >= D). The first D chunks
  // go out before the epilogue's staging, which every thread of the CTA runs (its loops stride by blockDim.x) while
  // they land; the rest after it.
  const bool producer = t == kTmaConsumerThreads;
  int segment = 0, first_row = 0;
  auto produce = [&](int s) {
    const int slot = s % D;
    if (s >= D) mbar_wait(empty + slot, static_cast<uint32_t>((s / D - 1) & 1));
    mbar_arrive_expect_tx(full + slot, kStage);
    unsigned char* stage = ring + slot * kStage;
    tma_load_2d(stage, &args.x_map, s * kWideChunk, 0, full + slot);
    tma_load_2d(stage + kTmaBoxBytesX, &args.w_map[segment], s * kWideChunk, first_row, full + slot);
  };
  if (producer) {
    segment = find_segment(p, row0);
    first_row = static_cast<int>(row_in_segment(p, segment, row0));
    for (int s = 0; s < D && s < steps; ++s) produce(s);
  }
  const typename Epilogue::Prefetch prefetched = Epilogue::template prefetch<T, kWideTokens>(base, row0);
  for (int r = t; r < kRows; r += kTmaThreads) {
    bias[r] = row0 + r < total_rows ? bias_of_row<T>(p, row0 + r) : 0.f;
  }
  Epilogue::template stage<T, kWideTokens>(base, prefetched, extra, row0);
  commit_copies();  // the staging copies: a wait covers only committed groups

  float acc[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
  if (producer) {
#pragma unroll 1
    for (int s = D; s < steps; ++s) produce(s);
  } else if (warp < kTmaConsumerThreads / 32) {
    const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
#pragma unroll 1
    for (int s = 0; s < steps; ++s) {
      mbar_wait(full + s % D, static_cast<uint32_t>((s / D) & 1));
      multiply_stage<T, kRows>(acc, ring_addr + static_cast<uint32_t>((s % D) * kStage));
      if (s >= 1 && lane == 0) mbar_arrive(empty + (s - 1) % D);  // this warp is done with chunk s - 1
    }
    wgmma_wait<0>();
    pin_accumulators(acc);
  }
  wait_copies<0>();
  pdl_launch_next();
  __syncthreads();  // every chunk consumed, every MMA done: the tile may overwrite the ring; the staging is visible

  if (warp < kTmaConsumerThreads / 32) store_accumulators<kRows>(tile, acc, warp, lane);
  __syncthreads();
  finish_wide<T, kRows, kTmaThreads, Epilogue>(base, tile, bias, extra, row0, total_rows);
#endif
}

}  // namespace mlinear
}  // namespace dspark
