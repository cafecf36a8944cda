// Host side shared by the multi_linear bindings (multi_linear.cu, multi_linear_kv_write.cu): the row ranges of a
// call ("runs", adjacent ones merged), the per-run cuBLAS path, whether the kernel can read a call, and the cluster
// launch with programmatic dependent launch.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "linear/multi_linear_kernels.cuh"

namespace dspark {
namespace mlinear {

using Biases = c10::List<std::optional<at::Tensor>>;

inline std::string shape_of(c10::IntArrayRef sizes) {  // as Python prints tuple(t.shape)
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + (sizes.size() == 1 ? ",)" : ")");
}

inline std::string dtype_of(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

// An argument's name with its index, e.g. `k_weights[3]` (or without one, e.g. `positions`: index kNoIndex): nothing
// is formatted unless a check fails (the TORCH_CHECK macros build their message only then), so a call that passes its
// checks builds no strings. The index goes through std::to_string, never streamed as a number (common/error_format.h
// says why).
struct Indexed {
  static constexpr size_t kNoIndex = static_cast<size_t>(-1);
  const char* head;
  const char* tail = "";
  size_t index = kNoIndex;
};
inline std::ostream& operator<<(std::ostream& out, const Indexed& a) {
  out << a.head << a.tail;
  return a.index == Indexed::kNoIndex ? out : out << "[" + std::to_string(a.index) + "]";
}

// ------------------------------------------------------------------------------------------------ runs

// Output columns [col, col + rows) come from `rows` weight rows at `weight` (row stride `weight_stride` elements)
// and, if `bias` is set, bias elements at `bias` (stride `bias_stride`): one weight's row range (`source` = its index)
// or the row ranges of consecutive weights that lie back to back in memory (`source` = -1).
struct Run {
  const char* weight;
  int64_t weight_stride;
  bool unit_inner;  // unit stride along K
  const char* bias;
  int64_t bias_stride;
  int64_t rows;
  int64_t col;
  int64_t source;
};

inline Run run_of(const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t start, int64_t count, int64_t col,
           int64_t source) {
  const int64_t esize = static_cast<int64_t>(w.element_size());
  Run r{};
  r.weight = static_cast<const char*>(w.data_ptr()) + start * w.stride(0) * esize;
  r.weight_stride = w.stride(0);
  r.unit_inner = w.size(1) <= 1 || w.stride(1) == 1;
  if (b.has_value()) {
    r.bias = static_cast<const char*>(b->data_ptr()) + start * b->stride(0) * esize;
    r.bias_stride = b->stride(0);
  }
  r.rows = count;
  r.col = col;
  r.source = source;
  return r;
}

// Whether `next` continues `run` in memory: same strides, its first row (and bias element) right after the run's
// last, both with or both without bias.
inline bool continues(const Run& run, const Run& next, int64_t esize) {
  if (!run.unit_inner || !next.unit_inner || run.weight_stride != next.weight_stride) return false;
  if (run.weight + run.rows * run.weight_stride * esize != next.weight) return false;
  if ((run.bias == nullptr) != (next.bias == nullptr)) return false;
  return run.bias == nullptr ||
         (run.bias_stride == next.bias_stride && run.bias + run.rows * run.bias_stride * esize == next.bias);
}

// The non-empty row ranges in output order, adjacent ones merged unless `merge` is false (a loader that allocated the
// weights back to back, or views of one packed tensor, gives one run: one GEMM / one kernel segment).
inline std::vector<Run> collect_runs(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts,
                              at::IntArrayRef counts, const Biases& biases, bool merge = true) {
  const int64_t esize = static_cast<int64_t>(x.element_size());
  std::vector<Run> runs;
  int64_t col = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (counts[i] == 0) continue;
    const Run r = run_of(weights[i], biases.get(i), starts[i], counts[i], col, static_cast<int64_t>(i));
    if (merge && !runs.empty() && continues(runs.back(), r, esize)) {
      runs.back().rows += r.rows;
      runs.back().source = -1;
    } else {
      runs.push_back(r);
    }
    col += counts[i];
  }
  return runs;
}

// ------------------------------------------------------------------------------------------------ cuBLAS path

inline at::Tensor blob(const char* data, at::IntArrayRef sizes, at::IntArrayRef strides, const at::Tensor& like) {
  return at::for_blob(const_cast<char*>(data), sizes)
      .strides(strides)
      .options(like.options())
      .target_device(like.device())
      .make_tensor();
}

// One mm / addmm per run straight into its column block of `out` (a merged run is viewed as one weight).
inline void run_cublas(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts, const Biases& biases,
                const std::vector<Run>& runs, at::Tensor& out) {
  for (const Run& r : runs) {
    at::Tensor block = out.narrow(1, r.col, r.rows);
    at::Tensor w, b;
    if (r.source >= 0) {
      const int64_t start = starts[r.source];
      w = weights[r.source].narrow(0, start, r.rows);
      const std::optional<at::Tensor> bias = biases.get(r.source);
      if (bias.has_value()) b = bias->narrow(0, start, r.rows);
    } else {
      w = blob(r.weight, {r.rows, x.size(1)}, {r.weight_stride, 1}, x);
      if (r.bias != nullptr) b = blob(r.bias, {r.rows}, {r.bias_stride}, x);
    }
    if (b.defined()) {
      at::addmm_out(block, b, x, w.t());
    } else {
      at::mm_out(block, x, w.t());
    }
  }
}

// ------------------------------------------------------------------------------------------------ kernel path

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int device_attribute(cudaDeviceAttr attr, const at::Device& device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device.index()));
  return value;
}

// Why the kernel cannot run this call (nullptr: it can). x's own layout never blocks it (see kernel_activation).
inline const char* kernel_blocker(const at::Tensor& x, const std::vector<Run>& runs) {
  const auto dtype = x.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return "x must be bfloat16 or float16";
  static_assert(kMaxTokens == 64, "the message below names the largest token tile");
  if (x.size(0) > kMaxTokens) return "x has more rows than the kernel's largest token tile (64)";
  if (x.size(1) == 0 || x.size(1) % 8 != 0) return "K must be a positive multiple of 8";
  if (device_attribute(cudaDevAttrComputeCapabilityMajor, x.device()) < 9) return "the GPU must be sm_90 or newer";
  const int64_t esize = static_cast<int64_t>(x.element_size());
  for (const Run& r : runs) {
    if (!r.unit_inner || !aligned16(r.weight) || (r.rows > 1 && (r.weight_stride * esize) % 16 != 0)) {
      return "every weight row range must have unit inner stride and 16-byte aligned rows";
    }
  }
  return nullptr;
}

// x itself when its rows are 16-byte aligned with unit inner stride, else a contiguous copy (T x K, small).
inline at::Tensor kernel_activation(const at::Tensor& x) {
  const int64_t esize = static_cast<int64_t>(x.element_size());
  const bool ok = x.stride(1) == 1 && aligned16(x.data_ptr()) && (x.size(0) == 1 || (x.stride(0) * esize) % 16 == 0);
  return ok ? x : x.clone(at::MemoryFormat::Contiguous);
}

// Whether launches on `device` may ask for programmatic dependent launch and clusters (sync_launch, common/pdl.cuh).
inline bool syncs_on(const at::Device& device) {
  return sync_launch(device_attribute(cudaDevAttrComputeCapabilityMajor, device),
                     device_attribute(cudaDevAttrComputeCapabilityMinor, device));
}

// Lets `kernel` launch with `smem` bytes of dynamic shared memory on `device` (above the default 48 KB it must opt
// in): cudaFuncSetAttribute once per kernel, device and larger size, not on every launch.
inline void allow_smem(const void* kernel, int smem, c10::DeviceIndex device) {
  static std::mutex lock;
  static std::map<std::pair<const void*, c10::DeviceIndex>, int> allowed;  // the largest size set so far
  const std::lock_guard<std::mutex> guard(lock);
  int& size = allowed[{kernel, device}];
  if (smem <= size) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  size = smem;
}

// Where the GPU runs the sm_90a code (syncs_on): programmatic dependent launch and a cluster of `split` CTAs per tile,
// also for split 1, so the kernel's cluster registers always describe a real cluster launch. Elsewhere a plain launch
// of one CTA per tile (split must be 1): the kernel's PTX there has no cluster and no dependency wait.
template <typename Args>
inline void launch(void (*kernel)(Args), const Args& p, int64_t blocks, int threads, int smem, int split,
                   const at::Device& device) {
  const bool syncs = syncs_on(device);
  TORCH_INTERNAL_ASSERT(split == 1 || syncs, "a cluster split needs the sm_90a code");
  cudaLaunchAttribute attrs[2] = {};
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = static_cast<unsigned>(split);
  attrs[1].val.clusterDim.y = 1;
  attrs[1].val.clusterDim.z = 1;
  if (smem > 48 * 1024) allow_smem(reinterpret_cast<const void*>(kernel), smem, device.index());
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = c10::cuda::getCurrentCUDAStream(device.index());
  config.attrs = attrs;
  config.numAttrs = syncs ? 2 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

}  // namespace mlinear
}  // namespace dspark
