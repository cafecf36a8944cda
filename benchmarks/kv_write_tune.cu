// The fused write of dspark::multi_linear_kv_write as a standalone CUDA program (no torch): the op's fused kernel
// (linear/multi_linear_kv_write_fused.cuh: weights loaded into MMA fragments, no shared-memory ring) in the op's and
// other configurations (k-warps, columns per lane, chunks in flight, clusters of 1, 2 and 4: BENCHMARKS.md, "The
// fused kernel loads into registers"), the previous fused tile (multi_linear_kernel with KvWriteEpilogue, cp.async
// per lane; also in clusters of 2 and 4) and leaner tiles of it (1 or 2 k-warps, 4 or 8 stages, clusters of 1..8:
// "Lean fused tiles in clusters"), the experimental wide tile (wgmma, 64 tokens per tile; in the op until it measured
// slower than the op's paths, experimental/kv_write_wide_kernel.cuh) and the
// experimental wide tile with a producer warp and tensor-map copies (experimental/kv_write_wide_tma_kernel.cuh) and
// that tile spread over every SM by stream-K (experimental/kv_write_streamk_kernel.cuh), on
// the draft configs of benchmarks/dspark_write.py; and reads of the same weights that separate the memory pattern
// from the math.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icustom_ops/csrc \
//        benchmarks/kv_write_tune.cu -o kv_write_tune && ./kv_write_tune [regs | forms | wide | small | profile [config [T [all]]]]
//
// (from the repository root; `bash scripts/gpu_check.sh tune` with TUNE=kv_write does this, TUNE_ARGS=regs for
// `regs`). Per config and T in {1, 8, 16, 32, 64}: every candidate's caches are checked three times against
// candidate 0's, the previous fused tile up to 16 tokens and the cp.async wide tile above (max |difference| of the
// written rows within 2 % of the largest value, every other cache element bit-identical: "WRONG" otherwise), then
// timed two ways, median of 7 runs each:
//   warm  back-to-back launches (programmatic dependent launch on, as the op launches) over weight copies that add
//         up to 3x the L2: the per-call cost inside a longer stream of work, e.g. a draft step's CUDA graph;
//   cold  one launch after an L2 flush, events around it: what a benchmark replaying the write alone sees, launch
//         latency included.
// Reads measured in the same run, against the copy rate (device-to-device copy, read + write): 16-byte loads over
// the whole grid; bulk copies of 16 KB by 80 / 132 / 160 / 264 CTAs; 1-D bulk copies of 512 B / 1 KB / 4 KB by 80
// and 132 CTAs; 2-D tensor-map boxes of 16 / 64 / 128 rows x 128 B.
// `regs`: the fused kernel's configurations against the previous tile (T <= 16) or the cp.async wide tile (T = 32 and
// 64: 4 and 8 token tiles), and the 16-byte-load read (warm and cold). `forms`: the op's fused kernel at 1, 8 and 16
// tokens with the K/V weights in one slab, inside q/k/v weights or each in its own allocation, and its epilogue
// reading a halves or pairs table or inverse frequencies, or no RoPE, with or without a norm (`measure_forms`). `wide`:
// 32 and 64 tokens only, no reads (the wide tiles against each other); `small`: the reads and 1, 8 and 16 tokens. `profile`: one config
// (default qwen3-8b) at one T (default 8), the previous fused tile and, with `all`, every candidate, one check and
// three launches each, no timing: for ncu or compute-sanitizer.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bulk_read.cuh"
#include "experimental/kv_write_wide_kernel.cuh"
#include "experimental/kv_write_streamk_kernel.cuh"
#include "linear/multi_linear_kv_write_fused.cuh"
#include "tune_common.cuh"

using namespace dspark;
using namespace dspark::mlinear;
using tune::launch;
using tune::cold_us;
using tune::warm_us;
using T = __nv_bfloat16;


__global__ void table_kernel(float* t, int rows, int rot) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * rot) return;
  const int r = i / rot, c = i % rot, half = rot / 2, j = c % half;
  const float angle = r * powf(10000.f, -2.f * j / rot);
  t[i] = c < half ? cosf(angle) : sinf(angle);
}

// Reads through the copy engine in 1-D bulk copies: bulk_read_kernel (bulk_read.cuh). Pure read through the
// copy engine in 2-D boxes: below.
constexpr int kReadStages = 8;

// Pure read through the copy engine with a 2-D tensor map over the weights [rows, k] (box kBoxRows x 64 columns,
// 128-byte swizzle, 8 stages): CTA b reads rows [b rows_per_cta, (b + 1) rows_per_cta), all columns.
template <int kBoxRows>
__global__ void tensor_read_kernel(const __grid_constant__ CUtensorMap map, int rows_per_cta, int k, uint32_t* sink) {
  extern __shared__ __align__(1024) float4 dynamic_smem[];
  char* ring = reinterpret_cast<char*>(dynamic_smem);
  constexpr int kBox = kBoxRows * 128;
  __shared__ uint64_t full[kReadStages];
  const int row_blocks = rows_per_cta / kBoxRows, col_blocks = k / 64;
  const int64_t steps = int64_t(row_blocks) * col_blocks;
  if (threadIdx.x == 0) {
    for (int d = 0; d < kReadStages; ++d) mbar_init(full + d, 1);
    mbar_init_fence();
  }
  __syncwarp();
  auto issue = [&](int64_t s) {
    uint64_t* bar = full + s % kReadStages;
    const int c0 = int(s % col_blocks) * 64, r0 = int(blockIdx.x) * rows_per_cta + int(s / col_blocks) * kBoxRows;
    mbar_arrive_expect_tx(bar, kBox);
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            static_cast<uint32_t>(__cvta_generic_to_shared(ring + (s % kReadStages) * kBox))),
        "l"(&map), "r"(c0), "r"(r0), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
        : "memory");
  };
  uint32_t acc = 0;
  if (threadIdx.x == 0) {
    for (int64_t s = 0; s < steps && s < kReadStages; ++s) issue(s);
  }
  for (int64_t s = 0; s < steps; ++s) {
    mbar_wait(full + s % kReadStages, (s / kReadStages) & 1);
    acc ^= reinterpret_cast<const uint32_t*>(ring + (s % kReadStages) * kBox)[threadIdx.x];
    __syncwarp();
    if (threadIdx.x == 0 && s + kReadStages < steps) issue(s + kReadStages);
  }
  if (acc == 0x12345678u) *sink = acc;
}

// The tensor map of a [rows, k] bf16 matrix whose rows are `row_stride` elements apart, in boxes of 64 columns x
// `box_rows` rows in the 128-byte swizzle (rows and columns past the matrix read as zeros).
CUtensorMap tensor_map_2d(const void* base, int64_t rows, int k, int64_t row_stride, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_stride) * sizeof(T)};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess) std::exit(1);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                            unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(1);
  }
  return map;
}

CUtensorMap weight_map(const T* w, int64_t rows, int k, int box_rows) { return tensor_map_2d(w, rows, k, k, box_rows); }

struct DraftConfig {
  const char* name;
  int hidden, heads, head_dim;
};

// One candidate: a name and how to launch it with the arguments of a weight copy.
struct Candidate {
  std::string name;
  std::function<void(const KvWriteArgs&)> run;
};

// A candidate that is one launch of `fn` with the op's arguments.
Candidate plain_candidate(std::string name, void (*fn)(KvWriteArgs), int64_t blocks, int threads, int smem,
                          int split) {
  return {std::move(name), [=](const KvWriteArgs& a) { launch(fn, a, blocks, threads, smem, split); }};
}

// The op's fused tile before the register-streaming kernel: multi_linear_kernel with KvWriteEpilogue, one head of
// V row warps of 2 m-tiles, 4 k-warps, 4 stages of cp.async copies, in clusters of `split`.
template <int V>
constexpr Variant kTileVariant{2, V, 4, 4};

template <int V, int NT>
Candidate op_candidate(int64_t heads, int split) {
  constexpr Variant v = kTileVariant<V>;
  const int smem = smem_bytes(v, NT) + KvWriteEpilogue<V>::extra_bytes(8 * NT);
  char name[96];
  std::snprintf(name, sizeof(name), "previous fused tile (%d KB) split %d", smem / 1024, split);
  return plain_candidate(name, &multi_linear_kernel<T, v.m_tiles, NT, v.row_warps, v.k_warps, v.stages,
                                                    KvWriteEpilogue<V>>,
                         heads * split, cta_threads(v), smem, split);
}

// A leaner fused tile: the op's tile of one head with WK k-warps (of V row warps) and D stages, in clusters of
// `split`: smaller CTAs, several per SM, so that a split grid covers every SM in one wave.
template <int V, int NT, int WK, int D>
Candidate lean_candidate(int64_t heads, int split) {
  constexpr Variant v{2, V, WK, D};
  const int smem = smem_bytes(v, NT) + KvWriteEpilogue<V>::extra_bytes(8 * NT);
  char name[96];
  std::snprintf(name, sizeof(name), "lean tile %dx%d warps, %d stages (%d KB) split %d", V, WK, D, smem / 1024, split);
  return plain_candidate(name, &multi_linear_kernel<T, v.m_tiles, NT, v.row_warps, v.k_warps, v.stages,
                                                    KvWriteEpilogue<V>>,
                         heads * split, cta_threads(v), smem, split);
}

template <int V, int NT>
void lean_candidates(std::vector<Candidate>& out, int64_t heads) {
  for (int split : {1, 2, 4, 8}) {
    out.push_back(lean_candidate<V, NT, 1, 4>(heads, split));
    out.push_back(lean_candidate<V, NT, 1, 8>(heads, split));
    out.push_back(lean_candidate<V, NT, 2, 4>(heads, split));
    out.push_back(lean_candidate<V, NT, 2, 8>(heads, split));
  }
}

// The wide tile with cp.async copies (experimental/kv_write_wide_kernel.cuh), one CTA per head.
template <int V>
Candidate wide_candidate(int64_t heads) {
  constexpr int kRows = 32 * V;
  const int smem = wide_smem_bytes(kRows, KvWriteEpilogue<V>::extra_bytes(kWideTokens));
  char name[96];
  std::snprintf(name, sizeof(name), "wide tile, cp.async (%d KB)", smem / 1024);
  return plain_candidate(name, &wide_head_kernel<T, kRows, KvWriteEpilogue<V>>, heads, kWideThreads, smem, 1);
}

// The experimental wide tile with a producer warp and tensor-map copies, D stages.
template <int V, int D>
Candidate wide_tma_candidate(int64_t heads) {
  constexpr int kRows = 32 * V;
  using Epilogue = KvWriteEpilogue<V>;
  const int smem = wide_tma_smem_bytes(kRows, D, Epilogue::extra_bytes(kWideTokens));
  char name[96];
  std::snprintf(name, sizeof(name), "wide tile, tensor maps, %d stages (%d KB)", D, smem / 1024);
  return {name, [=](const KvWriteArgs& a) {
            WideTmaArgs<Epilogue> t{};
            t.base = a;
            const Params& p = a.gemm;
            t.x_map = tensor_map_2d(p.x, p.tokens, p.k, p.x_stride, kWideTokens);
            for (int s = 0; s < p.num_segments; ++s) {
              const int64_t rows = p.segment_end[s] - (s == 0 ? 0 : p.segment_end[s - 1]);
              t.w_map[s] = tensor_map_2d(p.weight[s], rows, p.k, p.weight_stride[s], kRows);
            }
            launch(&wide_tma_kernel<T, kRows, D, Epilogue>, t, heads, kTmaThreads, smem, 1);
          }};
}

// The tensor-map tile spread over `grid` CTAs by stream-K (experimental/kv_write_streamk_kernel.cuh), D stages.
template <int V, int D>
Candidate streamk_candidate(int64_t heads, int grid) {
  constexpr int kRows = 32 * V;
  using Epilogue = KvWriteEpilogue<V>;
  const int smem = streamk_smem_bytes(kRows, D, Epilogue::extra_bytes(kWideTokens));
  float* partials;
  int* arrivals;
  CHECK(cudaMalloc(&partials, size_t(grid) * 2 * kTmaConsumerThreads * kRows / 2 * sizeof(float)));
  CHECK(cudaMalloc(&arrivals, heads * sizeof(int)));
  CHECK(cudaMemset(arrivals, 0, heads * sizeof(int)));  // each launch leaves them zero
  char name[96];
  std::snprintf(name, sizeof(name), "stream-K tile, %d CTAs, %d stages (%d KB)", grid, D, smem / 1024);
  return {name, [=](const KvWriteArgs& a) {
            StreamKArgs<Epilogue> s{};
            s.tma.base = a;
            const Params& p = a.gemm;
            s.tma.x_map = tensor_map_2d(p.x, p.tokens, p.k, p.x_stride, kWideTokens);
            for (int g = 0; g < p.num_segments; ++g) {
              const int64_t rows = p.segment_end[g] - (g == 0 ? 0 : p.segment_end[g - 1]);
              s.tma.w_map[g] = tensor_map_2d(p.weight[g], rows, p.k, p.weight_stride[g], kRows);
            }
            s.partials = partials;
            s.arrivals = arrivals;
            launch(&streamk_kernel<T, kRows, D, Epilogue>, s, grid, kTmaThreads, smem, 1);
          }};
}

// Up to 64 tokens: the cp.async wide tile (the reference above 16 tokens), the tensor-map one and its stream-K form.
template <int V>
void wide_candidates(std::vector<Candidate>& out, int64_t heads, int sms) {
  out.push_back(wide_candidate<V>(heads));
  out.push_back(wide_tma_candidate<V, 4>(heads));
  if constexpr (V == 4) {
    out.push_back(wide_tma_candidate<V, 6>(heads));
    out.push_back(wide_tma_candidate<V, 7>(heads));
    // one CTA per SM (up to 211 KB): as many CTAs as heads, then more up to the SM count
    out.push_back(streamk_candidate<V, 4>(heads, int(heads)));
    out.push_back(streamk_candidate<V, 4>(heads, int(heads + sms) / 2));
    out.push_back(streamk_candidate<V, 4>(heads, sms));
    out.push_back(streamk_candidate<V, 6>(heads, sms));
  } else {
    out.push_back(wide_tma_candidate<V, 5>(heads));
    out.push_back(streamk_candidate<V, 4>(heads, sms));      // 101 KB: two CTAs per SM fit
    out.push_back(streamk_candidate<V, 4>(heads, 2 * sms));
    out.push_back(streamk_candidate<V, 8>(heads, sms));
  }
}

// The op's register-streaming fused kernel (linear/multi_linear_kv_write_fused.cuh) with WK k-warps, E columns per
// lane and chunk, D chunks in flight, in clusters of 1, 2 and 4 (the op: kFusedKWarps, kFusedCols, kFusedDepth,
// split 1).
template <int V, int NT, int WK, int E, int D>
void regs_candidate(std::vector<Candidate>& out, int64_t heads) {
  constexpr int threads = fused_threads<V, WK>(), smem = fused_smem_bytes<V, NT>();
  const bool op = WK == kFusedKWarps && E == kFusedCols && D == kFusedDepth;
  for (int split : {1, 2, 4}) {
    char name[96];
    std::snprintf(name, sizeof(name), "%s%d k-warps, %2d cols/lane, %d deep, split %d", op && split == 1 ? "op: " : "",
                  WK, E, D, split);
    out.push_back(
        plain_candidate(name, &kv_write_fused_kernel<T, V, NT, WK, E, D>, heads * split, threads, smem, split));
  }
}

// The fused kernel's configurations measured: up to 16 tokens 1 or 2 k-warps, 8 to 32 columns per lane, 1 to 4
// deep; with 4 or 8 token tiles (32 and 64 tokens) those that hold their accumulators and loads without spilling.
template <int V, int NT>
void regs_candidates(std::vector<Candidate>& out, int64_t heads) {
  if constexpr (NT == 4) {
    regs_candidate<V, NT, 1, 8, 2>(out, heads);
    regs_candidate<V, NT, 1, 8, 4>(out, heads);
    regs_candidate<V, NT, 2, 8, 2>(out, heads);
  } else if constexpr (NT == 8) {
    regs_candidate<V, NT, 1, 8, 1>(out, heads);
    regs_candidate<V, NT, 1, 8, 2>(out, heads);
    regs_candidate<V, NT, 2, 8, 1>(out, heads);
  } else {
    regs_candidate<V, NT, 1, 8, 4>(out, heads);
    regs_candidate<V, NT, 1, 16, 2>(out, heads);
    regs_candidate<V, NT, 1, 16, 4>(out, heads);
    regs_candidate<V, NT, 1, 32, 2>(out, heads);
    regs_candidate<V, NT, 2, 16, 2>(out, heads);
    regs_candidate<V, NT, 2, 32, 1>(out, heads);
    regs_candidate<V, NT, 2, 8, 4>(out, heads);
    regs_candidate<V, NT, 2, 8, 2>(out, heads);
  }
}

// `forms`: where the K/V weights lie, for the op's fused kernel (its configuration, one CTA per head, as the binding
// launches it): one slab of every layer's K/V rows (the other modes' weights); each layer's K/V rows inside a
// [q + 2 kv, k] q/k/v weight (q = 4 kv), as a qkv_proj holds them; every K and V weight its own allocation (none
// continuing another). The same values in each (copied from the slab). The op's binding merges segments that
// continue one another into one run (collect_runs), and so does `measure_forms`: 1, 5 and 10 runs.
struct Placement {
  const char* name;
  std::vector<std::vector<const T*>> segments;  // per weight copy, per segment (layer s / 2, K or V) its first row
};

std::vector<Placement> placements(const std::vector<T*>& slabs, int layers, int kv, int k, std::vector<void*>& owned) {
  const int64_t segment = int64_t(kv) * k, q = 4 * int64_t(kv), layer_rows = q + 2 * int64_t(kv);
  std::vector<Placement> out{{"one slab", {}}, {"inside q/k/v weights", {}}, {"a weight per segment", {}}};
  for (T* slab : slabs) {
    T* qkv;
    CHECK(cudaMalloc(&qkv, layers * layer_rows * k * sizeof(T)));
    owned.push_back(qkv);
    tune::fill_kernel<<<1024, 256>>>(qkv, layers * layer_rows * k, 5, 0.01f);
    std::vector<const T*> in_slab, in_qkv, apart;
    for (int s = 0; s < 2 * layers; ++s) {
      const T* source = slab + s * segment;
      T* in_layer = qkv + ((s / 2) * layer_rows + q + (s % 2) * kv) * k;
      T* own;  // 1 MB past its rows, so that no two of them continue one another
      CHECK(cudaMalloc(&own, segment * sizeof(T) + (size_t(1) << 20)));
      owned.push_back(own);
      CHECK(cudaMemcpy(in_layer, source, segment * sizeof(T), cudaMemcpyDeviceToDevice));
      CHECK(cudaMemcpy(own, source, segment * sizeof(T), cudaMemcpyDeviceToDevice));
      in_slab.push_back(source);
      in_qkv.push_back(in_layer);
      apart.push_back(own);
    }
    out[0].segments.push_back(in_slab);
    out[1].segments.push_back(in_qkv);
    out[2].segments.push_back(apart);
  }
  return out;
}

// The epilogue's forms: the RoPE factors read from a halves table (sglang's spelling, this repository's), from a
// pairs table (DeepSeek's complex table; GPT-J rotation) or computed from inverse frequencies (HF's spellings), or no
// RoPE; with or without a norm weight (Llama's has none). Each table row is copied by its token's thread before the
// main loop; frequencies are turned into factors there by every thread; without RoPE nothing is staged.
struct EpilogueForm {
  const char* name;
  int table_form;  // kHalves, kPairs, kFrequencies, or -1: no RoPE
  bool norm;
};
constexpr EpilogueForm kEpilogueForms[] = {
    {"halves table, norm", kHalves, true},     {"pairs table, norm", kPairs, true},
    {"frequencies, norm", kFrequencies, true}, {"no RoPE, norm", -1, true},
    {"halves table, no norm", kHalves, false}, {"frequencies, no norm", kFrequencies, false}};

// What `forms` measures of one config at one T: the op's fused kernel with every placement and form, warm and cold;
// each placement's caches checked bit for bit against the slab's of the same form.
template <int V, int NT>
void measure_forms(const std::vector<Placement>& places, const std::function<KvWriteArgs(int)>& args_for,
                   const float* inv_freq, int64_t heads, int copies, void* caches, size_t cache_bytes, void* flush,
                   size_t flush_bytes, double floor_us) {
  std::vector<Candidate> op;
  regs_candidate<V, NT, kFusedKWarps, kFusedCols, kFusedDepth>(op, heads);  // op[0]: split 1, as the op launches
  std::vector<uint8_t> want(cache_bytes), got(cache_bytes);
  for (const EpilogueForm& form : kEpilogueForms) {
    for (size_t p = 0; p < places.size(); ++p) {
      auto args = [&](int i) {
        KvWriteArgs a = args_for(i);
        Params& g = a.gemm;
        const int layers = g.num_segments / 2;
        const int64_t segment_rows = g.segment_end[0];  // every segment: one layer's K or V rows
        // the placement's segments, those that continue the one before merged into it (as the binding's
        // collect_runs does: one run for the slab, one per layer inside q/k/v weights)
        int runs = 0;
        for (int s = 0; s < 2 * layers; ++s) {
          const T* first_row = places[p].segments[i][s];
          const int64_t end = int64_t(s + 1) * segment_rows;
          if (runs > 0) {
            const int64_t rows = g.segment_end[runs - 1] - (runs > 1 ? g.segment_end[runs - 2] : 0);
            if (static_cast<const T*>(g.weight[runs - 1]) + rows * g.k == first_row) {
              g.segment_end[runs - 1] = end;
              continue;
            }
          }
          g.weight[runs] = first_row;
          g.weight_stride[runs] = g.k;
          g.segment_end[runs++] = end;
        }
        g.num_segments = runs;
        for (int l = 0; l < layers; ++l) {
          if (form.table_form == kFrequencies) a.kv.cos_sin[l] = inv_freq;
          if (!form.norm) a.kv.norm_weight[l] = nullptr;
        }
        a.kv.table_form = form.table_form < 0 ? kHalves : form.table_form;
        a.kv.neox = form.table_form != kPairs;  // a pairs table: the halves table's values read as pairs
        a.kv.has_rope = form.table_form >= 0;
        a.kv.has_norm = form.norm;
        return a;
      };
      CHECK(cudaMemset(caches, 0xff, cache_bytes));
      op[0].run(args(0));
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(p == 0 ? want.data() : got.data(), caches, cache_bytes, cudaMemcpyDeviceToHost));
      const bool same = p == 0 || std::memcmp(want.data(), got.data(), cache_bytes) == 0;
      auto call = [&](int i) { op[0].run(args(i)); };
      const float warm = warm_us(call, copies, 5), cold = cold_us(call, copies, flush, flush_bytes);
      std::printf("  %-22s %-22s %2d runs  warm %6.1f us (%3.0f%% of copy)  cold %6.1f us  %s\n", form.name,
                  places[p].name, args(0).gemm.num_segments, warm, 100.0 * floor_us / warm, cold,
                  same ? "ok" : "WRONG (not the slab's bits)");
    }
  }
}

// Candidate 0 is the reference the others are checked against: the previous fused tile up to 16 tokens (an
// independent main loop), the cp.async wide tile above.
template <int V>
std::vector<Candidate> candidates(int64_t heads, int tokens, int k, int sms, bool regs_only) {
  std::vector<Candidate> out;
  if (tokens > 16) {
    if (!regs_only) {
      wide_candidates<V>(out, heads, sms);
    } else {
      out.push_back(wide_candidate<V>(heads));
      if (tokens > 32) {
        regs_candidates<V, 8>(out, heads);
      } else {
        regs_candidates<V, 4>(out, heads);
      }
    }
    return out;
  }
  const int nt = token_tiles(tokens);
  const int split = auto_split(kTileVariant<V>, heads * 32 * V, k, sms);
  out.push_back(nt == 1 ? op_candidate<V, 1>(heads, split) : op_candidate<V, 2>(heads, split));
  if (nt == 1) {
    regs_candidates<V, 1>(out, heads);
  } else {
    regs_candidates<V, 2>(out, heads);
  }
  if (regs_only) return out;
  for (int s : {2, 4}) {
    if (s != split) out.push_back(nt == 1 ? op_candidate<V, 1>(heads, s) : op_candidate<V, 2>(heads, s));
  }
  if (nt == 1) {
    lean_candidates<V, 1>(out, heads);
  } else {
    lean_candidates<V, 2>(out, heads);
  }
  wide_candidates<V>(out, heads, sms);
  return out;
}

// What the reads of one config need: the weight copies (each `bytes` of [rows, k] bf16), the floor and the L2 flush
// buffer.
struct ReadSetup {
  const std::vector<T*>& w;
  int64_t bytes;
  int k, head_dim;
  int sms;
  double floor_us;
  void* flush;
  size_t flush_bytes;
  uint32_t* sink;
};

// The reads of the same weights with nothing else: 16-byte loads, 1-D bulk copies by size and CTA count, 2-D boxes.
void measure_reads(const ReadSetup& r) {
  const int copies = static_cast<int>(r.w.size()), k = r.k;
  const float loads = warm_us(
      [&](int i) { tune::read_kernel<<<r.sms * 8, 512>>>((const uint4*)r.w[i], r.bytes / 16, r.sink); }, copies, 5);
  std::printf("read (16-byte loads, %d CTAs): warm %.1f us (%.0f%% of copy)\n", r.sms * 8, loads,
              100.0 * r.floor_us / loads);
  auto report = [&](const char* what, auto&& call) {
    const float us = warm_us(call, copies, 5);
    std::printf("read (%s): warm %.1f us (%.0f%%), cold %.1f us\n", what, us, 100.0 * r.floor_us / us,
                cold_us(call, copies, r.flush, r.flush_bytes));
  };
  char what[96];
  uint32_t* sums;  // the bulk reads' per-lane sums
  CHECK(cudaMalloc(&sums, 32 * 2 * r.sms * sizeof(uint32_t)));
  auto sized = [&](auto kernel, int bytes_per_copy) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmemBytes));
    for (int ctas : {80, r.sms, 160, 2 * r.sms}) {
      std::snprintf(what, sizeof(what), "1-D copies of %5d B, %3d CTAs", bytes_per_copy, ctas);
      report(what, [&](int i) { kernel<<<ctas, 32, kBulkSmemBytes>>>((const char*)r.w[i], r.bytes, sums); });
    }
  };
  sized(bulk_read_kernel<512>, 512);
  sized(bulk_read_kernel<1024>, 1024);
  sized(bulk_read_kernel<4096>, 4096);
  sized(bulk_read_kernel<16384>, 16384);
  CHECK(cudaFree(sums));
  const int64_t total_rows = r.bytes / 2 / k;
  auto tensor = [&](auto kernel, int box_rows) {
    const int smem = kReadStages * box_rows * 128;
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<CUtensorMap> maps;
    for (int i = 0; i < copies; ++i) maps.push_back(weight_map(r.w[i], total_rows, k, box_rows));
    for (int rows_per_cta : {r.head_dim, r.head_dim == 64 ? 0 : 64}) {  // a head per CTA, then 64 rows
      if (rows_per_cta == 0 || rows_per_cta % box_rows) continue;
      const int ctas = int(total_rows / rows_per_cta);
      std::snprintf(what, sizeof(what), "2-D box %3d x 64, %3d CTAs of %3d rows", box_rows, ctas, rows_per_cta);
      report(what, [&](int i) { kernel<<<ctas, 32, smem>>>(maps[i], rows_per_cta, k, r.sink); });
    }
  };
  tensor(tensor_read_kernel<16>, 16);
  tensor(tensor_read_kernel<64>, 64);
  tensor(tensor_read_kernel<128>, 128);
}

int main(int argc, char** argv) {
  // `profile [config [T]]`: only that config (default qwen3-8b) at that T (default 8), candidate 0 (with `all` as a
  // fourth word every candidate), three launches each, no timing (for ncu or compute-sanitizer)
  const bool profile = argc > 1 && std::strcmp(argv[1], "profile") == 0;
  const char* profile_config = argc > 2 ? argv[2] : "qwen3-8b";
  const int profile_tokens = argc > 3 ? std::atoi(argv[3]) : 8;
  const bool profile_all = argc > 4 && std::strcmp(argv[4], "all") == 0;
  // `regs`: the fused kernel's configurations and their reference tiles only, and the 16-byte-load read
  const bool regs_only = argc > 1 && std::strcmp(argv[1], "regs") == 0;
  // `forms`: the op's fused kernel at 1 / 8 / 16 tokens, its weights placed three ways, its epilogue in six forms
  const bool forms = argc > 1 && std::strcmp(argv[1], "forms") == 0;
  // `wide`: 32 and 64 tokens only (the cp.async wide tile and the tensor-map tiles), no reads
  const bool wide_only = argc > 1 && std::strcmp(argv[1], "wide") == 0;
  // `small`: the reads, then 1, 8 and 16 tokens only (the fused kernel's range)
  const bool small_only = argc > 1 && std::strcmp(argv[1], "small") == 0;
  int sms = 0, l2 = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  const size_t copy_bytes = size_t(2) << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, copy_bytes));
  CHECK(cudaMalloc(&dst, copy_bytes));
  const float copy_time = warm_us([&](int) { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); }, 1, 3);
  const double copy_rate = 2.0 * copy_bytes / (copy_time * 1e-6);
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  const size_t flush_bytes = size_t(4) * l2;
  void* flush;
  CHECK(cudaMalloc(&flush, flush_bytes));
  std::printf("GPU SMs %d, L2 %d MB; copy rate %.2f TB/s (read + write)\n", sms, l2 >> 20, copy_rate / 1e12);
  uint32_t* sink;
  CHECK(cudaMalloc(&sink, 4));

  const int layers = 5, slots = 8192, max_pos = 4096, max_tokens = 64;
  const DraftConfig configs[] = {{"qwen3-8b", 4096, 8, 128}, {"qwen3-4b", 2560, 8, 128}, {"hd64", 7168, 16, 64}};
  for (const DraftConfig& cfg : configs) {
    if (profile && std::strcmp(cfg.name, profile_config) != 0) continue;
    const int kv = cfg.heads * cfg.head_dim, k = cfg.hidden;
    const int64_t heads = int64_t(layers) * 2 * cfg.heads;
    const int64_t layer_bytes = int64_t(2) * kv * k * sizeof(T), bytes = layers * layer_bytes;
    const int copies = (int)std::max<int64_t>(2, 3 * int64_t(l2) / bytes + 1);
    std::vector<T*> w(copies);
    for (int i = 0; i < copies; ++i) {
      CHECK(cudaMalloc(&w[i], bytes));
      tune::fill_kernel<<<1024, 256>>>(w[i], bytes / 2, 100 + i, 2.f / sqrtf((float)k));
    }
    T *x, *norm, *caches;
    float* table;
    int64_t *positions, *loc;
    const int64_t cache_elems = int64_t(slots) * kv;
    CHECK(cudaMalloc(&x, max_tokens * k * sizeof(T)));
    CHECK(cudaMalloc(&norm, layers * cfg.head_dim * sizeof(T)));
    CHECK(cudaMalloc(&caches, 2 * layers * cache_elems * sizeof(T)));
    CHECK(cudaMalloc(&table, max_pos * cfg.head_dim * sizeof(float)));
    CHECK(cudaMalloc(&positions, max_tokens * sizeof(int64_t)));
    CHECK(cudaMalloc(&loc, max_tokens * sizeof(int64_t)));
    tune::fill_kernel<<<256, 256>>>(x, max_tokens * k, 7, 4.f);
    tune::fill_kernel<<<16, 256>>>(norm, layers * cfg.head_dim, 9, 1.f);
    table_kernel<<<(max_pos * cfg.head_dim + 255) / 256, 256>>>(table, max_pos, cfg.head_dim);
    std::vector<int64_t> host_pos(max_tokens), host_loc(max_tokens);
    for (int t = 0; t < max_tokens; ++t) {
      host_pos[t] = (t * 977 + 13) % max_pos;
      host_loc[t] = (t * 2741 + 101) % slots;
    }
    CHECK(cudaMemcpy(positions, host_pos.data(), max_tokens * sizeof(int64_t), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(loc, host_loc.data(), max_tokens * sizeof(int64_t), cudaMemcpyHostToDevice));

    const double floor_us = 1e6 * bytes / copy_rate;
    std::printf("\n## %s: hidden %d, %d kv heads x %d, %d layers: %.1f MB of K/V weights, floor %.1f us; copies %d\n",
                cfg.name, k, cfg.heads, cfg.head_dim, layers, bytes / 1e6, floor_us, copies);
    std::vector<void*> owned;  // `forms`: the placements' buffers
    const std::vector<Placement> places = forms ? placements(w, layers, kv, k, owned) : std::vector<Placement>{};
    float* inv_freq = nullptr;
    if (forms) {
      std::vector<float> host(cfg.head_dim / 2);
      for (int j = 0; j < cfg.head_dim / 2; ++j) host[j] = std::pow(1e6f, -2.f * j / cfg.head_dim);
      CHECK(cudaMalloc(&inv_freq, host.size() * sizeof(float)));
      CHECK(cudaMemcpy(inv_freq, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    if (regs_only) {
      const float loads = warm_us(
          [&](int i) { tune::read_kernel<<<sms * 8, 512>>>((const uint4*)w[i], bytes / 16, sink); }, copies, 5);
      std::printf("read (16-byte loads, %d CTAs): warm %.1f us (%.0f%% of copy), cold %.1f us\n", sms * 8, loads,
                  100.0 * floor_us / loads,
                  cold_us([&](int i) { tune::read_kernel<<<sms * 8, 512>>>((const uint4*)w[i], bytes / 16, sink); },
                          copies, flush, flush_bytes));
    } else if (!profile && !forms && !wide_only) {
      measure_reads({w, bytes, k, cfg.head_dim, sms, floor_us, flush, flush_bytes, sink});
    }
    for (int tokens : {1, 8, 16, 32, 64}) {
      if (profile && tokens != profile_tokens) continue;
      if (forms && tokens > 16) continue;
      if (wide_only && tokens <= 16) continue;
      if (small_only && tokens > 16) continue;
      auto args_for = [&](int i) {
        KvWriteArgs a{};
        Params& p = a.gemm;
        p.x = x;
        p.x_stride = k;
        p.tokens = tokens;
        p.k = k;
        p.num_segments = 2 * layers;
        KvWrite& q = a.kv;
        for (int l = 0; l < layers; ++l) {
          for (int kind = 0; kind < 2; ++kind) {
            const int s = 2 * l + kind;
            p.segment_end[s] = int64_t(s + 1) * kv;
            p.weight[s] = w[i] + (int64_t(l) * 2 + kind) * kv * k;
            p.weight_stride[s] = k;
            q.cache[kind][l] = caches + (int64_t(l) * 2 + kind) * cache_elems;
            q.slot_stride[kind][l] = kv;
            q.head_stride[kind][l] = cfg.head_dim;
          }
          q.norm_weight[l] = norm + l * cfg.head_dim;
          q.eps[l] = 1e-6f;
          q.cos_sin[l] = table;
          q.table_stride[l] = cfg.head_dim;
        }
        q.positions = positions;
        q.positions_stride = 1;
        q.positions_int64 = 1;
        q.loc = loc;
        q.loc_stride1 = 1;
        q.loc_int64 = 1;
        q.width = tokens;
        q.slots = slots;
        q.position_limit = max_pos;
        q.heads = cfg.heads;
        q.head_dim = cfg.head_dim;
        q.rotary_dim = cfg.head_dim;
        q.neox = 1;
        q.has_norm = 1;
        q.has_rope = 1;
        return a;
      };
      if (forms) {
        const size_t cache_bytes = 2 * layers * cache_elems * sizeof(T);
        std::printf("T=%2d\n", tokens);
        auto measure = cfg.head_dim == 64 ? (tokens <= 8 ? &measure_forms<2, 1> : &measure_forms<2, 2>)
                                          : (tokens <= 8 ? &measure_forms<4, 1> : &measure_forms<4, 2>);
        measure(places, args_for, inv_freq, heads, copies, caches, cache_bytes, flush, flush_bytes, floor_us);
        continue;
      }
      const std::vector<Candidate> cands =
          cfg.head_dim == 64 ? candidates<2>(heads, tokens, k, sms, regs_only)
                             : candidates<4>(heads, tokens, k, sms, regs_only);
      const size_t cache_bytes = 2 * layers * cache_elems * sizeof(T);
      std::vector<uint16_t> want(cache_bytes / 2), got(cache_bytes / 2);
      std::printf("T=%2d\n", tokens);
      for (size_t c = 0; c < cands.size(); ++c) {
        const Candidate& cand = cands[c];
        if (profile && !profile_all && c > 0) continue;  // candidate 0: the previous fused tile (or the wide tile)
        double err = 0, ref = 0;
        int64_t written = 0, mismatched = 0;
        // three checks per candidate (a race shows in some); each compares every cache element
        for (int trial = 0; trial < (c == 0 || profile ? 1 : 3); ++trial) {
          CHECK(cudaMemset(caches, 0xff, cache_bytes));
          cand.run(args_for(0));
          CHECK(cudaDeviceSynchronize());
          CHECK(cudaMemcpy(c == 0 ? want.data() : got.data(), caches, cache_bytes, cudaMemcpyDeviceToHost));
          if (c == 0) break;
          written = 0;
          for (size_t e = 0; e < want.size(); ++e) {
            if (want[e] == 0xffff) {
              mismatched += got[e] != 0xffff;
              continue;
            }
            ++written;
            float a, b;
            const uint32_t ua = uint32_t(want[e]) << 16, ub = uint32_t(got[e]) << 16;
            std::memcpy(&a, &ua, 4);
            std::memcpy(&b, &ub, 4);
            err = std::max(err, (double)std::fabs(a - b));
            ref = std::max(ref, (double)std::fabs(a));
          }
        }
        const bool ok = c == 0 || (mismatched == 0 && written == int64_t(2) * layers * tokens * kv && err <= 2e-2 * ref);
        auto call = [&](int i) { cand.run(args_for(i)); };
        if (profile) {
          for (int i = 0; i < 3; ++i) call(i % copies);
          CHECK(cudaDeviceSynchronize());
          std::printf("  %-46s profiled  %s\n", cand.name.c_str(), ok ? "ok" : "WRONG");
          continue;
        }
        const float warm = warm_us(call, copies, 5), cold = cold_us(call, copies, flush, flush_bytes);
        std::printf("  %-46s warm %6.1f us (%3.0f%% of copy)  cold %6.1f us  %s (max err %.2e of %.2e)\n",
                    cand.name.c_str(), warm, 100.0 * floor_us / warm, cold, ok ? "ok" : "WRONG", err, ref);
      }
    }
    for (T* p : w) CHECK(cudaFree(p));
    for (void* p : owned) CHECK(cudaFree(p));
    if (inv_freq != nullptr) CHECK(cudaFree(inv_freq));
    CHECK(cudaFree(x));
    CHECK(cudaFree(norm));
    CHECK(cudaFree(caches));
    CHECK(cudaFree(table));
    CHECK(cudaFree(positions));
    CHECK(cudaFree(loc));
  }
  return 0;
}
