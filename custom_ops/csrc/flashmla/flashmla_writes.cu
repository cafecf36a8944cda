// Torch binding of the DeepSeek-V4 norm / RoPE / FlashMLA-write kernels: argument checks (ValueError / TypeError
// in Python, same rules as custom_ops/flashmla/writes.py), the opt-in index-value checks, dtype dispatch, launches
// on the current stream, and the registration under the CUDA key of the dspark namespace (schemas are defined in
// Python).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/error_format.h"
#include "common/memory_overlap.h"
#include "common/range_checks.h"

#include "flashmla/flashmla_writes_kernels.cuh"

namespace dspark {
namespace {

template <typename T>
struct Tag {
  using type = T;
};

template <typename F>
void dispatch_float(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(Tag<float>{});
    case at::kBFloat16:
      return f(Tag<__nv_bfloat16>{});
    case at::kHalf:
      return f(Tag<__half>{});
    default:
      TORCH_CHECK_TYPE(false, "unsupported dtype ", dtype);
  }
}

// Structural checks: the same rules, in the same order, as the Python checks of custom_ops/flashmla/writes.py (the
// CPU and fake impls). The first tensor argument (`kv` or `q`) fixes the device; every other tensor is named when it
// is elsewhere.

void check_float(const at::Tensor& t, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kBFloat16 || d == at::kHalf || d == at::kFloat, name,
                   " must have dtype in (bfloat16, float16, float32), got ", d);
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType expected) {
  TORCH_CHECK_TYPE(t.scalar_type() == expected, name, " must have dtype in (", expected, "), got ", t.scalar_type());
}

void check_device(const at::Tensor& t, const char* name, const char* anchor, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " like ", anchor, ", got ", t.device());
}

void check_index(const at::Tensor& t, const char* name, int64_t n, const char* anchor, const at::Device& device) {
  const auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kInt || d == at::kLong, name, " must have dtype in (int32, int64), got ", d);
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, name, " must have shape (", num(n), ",), got ", dims(t.sizes()));
  check_device(t, name, anchor, device);
}

void check_unit_inner_stride(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, name,
                    " must have a unit stride in its last dim, got strides ", dims(t.strides()));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

bool aligned16(const at::Tensor& t, std::initializer_list<int64_t> strides) {
  if (!aligned16(t.data_ptr())) return false;
  for (const int64_t s : strides) {
    if ((s * static_cast<int64_t>(t.element_size())) % 16 != 0) return false;
  }
  return true;
}

void check_aligned16(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(aligned16(t.data_ptr()), name, " must be 16-byte aligned, got a storage offset of ",
                    num(t.storage_offset()), " elements");
}

// The rows (last dim) of a written tensor must not share memory: in order of increasing stride, every batch dim
// must step past the block spanned by the dims before it (custom_ops/flashmla/writes.py, _rows_disjoint).
void check_rows_disjoint(const at::Tensor& t, const char* name) {
  if (t.numel() == 0) return;
  std::vector<std::pair<int64_t, int64_t>> batch_dims;  // (stride, size)
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) > 1) batch_dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(batch_dims.begin(), batch_dims.end());
  int64_t span = t.size(-1);
  for (const auto& [stride, size] : batch_dims) {
    TORCH_CHECK_VALUE(stride >= span, name, " must not overlap itself (its rows are written in parallel), got shape ",
                      dims(t.sizes()), " and strides ", dims(t.strides()));
    span += (size - 1) * stride;
  }
}

void check_rows(const at::Tensor& kv, const char* name) {
  check_float(kv, name);
  TORCH_CHECK_VALUE(kv.dim() == 2 && kv.size(1) == kHeadDim, name, " must have shape (B, 512), got ",
                    dims(kv.sizes()));
  check_unit_inner_stride(kv, name);
}

void check_weight(const at::Tensor& weight, const at::Tensor& kv) {
  check_dtype(weight, "weight", kv.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == kHeadDim, "weight must have shape (512,), got ",
                    dims(weight.sizes()));
  check_unit_inner_stride(weight, "weight");
  check_device(weight, "weight", "kv", kv.device());
}

void check_eps(double eps) {
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", num(eps));
}

void check_weight_scale(double weight_scale) {
  TORCH_CHECK_VALUE(std::isfinite(weight_scale), "weight_scale must be finite, got ", num(weight_scale));
}

void check_table(const at::Tensor& freqs, const at::Tensor& positions, int64_t n, const char* anchor,
                 const at::Device& device) {
  check_dtype(freqs, "freqs", at::kFloat);
  TORCH_CHECK_VALUE(freqs.dim() == 2 && freqs.size(1) == kRopeDim, "freqs must have shape (max_pos, 64), got ",
                    dims(freqs.sizes()));
  TORCH_CHECK_VALUE(freqs.is_contiguous(), "freqs must be contiguous");
  check_device(freqs, "freqs", anchor, device);
  check_aligned16(freqs, "freqs");
  check_index(positions, "positions", n, anchor, device);
}

constexpr int64_t kMaxPageSize = int64_t{1} << 30;

int64_t page_bytes_of(int64_t page_size) {
  return (kTokenBytes * page_size + kValueBytes - 1) / kValueBytes * kValueBytes;
}

void check_cache(const at::Tensor& out_loc, const at::Tensor& kvcache, int64_t page_size, const at::Tensor& kv) {
  check_index(out_loc, "out_loc", kv.size(0), "kv", kv.device());
  TORCH_CHECK_VALUE(page_size >= 1 && page_size <= kMaxPageSize && (page_size & (page_size - 1)) == 0,
                    "page_size must be a power of two in [1, 2**30], got ", num(page_size));
  const int64_t page_bytes = page_bytes_of(page_size);
  check_dtype(kvcache, "kvcache", at::kByte);
  TORCH_CHECK_VALUE(kvcache.dim() == 2 && kvcache.size(1) == page_bytes, "kvcache must have shape (num_pages, ",
                    num(page_bytes), ") for page_size=", num(page_size), ", got ", dims(kvcache.sizes()));
  TORCH_CHECK_VALUE(kvcache.stride(1) == 1 && (kvcache.size(0) <= 1 || kvcache.stride(0) == page_bytes),
                    "kvcache must have strides (", num(page_bytes), ", 1) (row stride == page bytes), got ",
                    dims(kvcache.strides()));
  check_device(kvcache, "kvcache", "kv", kv.device());
  check_aligned16(kvcache, "kvcache");
}

// Index values (docs/contract.md): the kernels skip rows whose index is out of range; in checking mode the binding
// raises instead, with the CPU impls' message (custom_ops/flashmla/writes.py, _position_range and _slot_range).

std::string position_range_what(int64_t max_pos) {
  return "positions must be in [0, " + num(max_pos) + "), the rows of freqs";
}

std::string slot_range_what(int64_t num_pages, int64_t page_size) {
  return "slot ids must be < num_pages * page_size = " + num(num_pages) + " * " + num(page_size) + " = " +
         num(num_pages * page_size) + "; a negative id skips the row";
}

void check_position_values(const at::Tensor& freqs, const at::Tensor& positions) {
  const c10::cuda::CUDAGuard guard(positions.device());  // capture status and sync of the tensors' device
  if (!must_check_values()) return;
  check_index_range(positions, freqs.size(0), "positions", position_range_what(freqs.size(0)),
                    /*negative_skips=*/false);
}

void check_slot_values(const at::Tensor& out_loc, const at::Tensor& kvcache, int64_t page_size) {
  const c10::cuda::CUDAGuard guard(out_loc.device());
  if (!must_check_values()) return;
  check_index_range(out_loc, kvcache.size(0) * page_size, "out_loc", slot_range_what(kvcache.size(0), page_size));
}

template <typename Kernel, typename Args>
void launch(Kernel kernel, const Args& args, int64_t rows, const at::Device& device) {
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  // Broadcast (stride-0) inputs can ask for more rows than one grid holds; never let the block count wrap.
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int32_t>::max(), "too many rows for one launch: ", num(rows));
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream(device.index())>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kNormRope>
void flashmla_write(const at::Tensor& kv, const at::Tensor* weight, double eps, const at::Tensor* freqs,
                    const at::Tensor* positions, const at::Tensor& out_loc, at::Tensor& kvcache, int64_t page_size) {
  FlashMLAWriteArgs a{};
  a.kv = kv.data_ptr();
  a.kv_row_stride = kv.stride(0);
  a.eps = static_cast<float>(eps);
  a.out_loc = out_loc.data_ptr();
  a.out_loc_stride = out_loc.stride(0);
  a.out_loc_64 = out_loc.scalar_type() == at::kLong;
  a.cache = kvcache.data_ptr<uint8_t>();
  a.num_pages = kvcache.size(0);
  a.page_bytes = page_bytes_of(page_size);
  a.log2_page_size = 0;
  while ((int64_t{1} << a.log2_page_size) < page_size) ++a.log2_page_size;
  a.rows = kv.size(0);
  bool vec = aligned16(kv, {kv.stride(0)});
  if (kNormRope) {
    a.weight = weight->data_ptr();
    a.freqs = freqs->data_ptr<float>();
    a.max_pos = freqs->size(0);
    a.positions = positions->data_ptr();
    a.positions_stride = positions->stride(0);
    a.positions_64 = positions->scalar_type() == at::kLong;
    vec = vec && aligned16(weight->data_ptr());
  }
  dispatch_float(kv.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (vec) {
      launch(flashmla_write_kernel<T, true, kNormRope>, a, a.rows, kv.device());
    } else {
      launch(flashmla_write_kernel<T, false, kNormRope>, a, a.rows, kv.device());
    }
  });
}

void fused_k_norm_rope_flashmla(const at::Tensor& kv, const at::Tensor& weight, double eps, const at::Tensor& freqs,
                                const at::Tensor& positions, const at::Tensor& out_loc, at::Tensor& kvcache,
                                int64_t page_size) {
  check_rows(kv, "kv");
  check_weight(weight, kv);
  check_eps(eps);
  check_table(freqs, positions, kv.size(0), "kv", kv.device());
  check_cache(out_loc, kvcache, page_size, kv);
  check_no_shared_memory("kvcache", kvcache,
                         {{"kv", &kv}, {"weight", &weight}, {"freqs", &freqs}, {"positions", &positions},
                          {"out_loc", &out_loc}});
  check_position_values(freqs, positions);
  check_slot_values(out_loc, kvcache, page_size);
  flashmla_write<true>(kv, &weight, eps, &freqs, &positions, out_loc, kvcache, page_size);
}

void store_flashmla_cache(const at::Tensor& kv, const at::Tensor& out_loc, at::Tensor& kvcache, int64_t page_size) {
  check_rows(kv, "kv");
  check_cache(out_loc, kvcache, page_size, kv);
  check_no_shared_memory("kvcache", kvcache, {{"kv", &kv}, {"out_loc", &out_loc}});
  check_slot_values(out_loc, kvcache, page_size);
  flashmla_write<false>(kv, nullptr, 0.0, nullptr, nullptr, out_loc, kvcache, page_size);
}

template <bool kWeight>
void norm_rope(const at::Tensor& in, const at::Tensor& out, const at::Tensor* weight, double eps,
               const at::Tensor& freqs, const at::Tensor& positions) {
  NormRopeArgs a{};
  const bool is3d = in.dim() == 3;
  a.in = in.data_ptr();
  a.in_stride_b = in.stride(0);
  a.in_stride_h = is3d ? in.stride(1) : 0;
  a.out = out.data_ptr();
  a.out_stride_b = out.stride(0);
  a.out_stride_h = is3d ? out.stride(1) : 0;
  a.heads = is3d ? static_cast<int>(in.size(1)) : 1;
  a.rows = in.size(0) * a.heads;
  a.eps = static_cast<float>(eps);
  a.freqs = freqs.data_ptr<float>();
  a.max_pos = freqs.size(0);
  a.positions = positions.data_ptr();
  a.positions_stride = positions.stride(0);
  a.positions_64 = positions.scalar_type() == at::kLong;
  bool vec = aligned16(in, {a.in_stride_b, a.in_stride_h}) && aligned16(out, {a.out_stride_b, a.out_stride_h});
  if (kWeight) {
    a.weight = weight->data_ptr();
    vec = vec && aligned16(weight->data_ptr());
  }
  dispatch_float(in.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (vec) {
      launch(norm_rope_kernel<T, true, kWeight>, a, a.rows, in.device());
    } else {
      launch(norm_rope_kernel<T, false, kWeight>, a, a.rows, in.device());
    }
  });
}

void fused_q_norm_rope(const at::Tensor& q, at::Tensor& q_out, double eps, const at::Tensor& freqs,
                       const at::Tensor& positions) {
  check_float(q, "q");
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) == kHeadDim, "q must have shape (B, H, 512), got ", dims(q.sizes()));
  check_unit_inner_stride(q, "q");
  check_dtype(q_out, "q_out", q.scalar_type());
  TORCH_CHECK_VALUE(q_out.sizes() == q.sizes(), "q_out must have shape ", dims(q.sizes()), " like q, got ",
                    dims(q_out.sizes()));
  check_unit_inner_stride(q_out, "q_out");
  check_rows_disjoint(q_out, "q_out");
  check_device(q_out, "q_out", "q", q.device());
  check_eps(eps);
  check_table(freqs, positions, q.size(0), "q", q.device());
  if (!same_view(q_out, q)) {  // in place (q_out is q) is fine: each row is read whole before it is written
    check_no_shared_memory("q_out", q_out, {{"q", &q}});
  }
  check_no_shared_memory("q_out", q_out, {{"freqs", &freqs}, {"positions", &positions}});
  check_position_values(freqs, positions);
  norm_rope<false>(q, q_out, nullptr, eps, freqs, positions);
}

void fused_norm_rope_inplace(at::Tensor& kv, const at::Tensor& weight, double eps, const at::Tensor& freqs,
                             const at::Tensor& positions) {
  check_rows(kv, "kv");
  check_rows_disjoint(kv, "kv");
  check_weight(weight, kv);
  check_eps(eps);
  check_table(freqs, positions, kv.size(0), "kv", kv.device());
  check_no_shared_memory("kv", kv, {{"weight", &weight}, {"freqs", &freqs}, {"positions", &positions}});
  check_position_values(freqs, positions);
  norm_rope<true>(kv, kv, &weight, eps, freqs, positions);
}

std::tuple<at::Tensor, at::Tensor> fused_q_indexer_rope_hadamard_quant(const at::Tensor& q, const at::Tensor& weight,
                                                                       double weight_scale, const at::Tensor& freqs,
                                                                       const at::Tensor& positions) {
  check_float(q, "q");
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) == kIndexerDim, "q must have shape (B, H, 128), got ", dims(q.sizes()));
  check_unit_inner_stride(q, "q");
  check_dtype(weight, "weight", q.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) == q.size(0) && weight.size(1) == q.size(1),
                    "weight must have shape (B, H) like q, got ", dims(weight.sizes()));
  check_device(weight, "weight", "q", q.device());
  check_weight_scale(weight_scale);
  check_table(freqs, positions, q.size(0), "q", q.device());
  check_position_values(freqs, positions);

  const int64_t b = q.size(0), h = q.size(1);
  at::Tensor q_fp8 = at::empty({b, h, kIndexerDim}, q.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor weights_out = at::empty({b, h, 1}, q.options().dtype(at::kFloat));
  if (b * h == 0) return {q_fp8, weights_out};
  IndexerArgs a{};
  a.q = q.data_ptr();
  a.q_stride_b = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.weight = weight.data_ptr();
  a.w_stride_b = weight.stride(0);
  a.w_stride_h = weight.stride(1);
  a.weight_scale = static_cast<float>(weight_scale);
  a.freqs = freqs.data_ptr<float>();
  a.max_pos = freqs.size(0);
  a.positions = positions.data_ptr();
  a.positions_stride = positions.stride(0);
  a.positions_64 = positions.scalar_type() == at::kLong;
  a.q_fp8 = static_cast<uint8_t*>(q_fp8.data_ptr());
  a.weights_out = weights_out.data_ptr<float>();
  a.heads = static_cast<int>(h);
  a.rows = b * h;
  const int64_t esize = static_cast<int64_t>(q.element_size());
  const bool vec = (reinterpret_cast<uintptr_t>(q.data_ptr()) % (4 * esize)) == 0 &&
                   (a.q_stride_b * esize) % (4 * esize) == 0 && (a.q_stride_h * esize) % (4 * esize) == 0;
  dispatch_float(q.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (vec) {
      launch(indexer_q_kernel<T, true>, a, a.rows, q.device());
    } else {
      launch(indexer_q_kernel<T, false>, a, a.rows, q.device());
    }
  });
  return {q_fp8, weights_out};
}

}  // namespace
}  // namespace dspark

TORCH_LIBRARY_IMPL(dspark, CUDA, m) {
  m.impl("fused_k_norm_rope_flashmla", &dspark::fused_k_norm_rope_flashmla);
  m.impl("fused_q_norm_rope", &dspark::fused_q_norm_rope);
  m.impl("fused_norm_rope_inplace", &dspark::fused_norm_rope_inplace);
  m.impl("store_flashmla_cache", &dspark::store_flashmla_cache);
  m.impl("fused_q_indexer_rope_hadamard_quant", &dspark::fused_q_indexer_rope_hadamard_quant);
}
