// Planners of the DeepSeek-V4 compressor. Plain CUDA, no torch headers. Semantics and byte layout:
// custom_ops/dsv4/plan.py (the CPU / composite reference, which these kernels reproduce byte for byte);
// one launch instead of a chain of small torch ops.
// - decode: one thread per request;
// - prefill / extend: one block of 1024 threads; a block scan of extend_lens gives the ragged offsets, then the
//   query tokens are visited in chunks of 1024 and block scans of the event / write flags place the compact rows
//   (token order, as the reference), and the tails are padded with invalid rows.
// Index values are range-checked before they are multiplied into a state row or narrowed into a plan field; a row
// that needs an out-of-range value is invalid (docs/contract.md), and in checking mode the first problem is
// reported to the host (PlanProblem).
#pragma once

#include "dsv4/dsv4_compress_kernels.cuh"
#include "dsv4/dsv4_ratio.h"

namespace dspark {
namespace dsv4 {

constexpr int kPlanThreads = 128;

// Value problems a planner finds, by rank (the numbers of ERR_* in custom_ops/dsv4/plan.py). In checking
// mode the kernels atomicMin `rank << kProblemShift | flat index into the argument` into one word, so the host
// raises the same problem as the CPU path: the lowest rank, then the lowest index.
enum PlanProblem : int {
  kErrExtendRange = 0,   // extend_lens[b] outside 0..num_q_tokens
  kErrExtendSum = 1,     // sum(extend_lens[:b + 1]) > num_q_tokens
  kErrSeqBelowExtend = 2,
  kErrSeqMax = 3,        // seq_lens[b] > seq_max
  kErrRequest = 4,       // req_pool_indices[b] >= rid_hi
  kErrReqToToken = 5,    // req_to_token entry >= full_to_state length
  kErrFullToState = 6,   // full_to_state entry whose state row does not fit int32
};
constexpr int kProblemShift = 56;
constexpr unsigned long long kNoProblem = 0x7FFFFFFFFFFFFFFFull;

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
  int64_t seq_max;  // largest valid seq_len (int32 positions; paged: columns of req_to_token)
  int64_t rid_hi;   // request ids must be below (ring: 2^31 / ring, paged: rows of req_to_token, online: 2^31)
  int64_t swa_hi;   // paged: SWA slots must be below (their state rows fit int32)
  unsigned long long* problem;  // checking mode: the first problem (see PlanProblem); nullptr otherwise
  DecodePlan* out;
};

__device__ __forceinline__ void report(const PlanDecodeArgs& a, int rank, int64_t index) {
  if (a.problem != nullptr) {
    atomicMin(a.problem, (static_cast<unsigned long long>(rank) << kProblemShift) | static_cast<unsigned long long>(index));
  }
}

// Whether an active request's seq_len and request id are in range (reports both problems).
__device__ __forceinline__ bool request_ok(const PlanDecodeArgs& a, int64_t b, int64_t seq, int64_t rid) {
  bool ok = true;
  if (seq > a.seq_max) {
    report(a, kErrSeqMax, b);
    ok = false;
  }
  if (rid >= a.rid_hi) {
    report(a, kErrRequest, b);
    ok = false;
  }
  return ok;
}

// State row of (rid, pos) of a request that passed request_ok (so rid * ring and rid * r2t_cols + pos cannot
// overflow and stay inside req_to_token); false where a table entry is unmapped (negative) or out of range.
__device__ __forceinline__ bool state_loc(const PlanDecodeArgs& a, int64_t rid, int64_t pos, int64_t& loc) {
  if (a.req_to_token.p == nullptr) {
    loc = rid * a.ring + pos % a.ring;
    return true;
  }
  const int64_t at = rid * a.r2t_cols + pos;
  const int64_t full = a.req_to_token[at];
  if (full < 0) return false;
  if (full >= a.f2s_len) {
    report(a, kErrReqToToken, at);
    return false;
  }
  const int64_t swa = a.full_to_state[full];
  if (swa < 0) return false;
  if (swa >= a.swa_hi) {
    report(a, kErrFullToState, full);
    return false;
  }
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
  if (seq > 0 && rid >= 0 && request_ok(a, b, seq, rid)) {
    if constexpr (kOnline) {
      p = DecodePlan{static_cast<uint32_t>(seq), static_cast<int32_t>(rid), static_cast<int32_t>(rid), -1};
    } else {
      const int64_t pos1 = seq - 1;
      const int64_t pos0 = pos1 - a.ratio > 0 ? pos1 - a.ratio : 0;
      int64_t loc1 = 0, loc0 = 0;
      const bool ok1 = state_loc(a, rid, pos1, loc1);
      const bool ok0 = ok1 && state_loc(a, rid, pos0, loc0);
      if (ok1) {  // read_page_0 -1 where unmapped: c128 never reads it, c4 makes no entry there (plan.py)
        p = DecodePlan{static_cast<uint32_t>(seq), static_cast<int32_t>(loc1),
                       ok0 ? static_cast<int32_t>(loc0 / a.ratio) : -1, static_cast<int32_t>(loc1 / a.ratio)};
      }
    }
  }
  a.out[b] = p;
}

constexpr int kPrefillThreads = 1024;

struct PlanPrefillArgs {
  PlanDecodeArgs addr;  // seq_lens, rids, addressing, batch, ratio, ring, swa_page, limits, problem (out unused)
  IndexView ext_lens;
  int64_t num_tokens, rows_c, rows_w;
  int64_t* ends;  // scratch [batch]: inclusive prefix sums of the extend lengths clamped to 0..num_tokens + 1
  CompressPlan* plan_c;
  void* plan_w;  // WritePlan (offline) or CompressPlan (online) rows
};

// Extend length used for the ragged offsets: out-of-range lengths are clamped (their request plans no rows), so the
// ends stay monotone and their sums cannot overflow.
__device__ __forceinline__ int64_t clamped_extend(const PlanPrefillArgs& a, int64_t b) {
  const int64_t ext = a.ext_lens[b];
  return ext < 0 ? 0 : (ext > a.num_tokens ? a.num_tokens + 1 : ext);
}

// Whether request b of a prefill plans rows (after the ends are known); reports its problems.
__device__ __forceinline__ bool prefill_request_ok(const PlanPrefillArgs& a, int64_t b) {
  const PlanDecodeArgs& d = a.addr;
  const int64_t ext = a.ext_lens[b];
  bool ok = true;
  if (ext < 0 || ext > a.num_tokens) {
    report(d, kErrExtendRange, b);
    ok = false;
  }
  if (a.ends[b] > a.num_tokens) {
    report(d, kErrExtendSum, b);
    ok = false;
  }
  const int64_t rid = d.rids[b];
  if (rid < 0) return false;
  const int64_t seq = d.seq_lens[b];
  if (seq < ext) {
    report(d, kErrSeqBelowExtend, b);
    return false;
  }
  return request_ok(d, b, seq, rid) && ok;
}

// Inclusive block-wide prefix sum of v; `total` receives the block sum. All threads of the block must call it.
__device__ __forceinline__ int64_t block_scan(int64_t v, int64_t* warp_sums, int64_t& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int64_t w = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  const int64_t prefix = warp > 0 ? warp_sums[warp - 1] : 0;
  total = warp_sums[31];
  __syncthreads();  // warp_sums is reused by the next call
  return v + prefix;
}

template <bool kOnline>
__global__ void __launch_bounds__(kPrefillThreads) plan_prefill_kernel(const PlanPrefillArgs a) {
  __shared__ int64_t warp_sums[32];
  const PlanDecodeArgs& d = a.addr;
  const int t = threadIdx.x;
  const int64_t batch = d.batch;
  int64_t carry = 0, total;
  for (int64_t base = 0; base < batch; base += kPrefillThreads) {
    const int64_t i = base + t;
    const int64_t incl = block_scan(i < batch ? clamped_extend(a, i) : 0, warp_sums, total) + carry;
    if (i < batch) a.ends[i] = incl;
    carry += total;
  }
  __syncthreads();
  if (d.problem != nullptr) {  // requests without query tokens are checked too
    for (int64_t b = t; b < batch; b += kPrefillThreads) prefill_request_ok(a, b);
  }

  const int r = kOnline ? kRatioC128 : d.ratio;
  const int window = window_of(r);
  int64_t count_c = 0, count_w = 0;
  for (int64_t base = 0; base < a.num_tokens; base += kPrefillThreads) {
    const int64_t tok = base + t;
    bool event = false, write = false;
    CompressPlan crow{kInvalid, 0, 0, -1, -1};
    CompressPlan wrow_online{kInvalid, 0, 0, -1, -1};
    WritePlan wrow{kInvalid, -1};
    if (tok < a.num_tokens && batch > 0) {
      int64_t lo = 0, hi = batch;  // first b with ends[b] > tok
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (a.ends[mid] > tok) hi = mid; else lo = mid + 1;
      }
      const int64_t b = lo;
      if (b < batch && prefill_request_ok(a, b)) {
        const int64_t ext = a.ext_lens[b], seq = d.seq_lens[b], rid = d.rids[b];
        const int64_t j = tok - (a.ends[b] - ext);
        const int64_t pos = seq - ext + j;
        if constexpr (kOnline) {
          const int64_t seg = (j < pos % 128 ? j : pos % 128) + 1;
          const CompressPlan row{static_cast<uint32_t>(pos + 1), static_cast<uint16_t>(tok),
                                 static_cast<uint16_t>(seg), static_cast<int32_t>(rid), -1};
          event = (pos + 1) % 128 == 0;
          write = pos == seq - 1 && !event;
          crow = row;
          wrow_online = row;
        } else {
          const int64_t buffer_len = window - (j + 1) > 0 ? window - (j + 1) : 0;
          if ((pos + 1) % r == 0) {
            int64_t loc1 = 0, loc0 = 0;
            const bool ok1 = buffer_len > 0 && state_loc(d, rid, pos, loc1);
            const bool ok0 = ok1 && state_loc(d, rid, pos - r > 0 ? pos - r : 0, loc0);
            event = buffer_len == 0 || (ok1 && (ok0 || r == kRatioC128));  // c128 never reads read_page_0
            crow = CompressPlan{static_cast<uint32_t>(pos + 1), static_cast<uint16_t>(tok),
                                static_cast<uint16_t>(buffer_len), ok0 ? static_cast<int32_t>(loc0 / r) : -1,
                                buffer_len > 0 ? static_cast<int32_t>(loc1 / r) : static_cast<int32_t>(b)};
          }
          const int64_t first_w = (seq / r) * r - (r == 4 ? 4 : 0);
          bool keep = pos >= first_w;
          if (r == 4 && d.req_to_token.p != nullptr) keep = keep || pos % d.swa_page >= d.swa_page - r;
          int64_t loc = 0;
          if (keep && state_loc(d, rid, pos, loc)) {
            write = true;
            wrow = WritePlan{static_cast<uint32_t>(tok), static_cast<int32_t>(loc)};
          }
        }
      }
    }
    int64_t sum_c, sum_w;
    const int64_t at_c = count_c + block_scan(event ? 1 : 0, warp_sums, sum_c) - 1;
    const int64_t at_w = count_w + block_scan(write ? 1 : 0, warp_sums, sum_w) - 1;
    if (event && at_c < a.rows_c) a.plan_c[at_c] = crow;
    if (write && at_w < a.rows_w) {
      if constexpr (kOnline) {
        static_cast<CompressPlan*>(a.plan_w)[at_w] = wrow_online;
      } else {
        static_cast<WritePlan*>(a.plan_w)[at_w] = wrow;
      }
    }
    count_c += sum_c;
    count_w += sum_w;
  }
  for (int64_t i = count_c + t; i < a.rows_c; i += kPrefillThreads) a.plan_c[i] = CompressPlan{kInvalid, 0, 0, -1, -1};
  for (int64_t i = count_w + t; i < a.rows_w; i += kPrefillThreads) {
    if constexpr (kOnline) {
      static_cast<CompressPlan*>(a.plan_w)[i] = CompressPlan{kInvalid, 0, 0, -1, -1};
    } else {
      static_cast<WritePlan*>(a.plan_w)[i] = WritePlan{kInvalid, -1};
    }
  }
}

}  // namespace dsv4
}  // namespace dspark
