// Torch binding of the DeepSeek-V4 compression kernels: argument checks (ValueError / TypeError in Python, the
// rules of custom_ops/dsv4/compress.py and online.py; in checking mode also the plan values, with the
// CPU path's messages: dsv4_checks.h), dtype dispatch, launches on the current stream (prefill: compress launch,
// then state-write launch) and registration under the CUDA key.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/error_format.h"
#include "common/range_checks.h"
#include "dsv4/dsv4_checks.h"

#include "dsv4/dsv4_compress_kernels.cuh"

namespace dspark {
namespace dsv4 {
namespace {

template <typename T>
struct Tag {
  using type = T;
};

template <typename F>
void dispatch_dtype(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(Tag<float>{});
    case at::kBFloat16:
      return f(Tag<__nv_bfloat16>{});
    default:
      TORCH_CHECK_TYPE(false, name, ": expected float32 or bfloat16, got ", dtype);
  }
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& state) {
  TORCH_CHECK_VALUE(t.device() == state.device(), name, ": expected a tensor on ", state.device(), ", got ",
                    t.device());
}

int64_t check_ape(const at::Tensor& ape, int64_t rows) {
  TORCH_CHECK_TYPE(ape.scalar_type() == at::kFloat, "ape: expected an fp32 tensor, got ", ape.scalar_type());
  TORCH_CHECK_VALUE(ape.dim() == 2 && ape.size(0) == rows && (ape.size(1) == 128 || ape.size(1) == 512),
                    "ape: expected shape [", num(rows), ", D] with D in (128, 512), got ", dims(ape.sizes()));
  TORCH_CHECK_VALUE(ape.is_contiguous() && reinterpret_cast<uintptr_t>(ape.data_ptr()) % 16 == 0,
                    "ape: expected a contiguous, 16-byte aligned tensor");
  return ape.size(1);
}

void check_matrix(const at::Tensor& t, const char* name, int64_t cols) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(1) == cols, name, ": expected shape [rows, ", num(cols), "], got ",
                    dims(t.sizes()));
  TORCH_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, name, ": expected unit stride in the last dim, got strides ",
                    dims(t.strides()));
}

void check_plan(const at::Tensor& plan, const char* name, int64_t width, const at::Tensor& state) {
  TORCH_CHECK_TYPE(plan.scalar_type() == at::kByte, name, ": expected uint8 plan bytes, got ", plan.scalar_type());
  TORCH_CHECK_VALUE(plan.dim() == 2 && plan.size(1) == width && plan.is_contiguous(), name,
                    ": expected a contiguous [rows, ", num(width), "] uint8 tensor, got shape ", dims(plan.sizes()));
  TORCH_CHECK_VALUE((reinterpret_cast<uintptr_t>(plan.data_ptr()) % width) == 0, name, ": expected a ", num(width),
                    "-byte aligned plan");
  check_same_device(plan, name, state);
}

void check_plan_rows(const at::Tensor& plan, const at::Tensor& kv_score) {
  TORCH_CHECK_VALUE(plan.size(0) == kv_score.size(0), "plan: expected ", num(kv_score.size(0)),
                    " rows (one per kv_score row), got ", num(plan.size(0)));
}

int64_t check_args(const at::Tensor& state, const at::Tensor& kv_score, const at::Tensor& ape, int64_t ratio,
                   bool online) {
  TORCH_CHECK_VALUE(state.is_cuda(), "state: expected a CUDA tensor, got ", state.device());
  check_ratio(ratio);
  const int64_t d = check_ape(ape, window_of(ratio));
  const int64_t width = (ratio == 4 ? 4 : 2) * d;
  if (online) {
    TORCH_CHECK_TYPE(state.scalar_type() == at::kFloat, "state: expected float32, got ", state.scalar_type());
    check_matrix(state, "state", 3 * d);
  } else {
    const auto s = state.scalar_type();
    TORCH_CHECK_TYPE(s == at::kFloat || s == at::kBFloat16, "state: expected float32 or bfloat16, got ", s);
    check_matrix(state, "state", width);
    TORCH_CHECK_VALUE(state.size(0) % ratio == 0, "state: expected a multiple of ", num(ratio), " rows, got ",
                      num(state.size(0)));
  }
  TORCH_CHECK_VALUE(state.is_contiguous(), "state: expected a contiguous tensor");
  const auto k = kv_score.scalar_type();
  TORCH_CHECK_TYPE(k == at::kFloat || k == at::kBFloat16, "kv_score: expected float32 or bfloat16, got ", k);
  check_matrix(kv_score, "kv_score", width);
  check_same_device(kv_score, "kv_score", state);
  check_same_device(ape, "ape", state);
  return d;
}

bool aligned(const void* p, int64_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// 16-byte (fp32) or 8-byte (bf16) vectors of 4 elements are legal for every row access.
bool vector_ok(const at::Tensor& state, const at::Tensor& kv_score) {
  const int64_t s = 4 * state.element_size(), k = 4 * kv_score.element_size();
  return aligned(state.data_ptr(), s) && aligned(kv_score.data_ptr(), k) &&
         (kv_score.stride(0) * kv_score.element_size()) % k == 0;
}

CompressArgs make_args(const at::Tensor& state, const at::Tensor& kv_score, const at::Tensor& ape,
                       const at::Tensor& plan, float* out, int64_t d) {
  CompressArgs a{};
  a.state = state.data_ptr();
  a.input = kv_score.data_ptr();
  a.out = out;
  a.ape = ape.data_ptr<float>();
  a.plan = plan.data_ptr();
  a.in_stride = kv_score.stride(0);
  a.state_rows = state.size(0);
  a.input_rows = kv_score.size(0);
  a.num_rows = static_cast<int>(plan.size(0));
  a.d = static_cast<int>(d);
  return a;
}

int device_attribute(cudaDeviceAttr attr, const at::Tensor& on) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, on.device().index()));
  return value;
}

// Launches with programmatic dependent launch allowed where the GPU runs the sm_90a code (sync_launch): every kernel
// in dsv4_compress_kernels.cuh waits for the previous kernel's memory (pdl_wait) before its first global access, so
// only the launch latency overlaps.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int64_t blocks, int threads, const at::Tensor& state, Args... args) {
  if (blocks == 0) return;
  const c10::cuda::CUDAGuard guard(state.device());
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = c10::cuda::getCurrentCUDAStream(state.device().index());
  config.attrs = &pdl;
  config.numAttrs = sync_launch(device_attribute(cudaDevAttrComputeCapabilityMajor, state),
                                device_attribute(cudaDevAttrComputeCapabilityMinor, state)) ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

// One block per (plan row, channel split) for the c128 kernel.
template <typename... Params>
void launch_c128(void (*kernel)(Params...), const at::Tensor& state, const CompressArgs& a) {
  const int splits = c128_splits(a.num_rows, a.d, device_attribute(cudaDevAttrMultiProcessorCount, state));
  launch(kernel, static_cast<int64_t>(a.num_rows) * splits, kC128Threads, state, a, splits);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Offline state dtype x input dtype x vectorization.
template <typename F>
void dispatch_offline(const at::Tensor& state, const at::Tensor& kv_score, F&& f) {
  const bool vec = vector_ok(state, kv_score);
  dispatch_dtype(state.scalar_type(), "state", [&](auto ts) {
    dispatch_dtype(kv_score.scalar_type(), "kv_score", [&](auto ti) {
      using TS = typename decltype(ts)::type;
      using TI = typename decltype(ti)::type;
      if (vec) {
        f(Tag<TS>{}, Tag<TI>{}, std::true_type{});
      } else {
        f(Tag<TS>{}, Tag<TI>{}, std::false_type{});
      }
    });
  });
}

// The compress launch of a decode (kDecode) or prefill step: c4 one warp per (plan row, 128 channels), c128 one
// block per (plan row, channel split).
template <bool kDecode>
void launch_compress(const at::Tensor& state, const at::Tensor& kv_score, const CompressArgs& a, int64_t ratio) {
  dispatch_offline(state, kv_score, [&](auto ts, auto ti, auto vec) {
    using TS = typename decltype(ts)::type;
    using TI = typename decltype(ti)::type;
    constexpr bool kVec = decltype(vec)::value;
    if (ratio == 4) {
      const int64_t warps = static_cast<int64_t>(a.num_rows) * (a.d / kSplit);
      launch(c4_kernel<kDecode, TS, TI, kVec>, ceil_div(warps * 32, kC4Threads), kC4Threads, state, a);
    } else {
      launch_c128(c128_kernel<kDecode ? C128Mode::kDecode : C128Mode::kPrefill, TS, TI, kVec>, state, a);
    }
  });
}

void launch_writes(const at::Tensor& state, const at::Tensor& kv_score, const at::Tensor& ape,
                   const at::Tensor& plan_w, int64_t d, int64_t width) {
  const CompressArgs w = make_args(state, kv_score, ape, plan_w, nullptr, d);
  dispatch_offline(state, kv_score, [&](auto ts, auto ti, auto vec) {
    using TS = typename decltype(ts)::type;
    using TI = typename decltype(ti)::type;
    const int64_t blocks = std::min<int64_t>(ceil_div(plan_w.size(0) * 32, kCopyThreads), kMaxWriteBlocks);
    launch(write_rows_kernel<TS, TI, decltype(vec)::value>, blocks, kCopyThreads, state, w, width);
  });
}

at::Tensor compress_decode(at::Tensor& state, const at::Tensor& kv_score, const at::Tensor& ape,
                           const at::Tensor& plan, int64_t ratio) {
  const int64_t d = check_args(state, kv_score, ape, ratio, false);
  check_plan(plan, "plan", 16, state);
  check_plan_rows(plan, kv_score);
  check_no_shared_memory("state", state, {{"kv_score", &kv_score}, {"ape", &ape}, {"plan", &plan}});
  if (must_check_values()) check_decode_plan_values(plan, state.size(0), ratio);
  at::Tensor out = at::empty({plan.size(0), d}, kv_score.options().dtype(at::kFloat));
  launch_compress<true>(state, kv_score, make_args(state, kv_score, ape, plan, out.data_ptr<float>(), d), ratio);
  return out;
}

at::Tensor compress_prefill(at::Tensor& state, const at::Tensor& kv_score, const at::Tensor& ape,
                            const at::Tensor& plan_c, const at::Tensor& plan_w, int64_t ratio) {
  const int64_t d = check_args(state, kv_score, ape, ratio, false);
  check_plan(plan_c, "plan_c", 16, state);
  check_plan(plan_w, "plan_w", 8, state);
  check_no_shared_memory("state", state,
                         {{"kv_score", &kv_score}, {"ape", &ape}, {"plan_c", &plan_c}, {"plan_w", &plan_w}});
  if (must_check_values()) check_prefill_plan_values(plan_c, plan_w, state.size(0), kv_score.size(0), ratio);
  at::Tensor out = at::empty({plan_c.size(0), d}, kv_score.options().dtype(at::kFloat));
  launch_compress<false>(state, kv_score, make_args(state, kv_score, ape, plan_c, out.data_ptr<float>(), d), ratio);
  launch_writes(state, kv_score, ape, plan_w, d, (ratio == 4 ? 4 : 2) * d);
  return out;
}

at::Tensor online_compress_decode(at::Tensor& state, const at::Tensor& kv_score, const at::Tensor& ape,
                                  const at::Tensor& plan) {
  const int64_t d = check_args(state, kv_score, ape, 128, true);
  check_plan(plan, "plan", 16, state);
  check_plan_rows(plan, kv_score);
  check_no_shared_memory("state", state, {{"kv_score", &kv_score}, {"ape", &ape}, {"plan", &plan}});
  if (must_check_values()) check_online_decode_plan_values(plan, state.size(0));
  at::Tensor out = at::empty({plan.size(0), d}, kv_score.options().dtype(at::kFloat));
  const CompressArgs a = make_args(state, kv_score, ape, plan, out.data_ptr<float>(), d);
  const bool vec = vector_ok(state, kv_score);
  dispatch_dtype(kv_score.scalar_type(), "kv_score", [&](auto ti) {
    using TI = typename decltype(ti)::type;
    const int64_t blocks = ceil_div(plan.size(0) * d / 4, kCopyThreads);
    if (vec) {
      launch(online_decode_kernel<TI, true>, blocks, kCopyThreads, state, a);
    } else {
      launch(online_decode_kernel<TI, false>, blocks, kCopyThreads, state, a);
    }
  });
  return out;
}

at::Tensor online_compress_prefill(at::Tensor& state, const at::Tensor& kv_score, const at::Tensor& ape,
                                   const at::Tensor& plan_c, const at::Tensor& plan_w) {
  const int64_t d = check_args(state, kv_score, ape, 128, true);
  check_plan(plan_c, "plan_c", 16, state);
  check_plan(plan_w, "plan_w", 16, state);
  check_no_shared_memory("state", state,
                         {{"kv_score", &kv_score}, {"ape", &ape}, {"plan_c", &plan_c}, {"plan_w", &plan_w}});
  if (must_check_values()) {
    check_online_segment_values("plan_c", plan_c, state.size(0), kv_score.size(0));
    check_online_segment_values("plan_w", plan_w, state.size(0), kv_score.size(0));
  }
  at::Tensor out = at::empty({plan_c.size(0), d}, kv_score.options().dtype(at::kFloat));
  const CompressArgs c = make_args(state, kv_score, ape, plan_c, out.data_ptr<float>(), d);
  const CompressArgs w = make_args(state, kv_score, ape, plan_w, nullptr, d);
  const bool vec = vector_ok(state, kv_score);
  dispatch_dtype(kv_score.scalar_type(), "kv_score", [&](auto ti) {
    using TI = typename decltype(ti)::type;
    if (vec) {
      launch_c128(c128_kernel<C128Mode::kOnlineCompress, float, TI, true>, state, c);
      launch_c128(c128_kernel<C128Mode::kOnlineWrite, float, TI, true>, state, w);
    } else {
      launch_c128(c128_kernel<C128Mode::kOnlineCompress, float, TI, false>, state, c);
      launch_c128(c128_kernel<C128Mode::kOnlineWrite, float, TI, false>, state, w);
    }
  });
  return out;
}

}  // namespace
}  // namespace dsv4
}  // namespace dspark

TORCH_LIBRARY_IMPL(dspark, CUDA, m) {
  m.impl("dsv4_compress_decode", &dspark::dsv4::compress_decode);
  m.impl("dsv4_compress_prefill", &dspark::dsv4::compress_prefill);
  m.impl("dsv4_online_compress_decode", &dspark::dsv4::online_compress_decode);
  m.impl("dsv4_online_compress_prefill", &dspark::dsv4::online_compress_prefill);
}
