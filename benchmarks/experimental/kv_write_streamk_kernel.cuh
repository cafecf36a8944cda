// EXPERIMENTAL (benchmarks/kv_write_tune.cu and the kernel emulation tests; no op launches it). The tensor-map wide
// tile of kv_write_wide_tma_kernel.cuh (one head of kRows rows by 64 tokens on the warpgroup MMA, a producer warp
// loading 2-D boxes, the fused norm/RoPE/cache-write epilogue) spread over every SM by stream-K.
//
// Why: the wide tile runs one CTA per head, 80 CTAs for a Qwen3-8B draft's K/V heads on 132 SMs, and its time is its
// 64 chunks per CTA one after the other (BENCHMARKS.md, "The wide tile with a producer warp and tensor-map copies").
// Here the launch's (head, chunk) iterations, heads x ceil(K / 64), are cut into gridDim.x equal contiguous ranges,
// one per CTA (the grid is at most one CTA per SM), so every SM streams the same number of chunks (39 of 64 per head
// for the Qwen3-8B draft) and the producer runs on across head boundaries without a pause.
//
// A CTA's range covers whole heads and at most two parts of heads (its first and its last). A whole head ends in the
// epilogue as in the wide tile. A part's accumulators go to the CTA's partial slot (0 for its first head, 1 for its
// last) in global memory, laid out by thread (each thread its kRows / 2 accumulators, so that the sum needs no
// shuffle), then the CTA counts itself in on the head's arrival counter; the last CTA to arrive adds the parts in
// the order of their CTAs (the same bits whichever CTA arrives last), resets the counter to zero for the next launch
// and runs the epilogue. No CTA waits for another, so the grid needs no co-residency.
//
// Measured on an H100 (BENCHMARKS.md, "The tensor-map tile over every SM by stream-K"): slower than the tensor-map
// tile at every config and grid (Qwen3-8B, 64 tokens: 65.1 µs cold on 132 CTAs, 56.4 on 80, against 50.7), and
// slower the more SMs read: the DRAM throughput fell from 2.1 to 1.7 TB/s with heads cut over 132 CTAs. So it stays
// out of the op.
//
// Only the consumer warpgroup runs the epilogue (named barrier 1, 128 threads): the producer warp is already loading
// the next head's chunks. `partials` holds gridDim.x * 2 * 128 * kRows / 2 floats; `arrivals` one int per head, zero
// before the first launch (each launch leaves them zero).
#pragma once

#include "kv_write_wide_tma_kernel.cuh"

namespace dspark {
namespace mlinear {

template <typename Epilogue>
struct StreamKArgs {
  WideTmaArgs<Epilogue> tma;
  float* partials;
  int* arrivals;
};

__host__ __device__ constexpr int streamk_smem_bytes(int rows, int stages, int extra) {
  return 1024 + stages * wide_stage_bytes(rows) + 4 * kWideTokens * tile_pitch(rows) + 2 * 8 * stages + 4 * rows +
         16 + extra;
}

// The first iteration of CTA `cta`'s range (iteration = head * steps + chunk).
__host__ __device__ __forceinline__ int64_t streamk_begin(int64_t iterations, int grid, int cta) {
  return iterations * cta / grid;
}

// The CTA whose range holds iteration `i`.
__device__ __forceinline__ int streamk_owner(int64_t iterations, int grid, int64_t i) {
  int cta = static_cast<int>(i * grid / iterations);
  while (cta + 1 < grid && streamk_begin(iterations, grid, cta + 1) <= i) ++cta;
  while (cta > 0 && streamk_begin(iterations, grid, cta) > i) --cta;
  return cta;
}

// Counts this CTA in on `counter`; the count before it.
__device__ __forceinline__ int streamk_arrive(int* counter) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(counter, 1);
#else
  return (*counter)++;  // the emulation runs one CTA after another
#endif
}

// This thread's global writes before its later ones, as every other thread of the GPU sees them.
__device__ __forceinline__ void streamk_fence() {
#if defined(__CUDA_ARCH__)
  __threadfence();
#endif
}

// A partial written by another SM: read through L2 only (never a line an earlier launch left in this SM's L1).
__device__ __forceinline__ float4 streamk_load(const float4* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *p;
#endif
}

template <typename T, int kRows, int D, typename Epilogue>
__global__ void __launch_bounds__(kTmaThreads, 1) streamk_kernel(const __grid_constant__ StreamKArgs<Epilogue> args) {
#if DSPARK_WGMMA_CODE
  static_assert(kRows == 64 || kRows == 128, "a head of 64 or 128 rows");
  constexpr int kStage = wide_stage_bytes(kRows), kAcc = kRows / 2, kConsumers = kTmaConsumerThreads;
  const typename Epilogue::Args& base = args.tma.base;
  const Params& p = Epilogue::gemm(base);
  const int t = static_cast<int>(threadIdx.x), warp = t / 32, lane = t % 32;
  const int64_t total_rows = p.segment_end[p.num_segments - 1];
  const int steps = (p.k + kWideChunk - 1) / kWideChunk;
  const int64_t iterations = (total_rows + kRows - 1) / kRows * steps;
  const int grid = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
  const int64_t begin = streamk_begin(iterations, grid, cta), end = streamk_begin(iterations, grid, cta + 1);
  if (begin >= end) return;  // the whole CTA, before any barrier

  unsigned char* raw = reinterpret_cast<unsigned char*>(cta_smem());
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  unsigned char* ring = raw + ((1024u - (raw_addr & 1023u)) & 1023u);
  float* tile = reinterpret_cast<float*>(ring + D * kStage);  // [kWideTokens][tile_pitch(kRows)]
  uint64_t* full = reinterpret_cast<uint64_t*>(tile + kWideTokens * tile_pitch(kRows));
  uint64_t* empty = full + D;
  float* bias = reinterpret_cast<float*>(empty + D);
  int* last_flag = reinterpret_cast<int*>(bias + kRows);
  float* extra = reinterpret_cast<float*>(last_flag + 4);
  init_ring_barriers(full, empty, D);

  if (t == kConsumers) {  // the producer: iteration begin + q into ring slot q % D, once the slot is released
    // (no division in the loop: the head, its chunk and the slot advance by counting)
    int64_t head = begin / steps;
    int chunk = static_cast<int>(begin - head * steps);
    int segment = find_segment(p, head * kRows);
    int first_row = static_cast<int>(row_in_segment(p, segment, head * kRows));
    int slot = 0;
    uint32_t round = 0;
#pragma unroll 1
    for (int64_t q = begin; q < end; ++q) {
      if (round > 0) mbar_wait(empty + slot, (round - 1) & 1);
      mbar_arrive_expect_tx(full + slot, kStage);
      unsigned char* stage = ring + slot * kStage;
      tma_load_2d(stage, &args.tma.x_map, chunk * kWideChunk, 0, full + slot);
      tma_load_2d(stage + kTmaBoxBytesX, &args.tma.w_map[segment], chunk * kWideChunk, first_row, full + slot);
      if (++chunk == steps && q + 1 < end) {
        chunk = 0;
        ++head;
        segment = find_segment(p, head * kRows);
        first_row = static_cast<int>(row_in_segment(p, segment, head * kRows));
      }
      if (++slot == D) {
        slot = 0;
        ++round;
      }
    }
  } else if (t < kConsumers) {
    const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
    int slot = 0, previous = 0;
    uint32_t round = 0;
#pragma unroll 1
    for (int64_t it = begin; it < end;) {
      const int64_t head = it / steps, head_begin = head * steps, head_end = head_begin + steps;
      const int64_t part_end = end < head_end ? end : head_end;
      float acc[kAcc];
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
#pragma unroll 1
      for (int64_t j = it; j < part_end; ++j) {
        mbar_wait(full + slot, round & 1);
        multiply_stage<T, kRows>(acc, ring_addr + static_cast<uint32_t>(slot * kStage));
        if (j > it && lane == 0) mbar_arrive(empty + previous);  // this warp is done with the previous chunk
        previous = slot;
        if (++slot == D) {
          slot = 0;
          ++round;
        }
      }
      wgmma_wait<0>();
      pin_accumulators(acc);
      if (lane == 0) mbar_arrive(empty + previous);

      bool finish = it == head_begin && part_end == head_end;  // a whole head
      if (!finish) {
        // This part into the CTA's slot, then the count; the last CTA in adds every part in CTA order.
        const int first_cta = streamk_owner(iterations, grid, head_begin);
        const int last_cta = streamk_owner(iterations, grid, head_end - 1);
        auto slot_of = [&](int c) {
          const int which = streamk_begin(iterations, grid, c) / steps == head ? 0 : 1;
          return reinterpret_cast<float4*>(args.partials + ((static_cast<int64_t>(c) * 2 + which) * kConsumers + t) *
                                                               kAcc);
        };
        float4* mine = slot_of(cta);
#pragma unroll
        for (int i = 0; i < kAcc / 4; ++i) mine[i] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
        streamk_fence();
        group_barrier(1, kConsumers);
        if (t == 0) *last_flag = streamk_arrive(args.arrivals + head) == last_cta - first_cta;
        group_barrier(1, kConsumers);
        finish = *last_flag != 0;
        if (finish) {
          streamk_fence();
#pragma unroll
          for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
#pragma unroll 1
          for (int c = first_cta; c <= last_cta; ++c) {
            const float4* part = slot_of(c);
#pragma unroll
            for (int i = 0; i < kAcc / 4; ++i) {
              const float4 v = streamk_load(part + i);
              acc[4 * i] += v.x;
              acc[4 * i + 1] += v.y;
              acc[4 * i + 2] += v.z;
              acc[4 * i + 3] += v.w;
            }
          }
          if (t == 0) args.arrivals[head] = 0;
        }
      }
      if (finish) {
        const int64_t row0 = head * kRows;
        const typename Epilogue::Prefetch prefetched = Epilogue::template prefetch<T, kWideTokens>(base, row0);
        for (int r = t; r < kRows; r += kConsumers) bias[r] = bias_of_row<T>(p, row0 + r);
        Epilogue::template stage<T, kWideTokens>(base, prefetched, extra, row0, kConsumers);
        commit_copies();
        wait_copies<0>();
        store_accumulators<kRows>(tile, acc, warp, lane);
        group_barrier(1, kConsumers);  // the tile, the bias and the staging are visible
        Epilogue::template finish<T, kRows, kWideTokens, kConsumers>(base, tile, bias, extra, row0, kRows,
                                                                     ClusterCoord{blockIdx.x, 0, 1});
        group_barrier(1, kConsumers);  // before the next head's epilogue overwrites them
      }
      it = part_end;
    }
  }
  pdl_launch_next();
#endif
}

}  // namespace mlinear
}  // namespace dspark
