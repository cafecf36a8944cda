// Torch binding of dspark::multi_linear on CUDA: the argument checks of custom_ops/linear/multi_linear.py (same error
// class, same message), merging of weights that are adjacent in memory, and the choice between the small-T kernel
// (multi_linear_kernels.cuh) and per-weight cuBLAS GEMMs into the output's column blocks. Also the debug op
// dspark::_multi_linear_variant (forces a kernel variant and split; the benchmark sweep and the tests use it) and the C
// entry points through which Python reads the variant table and the token threshold.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "common/error_format.h"
#include "linear/multi_linear_host.h"

namespace dspark {
namespace mlinear {
namespace {

// The switch between the two CUDA paths (fp32 and layouts the kernel cannot read always take cuBLAS, see
// kernel_blocker). Measured on the H200 (benchmarks/multi_linear_tune.cu and benchmarks/multi_linear.py, L2-cold
// weights) with default_variant's tiles: up to 8 tokens the kernel beats per-weight cuBLAS for every group
// (1.04-1.8x); up to 32 tokens for groups of several weights of <= 4096 rows on average (KV of 5 layers 31 vs 51
// us, q/k/v 22 vs 31 us); single weights and 2 x 12288 rows measured 0.95-1.03x at 16 tokens, so they stay on
// cuBLAS; at 64 tokens the kernel is compute-bound (mma.sync fed from shared memory, 1-2 CTAs per SM) and cuBLAS
// wins or ties.
constexpr int64_t kTokenThreshold = 8;
constexpr int64_t kGroupTokenThreshold = 32;
constexpr int64_t kGroupMaxMeanRows = 4096;
static_assert(kGroupTokenThreshold <= kMaxTokens, "the kernel handles at most kMaxTokens tokens");

// Whether a call with `tokens` rows of x over `runs` row ranges (after merging adjacent ones) of `rows` rows in all
// takes the kernel.
bool kernel_pays(int64_t tokens, int64_t runs, int64_t rows) {
  if (tokens <= kTokenThreshold) return true;
  return tokens <= kGroupTokenThreshold && runs >= 2 && rows <= kGroupMaxMeanRows * runs;
}

// ------------------------------------------------------------------------------------------------ checks

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

// The structural checks of custom_ops.linear.multi_linear._check_args, in the same order with the same messages.
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

// Read by custom_ops/linear/multi_linear.py through ctypes (kernel_token_threshold, uses_kernel, kernel_variants).
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
