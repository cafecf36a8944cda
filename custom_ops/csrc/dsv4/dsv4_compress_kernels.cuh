// DeepSeek-V4 KV compression kernels (c4, c128, online c128). Plain CUDA, no torch headers.
//
// Semantics and plan layouts: custom_ops/dsv4/compress.py, online.py, plan.py and
// docs/dsv4_compress.md. fp32 math; state rows are fp32 or bf16, input rows fp32 or bf16.
//
// Plan rows are validated before any address is formed from them: a row that would read or write outside the state
// or the input is skipped (it writes nothing, its output row is zero), exactly the rows the CPU references reject
// (check_*_plan_values there; docs/contract.md).
//
// Thread mapping (every thread owns 4 contiguous channels, so all row accesses are 16-byte fp32 / 8-byte bf16
// vectors when the pointers allow it, kVec):
// - c4: one warp per (plan row, 128-channel split); each lane holds the 8 window slots of its 4 channels in
//   registers. 4 warps per block.
// - c128 and online-c128 prefill: one block per (plan row, channel split), `groups` slot groups of threads that
//   each own 4 channels of the split (c128_splits); per-group partial (max, sum, weighted sum) go through shared
//   memory and are merged one channel per thread.
// - online-c128 decode: one thread per 4 elements; prefill state writes: one warp per persisted row.
// Decode writes the new row before it compresses (c4 takes the new row's values from registers after the
// state-dtype round trip; c128: the thread that writes a row element is the one that reads it back). Prefill
// compression and the prefill state writes are separate launches, in that order. Every output element is
// written (zero where a row produces no entry).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/pdl.cuh"

namespace dspark {
namespace dsv4 {

constexpr float kNegMax = -3.402823466e38f;  // -FLT_MAX: masked score (never -inf, so no inf - inf)
constexpr uint32_t kInvalid = 0xFFFFFFFFu;
constexpr int kSplit = 128;  // channels per warp (c4); the narrowest channel split of a c128 block
constexpr int kC4Threads = 128;
constexpr int kC128Threads = 512;
constexpr int kCopyThreads = 256;
constexpr int kMaxWriteBlocks = 512;

struct DecodePlan {
  uint32_t seq_len;
  int32_t write_loc;
  int32_t read_page_0;
  int32_t read_page_1;
};
struct CompressPlan {
  uint32_t seq_len;
  uint16_t ragged_id;
  uint16_t buffer_len;
  int32_t read_page_0;
  int32_t read_page_1;
};
struct WritePlan {
  uint32_t ragged_id;
  int32_t write_loc;
};
static_assert(sizeof(DecodePlan) == 16 && sizeof(CompressPlan) == 16 && sizeof(WritePlan) == 8, "plan layout");

// ------------------------------------------------------------------------------------------------ vector I/O

__device__ __forceinline__ float4 to_float4(__nv_bfloat162 a, __nv_bfloat162 b) {
  const float2 x = __bfloat1622float2(a);
  const float2 y = __bfloat1622float2(b);
  return make_float4(x.x, x.y, y.x, y.y);
}

template <bool kVec>
__device__ __forceinline__ float4 load4(const float* p) {
  if constexpr (kVec) return *reinterpret_cast<const float4*>(p);
  return make_float4(p[0], p[1], p[2], p[3]);
}

template <bool kVec>
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  if constexpr (kVec) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return to_float4(*reinterpret_cast<const __nv_bfloat162*>(&u.x), *reinterpret_cast<const __nv_bfloat162*>(&u.y));
  }
  return make_float4(__bfloat162float(p[0]), __bfloat162float(p[1]), __bfloat162float(p[2]), __bfloat162float(p[3]));
}

template <bool kVec>
__device__ __forceinline__ void store4(float* p, float4 v) {
  if constexpr (kVec) {
    *reinterpret_cast<float4*>(p) = v;
  } else {
    p[0] = v.x;
    p[1] = v.y;
    p[2] = v.z;
    p[3] = v.w;
  }
}

template <bool kVec>
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y);
  const __nv_bfloat162 b = __floats2bfloat162_rn(v.z, v.w);
  if constexpr (kVec) {
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t*>(&a);
    u.y = *reinterpret_cast<const uint32_t*>(&b);
    *reinterpret_cast<uint2*>(p) = u;
  } else {
    p[0] = a.x;
    p[1] = a.y;
    p[2] = b.x;
    p[3] = b.y;
  }
}

__device__ __forceinline__ float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
__device__ __forceinline__ float get(const float4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }
__device__ __forceinline__ void set(float4& v, int k, float x) {
  if (k == 0) v.x = x;
  else if (k == 1) v.y = x;
  else if (k == 2) v.z = x;
  else v.w = x;
}

// ------------------------------------------------------------------------------------------------ arguments

struct CompressArgs {
  void* state;           // [state_rows, state_width] TS
  const void* input;     // [input_rows, in_stride] TI (kv_score rows)
  float* out;            // [num_rows, d] fp32
  const float* ape;      // [window, d] fp32
  const void* plan;      // [num_rows, 16] (DecodePlan or CompressPlan)
  int64_t in_stride;     // elements between input rows
  int64_t state_rows;
  int64_t input_rows;
  int num_rows;
  int d;
};

// ------------------------------------------------------------------------------------------------ c4

// fp32 value of v after a round trip through the state dtype (what a read of the stored row returns).
template <typename TS>
__device__ __forceinline__ float4 as_stored(float4 v) {
  if constexpr (sizeof(TS) == 4) {
    return v;
  } else {
    return to_float4(__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w));
  }
}

// Window slot i of a c4 entry: kv at column (i < 4 ? 0 : d), score at (i < 4 ? 2d : 3d) of its row; the row is
// row i % 4 of page rp0 (i < 4) or rp1 (i >= 4) if i < buffer_len, else input row last - 7 + i.
template <typename TS, typename TI, bool kVec>
__device__ __forceinline__ void c4_slot(const CompressArgs& a, int i, int c, int64_t width, int64_t rp0, int64_t rp1,
                                        int buffer_len, int64_t last, bool overlap, float4& kv, float4& sc) {
  const int d = a.d;
  const bool ov = i < 4;
  if (ov && !overlap) {
    kv = make_float4(0.f, 0.f, 0.f, 0.f);
    sc = make_float4(kNegMax, kNegMax, kNegMax, kNegMax);
    return;
  }
  const int kv_col = ov ? 0 : d;
  const int sc_col = ov ? 2 * d : 3 * d;
  if (i < buffer_len) {
    const TS* r = static_cast<const TS*>(a.state) + ((ov ? rp0 : rp1) * 4 + (i & 3)) * width;
    kv = load4<kVec>(r + kv_col + c);
    sc = load4<kVec>(r + sc_col + c);
  } else {
    const TI* r = static_cast<const TI*>(a.input) + (last - 7 + i) * a.in_stride;
    kv = load4<kVec>(r + kv_col + c);
    sc = load4<kVec>(r + sc_col + c);
  }
  sc = add4(sc, *reinterpret_cast<const float4*>(a.ape + i * d + c));
}

// Decode: slots 0..6 are loaded from the state together with the new row (one memory round trip); slot 7 is the
// new row itself (row 3 of page rp1, checked), taken from registers after the state-dtype round trip, i.e. the
// value a read after the write returns.
template <bool kDecode, typename TS, typename TI, bool kVec>
__global__ void __launch_bounds__(kC4Threads) c4_kernel(CompressArgs a) {
  pdl_wait();
  const int splits = a.d / kSplit;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kC4Threads + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= static_cast<int64_t>(a.num_rows) * splits) return;
  const int row = static_cast<int>(warp / splits);
  const int c = static_cast<int>(warp % splits) * kSplit + lane * 4;
  const int d = a.d;
  const int64_t width = 4 * static_cast<int64_t>(d);
  float* out = a.out + static_cast<int64_t>(row) * d + c;
  const int64_t pages = a.state_rows / 4;
  float4 kv[8], sc[8];
  bool emit;
  if constexpr (kDecode) {
    const DecodePlan p = static_cast<const DecodePlan*>(a.plan)[row];
    const bool active = p.write_loc >= 0 && p.write_loc < a.state_rows;
    const int64_t rp0 = p.read_page_0, rp1 = p.read_page_1;
    emit = active && p.seq_len % 4 == 0 && rp0 >= 0 && rp0 < pages && rp1 >= 0 && rp1 < pages &&
           p.write_loc == rp1 * 4 + 3;
    float4 in[4];
    if (active) {
      const TI* src = static_cast<const TI*>(a.input) + row * a.in_stride;
#pragma unroll
      for (int seg = 0; seg < 4; ++seg) in[seg] = load4<kVec>(src + seg * d + c);
    }
    if (emit) {
#pragma unroll
      for (int i = 0; i < 7; ++i) c4_slot<TS, TI, kVec>(a, i, c, width, rp0, rp1, 8, 0, p.seq_len > 4, kv[i], sc[i]);
    }
    if (active) {
      TS* dst = static_cast<TS*>(a.state) + p.write_loc * width;
#pragma unroll
      for (int seg = 0; seg < 4; ++seg) store4<kVec>(dst + seg * d + c, in[seg]);
    }
    if (emit) {
      kv[7] = as_stored<TS>(in[1]);
      sc[7] = add4(as_stored<TS>(in[3]), *reinterpret_cast<const float4*>(a.ape + 7 * d + c));
    }
  } else {
    const CompressPlan p = static_cast<const CompressPlan*>(a.plan)[row];
    const int64_t rp0 = p.read_page_0, rp1 = p.read_page_1;
    const int buffer_len = p.buffer_len;
    const bool pages_ok = buffer_len == 0 || (rp0 >= 0 && rp0 < pages && rp1 >= 0 && rp1 < pages);
    // input rows ragged_id - 7 + buffer_len .. ragged_id are read: they must exist
    const bool rows_ok = buffer_len <= 8 && p.ragged_id < a.input_rows && p.ragged_id + 1 + buffer_len >= 8;
    emit = p.seq_len != kInvalid && rows_ok && pages_ok;
    if (emit) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        c4_slot<TS, TI, kVec>(a, i, c, width, rp0, rp1, buffer_len, p.ragged_id, p.seq_len > 4, kv[i], sc[i]);
      }
    }
  }
  pdl_launch_next();
  if (!emit) {
    store4<true>(out, make_float4(0.f, 0.f, 0.f, 0.f));
    return;
  }
  float4 res;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float m = get(sc[0], k);
#pragma unroll
    for (int i = 1; i < 8; ++i) m = fmaxf(m, get(sc[i], k));
    float sum = 0.f, acc = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float e = __expf(get(sc[i], k) - m);
      sum += e;
      acc += e * get(kv[i], k);
    }
    set(res, k, acc / sum);
  }
  store4<true>(out, res);
}

// ------------------------------------------------------------------------------------------------ c128

enum class C128Mode { kDecode, kPrefill, kOnlineCompress, kOnlineWrite };

// Launch shape: one block of kC128Threads per (plan row, channel split of d / splits channels); the block is
// kC128Threads / (d / splits / 4) slot groups of threads that own 4 channels each, group g holding slots g,
// g + groups, g + 2 * groups, ... so the block reads whole consecutive rows at a time. Few rows: split the channels
// until there are about as many blocks as SMs (measured on H200 for batch 1..256, BENCHMARKS.md).
inline int c128_splits(int64_t rows, int d, int num_sms) {
  int splits = 1;
  while (rows * splits < num_sms && d / splits > kSplit) splits *= 2;
  return splits;
}

// Offline: slot j reads state row rp1*128 + j if j < buffer_len, else input row last - 127 + j; ape row j.
// Online: slot j < seg_len reads input row last - seg_len + 1 + j, ape row chunk_off + j; the segment state is
// merged with the stored one when chunk_off != 0.
template <C128Mode kMode, typename TS, typename TI, bool kVec>
__global__ void __launch_bounds__(kC128Threads) c128_kernel(CompressArgs a, int splits) {
  pdl_wait();
  __shared__ float smem[3 * 4 * kC128Threads];  // per-group partial (max, sum, weighted sum) of every channel
  constexpr bool kOnline = kMode == C128Mode::kOnlineCompress || kMode == C128Mode::kOnlineWrite;
  const int d = a.d;
  const int cw = d / splits;  // channels of this block
  const int quads = cw / 4;
  const int groups = kC128Threads / quads;
  const int row = blockIdx.x / splits;
  const int base = (blockIdx.x % splits) * cw;
  const int g = threadIdx.x / quads;
  const int c = base + (threadIdx.x % quads) * 4;
  const int64_t width = (kOnline ? 3 : 2) * static_cast<int64_t>(d);
  TS* state = static_cast<TS*>(a.state);
  const TI* input = static_cast<const TI*>(a.input);
  const int64_t pages = kOnline ? a.state_rows : a.state_rows / 128;

  bool emit;
  int count;        // slots [0, count) hold tokens (offline: 128)
  int buffer_len;   // offline: slots [0, buffer_len) come from the state
  int ape_off = 0;  // online: chunk offset of slot 0
  int64_t rp = -1, last = 0, first_token = 0;
  if constexpr (kMode == C128Mode::kDecode) {
    const DecodePlan p = static_cast<const DecodePlan*>(a.plan)[row];
    const bool active = p.write_loc >= 0 && p.write_loc < a.state_rows;
    rp = p.read_page_1;
    // the group that owns the written slot writes it, so the same threads read it back below
    if (active && g == (p.write_loc % 128) % groups) {
      const TI* src = input + row * a.in_stride;
      TS* dst = state + p.write_loc * width;
      store4<kVec>(dst + c, load4<kVec>(src + c));
      store4<kVec>(dst + d + c, load4<kVec>(src + d + c));
    }
    emit = active && p.seq_len % 128 == 0 && rp >= 0 && rp < pages && p.write_loc == rp * 128 + 127;
    count = 128;
    buffer_len = 128;
  } else {
    const CompressPlan p = static_cast<const CompressPlan*>(a.plan)[row];
    last = p.ragged_id;
    emit = p.seq_len != kInvalid && last < a.input_rows;
    if constexpr (kOnline) {
      count = p.buffer_len;
      // a segment that ends at seq_len - 1 inside one 128-chunk, of a request slot (read_page_0 < 0: padding)
      // inside the state; read_page_1 >= 0 overrides the slot the stored partial state is loaded from
      ape_off = static_cast<int>((p.seq_len - count) % 128);
      first_token = last - count + 1;
      rp = p.read_page_1 >= 0 ? p.read_page_1 : p.read_page_0;
      emit = emit && count >= 1 && static_cast<uint32_t>(count) <= p.seq_len && ape_off + count <= 128 &&
             first_token >= 0 && p.read_page_0 >= 0 && p.read_page_0 < pages && p.read_page_1 < pages;
      buffer_len = 0;
    } else {
      count = 128;
      buffer_len = p.buffer_len;
      rp = p.read_page_1;
      // input rows last - 127 + buffer_len .. last are read: they must exist
      emit = emit && buffer_len <= 128 && last + 1 + buffer_len >= 128 && (buffer_len == 0 || (rp >= 0 && rp < pages));
      first_token = last - 127;
    }
  }
  float* out = a.out + static_cast<int64_t>(row) * d + base;
  if (!emit) {
    if constexpr (kMode != C128Mode::kOnlineWrite) {
      for (int ch = threadIdx.x; ch < cw; ch += kC128Threads) out[ch] = 0.f;
    }
    return;
  }

  // per-thread partial over the group's slots, kBatch rows in flight at a time; decode reads all 128 slots from
  // the state and offline prefill always has 128, so only online compression masks slots
  constexpr bool kAllSlots = !kOnline;
  float4 m = make_float4(kNegMax, kNegMax, kNegMax, kNegMax);
  float4 l = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  constexpr int kBatch = 4;
#pragma unroll 1
  for (int j0 = g; j0 < 128; j0 += kBatch * groups) {
    float4 kv[kBatch], sc[kBatch];
    bool ok[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int j = j0 + i * groups;
      ok[i] = kAllSlots || j < count;
      if (!ok[i]) {
        kv[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        sc[i] = make_float4(kNegMax, kNegMax, kNegMax, kNegMax);
        continue;
      }
      if (kMode == C128Mode::kDecode || j < buffer_len) {
        const TS* r = state + (rp * 128 + j) * width;
        kv[i] = load4<kVec>(r + c);
        sc[i] = load4<kVec>(r + d + c);
      } else {
        const TI* r = input + (first_token + j) * a.in_stride;
        kv[i] = load4<kVec>(r + c);
        sc[i] = load4<kVec>(r + d + c);
      }
      sc[i] = add4(sc[i], *reinterpret_cast<const float4*>(a.ape + static_cast<int64_t>(ape_off + j) * d + c));
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float mk = get(m, k);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) mk = ok[i] ? fmaxf(mk, get(sc[i], k)) : mk;
      const float scale = __expf(get(m, k) - mk);
      float lk = get(l, k) * scale, ak = get(acc, k) * scale;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const float e = ok[i] ? __expf(get(sc[i], k) - mk) : 0.f;
        lk += e;
        ak += e * get(kv[i], k);
      }
      set(m, k, mk);
      set(l, k, lk);
      set(acc, k, ak);
    }
  }
  pdl_launch_next();
  float* sm_m = smem;  // [groups][cw]
  float* sm_l = sm_m + groups * cw;
  float* sm_a = sm_l + groups * cw;
  const int own = g * cw + (c - base);
  store4<true>(sm_m + own, m);
  store4<true>(sm_l + own, l);
  store4<true>(sm_a + own, acc);
  __syncthreads();
  for (int ch = threadIdx.x; ch < cw; ch += kC128Threads) {
    float big = kNegMax;
    for (int w = 0; w < groups; ++w) big = sm_l[w * cw + ch] > 0.f ? fmaxf(big, sm_m[w * cw + ch]) : big;
    float total = 0.f, weighted = 0.f;
    for (int w = 0; w < groups; ++w) {
      const float lw = sm_l[w * cw + ch];
      const float s = lw > 0.f ? __expf(sm_m[w * cw + ch] - big) : 0.f;
      total += lw * s;
      weighted += sm_a[w * cw + ch] * s;
    }
    float avg = weighted / total;
    if constexpr (kOnline) {
      if (ape_off != 0) {  // merge with the stored partial state (m1, l1, a1)
        const TS* r = state + rp * width + base;
        const float m1 = static_cast<float>(r[ch]);
        const float l1 = static_cast<float>(r[d + ch]);
        const float a1 = static_cast<float>(r[2 * d + ch]);
        const float mm = fmaxf(m1, big);
        const float w1 = l1 * __expf(m1 - mm);
        const float w2 = total * __expf(big - mm);
        avg = (a1 * w1 + avg * w2) / (w1 + w2);
        total = w1 + w2;
        big = mm;
      }
    }
    if constexpr (kMode == C128Mode::kOnlineWrite) {
      const CompressPlan p = static_cast<const CompressPlan*>(a.plan)[row];
      TS* dst = state + static_cast<int64_t>(p.read_page_0) * width + base;
      dst[ch] = big;
      dst[d + ch] = total;
      dst[2 * d + ch] = avg;
    } else {
      out[ch] = avg;
    }
  }
}

// ------------------------------------------------------------------------------------------------ online decode

// One thread per (request, 4 channels): load the running state unless the token starts a chunk, update it with
// the token, then either emit the average (last token of a chunk) or store the state.
template <typename TI, bool kVec>
__global__ void __launch_bounds__(kCopyThreads) online_decode_kernel(CompressArgs a) {
  pdl_wait();
  const int quads = a.d / 4;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  if (t >= static_cast<int64_t>(a.num_rows) * quads) return;
  const int row = static_cast<int>(t / quads);
  const int c = static_cast<int>(t % quads) * 4;
  const int d = a.d;
  float* state = static_cast<float*>(a.state);
  float* out = a.out + static_cast<int64_t>(row) * d + c;
  const DecodePlan p = static_cast<const DecodePlan*>(a.plan)[row];
  const int off = static_cast<int>((p.seq_len - 1u) % 128u);
  const bool fresh = off == 0;
  const bool ok = p.write_loc >= 0 && p.write_loc < a.state_rows &&
                  (fresh || (p.read_page_0 >= 0 && p.read_page_0 < a.state_rows));
  if (!ok) {
    store4<true>(out, make_float4(0.f, 0.f, 0.f, 0.f));
    return;
  }
  const TI* src = static_cast<const TI*>(a.input) + row * a.in_stride;
  const float4 v = load4<kVec>(src + c);
  const float4 s = add4(load4<kVec>(src + d + c), *reinterpret_cast<const float4*>(a.ape + off * d + c));
  float4 m = s, l = make_float4(1.f, 1.f, 1.f, 1.f), avg = v;
  if (!fresh) {
    const float* r = state + static_cast<int64_t>(p.read_page_0) * 3 * d;
    const float4 m1 = load4<true>(r + c), l1 = load4<true>(r + d + c), a1 = load4<true>(r + 2 * d + c);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float mm = fmaxf(get(m1, k), get(s, k));
      const float w1 = get(l1, k) * __expf(get(m1, k) - mm);
      const float w2 = __expf(get(s, k) - mm);
      set(m, k, mm);
      set(l, k, w1 + w2);
      set(avg, k, (get(a1, k) * w1 + get(v, k) * w2) / (w1 + w2));
    }
  }
  if (off == 127) {
    store4<true>(out, avg);
    return;
  }
  store4<true>(out, make_float4(0.f, 0.f, 0.f, 0.f));
  float* dst = state + static_cast<int64_t>(p.write_loc) * 3 * d;
  store4<true>(dst + c, m);
  store4<true>(dst + d + c, l);
  store4<true>(dst + 2 * d + c, avg);
}

// ------------------------------------------------------------------------------------------------ prefill writes

// Persisted rows: state[write_loc] = input[ragged_id] (whole row). One warp per plan row, grid-stride over the
// rows (the plan is padded to the token count, so the grid is capped), 4 elements per lane per step.
template <typename TS, typename TI, bool kVec>
__global__ void __launch_bounds__(kCopyThreads) write_rows_kernel(CompressArgs a, int64_t width) {
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kCopyThreads / 32);
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x) >> 5; row < a.num_rows;
       row += warps) {
    const WritePlan p = static_cast<const WritePlan*>(a.plan)[row];
    if (p.ragged_id == kInvalid || p.write_loc < 0 || p.write_loc >= a.state_rows ||
        static_cast<int64_t>(p.ragged_id) >= a.input_rows)
      continue;
    const TI* src = static_cast<const TI*>(a.input) + static_cast<int64_t>(p.ragged_id) * a.in_stride;
    TS* dst = static_cast<TS*>(a.state) + static_cast<int64_t>(p.write_loc) * width;
#pragma unroll 4
    for (int64_t c = lane * 4; c < width; c += 128) store4<kVec>(dst + c, load4<kVec>(src + c));
  }
}

}  // namespace dsv4
}  // namespace dspark
