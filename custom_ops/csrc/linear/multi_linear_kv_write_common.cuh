// The GEMM path's warp-per-unit heads kernel of dspark::multi_linear_kv_write (kv_write_heads_unit_kernel of
// linear/multi_linear_kv_write_kernels.cuh) compiled for one form of the write, the form of every draft of
// benchmarks/dspark_write.py; the binding launches it wherever a call has that form (common_form_fits):
//   * RoPE over the whole head (rotary_dim == head_dim == 8 kLanes: 64, 128 or 256), neox style, from a halves
//     table ([P, head_dim] fp32 rows, cos then sin);
//   * every layer with an RMSNorm weight of the element type;
//   * table rows and norm weights 16-byte aligned.
// The same units, loads and values, bit for bit (tests/test_multi_linear_kv_write_emulation.py); what goes is the
// general kernel's run-time choice between the table forms, RoPE styles, partial rotary, lanes past head_dim and
// fp32 weights, whose code is unrolled for every step of a unit: 1208 SASS instructions against 3656 for 128-wide
// heads (nvcc 13.0, sm_90a), and no shared memory. At small T the heads kernel is one warp's chain of instructions,
// so the shorter chain is faster: H100, each after a GEMM-like kernel in a CUDA graph (benchmarks/heads_tune.cu),
// Qwen3-8B draft at T = 17 / 64 / 200: 2.25 / 2.49 / 4.17 us against 2.58 / 2.92 / 4.64 for the general unit kernel.
#pragma once

#include "linear/multi_linear_kv_write_kernels.cuh"

namespace dspark {
namespace mlinear {

// Whether `kv` (layers [0, layers)) has the one form kv_write_heads_common_kernel<T, kLanes> is compiled for.
template <typename T, int kLanes>
bool common_form_fits(const KvWrite& kv, int layers) {
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  if (!kv.has_rope || !kv.has_norm || !kv.neox || kv.table_form != kHalves) return false;
  if (kv.head_dim != 8 * kLanes || kv.rotary_dim != kv.head_dim) return false;
  for (int i = 0; i < layers; ++i) {
    if (kv.norm_weight[i] == nullptr || kv.norm_fp32[i] || !aligned(kv.norm_weight[i])) return false;
    if (!aligned(kv.cos_sin[i]) || kv.table_stride[i] % 4 != 0) return false;
  }
  return true;
}

template <typename T, int kLanes>
__global__ void __launch_bounds__(32 * kHeadWarps, 3)
    kv_write_heads_common_kernel(const __grid_constant__ KvWrite kv, const T* projections, int64_t ld, int tokens,
                                 int layers, int per_unit) {
  constexpr int V = kHeadLaneElems, kGroups = 32 / kLanes, kHeadDim = V * kLanes, kHalf = kHeadDim / 2;
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
  if (kind == 0) {
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
  // The factors of this lane's elements: pair e mod R/2, 8 consecutive floats of each half of the position's row.
  const bool first_half = e0 < kHalf;
  const float* cos_row = kv.cos_sin[layer] + pos * kv.table_stride[layer] + (first_half ? e0 : e0 - kHalf);
  float c[V], s[V];
  unpack_floats(*reinterpret_cast<const uint4*>(cos_row), c);
  unpack_floats(*reinterpret_cast<const uint4*>(cos_row + 4), c + 4);
  unpack_floats(*reinterpret_cast<const uint4*>(cos_row + kHalf), s);
  unpack_floats(*reinterpret_cast<const uint4*>(cos_row + kHalf + 4), s + 4);
  const float eps = kv.eps[layer];
#pragma unroll
  for (int step = 0; step < kHeadSteps; ++step) {
    if (w.first + step * kGroups >= w.last) break;  // the same in every lane
    const int head = w.first + step * kGroups + group;
    const uint32_t words[V / 2] = {pieces[step].x, pieces[step].y, pieces[step].z, pieces[step].w};
    float v[V];
    unpack_words<T, V>(words, v);
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) ss += v[i] * v[i];
    const float scale = rsqrtf(group_sum<kLanes>(ss) / static_cast<float>(kHeadDim) + eps);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] *= scale * g[i];
    // neox: the partner of element e is e +- R/2, the same element of the lane R/2 / V = kLanes / 2 away
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, v[i], kLanes / 2, kLanes);
      v[i] = first_half ? v[i] * c[i] - other * s[i] : v[i] * c[i] + other * s[i];
    }
    if (head < w.last) store_row<T, V>(row + head * head_stride + e0, v);
  }
}

}  // namespace mlinear
}  // namespace dspark
