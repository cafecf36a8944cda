// Torch binding of the DeepSeek-V4 decode planners (CUDA key). The prefill planners keep their composite
// implementation (fixed-shape torch ops, sync-free), see custom_ops/dsv4_compress_plan.py.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "dsv4_compress_plan_kernels.cuh"

namespace dspark {
namespace dsv4 {
namespace {

// `t` must stay alive (and contiguous) while the kernel may run: callers pass contiguous() copies they own.
IndexView index_view(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device) {
  const auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kInt || d == at::kLong, name, ": expected int32 or int64, got ", d);
  TORCH_CHECK_VALUE(t.dim() == dim, name, ": expected a ", dim, "-D tensor, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, name, ": expected a tensor on ", device, ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": internal error, expected a contiguous copy");
  return IndexView{t.data_ptr(), d == at::kLong};
}

void launch(bool online, const PlanDecodeArgs& a, const at::Device& device) {
  if (a.batch == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  const unsigned blocks = static_cast<unsigned>((a.batch + kPlanThreads - 1) / kPlanThreads);
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  if (online) {
    plan_decode_kernel<true><<<blocks, kPlanThreads, 0, stream>>>(a);
  } else {
    plan_decode_kernel<false><<<blocks, kPlanThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor plan_decode(const at::Tensor& seq_lens_in, const at::Tensor& req_pool_indices_in,
                       const std::optional<at::Tensor>& req_to_token_in,
                       const std::optional<at::Tensor>& full_to_state_in, int64_t ratio, int64_t ring_size,
                       int64_t swa_page_size) {
  const at::Tensor seq_lens = seq_lens_in.contiguous(), req_pool_indices = req_pool_indices_in.contiguous();
  std::optional<at::Tensor> req_to_token, full_to_state;
  if (req_to_token_in.has_value()) req_to_token = req_to_token_in->contiguous();
  if (full_to_state_in.has_value()) full_to_state = full_to_state_in->contiguous();
  const auto device = seq_lens.device();
  TORCH_CHECK_VALUE(ratio == 4 || ratio == 128, "ratio: expected 4 or 128, got ", ratio);
  TORCH_CHECK_VALUE(ring_size >= (ratio == 4 ? 8 : 128) && ring_size % ratio == 0,
                    "ring_size: expected a multiple of ", ratio, " that is >= ", ratio == 4 ? 8 : 128, ", got ",
                    ring_size);
  TORCH_CHECK_VALUE(req_to_token.has_value() == full_to_state.has_value(),
                    "req_to_token/full_to_state: pass both (paged addressing) or neither (ring addressing)");
  PlanDecodeArgs a{};
  a.seq_lens = index_view(seq_lens, "seq_lens", 1, device);
  a.rids = index_view(req_pool_indices, "req_pool_indices", 1, device);
  TORCH_CHECK_VALUE(req_pool_indices.size(0) == seq_lens.size(0), "req_pool_indices: expected ", seq_lens.size(0),
                    " entries (one per seq_lens entry), got ", req_pool_indices.size(0));
  a.batch = seq_lens.size(0);
  a.ratio = static_cast<int>(ratio);
  a.ring = static_cast<int>(ring_size);
  if (req_to_token.has_value()) {
    TORCH_CHECK_VALUE(swa_page_size > 0 && swa_page_size % ring_size == 0,
                      "swa_page_size: expected a positive multiple of ring_size=", ring_size, ", got ", swa_page_size);
    a.req_to_token = index_view(*req_to_token, "req_to_token", 2, device);
    a.full_to_state = index_view(*full_to_state, "full_to_state", 1, device);
    a.r2t_rows = req_to_token->size(0);
    a.r2t_cols = req_to_token->size(1);
    a.f2s_len = full_to_state->size(0);
    a.swa_page = static_cast<int>(swa_page_size);
  }
  at::Tensor out = at::empty({a.batch, 16}, seq_lens.options().dtype(at::kByte));
  a.out = reinterpret_cast<DecodePlan*>(out.data_ptr<uint8_t>());
  launch(false, a, device);
  return out;
}

at::Tensor plan_online_decode(const at::Tensor& seq_lens_in, const at::Tensor& req_pool_indices_in) {
  const at::Tensor seq_lens = seq_lens_in.contiguous(), req_pool_indices = req_pool_indices_in.contiguous();
  const auto device = seq_lens.device();
  PlanDecodeArgs a{};
  a.seq_lens = index_view(seq_lens, "seq_lens", 1, device);
  a.rids = index_view(req_pool_indices, "req_pool_indices", 1, device);
  TORCH_CHECK_VALUE(req_pool_indices.size(0) == seq_lens.size(0), "req_pool_indices: expected ", seq_lens.size(0),
                    " entries, got ", req_pool_indices.size(0));
  a.batch = seq_lens.size(0);
  at::Tensor out = at::empty({a.batch, 16}, seq_lens.options().dtype(at::kByte));
  a.out = reinterpret_cast<DecodePlan*>(out.data_ptr<uint8_t>());
  launch(true, a, device);
  return out;
}

}  // namespace
}  // namespace dsv4
}  // namespace dspark

TORCH_LIBRARY_IMPL(dspark, CUDA, m) {
  m.impl("dsv4_plan_decode", &dspark::dsv4::plan_decode);
  m.impl("dsv4_plan_online_decode", &dspark::dsv4::plan_online_decode);
}
