// Torch binding of the DeepSeek-V4 planners (CUDA key): argument checks, scratch / output allocation (shapes from
// input shapes only), launches on the current stream. Reference: custom_ops/dsv4_compress_plan.py.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "error_format.h"

#include "dsv4_compress_plan_kernels.cuh"

namespace dspark {
namespace dsv4 {
namespace {

// `t` must stay alive (and contiguous) while the kernel may run: callers pass contiguous() copies they own.
IndexView index_view(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device) {
  const auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kInt || d == at::kLong, name, ": expected int32 or int64, got ", d);
  TORCH_CHECK_VALUE(t.dim() == dim, name, ": expected a ", num(dim), "-D tensor, got shape ", dims(t.sizes()));
  TORCH_CHECK_VALUE(t.device() == device, name, ": expected a tensor on ", device, ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": internal error, expected a contiguous copy");
  return IndexView{t.data_ptr(), d == at::kLong};
}

void check_ratio_ring(int64_t ratio, int64_t ring_size) {
  TORCH_CHECK_VALUE(ratio == 4 || ratio == 128, "ratio: expected 4 or 128, got ", num(ratio));
  TORCH_CHECK_VALUE(ring_size >= (ratio == 4 ? 8 : 128) && ring_size % ratio == 0, "ring_size: expected a multiple of ",
                    num(ratio), " that is >= ", num(ratio == 4 ? 8 : 128), ", got ", num(ring_size));
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
  check_ratio_ring(ratio, ring_size);
  TORCH_CHECK_VALUE(req_to_token.has_value() == full_to_state.has_value(),
                    "req_to_token/full_to_state: pass both (paged addressing) or neither (ring addressing)");
  PlanDecodeArgs a{};
  a.seq_lens = index_view(seq_lens, "seq_lens", 1, device);
  a.rids = index_view(req_pool_indices, "req_pool_indices", 1, device);
  TORCH_CHECK_VALUE(req_pool_indices.size(0) == seq_lens.size(0), "req_pool_indices: expected ", num(seq_lens.size(0)),
                    " entries (one per seq_lens entry), got ", num(req_pool_indices.size(0)));
  a.batch = seq_lens.size(0);
  a.ratio = static_cast<int>(ratio);
  a.ring = static_cast<int>(ring_size);
  if (req_to_token.has_value()) {
    TORCH_CHECK_VALUE(swa_page_size > 0 && swa_page_size % ring_size == 0,
                      "swa_page_size: expected a positive multiple of ring_size=", num(ring_size), ", got ",
                      num(swa_page_size));
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
  TORCH_CHECK_VALUE(req_pool_indices.size(0) == seq_lens.size(0), "req_pool_indices: expected ", num(seq_lens.size(0)),
                    " entries, got ", num(req_pool_indices.size(0)));
  a.batch = seq_lens.size(0);
  at::Tensor out = at::empty({a.batch, 16}, seq_lens.options().dtype(at::kByte));
  a.out = reinterpret_cast<DecodePlan*>(out.data_ptr<uint8_t>());
  launch(true, a, device);
  return out;
}

int64_t check_tokens(int64_t n) {
  TORCH_CHECK_VALUE(n >= 0 && n <= 65535, "num_q_tokens: expected 0..65535 (16-bit ragged ids), got ", num(n));
  return n;
}

void launch_prefill(bool online, const PlanPrefillArgs& a, const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  if (online) {
    plan_prefill_kernel<true><<<1, kPrefillThreads, 0, stream>>>(a);
  } else {
    plan_prefill_kernel<false><<<1, kPrefillThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> plan_prefill(const at::Tensor& seq_lens_in, const at::Tensor& extend_lens_in,
                                                const at::Tensor& req_pool_indices_in,
                                                const std::optional<at::Tensor>& req_to_token_in,
                                                const std::optional<at::Tensor>& full_to_state_in, int64_t ratio,
                                                int64_t ring_size, int64_t swa_page_size,
                                                int64_t num_q_tokens) {
  const at::Tensor seq_lens = seq_lens_in.contiguous(), extend_lens = extend_lens_in.contiguous();
  const at::Tensor req_pool_indices = req_pool_indices_in.contiguous();
  std::optional<at::Tensor> req_to_token, full_to_state;
  if (req_to_token_in.has_value()) req_to_token = req_to_token_in->contiguous();
  if (full_to_state_in.has_value()) full_to_state = full_to_state_in->contiguous();
  const auto device = seq_lens.device();
  check_ratio_ring(ratio, ring_size);
  TORCH_CHECK_VALUE(req_to_token.has_value() == full_to_state.has_value(),
                    "req_to_token/full_to_state: pass both (paged addressing) or neither (ring addressing)");
  const int64_t n = check_tokens(num_q_tokens);
  PlanPrefillArgs a{};
  a.addr.seq_lens = index_view(seq_lens, "seq_lens", 1, device);
  a.ext_lens = index_view(extend_lens, "extend_lens", 1, device);
  a.addr.rids = index_view(req_pool_indices, "req_pool_indices", 1, device);
  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK_VALUE(extend_lens.size(0) == batch && req_pool_indices.size(0) == batch,
                    "extend_lens/req_pool_indices: expected ", num(batch), " entries (one per seq_lens entry)");
  a.addr.batch = batch;
  a.addr.ratio = static_cast<int>(ratio);
  a.addr.ring = static_cast<int>(ring_size);
  if (req_to_token.has_value()) {
    TORCH_CHECK_VALUE(swa_page_size > 0 && swa_page_size % ring_size == 0,
                      "swa_page_size: expected a positive multiple of ring_size=", num(ring_size), ", got ",
                      num(swa_page_size));
    a.addr.req_to_token = index_view(*req_to_token, "req_to_token", 2, device);
    a.addr.full_to_state = index_view(*full_to_state, "full_to_state", 1, device);
    a.addr.r2t_rows = req_to_token->size(0);
    a.addr.r2t_cols = req_to_token->size(1);
    a.addr.f2s_len = full_to_state->size(0);
    a.addr.swa_page = static_cast<int>(swa_page_size);
  }
  a.num_tokens = n;
  a.rows_c = std::min(n, n / ratio + batch);
  a.rows_w = n;
  const at::Tensor ends = at::empty({batch}, seq_lens.options().dtype(at::kLong));
  at::Tensor plan_c = at::empty({a.rows_c, 16}, seq_lens.options().dtype(at::kByte));
  at::Tensor plan_w = at::empty({a.rows_w, 8}, seq_lens.options().dtype(at::kByte));
  a.ends = ends.data_ptr<int64_t>();
  a.plan_c = reinterpret_cast<CompressPlan*>(plan_c.data_ptr<uint8_t>());
  a.plan_w = plan_w.data_ptr<uint8_t>();
  launch_prefill(false, a, device);
  return {plan_c, plan_w};
}

std::tuple<at::Tensor, at::Tensor> plan_online_prefill(const at::Tensor& seq_lens_in,
                                                       const at::Tensor& extend_lens_in,
                                                       const at::Tensor& req_pool_indices_in,
                                                       int64_t num_q_tokens) {
  const at::Tensor seq_lens = seq_lens_in.contiguous(), extend_lens = extend_lens_in.contiguous();
  const at::Tensor req_pool_indices = req_pool_indices_in.contiguous();
  const auto device = seq_lens.device();
  const int64_t n = check_tokens(num_q_tokens);
  PlanPrefillArgs a{};
  a.addr.seq_lens = index_view(seq_lens, "seq_lens", 1, device);
  a.ext_lens = index_view(extend_lens, "extend_lens", 1, device);
  a.addr.rids = index_view(req_pool_indices, "req_pool_indices", 1, device);
  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK_VALUE(extend_lens.size(0) == batch && req_pool_indices.size(0) == batch,
                    "extend_lens/req_pool_indices: expected ", num(batch), " entries (one per seq_lens entry)");
  a.addr.batch = batch;
  a.addr.ratio = 128;
  a.num_tokens = n;
  a.rows_c = std::min(n, n / 128 + batch);
  a.rows_w = std::min(n, batch);
  const at::Tensor ends = at::empty({batch}, seq_lens.options().dtype(at::kLong));
  at::Tensor plan_c = at::empty({a.rows_c, 16}, seq_lens.options().dtype(at::kByte));
  at::Tensor plan_w = at::empty({a.rows_w, 16}, seq_lens.options().dtype(at::kByte));
  a.ends = ends.data_ptr<int64_t>();
  a.plan_c = reinterpret_cast<CompressPlan*>(plan_c.data_ptr<uint8_t>());
  a.plan_w = plan_w.data_ptr<uint8_t>();
  launch_prefill(true, a, device);
  return {plan_c, plan_w};
}

}  // namespace
}  // namespace dsv4
}  // namespace dspark

TORCH_LIBRARY_IMPL(dspark, CUDA, m) {
  m.impl("dsv4_plan_decode", &dspark::dsv4::plan_decode);
  m.impl("dsv4_plan_online_decode", &dspark::dsv4::plan_online_decode);
  m.impl("dsv4_plan_prefill", &dspark::dsv4::plan_prefill);
  m.impl("dsv4_plan_online_prefill", &dspark::dsv4::plan_online_prefill);
}
