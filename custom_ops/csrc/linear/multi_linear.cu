// Torch binding of dspark::multi_linear on CUDA: the argument checks of custom_ops/linear/multi_linear.py (same error
// class, same message), merging of weights that are adjacent in memory, and the choice between the small-T kernel
// (multi_linear_kernels.cuh) and cuBLAS (batched GEMMs over row blocks, or a GEMM per range) into the output's column
// blocks. Also the debug ops dspark::_multi_linear_variant (forces a kernel variant and split; the benchmark sweep and
// the tests use it) and dspark::_multi_linear_cublas, and the C entry points through which Python reads the variant
// table, the token threshold and the path rules.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "common/error_format.h"
#include "linear/captured_pointer_tables.h"
#include "linear/multi_linear_host.h"
#include "linear/multi_linear_stream.cuh"

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
// The register-streaming tile of the K/V write's fused kernel (multi_linear_direct.cuh), run as variants of this op,
// was 1.2-1.5x slower than this tile for every group at 1-16 tokens (BENCHMARKS.md "Register-streaming variants"), so
// the op does not compile it.
constexpr int64_t kTokenThreshold = 8;
constexpr int64_t kGroupTokenThreshold = 32;
constexpr int64_t kGroupMaxMeanRows = 4096;
static_assert(kGroupTokenThreshold <= kMaxTokens, "the kernel handles at most kMaxTokens tokens");

// Whether a call with `tokens` rows of x over `runs` row ranges (after merging adjacent ones) of `rows` rows in all
// takes the kernel; `all_batched()`: the cuBLAS path would batch every range (see batches_every_run; a single range:
// cut into row blocks, see strided_block), asked only when the answer matters (a single range, or 8 < tokens <= 32
// and several ranges), so a decode call does not group its ranges by shape. A single range that cuBLAS cuts into
// row blocks takes cuBLAS at every T: 32.6-32.8 us against 34.1-34.5 for the kernel for [4096, 12288] at 1-8 tokens,
// within 1 % of it for [4096, 4096] and [12288, 4096] (H200, BENCHMARKS.md "Row blocks").
template <typename AllBatched>
bool kernel_pays(int64_t tokens, int64_t runs, int64_t rows, AllBatched&& all_batched) {
  if (runs == 1 && all_batched()) return false;
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

// Batched cuBLAS. cuBLAS picks its tiles per GEMM shape, and for a decode-sized T its tiles of one GEMM of a few
// thousand rows leave much of the H200's bandwidth unused; one batched GEMM over equal row blocks fills it (the batch is
// one more grid dimension). So the cuBLAS path cuts the row ranges it can batch into blocks of one height: the gcd of
// their row counts, halved while above kMaxBlockRows, and only if that is at least kMinBlockRows (else ranges of one
// shape are batched whole, as before, and the others take a GEMM each). Measured on the H200 (bf16, K = 4096,
// CUDA-graph replay, L2-cold weights; benchmarks/cublas_paths_tune.cu, BENCHMARKS.md "Row blocks"): q/k/v of
// [4096|1024|1024] rows in blocks of 1024 took 17.8 us at 16 tokens against 25.4 for a GEMM for q and a batched one for
// k and v (0.70-0.77x up to 128 tokens, within 2-9 % of one GEMM on a concatenated copy); a single [4096, 12288] weight
// in blocks of 2048 took 29.0 us at 8 tokens against 32.4 as one GEMM.
constexpr int64_t kMinBlockRows = 256;
constexpr int64_t kMaxBlockRows = 2048;
// A single row range (nothing to batch it with) is cut into blocks, a strided batched GEMM with no pointer table, if
// it has at least kStridedMinRows rows and T <= kStridedMaxTokens: from 128 tokens on its blocks were 1-6 % slower than
// one GEMM ([4096, 4096] and [4096, 12288]).
constexpr int64_t kStridedMinRows = 4096;
constexpr int64_t kStridedMaxTokens = 64;

// The block height for row ranges whose row counts have gcd `rows_gcd` (0: they are not cut into blocks). A multiple
// of 8, so that every block's output columns stay 16-byte aligned (see batch_aligned).
int64_t block_rows(int64_t rows_gcd) {
  int64_t block = rows_gcd;
  while (block > kMaxBlockRows && block % 16 == 0) block /= 2;
  return block >= kMinBlockRows && block <= kMaxBlockRows && block % 8 == 0 ? block : 0;
}

// cuBLAS reads the batched GEMM's matrix pointers from device memory. Outside a CUDA-graph capture fill_pointer_table
// writes them there from its by-value parameter (no host-to-device copy, no sync, nothing kept between calls); a
// capture takes the table from CapturedPointerTables instead (written once, the graph holds only the GEMM). Problem p
// of the batch is block p - first[i] of run i (first[i] <= p < first[i + 1]).
struct PointerTable {
  const char* weight[kMaxSegments];  // first row of run i
  char* out[kMaxSegments];           // run i's column block of out
  int first[kMaxSegments + 1];       // the run's first problem; first[runs]: the problem count
  const void* x;                     // B of every problem
  int64_t weight_step;               // bytes from one block's first weight row to the next one's
  int64_t out_step;                  // bytes from one block's first output column to the next one's
  int runs;
};

// Entry i of the table: 3 x problems pointers, every problem's weight block (A), then x (B) for each, then every
// problem's output block (C).
__host__ __device__ inline const void* table_entry(const PointerTable& t, int i) {
  const int problems = t.first[t.runs];
  if (i / problems == 1) return t.x;
  const int p = i % problems;
  int r = 0;
  while (p >= t.first[r + 1]) ++r;
  const int64_t block = p - t.first[r];
  return i < problems ? t.weight[r] + block * t.weight_step : t.out[r] + block * t.out_step;
}

__global__ void fill_pointer_table(const __grid_constant__ PointerTable t, const void** table) {
  const int entries = 3 * t.first[t.runs];
  for (int i = static_cast<int>(threadIdx.x); i < entries; i += static_cast<int>(blockDim.x)) {
    table[i] = table_entry(t, i);
  }
}

// The table of a batched GEMM that `stream` is capturing into a CUDA graph (CapturedPointerTables), else nullptr (not
// capturing, or the cache's budget spent): then the caller writes it with fill_pointer_table.
const void** captured_table(const PointerTable& t, cudaStream_t stream, int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusActive) return nullptr;
  std::vector<const void*> entries(3 * static_cast<size_t>(t.first[t.runs]));
  for (size_t i = 0; i < entries.size(); ++i) entries[i] = table_entry(t, static_cast<int>(i));
  return CapturedPointerTables::instance().get(device, entries);
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

// One batched GEMM: runs of one row stride (the GEMM's lda), each cut into blocks of `block` rows (a run's own row
// count when ranges of one shape are batched whole).
struct Batch {
  int64_t block;
  std::vector<const Run*> runs;
};

// Runs grouped by a key (a row stride, a row count), in first-seen order: a call has a few keys, no tree per call.
using RunsByKey = std::vector<std::pair<int64_t, std::vector<const Run*>>>;

void add_to_group(RunsByKey& groups, int64_t key, const Run* r) {
  auto at = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
  if (at == groups.end()) at = groups.insert(at, {key, {}});
  at->second.push_back(r);
}

// The batches of `runs` (none when x and its contiguous copy would both be misaligned); `single` gets the runs left
// to a GEMM of their own. Batchable runs of one row stride form one batch of row blocks (block_rows of their gcd), or
// where their gcd is too small, one batch per row count that >= 2 of them share.
std::vector<Batch> batches(const at::Tensor& x, const std::vector<Run>& runs, std::vector<Run>* single) {
  const bool batching = x_batch_ready(x) || x.size(1) % 8 == 0;
  const int64_t out_ld = runs.empty() ? 0 : runs.back().col + runs.back().rows;  // the output's columns
  RunsByKey by_stride;
  for (const Run& r : runs) {
    if (batching && batchable(x, r, out_ld)) {
      add_to_group(by_stride, r.weight_stride, &r);
    } else if (single != nullptr) {
      single->push_back(r);
    }
  }
  std::vector<Batch> out;
  for (auto& [stride, group] : by_stride) {
    int64_t rows_gcd = 0;
    for (const Run* r : group) rows_gcd = std::gcd(rows_gcd, r->rows);
    const int64_t block = block_rows(rows_gcd);
    if (group.size() >= 2 && block > 0) {
      out.push_back({block, std::move(group)});
      continue;
    }
    RunsByKey by_rows;
    for (const Run* r : group) add_to_group(by_rows, r->rows, r);
    for (auto& [rows, same] : by_rows) {
      if (same.size() >= 2) {
        out.push_back({rows, std::move(same)});
      } else if (single != nullptr) {
        single->push_back(*same[0]);
      }
    }
  }
  return out;
}

// Whether the cuBLAS path would put every run into a batched GEMM.
bool batches_every_run(const at::Tensor& x, const std::vector<Run>& runs) {
  std::vector<Run> single;
  batches(x, runs, &single);
  return single.empty();
}

// Kernel launches of the cuBLAS path over `runs` outside a CUDA-graph capture: two (the pointer table, the GEMM) per
// kMaxSegments runs of a batch, one per other run.
size_t cublas_launches(const at::Tensor& x, const std::vector<Run>& runs) {
  std::vector<Run> single;
  size_t launches = 0;
  for (const Batch& b : batches(x, runs, &single)) launches += 2 * ((b.runs.size() + kMaxSegments - 1) / kMaxSegments);
  return launches + single.size();
}

// The row ranges the cuBLAS path runs: `merged` (collect_runs: adjacent ranges merged, fewer and larger GEMMs) where
// those take fewer launches, else the ranges as given. Which weights lie back to back is up to the allocator, and
// merging some of them can leave runs that batch worse than the given ones (H200, K/V of 5 layers as 10 [1024, 4096]
// weights at 64 tokens, some adjacent: 3 GEMMs and a split-K reduction, 50.8 us per write, against one batched GEMM,
// 40.7 us): the path must not depend on it. On a tie the given ones, so that only weights that all lie back to back
// (one GEMM) change the GEMMs.
std::vector<Run> cublas_runs(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts,
                             at::IntArrayRef counts, const Biases& biases, std::vector<Run> merged) {
  size_t ranges = 0;
  for (const int64_t c : counts) ranges += c > 0 ? 1 : 0;
  if (merged.size() <= 1 || merged.size() == ranges) return merged;  // all in one GEMM, or nothing merged
  std::vector<Run> given = collect_runs(x, weights, starts, counts, biases, /*merge=*/false);
  return cublas_launches(x, merged) < cublas_launches(x, given) ? merged : given;
}

cudaDataType_t cublas_type(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F; }

// `runs` (1..kMaxSegments of one row stride, each a multiple of `block` rows) as one batched GEMM over their row
// blocks, into their column blocks of `out`. Column-major view: out block^T [block, T] = W block [block, K]
// (row-major, i.e. op T) x x^T [K, T] (op N).
void gemm_batched(const at::Tensor& x, const std::vector<const Run*>& runs, int64_t block, at::Tensor& out) {
  const int64_t esize = static_cast<int64_t>(x.element_size());
  PointerTable t{};
  int problems = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    t.weight[i] = runs[i]->weight;
    t.out[i] = static_cast<char*>(out.data_ptr()) + runs[i]->col * esize;
    t.first[i] = problems;
    problems += static_cast<int>(runs[i]->rows / block);
  }
  t.runs = static_cast<int>(runs.size());
  t.first[t.runs] = problems;
  t.x = x.data_ptr();
  t.weight_step = block * runs[0]->weight_stride * esize;
  t.out_step = block * esize;
  const auto stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const void** pointers = captured_table(t, stream, x.device().index());
  at::Tensor table;  // this call's table, freed after the GEMM is enqueued (the allocator orders reuse on the stream)
  if (pointers == nullptr) {
    table = at::empty({3 * problems}, x.options().dtype(at::kLong));
    pointers = static_cast<const void**>(table.data_ptr());
    fill_pointer_table<<<1, std::min(3 * problems, 256), 0, stream>>>(t, pointers);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const cudaDataType_t type = cublas_type(x);
  const float alpha = 1.0f;
  const float beta = 0.0f;
  TORCH_CUDABLAS_CHECK(cublasGemmBatchedEx(
      at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(block),
      static_cast<int>(x.size(0)), static_cast<int>(x.size(1)), &alpha, pointers, type,
      static_cast<int>(runs[0]->weight_stride), pointers + problems, type, static_cast<int>(x.stride(0)), &beta,
      const_cast<void**>(pointers + 2 * problems), type, static_cast<int>(out.stride(0)), problems,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The block height a single range of `rows` rows is cut into at `tokens` tokens (0: one plain GEMM), given a layout
// cuBLAS can batch.
int64_t strided_rows_block(int64_t tokens, int64_t rows) {
  return tokens <= kStridedMaxTokens && rows >= kStridedMinRows ? block_rows(rows) : 0;
}

// The block height run `r` (a single run) is cut into for a strided batched GEMM (0: one plain GEMM).
int64_t strided_block(const at::Tensor& x, const Run& r, int64_t out_ld) {
  return batchable(x, r, out_ld) ? strided_rows_block(x.size(0), r.rows) : 0;
}

// A single run cut into blocks of `block` rows: one strided batched GEMM (the blocks are equally spaced, x is shared:
// stride 0), no pointer table.
void gemm_strided_blocks(const at::Tensor& x, const Run& r, int64_t block, at::Tensor& out) {
  const cudaDataType_t type = cublas_type(x);
  const float alpha = 1.0f;
  const float beta = 0.0f;
  char* c = static_cast<char*>(out.data_ptr()) + r.col * static_cast<int64_t>(x.element_size());
  TORCH_CUDABLAS_CHECK(cublasGemmStridedBatchedEx(
      at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(block),
      static_cast<int>(x.size(0)), static_cast<int>(x.size(1)), &alpha, r.weight, type,
      static_cast<int>(r.weight_stride), block * r.weight_stride, x.data_ptr(), type, static_cast<int>(x.stride(0)),
      0, &beta, c, type, static_cast<int>(out.stride(0)), block, static_cast<int>(r.rows / block),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The cuBLAS path: the batches, one batched GEMM per kMaxSegments runs of each; a single run of >= kStridedMinRows
// rows at T <= kStridedMaxTokens as one strided batched GEMM of row blocks; every other run as its own mm / addmm.
// batched = false: one GEMM per run (the debug op compares the two).
void cublas_path(const at::Tensor& x, at::TensorList weights, at::IntArrayRef starts, const Biases& biases,
                 const std::vector<Run>& runs, at::Tensor& out, bool batched) {
  if (!batched) {
    run_cublas(x, weights, starts, biases, runs, out);
    return;
  }
  // x for the batched GEMMs (x_batch_ready), else a copy made on first use: clone, since contiguous() keeps a
  // misaligned contiguous x.
  at::Tensor xb;
  const auto batch_x = [&]() -> const at::Tensor& {
    if (!xb.defined()) xb = x_batch_ready(x) ? x : x.clone(at::MemoryFormat::Contiguous);
    return xb;
  };
  std::vector<Run> single;
  for (const Batch& b : batches(x, runs, &single)) {
    for (size_t first = 0; first < b.runs.size(); first += kMaxSegments) {
      const size_t n = std::min<size_t>(kMaxSegments, b.runs.size() - first);
      gemm_batched(batch_x(), std::vector<const Run*>(b.runs.begin() + first, b.runs.begin() + first + n), b.block,
                   out);
    }
  }
  std::vector<Run> plain;
  for (const Run& r : single) {
    const int64_t block = strided_block(x, r, out.size(1));
    if (block > 0) {
      gemm_strided_blocks(batch_x(), r, block, out);
    } else {
      plain.push_back(r);
    }
  }
  run_cublas(x, weights, starts, biases, plain, out);
}

// `variant` for the streaming kernel (multi_linear_stream.cuh) in run_kernel and _multi_linear_variant.
constexpr int kStreamVariant = -2;

// One launch per kMaxSegments runs (the parameter table is fixed-size); each writes its own output columns.
// variant -1 / split 0: the defaults for the launch's rows (default_variant, auto_split where the GPU runs clusters,
// else 1); kStreamVariant: the streaming kernel (sm_90a code, up to kStreamMaxTokens tokens, no split).
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
    if (variant == kStreamVariant) {
      launch(stream_kernel_for<T>(tokens), p, stream_grid(rows, sm_count), stream_threads(), stream_smem(tokens), 1,
             x.device());
      continue;
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
  const auto all_batched = [&] {
    return gemm_runs.size() == 1 ? strided_block(x, gemm_runs[0], rows) > 0 : batches_every_run(x, gemm_runs);
  };
  const int sm_count = device_attribute(cudaDevAttrMultiProcessorCount, x.device());
  const auto run_count = static_cast<int64_t>(runs.size());
  const bool stream = syncs_on(x.device()) && stream_pays(x.size(0), run_count, rows, sm_count);
  // the layout is asked about only where a kernel would run; the same rules hold for both kernels
  if ((stream || kernel_pays(x.size(0), run_count, rows, all_batched)) && kernel_blocker(x, runs) == nullptr) {
    dispatch_kernel(x, runs, out, stream ? kStreamVariant : -1, 0);
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

// The kernel with a forced variant (-1: the default one; kStreamVariant: the streaming kernel) and cluster split (0:
// automatic), for any token count up to kMaxTokens (kStreamMaxTokens for the streaming kernel); raises ValueError
// where the kernel cannot run.
at::Tensor multi_linear_variant(const at::Tensor& x, at::TensorList weights, at::IntArrayRef row_starts,
                                at::IntArrayRef row_counts, const Biases& biases, int64_t variant, int64_t split) {
  check_args(x, weights, row_starts, row_counts, biases);
  TORCH_CHECK_VALUE(variant >= kStreamVariant && variant < kNumVariants, "_multi_linear_variant: variant must be in [",
                    num(kStreamVariant), ", ", num(kNumVariants), "), got ", num(variant));
  TORCH_CHECK_VALUE(split >= 0 && split <= kMaxSplit, "_multi_linear_variant: split must be in [0, ", num(kMaxSplit),
                    "], got ", num(split));
  TORCH_CHECK_VALUE(split <= 1 || syncs_on(x.device()), "_multi_linear_variant: split ", num(split),
                    " needs thread-block clusters, which the kernel has only on sm_90 (its sm_90a code); this GPU "
                    "runs its portable PTX: use split 0 or 1");
  if (variant == kStreamVariant) {
    TORCH_CHECK_VALUE(syncs_on(x.device()), "_multi_linear_variant: the streaming kernel (variant ",
                      num(kStreamVariant), ") needs the sm_90a code (bulk copies); this GPU runs the portable PTX");
    TORCH_CHECK_VALUE(x.size(0) <= kStreamMaxTokens, "_multi_linear_variant: the streaming kernel (variant ",
                      num(kStreamVariant), ") handles at most ", num(kStreamMaxTokens), " tokens, got ",
                      num(x.size(0)));
    TORCH_CHECK_VALUE(split <= 1, "_multi_linear_variant: the streaming kernel (variant ", num(kStreamVariant),
                      ") does not split K: split must be 0 or 1, got ", num(split));
  }
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

// Whether a call of `tokens` tokens over `runs` row ranges of `rows` output rows takes the streaming kernel on a GPU
// with `sm_count` SMs that runs the sm_90a code, given a layout the kernels can read.
extern "C" __attribute__((visibility("default"))) int dspark_multi_linear_uses_stream(int64_t tokens, int64_t runs,
                                                                                      int64_t rows, int sm_count) {
  return dspark::mlinear::stream_pays(tokens, runs, rows, sm_count) ? 1 : 0;
}

extern "C" __attribute__((visibility("default"))) int dspark_multi_linear_stream_variant() {
  return dspark::mlinear::kStreamVariant;
}

// The height of the row blocks that the cuBLAS path cuts batchable ranges into when their row counts have gcd
// `rows_gcd` (0: none; then ranges of one shape are batched whole).
extern "C" __attribute__((visibility("default"))) int64_t dspark_multi_linear_block_rows(int64_t rows_gcd) {
  return dspark::mlinear::block_rows(rows_gcd);
}

// The height of the row blocks a single range of `rows` rows is cut into at `tokens` tokens (0: one plain GEMM).
extern "C" __attribute__((visibility("default"))) int64_t dspark_multi_linear_strided_block(int64_t tokens,
                                                                                          int64_t rows) {
  return dspark::mlinear::strided_rows_block(tokens, rows);
}

// How many batched GEMMs' pointer tables CUDA-graph captures have written once and kept (CapturedPointerTables).
extern "C" __attribute__((visibility("default"))) int64_t dspark_multi_linear_captured_tables() {
  return static_cast<int64_t>(dspark::mlinear::CapturedPointerTables::instance().size());
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
