// The GEMM path's warp-per-unit heads kernel of dspark::multi_linear_kv_write (kv_write_heads_unit_kernel of
// linear/multi_linear_kv_write_kernels.cuh) compiled for the forms in which drafts are written; the binding launches
// it wherever a call has one of them (common_form):
//   * RoPE over the whole head (rotary_dim == head_dim == 8 kLanes: 64, 128 or 256), from
//     - a halves table ([P, head_dim] fp32 rows, cos then sin), neox style (sglang's and this repository's drafts),
//     - inverse frequencies ([head_dim / 2] fp32, the angle position x frequency), neox style (HF transformers),
//     - a pairs table ([P, head_dim / 2, 2] fp32, a complex table's real view), GPT-J style (DeepSeek's reference),
//     - a halves table, GPT-J style;
//   * every layer with an RMSNorm weight of the element type, or no norm (Llama-style drafts: no k_norm);
//   * tables and norm weights 16-byte aligned (table rows too).
// The same units, loads and values, bit for bit (tests/test_multi_linear_kv_write_emulation.py); what goes is the
// general kernel's run-time choice between the table forms, RoPE styles, partial rotary, lanes past head_dim and
// fp32 weights, whose code is unrolled for every step of a unit (for 128-wide heads and the neox halves form, 1208
// SASS instructions against 3656, nvcc 13.0, sm_90a), and its shared memory. At small T the heads kernel is one
// warp's chain of instructions, so the shorter chain is faster: H100, each after a GEMM-like kernel in a CUDA graph
// (benchmarks/heads_tune.cu), Qwen3-8B draft, neox halves, at T = 17 / 64 / 200: 2.25 / 2.49 / 4.17 us against
// 2.58 / 2.92 / 4.64 for the general unit kernel.
#pragma once

#include "linear/multi_linear_kv_write_kernels.cuh"

namespace dspark {
namespace mlinear {

// The forms kv_write_heads_common_kernel is compiled for (table form and RoPE style; RoPE over the whole head).
constexpr int kNeoxHalves = 0;
constexpr int kNeoxFrequencies = 1;
constexpr int kGptjPairs = 2;
constexpr int kGptjHalves = 3;

// The form of kv_write_heads_common_kernel<T, kLanes, form, kv.has_norm> that `kv` (layers [0, layers)) has, or -1.
template <typename T, int kLanes>
int common_form(const KvWrite& kv, int layers) {
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  if (!kv.has_rope || kv.head_dim != 8 * kLanes || kv.rotary_dim != kv.head_dim) return -1;
  const int form = kv.table_form == kFrequencies ? (kv.neox ? kNeoxFrequencies : -1)
                   : kv.table_form == kPairs     ? (kv.neox ? -1 : kGptjPairs)
                                                 : (kv.neox ? kNeoxHalves : kGptjHalves);
  for (int i = 0; i < layers && form >= 0; ++i) {
    if (kv.has_norm && (kv.norm_weight[i] == nullptr || kv.norm_fp32[i] || !aligned(kv.norm_weight[i]))) return -1;
    if (!aligned(kv.cos_sin[i]) || (kv.table_form != kFrequencies && kv.table_stride[i] % 4 != 0)) return -1;
  }
  return form;
}

// kNorm: the call has the norm (kv.has_norm); without it K is only rotated.
template <typename T, int kLanes, int kForm, bool kNorm = true>
__global__ void __launch_bounds__(32 * kHeadWarps, 3)
    kv_write_heads_common_kernel(const __grid_constant__ KvWrite kv, const T* projections, int64_t ld, int tokens,
                                 int layers, int per_unit) {
  constexpr int V = kHeadLaneElems, kGroups = 32 / kLanes, kHeadDim = V * kLanes, kHalf = kHeadDim / 2;
  constexpr bool kNeox = kForm == kNeoxHalves || kForm == kNeoxFrequencies;
  pdl_wait();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int segments = 2 * layers, groups = (kv.heads + per_unit - 1) / per_unit;
  const int u = static_cast<int>(blockIdx.x) * kHeadWarps + warp;
  if (u >= tokens * segments * groups) return;  // the same in every lane; the kernel has no CTA barrier
  const int sub = lane % kLanes, group = lane / kLanes;
  const int e0 = sub * V;
  const HeadsUnit w = UnitCursor(u, segments, groups).unit(per_unit, kv.heads);
  const int layer = w.segment >> 1, kind = w.segment & 1;
  uint4 pieces[kHeadSteps];
  load_unit<T, kLanes>(pieces, kv, projections, ld, w, group, e0);
  float g[V];
  if (kNorm && kind == 0) {
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(kv.norm_weight[layer]) + e0);
    const uint32_t words[V / 2] = {raw.x, raw.y, raw.z, raw.w};
    unpack_words<T, V>(words, g);
  }
  int64_t slot, pos;
  if (!token_target(kv, w.token, slot, pos)) return;
  T* row = static_cast<T*>(kv.cache[kind][layer]) + slot * kv.slot_stride[kind][layer];
  const int64_t head_stride = kv.head_stride[kind][layer];
  if (kind == 1) {  // V: the projections as they are
#pragma unroll
    for (int step = 0; step < kHeadSteps; ++step) {
      const int head = w.first + step * kGroups + group;
      if (head < w.last) *reinterpret_cast<uint4*>(row + head * head_stride + e0) = pieces[step];
    }
    return;
  }
  // The factors of this lane's elements e0 .. e0 + V - 1. neox: pair e mod R/2, so V consecutive pairs of one half
  // (R/2 is a multiple of V); GPT-J: pair e / 2, so V / 2 consecutive pairs (c[i], s[i] those of elements i, i + 1).
  const bool first_half = e0 < kHalf;
  const float* table = kv.cos_sin[layer];
  float c[V], s[V];
  if constexpr (kForm == kNeoxHalves) {
    const float* cos_row = table + pos * kv.table_stride[layer] + (first_half ? e0 : e0 - kHalf);
    unpack_floats(*reinterpret_cast<const uint4*>(cos_row), c);
    unpack_floats(*reinterpret_cast<const uint4*>(cos_row + 4), c + 4);
    unpack_floats(*reinterpret_cast<const uint4*>(cos_row + kHalf), s);
    unpack_floats(*reinterpret_cast<const uint4*>(cos_row + kHalf + 4), s + 4);
  } else if constexpr (kForm == kNeoxFrequencies) {
    const float* frequencies = table + (first_half ? e0 : e0 - kHalf);
    float f[V];
    unpack_floats(*reinterpret_cast<const uint4*>(frequencies), f);
    unpack_floats(*reinterpret_cast<const uint4*>(frequencies + 4), f + 4);
    const float angle_of = static_cast<float>(pos);  // the fp32 product, as positions.float() * inv_freq
#pragma unroll
    for (int i = 0; i < V; ++i) sincosf(angle_of * f[i], &s[i], &c[i]);
  } else if constexpr (kForm == kGptjPairs) {
    const float* pairs = table + pos * kv.table_stride[layer] + e0;  // (cos, sin) of pairs e0 / 2 .. e0 / 2 + 3
    float r[V];
    unpack_floats(*reinterpret_cast<const uint4*>(pairs), r);
    unpack_floats(*reinterpret_cast<const uint4*>(pairs + 4), r + 4);
#pragma unroll
    for (int i = 0; i < V; i += 2) c[i] = c[i + 1] = r[i], s[i] = s[i + 1] = r[i + 1];
  } else {
    const float* cos_row = table + pos * kv.table_stride[layer] + e0 / 2;
    float cq[V / 2], sq[V / 2];
    unpack_floats(*reinterpret_cast<const uint4*>(cos_row), cq);
    unpack_floats(*reinterpret_cast<const uint4*>(cos_row + kHalf), sq);
#pragma unroll
    for (int i = 0; i < V; i += 2) c[i] = c[i + 1] = cq[i / 2], s[i] = s[i + 1] = sq[i / 2];
  }
  const float eps = kv.eps[layer];
#pragma unroll
  for (int step = 0; step < kHeadSteps; ++step) {
    if (w.first + step * kGroups >= w.last) break;  // the same in every lane
    const int head = w.first + step * kGroups + group;
    const uint32_t words[V / 2] = {pieces[step].x, pieces[step].y, pieces[step].z, pieces[step].w};
    float v[V];
    unpack_words<T, V>(words, v);
    if constexpr (kNorm) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < V; ++i) ss += v[i] * v[i];
      const float scale = rsqrtf(group_sum<kLanes>(ss) / static_cast<float>(kHeadDim) + eps);
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] *= scale * g[i];
    }
    if constexpr (kNeox) {  // the partner of element e is e +- R/2: the same element of the lane kLanes / 2 away
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float other = __shfl_xor_sync(0xffffffffu, v[i], kLanes / 2, kLanes);
        v[i] = first_half ? v[i] * c[i] - other * s[i] : v[i] * c[i] + other * s[i];
      }
    } else {  // GPT-J: the partner of element 2j is 2j + 1, in the same lane
#pragma unroll
      for (int i = 0; i < V; i += 2) {
        const float a = v[i], b = v[i + 1];
        v[i] = a * c[i] - b * s[i];
        v[i + 1] = b * c[i] + a * s[i];
      }
    }
    if (head < w.last) store_row<T, V>(row + head * head_stride + e0, v);
  }
}

}  // namespace mlinear
}  // namespace dspark
