// Whether cuBLASLt's pointer-array batched matmul, with the best of its heuristic's algorithms, reads a group of
// separate weights as fast as one GEMM on a concatenated copy. Standalone CUDA and cuBLAS (no torch):
//
//   C=$(python3 -c 'import nvidia.cu13; print(list(nvidia.cu13.__path__)[0])')
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icustom_ops/csrc -I$C/include \
//        benchmarks/cublaslt_tune.cu -o cublaslt_tune -L$C/lib -l:libcublas.so.13 -l:libcublasLt.so.13 \
//        -Xlinker -rpath=$C/lib
//
// Per group (every weight cut into blocks of one height, each its own allocation) and M: cublasGemmEx on a
// concatenated copy (what torch's mm runs), cublasGemmBatchedEx over the blocks (dspark::multi_linear's cuBLAS path),
// and cublasLtMatmul in CUBLASLT_BATCH_MODE_POINTER_ARRAY over the same pointer tables with each algorithm its
// heuristic returns (up to 24), the first and the fastest; the same for cublasLtMatmul on the concatenated copy.
// Timing as benchmarks/cublas_paths_tune.cu: CUDA graphs replayed over weight copies that add up to 3x the L2,
// median of 7 runs; every output checked against the concatenated GEMM.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "tune_cublas.cuh"

using T = __nv_bfloat16;

namespace {

struct Group {
  std::string name;
  int blocks, block_rows, k;
};

constexpr size_t kWorkspace = 32 << 20;

// A layout of `rows` x `cols` column-major bf16 with leading dimension `ld`, batched `count` times by pointer arrays
// (count > 1) or not.
cublasLtMatrixLayout_t layout(int rows, int cols, int64_t ld, int count) {
  cublasLtMatrixLayout_t l;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, CUDA_R_16BF, rows, cols, ld));
  if (count > 1) {
    const uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof(mode)));
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  }
  return l;
}

// One Lt problem (out[:, blocks] = x @ W_b^T for each block, or one GEMM): its descriptors and heuristic algorithms.
struct LtProblem {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, d;
  std::vector<cublasLtMatmulHeuristicResult_t> algos;

  LtProblem(cublasLtHandle_t lt, int rows, int tokens, int k, int64_t ldd, int count) {
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    a = layout(k, rows, k, count);
    b = layout(k, tokens, k, count);
    d = layout(rows, tokens, ldd, count);
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kWorkspace;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    algos.resize(24);
    int found = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, d, d, pref, (int)algos.size(), algos.data(), &found);
    algos.resize(status == CUBLAS_STATUS_SUCCESS ? found : 0);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  }
};

// "tile id / splitK / stages" of an algorithm.
std::string describe(const cublasLtMatmulAlgo_t& algo) {
  int tile = 0, split = 0, stages = 0;
  size_t n = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &n);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split), &n);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &n);
  return "tile " + std::to_string(tile) + " split " + std::to_string(split) + " stages " + std::to_string(stages);
}

}  // namespace

int main() {
  const cublasHandle_t handle = tune::cublas_handle();
  cudaStream_t stream;
  CUBLAS_CHECK(cublasGetStream(handle, &stream));
  cublasLtHandle_t lt;
  CUBLAS_CHECK(cublasLtCreate(&lt));
  void* workspace;
  CHECK(cudaMalloc(&workspace, kWorkspace));
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, cuBLAS %d\n", prop.name, CUBLAS_VERSION);
  const std::vector<Group> groups = {
      {"kv 10x[1024,4096]", 10, 1024, 4096},
      {"q/k/v [4096|1024|1024,4096] as 6x1024", 6, 1024, 4096},
      {"gate/up 2x[12288,4096] as 12x2048", 12, 2048, 4096},
  };
  const int max_tokens = 512;
  T *x, *out, *ref;
  CHECK(cudaMalloc(&x, (size_t)max_tokens * 4096 * sizeof(T)));
  tune::fill_kernel<<<256, 256>>>(x, (int64_t)max_tokens * 4096, 7, 0.25f);
  const float one = 1.f, zero = 0.f;
  for (const Group& g : groups) {
    const int total = g.blocks * g.block_rows;
    const size_t bytes = (size_t)total * g.k * sizeof(T);
    const int copies = (int)std::max<size_t>(2, 3 * (size_t)l2 / bytes + 1);
    std::vector<T*> concat(copies);
    std::vector<std::vector<T*>> w(copies);
    for (int c = 0; c < copies; ++c) {
      CHECK(cudaMalloc(&concat[c], bytes));
      tune::fill_kernel<<<1024, 256>>>(concat[c], (int64_t)total * g.k, 100 + c, 0.25f);
      for (int i = 0; i < g.blocks; ++i) {
        T* p;
        CHECK(cudaMalloc(&p, (size_t)g.block_rows * g.k * sizeof(T) + 4096));  // a gap after each weight
        CHECK(cudaMemcpy(p, concat[c] + (size_t)i * g.block_rows * g.k, (size_t)g.block_rows * g.k * sizeof(T),
                         cudaMemcpyDeviceToDevice));
        w[c].push_back(p);
      }
    }
    CHECK(cudaMalloc(&out, (size_t)max_tokens * total * sizeof(T)));
    CHECK(cudaMalloc(&ref, (size_t)max_tokens * total * sizeof(T)));
    // per copy: [A (blocks)..., B (x)..., D (out column blocks)...]
    std::vector<void**> tables(copies);
    for (int c = 0; c < copies; ++c) {
      CHECK(cudaMalloc(&tables[c], 3 * g.blocks * sizeof(void*)));
      std::vector<void*> host(3 * g.blocks);
      for (int i = 0; i < g.blocks; ++i) {
        host[i] = w[c][i];
        host[g.blocks + i] = x;
        host[2 * g.blocks + i] = out + (size_t)i * g.block_rows;
      }
      CHECK(cudaMemcpy(tables[c], host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
    }
    std::printf("\n## %s: %.1f MB, %d copies\n", g.name.c_str(), bytes / 1e6, copies);
    std::printf("| M | concat GemmEx | batched GemmBatchedEx | Lt pointer array: first | Lt pointer array: fastest |"
                " Lt concat: first | Lt concat: fastest | fastest pointer array / concat GemmEx |\n");
    for (int tokens : {1, 8, 16, 64, 512}) {
      LtProblem batched_lt(lt, g.block_rows, tokens, g.k, total, g.blocks);
      LtProblem concat_lt(lt, total, tokens, g.k, total, 1);
      CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, total, tokens, g.k, &one, concat[0], CUDA_R_16BF,
                                g.k, x, CUDA_R_16BF, g.k, &zero, ref, CUDA_R_16BF, total, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
      CHECK(cudaStreamSynchronize(stream));
      std::vector<T> want((size_t)tokens * total), got(want.size());
      CHECK(cudaMemcpy(want.data(), ref, want.size() * sizeof(T), cudaMemcpyDeviceToHost));
      // the time of `call` (as a graph per copy), or -1 where its output is wrong or it fails
      auto time = [&](const std::function<cublasStatus_t(int)>& call) -> float {
        CHECK(cudaMemset(out, 0xff, got.size() * sizeof(T)));
        if (call(0) != CUBLAS_STATUS_SUCCESS) return -1;
        CHECK(cudaStreamSynchronize(stream));
        CHECK(cudaMemcpy(got.data(), out, got.size() * sizeof(T), cudaMemcpyDeviceToHost));
        if (!(tune::relative_squared_error(got, want) <= 1e-4)) return -1;
        std::vector<cudaGraphExec_t> execs(copies);
        for (int c = 0; c < copies; ++c) {
          cudaGraph_t graph;
          CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          const cublasStatus_t s = call(c);
          CHECK(cudaStreamEndCapture(stream, &graph));
          if (s != CUBLAS_STATUS_SUCCESS) return -1;
          CHECK(cudaGraphInstantiate(&execs[c], graph, 0));
          CHECK(cudaGraphDestroy(graph));
        }
        const float us = tune::warm_us([&](int c) { CHECK(cudaGraphLaunch(execs[c], stream)); }, copies, 5);
        for (auto exec : execs) CHECK(cudaGraphExecDestroy(exec));
        return us;
      };
      const float gemm = time([&](int c) {
        return cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, total, tokens, g.k, &one, concat[c], CUDA_R_16BF, g.k,
                            x, CUDA_R_16BF, g.k, &zero, out, CUDA_R_16BF, total, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT);
      });
      const float batched = time([&](int c) {
        void** t = tables[c];
        return cublasGemmBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, g.block_rows, tokens, g.k, &one,
                                   (const void* const*)t, CUDA_R_16BF, g.k, (const void* const*)(t + g.blocks),
                                   CUDA_R_16BF, g.k, &zero, t + 2 * g.blocks, CUDA_R_16BF, total, g.blocks,
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      });
      // first and fastest of a problem's algorithms, with the fastest's description
      auto sweep = [&](LtProblem& p, bool pointer_array, float& first, float& best, std::string& what) {
        first = best = -1;
        for (size_t i = 0; i < p.algos.size(); ++i) {
          const float us = time([&](int c) {
            const void* a = pointer_array ? (const void*)tables[c] : (const void*)concat[c];
            const void* b = pointer_array ? (const void*)(tables[c] + g.blocks) : (const void*)x;
            void* d = pointer_array ? (void*)(tables[c] + 2 * g.blocks) : (void*)out;
            return cublasLtMatmul(lt, p.desc, &one, a, p.a, b, p.b, &zero, d, p.d, d, p.d, &p.algos[i].algo,
                                  workspace, kWorkspace, stream);
          });
          if (i == 0) first = us;
          if (us > 0 && (best < 0 || us < best)) {
            best = us;
            what = "#" + std::to_string(i) + " " + describe(p.algos[i].algo);
          }
        }
      };
      float lt_first, lt_best, cat_first, cat_best;
      std::string lt_what, cat_what;
      sweep(batched_lt, true, lt_first, lt_best, lt_what);
      sweep(concat_lt, false, cat_first, cat_best, cat_what);
      std::printf("| %d | %.1f | %.1f | %.1f | %.1f (%s of %zu) | %.1f | %.1f (%s of %zu) | %.3fx |\n", tokens, gemm,
                  batched, lt_first, lt_best, lt_what.c_str(), batched_lt.algos.size(), cat_first, cat_best,
                  cat_what.c_str(), concat_lt.algos.size(), lt_best > 0 ? lt_best / gemm : -1.0);
      std::fflush(stdout);
    }
    for (int c = 0; c < copies; ++c) {
      for (T* p : w[c]) CHECK(cudaFree(p));
      CHECK(cudaFree(concat[c]));
      CHECK(cudaFree(tables[c]));
    }
    CHECK(cudaFree(out));
    CHECK(cudaFree(ref));
  }
  return 0;
}
