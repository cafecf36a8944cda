// Pointer tables of the batched cuBLAS GEMMs captured into CUDA graphs, written once at capture time.
//
// cublasGemmBatchedEx reads each problem's matrix pointers from device memory. Outside a capture the multi_linear
// binding writes that table with a small kernel before the GEMM (fill_pointer_table: capturable, nothing kept between
// calls). Inside a capture that kernel becomes a graph node, and every replay pays its launch and the GEMM's wait on
// it: on the H200 about 3 us per batched GEMM (K/V of 5 layers, 16 tokens: 28.4 us with the table kernel, 25.2
// without; BENCHMARKS.md "Row blocks"). A captured graph replays fixed addresses, so its tables never change: this
// cache copies each one to device memory while the graph is captured, and the graph holds only the GEMM.
//
// - Entries are keyed by the device and the table's contents (the pointers themselves), so an entry is valid for
//   every graph that captured it, and two captures of the same addresses share one. Entries are never freed: a graph
//   may be replayed for as long as the process lives. At most kMaxBytes of 1 MiB slabs per device (a table takes
//   24 bytes per problem: tens of thousands of tables); past that, callers fall back to the table kernel (correct,
//   one launch more).
// - The copy happens during the capture, outside it: this thread's capture mode is relaxed for the duration, the copy
//   goes through a private non-blocking stream that is synchronized before returning, so the table is in device
//   memory before the graph can ever be launched. That host wait happens once per new table and only at capture time;
//   an eager call never takes this path.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace dspark {
namespace mlinear {

class CapturedPointerTables {
 public:
  static constexpr size_t kMaxBytes = size_t{64} << 20;
  static constexpr size_t kSlabBytes = size_t{1} << 20;

  static CapturedPointerTables& instance() {
    static CapturedPointerTables* tables = new CapturedPointerTables();  // never destroyed: graphs outlive statics
    return *tables;
  }

  // The device copy of `pointers` on `device` (the current device), made now if it does not exist; nullptr when the
  // device's budget is spent.
  const void** get(int device, const std::vector<const void*>& pointers) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto key = std::make_pair(device, pointers);
    const auto found = tables_.find(key);
    if (found != tables_.end()) return found->second;
    const size_t bytes = pointers.size() * sizeof(void*);
    PerDevice& d = devices_[device];
    const bool new_slab = d.left < bytes;
    if (bytes > kSlabBytes || (new_slab && d.slabs_bytes + kSlabBytes > kMaxBytes)) return nullptr;
    RelaxedCapture relaxed;
    if (d.copy_stream == nullptr) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&d.copy_stream, cudaStreamNonBlocking));
    if (new_slab) {
      void* slab = nullptr;
      C10_CUDA_CHECK(cudaMalloc(&slab, kSlabBytes));
      d.next = static_cast<char*>(slab);
      d.left = kSlabBytes;
      d.slabs_bytes += kSlabBytes;
    }
    const void** table = reinterpret_cast<const void**>(d.next);
    C10_CUDA_CHECK(cudaMemcpyAsync(table, pointers.data(), bytes, cudaMemcpyHostToDevice, d.copy_stream));
    C10_CUDA_CHECK(cudaStreamSynchronize(d.copy_stream));
    const size_t used = (bytes + 15) / 16 * 16;  // keep every table 16-byte aligned
    d.next += used;
    d.left = d.left > used ? d.left - used : 0;
    tables_.emplace(key, table);
    return table;
  }

  // How many tables are held (all devices): what the tests read to see that a capture used the cache.
  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return tables_.size();
  }

 private:
  // This thread's stream-capture mode set to relaxed for the guard's lifetime (cudaMalloc and a synchronized copy
  // on another stream are refused in the global and thread-local modes while a capture is under way).
  struct RelaxedCapture {
    cudaStreamCaptureMode previous = cudaStreamCaptureModeRelaxed;
    RelaxedCapture() { C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&previous)); }
    ~RelaxedCapture() { C10_CUDA_CHECK_WARN(cudaThreadExchangeStreamCaptureMode(&previous)); }
  };
  struct PerDevice {
    cudaStream_t copy_stream = nullptr;
    char* next = nullptr;
    size_t left = 0;
    size_t slabs_bytes = 0;
  };

  std::mutex mutex_;
  std::map<std::pair<int, std::vector<const void*>>, const void**> tables_;
  std::map<int, PerDevice> devices_;
};

}  // namespace mlinear
}  // namespace dspark
