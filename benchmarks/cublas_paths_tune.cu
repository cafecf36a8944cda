// Which cuBLAS call reads the weights of a multi-weight GEMM (dspark::multi_linear's cuBLAS path: out[:, ranges] =
// x @ W_i^T) fastest. Standalone CUDA and cuBLAS (no torch):
//
//   C=$(python3 -c 'import nvidia.cu13; print(list(nvidia.cu13.__path__)[0])')
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icustom_ops/csrc -I$C/include \
//        benchmarks/cublas_paths_tune.cu -o cublas_paths_tune -L$C/lib -l:libcublas.so.13 -Xlinker -rpath=$C/lib
//
// (`TUNE=cublas_paths bash scripts/gpu_check.sh tune` does this.) The ways: one GEMM per weight; one batched GEMM per
// shape of weight (the op's path), the other weights a GEMM each; one grouped batched GEMM (cublasGemmGroupedBatchedEx,
// every shape in one call); one batched GEMM over row blocks of B rows (every weight cut into blocks of B rows, B
// dividing every weight's rows: one shape, one call); one GEMM on a concatenated copy of the weights. Each is captured
// in a CUDA graph (the pointer tables written before the capture, as the op's table kernel would), replayed over
// weight copies that add up to 3x the L2, median of 7 runs of back-to-back replays; the graph's kernel count is
// printed, and every way's output is checked against the per-weight GEMMs.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tune_cublas.cuh"

using T = __nv_bfloat16;

struct Group {
  std::string name;
  std::vector<int> rows;  // one weight per entry, all [rows, k]
  int k;
};

// One copy of a group's weights: each weight its own allocation (as in a model), plus the concatenation.
struct Copy {
  std::vector<T*> w;
  T* concat;
};

// Kernel nodes of `graph`.
int kernel_nodes(cudaGraph_t graph) {
  size_t n = 0;
  CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  int kernels = 0;
  for (auto node : nodes) {
    cudaGraphNodeType t;
    CHECK(cudaGraphNodeGetType(node, &t));
    kernels += t == cudaGraphNodeTypeKernel ? 1 : 0;
  }
  return kernels;
}

int main() {
  const cublasHandle_t handle = tune::cublas_handle();
  cudaStream_t stream;
  CUBLAS_CHECK(cublasGetStream(handle, &stream));
  const std::vector<Group> groups = {
      {"qkv [4096|1024|1024,4096]", {4096, 1024, 1024}, 4096},
      {"q|k|v GQA-8 [4096|512|512,4096]", {4096, 512, 512}, 4096},
      {"kv 5x[2048,4096]", {2048, 2048, 2048, 2048, 2048}, 4096},
      {"kv 10x[1024,4096]", {1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024}, 4096},
      {"gate/up 2x[12288,4096]", {12288, 12288}, 4096},
      {"[4096,4096]", {4096}, 4096},
      {"[4096,12288]", {4096}, 12288},
      {"[12288,4096]", {12288}, 4096},
  };
  const std::vector<int> block_rows = {256, 512, 1024, 2048};
  const size_t copy_bytes = size_t(1) << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, copy_bytes));
  CHECK(cudaMalloc(&dst, copy_bytes));
  const float copy_us =
      tune::warm_us([&](int) { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); }, 1, 3);
  const double copy_rate = 2.0 * copy_bytes / (copy_us * 1e-6);
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  std::printf("copy rate %.2f TB/s (read + write)\n", copy_rate / 1e12);
  const int max_tokens = 2048;
  T* x;
  int max_k = 0;
  for (const Group& g : groups) max_k = std::max(max_k, g.k);
  CHECK(cudaMalloc(&x, (size_t)max_tokens * max_k * sizeof(T)));
  tune::fill_kernel<<<256, 256>>>(x, (int64_t)max_tokens * max_k, 7, 0.25f);
  const float one = 1.f, zero = 0.f;

  for (const Group& g : groups) {
    int total = 0;
    for (int r : g.rows) total += r;
    const size_t bytes = (size_t)total * g.k * sizeof(T);
    const int copies = (int)std::max<size_t>(2, (size_t(3) * 60 << 20) / bytes + 1);
    std::vector<Copy> cs(copies);
    for (int c = 0; c < copies; ++c) {
      CHECK(cudaMalloc(&cs[c].concat, bytes));
      tune::fill_kernel<<<1024, 256>>>(cs[c].concat, (int64_t)total * g.k, 100 + c, 0.25f);
      int64_t row = 0;
      for (int r : g.rows) {
        T* w;
        CHECK(cudaMalloc(&w, (size_t)r * g.k * sizeof(T) + 4096));  // a gap after each weight
        CHECK(cudaMemcpy(w, cs[c].concat + row * g.k, (size_t)r * g.k * sizeof(T), cudaMemcpyDeviceToDevice));
        cs[c].w.push_back(w);
        row += r;
      }
    }
    T *out, *ref;
    CHECK(cudaMalloc(&out, (size_t)max_tokens * total * sizeof(T)));
    CHECK(cudaMalloc(&ref, (size_t)max_tokens * total * sizeof(T)));
    // pointer tables per copy: [A (weights)..., B (x)..., C (out blocks)...], grouped order = batched order
    const int n = (int)g.rows.size();
    std::vector<void**> tables(copies);
    for (int c = 0; c < copies; ++c) CHECK(cudaMalloc(&tables[c], 3 * n * sizeof(void*)));
    // row-block tables per copy and block size (B dividing every weight's rows): [A..., B..., C...] of every block
    std::vector<int> blocks;
    for (int b : block_rows) {
      bool divides = total / b >= 2;
      for (int r : g.rows) divides = divides && r % b == 0;
      if (divides) blocks.push_back(b);
    }
    std::vector<std::vector<void**>> block_tables(blocks.size(), std::vector<void**>(copies));
    for (size_t b = 0; b < blocks.size(); ++b) {
      for (int c = 0; c < copies; ++c) CHECK(cudaMalloc(&block_tables[b][c], 3 * (total / blocks[b]) * sizeof(void*)));
    }
    // shapes in first-seen order; `order` lists weights shape by shape
    std::vector<int> shape_rows, group_size, order;
    for (int r : g.rows) {
      if (std::find(shape_rows.begin(), shape_rows.end(), r) == shape_rows.end()) shape_rows.push_back(r);
    }
    for (int r : shape_rows) {
      int count = 0;
      for (int i = 0; i < n; ++i) {
        if (g.rows[i] == r) {
          order.push_back(i);
          ++count;
        }
      }
      group_size.push_back(count);
    }
    std::vector<int64_t> col(n);
    for (int i = 0, c = 0; i < n; c += g.rows[i], ++i) col[i] = c;
    std::printf("\n## %s: %.1f MB, %d copies\n", g.name.c_str(), bytes / 1e6, copies);
    std::printf("| M | floor us | per weight | batched by shape | grouped |");
    for (int b : blocks) std::printf(" blocks of %d |", b);
    std::printf(" concat | best blocks / batched by shape | best blocks / concat |\n");
    for (int tokens : {1, 8, 16, 32, 64, 128, 512, 2048}) {
      for (int c = 0; c < copies; ++c) {
        std::vector<void*> host(3 * n);
        for (int j = 0; j < n; ++j) {
          const int i = order[j];
          host[j] = cs[c].w[i];
          host[n + j] = x;
          host[2 * n + j] = out + col[i];
        }
        CHECK(cudaMemcpy(tables[c], host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
        for (size_t b = 0; b < blocks.size(); ++b) {
          const int count = total / blocks[b];
          std::vector<void*> bt(3 * count);
          int j = 0;
          for (int i = 0; i < n; ++i) {
            for (int r = 0; r < g.rows[i]; r += blocks[b], ++j) {
              bt[j] = cs[c].w[i] + (int64_t)r * g.k;
              bt[count + j] = x;
              bt[2 * count + j] = out + col[i] + r;
            }
          }
          CHECK(cudaMemcpy(block_tables[b][c], bt.data(), bt.size() * sizeof(void*), cudaMemcpyHostToDevice));
        }
      }
      auto per_weight = [&](int c, T* o) {
        for (int i = 0; i < n; ++i)
          CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, g.rows[i], tokens, g.k, &one, cs[c].w[i],
                                    CUDA_R_16BF, g.k, x, CUDA_R_16BF, g.k, &zero, o + col[i], CUDA_R_16BF, total,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      auto batched = [&](int c, T*) {
        int first = 0;
        for (size_t s = 0; s < shape_rows.size(); ++s) {
          const int count = group_size[s];
          if (count == 1) {
            const int i = order[first];
            CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, g.rows[i], tokens, g.k, &one, cs[c].w[i],
                                      CUDA_R_16BF, g.k, x, CUDA_R_16BF, g.k, &zero, out + col[i], CUDA_R_16BF, total,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
          } else {
            void** t = tables[c];
            CUBLAS_CHECK(cublasGemmBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, shape_rows[s], tokens, g.k, &one,
                                             (const void* const*)(t + first), CUDA_R_16BF, g.k,
                                             (const void* const*)(t + n + first), CUDA_R_16BF, g.k, &zero,
                                             t + 2 * n + first, CUDA_R_16BF, total, count, CUBLAS_COMPUTE_32F,
                                             CUBLAS_GEMM_DEFAULT));
          }
          first += count;
        }
      };
      const int shapes = (int)shape_rows.size();
      std::vector<cublasOperation_t> ta(shapes, CUBLAS_OP_T), tb(shapes, CUBLAS_OP_N);
      std::vector<int> ms(shape_rows), ns(shapes, tokens), ks(shapes, g.k), ldas(shapes, g.k), ldbs(shapes, g.k),
          ldcs(shapes, total);
      std::vector<float> alphas(shapes, 1.f), betas(shapes, 0.f);
      auto grouped = [&](int c, T*) {
        void** t = tables[c];
        CUBLAS_CHECK(cublasGemmGroupedBatchedEx(handle, ta.data(), tb.data(), ms.data(), ns.data(), ks.data(),
                                                alphas.data(), (const void* const*)t, CUDA_R_16BF, ldas.data(),
                                                (const void* const*)(t + n), CUDA_R_16BF, ldbs.data(), betas.data(),
                                                t + 2 * n, CUDA_R_16BF, ldcs.data(), shapes, group_size.data(),
                                                CUBLAS_COMPUTE_32F));
      };
      auto concat = [&](int c, T* o) {
        CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, total, tokens, g.k, &one, cs[c].concat,
                                  CUDA_R_16BF, g.k, x, CUDA_R_16BF, g.k, &zero, o, CUDA_R_16BF, total,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      // reference: per weight into `ref`; each way into `out`, compared bitwise-close
      per_weight(0, ref);
      CHECK(cudaStreamSynchronize(stream));
      std::vector<T> want((size_t)tokens * total), got((size_t)tokens * total);
      CHECK(cudaMemcpy(want.data(), ref, want.size() * sizeof(T), cudaMemcpyDeviceToHost));
      std::vector<std::pair<std::string, std::function<void(int, T*)>>> ways = {
          {"per weight", per_weight}, {"batched", batched}, {"grouped", grouped}, {"concat", concat}};
      for (size_t b = 0; b < blocks.size(); ++b) {
        const int m = blocks[b], count = total / m;
        ways.push_back({"blocks" + std::to_string(m), [&, b, m, count](int c, T*) {
                          void** t = block_tables[b][c];
                          CUBLAS_CHECK(cublasGemmBatchedEx(
                              handle, CUBLAS_OP_T, CUBLAS_OP_N, m, tokens, g.k, &one, (const void* const*)t,
                              CUDA_R_16BF, g.k, (const void* const*)(t + count), CUDA_R_16BF, g.k, &zero,
                              t + 2 * count, CUDA_R_16BF, total, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                        }});
      }
      std::map<std::string, float> us;
      std::map<std::string, int> kernels;
      for (const auto& [name, call] : ways) {
        CHECK(cudaMemset(out, 0xff, got.size() * sizeof(T)));
        call(0, out);
        CHECK(cudaStreamSynchronize(stream));
        CHECK(cudaMemcpy(got.data(), out, got.size() * sizeof(T), cudaMemcpyDeviceToHost));
        const double error = tune::relative_squared_error(got, want);
        if (!(error <= 1e-4)) {
          std::printf("M=%d %s: WRONG (relative squared error %.3g)\n", tokens, name.c_str(), error);
          us[name] = -1;
          continue;
        }
        std::vector<cudaGraphExec_t> execs(copies);
        for (int c = 0; c < copies; ++c) {
          cudaGraph_t graph;
          CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          call(c, out);
          CHECK(cudaStreamEndCapture(stream, &graph));
          if (c == 0) kernels[name] = kernel_nodes(graph);
          CHECK(cudaGraphInstantiate(&execs[c], graph, 0));
          CHECK(cudaGraphDestroy(graph));
        }
        us[name] = tune::warm_us([&](int c) { CHECK(cudaGraphLaunch(execs[c], stream)); }, copies, 5);
        for (auto exec : execs) CHECK(cudaGraphExecDestroy(exec));
      }
      const double floor_us = 1e6 * (bytes + (double)tokens * (g.k + total) * 2) / copy_rate;
      std::printf("| %d | %.1f |", tokens, floor_us);
      float best = 1e30f;
      for (const char* name : {"per weight", "batched", "grouped"}) std::printf(" %.1f (%dk) |", us[name], kernels[name]);
      for (int b : blocks) {
        const std::string name = "blocks" + std::to_string(b);
        std::printf(" %.1f (%dk) |", us[name], kernels[name]);
        if (us[name] > 0) best = std::min(best, us[name]);
      }
      std::printf(" %.1f (%dk) | %.2fx | %.2fx |\n", us["concat"], kernels["concat"], best / us["batched"],
                  best / us["concat"]);
    }
    for (auto& c : cs) {
      for (T* w : c.w) CHECK(cudaFree(w));
      CHECK(cudaFree(c.concat));
    }
    for (auto t : tables) CHECK(cudaFree(t));
    for (auto& bt : block_tables) {
      for (auto t : bt) CHECK(cudaFree(t));
    }
    CHECK(cudaFree(out));
    CHECK(cudaFree(ref));
  }
  return 0;
}
