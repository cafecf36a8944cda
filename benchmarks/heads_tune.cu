// The GEMM path's heads kernels of dspark::multi_linear_kv_write as a standalone CUDA program (no torch): the ring
// kernel (kv_write_heads_kernel, persistent warps) against the warp-per-unit kernels, the general one
// (kv_write_heads_unit_kernel) and the one compiled for the call's form (kv_write_heads_common_kernel), all at every
// T (the op takes a warp-per-unit kernel while the units fit the GPU at once), on the draft configs of
// benchmarks/dspark_write.py (the heads kernel sees only the layers, K/V heads and head_dim: the Qwen3-8B and
// Qwen3-4B drafts launch the same grid) with a neox halves table, and on the Qwen3-8B dims with HF's RoPE (inverse
// frequencies) and DeepSeek's (a complex table: GPT-J pairs), and HF's RoPE without a k_norm (Llama-style).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icustom_ops/csrc \
//        benchmarks/heads_tune.cu -o heads_tune && ./heads_tune
//
// (from the repository root; `bash scripts/gpu_check.sh tune` with TUNE=heads does this). Per config and T: every
// kernel writes poisoned caches from the same projections, and every cache byte must agree ("WRONG" otherwise). Then
// each is timed as the op runs it, after a GEMM: a CUDA graph of [a read of 3x the L2 (evicts the indices, tables
// and caches), a kernel writing the projections, the heads kernel launched with programmatic dependent launch],
// replayed 200 times per round in 15 interleaved rounds, against the same graph without the heads kernel; the
// median difference is the heads kernel's cost in µs (launch gap included). The ring kernel runs with its heads per
// unit (heads_per_unit), the general unit kernel with the op's (unit_heads_per_unit), the compiled-form kernel with
// the op's and with half and twice as many. Beyond one wave the warp-per-unit kernels run in several waves (the op
// takes the compiled-form kernel there too, and the ring kernel for forms it has not compiled).
// `heads_tune profile T` instead launches the ring kernel and the compiled-form kernel once each at T tokens on the
// Qwen3-8B dims (after the same L2-evicting read and projection-writing kernel), untimed: a program for ncu.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "linear/multi_linear_kv_write_common.cuh"
#include "linear/multi_linear_kv_write_kernels.cuh"
#include "tune_common.cuh"

using namespace dspark::mlinear;
using T = __nv_bfloat16;

namespace {

struct Config {
  const char* name;
  int layers, heads, head_dim;
  int form = kNeoxHalves;  // the RoPE table's form and style (kNeoxHalves, kNeoxFrequencies or kGptjPairs)
  bool norm = true;        // false: no k_norm (Llama-style drafts)
};

// The RoPE table of `form` for positions [0, rows): halves [rows, rot] (cos then sin), pairs [rows, rot / 2, 2]
// (cos, sin), or the rot / 2 inverse frequencies.
__global__ void table_kernel(float* t, int rows, int rot, int form) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x, half = rot / 2;
  if (form == kNeoxFrequencies) {
    if (i < half) t[i] = powf(1e6f, -2.f * i / rot);
    return;
  }
  if (i >= rows * rot) return;
  const int r = i / rot, c = i % rot, j = form == kGptjPairs ? c / 2 : c % half;
  const float a = r * powf(1e6f, -2.f * j / rot);
  t[i] = (form == kGptjPairs ? c % 2 == 0 : c < half) ? cosf(a) : sinf(a);
}

// Writes the projections as a GEMM would (so that they are in L2 when the heads kernel reads them).
__global__ void projections_kernel(T* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 13;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 4.f);
  }
}

struct Problem {
  Config cfg;
  int tokens, slots = 8192, positions = 4096;
  T* projections;
  std::vector<T*> caches;  // [layer][kind]
  std::vector<T*> weights;
  float* table;
  int64_t* loc;
  int64_t* pos;
  KvWrite kv{};
  int64_t ld;

  Problem(const Config& c, int t) : cfg(c), tokens(t) {
    const int64_t kv_rows = int64_t(c.heads) * c.head_dim;
    ld = 2 * c.layers * kv_rows;
    CHECK(cudaMalloc(&projections, tokens * ld * sizeof(T)));
    CHECK(cudaMalloc(&table, int64_t(positions) * c.head_dim * 4));
    table_kernel<<<(positions * c.head_dim + 255) / 256, 256>>>(table, positions, c.head_dim, c.form);
    std::vector<int64_t> h_loc(tokens), h_pos(tokens);
    for (int i = 0; i < tokens; ++i) {
      h_loc[i] = (int64_t(i) * 2654435761u) % slots;
      h_pos[i] = (int64_t(i) * 40503u + 7) % positions;
    }
    CHECK(cudaMalloc(&loc, tokens * 8));
    CHECK(cudaMalloc(&pos, tokens * 8));
    CHECK(cudaMemcpy(loc, h_loc.data(), tokens * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(pos, h_pos.data(), tokens * 8, cudaMemcpyHostToDevice));
    for (int l = 0; l < c.layers; ++l) {
      for (int kind = 0; kind < 2; ++kind) {
        T* cache;
        CHECK(cudaMalloc(&cache, int64_t(slots) * kv_rows * sizeof(T)));
        caches.push_back(cache);
        kv.cache[kind][l] = cache;
        kv.slot_stride[kind][l] = kv_rows;
        kv.head_stride[kind][l] = c.head_dim;
      }
      T* w;
      CHECK(cudaMalloc(&w, c.head_dim * sizeof(T)));
      tune::fill_kernel<<<1, 128>>>(w, c.head_dim, 77 + l, 2.f);
      weights.push_back(w);
      kv.norm_weight[l] = w;
      kv.norm_fp32[l] = 0;
      kv.eps[l] = 1e-6f;
      kv.cos_sin[l] = table;
      kv.table_stride[l] = c.head_dim;
    }
    kv.table_form = c.form == kNeoxFrequencies ? kFrequencies : c.form == kGptjPairs ? kPairs : kHalves;
    kv.positions = pos;
    kv.positions_stride = 1;
    kv.positions_int64 = 1;
    kv.loc = loc;
    kv.loc_stride0 = 0;
    kv.loc_stride1 = 1;
    kv.loc_int64 = 1;
    kv.width = tokens;
    kv.slots = slots;
    kv.position_limit = positions;
    kv.heads = c.heads;
    kv.head_dim = c.head_dim;
    kv.rotary_dim = c.head_dim;
    kv.neox = c.form == kGptjPairs ? 0 : 1;
    kv.has_norm = c.norm ? 1 : 0;
    kv.has_rope = 1;
    projections_kernel<<<264, 256>>>(projections, tokens * ld, 1234);
    CHECK(cudaDeviceSynchronize());
  }

  void poison() {
    const int64_t bytes = int64_t(slots) * cfg.heads * cfg.head_dim * sizeof(T);
    for (T* c : caches) CHECK(cudaMemset(c, 0x7b, bytes));
  }

  std::vector<uint8_t> read_caches() {
    const int64_t bytes = int64_t(slots) * cfg.heads * cfg.head_dim * sizeof(T);
    std::vector<uint8_t> out(bytes * caches.size());
    for (size_t i = 0; i < caches.size(); ++i) CHECK(cudaMemcpy(out.data() + i * bytes, caches[i], bytes,
                                                                cudaMemcpyDeviceToHost));
    return out;
  }
};

template <int kLanes>
struct Kernels {
  // CTAs per SM of the ring kernel (unit: false) or the unit kernel.
  static int per_sm(bool unit) {
    int n = 0;
    if (unit) {
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, &kv_write_heads_unit_kernel<T, kLanes>,
                                                          32 * kHeadWarps, unit_smem_bytes()));
    } else {
      CHECK(cudaFuncSetAttribute(&kv_write_heads_kernel<T, kLanes>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 heads_smem_bytes()));
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, &kv_write_heads_kernel<T, kLanes>, 32 * kHeadWarps,
                                                          heads_smem_bytes()));
    }
    return n;
  }

  // The compiled-form kernel for the problem's form.
  template <bool kNorm>
  static void (*common_kernel_of(int form))(KvWrite, const T*, int64_t, int, int, int) {
    switch (form) {
      case kNeoxHalves: return &kv_write_heads_common_kernel<T, kLanes, kNeoxHalves, kNorm>;
      case kNeoxFrequencies: return &kv_write_heads_common_kernel<T, kLanes, kNeoxFrequencies, kNorm>;
      case kGptjPairs: return &kv_write_heads_common_kernel<T, kLanes, kGptjPairs, kNorm>;
    }
    std::fprintf(stderr, "the problem has no compiled form\n");
    std::exit(1);
  }
  static void (*common_kernel(const Problem& p))(KvWrite, const T*, int64_t, int, int, int) {
    const int form = common_form<T, kLanes>(p.kv, p.cfg.layers);
    return p.kv.has_norm ? common_kernel_of<true>(form) : common_kernel_of<false>(form);
  }

  // Warps of the unit kernel resident on the GPU at once.
  static int64_t unit_warps(int sms) { return int64_t(per_sm(true)) * sms * kHeadWarps; }

  // 0: the ring kernel with the ring's heads per unit; 1: the general unit kernel with the op's heads per unit
  // (unit_heads_per_unit; the ring's where the units never fit at once); 2: the compiled-form kernel with the op's
  // (unit_heads_per_unit; a batch of heads where the units never fit at once); 3, 4: the compiled-form kernel with half
  // and twice as many.
  static int per_unit_of(int which, const Problem& p, int sms) {
    const int ring = heads_per_unit<kLanes>(p.tokens, p.cfg.layers, p.cfg.heads, sms);
    if (which == 0) return ring;
    const int unit = unit_heads_per_unit<kLanes>(p.tokens, p.cfg.layers, p.cfg.heads, sms, unit_warps(sms));
    const int widest = std::min(p.cfg.heads, head_batch<kLanes>());
    const int op = unit > 0 ? unit : which >= 2 ? widest : ring;  // beyond one wave, as the op runs each
    const int v = which == 3 ? op / 2 : which == 4 ? op * 2 : op;
    return std::max(1, std::min(v, std::min(p.cfg.heads, head_batch<kLanes>())));
  }

  static void launch(int which, const Problem& p, int sms, cudaStream_t stream) {
    const int per_unit = per_unit_of(which, p, sms);
    const int64_t units = heads_units(p.tokens, p.cfg.layers, p.cfg.heads, per_unit);
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.blockDim = dim3(32 * kHeadWarps);
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = 1;
    if (which == 0) {
      config.gridDim = dim3(unsigned(heads_blocks(units, int64_t(per_sm(false)) * sms)));
      config.dynamicSmemBytes = heads_smem_bytes();
      CHECK(cudaLaunchKernelEx(&config, &kv_write_heads_kernel<T, kLanes>, p.kv, (const T*)p.projections, p.ld,
                               p.tokens, p.cfg.layers, per_unit));
    } else {
      config.gridDim = dim3(unsigned((units + kHeadWarps - 1) / kHeadWarps));
      config.dynamicSmemBytes = which >= 2 ? 0 : unit_smem_bytes();
      const auto kernel = which >= 2 ? common_kernel(p) : &kv_write_heads_unit_kernel<T, kLanes>;
      CHECK(cudaLaunchKernelEx(&config, kernel, p.kv, (const T*)p.projections, p.ld, p.tokens, p.cfg.layers,
                               per_unit));
    }
  }
};

template <int kLanes>
void run(const Config& c, int tokens, int sms, const uint4* flush, int64_t flush_vectors, uint32_t* sink) {
  constexpr int kKernels = 5;
  Problem p(c, tokens);
  const int64_t unit_warps = Kernels<kLanes>::unit_warps(sms);
  const int64_t units = heads_units(tokens, c.layers, c.heads, Kernels<kLanes>::per_unit_of(1, p, sms));
  std::vector<uint8_t> out[kKernels];
  size_t differ = 0;
  for (int which = 0; which < kKernels; ++which) {
    p.poison();
    Kernels<kLanes>::launch(which, p, sms, 0);
    CHECK(cudaDeviceSynchronize());
    out[which] = p.read_caches();
    for (size_t i = 0; i < out[0].size(); ++i) differ += out[0][i] != out[which][i];
  }
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t graphs[kKernels + 1];  // without the heads kernel, then each kernel
  for (int g = 0; g <= kKernels; ++g) {
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    tune::read_kernel<<<264, 512, 0, stream>>>(flush, flush_vectors, sink);
    projections_kernel<<<264, 256, 0, stream>>>(p.projections, tokens * p.ld, 99);
    if (g > 0) Kernels<kLanes>::launch(g - 1, p, sms, stream);
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&graphs[g], graph, 0));
    CHECK(cudaGraphDestroy(graph));
  }
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> times[kKernels + 1];
  constexpr int kReps = 200;
  for (int round = 0; round < 15; ++round) {
    for (int g = 0; g <= kKernels; ++g) {
      CHECK(cudaGraphLaunch(graphs[g], stream));
      CHECK(cudaEventRecord(a, stream));
      for (int r = 0; r < kReps; ++r) CHECK(cudaGraphLaunch(graphs[g], stream));
      CHECK(cudaEventRecord(b, stream));
      CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      times[g].push_back(1e3f * ms / kReps);
    }
  }
  const float base = tune::median(times[0]), ring = tune::median(times[1]) - base;
  std::printf("%-12s T=%4d: %5lld units of the op's width (%s the unit kernel's %lld warps); graph without a heads "
              "kernel %6.2f us; heads kernel: ring (%d heads) %5.2f us", c.name, tokens, (long long)units,
              units <= unit_warps ? "within" : "over", (long long)unit_warps, base,
              Kernels<kLanes>::per_unit_of(0, p, sms), ring);
  for (int which = 1; which < kKernels; ++which) {
    const float unit = tune::median(times[which + 1]) - base;
    std::printf(", %s (%d heads) %5.2f us (%.2fx)", which >= 2 ? "compiled form" : "unit",
                Kernels<kLanes>::per_unit_of(which, p, sms), unit, unit / ring);
  }
  std::printf("; cache bytes differing from the ring kernel's %zu%s\n", differ, differ ? " WRONG" : "");
  for (auto& g : graphs) CHECK(cudaGraphExecDestroy(g));
  CHECK(cudaStreamDestroy(stream));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
}

// `profile T`: the ring kernel and the compiled-form kernel (the op's heads per unit) once each on the Qwen3-8B
// dims, each after the L2-evicting read and the projection-writing kernel as in the timed graphs, no timing: for ncu.
void profile(int tokens, int sms, const uint4* flush, int64_t flush_vectors, uint32_t* sink) {
  const Problem p(Config{"Qwen3-8B/4B", 5, 8, 128}, tokens);
  for (int which : {0, 2}) {
    tune::read_kernel<<<264, 512>>>(flush, flush_vectors, sink);
    projections_kernel<<<264, 256>>>(p.projections, tokens * p.ld, 99);
    Kernels<16>::launch(which, p, sms, 0);
    CHECK(cudaDeviceSynchronize());
  }
}

}  // namespace

int main(int argc, char** argv) {
  int sms = 0, l2 = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, l2 >> 20);
  const int64_t flush_vectors = 3 * int64_t(l2) / 16;
  uint4* flush;
  uint32_t* sink;
  CHECK(cudaMalloc(&flush, flush_vectors * 16));
  CHECK(cudaMemset(flush, 1, flush_vectors * 16));
  CHECK(cudaMalloc(&sink, 4));
  if (argc > 1 && std::strcmp(argv[1], "profile") == 0) {
    const int tokens = argc > 2 ? std::atoi(argv[2]) : 512;
    if (tokens < 1) {
      std::fprintf(stderr, "usage: heads_tune [profile [T >= 1, default 512]]\n");
      return 2;
    }
    profile(tokens, sms, flush, flush_vectors, sink);
    return 0;
  }
  const Config qwen{"Qwen3-8B/4B", 5, 8, 128}, hd64{"head_dim 64", 5, 16, 64};
  const Config hf{"Qwen3-8B, HF", 5, 8, 128, kNeoxFrequencies}, complex{"Qwen3-8B, complex", 5, 8, 128, kGptjPairs};
  const Config llama{"Llama-style, HF, no norm", 5, 8, 128, kNeoxFrequencies, false};
  // one wave at 4 heads per unit up to 158 (Qwen3-8B) / 79 (head_dim 64) tokens, at a batch of heads up to 316
  for (int tokens : {17, 64, 100, 158, 159, 200, 316, 317, 512, 1024, 4096}) {
    run<16>(qwen, tokens, sms, flush, flush_vectors, sink);
  }
  for (int tokens : {17, 64, 159, 317, 512, 4096}) run<8>(hd64, tokens, sms, flush, flush_vectors, sink);
  for (int tokens : {17, 64, 512}) run<16>(hf, tokens, sms, flush, flush_vectors, sink);
  for (int tokens : {17, 64, 512}) run<16>(complex, tokens, sms, flush, flush_vectors, sink);
  for (int tokens : {17, 64, 512}) run<16>(llama, tokens, sms, flush, flush_vectors, sink);
  return 0;
}
