// Torch binding of dspark::multi_linear on CUDA: the argument checks of custom_ops/linear/multi_linear.py (same error
// class, same message), merging of weights that are adjacent in memory, and the choice between the small-T kernel
// (multi_linear_kernels.cuh) and per-weight cuBLAS GEMMs into the output's column blocks. Also the debug op
// dspark::_multi_linear_variant (forces a kernel variant and split; the benchmark sweep and the tests use it) and the C
// entry points through which Python reads the variant table and the token threshold.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "common/error_format.h"
#include "linear/multi_linear_host.h"

namespace dspark {
namespace mlinear {
namespace {

// The switch between the CUDA paths (fp32 and layouts the kernel cannot read always take cuBLAS, see
// kernel_blocker). Measured on the H200 (benchmarks/multi_linear.py: separate weights, L2-cold, CUDA-graph replay;
// BENCHMARKS.md) with default_variant's tiles:
// - up to 8 tokens the kernel beats per-weight cuBLAS for every group (1.04-1.8x) and ties or beats the batched
//   GEMM, except by 2-3 % where every range has one shape (KV of 5 layers: 27.7 vs 27.0 us at 1 token);
// - up to 32 tokens it still wins for groups of several ranges of <= 4096 rows on average that cuBLAS cannot batch
//   whole (q/k/v at 16 tokens: 20.4 us against 26.8 batched and 31.8 per weight), while a group of one shape is
//   faster batched (KV at 16: 27.8 vs 30.2 us) and single weights and 2 x 12288 rows tie or lose (0.95-1.03x);
// - at 64 tokens the kernel is compute-bound (mma.sync fed from shared memory, 1-2 CTAs per SM): cuBLAS.
constexpr int64_t kTokenThreshold = 8;
constexpr int64_t kGroupTokenThreshold = 32;
constexpr int64_t kGroupMaxMeanRows = 4096;
static_assert(kGroupTokenThreshold <= kMaxTokens, "the kernel handles at most kMaxTokens tokens");

// Whether a call with `tokens` rows of x over `runs` row ranges (after merging adjacent ones) of `rows` rows in all
// takes the kernel; `all_batched()`: the cuBLAS path would batch every range (see batches_every_run), asked only when
// the answer matters (8 < tokens <= 32, several ranges), so a decode call does not group its ranges by shape.
template <typename AllBatched>
bool kernel_pays(int64_t tokens, int64_t runs, int64_t rows, AllBatched&& all_batched) {
  if (tokens <= kTokenThreshold) return true;
  return tokens <= kGroupTokenThreshold && runs >= 2 && rows <= kGroupMaxMeanRows * runs && !all_batched();
}

// ------------------------------------------------------------------------------------------------ checks

void check_weight(const at::Tensor& x, const at::Tensor& w, size_t i, int64_t start, int64_t count) {
  const Indexed name{"multi_linear: weights", "", i};
  TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == x.size(1), name, " must be [R, ", num(x.size(1)), "] (x is ",
                    shape_of(x.sizes()), "), got ", shape_of(w.sizes()));
  TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type(), name, " dtype ", dtype_of(w.scalar_type()),
                   " differs from x dtype ", dtype_of(x.scalar_type()));
  TORCH_CHECK_VALUE(w.device() == x.device(), name, " is on ", w.device().str(), ", x is on ", x.device().str());
  TORCH_CHECK_VALUE(count >= 0, "multi_linear: row_counts[", num(i), "] must be >= 0, got ", num(count));
  TORCH_CHECK_VALUE(start >= 0 && start + count <= w.size(0), "multi_linear: row_starts[", num(i), "] = ", num(start),
                    ": rows [", num(start), ", ", num(start + count), ") of weights[", num(i),
                    "] are out of range (it has ", num(w.size(0)), " rows)");
}

void check_bias(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, size_t i) {
  const Indexed name{"multi_linear: biases", "", i};
  TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == w.size(0), name, " must be [", num(w.size(0)),
                    "] (one entry per row of weights[", num(i), "]), got ", shape_of(b.sizes()));
  TORCH_CHECK_TYPE(b.scalar_type() == x.scalar_type(), name, " dtype ", dtype_of(b.scalar_type()),
                   " differs from x dtype ", dtype_of(x.scalar_type()));
  TORCH_CHECK_VALUE(b.device() == x.device(), name, " is on ", b.device().str(), ", x is on ", x.device().str());
}

void check_length(const char* name, size_t length, size_t n) {
  TORCH_CHECK_VALUE(length == n, "multi_linear: ", name, " must hold one entry per weight (", num(n),
                    ", the length of weights), got ", num(length));
}

// The structural checks of custom_ops.linear.multi_linear._check_args, in the same order with the same messages.
void check_args(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts, at::IntArrayRef counts,
                const Biases& biases) {
  TORCH_CHECK_VALUE(x.dim() == 2, "multi_linear: x must be 2-D [T, K], got shape ", shape_of(x.sizes()));
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
                   "multi_linear: x must be bfloat16, float16 or float32, got ", dtype_of(dtype));
  const size_t n = weights.size();
  TORCH_CHECK_VALUE(n > 0, "multi_linear: weights must hold at least one tensor");
  check_length("row_starts", starts.size(), n);
  check_length("row_counts", counts.size(), n);
  check_length("biases", biases.size(), n);
  for (size_t i = 0; i < n; ++i) {
    check_weight(x, weights[i], i, starts[i], counts[i]);
    const std::optional<at::Tensor> b = biases.get(i);
    if (b.has_value()) check_bias(x, weights[i], *b, i);
  }
}

// ------------------------------------------------------------------------------------------------ batched cuBLAS

// Runs of one shape (rows, row stride, no bias) are one cublasGemmBatchedEx instead of one GEMM each: one launch (and
// one split-K reduction) for the whole group, its tiles filling the GPU together. cuBLAS reads the per-GEMM pointers
// from device memory; fill_pointer_table writes them there from its by-value parameter (no host-to-device copy, no
// sync, nothing kept between calls: capturable, and a CUDA graph replays the pointers it captured).
struct PointerTable {
  const void* weight[kMaxSegments];  // A of GEMM i: the run's first weight row
  void* out[kMaxSegments];           // C of GEMM i: the run's column block of out
  const void* x;                     // B of every GEMM
  int count;
};

__global__ void fill_pointer_table(const __grid_constant__ PointerTable t, const void** table) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < t.count) {
    table[i] = t.weight[i];
    table[t.count + i] = t.x;
    table[2 * t.count + i] = t.out[i];
  }
}

// cuBLAS reads the batched GEMM's matrix pointers from device memory, so it cannot check them, and picks kernels that
// assume every matrix starts 16-byte aligned with rows a multiple of 16 bytes apart: on the H200 (bf16, T = 16,
// K = 4096) an activation 2 bytes off returned success and a max error of 4.48 against 0.031 aligned. Every matrix
// handed to it must be `batch_aligned` (the leading dimension in elements of `esize` bytes).
bool batch_aligned(const void* p, int64_t ld, int64_t esize) { return aligned16(p) && (ld * esize) % 16 == 0; }

// The activation the batched GEMMs read (B of every GEMM): x itself when cuBLAS accepts it (unit inner stride, a row
// stride >= K, batch-aligned), else a contiguous copy (T x K, small; batch-aligned when K % 8 == 0).
bool x_batch_ready(const at::Tensor& x) {
  return x.stride(1) == 1 && x.stride(0) >= x.size(1) &&
         batch_aligned(x.data_ptr(), x.stride(0), static_cast<int64_t>(x.element_size()));
}

// The runs cuBLAS can batch: 16-bit dtype, no bias, unit inner stride, a row stride cuBLAS accepts (>= K), and the
// run's weight rows (A) and output column block (C: column `col` of the op's fresh, aligned output of `out_ld`
// columns) batch-aligned.
bool batchable(const at::Tensor& x, const Run& r, int64_t out_ld) {
  const int64_t esize = static_cast<int64_t>(x.element_size());
  return x.scalar_type() != at::kFloat && r.bias == nullptr && r.unit_inner && r.weight_stride >= x.size(1) &&
         batch_aligned(r.weight, r.weight_stride, esize) && (r.col * esize) % 16 == 0 && (out_ld * esize) % 16 == 0;
}

using Shape = std::pair<int64_t, int64_t>;  // (rows, row stride): runs of one shape share a batched GEMM
// Runs by shape, in increasing shape order (a call has a few shapes: a sorted vector, no tree per call).
using ShapeGroups = std::vector<std::pair<Shape, std::vector<const Run*>>>;

// The batchable runs by shape (none when x and its contiguous copy would both be misaligned); `single` gets the
// others. cuBLAS batches row ranges of one shape at every T: the KV group of 5 layers at 64 tokens took 29.2 us
// batched against 53.0 per weight, and ten [1024, 4096] weights placed apart took 66.8 us batched against 102.3 one
// GEMM each at 512 tokens, 134.0 against 157.1 at 1024, 260.4 against 265.8 at 2048 and 520.7 against 503.0 at 4096
// (H200, BENCHMARKS.md "Batched at every T"): a GEMM of 1024 rows fills the GPU only from about 4096 tokens, and
// there the batched one is within 4 %, while the time no longer depends on which weights lie back to back.
ShapeGroups batches(const at::Tensor& x, const std::vector<Run>& runs, std::vector<Run>* single) {
  ShapeGroups shapes;
  const bool batching = x_batch_ready(x) || x.size(1) % 8 == 0;
  const int64_t out_ld = runs.empty() ? 0 : runs.back().col + runs.back().rows;  // the output's columns
  for (const Run& r : runs) {
    if (batching && batchable(x, r, out_ld)) {
      const Shape shape{r.rows, r.weight_stride};
      auto at = std::lower_bound(shapes.begin(), shapes.end(), shape,
                                 [](const auto& group, const Shape& s) { return group.first < s; });
      if (at == shapes.end() || at->first != shape) at = shapes.insert(at, {shape, {}});
      at->second.push_back(&r);
    } else if (single != nullptr) {
      single->push_back(r);
    }
  }
  return shapes;
}

// Whether the cuBLAS path would put every run into a batched GEMM of >= 2 runs.
bool batches_every_run(const at::Tensor& x, const std::vector<Run>& runs) {
  size_t batched = 0;
  for (const auto& [shape, group] : batches(x, runs, nullptr)) {
    if (group.size() >= 2) batched += group.size();
  }
  return batched == runs.size();
}

// Kernel launches of the cuBLAS path over `runs`: two (the pointer table, the GEMM) per kMaxSegments runs of a
// batched shape, one per other run.
size_t cublas_launches(const at::Tensor& x, const std::vector<Run>& runs) {
  std::vector<Run> single;
  size_t launches = 0;
  for (const auto& [shape, group] : batches(x, runs, &single)) {
    launches += group.size() < 2 ? 1 : 2 * ((group.size() + kMaxSegments - 1) / kMaxSegments);
  }
  return launches + single.size();
}

// The row ranges the cuBLAS path runs: `merged` (collect_runs: adjacent ranges merged, fewer and larger GEMMs) where
// those take fewer launches, else the ranges as given. Which weights lie back to back is up to the allocator, and
// merging some of them leaves runs of several shapes, a GEMM each, where the given ranges of one shape are one
// batched GEMM (H200, K/V of 5 layers as 10 [1024, 4096] weights at 64 tokens, some adjacent: 3 GEMMs and a
// split-K reduction, 50.8 us per write, against one batched GEMM, 40.7 us): the path must not depend on it. On a tie
// (k and v of each layer adjacent: five batched ranges or ten) the given ones, so that only weights that all lie back
// to back (one GEMM) change the GEMM's shape.
std::vector<Run> cublas_runs(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts,
                             at::IntArrayRef counts, const Biases& biases, std::vector<Run> merged) {
  size_t ranges = 0;
  for (const int64_t c : counts) ranges += c > 0 ? 1 : 0;
  if (merged.size() <= 1 || merged.size() == ranges) return merged;  // all in one GEMM, or nothing merged
  std::vector<Run> given = collect_runs(x, weights, starts, counts, biases, /*merge=*/false);
  return cublas_launches(x, merged) < cublas_launches(x, given) ? merged : given;
}

// `runs` (all of one shape, 2..kMaxSegments of them) as one batched GEMM into their column blocks of `out`.
void gemm_batched(const at::Tensor& x, const std::vector<const Run*>& runs, at::Tensor& out) {
  const int count = static_cast<int>(runs.size());
  const int64_t esize = static_cast<int64_t>(x.element_size());
  PointerTable t{};
  for (int i = 0; i < count; ++i) {
    t.weight[i] = runs[i]->weight;
    t.out[i] = static_cast<char*>(out.data_ptr()) + runs[i]->col * esize;
  }
  t.x = x.data_ptr();
  t.count = count;
  const at::Tensor table = at::empty({3 * count}, x.options().dtype(at::kLong));
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const void** pointers = static_cast<const void**>(table.data_ptr());
  fill_pointer_table<<<1, count, 0, stream>>>(t, pointers);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Column-major view: out block^T [rows, T] = W [rows, K] (row-major, i.e. op T) x x^T [K, T] (op N).
  const cudaDataType_t type = x.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const float alpha = 1.0f;
  const float beta = 0.0f;
  TORCH_CUDABLAS_CHECK(cublasGemmBatchedEx(
      at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(runs[0]->rows),
      static_cast<int>(x.size(0)), static_cast<int>(x.size(1)), &alpha, pointers, type,
      static_cast<int>(runs[0]->weight_stride), pointers + count, type, static_cast<int>(x.stride(0)), &beta,
      const_cast<void**>(pointers + 2 * count), type, static_cast<int>(out.stride(0)), count, CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT));
}

// The cuBLAS path: runs of one shape (batchable) in one batched GEMM per
// kMaxSegments of them; every other run as its own mm / addmm. batched = false: one GEMM per run (the debug op
// compares the two).
void cublas_path(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts, const Biases& biases,
                 const std::vector<Run>& runs, at::Tensor& out, bool batched) {
  std::vector<Run> single;
  if (!batched) {
    run_cublas(x, weights, starts, biases, runs, out);
    return;
  }
  const ShapeGroups shapes = batches(x, runs, &single);
  // x for the batched GEMMs (x_batch_ready), else a copy: clone, since contiguous() keeps a misaligned contiguous x.
  at::Tensor xb;
  for (const auto& [shape, group] : shapes) {
    if (group.size() < 2) {
      single.push_back(*group[0]);
      continue;
    }
    if (!xb.defined()) {
      xb = x_batch_ready(x) ? x : x.clone(at::MemoryFormat::Contiguous);
    }
    for (size_t first = 0; first < group.size(); first += kMaxSegments) {
      const size_t n = std::min<size_t>(kMaxSegments, group.size() - first);
      if (n == 1) {
        single.push_back(*group[first]);
      } else {
        gemm_batched(xb, std::vector<const Run*>(group.begin() + first, group.begin() + first + n), out);
      }
    }
  }
  run_cublas(x, weights, starts, biases, single, out);
}

// One launch per kMaxSegments runs (the parameter table is fixed-size); each writes its own output columns.
// variant -1 / split 0: the defaults for the launch's rows (default_variant, auto_split where the GPU runs clusters,
// else 1).
template <typename T>
void run_kernel(const at::Tensor& x, const std::vector<Run>& runs, at::Tensor& out, int variant, int split) {
  const int tokens = static_cast<int>(x.size(0));
  const int k = static_cast<int>(x.size(1));
  const int64_t esize = static_cast<int64_t>(x.element_size());
  const int sm_count = device_attribute(cudaDevAttrMultiProcessorCount, x.device());
  const bool syncs = syncs_on(x.device());
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
    const int s = split > 0 ? split : syncs ? auto_split(v, rows, k, sm_count) : 1;
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
  const std::vector<Run> gemm_runs = cublas_runs(x, weights, row_starts, row_counts, biases, runs);
  const int64_t rows = out.size(1);
  const auto all_batched = [&] { return batches_every_run(x, gemm_runs); };
  if (kernel_pays(x.size(0), static_cast<int64_t>(runs.size()), rows, all_batched) &&
      kernel_blocker(x, runs) == nullptr) {
    dispatch_kernel(x, runs, out, -1, 0);
  } else {
    cublas_path(x, weights, row_starts, biases, gemm_runs, out, /*batched=*/true);
  }
  return out;
}

// The cuBLAS path whatever T, batched (as the op runs it) or one GEMM per row range, for the benchmark and the tests.
at::Tensor multi_linear_cublas(const at::Tensor& x, at::TensorList weights, at::IntArrayRef row_starts,
                               at::IntArrayRef row_counts, const Biases& biases, bool batched) {
  check_args(x, weights, row_starts, row_counts, biases);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), total_rows(row_counts)}, x.options());
  if (out.numel() == 0) return out;
  std::vector<Run> runs = collect_runs(x, weights, row_starts, row_counts, biases);
  if (batched) runs = cublas_runs(x, weights, row_starts, row_counts, biases, std::move(runs));
  cublas_path(x, weights, row_starts, biases, runs, out, batched);
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
  TORCH_CHECK_VALUE(split <= 1 || syncs_on(x.device()), "_multi_linear_variant: split ", num(split),
                    " needs thread-block clusters, which the kernel has only on sm_90 (its sm_90a code); this GPU "
                    "runs its portable PTX: use split 0 or 1");
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
  m.impl("_multi_linear_cublas", &dspark::mlinear::multi_linear_cublas);
}

// Read by custom_ops/linear/multi_linear.py through ctypes (kernel_token_threshold, uses_kernel, kernel_variants).
extern "C" __attribute__((visibility("default"))) int dspark_multi_linear_token_threshold() {
  return static_cast<int>(dspark::mlinear::kTokenThreshold);
}

extern "C" __attribute__((visibility("default"))) int dspark_multi_linear_uses_kernel(int64_t tokens, int64_t runs,
                                                                                      int64_t rows, int all_batched) {
  return dspark::mlinear::kernel_pays(tokens, runs, rows, [=] { return all_batched != 0; }) ? 1 : 0;
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
