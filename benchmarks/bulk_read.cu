// The copy-engine read of bulk_read.cuh as a C entry point, for benchmarks/_read_floor.py (ctypes; no torch headers,
// so it builds in seconds): it compiles this file into a shared library with
//
//   nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -cudart shared -gencode=arch=compute_90a,code=sm_90a \
//        benchmarks/bulk_read.cu -o bulk_read.so
//
// and launches the read on torch's current stream, also while it captures a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>

#include "bulk_read.cuh"

namespace {

template <int kBytes>
cudaError_t launch(const char* src, int64_t n, int ctas, uint32_t* sums, cudaStream_t stream) {
  static const cudaError_t opted_in =
      cudaFuncSetAttribute(dspark::bulk_read_kernel<kBytes>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           dspark::kBulkSmemBytes);
  if (opted_in != cudaSuccess) return opted_in;
  dspark::bulk_read_kernel<kBytes><<<ctas, 32, dspark::kBulkSmemBytes, stream>>>(src, n, sums);
  return cudaGetLastError();
}

}  // namespace

// Reads the `n` bytes at `src` (both multiples of 16) with `ctas` CTAs in copies of `copy_bytes` (4096 or 16384) on
// `stream`, writing each lane's sum of the 32-bit words it read to sums[0..32 ctas). Returns a cudaError_t (0:
// launched; cudaErrorInvalidValue for arguments outside those).
extern "C" __attribute__((visibility("default"))) int dspark_bulk_read(const void* src, int64_t n, int ctas,
                                                                        int copy_bytes, uint32_t* sums,
                                                                        void* stream) {
  const char* bytes = static_cast<const char*>(src);
  const auto s = static_cast<cudaStream_t>(stream);
  if (n <= 0 || n % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 || ctas < 1) return cudaErrorInvalidValue;
  switch (copy_bytes) {
    case 4096:
      return launch<4096>(bytes, n, ctas, sums, s);
    case 16384:
      return launch<16384>(bytes, n, ctas, sums, s);
    default:
      return cudaErrorInvalidValue;
  }
}
