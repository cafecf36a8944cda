// Torch binding of the DeepSeek-V4 planners (CUDA key): argument checks, scratch / output allocation (shapes from
// input shapes only), launches on the current stream. Reference: custom_ops/dsv4/plan.py (the same
// structural checks, and in checking mode the same value errors, word for word).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "common/error_format.h"
#include "common/range_checks.h"
#include "dsv4/dsv4_checks.h"

#include "dsv4/dsv4_compress_plan_kernels.cuh"

namespace dspark {
namespace dsv4 {
namespace {

constexpr int64_t kStateRows = int64_t{1} << 31;  // state rows and slots are int32 plan fields
constexpr int64_t kInt32Max = kStateRows - 1;
constexpr int64_t kMaxRagged = 65535;

void check_index(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device) {
  const auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kInt || d == at::kLong, name, ": expected int32 or int64, got ", d);
  TORCH_CHECK_VALUE(t.dim() == dim, name, ": expected ", num(dim), "-D, got shape ", dims(t.sizes()));
  TORCH_CHECK_VALUE(t.device() == device, name, ": expected a tensor on ", device, ", got ", t.device());
}

// seq_lens and the other per-request tensors: 1-D int32/int64 with B entries, on seq_lens' device.
void check_batch(const at::Tensor& seq_lens, std::initializer_list<std::pair<const at::Tensor*, const char*>> others) {
  check_index(seq_lens, "seq_lens", 1, seq_lens.device());
  for (const auto& [t, name] : others) {
    check_index(*t, name, 1, seq_lens.device());
    TORCH_CHECK_VALUE(t->size(0) == seq_lens.size(0), name, ": expected ", num(seq_lens.size(0)),
                      " entries (one per seq_lens entry), got ", num(t->size(0)));
  }
}

void check_addressing(const at::Tensor& seq_lens, const std::optional<at::Tensor>& req_to_token,
                      const std::optional<at::Tensor>& full_to_state, int64_t ratio, int64_t ring_size,
                      int64_t swa_page_size) {
  check_ratio(ratio);
  const int64_t window = window_of(ratio);
  TORCH_CHECK_VALUE(ring_size >= window && ring_size <= kInt32Max && ring_size % ratio == 0,
                    "ring_size: expected a multiple of ", num(ratio), " in ", num(window), "..", num(kInt32Max),
                    ", got ", num(ring_size));
  TORCH_CHECK_VALUE(req_to_token.has_value() == full_to_state.has_value(),
                    "req_to_token/full_to_state: pass both (paged addressing) or neither (ring addressing)");
  if (!req_to_token.has_value()) return;
  check_index(*req_to_token, "req_to_token", 2, seq_lens.device());
  check_index(*full_to_state, "full_to_state", 1, seq_lens.device());
  TORCH_CHECK_VALUE(swa_page_size > 0 && swa_page_size <= kInt32Max && swa_page_size % ring_size == 0,
                    "swa_page_size: expected a positive multiple of ring_size=", num(ring_size), " up to ",
                    num(kInt32Max), ", got ", num(swa_page_size));
}

int64_t check_tokens(int64_t n) {
  TORCH_CHECK_VALUE(n >= 0 && n <= kMaxRagged, "num_q_tokens: expected 0..", num(kMaxRagged),
                    " (16-bit ragged ids), got ", num(n));
  return n;
}

// `t` must stay alive (and contiguous) while the kernel may run: callers pass contiguous() copies they own.
IndexView index_view(const at::Tensor& t) { return IndexView{t.data_ptr(), t.scalar_type() == at::kLong}; }

// The value limits of custom_ops/dsv4/plan.py (_seq_limit, _request_limit) and how messages state them.
struct Limits {
  int64_t seq_max;
  std::string seq_what;
  int64_t rid_hi;
  std::string rid_what;
  int64_t swa_hi;
};

Limits limits(const std::optional<at::Tensor>& req_to_token, int64_t ring, int64_t swa_page, bool online) {
  Limits l{kInt32Max, "expected <= " + num(kInt32Max) + " (int32 positions)", 0, "", 0};
  if (online) {
    l.rid_hi = kStateRows;
    l.rid_what = "expected < " + num(kStateRows) + " (int32 state slots)";
    return l;
  }
  if (!req_to_token.has_value()) {
    l.rid_hi = kStateRows / ring;
    l.rid_what = "expected < " + num(l.rid_hi) + " (a ring of " + num(ring) + " rows per request, int32 state rows)";
    return l;
  }
  const int64_t cols = req_to_token->size(1);
  if (cols <= kInt32Max) {
    l.seq_max = cols;
    l.seq_what = "expected <= " + num(cols) + " (columns of req_to_token)";
  }
  l.rid_hi = req_to_token->size(0);
  l.rid_what = "expected < " + num(l.rid_hi) + " (rows of req_to_token)";
  l.swa_hi = (kStateRows / ring) * swa_page;
  return l;
}

// Everything the value-error messages read (contiguous copies the kernel used).
struct PlanInputs {
  at::Tensor seq_lens, extend_lens, req_pool_indices, ends;
  std::optional<at::Tensor> req_to_token, full_to_state;
  int64_t num_tokens;
  Limits lim;
};

int64_t at_index(const at::Tensor& t, int64_t i) { return t.view(-1)[i].item<int64_t>(); }

[[noreturn]] void raise_value(const char* name, const std::string& label, int64_t value, const std::string& what) {
  TORCH_CHECK_VALUE(false, name, "[", label, "] = ", num(value), " is out of range: ", what);
  __builtin_unreachable();
}

// Checking mode: raise the problem the kernel reported (the CPU path's ValueError), if any. Syncs.
void raise_reported(const at::Tensor& problem, const PlanInputs& in) {
  const auto key = static_cast<unsigned long long>(problem.item<int64_t>());
  if (key == kNoProblem) return;
  const int rank = static_cast<int>(key >> kProblemShift);
  const int64_t i = static_cast<int64_t>(key & ((1ull << kProblemShift) - 1));
  const std::string b = num(i);
  switch (rank) {
    case kErrExtendRange:
      raise_value("extend_lens", b, at_index(in.extend_lens, i),
                  "expected 0.." + num(in.num_tokens) + " (num_q_tokens)");
    case kErrExtendSum:
      raise_value("extend_lens", b, at_index(in.extend_lens, i),
                  "sum(extend_lens[:" + num(i + 1) + "]) = " + num(at_index(in.ends, i)) +
                      " exceeds num_q_tokens = " + num(in.num_tokens));
    case kErrSeqBelowExtend:
      raise_value("seq_lens", b, at_index(in.seq_lens, i),
                  "expected >= extend_lens[" + b + "] = " + num(at_index(in.extend_lens, i)));
    case kErrSeqMax:
      raise_value("seq_lens", b, at_index(in.seq_lens, i), in.lim.seq_what);
    case kErrRequest:
      raise_value("req_pool_indices", b, at_index(in.req_pool_indices, i), in.lim.rid_what);
    case kErrReqToToken: {
      const int64_t cols = in.req_to_token->size(1);
      raise_value("req_to_token", num(i / cols) + ", " + num(i % cols), at_index(*in.req_to_token, i),
                  "expected < " + num(in.full_to_state->size(0)) +
                      " (entries of full_to_state; negative entries are unmapped)");
    }
    case kErrFullToState:
      raise_value("full_to_state", b, at_index(*in.full_to_state, i),
                  "expected < " + num(in.lim.swa_hi) + " (state rows must fit in int32; negative entries are unmapped)");
    default:
      TORCH_CHECK(false, "dsv4 planner: internal error, unknown problem rank ", num(rank));
  }
}

// Checking mode: a word the kernel reports its first problem into; undefined otherwise (no sync, capturable).
at::Tensor problem_word(const at::Tensor& like) {
  if (!must_check_values()) return at::Tensor();
  return at::full({1}, static_cast<int64_t>(kNoProblem), like.options().dtype(at::kLong));
}

unsigned long long* problem_ptr(const at::Tensor& word) {
  return word.defined() ? reinterpret_cast<unsigned long long*>(word.data_ptr<int64_t>()) : nullptr;
}

void set_limits(PlanDecodeArgs& a, const Limits& l) {
  a.seq_max = l.seq_max;
  a.rid_hi = l.rid_hi;
  a.swa_hi = l.swa_hi;
}

void set_paged(PlanDecodeArgs& a, const at::Tensor& req_to_token, const at::Tensor& full_to_state,
               int64_t swa_page_size) {
  a.req_to_token = index_view(req_to_token);
  a.full_to_state = index_view(full_to_state);
  a.r2t_rows = req_to_token.size(0);
  a.r2t_cols = req_to_token.size(1);
  a.f2s_len = full_to_state.size(0);
  a.swa_page = static_cast<int>(swa_page_size);
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

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

at::Tensor plan_decode(const at::Tensor& seq_lens_in, const at::Tensor& req_pool_indices_in,
                       const std::optional<at::Tensor>& req_to_token_in,
                       const std::optional<at::Tensor>& full_to_state_in, int64_t ratio, int64_t ring_size,
                       int64_t swa_page_size) {
  check_batch(seq_lens_in, {{&req_pool_indices_in, "req_pool_indices"}});
  check_addressing(seq_lens_in, req_to_token_in, full_to_state_in, ratio, ring_size, swa_page_size);
  const at::Tensor seq_lens = seq_lens_in.contiguous(), req_pool_indices = req_pool_indices_in.contiguous();
  const auto req_to_token = contiguous(req_to_token_in), full_to_state = contiguous(full_to_state_in);
  const Limits lim = limits(req_to_token, ring_size, swa_page_size, false);
  const at::Tensor problem = problem_word(seq_lens);
  PlanDecodeArgs a{};
  a.seq_lens = index_view(seq_lens);
  a.rids = index_view(req_pool_indices);
  a.batch = seq_lens.size(0);
  a.ratio = static_cast<int>(ratio);
  a.ring = static_cast<int>(ring_size);
  set_limits(a, lim);
  if (req_to_token.has_value()) set_paged(a, *req_to_token, *full_to_state, swa_page_size);
  a.problem = problem_ptr(problem);
  at::Tensor out = at::empty({a.batch, 16}, seq_lens.options().dtype(at::kByte));
  a.out = reinterpret_cast<DecodePlan*>(out.data_ptr<uint8_t>());
  launch(false, a, seq_lens.device());
  if (problem.defined()) {
    raise_reported(problem, {seq_lens, at::Tensor(), req_pool_indices, at::Tensor(), req_to_token, full_to_state, 0, lim});
  }
  return out;
}

at::Tensor plan_online_decode(const at::Tensor& seq_lens_in, const at::Tensor& req_pool_indices_in) {
  check_batch(seq_lens_in, {{&req_pool_indices_in, "req_pool_indices"}});
  const at::Tensor seq_lens = seq_lens_in.contiguous(), req_pool_indices = req_pool_indices_in.contiguous();
  const Limits lim = limits(std::nullopt, 1, 0, true);
  const at::Tensor problem = problem_word(seq_lens);
  PlanDecodeArgs a{};
  a.seq_lens = index_view(seq_lens);
  a.rids = index_view(req_pool_indices);
  a.batch = seq_lens.size(0);
  set_limits(a, lim);
  a.problem = problem_ptr(problem);
  at::Tensor out = at::empty({a.batch, 16}, seq_lens.options().dtype(at::kByte));
  a.out = reinterpret_cast<DecodePlan*>(out.data_ptr<uint8_t>());
  launch(true, a, seq_lens.device());
  if (problem.defined()) {
    raise_reported(problem, {seq_lens, at::Tensor(), req_pool_indices, at::Tensor(), std::nullopt, std::nullopt, 0, lim});
  }
  return out;
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

// The prefill launch shared by the offline and online planners: `a.addr` holds the addressing; fills in the rest.
std::tuple<at::Tensor, at::Tensor> run_prefill(bool online, PlanPrefillArgs& a, const PlanInputs& in, int64_t ratio) {
  const at::Tensor& seq_lens = in.seq_lens;
  const int64_t n = in.num_tokens, batch = seq_lens.size(0);
  const at::Tensor problem = problem_word(seq_lens);
  a.addr.seq_lens = index_view(seq_lens);
  a.addr.rids = index_view(in.req_pool_indices);
  a.addr.batch = batch;
  set_limits(a.addr, in.lim);
  a.addr.problem = problem_ptr(problem);
  a.ext_lens = index_view(in.extend_lens);
  a.num_tokens = n;
  a.rows_c = std::min(n, n / ratio + batch);
  a.rows_w = online ? std::min(n, batch) : n;
  at::Tensor plan_c = at::empty({a.rows_c, 16}, seq_lens.options().dtype(at::kByte));
  at::Tensor plan_w = at::empty({a.rows_w, online ? 16 : 8}, seq_lens.options().dtype(at::kByte));
  a.ends = in.ends.data_ptr<int64_t>();
  a.plan_c = reinterpret_cast<CompressPlan*>(plan_c.data_ptr<uint8_t>());
  a.plan_w = plan_w.data_ptr<uint8_t>();
  launch_prefill(online, a, seq_lens.device());
  if (problem.defined()) raise_reported(problem, in);
  return {plan_c, plan_w};
}

std::tuple<at::Tensor, at::Tensor> plan_prefill(const at::Tensor& seq_lens_in, const at::Tensor& extend_lens_in,
                                                const at::Tensor& req_pool_indices_in,
                                                const std::optional<at::Tensor>& req_to_token_in,
                                                const std::optional<at::Tensor>& full_to_state_in, int64_t ratio,
                                                int64_t ring_size, int64_t swa_page_size,
                                                int64_t num_q_tokens) {
  check_batch(seq_lens_in, {{&extend_lens_in, "extend_lens"}, {&req_pool_indices_in, "req_pool_indices"}});
  check_addressing(seq_lens_in, req_to_token_in, full_to_state_in, ratio, ring_size, swa_page_size);
  const int64_t n = check_tokens(num_q_tokens);
  const auto req_to_token = contiguous(req_to_token_in), full_to_state = contiguous(full_to_state_in);
  const PlanInputs in{seq_lens_in.contiguous(),
                      extend_lens_in.contiguous(),
                      req_pool_indices_in.contiguous(),
                      at::empty({seq_lens_in.size(0)}, seq_lens_in.options().dtype(at::kLong)),
                      req_to_token,
                      full_to_state,
                      n,
                      limits(req_to_token, ring_size, swa_page_size, false)};
  PlanPrefillArgs a{};
  a.addr.ratio = static_cast<int>(ratio);
  a.addr.ring = static_cast<int>(ring_size);
  if (req_to_token.has_value()) set_paged(a.addr, *req_to_token, *full_to_state, swa_page_size);
  return run_prefill(false, a, in, ratio);
}

std::tuple<at::Tensor, at::Tensor> plan_online_prefill(const at::Tensor& seq_lens_in,
                                                       const at::Tensor& extend_lens_in,
                                                       const at::Tensor& req_pool_indices_in,
                                                       int64_t num_q_tokens) {
  check_batch(seq_lens_in, {{&extend_lens_in, "extend_lens"}, {&req_pool_indices_in, "req_pool_indices"}});
  const int64_t n = check_tokens(num_q_tokens);
  const PlanInputs in{seq_lens_in.contiguous(),
                      extend_lens_in.contiguous(),
                      req_pool_indices_in.contiguous(),
                      at::empty({seq_lens_in.size(0)}, seq_lens_in.options().dtype(at::kLong)),
                      std::nullopt,
                      std::nullopt,
                      n,
                      limits(std::nullopt, 1, 0, true)};
  PlanPrefillArgs a{};
  a.addr.ratio = 128;
  return run_prefill(true, a, in, 128);
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
