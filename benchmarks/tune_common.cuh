// What the standalone kernel sweeps (benchmarks/*_tune.cu) share: error checks, random bf16 fills, a plain read of a
// buffer (the read ceiling of a launch), back-to-back timing with CUDA events and the op's launch (a cluster of
// `split` CTAs, programmatic dependent launch on).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e = (x);                                                                     \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

namespace tune {

// p[i] = uniform in [-scale / 2, scale / 2), from a hash of i and `seed` (never zeros: they run faster).
__global__ void fill_kernel(__nv_bfloat16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * scale);
  }
}

// Pure read of n 16-byte vectors (8 loads in flight per thread); the xor keeps the loads alive.
__global__ void read_kernel(const uint4* p, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldcs(p + i + j * stride);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median over 7 runs of `reps` x `copies` back-to-back calls `call(copy)`, after one call per copy; µs per call.
template <typename F>
float warm_us(F&& call, int copies, int reps) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < copies; ++i) call(i);
  std::vector<float> runs;
  for (int run = 0; run < 7; ++run) {
    CHECK(cudaEventRecord(a));
    for (int r = 0; r < reps; ++r)
      for (int i = 0; i < copies; ++i) call(i);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    runs.push_back(1e3f * ms / (reps * copies));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return median(runs);
}

// Median over 7 x `copies` single calls, each after an L2 flush, events around the call only; µs.
template <typename F>
float cold_us(F&& call, int copies, void* flush, size_t flush_bytes) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> runs;
  for (int run = 0; run < 7 * copies; ++run) {
    CHECK(cudaMemsetAsync(flush, run & 0xff, flush_bytes));
    CHECK(cudaEventRecord(a));
    call(run % copies);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    runs.push_back(1e3f * ms);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return median(runs);
}

// `kernel(args)` on `blocks` CTAs of `threads` threads as the op launches it: clusters of `split` CTAs, programmatic
// dependent launch allowed, `smem` bytes of dynamic shared memory (opted in above 48 KB).
template <typename Args>
void launch(void (*kernel)(Args), const Args& args, int64_t blocks, int threads, int smem, int split) {
  if (smem > 48 * 1024) CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchAttribute attrs[2] = {};
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = split;
  attrs[1].val.clusterDim.y = 1;
  attrs[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = dim3((unsigned)blocks);
  c.blockDim = dim3(threads);
  c.dynamicSmemBytes = smem;
  c.attrs = attrs;
  c.numAttrs = 2;
  CHECK(cudaLaunchKernelEx(&c, kernel, args));
}

}  // namespace tune
