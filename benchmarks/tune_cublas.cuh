// What the standalone sweeps that call cuBLAS share (benchmarks/cublas_paths_tune.cu, benchmarks/multi_linear_tune.cu):
// its status check and a handle on a blocking stream with a workspace. Build them with cuBLAS from the CUDA wheels
// torch depends on (`bash scripts/gpu_check.sh tune` passes the flags):
//
//   C=$(python3 -c 'import nvidia.cu13; print(list(nvidia.cu13.__path__)[0])')
//   nvcc ... -I$C/include <harness>.cu -L$C/lib -l:libcublas.so.13 -Xlinker -rpath=$C/lib
#pragma once

#include <cublas_v2.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tune_common.cuh"

#define CUBLAS_CHECK(x)                                                                      \
  do {                                                                                       \
    cublasStatus_t status_ = (x);                                                            \
    if (status_ != CUBLAS_STATUS_SUCCESS) {                                                  \
      std::fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)status_); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

namespace tune {

// A cuBLAS handle on a blocking stream (tune::warm_us times it from the legacy stream) with a 32 MB workspace.
inline cublasHandle_t cublas_handle() {
  cublasHandle_t handle;
  CUBLAS_CHECK(cublasCreate(&handle));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  CUBLAS_CHECK(cublasSetStream(handle, stream));
  void* workspace;
  CHECK(cudaMalloc(&workspace, 32 << 20));
  CUBLAS_CHECK(cublasSetWorkspace(handle, workspace, 32 << 20));
  return handle;
}

// sum((got - want)^2) / sum(want^2) of two bf16 outputs: a GEMM way's output against the reference GEMM's.
inline double relative_squared_error(const std::vector<__nv_bfloat16>& got, const std::vector<__nv_bfloat16>& want) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = (double)__bfloat162float(got[i]) - __bfloat162float(want[i]);
    err += d * d;
    norm += (double)__bfloat162float(want[i]) * __bfloat162float(want[i]);
  }
  return err / norm;
}

}  // namespace tune
