// Tile-configuration sweep of the multi_linear kernel as a standalone CUDA program (no torch: the kernel headers are
// torch-free; cuBLAS for the baseline), so it builds in seconds and runs on the GPU without the op library.
//
//   C=$(python3 -c 'import nvidia.cu13; print(list(nvidia.cu13.__path__)[0])')
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icustom_ops/csrc -I$C/include \
//        benchmarks/multi_linear_tune.cu -o multi_linear_tune -L$C/lib -l:libcublas.so.13 -Xlinker -rpath=$C/lib
//   ./multi_linear_tune
//
// (from the repository root; like every source of the project it includes headers relative to custom_ops/csrc).
//
// For every group of benchmarks/multi_linear.py, M in {1, 8, 16, 32, 64}, every compiled variant (kVariants) and
// configurations of the register-streaming tile of linear/multi_linear_direct.cuh (M <= 16; the op does not launch
// it), cluster splits 1..8: checks the output against a plain fp32 reference kernel, then times back-to-back launches
// (programmatic dependent launch on, as the op launches) over enough weight copies that the L2 never serves them
// (median of 7 runs). Also measured in the same run: the copy rate (device-to-device copy, bytes read + written),
// a pure read of the same weights (the read ceiling: what any kernel reading those bytes once can reach) and one
// cuBLAS GEMM on the group's weights, which lie back to back here (cuBLAS on a concatenated copy: the reference the
// op must not be slower than), timed and checked the same way.
// Add a candidate to kVariants, or a direct_config to main's list, to try it.
//
// `./multi_linear_tune stream` instead: the groups of at least 16 MB, each weight in its own allocation, at 1, 8 and
// 16 tokens: the op's streaming kernel (linear/multi_linear_stream.cuh) in several configurations against the tile
// the op picks otherwise (default_variant, auto_split), cuBLAS on a concatenated copy and the copy engine's read of
// the same bytes (bulk_read.cuh), each checked against the reference and timed warm (back to back) and cold (one
// launch after an L2 flush, events around it; what a replay of one GEMM alone sees).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bulk_read.cuh"
#include "linear/multi_linear_stream.cuh"
#include "linear/multi_linear_direct.cuh"
#include "linear/multi_linear_kernels.cuh"
#include "tune_cublas.cuh"

using namespace dspark::mlinear;
using dspark::bulk_read_kernel;
using dspark::kBulkSmemBytes;
using tune::cold_us;
using tune::launch;
using tune::warm_us;
using T = __nv_bfloat16;

// A kernel to sweep: the tile's rows, threads and k-warps, the fewest K steps of 32 columns a warp must get, and per
// n-tile count (1, 2, 4, 8) its function and shared memory (nullptr: not compiled for that many tokens).
struct Config {
  std::string name;
  int rows, threads, k_warps, min_steps;
  KernelFn fn[4];
  int smem[4];
};

template <int V>
Config make_config() {
  constexpr Variant v = kVariants[V];
  const std::string name = "v" + std::to_string(V) + ":" + std::to_string(cta_rows(v)) + "r/" +
                           std::to_string(v.row_warps * v.k_warps) + "w/k" + std::to_string(v.k_warps) + "/d" +
                           std::to_string(v.stages);
  return {name,
          cta_rows(v),
          cta_threads(v),
          v.k_warps,
          2,
          {kernel_instance<T, V, 1>(), kernel_instance<T, V, 2>(), kernel_instance<T, V, 4>(),
           kernel_instance<T, V, 8>()},
          {smem_bytes(v, 1), smem_bytes(v, 2), smem_bytes(v, 4), smem_bytes(v, 8)}};
}

template <int... V>
std::vector<Config> all_configs(std::integer_sequence<int, V...>) {
  return {make_config<V>()...};
}

// The register-streaming tile (linear/multi_linear_direct.cuh): WR row warps of 16 rows x WK k-warps, E columns per
// lane and chunk, D chunks in flight; up to 16 tokens (more tokens' accumulators take the registers of the loads).
template <int WR, int WK, int E, int D>
Config direct_config() {
  const std::string name = "direct:" + std::to_string(16 * WR) + "r/" + std::to_string(WR * WK) + "w/k" +
                           std::to_string(WK) + "/e" + std::to_string(E) + "/d" + std::to_string(D);
  return {name,
          16 * WR,
          direct_threads<WR, WK>(),
          WK,
          D * E / 8,
          {&multi_linear_direct_kernel<T, WR, 1, WK, E, D>, &multi_linear_direct_kernel<T, WR, 2, WK, E, D>, nullptr,
           nullptr},
          {direct_smem_bytes<WR, 1, StoreEpilogue>(), direct_smem_bytes<WR, 2, StoreEpilogue>(), 0, 0}};
}

__global__ void reference_kernel(const T* x, const T* w, int tokens, int k, int64_t rows, float* out) {
  const int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (r >= rows) return;
  for (int t = 0; t < tokens; ++t) {
    float s = 0.f;
    for (int c = 0; c < k; ++c) s += __bfloat162float(x[(int64_t)t * k + c]) * __bfloat162float(w[r * k + c]);
    out[(int64_t)t * rows + r] = s;
  }
}

struct Group {
  std::string name;
  std::vector<int64_t> rows;
  int k;
};

// Whether the `n` outputs at `out` (poisoned before the call) hold the fp32 reference `ref_host` to bf16 rounding.
bool matches_reference(const T* out, std::vector<T>& out_host, const float* ref_host, int64_t n) {
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(out_host.data(), out, n * sizeof(T), cudaMemcpyDeviceToHost));
  double err = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = __bfloat162float(out_host[i]) - ref_host[i];
    err += d * d;
    norm += (double)ref_host[i] * ref_host[i];
  }
  return err <= 1e-4 * norm;
}

// The kernel parameters of group `g` at `tokens` tokens over the weight copy at `w`, whose weights lie back to back
// with `gap` elements between them, writing `out` [tokens, rows].
Params group_params(const Group& g, const T* x, T* out, int tokens, const T* w, int64_t gap) {
  Params p{};
  p.x = x;
  p.x_stride = g.k;
  p.out = out;
  p.out_stride = 0;
  p.tokens = tokens;
  p.k = g.k;
  p.num_segments = (int)g.rows.size();
  int64_t end = 0;
  for (size_t s = 0; s < g.rows.size(); ++s) {
    p.weight[s] = w + end * g.k + s * gap;
    end += g.rows[s];
    p.segment_end[s] = end;
    p.weight_stride[s] = g.k;
    p.bias[s] = nullptr;
  }
  p.out_stride = end;
  return p;
}


// `stream` (see the header).
template <int KC, int NT, int CW, int D>
Config stream_config() {
  const std::string name = "stream:kc" + std::to_string(KC) + "/c" + std::to_string(CW) + "/d" + std::to_string(D);
  Config c{name, 16, 32 * (CW + 1), 1, 0, {nullptr, nullptr, nullptr, nullptr}, {0, 0, 0, 0}};
  c.fn[NT - 1] = &multi_linear_stream_kernel<T, KC, NT, CW, D>;
  c.smem[NT - 1] = stream_smem_bytes<KC, NT, CW, D>();
  static_assert(stream_smem_bytes<KC, NT, CW, D>() <= kMaxSmemBytes, "fits one CTA per SM");
  return c;
}

int stream_mode(const std::vector<Group>& groups, int sms, double copy_rate, const T* x, uint32_t* sink) {
  const std::vector<Config> streams = {
      stream_config<1024, 1, 4, 4>(), stream_config<1024, 1, 8, 4>(), stream_config<512, 1, 2, 8>(),
      stream_config<512, 1, 4, 8>(),  stream_config<1024, 2, 4, 3>(), stream_config<1024, 2, 8, 3>(),
      stream_config<512, 2, 4, 6>(),  stream_config<512, 2, 2, 6>(),
  };
  const cublasHandle_t handle = tune::cublas_handle();
  const size_t flush_bytes = size_t(256) << 20;
  void* flush;
  CHECK(cudaMalloc(&flush, flush_bytes));
  uint32_t* sums;
  CHECK(cudaMalloc(&sums, 32 * sms * sizeof(uint32_t)));
  CHECK(cudaFuncSetAttribute(bulk_read_kernel<16384>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmemBytes));
  for (const Group& g : groups) {
    int64_t rows = 0;
    for (auto r : g.rows) rows += r;
    const int64_t group_bytes = rows * g.k * (int64_t)sizeof(T);
    if (group_bytes < (16 << 20)) continue;
    const int copies = (int)std::max<int64_t>(2, (3 * 60 * (int64_t)1 << 20) / group_bytes + 1);
    std::vector<T*> w(copies);
    for (int i = 0; i < copies; ++i) {  // each weight of a copy in its own allocation, as in a model
      CHECK(cudaMalloc(&w[i], group_bytes + g.rows.size() * 4096));
      tune::fill_kernel<<<1024, 256>>>(w[i], (group_bytes + g.rows.size() * 4096) / 2, 100 + i, 0.25f);
    }
    std::vector<T*> concat(copies);
    for (int i = 0; i < copies; ++i) {
      CHECK(cudaMalloc(&concat[i], group_bytes));
      int64_t end = 0;
      for (size_t s = 0; s < g.rows.size(); ++s) {
        CHECK(cudaMemcpy(concat[i] + end * g.k, w[i] + end * g.k + s * 2048, g.rows[s] * g.k * sizeof(T),
                         cudaMemcpyDeviceToDevice));
        end += g.rows[s];
      }
    }
    auto report = [&](const std::string& what, auto&& call, bool ok) {
      const float warm = warm_us(call, copies, 5), cold = cold_us(call, copies, flush, flush_bytes);
      std::printf("  %-34s warm %6.2f us (%3.0f%%) cold %6.2f us (%3.0f%%)%s\n", what.c_str(), warm,
                  100.0 * group_bytes / (warm * 1e-6) / copy_rate, cold,
                  100.0 * group_bytes / (cold * 1e-6) / copy_rate, ok ? "" : " WRONG");
    };
    std::printf("\n## %s: %.1f MB (weights apart, 4 KB between them)\n", g.name.c_str(), group_bytes / 1e6);
    report("read: copy engine 16 KB x SMs", [&](int i) {
      bulk_read_kernel<16384><<<sms, 32, kBulkSmemBytes>>>((const char*)concat[i], group_bytes, sums);
    }, true);
    T* out;
    float *ref, *ref_host;
    CHECK(cudaMalloc(&out, 16 * rows * sizeof(T)));
    CHECK(cudaMalloc(&ref, 16 * rows * sizeof(float)));
    ref_host = (float*)std::malloc(16 * rows * sizeof(float));
    std::vector<T> out_host(16 * rows);
    for (int tokens : {1, 8, 16}) {
      reference_kernel<<<(unsigned)((rows + 127) / 128), 128>>>(x, concat[0], tokens, g.k, rows, ref);
      CHECK(cudaMemcpy(ref_host, ref, tokens * rows * sizeof(float), cudaMemcpyDeviceToHost));
      auto matches = [&] { return matches_reference(out, out_host, ref_host, tokens * rows); };
      auto params = [&](int i) { return group_params(g, x, out, tokens, w[i], 2048); };
      std::printf("M=%d\n", tokens);
      const int nt = tokens <= 8 ? 0 : 1;
      const int dv = default_variant(rows, g.k, sms);
      const int ds = auto_split(kVariants[dv], rows, g.k, sms);
      const Config op = all_configs(std::make_integer_sequence<int, kNumVariants>{})[dv];
      const int64_t tiles = (rows + op.rows - 1) / op.rows;
      auto op_call = [&](int i) { launch(op.fn[nt], params(i), tiles * ds, op.threads, op.smem[nt], ds); };
      CHECK(cudaMemset(out, 0xff, tokens * rows * sizeof(T)));
      op_call(0);
      report("op tile " + op.name + " split " + std::to_string(ds), op_call, matches());
      for (const Config& c : streams) {
        if (c.fn[nt] == nullptr) continue;
        const int grid = (int)std::min<int64_t>(sms, (rows + 15) / 16);
        auto call = [&](int i) { launch(c.fn[nt], params(i), grid, c.threads, c.smem[nt], 1); };
        CHECK(cudaMemset(out, 0xff, tokens * rows * sizeof(T)));
        call(0);
        const bool ok = matches();
        report(c.name, call, ok);
      }
      const float one = 1.f, zero = 0.f;
      auto cublas = [&](int i) {
        CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, tokens, g.k, &one, concat[i],
                                  CUDA_R_16BF, g.k, x, CUDA_R_16BF, g.k, &zero, out, CUDA_R_16BF, (int)rows,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      CHECK(cudaMemset(out, 0xff, tokens * rows * sizeof(T)));
      cublas(0);
      report("cuBLAS on the concatenated copy", cublas, matches());
    }
    for (T* q : w) CHECK(cudaFree(q));
    for (T* q : concat) CHECK(cudaFree(q));
    CHECK(cudaFree(out));
    CHECK(cudaFree(ref));
    std::free(ref_host);
  }
  CHECK(cudaFree(flush));
  CHECK(cudaFree(sums));
  return 0;
}

int main(int argc, char** argv) {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const cublasHandle_t handle = tune::cublas_handle();
  std::vector<Config> configs = all_configs(std::make_integer_sequence<int, kNumVariants>{});
  for (const Config& c : {direct_config<8, 2, 8, 4>(), direct_config<8, 1, 8, 4>(), direct_config<4, 2, 8, 4>(),
                          direct_config<4, 4, 8, 4>(), direct_config<4, 2, 8, 2>(), direct_config<2, 4, 8, 4>(),
                          direct_config<4, 2, 16, 2>()}) {
    configs.push_back(c);
  }
  const std::vector<Group> groups = {
      {"kv 5x[2048,4096]", {2048, 2048, 2048, 2048, 2048}, 4096},
      {"qkv [4096|1024|1024,4096]", {4096, 1024, 1024}, 4096},
      {"gate/up 2x[12288,4096]", {12288, 12288}, 4096},
      {"[4096,4096]", {4096}, 4096},
      {"[1024,4096]", {1024}, 4096},
      {"[4096,12288]", {4096}, 12288},
  };
  // copy rate
  const size_t copy_bytes = size_t(2) << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, copy_bytes));
  CHECK(cudaMalloc(&dst, copy_bytes));
  const float copy_us = tune::warm_us([&](int) { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); }, 1, 3);
  const double copy_rate = 2.0 * copy_bytes / (copy_us * 1e-6);
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  std::printf("GPU SMs %d; copy rate %.2f TB/s (read + write)\n", sms, copy_rate / 1e12);
  uint32_t* sink;
  CHECK(cudaMalloc(&sink, 4));
  const int64_t max_tokens = 64;
  T* x;
  CHECK(cudaMalloc(&x, max_tokens * 12288 * sizeof(T)));
  tune::fill_kernel<<<256, 256>>>(x, max_tokens * 12288, 7, 0.25f);
  if (argc > 1 && std::string(argv[1]) == "stream") return stream_mode(groups, sms, copy_rate, x, sink);
  for (const Group& g : groups) {
    int64_t rows = 0;
    for (auto r : g.rows) rows += r;
    const int64_t group_bytes = rows * g.k * (int64_t)sizeof(T);
    const int copies = (int)std::max<int64_t>(2, (3 * 60 * (int64_t)1 << 20) / group_bytes + 1);
    std::vector<T*> w(copies);
    for (int i = 0; i < copies; ++i) {
      CHECK(cudaMalloc(&w[i], group_bytes));
      tune::fill_kernel<<<1024, 256>>>(w[i], rows * g.k, 100 + i, 0.25f);
    }
    const float read_us = tune::warm_us(
        [&](int i) { tune::read_kernel<<<sms * 8, 512>>>((const uint4*)w[i], group_bytes / 16, sink); }, copies, 5);
    std::printf("\n## %s: %.1f MB, read ceiling %.2f us = %.2f TB/s (%.0f%% of copy)\n", g.name.c_str(),
                group_bytes / 1e6, read_us, group_bytes / (read_us * 1e-6) / 1e12,
                100.0 * group_bytes / (read_us * 1e-6) / copy_rate);
    T* out;
    float *ref, *ref_host;
    CHECK(cudaMalloc(&out, max_tokens * rows * sizeof(T)));
    CHECK(cudaMalloc(&ref, max_tokens * rows * sizeof(float)));
    ref_host = (float*)std::malloc(max_tokens * rows * sizeof(float));
    std::vector<T> out_host(max_tokens * rows);
    for (int tokens : {1, 8, 16, 32, 64}) {
      reference_kernel<<<(unsigned)((rows + 127) / 128), 128>>>(x, w[0], tokens, g.k, rows, ref);
      CHECK(cudaMemcpy(ref_host, ref, tokens * rows * sizeof(float), cudaMemcpyDeviceToHost));
      const double floor_us = 1e6 * (group_bytes + tokens * (g.k + rows) * 2.0) / copy_rate;
      float best = 1e30f;
      std::string best_name;
      const int dv = default_variant(rows, g.k, sms);
      const int ds = auto_split(kVariants[dv], rows, g.k, sms);
      auto matches = [&] { return matches_reference(out, out_host, ref_host, tokens * rows); };
      for (const Config& c : configs) {
        const int nt = tokens <= 8 ? 0 : tokens <= 16 ? 1 : tokens <= 32 ? 2 : 3;
        const int smem = c.smem[nt];
        if (c.fn[nt] == nullptr || smem > kMaxSmemBytes) continue;
        const int64_t tiles = (rows + c.rows - 1) / c.rows;
        std::string line;
        for (int split : {1, 2, 3, 4, 6, 8}) {
          if (g.k / kStepCols / (split * c.k_warps) < c.min_steps) continue;
          auto params = [&](int i) { return group_params(g, x, out, tokens, w[i], 0); };
          CHECK(cudaMemset(out, 0xff, tokens * rows * sizeof(T)));
          launch(c.fn[nt], params(0), tiles * split, c.threads, smem, split);
          if (!matches()) {
            line += " split" + std::to_string(split) + "=WRONG";
            continue;
          }
          const float us = tune::warm_us(
              [&](int i) { launch(c.fn[nt], params(i), tiles * split, c.threads, smem, split); }, copies, 5);
          char buf[64];
          std::snprintf(buf, sizeof(buf), " s%d %.1f", split, us);
          line += buf;
          if (us < best) {
            best = us;
            best_name = std::string(c.name) + " split " + std::to_string(split);
          }
        }
        std::printf("M=%2d %-18s smem %6d:%s\n", tokens, c.name.c_str(), smem, line.c_str());
      }
      const float one = 1.f, zero = 0.f;
      auto cublas = [&](int i) {
        CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, tokens, g.k, &one, w[i], CUDA_R_16BF,
                                  g.k, x, CUDA_R_16BF, g.k, &zero, out, CUDA_R_16BF, (int)rows, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
      };
      CHECK(cudaMemset(out, 0xff, tokens * rows * sizeof(T)));
      cublas(0);
      const bool cublas_ok = matches();
      const float cublas_us = tune::warm_us(cublas, copies, 5);
      std::printf("M=%2d BEST %s %.2f us = %.0f%% of copy (floor %.2f us); default v%d split %d; cuBLAS on the "
                  "concatenated weights %.2f us%s (best / cuBLAS %.2fx)\n",
                  tokens, best_name.c_str(), best, 100.0 * floor_us / best, floor_us, dv, ds, cublas_us,
                  cublas_ok ? "" : " WRONG", best / cublas_us);
    }
    for (T* p : w) CHECK(cudaFree(p));
    CHECK(cudaFree(out));
    CHECK(cudaFree(ref));
    std::free(ref_host);
  }
  return 0;
}
