// A read of a buffer through the copy engine, nothing else (sm_90): the CTAs split the buffer into stages of 16 KB
// (the last one shorter), and each CTA streams its contiguous share of them through kBulkStages shared-memory slots
// in 1-D bulk copies (cp.async.bulk) of kBytes each, completing on one mbarrier per slot, issued by the lanes of its
// one warp. Each lane adds up its 32-bit words of every stage (wrapping) into sums[32 * blockIdx.x + lane], so a
// caller can check that every byte was read. The copies carry the evict-first L2 policy (the bytes are read once).
// tests/test_bulk_read_emulation.py runs it on the host (DSPARK_KERNEL_EMULATION: copies landing late and out of
// order).
//
// A reader for the read floors of the benchmarks (benchmarks/bulk_read.cu, through benchmarks/_read_floor.py) and
// for benchmarks/kv_write_tune.cu: per copy the copy engine costs a fixed time, so copies of a few KB let few CTAs
// read at the full rate, where 16-byte loads need the whole GPU's warps (BENCHMARKS.md, "Copy-engine experiment").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/bulk_copy.cuh"

namespace dspark {

constexpr int kBulkStages = 8, kBulkStageBytes = 16384;
// Dynamic shared memory: the slots, then one mbarrier per slot.
constexpr int kBulkSmemBytes = kBulkStages * kBulkStageBytes + kBulkStages * 8;

__device__ __forceinline__ uint4* bulk_smem() {
#if defined(DSPARK_KERNEL_EMULATION)
  return reinterpret_cast<uint4*>(emu_cta_smem());
#else
  extern __shared__ uint4 bulk_dynamic_smem[];
  return bulk_dynamic_smem;
#endif
}

// `n` bytes at `p` (n and p multiples of 16); `sums` holds 32 * gridDim.x words. kBytes divides the stage.
template <int kBytes>
__global__ void __launch_bounds__(32) bulk_read_kernel(const char* p, int64_t n, uint32_t* sums) {
  static_assert(kBulkStageBytes % kBytes == 0 && kBytes % 16 == 0, "copies of whole 16-byte units, a stage apart");
  uint4* const bulk_ring = bulk_smem();
  uint64_t* const full = reinterpret_cast<uint64_t*>(bulk_ring + kBulkStages * (kBulkStageBytes / 16));
  const int64_t stages = (n + kBulkStageBytes - 1) / kBulkStageBytes;
  const int64_t first = stages * blockIdx.x / gridDim.x, last = stages * (blockIdx.x + 1) / gridDim.x;
  const int lane = static_cast<int>(threadIdx.x);
  if (lane == 0) {
    for (int d = 0; d < kBulkStages; ++d) mbar_init(full + d, 1);
    mbar_init_fence();
  }
  __syncwarp();
  const uint64_t once = evict_first_policy();
  auto stage_bytes = [&](int64_t s) {
    const int64_t left = n - s * kBulkStageBytes;
    return static_cast<uint32_t>(left < kBulkStageBytes ? left : kBulkStageBytes);
  };
  auto issue = [&](int64_t s) {
    const int slot = static_cast<int>((s - first) % kBulkStages);
    const uint32_t bytes = stage_bytes(s);
    uint64_t* bar = full + slot;
    if (lane == 0) mbar_arrive_expect_tx(bar, bytes);
    __syncwarp();  // the stage's bytes announced, and every lane done reading the slot's previous stage
    char* dst = reinterpret_cast<char*>(bulk_ring) + slot * kBulkStageBytes;
    const char* src = p + s * kBulkStageBytes;
    for (uint32_t at = static_cast<uint32_t>(lane) * kBytes; at < bytes; at += 32u * kBytes) {
      bulk_copy(dst + at, src + at, bytes - at < kBytes ? bytes - at : kBytes, bar, once);
    }
  };
  for (int64_t s = first; s < last && s < first + kBulkStages; ++s) issue(s);
  uint32_t sum = 0;
  for (int64_t s = first; s < last; ++s) {
    const int slot = static_cast<int>((s - first) % kBulkStages);
    mbar_wait(full + slot, static_cast<uint32_t>(((s - first) / kBulkStages) & 1));
    const uint4* stage = bulk_ring + slot * (kBulkStageBytes / 16);
    const int vectors = static_cast<int>(stage_bytes(s) / 16);
    for (int v = lane; v < vectors; v += 32) sum += stage[v].x + stage[v].y + stage[v].z + stage[v].w;
    if (s + kBulkStages < last) issue(s + kBulkStages);
  }
  sums[32 * blockIdx.x + lane] = sum;
}

}  // namespace dspark
