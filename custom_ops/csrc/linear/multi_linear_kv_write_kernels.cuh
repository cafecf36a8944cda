// Kernels of dspark::multi_linear_kv_write: N layers' K/V projections, per-head RMSNorm and RoPE of K, and the cache
// writes. Plain CUDA (no torch headers); the binding is multi_linear_kv_write.cu, the reference math
// custom_ops/linear/multi_linear_kv_write.py.
//
// Rows. The op's projections are one multi-weight GEMM over 2N segments of kv = heads * head_dim rows each, in the
// order K_0, V_0, K_1, V_1, ...: concatenated row r is element r % head_dim of head (r % kv) / head_dim of the K
// (segment even) or V (odd) block of layer r / (2 kv). Every segment is a whole number of heads, so a tile whose
// height is a multiple of head_dim and starts at a multiple of it holds whole heads.
//
// Two paths:
//   * fused (small T, head_dim 64 or 128): kv_write_fused_kernel of multi_linear_kv_write_fused.cuh (and the
//     experimental wide tiles of benchmarks/experimental/) with KvWriteEpilogue below. A CTA computes one head (64 or
//     128 rows); after the reduction over its warps (and a cluster's CTAs) the finished tile sits in shared memory in
//     fp32, and the epilogue writes each token's head straight into the cache (one warp per token): nothing but the
//     weights, the activation and the written cache rows touch HBM.
//   * heads (any T; head_dim up to 256): reads the projections that the GEMM path wrote to a [T, 2N kv] buffer and
//     does the same per-unit work (a unit: the heads of one (token, layer, K or V), or at small T a group of 4 of
//     them), with a head in 8, 16 or 32 lanes of 8 elements; V is copied as it is. Three kernels: a warp per unit
//     (kv_write_heads_unit_kernel) while the units fit the GPU at once, else persistent warps, each through a run
//     of units copied ahead into a shared-memory ring (kv_write_heads_kernel); for the forms drafts are written in
//     (RoPE over the whole head from a neox halves table, neox inverse frequencies, a GPT-J pairs or halves table;
//     norm weights of the element type, or no norm) a warp per unit compiled for the form, at every T
//     (kv_write_heads_common_kernel of multi_linear_kv_write_common.cuh).
//
// Per (token, head) unit, in fp32 (each lane of the head's lanes holds V consecutive elements: V = head_dim / 32 in
// the fused epilogue, 8 in the heads kernel): the token's slot (cache_loc, or cache_loc_2d and commit_lens) and, with
// RoPE, its position; a negative or out-of-range slot, a masked commit column or a position outside the shortest
// table (halves or pairs form; a frequencies table has no rows) skips the token (nothing is read through it, nothing
// written, in any layer). K: sum of squares across the
// head's lanes, scale = rsqrt(mean + eps), times the norm weight; RoPE pairs (j, j + R/2) (neox: by a shuffle, or
// through a row of shared memory private to the head's lanes when R/2 splits a lane's elements) or (2j, 2j + 1)
// (GPT-J, inside a lane) for j < R/2; then every lane stores its V elements, rounded once, with one vector store.
#pragma once

#include "linear/multi_linear_kernels.cuh"

namespace dspark {
namespace mlinear {

constexpr int kMaxLayers = kMaxSegments / 2;  // layers per launch: two GEMM segments (K, V) each
constexpr int kHeadWarps = 8;                 // warps per CTA of the heads kernel

// RoPE table forms (KvWrite::table_form; table_form in custom_ops/linear/multi_linear_kv_write.py): the factors
// (c_j, s_j) of pair j < R/2 at position p are row p's (j, R/2 + j) (halves, [P, R]), (2j, 2j + 1) (pairs,
// [P, R/2, 2]: a complex table's real view), or cos / sin of float(p) * f[j] in fp32 (frequencies, f = [R/2]).
constexpr int kHalves = 0;
constexpr int kPairs = 1;
constexpr int kFrequencies = 2;

// What the epilogue needs besides the GEMM: where each layer's K (kind 0) and V (kind 1) rows go and how K is normed
// and rotated. Index tensors are addressed through their strides; a flag says int64 (else int32).
struct KvWrite {
  void* cache[2][kMaxLayers];           // [kind][layer] first element of slot 0, head 0
  int64_t slot_stride[2][kMaxLayers];   // elements
  int64_t head_stride[2][kMaxLayers];   // elements (the head_dim elements of a head are contiguous)
  const void* norm_weight[kMaxLayers];  // [head_dim], nullptr: no weight
  int norm_fp32[kMaxLayers];            // norm_weight is fp32 (else the element type)
  float eps[kMaxLayers];
  const float* cos_sin[kMaxLayers];     // a table of the form table_form: rows of R factors, or R/2 frequencies
  int64_t table_stride[kMaxLayers];     // elements between rows (halves, pairs)
  int table_form;                       // kHalves, kPairs or kFrequencies
  const void* positions;
  int64_t positions_stride;
  int positions_int64;
  const void* loc;                      // token t = b * width + j reads loc[b * loc_stride0 + j * loc_stride1]
  int64_t loc_stride0, loc_stride1;
  int loc_int64;
  const void* commit_lens;              // nullptr: every column; else write only j < commit_lens[b]
  int64_t commit_stride;
  int commit_int64;
  int width;                            // 32-bit index arithmetic throughout (the binding checks the ranges)
  int64_t slots;
  int64_t position_limit;               // rows of the shortest table of the call: a position outside [0, limit)
                                        // skips its token in every layer (the CPU op raises for it); unused for
                                        // frequencies, whose positions are angles (any value, never wrapped)
  int heads, head_dim, rotary_dim;
  int neox, has_norm, has_rope;
  int wrap_negative;                    // a slot in [-slots, 0) / position in [-limit, 0) counts from the end
};

struct KvWriteArgs {
  Params gemm;  // segments K_0, V_0, K_1, ... (adjacent ones may be merged: the row arithmetic does not need them)
  KvWrite kv;
};

__device__ __forceinline__ int64_t load_index(const void* base, int64_t offset, int is_int64) {
  return is_int64 ? static_cast<const int64_t*>(base)[offset] : static_cast<const int32_t*>(base)[offset];
}

// `index` as Python indexing reads it when `wrap` (a value in [-size, 0) counts from the end), else unchanged.
__device__ __forceinline__ int64_t wrapped(int64_t index, int64_t size, int wrap) {
  return wrap && index < 0 ? index + size : index;
}

template <typename T, int V>
__device__ __forceinline__ void store_row(T* dst, const float (&v)[V]);

template <>
__device__ __forceinline__ void store_row<__nv_bfloat16, 2>(__nv_bfloat16* dst, const float (&v)[2]) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v[0], v[1]);
}
template <>
__device__ __forceinline__ void store_row<__half, 2>(__half* dst, const float (&v)[2]) {
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v[0], v[1]);
}

// V = 4 or 8: pairs packed into 32-bit words, one 8- or 16-byte store.
template <typename T, int V>
__device__ __forceinline__ void store_row(T* dst, const float (&v)[V]) {
  static_assert(V == 4 || V == 8, "2, 4 or 8 elements per lane");
  uint32_t words[V / 2];
#pragma unroll
  for (int i = 0; i < V / 2; ++i) {
    const float pair[2] = {v[2 * i], v[2 * i + 1]};
    T packed[2];
    store_row<T, 2>(packed, pair);
    words[i] = *reinterpret_cast<const uint32_t*>(packed);
  }
  if constexpr (V == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// The V elements of T packed in pairs into 32-bit words, as floats.
template <typename T, int V>
__device__ __forceinline__ void unpack_words(const uint32_t (&words)[V / 2], float (&v)[V]) {
#pragma unroll
  for (int i = 0; i < V / 2; ++i) {
    const T* pair = reinterpret_cast<const T*>(&words[i]);
    v[2 * i] = to_float(pair[0]);
    v[2 * i + 1] = to_float(pair[1]);
  }
}

// The sum of v over each aligned group of kLanes lanes (a power of two <= 32), in every lane of the group.
template <int kLanes>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset, kLanes);
  return v;
}

// The four floats of a 16-byte load, into dst[0..3].
__device__ __forceinline__ void unpack_floats(const uint4& q, float* dst) {
  dst[0] = __uint_as_float(q.x), dst[1] = __uint_as_float(q.y);
  dst[2] = __uint_as_float(q.z), dst[3] = __uint_as_float(q.w);
}

// Whether positions index table rows (halves, pairs) and so are wrapped and range-checked; frequencies' are angles.
__device__ __forceinline__ bool positions_are_rows(const KvWrite& kv) {
  return kv.has_rope && kv.table_form != kFrequencies;
}

// The token's position as read by the kernels: wrapped (with wrap_negative) where it is a table row.
__device__ __forceinline__ int64_t token_position(const KvWrite& kv, int64_t t) {
  const int64_t p = load_index(kv.positions, t * kv.positions_stride, kv.positions_int64);
  return positions_are_rows(kv) ? wrapped(p, kv.position_limit, kv.wrap_negative) : p;
}

// Whether RoPE lets the token be written: a row position inside every table (any position for frequencies).
__device__ __forceinline__ bool position_ok(const KvWrite& kv, int64_t pos) {
  return !positions_are_rows(kv) || (pos >= 0 && pos < kv.position_limit);
}

// The factors of pair j: from the position's row (halves, pairs) or from the frequencies and the position.
__device__ __forceinline__ void rope_factors(int form, const float* row, int half, int j, float pos, float& c,
                                             float& s) {
  if (form == kFrequencies) {
    sincosf(pos * row[j], &s, &c);  // fp32 product, as positions.float() * inv_freq
  } else if (form == kPairs) {
    c = row[2 * j];
    s = row[2 * j + 1];
  } else {
    c = row[j];
    s = row[half + j];
  }
}

// A lane's share of one head: elements e0 = lane * V .. e0 + V - 1 of head_dim, `lane` counted in the head's lanes
// (lanes with e0 >= head_dim hold none: head_dim may be any multiple of 8 up to V times the head's lanes).
//
// The cos/sin factors of this lane's elements (1 and 0 past the rotary dim): pair j of element e is e or e - R/2
// (neox) or e / 2 (GPT-J); `row` holds the token's factors in the form `form` (global or shared memory; for
// frequencies the R/2 frequencies, `pos` the token's position).
template <int V>
__device__ __forceinline__ void load_rope(const KvWrite& kv, int form, const float* row, float pos, int e0,
                                          float (&c)[V], float (&s)[V]) {
  const int half = kv.rotary_dim / 2;
  if constexpr (V % 4 == 0) {
    // neox halves with the lane's elements inside one half of the rotary dims (R/2 a multiple of V): the factors are
    // V consecutive floats of each half of the row, read 16 bytes at a time where the row is 16-byte aligned (the
    // same values as the loop below, a quarter of the loads and none of its per-element index arithmetic)
    if (kv.has_rope && form == kHalves && kv.neox && half % V == 0 && e0 + V <= kv.rotary_dim &&
        (reinterpret_cast<uintptr_t>(row) & 15u) == 0) {
      const float* cos_row = row + (e0 < half ? e0 : e0 - half);
#pragma unroll
      for (int q = 0; q < V / 4; ++q) {
        unpack_floats(*reinterpret_cast<const uint4*>(cos_row + 4 * q), c + 4 * q);
        unpack_floats(*reinterpret_cast<const uint4*>(cos_row + half + 4 * q), s + 4 * q);
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = e0 + i;
    c[i] = 1.f;
    s[i] = 0.f;
    if (kv.has_rope && e < kv.rotary_dim) {
      const int j = kv.neox ? (e < half ? e : e - half) : e / 2;
      rope_factors(form, row, half, j, pos, c[i], s[i]);
    }
  }
}

// The norm weight of this lane's elements: fp32 when `fp32`, else T; 1 without a weight or past head_dim.
template <typename T, int V>
__device__ __forceinline__ void load_weight(const void* w, int fp32, int e0, int head_dim, float (&g)[V]) {
  // All V elements inside head_dim and 16-byte aligned: 16-byte loads (the same values as the loop below)
  const bool whole = w != nullptr && e0 + V <= head_dim;
  if constexpr (V % 4 == 0) {
    const float* w32 = whole && fp32 ? static_cast<const float*>(w) + e0 : nullptr;
    if (w32 != nullptr && (reinterpret_cast<uintptr_t>(w32) & 15u) == 0) {
#pragma unroll
      for (int q = 0; q < V / 4; ++q) {
        unpack_floats(*reinterpret_cast<const uint4*>(w32 + 4 * q), g + 4 * q);
      }
      return;
    }
  }
  if constexpr (V % 8 == 0 && sizeof(T) == 2) {
    const T* wt = whole && !fp32 ? static_cast<const T*>(w) + e0 : nullptr;
    if (wt != nullptr && (reinterpret_cast<uintptr_t>(wt) & 15u) == 0) {
#pragma unroll
      for (int q = 0; q < V / 8; ++q) {
        const uint4 wq = *reinterpret_cast<const uint4*>(wt + 8 * q);
        const uint32_t words[4] = {wq.x, wq.y, wq.z, wq.w};
        float part[8];
        unpack_words<T, 8>(words, part);
#pragma unroll
        for (int i = 0; i < 8; ++i) g[8 * q + i] = part[i];
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < V; ++i) {
    g[i] = 1.f;
    if (w != nullptr && e0 + i < head_dim) {
      g[i] = fp32 ? static_cast<const float*>(w)[e0 + i] : to_float(static_cast<const T*>(w)[e0 + i]);
    }
  }
}

// Norm (K), RoPE (K) and the store of one head whose fp32 projection an aligned group of kLanes lanes (the warp, or
// 32 / kLanes heads side by side) holds in v, `lane` being the lane's index in its group, with the lane's norm
// weights g and cos/sin factors c, s already loaded (so no load follows a store). Every lane of the warp calls it
// (the shuffles and the scratch path's __syncwarp are warp-wide); a group with `store` false (a head past the last)
// writes nothing. `scratch` is head_dim floats of shared memory only this group uses (RoPE partners); `dst` the
// head's cache row.
template <typename T, int V, int kLanes = 32>
__device__ __forceinline__ void emit_head(const KvWrite& kv, bool is_k, float eps, const float (&g)[V],
                                          const float (&c)[V], const float (&s)[V], float (&v)[V], float* scratch,
                                          T* dst, int lane, bool store = true) {
  const int e0 = lane * V;
  const bool active = e0 < kv.head_dim;
  if (is_k && kv.has_norm) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) ss += active ? v[i] * v[i] : 0.f;
    const float scale = rsqrtf(group_sum<kLanes>(ss) / static_cast<float>(kv.head_dim) + eps);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] *= scale * g[i];
  }
  if (is_k && kv.has_rope) {
    const int half = kv.rotary_dim / 2;
    if (!kv.neox) {  // GPT-J: pair (2j, 2j + 1) lies in one lane (V and e0 are even); c, s are equal within it
#pragma unroll
      for (int i = 0; i < V; i += 2) {
        if (e0 + i >= kv.rotary_dim) continue;
        const float a = v[i], b = v[i + 1];
        v[i] = a * c[i] - b * s[i];
        v[i + 1] = b * c[i] + a * s[i];
      }
    } else if (half % V == 0) {  // neox, partner element e +- R/2 at the same i of lane +- R/2 / V
      const int partner = e0 >= kv.rotary_dim ? lane : e0 < half ? lane + half / V : lane - half / V;
      const bool first = e0 < half;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float other = __shfl_sync(0xffffffffu, v[i], partner, kLanes);
        if (e0 < kv.rotary_dim) v[i] = first ? v[i] * c[i] - other * s[i] : v[i] * c[i] + other * s[i];
      }
    } else {  // neox with a rotary half that splits a lane's elements: partners through shared memory
      if (active) {
#pragma unroll
        for (int i = 0; i < V; ++i) scratch[e0 + i] = v[i];
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int e = e0 + i;
        if (!active || e >= kv.rotary_dim) continue;
        const bool first = e < half;
        const float other = scratch[first ? e + half : e - half];
        v[i] = first ? v[i] * c[i] - other * s[i] : v[i] * c[i] + other * s[i];
      }
      __syncwarp();  // the scratch row is free for the group's next head
    }
  }
  if (active && store) store_row<T, V>(dst + e0, v);
}

// Where head `head` of layer `layer`'s K (kind 0) or V cache row `slot` starts.
template <typename T>
__device__ __forceinline__ T* cache_row(const KvWrite& kv, int kind, int layer, int head, int64_t slot) {
  return static_cast<T*>(kv.cache[kind][layer]) + slot * kv.slot_stride[kind][layer] +
         head * kv.head_stride[kind][layer];
}

// The layer, kind (0: K, 1: V) and head of the launch's head `index` (concatenated rows index * head_dim on).
struct HeadOf {
  int layer, kind, head;
};

__device__ __forceinline__ HeadOf head_of(const KvWrite& kv, int index) {
  const int segment = index / kv.heads;
  return {segment >> 1, segment & 1, index - segment * kv.heads};
}

// 4 bytes from global `src` to shared `dst`, asynchronously (waited for with wait_copies).
__device__ __forceinline__ void copy_async4(float* dst, const float* src) {
#if defined(__CUDA_ARCH__)
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(to), "l"(src) : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_copy_async(dst, src, 4, true);
#endif
}

// The fused epilogue. A tile is exactly one head (kRows == head_dim = 32 V) of one layer's K or V, so a unit is a
// token of the tile. Staged in shared memory while the main loop runs: each token's slot (-1: skipped) and, for K
// with RoPE, its cos/sin row, and the layer's norm weight. The loads behind them are issued right after the main
// loop's first loads (`prefetch`: raw values into registers of thread t < tokens and i < head_dim), evaluated later
// (`stage`: slots and weights to shared memory, the cos/sin rows by asynchronous copies), so the epilogue reads no
// global memory but the peer tiles. Tokens are shared out over the cluster's CTAs and each CTA's
// warps; a token's values are the bias plus the S partial tiles, written back into the owner's own tile row (which
// no other CTA reads) to serve as the RoPE scratch row.
template <int V>
struct KvWriteEpilogue {
  static constexpr int kHeadDim = 32 * V;
  using Args = KvWriteArgs;
  struct Prefetch {
    int64_t commit, loc, pos;  // thread t < tokens: token t's raw index values
    uint32_t weight;           // thread i < head_dim: norm weight element i, raw bits
  };
  // Shared memory: slot [kTokens] int64, norm weight [head_dim] and cos/sin rows [kTokens][head_dim] fp32 (the first
  // R of each row used).
  static __host__ __device__ constexpr int extra_bytes(int tokens) { return 8 * tokens + 4 * kHeadDim * (1 + tokens); }
  static __device__ __forceinline__ const Params& gemm(const Args& args) { return args.gemm; }

  template <typename T, int kTokens>
  static __device__ __forceinline__ Prefetch prefetch(const Args& args, int64_t row0) {
    const KvWrite& kv = args.kv;
    const HeadOf h = head_of(kv, static_cast<int>(row0 / kHeadDim));
    const int t = static_cast<int>(threadIdx.x);
    Prefetch pre{0, -1, 0, 0};
    if (t < args.gemm.tokens && t < kTokens) {
      const int b = t / kv.width, j = t % kv.width;
      pre.commit = kv.commit_lens != nullptr ? load_index(kv.commit_lens, b * kv.commit_stride, kv.commit_int64)
                                             : j + 1;
      pre.loc = wrapped(load_index(kv.loc, b * kv.loc_stride0 + j * kv.loc_stride1, kv.loc_int64), kv.slots,
                        kv.wrap_negative);
      if (kv.has_rope) pre.pos = token_position(kv, t);
    }
    const void* w = kv.norm_weight[h.layer];
    if (h.kind == 0 && kv.has_norm && w != nullptr && t < kHeadDim) {
      pre.weight = kv.norm_fp32[h.layer] ? static_cast<const uint32_t*>(w)[t] : static_cast<const uint16_t*>(w)[t];
    }
    return pre;
  }

  template <typename T, int kTokens>
  // `threads`: how many threads of the CTA (0, 1, ...) run it; 0: all of them.
  static __device__ __forceinline__ void stage(const Args& args, const Prefetch& pre, float* extra, int64_t row0,
                                               int threads = 0) {
    const KvWrite& kv = args.kv;
    const HeadOf h = head_of(kv, static_cast<int>(row0 / kHeadDim));
    int64_t* slots = reinterpret_cast<int64_t*>(extra);
    float* weight = reinterpret_cast<float*>(slots + kTokens);
    float* rows = weight + kHeadDim;
    const int t = static_cast<int>(threadIdx.x);
    if (t < kHeadDim) {
      float w = 1.f;
      if (kv.norm_weight[h.layer] != nullptr) {
        if (kv.norm_fp32[h.layer]) {
          w = __uint_as_float(pre.weight);
        } else {
          T raw;
          *reinterpret_cast<uint16_t*>(&raw) = static_cast<uint16_t>(pre.weight);
          w = to_float(raw);
        }
      }
      weight[t] = w;
    }
    if (kv.has_rope && kv.table_form == kFrequencies && h.kind == 0) {
      // Every token's factors (a skipped token's row is never read), one (token, pair) per thread of the CTA.
      const int half = kv.rotary_dim / 2;
      const int tokens = args.gemm.tokens < kTokens ? args.gemm.tokens : kTokens;
      const int stride = threads > 0 ? threads : static_cast<int>(blockDim.x);
      for (int i = t; i < tokens * half; i += stride) {
        const int u = i / half, pair = i - u * half;
        float* row = rows + u * kHeadDim;
        rope_factors(kFrequencies, kv.cos_sin[h.layer], half, pair, static_cast<float>(token_position(kv, u)),
                     row[pair], row[half + pair]);
      }
    }
    if (t >= kTokens) return;
    const int j = t % kv.width;
    const bool rope_ok = position_ok(kv, pre.pos);
    const bool live = t < args.gemm.tokens && j < pre.commit && pre.loc >= 0 && pre.loc < kv.slots && rope_ok;
    slots[t] = live ? pre.loc : -1;
    if (!live || h.kind != 0 || !kv.has_rope || kv.table_form == kFrequencies) return;
    float* dst = rows + t * kHeadDim;
    // This token's cos/sin row (halves or pairs: R consecutive floats): 16-byte copies where the row allows, else
    // 4-byte ones.
    const float* src = kv.cos_sin[h.layer] + pre.pos * kv.table_stride[h.layer];
    if (kv.rotary_dim % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
      for (int e = 0; e < kv.rotary_dim; e += 4) copy_async16(reinterpret_cast<uint4*>(dst + e), src + e, true);
    } else {
      for (int e = 0; e < kv.rotary_dim; ++e) copy_async4(dst + e, src + e);
    }
  }

  template <typename T, int kRows, int kTokens, int kThreads>
  static __device__ __forceinline__ void finish(const Args& args, float* tile, const float* bias, const float* extra,
                                                int64_t row0, int, const ClusterCoord& cluster) {
    static_assert(kRows == kHeadDim, "a tile is one head");
    constexpr int kPitch = tile_pitch(kRows);
    const KvWrite& kv = args.kv;
    const HeadOf h = head_of(kv, static_cast<int>(row0 / kHeadDim));
    const int64_t* slots = reinterpret_cast<const int64_t*>(extra);
    const float* weight = reinterpret_cast<const float*>(slots + kTokens);
    const float* table_rows = weight + kHeadDim;
    if (cluster.size > 1) cluster_sync();
    const int tokens = args.gemm.tokens < kTokens ? args.gemm.tokens : kTokens;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const int begin = static_cast<int>(static_cast<int64_t>(tokens) * cluster.rank / cluster.size);
    const int end = static_cast<int>(static_cast<int64_t>(tokens) * (cluster.rank + 1) / cluster.size);
    for (int token = begin + warp; token < end; token += kThreads / 32) {
      const int64_t slot = slots[token];
      if (slot < 0) continue;
      float* mine = tile + token * kPitch;
      float v[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int e = lane * V + i;
        float sum = bias[e];
        if (cluster.size == 1) {
          sum += mine[e];
        } else {
          for (unsigned q = 0; q < cluster.size; ++q) sum += cluster_peer(mine, q)[e];
        }
        v[i] = sum;
      }
      float g[V], c[V], sn[V];
      load_weight<float, V>(weight, 1, lane * V, kHeadDim, g);
      load_rope<V>(kv, kv.table_form == kPairs ? kPairs : kHalves, table_rows + token * kHeadDim, 0.f, lane * V, c,
                   sn);
      __syncwarp();  // every lane has read its sums before the row becomes the scratch row
      emit_head<T, V>(kv, h.kind == 0, kv.eps[h.layer], g, c, sn, v, mine,
                      cache_row<T>(kv, h.kind, h.layer, h.head, slot), lane);
    }
    if (cluster.size > 1) cluster_sync();
  }
};

// The heads kernel: persistent warps, each writing a contiguous run of units from `projections` [T, ld] (the GEMM's
// rows: segment 2 layer + kind of heads * head_dim rows). A unit is up to head_batch heads of one (token, layer, K or
// V): kHeadSteps steps of 32 / kLanes heads side by side, a head being kLanes lanes of kHeadLaneElems = 8
// consecutive elements (16-byte copies and stores; kLanes = 8, 16 or 32 for head_dim <= 64, 128, 256, lanes past
// head_dim idle), 2 KB per unit (8 heads of 128, 16 of 64, 4 of 256): a whole (token, layer, K or V) of the
// Qwen3-style drafts. Each warp keeps kHeadStages units in flight through a ring of shared memory filled by cp.async
// (each lane copies, waits for and reads back only its own 16-byte pieces, so the ring needs no barrier); a token's
// indices are loaded when the warp's run reaches it, a K unit's norm weight and cos/sin row before the unit's wait;
// a V unit's pieces go from the ring to the cache as they are (the GEMM rounded them already). Why: at large T the
// kernel is a stream (each element read once, written once) whose rate is set by the bytes in flight per SM over the
// memory latency. H200, the kernel in the op's graph replay after an L2 flush, Qwen3-8B / head_dim-64 drafts at
// T = 4096 (168 MB read and written each): one warp per unit holding its 2 KB in registers (3 CTAs per SM, 80
// registers with spills: at most 48 KB in flight per SM) 74.5-78.4 / 73.8-74.3 us; this ring capped at 3 CTAs per
// SM (80 registers) 68.7 / 69.0 with 40-48 bytes of spills, 92.6-94.0 once the cursor and the V path below raised
// them to 124-148 bytes (80.7-81.1 with 2 stages); at 2 CTAs per SM (122 registers, no spills) 50.7-53.2 / 53.1
// with 4 stages and 52.2-53.1 / 52.1-53.7 with 3 (3.2 TB/s). T = 512: 12.2 / 11.3 us (registers: 12.6 / 11.6),
// T = 64 (one unit per warp): 5.5 / 6.0 (4.9 / 4.5). After the dependency wait a warp issues its first copies;
// nothing is loaded before the wait: the kernel before this one may be cuBLAS, which promises nothing about when a
// dependent launch starts.
constexpr int kHeadLaneElems = 8;
constexpr int kHeadSteps = 4;
constexpr int kHeadStages = 3;  // units in flight per warp (4 measured the same)
// Lanes per head for heads of up to head_dim elements (<= 256): the fewest of 8, 16 or 32 that hold them.
inline int head_lanes(int64_t head_dim) {
  int lanes = 8;
  while (lanes < 32 && lanes * kHeadLaneElems < head_dim) lanes *= 2;
  return lanes;
}
// Heads of one unit at most: kHeadSteps steps of 32 / kLanes heads.
template <int kLanes>
__host__ __device__ constexpr int head_batch() {
  return kHeadSteps * (32 / kLanes);
}
// Dynamic shared memory of a heads-kernel CTA: per warp its ring of kHeadStages units (kHeadSteps x 32 lanes x 16
// bytes each) and a RoPE scratch row of 32 lanes x 8 floats.
constexpr int kHeadStageWords = kHeadSteps * 32;               // uint4 per unit
constexpr int kHeadRingWords = kHeadStages * kHeadStageWords;  // uint4 per warp
constexpr int heads_smem_bytes() { return kHeadWarps * (kHeadRingWords * 16 + 32 * kHeadLaneElems * 4); }
// Heads per unit when the heads of a segment are split over units (small T).
constexpr int kSplitHeads = 4;
// Below this many whole-segment units per SM, the heads are split into units of kSplitHeads heads. H200, heads
// kernel alone in the op's CUDA-graph replay after an L2 flush (torch profiler), split vs not, Qwen3-8B draft (8
// heads of 128) / 16 heads of 64 (hidden 7168): T = 64 (4.8 units per SM) 5.0 vs 6.0 / 5.3 vs 8.2 us; T = 512 (39
// per SM) 17.2 vs 13.1 / 23.2 vs 18.1 us (the register kernel before the ring: one unit per warp). T = 4096 gives 310
// per SM.
constexpr int kSplitHeadsBelowUnitsPerSm = 16;

// Heads per unit: kSplitHeads while whole segments give fewer than kSplitHeadsBelowUnitsPerSm units per SM, else a
// segment's heads; at most a batch of kLanes lanes per head.
template <int kLanes>
int heads_per_unit(int tokens, int layers, int heads, int sm_count) {
  const int64_t segments = static_cast<int64_t>(tokens) * 2 * layers;
  const int per_unit = segments < static_cast<int64_t>(kSplitHeadsBelowUnitsPerSm) * sm_count ? kSplitHeads : heads;
  return per_unit < head_batch<kLanes>() ? per_unit : head_batch<kLanes>();
}

// Units of the heads kernel, and its CTAs: a warp per unit up to `resident` CTAs, whose warps then take several.
__host__ __device__ inline int64_t heads_units(int tokens, int layers, int heads, int per_unit) {
  return static_cast<int64_t>(tokens) * 2 * layers * ((heads + per_unit - 1) / per_unit);
}
__host__ __device__ inline int64_t heads_blocks(int64_t units, int64_t resident) {
  const int64_t blocks = (units + kHeadWarps - 1) / kHeadWarps;
  return blocks < resident ? blocks : resident;
}

// Heads per unit of kv_write_heads_unit_kernel, whose `resident_warps` warps are resident on the GPU at once: the
// ring kernel's heads_per_unit, doubled (up to a segment's heads and a batch) until every unit has a resident warp;
// 0 where they never do (the binding then takes the ring kernel, or for a compiled form the compiled-form kernel
// in waves). Fewer, wider units in one wave beat the ring's narrower units on
// its persistent warps: H100, each after a GEMM-like kernel in a CUDA graph (benchmarks/heads_tune.cu), Qwen3-8B
// draft at T = 158 / 200: 4.28 / 5.00 us with units of 8 heads against 5.68 / 6.50 for the ring's units of 4.
template <int kLanes>
int unit_heads_per_unit(int tokens, int layers, int heads, int sm_count, int64_t resident_warps) {
  const int most = heads < head_batch<kLanes>() ? heads : head_batch<kLanes>();
  for (int per_unit = heads_per_unit<kLanes>(tokens, layers, heads, sm_count);; per_unit *= 2) {
    per_unit = per_unit < most ? per_unit : most;
    if (heads_units(tokens, layers, heads, per_unit) <= resident_warps) return per_unit;
    if (per_unit == most) return 0;
  }
}

// A unit's token, segment (2 layer + kind) and heads [first, last).
struct HeadsUnit {
  int token, segment, first, last;
};

// Walks a warp's run of units in order (token, then segment, then group of heads), dividing only at the start;
// `segments` = 2 layers, `groups` = heads / per_unit rounded up.
struct UnitCursor {
  int token, segment, group;

  __device__ __forceinline__ UnitCursor(int u, int segments, int groups) {
    token = u / (segments * groups);
    const int rest = u - token * segments * groups;
    segment = rest / groups;
    group = rest - segment * groups;
  }
  __device__ __forceinline__ HeadsUnit unit(int per_unit, int heads) const {
    const int first = group * per_unit;
    return {token, segment, first, first + per_unit < heads ? first + per_unit : heads};
  }
  __device__ __forceinline__ void next(int segments, int groups) {
    if (++group < groups) return;
    group = 0;
    if (++segment < segments) return;
    segment = 0;
    ++token;
  }
};

// Token `token`'s cache slot and position (wrapped as the kernels read them), and whether it is written: its column
// committed, the slot and (with RoPE) the position in range.
__device__ __forceinline__ bool token_target(const KvWrite& kv, int token, int64_t& slot, int64_t& pos) {
  const int b = token < kv.width ? 0 : token / kv.width, j = token - b * kv.width;
  const int64_t commit =
      kv.commit_lens != nullptr ? load_index(kv.commit_lens, b * kv.commit_stride, kv.commit_int64) : j + 1;
  slot = wrapped(load_index(kv.loc, b * kv.loc_stride0 + j * kv.loc_stride1, kv.loc_int64), kv.slots,
                 kv.wrap_negative);
  pos = kv.has_rope ? token_position(kv, token) : 0;
  return j < commit && slot >= 0 && slot < kv.slots && position_ok(kv, pos);
}

// Starts this lane's copies of unit `w` into `stage` ([kHeadSteps][32] 16-byte pieces): the heads first + step * 32 /
// kLanes + group, zeros for lanes past head_dim and heads from `last` on; steps without a head copy nothing.
template <typename T, int kLanes>
__device__ __forceinline__ void copy_unit(uint4* stage, const KvWrite& kv, const T* projections, int64_t ld,
                                          const HeadsUnit& w, int group, int e0, int lane) {
  constexpr int kGroups = 32 / kLanes;
  const T* src = projections + w.token * ld + static_cast<int64_t>(w.segment) * kv.heads * kv.head_dim + e0;
#pragma unroll
  for (int step = 0; step < kHeadSteps; ++step) {
    if (w.first + step * kGroups >= w.last) break;  // the same in every lane
    const int head = w.first + step * kGroups + group;
    const bool live = e0 < kv.head_dim && head < w.last;
    copy_async16(stage + step * 32 + lane, live ? src + head * kv.head_dim : projections, live);
  }
}

template <typename T, int kLanes>
__global__ void __launch_bounds__(32 * kHeadWarps, 2)
    kv_write_heads_kernel(const __grid_constant__ KvWrite kv, const T* projections, int64_t ld, int tokens,
                          int layers, int per_unit) {
  constexpr int V = kHeadLaneElems, kGroups = 32 / kLanes;
  pdl_wait();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int sub = lane % kLanes, group = lane / kLanes;  // this lane's place in its head, and the head's
  const int e0 = sub * V;
  uint4* ring = reinterpret_cast<uint4*>(cta_smem()) + warp * kHeadRingWords;
  float* scratch = reinterpret_cast<float*>(reinterpret_cast<uint4*>(cta_smem()) + kHeadWarps * kHeadRingWords) +
                   warp * 32 * V + group * kLanes * V;
  const int segments = 2 * layers, groups = (kv.heads + per_unit - 1) / per_unit;
  // This warp's run [begin, end) of the units (< 2^31: the binding checks); runs differ by at most one unit. Where
  // the grid has a warp per unit, the run is the warp's own unit, without the 64-bit divisions (a warp then does one
  // unit, so its prologue is on the kernel's critical path). The binding launches this kernel only where the units
  // outnumber its resident warps (launch_heads: smaller calls take a warp-per-unit kernel); the emulation and
  // benchmarks/heads_tune.cu launch it with a warp per unit too.
  const int64_t units = static_cast<int64_t>(tokens) * segments * groups, warps = int64_t{gridDim.x} * kHeadWarps;
  const int64_t me = int64_t{blockIdx.x} * kHeadWarps + warp;
  const bool own_unit = units <= warps;
  const int begin = static_cast<int>(own_unit ? (me < units ? me : units) : me * units / warps);
  const int end = own_unit ? begin + (me < units ? 1 : 0) : static_cast<int>((me + 1) * units / warps);
  const UnitCursor first(begin, segments, groups);
  UnitCursor ahead = first;  // the next unit to copy
#pragma unroll
  for (int s = 0; s < kHeadStages; ++s) {
    if (begin + s < end) {
      copy_unit<T, kLanes>(ring + s * kHeadStageWords, kv, projections, ld, ahead.unit(per_unit, kv.heads), group,
                           e0, lane);
      ahead.next(segments, groups);
    }
    commit_copies();  // one group per ring slot, empty or not, so that the wait below counts units
  }
  UnitCursor at = first;  // the unit to write
  int token = -1;
  bool live = false;  // the current token is written
  int64_t slot = 0, pos = 0;
  int stage = 0;
  float c[V] = {}, sn[V] = {};  // the cos/sin factors of token rope_token in table rope_table (every K unit of it)
  int rope_token = -1;
  const float* rope_table = nullptr;
  for (int u = begin; u < end; ++u, at.next(segments, groups)) {
    const HeadsUnit w = at.unit(per_unit, kv.heads);
    if (w.token != token) {
      token = w.token;
      live = token_target(kv, token, slot, pos);
    }
    const int layer = w.segment >> 1, kind = w.segment & 1;
    float g[V];
    if (live && kind == 0) {  // K: the norm weight and the cos/sin factors load while the unit's copies land
      load_weight<T, V>(kv.has_norm ? kv.norm_weight[layer] : nullptr, kv.norm_fp32[layer], e0, kv.head_dim, g);
      const float* table = kv.has_rope ? kv.cos_sin[layer] : nullptr;
      if (token != rope_token || table != rope_table) {  // layers sharing a table share the token's factors
        rope_token = token;
        rope_table = table;
        const float* row = !kv.has_rope || kv.table_form == kFrequencies ? table : table + pos * kv.table_stride[layer];
        load_rope<V>(kv, kv.table_form, row, static_cast<float>(pos), kv.has_rope ? e0 : 1 << 30, c, sn);
      }
    }
    wait_copies<kHeadStages - 1>();  // this unit's group is complete
    if (live) {
      const uint4* pieces = ring + stage * kHeadStageWords;
      T* row = static_cast<T*>(kv.cache[kind][layer]) + slot * kv.slot_stride[kind][layer];
      const int64_t head_stride = kv.head_stride[kind][layer];
#pragma unroll
      for (int step = 0; step < kHeadSteps; ++step) {
        if (w.first + step * kGroups >= w.last) break;  // the same in every lane
        const int head = w.first + step * kGroups + group;
        const uint4 piece = pieces[step * 32 + lane];
        if (kind == 1) {  // V: the projections as they are (already rounded once)
          if (e0 < kv.head_dim && head < w.last) *reinterpret_cast<uint4*>(row + head * head_stride + e0) = piece;
        } else {
          const uint32_t words[V / 2] = {piece.x, piece.y, piece.z, piece.w};
          float v[V];
          unpack_words<T, V>(words, v);
          emit_head<T, V, kLanes>(kv, true, kv.eps[layer], g, c, sn, v, scratch, row + head * head_stride, sub,
                                  head < w.last);
        }
      }
    }
    if (u + kHeadStages < end) {  // the slot this unit read takes the unit kHeadStages ahead
      copy_unit<T, kLanes>(ring + stage * kHeadStageWords, kv, projections, ld, ahead.unit(per_unit, kv.heads),
                           group, e0, lane);
      ahead.next(segments, groups);
    }
    commit_copies();
    stage = stage + 1 == kHeadStages ? 0 : stage + 1;
  }
}

// This lane's 16-byte pieces of unit `w` (as copy_unit copies them), straight into registers: zeros for lanes past
// head_dim, heads from `last` on and steps without a head.
template <typename T, int kLanes>
__device__ __forceinline__ void load_unit(uint4 (&pieces)[kHeadSteps], const KvWrite& kv, const T* projections,
                                          int64_t ld, const HeadsUnit& w, int group, int e0) {
  constexpr int kGroups = 32 / kLanes;
  const T* src = projections + w.token * ld + static_cast<int64_t>(w.segment) * kv.heads * kv.head_dim + e0;
#pragma unroll
  for (int step = 0; step < kHeadSteps; ++step) {
    const int head = w.first + step * kGroups + group;
    pieces[step] = make_uint4(0, 0, 0, 0);
    if (head < w.last && e0 < kv.head_dim) pieces[step] = *reinterpret_cast<const uint4*>(src + head * kv.head_dim);
  }
}

// Dynamic shared memory of a kv_write_heads_unit_kernel CTA: a RoPE scratch row of 32 lanes x 8 floats per warp.
constexpr int unit_smem_bytes() { return kHeadWarps * 32 * kHeadLaneElems * 4; }

// The heads kernel with a warp of its own for every unit (the binding takes it while the units fit the GPU at once:
// small T): the units and values of kv_write_heads_kernel without its ring, so that the one unit's chain is short.
// A warp loads its unit's projections straight into registers (16 bytes per lane and step) right after the
// dependency wait, then the token's indices and, for K, the layer's norm weight together (the weight does not wait
// for the slot), then the cos/sin row of the token's position; V units are stored as they are. Shared memory: the
// RoPE scratch rows only (unit_smem_bytes).
template <typename T, int kLanes>
__global__ void __launch_bounds__(32 * kHeadWarps, 3)
    kv_write_heads_unit_kernel(const __grid_constant__ KvWrite kv, const T* projections, int64_t ld, int tokens,
                               int layers, int per_unit) {
  constexpr int V = kHeadLaneElems, kGroups = 32 / kLanes;
  pdl_wait();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int segments = 2 * layers, groups = (kv.heads + per_unit - 1) / per_unit;
  const int u = static_cast<int>(blockIdx.x) * kHeadWarps + warp;
  if (u >= tokens * segments * groups) return;  // the same in every lane; the kernel has no CTA barrier
  const int sub = lane % kLanes, group = lane / kLanes;  // this lane's place in its head, and the head's
  const int e0 = sub * V;
  const HeadsUnit w = UnitCursor(u, segments, groups).unit(per_unit, kv.heads);
  const int layer = w.segment >> 1, kind = w.segment & 1;
  uint4 pieces[kHeadSteps];
  load_unit<T, kLanes>(pieces, kv, projections, ld, w, group, e0);
  float g[V];
  if (kind == 0) {
    load_weight<T, V>(kv.has_norm ? kv.norm_weight[layer] : nullptr, kv.norm_fp32[layer], e0, kv.head_dim, g);
  }
  int64_t slot, pos;
  if (!token_target(kv, w.token, slot, pos)) return;
  T* row = static_cast<T*>(kv.cache[kind][layer]) + slot * kv.slot_stride[kind][layer];
  const int64_t head_stride = kv.head_stride[kind][layer];
  if (kind == 1) {  // V: the projections as they are (already rounded once)
#pragma unroll
    for (int step = 0; step < kHeadSteps; ++step) {
      const int head = w.first + step * kGroups + group;
      if (head < w.last && e0 < kv.head_dim) *reinterpret_cast<uint4*>(row + head * head_stride + e0) = pieces[step];
    }
    return;
  }
  float c[V], sn[V];
  const float* table = kv.has_rope ? kv.cos_sin[layer] : nullptr;
  const float* factors = !kv.has_rope || kv.table_form == kFrequencies ? table : table + pos * kv.table_stride[layer];
  load_rope<V>(kv, kv.table_form, factors, static_cast<float>(pos), kv.has_rope ? e0 : 1 << 30, c, sn);
  float* scratch = reinterpret_cast<float*>(cta_smem()) + (warp * 32 + group * kLanes) * V;
#pragma unroll
  for (int step = 0; step < kHeadSteps; ++step) {
    if (w.first + step * kGroups >= w.last) break;  // the same in every lane
    const int head = w.first + step * kGroups + group;
    const uint32_t words[V / 2] = {pieces[step].x, pieces[step].y, pieces[step].z, pieces[step].w};
    float v[V];
    unpack_words<T, V>(words, v);
    emit_head<T, V, kLanes>(kv, true, kv.eps[layer], g, c, sn, v, scratch, row + head * head_stride, sub,
                            head < w.last);
  }
}

}  // namespace mlinear
}  // namespace dspark
