// Decode planners of the DeepSeek-V4 compressor (one thread per request). Plain CUDA, no torch headers.
// Semantics and byte layout: custom_ops/dsv4_compress_plan.py (the CPU / composite reference, which these
// kernels reproduce byte for byte); one launch instead of a chain of small torch ops per decode step.
#pragma once

#include "dsv4_compress_kernels.cuh"

namespace dspark {
namespace dsv4 {

constexpr int kPlanThreads = 128;

struct IndexView {
  const void* p;
  bool is64;
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
  }
};

struct PlanDecodeArgs {
  IndexView seq_lens, rids;
  IndexView req_to_token, full_to_state;  // paged addressing when req_to_token.p != nullptr
  int64_t r2t_rows, r2t_cols, f2s_len;
  int64_t batch;
  int ratio, ring, swa_page;
  DecodePlan* out;
};

// State row of (rid, pos); false where the position is not mapped (paged addressing).
__device__ __forceinline__ bool state_loc(const PlanDecodeArgs& a, int64_t rid, int64_t pos, int64_t& loc) {
  if (a.req_to_token.p == nullptr) {
    loc = rid * a.ring + pos % a.ring;
    return true;
  }
  if (rid >= a.r2t_rows || pos >= a.r2t_cols) return false;
  const int64_t full = a.req_to_token[rid * a.r2t_cols + pos];
  if (full < 0 || full >= a.f2s_len) return false;
  const int64_t swa = a.full_to_state[full];
  if (swa < 0) return false;
  loc = (swa / a.swa_page) * a.ring + swa % a.ring;
  return true;
}

template <bool kOnline>
__global__ void __launch_bounds__(kPlanThreads) plan_decode_kernel(const PlanDecodeArgs a) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kPlanThreads + threadIdx.x;
  if (b >= a.batch) return;
  const int64_t seq = a.seq_lens[b];
  const int64_t rid = a.rids[b];
  DecodePlan p{kInvalid, -1, -1, -1};
  if (seq > 0 && rid >= 0) {
    if constexpr (kOnline) {
      p = DecodePlan{static_cast<uint32_t>(seq), static_cast<int32_t>(rid), static_cast<int32_t>(rid), -1};
    } else {
      const int64_t pos1 = seq - 1;
      const int64_t pos0 = pos1 - a.ratio > 0 ? pos1 - a.ratio : 0;
      int64_t loc1, loc0;
      if (state_loc(a, rid, pos1, loc1) && state_loc(a, rid, pos0, loc0)) {
        p = DecodePlan{static_cast<uint32_t>(seq), static_cast<int32_t>(loc1), static_cast<int32_t>(loc0 / a.ratio),
                       static_cast<int32_t>(loc1 / a.ratio)};
      }
    }
  }
  a.out[b] = p;
}

}  // namespace dsv4
}  // namespace dspark
