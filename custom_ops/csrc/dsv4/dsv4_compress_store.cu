// Torch binding of dsv4_compress_norm_rope_store: argument checks (the rules of
// custom_ops/dsv4/store.py; in checking mode also the index values, with the CPU path's messages), launch on
// the current stream, registration under the CUDA key.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>

#include "common/error_format.h"
#include "common/range_checks.h"
#include "dsv4/dsv4_checks.h"

#include "dsv4/dsv4_compress_store_kernels.cuh"

namespace dspark {
namespace dsv4 {
namespace {

void check_on(const at::Tensor& t, const char* name, const at::Tensor& kv) {
  TORCH_CHECK_VALUE(t.device() == kv.device(), name, ": expected a tensor on ", kv.device(), ", got ", t.device());
}

int64_t cache_page_bytes(int64_t d, int64_t page_size, bool fp4) {
  if (d == kIndexerDim) return ((fp4 ? kIndexerDim / 2 : kIndexerDim) + 4) * page_size;
  return (kTokenBytes * page_size + kValueBytes - 1) / kValueBytes * kValueBytes;
}

// dsv4/store.py, check_store_values (checking mode): out_loc entries inside the cache, then the out_loc index of
// every row with an entry, then the RoPE position of every row that stores. Syncs.
void check_store_values(const at::Tensor& plan, const at::Tensor& out_loc, int64_t max_pos, int64_t pages,
                        int64_t page_size, int64_t ratio, bool decode) {
  const int64_t slots = pages * page_size;
  check_index_range(out_loc, slots, "out_loc",
                    "expected < " + num(slots) + " (" + num(pages) + " pages of " + num(page_size) + " slots in kvcache)");
  const PlanColumns p = plan_columns(plan, 16);
  const at::Tensor seq = p.u32(0);
  at::Tensor valid, source;
  if (decode) {
    valid = p.col(1).ge(0).logical_and(p.col(2).ge(0)).logical_and(seq.remainder(ratio).eq(0));
    source = at::arange(plan.size(0), seq.options());
  } else {
    valid = seq.ne(int64_t{0xFFFFFFFF});
    source = p.low16(1);
  }
  valid = valid.logical_and(seq.ge(ratio));
  const int64_t entries = out_loc.size(0);
  check_plan_field("plan", "ragged_id", source, valid.logical_and(source.ge(entries)),
                   [&](int64_t) { return "expected < " + num(entries) + " (entries of out_loc)"; });
  const at::Tensor loc =
      entries > 0 ? out_loc.to(at::kLong).index_select(0, source.clamp(0, entries - 1)) : at::full_like(source, -1);
  const at::Tensor stores = valid.logical_and(loc.ge(0));
  check_plan_field("plan", "seq_len", seq, stores.logical_and((seq - ratio).ge(max_pos)), [&](int64_t) {
    return "expected <= " + num(max_pos - 1 + ratio) + " (the RoPE position seq_len - " + num(ratio) +
           " must be a row of freqs)";
  });
}

// Structural checks, in the order of dsv4/store.py, check_store_args; returns the head dim.
int64_t check_store_args(const at::Tensor& kv, const at::Tensor& plan, const at::Tensor& norm_weight, double eps,
                         const at::Tensor& freqs, const at::Tensor& out_loc, const at::Tensor& kvcache,
                         int64_t page_size, int64_t ratio, bool decode, bool fp4) {
  check_ratio(ratio);
  TORCH_CHECK_TYPE(kv.scalar_type() == at::kFloat, "kv: expected float32, got ", kv.scalar_type());
  TORCH_CHECK_VALUE(kv.dim() == 2 && (kv.size(1) == kIndexerDim || kv.size(1) == kHeadDim),
                    "kv: expected shape [rows, 128 or 512], got ", dims(kv.sizes()));
  TORCH_CHECK_VALUE(kv.is_contiguous(), "kv: expected a contiguous tensor");
  TORCH_CHECK_VALUE(kv.is_cuda(), "kv: expected a CUDA tensor, got ", kv.device());
  const int64_t d = kv.size(1);
  TORCH_CHECK_VALUE(!fp4 || d == kIndexerDim,
                    "fp4: only the indexer store (kv of width 128) has an FP4 layout, got width ", num(d));
  TORCH_CHECK_TYPE(plan.scalar_type() == at::kByte, "plan: expected uint8, got ", plan.scalar_type());
  TORCH_CHECK_VALUE(plan.dim() == 2 && plan.size(1) == 16 && plan.is_contiguous(),
                    "plan: expected a contiguous [rows, 16] uint8 tensor, got shape ", dims(plan.sizes()));
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(plan.data_ptr()) % 16 == 0, "plan: expected a 16-byte aligned plan");
  check_on(plan, "plan", kv);
  TORCH_CHECK_VALUE(plan.size(0) == kv.size(0), "plan: expected ", num(kv.size(0)), " rows (one per kv row), got ",
                    num(plan.size(0)));
  TORCH_CHECK_TYPE(norm_weight.scalar_type() == at::kFloat, "norm_weight: expected float32, got ",
                   norm_weight.scalar_type());
  TORCH_CHECK_VALUE(norm_weight.dim() == 1 && norm_weight.size(0) == d && norm_weight.is_contiguous(),
                    "norm_weight: expected a contiguous [", num(d), "] tensor, got shape ", dims(norm_weight.sizes()));
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps: expected a finite float >= 0, got ", num(eps));
  TORCH_CHECK_TYPE(freqs.scalar_type() == at::kFloat, "freqs: expected float32, got ", freqs.scalar_type());
  TORCH_CHECK_VALUE(freqs.dim() == 2 && freqs.size(1) == kRopeDim && freqs.is_contiguous(),
                    "freqs: expected a contiguous fp32 [max_pos, 64] table, got ", dims(freqs.sizes()));
  const auto lt = out_loc.scalar_type();
  TORCH_CHECK_TYPE(lt == at::kInt || lt == at::kLong, "out_loc: expected int32 or int64, got ", lt);
  TORCH_CHECK_VALUE(out_loc.dim() == 1, "out_loc: expected 1-D, got shape ", dims(out_loc.sizes()));
  TORCH_CHECK_VALUE(!decode || out_loc.size(0) == kv.size(0), "out_loc: expected ", num(kv.size(0)),
                    " entries (one per plan row), got ", num(out_loc.size(0)));
  TORCH_CHECK_VALUE(decode || out_loc.size(0) >= kv.size(0), "out_loc: expected at least ", num(kv.size(0)),
                    " entries (one per query token; a prefill plan has at most one row per query token), got ",
                    num(out_loc.size(0)));
  TORCH_CHECK_VALUE(page_size >= 1 && (page_size & (page_size - 1)) == 0, "page_size: expected a power of two, got ",
                    num(page_size));
  const int64_t width = cache_page_bytes(d, page_size, fp4);
  TORCH_CHECK_TYPE(kvcache.scalar_type() == at::kByte, "kvcache: expected uint8, got ", kvcache.scalar_type());
  TORCH_CHECK_VALUE(kvcache.dim() == 2 && kvcache.size(1) == width && kvcache.is_contiguous(),
                    "kvcache: expected a contiguous uint8 [pages, ", num(width), "] tensor, got ", dims(kvcache.sizes()));
  check_on(norm_weight, "norm_weight", kv);
  check_on(freqs, "freqs", kv);
  check_on(out_loc, "out_loc", kv);
  check_on(kvcache, "kvcache", kv);
  for (const auto& [t, name] : {std::pair{&kv, "kv"}, {&norm_weight, "norm_weight"}, {&freqs, "freqs"}}) {
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, name,
                      ": expected a 16-byte aligned tensor");
  }
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(kvcache.data_ptr()) % 4 == 0,
                    "kvcache: expected a 4-byte aligned tensor");
  check_no_shared_memory(
      "kvcache", kvcache,
      {{"kv", &kv}, {"plan", &plan}, {"norm_weight", &norm_weight}, {"freqs", &freqs}, {"out_loc", &out_loc}});
  return d;
}

void compress_norm_rope_store(const at::Tensor& kv, const at::Tensor& plan, const at::Tensor& norm_weight,
                              double eps, const at::Tensor& freqs, const at::Tensor& out_loc_in, at::Tensor& kvcache,
                              int64_t page_size, int64_t ratio, bool decode, bool fp4) {
  const int64_t d =
      check_store_args(kv, plan, norm_weight, eps, freqs, out_loc_in, kvcache, page_size, ratio, decode, fp4);
  const at::Tensor out_loc = out_loc_in.contiguous();  // kept alive by the caching allocator's stream order
  if (must_check_values()) check_store_values(plan, out_loc, freqs.size(0), kvcache.size(0), page_size, ratio, decode);
  if (kv.size(0) == 0) return;

  StoreArgs a{};
  a.kv = kv.data_ptr<float>();
  a.plan = plan.data_ptr<uint8_t>();
  a.weight = norm_weight.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.freqs = freqs.data_ptr<float>();
  a.out_loc = out_loc.data_ptr();
  a.out_loc_64 = out_loc.scalar_type() == at::kLong;
  a.out_loc_len = out_loc.size(0);
  a.cache = kvcache.data_ptr<uint8_t>();
  a.page_bytes = kvcache.size(1);
  a.log2_page_size = 0;
  while ((int64_t{1} << a.log2_page_size) < page_size) ++a.log2_page_size;
  a.num_slots = kvcache.size(0) * page_size;
  a.max_pos = freqs.size(0);
  a.rows = kv.size(0);
  a.ratio = static_cast<int>(ratio);
  a.decode = decode;
  const c10::cuda::CUDAGuard guard(kv.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(kv.device().index());
  const unsigned blocks = static_cast<unsigned>((a.rows + kStoreWarps - 1) / kStoreWarps);
  if (d == kHeadDim) {
    store_flashmla_kernel<<<blocks, kStoreThreads, 0, stream>>>(a);
  } else if (fp4) {
    store_indexer_kernel<true><<<blocks, kStoreThreads, 0, stream>>>(a);
  } else {
    store_indexer_kernel<false><<<blocks, kStoreThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace dsv4
}  // namespace dspark

TORCH_LIBRARY_IMPL(dspark, CUDA, m) {
  m.impl("dsv4_compress_norm_rope_store", &dspark::dsv4::compress_norm_rope_store);
}
