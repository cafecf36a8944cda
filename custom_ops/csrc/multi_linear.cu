// Torch binding of dspark::multi_linear on CUDA: the argument checks of custom_ops/multi_linear.py (same error class,
// same message), merging of weights that are adjacent in memory, and the choice between the small-T kernel
// (multi_linear_kernels.cuh) and per-weight cuBLAS GEMMs into the output's column blocks. Also the debug op
// dspark::_multi_linear_variant (forces a kernel variant and split; the benchmark sweep and the tests use it) and
// the C entry points through which Python reads the variant table and the token threshold.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "error_format.h"
#include "multi_linear_kernels.cuh"

namespace dspark {
namespace mlinear {
namespace {

// The switch between the two CUDA paths (fp32 and layouts the kernel cannot read always take cuBLAS, see
// kernel_blocker). Measured on the H200 (benchmarks/multi_linear_tune.cu and benchmarks/multi_linear.py, L2-cold
// weights) with default_variant's tiles: up to 16 tokens the kernel beats per-weight cuBLAS for every group
// (single weights 1.03-1.26x at 16 tokens); up to 32 tokens for groups of several weights of <= 4096 rows on
// average (KV of 5 layers 31 vs 51 us, q/k/v 22 vs 31 us; 2 x 12288 rows and single weights on par); at 64 tokens
// it is compute-bound (mma.sync fed from shared memory, 1-2 CTAs per SM) and cuBLAS wins or ties.
constexpr int64_t kTokenThreshold = 16;
constexpr int64_t kGroupTokenThreshold = 32;
constexpr int64_t kGroupMaxMeanRows = 4096;
static_assert(kGroupTokenThreshold <= kMaxTokens, "the kernel handles at most kMaxTokens tokens");

// Whether a call with `tokens` rows of x over `runs` row ranges (after merging adjacent ones) of `rows` rows in all
// takes the kernel.
bool kernel_pays(int64_t tokens, int64_t runs, int64_t rows) {
  if (tokens <= kTokenThreshold) return true;
  return tokens <= kGroupTokenThreshold && runs >= 2 && rows <= kGroupMaxMeanRows * runs;
}

using Biases = c10::List<std::optional<at::Tensor>>;

// ------------------------------------------------------------------------------------------------ checks

std::string shape_of(c10::IntArrayRef sizes) {  // as Python prints tuple(t.shape)
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + (sizes.size() == 1 ? ",)" : ")");
}

std::string dtype_of(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

void check_weight(const at::Tensor& x, const at::Tensor& w, size_t i, int64_t start, int64_t count) {
  const std::string name = "multi_linear: weights[" + num(i) + "]";
  TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == x.size(1), name, " must be [R, ", num(x.size(1)), "] (x is ",
                    shape_of(x.sizes()), "), got ", shape_of(w.sizes()));
  TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type(), name, " dtype ", dtype_of(w.scalar_type()),
                   " differs from x dtype ", dtype_of(x.scalar_type()));
  TORCH_CHECK_VALUE(w.device() == x.device(), name, " is on ", w.device().str(), ", x is on ", x.device().str());
  TORCH_CHECK_VALUE(start >= 0 && count >= 0 && start + count <= w.size(0), "multi_linear: rows [", num(start), ", ",
                    num(start + count), ") of weights[", num(i), "] are out of range (it has ", num(w.size(0)),
                    " rows)");
}

void check_bias(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, size_t i) {
  TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == w.size(0) && b.scalar_type() == x.scalar_type() &&
                        b.device() == x.device(),
                    "multi_linear: biases[", num(i), "] must be [", num(w.size(0)), "] ", dtype_of(x.scalar_type()),
                    " on ", x.device().str(), ", got ", shape_of(b.sizes()), " ", dtype_of(b.scalar_type()), " on ",
                    b.device().str());
}

// The structural checks of custom_ops.multi_linear._check_args, in the same order with the same messages.
void check_args(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts, at::IntArrayRef counts,
                const Biases& biases) {
  TORCH_CHECK_VALUE(x.dim() == 2, "multi_linear: x must be 2-D [T, K], got shape ", shape_of(x.sizes()));
  const size_t n = weights.size();
  TORCH_CHECK_VALUE(n > 0, "multi_linear: weights must hold at least one tensor");
  TORCH_CHECK_VALUE(starts.size() == n && counts.size() == n && biases.size() == n,
                    "multi_linear: weights, row_starts, row_counts and biases must have the same length, got ", num(n),
                    ", ", num(starts.size()), ", ", num(counts.size()), ", ", num(biases.size()));
  for (size_t i = 0; i < n; ++i) {
    check_weight(x, weights[i], i, starts[i], counts[i]);
    const std::optional<at::Tensor> b = biases.get(i);
    if (b.has_value()) check_bias(x, weights[i], *b, i);
  }
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

Run run_of(const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t start, int64_t count, int64_t col,
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
bool continues(const Run& run, const Run& next, int64_t esize) {
  if (!run.unit_inner || !next.unit_inner || run.weight_stride != next.weight_stride) return false;
  if (run.weight + run.rows * run.weight_stride * esize != next.weight) return false;
  if ((run.bias == nullptr) != (next.bias == nullptr)) return false;
  return run.bias == nullptr ||
         (run.bias_stride == next.bias_stride && run.bias + run.rows * run.bias_stride * esize == next.bias);
}

// The non-empty row ranges in output order, adjacent ones merged (a loader that allocated the weights back to back,
// or views of one packed tensor, gives one run: one GEMM / one kernel segment).
std::vector<Run> collect_runs(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts,
                              at::IntArrayRef counts, const Biases& biases) {
  const int64_t esize = static_cast<int64_t>(x.element_size());
  std::vector<Run> runs;
  int64_t col = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (counts[i] == 0) continue;
    const Run r = run_of(weights[i], biases.get(i), starts[i], counts[i], col, static_cast<int64_t>(i));
    if (!runs.empty() && continues(runs.back(), r, esize)) {
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

at::Tensor blob(const char* data, at::IntArrayRef sizes, at::IntArrayRef strides, const at::Tensor& like) {
  return at::for_blob(const_cast<char*>(data), sizes)
      .strides(strides)
      .options(like.options())
      .target_device(like.device())
      .make_tensor();
}

// One mm / addmm per run straight into its column block of `out` (a merged run is viewed as one weight).
void run_cublas(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts, const Biases& biases,
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int device_attribute(cudaDeviceAttr attr, const at::Device& device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device.index()));
  return value;
}

// Why the kernel cannot run this call (nullptr: it can). x's own layout never blocks it (see kernel_activation).
const char* kernel_blocker(const at::Tensor& x, const std::vector<Run>& runs) {
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
at::Tensor kernel_activation(const at::Tensor& x) {
  const int64_t esize = static_cast<int64_t>(x.element_size());
  const bool ok = x.stride(1) == 1 && aligned16(x.data_ptr()) && (x.size(0) == 1 || (x.stride(0) * esize) % 16 == 0);
  return ok ? x : x.clone(at::MemoryFormat::Contiguous);
}

// Programmatic dependent launch (the host only runs the kernel on sm_90+) and a cluster of `split` CTAs per tile,
// also for split 1, so the kernel's cluster registers always describe a real cluster launch.
void launch(KernelFn kernel, const Params& p, int64_t blocks, int threads, int smem, int split,
            const at::Device& device) {
  cudaLaunchAttribute attrs[2] = {};
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = static_cast<unsigned>(split);
  attrs[1].val.clusterDim.y = 1;
  attrs[1].val.clusterDim.z = 1;
  if (smem > 48 * 1024) {  // above the default limit the kernel must opt in (per kernel, cheap, not a stream op)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = c10::cuda::getCurrentCUDAStream(device.index());
  config.attrs = attrs;
  config.numAttrs = 2;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

// One launch per kMaxSegments runs (the parameter table is fixed-size); each writes its own output columns.
// variant -1 / split 0: the defaults for the launch's rows (default_variant, auto_split).
template <typename T>
void run_kernel(const at::Tensor& x, const std::vector<Run>& runs, at::Tensor& out, int variant, int split) {
  const int tokens = static_cast<int>(x.size(0));
  const int k = static_cast<int>(x.size(1));
  const int64_t esize = static_cast<int64_t>(x.element_size());
  const int sm_count = device_attribute(cudaDevAttrMultiProcessorCount, x.device());
  for (size_t first = 0; first < runs.size(); first += kMaxSegments) {
    const size_t count = std::min<size_t>(kMaxSegments, runs.size() - first);
    Params p{};
    p.x = x.data_ptr();
    p.x_stride = x.stride(0);
    p.out = static_cast<char*>(out.data_ptr()) + runs[first].col * esize;
    p.out_stride = out.stride(0);
    p.tokens = tokens;
    p.k = k;
    p.num_segments = static_cast<int>(count);
    int64_t rows = 0;
    for (size_t j = 0; j < count; ++j) {
      const Run& r = runs[first + j];
      rows += r.rows;
      p.segment_end[j] = rows;
      p.weight[j] = r.weight;
      p.weight_stride[j] = r.weight_stride;
      p.bias[j] = r.bias;
      p.bias_stride[j] = r.bias_stride;
    }
    const int vi = variant >= 0 ? variant : default_variant(rows, k, sm_count);
    const Variant& v = kVariants[vi];
    const int s = split > 0 ? split : auto_split(v, rows, k, sm_count);
    const int64_t tiles = (rows + cta_rows(v) - 1) / cta_rows(v);
    launch(kernel_for<T>(vi, tokens), p, tiles * s, cta_threads(v), smem_bytes(v, token_tiles(tokens)), s, x.device());
  }
}

void dispatch_kernel(const at::Tensor& x, const std::vector<Run>& runs, at::Tensor& out, int variant, int split) {
  const at::Tensor activation = kernel_activation(x);
  if (x.scalar_type() == at::kBFloat16) {
    run_kernel<__nv_bfloat16>(activation, runs, out, variant, split);
  } else {
    run_kernel<__half>(activation, runs, out, variant, split);
  }
}

int64_t total_rows(at::IntArrayRef counts) {
  int64_t total = 0;
  for (const int64_t c : counts) total += c;
  return total;
}

// ------------------------------------------------------------------------------------------------ ops

at::Tensor multi_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef row_starts,
                        at::IntArrayRef row_counts, const Biases& biases) {
  check_args(x, weights, row_starts, row_counts, biases);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), total_rows(row_counts)}, x.options());
  if (out.numel() == 0) return out;
  const std::vector<Run> runs = collect_runs(x, weights, row_starts, row_counts, biases);
  const int64_t rows = out.size(1);
  if (kernel_pays(x.size(0), static_cast<int64_t>(runs.size()), rows) && kernel_blocker(x, runs) == nullptr) {
    dispatch_kernel(x, runs, out, -1, 0);
  } else {
    run_cublas(x, weights, row_starts, biases, runs, out);
  }
  return out;
}

// The kernel with a forced variant (-1: the default one) and cluster split (0: automatic), for any token count up to
// kMaxTokens; raises ValueError where the kernel cannot run.
at::Tensor multi_linear_variant(const at::Tensor& x, at::TensorList weights, at::IntArrayRef row_starts,
                                at::IntArrayRef row_counts, const Biases& biases, int64_t variant, int64_t split) {
  check_args(x, weights, row_starts, row_counts, biases);
  TORCH_CHECK_VALUE(variant >= -1 && variant < kNumVariants, "_multi_linear_variant: variant must be in [-1, ",
                    num(kNumVariants), "), got ", num(variant));
  TORCH_CHECK_VALUE(split >= 0 && split <= kMaxSplit, "_multi_linear_variant: split must be in [0, ", num(kMaxSplit),
                    "], got ", num(split));
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), total_rows(row_counts)}, x.options());
  if (out.numel() == 0) return out;
  const std::vector<Run> runs = collect_runs(x, weights, row_starts, row_counts, biases);
  const char* blocker = kernel_blocker(x, runs);
  TORCH_CHECK_VALUE(blocker == nullptr, "_multi_linear_variant: the kernel cannot run this call: ", blocker);
  dispatch_kernel(x, runs, out, static_cast<int>(variant), static_cast<int>(split));
  return out;
}

}  // namespace
}  // namespace mlinear
}  // namespace dspark

TORCH_LIBRARY_IMPL(dspark, CUDA, m) {
  m.impl("multi_linear", &dspark::mlinear::multi_linear);
  m.impl("_multi_linear_variant", &dspark::mlinear::multi_linear_variant);
}

// Read by custom_ops/multi_linear.py through ctypes (kernel_token_threshold, uses_kernel, kernel_variants).
extern "C" __attribute__((visibility("default"))) int dspark_multi_linear_token_threshold() {
  return static_cast<int>(dspark::mlinear::kTokenThreshold);
}

extern "C" __attribute__((visibility("default"))) int dspark_multi_linear_uses_kernel(int64_t tokens, int64_t runs,
                                                                                      int64_t rows) {
  return dspark::mlinear::kernel_pays(tokens, runs, rows) ? 1 : 0;
}

extern "C" __attribute__((visibility("default"))) int dspark_multi_linear_num_variants() {
  return dspark::mlinear::kNumVariants;
}

// Writes m_tiles, row_warps, k_warps, stages of variant `index` to fields[0..3]; returns 0, or -1 for a bad index.
extern "C" __attribute__((visibility("default"))) int dspark_multi_linear_variant(int index, int* fields) {
  if (index < 0 || index >= dspark::mlinear::kNumVariants) return -1;
  const dspark::mlinear::Variant& v = dspark::mlinear::kVariants[index];
  fields[0] = v.m_tiles;
  fields[1] = v.row_warps;
  fields[2] = v.k_warps;
  fields[3] = v.stages;
  return 0;
}
