// Torch binding of dsv4_compress_norm_rope_store: argument checks (the rules of
// custom_ops/dsv4_compress_store.py), launch on the current stream, registration under the CUDA key.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "error_format.h"

#include "dsv4_compress_store_kernels.cuh"

namespace dspark {
namespace dsv4 {
namespace {

void check_on(const at::Tensor& t, const char* name, const at::Tensor& kv) {
  TORCH_CHECK_VALUE(t.device() == kv.device(), name, ": expected a tensor on ", kv.device(), ", got ", t.device());
}

int64_t cache_page_bytes(int64_t d, int64_t page_size, bool fp4) {
  if (d == kIndexerDim) return ((fp4 ? kIndexerDim / 2 : kIndexerDim) + 4) * page_size;
  return ((kValueBytes + kScaleBytes) * page_size + kValueBytes - 1) / kValueBytes * kValueBytes;
}

void compress_norm_rope_store(const at::Tensor& kv, const at::Tensor& plan, const at::Tensor& norm_weight,
                              double eps, const at::Tensor& freqs, const at::Tensor& out_loc, at::Tensor& kvcache,
                              int64_t page_size, int64_t ratio, bool decode, bool fp4) {
  TORCH_CHECK_VALUE(ratio == 4 || ratio == 128, "ratio: expected 4 or 128, got ", num(ratio));
  TORCH_CHECK_VALUE(kv.is_cuda(), "kv: expected a CUDA tensor, got ", kv.device());
  TORCH_CHECK_VALUE(kv.dim() == 2 && (kv.size(1) == kIndexerDim || kv.size(1) == kHeadDim),
                    "kv: expected shape [rows, 128 or 512], got ", dims(kv.sizes()));
  TORCH_CHECK_TYPE(kv.scalar_type() == at::kFloat, "kv: expected float32, got ", kv.scalar_type());
  TORCH_CHECK_VALUE(kv.is_contiguous(), "kv: expected a contiguous tensor");
  const int64_t d = kv.size(1);
  TORCH_CHECK_VALUE(!fp4 || d == kIndexerDim,
                    "fp4: only the indexer store (kv of width 128) has an FP4 layout, got width ", num(d));
  TORCH_CHECK_TYPE(plan.scalar_type() == at::kByte, "plan: expected uint8 plan bytes, got ", plan.scalar_type());
  TORCH_CHECK_VALUE(plan.dim() == 2 && plan.size(1) == 16 && plan.is_contiguous() && plan.size(0) == kv.size(0),
                    "plan: expected a contiguous [", num(kv.size(0)), ", 16] uint8 tensor, got ", dims(plan.sizes()));
  TORCH_CHECK_VALUE(norm_weight.scalar_type() == at::kFloat && norm_weight.dim() == 1 && norm_weight.size(0) == d &&
                        norm_weight.is_contiguous(),
                    "norm_weight: expected a contiguous fp32 [", num(d), "] tensor");
  TORCH_CHECK_VALUE(freqs.scalar_type() == at::kFloat && freqs.dim() == 2 && freqs.size(1) == kRopeDim &&
                        freqs.is_contiguous(),
                    "freqs: expected a contiguous fp32 [max_pos, 64] table, got ", dims(freqs.sizes()));
  const auto lt = out_loc.scalar_type();
  TORCH_CHECK_TYPE((lt == at::kInt || lt == at::kLong) && out_loc.dim() == 1 && out_loc.is_contiguous(),
                   "out_loc: expected a contiguous 1-D int32/int64 tensor, got ", lt, " ", dims(out_loc.sizes()));
  TORCH_CHECK_VALUE(page_size >= 1 && (page_size & (page_size - 1)) == 0, "page_size: expected a power of two, got ",
                    num(page_size));
  const int64_t width = cache_page_bytes(d, page_size, fp4);
  TORCH_CHECK_VALUE(
      kvcache.scalar_type() == at::kByte && kvcache.dim() == 2 && kvcache.size(1) == width && kvcache.is_contiguous(),
      "kvcache: expected a contiguous uint8 [pages, ", num(width), "] tensor, got ", dims(kvcache.sizes()));
  check_on(plan, "plan", kv);
  check_on(norm_weight, "norm_weight", kv);
  check_on(freqs, "freqs", kv);
  check_on(out_loc, "out_loc", kv);
  check_on(kvcache, "kvcache", kv);
  for (const auto& [t, name] : {std::pair{&kv, "kv"}, {&norm_weight, "norm_weight"}, {&freqs, "freqs"}}) {
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, name,
                      ": expected a 16-byte aligned tensor (CUDA kernel)");
  }
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(kvcache.data_ptr()) % 4 == 0,
                    "kvcache: expected a 4-byte aligned tensor (CUDA kernel)");
  if (kv.size(0) == 0) return;

  StoreArgs a{};
  a.kv = kv.data_ptr<float>();
  a.plan = plan.data_ptr<uint8_t>();
  a.weight = norm_weight.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.freqs = freqs.data_ptr<float>();
  a.out_loc = out_loc.data_ptr();
  a.out_loc_64 = lt == at::kLong;
  a.out_loc_len = out_loc.size(0);
  a.cache = kvcache.data_ptr<uint8_t>();
  a.page_bytes = width;
  a.log2_page_size = 0;
  while ((int64_t{1} << a.log2_page_size) < page_size) ++a.log2_page_size;
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
