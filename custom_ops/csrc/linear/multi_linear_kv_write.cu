// Torch binding of dspark::multi_linear_kv_write on CUDA: the structural checks of
// custom_ops/linear/multi_linear_kv_write.py (same error class, same argument names), the value checks of checking
// mode, the CUDA layout rules, and the choice between the fused kernel (projections, norm, RoPE and cache writes in one
// launch per 32 layers) and the GEMM path (dspark::multi_linear into a [T, 2 N kv] buffer, then the heads kernel).
// Kernels: multi_linear_kv_write_fused.cuh (the fused kernel), multi_linear_kv_write_kernels.cuh (its epilogue and
// the heads kernel) and multi_linear_kv_write_common.cuh (the heads kernel compiled for the drafts' forms).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "common/error_format.h"
#include "common/memory_overlap.h"
#include "common/range_checks.h"
#include "linear/multi_linear_host.h"
#include "linear/multi_linear_kv_write_common.cuh"
#include "linear/multi_linear_kv_write_fused.cuh"
#include "linear/multi_linear_kv_write_kernels.cuh"

namespace dspark {
namespace mlinear {
namespace {

constexpr const char* kOp = "multi_linear_kv_write: ";
// Up to this many tokens the fused kernel runs; beyond, the GEMM path (dspark::multi_linear picks its kernel or
// cuBLAS) and the heads kernel. H200, Qwen3-8B draft dims, CUDA-graph replay of the op alone, with the fused kernel
// before this one (a shared-memory ring, the same per-token cost): fused 36.4 / 37.9 us at 8 / 16 tokens against
// 41.5 / 39.6 for the GEMM path; at 32 tokens the best fused tiling took 48.5 against 40.1, because one head per
// CTA leaves the MMAs of 32 tokens to 80 SMs where the GEMM path's own tiles fill the GPU.
constexpr int kFusedMaxTokens = 16;

static_assert(kFusedMaxTokens <= 16, "the fused kernel is compiled for 1 and 2 token tiles");

using TensorList = at::TensorList;
using OptionalList = c10::List<std::optional<at::Tensor>>;

// ------------------------------------------------------------------------------------------------ checks

template <typename Name>
void check_device(const Name& name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK_VALUE(t.device() == x.device(), kOp, name, " is on ", t.device().str(), ", x is on ", x.device().str());
}

bool is_index(const at::Tensor& t) { return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong; }

void check_projection(const at::Tensor& x, const char* kind, TensorList weights, at::IntArrayRef starts,
                      const OptionalList& biases, int64_t kv) {
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const Indexed name{kind, "_weights", i};
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == x.size(1), kOp, name, " must be [R, ", num(x.size(1)),
                      "] (x is ", shape_of(x.sizes()), "), got ", shape_of(w.sizes()));
    TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type(), kOp, name, " dtype ", dtype_of(w.scalar_type()),
                     " differs from x dtype ", dtype_of(x.scalar_type()));
    check_device(name, w, x);
    TORCH_CHECK_VALUE(starts[i] >= 0 && starts[i] + kv <= w.size(0), kOp, kind, "_row_starts[", num(i),
                      "] = ", num(starts[i]), ": rows [", num(starts[i]), ", ", num(starts[i] + kv), ") of ", name,
                      " are out of range (it has ", num(w.size(0)), " rows, a layer uses num_kv_heads * head_dim = ",
                      num(kv), ")");
    const std::optional<at::Tensor> b = biases.get(i);
    if (!b.has_value()) continue;
    const Indexed bias{kind, "_biases", i};
    TORCH_CHECK_VALUE(b->dim() == 1 && b->size(0) == w.size(0), kOp, bias, " must be [", num(w.size(0)),
                      "] (one entry per row of ", name, "), got ", shape_of(b->sizes()));
    TORCH_CHECK_TYPE(b->scalar_type() == x.scalar_type(), kOp, bias, " dtype ", dtype_of(b->scalar_type()),
                     " differs from x dtype ", dtype_of(x.scalar_type()));
    check_device(bias, *b, x);
  }
}

void check_norm(const at::Tensor& x, const OptionalList& weights, at::ArrayRef<double> eps, int64_t head_dim) {
  for (size_t i = 0; i < eps.size(); ++i) {
    TORCH_CHECK_VALUE(std::isfinite(eps[i]) && eps[i] >= 0.0, kOp, "k_norm_eps[", num(i),
                      "] must be finite and >= 0, got ", num(eps[i]));
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::optional<at::Tensor> w = weights.get(i);
    if (!w.has_value()) continue;
    const Indexed name{"k_norm_weights", "", i};
    TORCH_CHECK_VALUE(!eps.empty(), kOp, name,
                      " is given but k_norm_eps is empty (no norm): pass None, or one eps per layer");
    TORCH_CHECK_VALUE(w->dim() == 1 && w->size(0) == head_dim, kOp, name, " must be [", num(head_dim),
                      "] (head_dim), got ", shape_of(w->sizes()));
    TORCH_CHECK_TYPE(w->scalar_type() == x.scalar_type() || w->scalar_type() == at::kFloat, kOp, name, " dtype ",
                     dtype_of(w->scalar_type()), " must be x's (", dtype_of(x.scalar_type()), ") or torch.float32");
    check_device(name, *w, x);
  }
}

// The RoPE form of a table (as table_form in Python): by its dims, [P, R] halves, [P, R/2, 2] pairs, [R/2]
// inverse frequencies; -1 for none of them.
int table_form_of(const at::Tensor& t) {
  if (t.dim() == 2) return kHalves;
  if (t.dim() == 3 && t.size(2) == 2) return kPairs;
  if (t.dim() == 1) return kFrequencies;
  return -1;
}

const char* form_name(int form) {
  return form == kHalves ? "[P, R] table (halves)" : form == kPairs ? "[P, R/2, 2] table (pairs)"
                                                                    : "[R/2] table (frequencies)";
}

int64_t rotary_dim_of(const at::Tensor& t) {
  return t.dim() == 2 ? t.size(1) : 2 * t.size(t.dim() == 3 ? 1 : 0);
}

void check_rope(const at::Tensor& x, TensorList tables, const at::Tensor& positions, int64_t head_dim) {
  const int64_t tokens = x.size(0);
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == tokens, kOp, "positions must be [", num(tokens),
                    "] (one per token of x), got ", shape_of(positions.sizes()));
  TORCH_CHECK_TYPE(is_index(positions), kOp, "positions must be int32 or int64, got ",
                   dtype_of(positions.scalar_type()));
  check_device("positions", positions, x);
  for (size_t i = 0; i < tables.size(); ++i) {
    const at::Tensor& c = tables[i];
    const Indexed name{"cos_sin_caches", "", i};
    const int form = table_form_of(c);
    TORCH_CHECK_VALUE(form >= 0, kOp, name,
                      " must be [P, R] (cos | sin halves), [P, R/2, 2] (cos, sin pairs) or [R/2] (inverse "
                      "frequencies), got ",
                      shape_of(c.sizes()));
    const int first = table_form_of(tables[0]);
    TORCH_CHECK_VALUE(form == first, kOp, name, " is a ", form_name(form), ", layer 0's a ", form_name(first),
                      ": every layer's table must have the same form");
    TORCH_CHECK_TYPE(c.scalar_type() == at::kFloat, kOp, name, " must be torch.float32, got ",
                     dtype_of(c.scalar_type()));
    check_device(name, c, x);
    const int64_t rot = rotary_dim_of(c), rot0 = rotary_dim_of(tables[0]);
    TORCH_CHECK_VALUE(rot % 2 == 0 && rot > 0 && rot <= head_dim && rot == rot0, kOp, name, " ",
                      shape_of(c.sizes()), " rotates ", num(rot),
                      " elements: the rotary dim must be even, in (0, head_dim = ", num(head_dim),
                      "] and the same for every layer (", num(rot0), " for layer 0)");
  }
}

void check_caches(const at::Tensor& x, TensorList k_caches, TensorList v_caches, int64_t heads, int64_t head_dim) {
  const c10::IntArrayRef shape = k_caches[0].sizes();
  for (const char* kind : {"k", "v"}) {
    TensorList caches = kind[0] == 'k' ? k_caches : v_caches;
    for (size_t i = 0; i < caches.size(); ++i) {
      const at::Tensor& c = caches[i];
      const Indexed name{kind, "_caches", i};
      TORCH_CHECK_VALUE(c.dim() == 3 && c.size(1) == heads && c.size(2) == head_dim && c.sizes() == shape, kOp, name,
                        " must be [S, ", num(heads), ", ", num(head_dim), "] with the slots of k_caches[0] ",
                        shape_of(shape), ", got ", shape_of(c.sizes()));
      TORCH_CHECK_TYPE(c.scalar_type() == x.scalar_type(), kOp, name, " dtype ", dtype_of(c.scalar_type()),
                       " differs from x dtype ", dtype_of(x.scalar_type()));
      check_device(name, c, x);
      TORCH_CHECK_VALUE(c.numel() == 0 || !overlaps_itself(c), kOp, name,
                        " must not overlap itself (its rows are written independently)");
    }
  }
}

void check_locations(const at::Tensor& x, const at::Tensor& loc, const std::optional<at::Tensor>& commit) {
  const int64_t tokens = x.size(0);
  TORCH_CHECK_TYPE(is_index(loc), kOp, "cache_loc must be int32 or int64, got ", dtype_of(loc.scalar_type()));
  check_device("cache_loc", loc, x);
  if (loc.dim() == 1) {
    TORCH_CHECK_VALUE(loc.size(0) == tokens, kOp, "cache_loc must be [", num(tokens),
                      "] (one slot per token of x), got ", shape_of(loc.sizes()));
    TORCH_CHECK_VALUE(!commit.has_value(), kOp, "commit_lens needs a 2-D cache_loc [B, W]; got a 1-D cache_loc");
    return;
  }
  TORCH_CHECK_VALUE(loc.dim() == 2 && loc.numel() == tokens, kOp, "cache_loc must be [", num(tokens),
                    "] or [B, W] with B * W = ", num(tokens), ", got ", shape_of(loc.sizes()));
  TORCH_CHECK_VALUE(commit.has_value(), kOp, "commit_lens [B] must be given with a 2-D cache_loc [B, W]");
  TORCH_CHECK_VALUE(commit->dim() == 1 && commit->size(0) == loc.size(0), kOp, "commit_lens must be [",
                    num(loc.size(0)), "] (one per row of cache_loc), got ", shape_of(commit->sizes()));
  TORCH_CHECK_TYPE(is_index(*commit), kOp, "commit_lens must be int32 or int64, got ",
                   dtype_of(commit->scalar_type()));
  check_device("commit_lens", *commit, x);
}

// A tensor argument and its name (formatted only for an error message).
struct Named {
  Indexed name;
  at::Tensor tensor;
};

// Whether some cache's bytes and another cache's or an input's bytes lie in one address range: a sort and a sweep
// over [first byte, last byte] of every tensor, O(n log n). No overlap: no two of them share memory (tensors of
// different allocations never overlap). An overlap is only a maybe (the K and V halves of an interleaved buffer
// overlap as ranges, not as elements): check_aliasing decides, and names the pair.
bool caches_may_alias(const std::vector<Named>& caches, const std::vector<Named>& inputs) {
  struct Range {
    uintptr_t first, last;
    bool cache;
  };
  std::vector<Range> ranges;
  ranges.reserve(caches.size() + inputs.size());
  const auto add = [&](const at::Tensor& t, bool cache) {
    if (t.numel() == 0) return;
    int64_t span = 0;
    for (int64_t d = 0; d < t.dim(); ++d) span += (t.size(d) - 1) * t.stride(d);
    const uintptr_t first = reinterpret_cast<uintptr_t>(t.data_ptr());
    ranges.push_back({first, first + static_cast<uintptr_t>((span + 1) * t.element_size()) - 1, cache});
  };
  for (const Named& t : caches) add(t.tensor, true);
  for (const Named& t : inputs) add(t.tensor, false);
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.first < b.first; });
  uintptr_t last_any = 0, last_cache = 0;
  bool any = false, any_cache = false;
  for (const Range& r : ranges) {
    if ((any && r.cache && r.first <= last_any) || (any_cache && r.first <= last_cache)) return true;
    last_any = any ? std::max(last_any, r.last) : r.last;
    any = true;
    if (r.cache) {
      last_cache = any_cache ? std::max(last_cache, r.last) : r.last;
      any_cache = true;
    }
  }
  return false;
}

void check_aliasing(const std::vector<Named>& caches, const std::vector<Named>& inputs) {
  for (size_t j = 0; j < caches.size(); ++j) {
    const auto check = [&](const Named& other) {
      TORCH_CHECK_VALUE(!share_memory(caches[j].tensor, other.tensor), kOp, caches[j].name, " shares memory with ",
                        other.name, ": the caches must not overlap each other or any input");
    };
    for (size_t i = 0; i < j; ++i) check(caches[i]);
    for (const Named& in : inputs) check(in);
  }
}

struct Call {
  const at::Tensor& x;
  TensorList k_weights;
  at::IntArrayRef k_starts;
  const OptionalList& k_biases;
  TensorList v_weights;
  at::IntArrayRef v_starts;
  const OptionalList& v_biases;
  const OptionalList& norm_weights;
  at::ArrayRef<double> eps;
  TensorList tables;
  const at::Tensor& positions;
  bool neox;
  TensorList k_caches;
  TensorList v_caches;
  const at::Tensor& loc;
  const std::optional<at::Tensor>& commit;
  int64_t heads;
  int64_t head_dim;
  bool wrap_negative;
};

// The structural checks of _check_args in Python, in the same order.
void check_args(const Call& c) {
  TORCH_CHECK_VALUE(c.x.dim() == 2, kOp, "x must be 2-D [T, K], got ", shape_of(c.x.sizes()));
  const auto dtype = c.x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat, kOp,
                   "x must be bfloat16, float16 or float32, got ", dtype_of(dtype));
  const size_t n = c.k_weights.size();
  TORCH_CHECK_VALUE(n > 0, kOp, "k_weights must hold at least one tensor (one per layer)");
  TORCH_CHECK_VALUE(c.heads >= 1, kOp, "num_kv_heads must be >= 1, got ", num(c.heads));
  TORCH_CHECK_VALUE(c.head_dim >= 1, kOp, "head_dim must be >= 1, got ", num(c.head_dim));
  const std::pair<const char*, size_t> lengths[] = {
      {"k_row_starts", c.k_starts.size()}, {"k_biases", c.k_biases.size()},   {"v_weights", c.v_weights.size()},
      {"v_row_starts", c.v_starts.size()}, {"v_biases", c.v_biases.size()},   {"k_norm_weights", c.norm_weights.size()},
      {"k_caches", c.k_caches.size()},     {"v_caches", c.v_caches.size()},
  };
  for (const auto& [name, length] : lengths) {
    TORCH_CHECK_VALUE(length == n, kOp, name, " must hold one entry per layer (", num(n),
                      ", the length of k_weights), got ", num(length));
  }
  TORCH_CHECK_VALUE(c.eps.empty() || c.eps.size() == n, kOp, "k_norm_eps must be empty or hold one entry per layer (",
                    num(n), "), got ", num(c.eps.size()));
  TORCH_CHECK_VALUE(c.tables.empty() || c.tables.size() == n, kOp,
                    "cos_sin_caches must be empty or hold one entry per layer (", num(n), "), got ",
                    num(c.tables.size()));
  const int64_t kv = c.heads * c.head_dim;
  check_projection(c.x, "k", c.k_weights, c.k_starts, c.k_biases, kv);
  check_projection(c.x, "v", c.v_weights, c.v_starts, c.v_biases, kv);
  check_norm(c.x, c.norm_weights, c.eps, c.head_dim);
  check_rope(c.x, c.tables, c.positions, c.head_dim);
  check_caches(c.x, c.k_caches, c.v_caches, c.heads, c.head_dim);
  check_locations(c.x, c.loc, c.commit);
  std::vector<Named> caches, inputs{{{"x"}, c.x}};
  for (size_t i = 0; i < n; ++i) caches.push_back({{"k_caches", "", i}, c.k_caches[i]});
  for (size_t i = 0; i < n; ++i) caches.push_back({{"v_caches", "", i}, c.v_caches[i]});
  for (size_t i = 0; i < n; ++i) inputs.push_back({{"k_weights", "", i}, c.k_weights[i]});
  for (size_t i = 0; i < n; ++i) inputs.push_back({{"v_weights", "", i}, c.v_weights[i]});
  const auto add_optional = [&](const Indexed& name, const std::optional<at::Tensor>& t) {
    if (t.has_value()) inputs.push_back({name, *t});
  };
  for (size_t i = 0; i < n; ++i) add_optional({"k_biases", "", i}, c.k_biases.get(i));
  for (size_t i = 0; i < n; ++i) add_optional({"v_biases", "", i}, c.v_biases.get(i));
  for (size_t i = 0; i < n; ++i) add_optional({"k_norm_weights", "", i}, c.norm_weights.get(i));
  for (size_t i = 0; i < c.tables.size(); ++i) inputs.push_back({{"cos_sin_caches", "", i}, c.tables[i]});
  inputs.push_back({{"positions"}, c.positions});
  inputs.push_back({{"cache_loc"}, c.loc});
  add_optional({"commit_lens"}, c.commit);
  if (caches_may_alias(caches, inputs)) check_aliasing(caches, inputs);
}

// What the CUDA kernels need beyond the structural rules; ValueError / TypeError naming the argument.
void check_cuda_layout(const Call& c) {
  const auto dtype = c.x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf, kOp, "x must be bfloat16 or float16 on CUDA, got ",
                   dtype_of(dtype));
  TORCH_CHECK_VALUE(c.x.size(1) % 8 == 0 && c.x.size(1) > 0, kOp, "x must have K > 0 and a multiple of 8 on CUDA, got K = ",
                    num(c.x.size(1)));
  TORCH_CHECK_VALUE(c.head_dim % 8 == 0 && c.head_dim <= 256, kOp,
                    "head_dim must be a multiple of 8 and at most 256 on CUDA, got ", num(c.head_dim));
  for (const char* kind : {"k", "v"}) {
    TensorList caches = kind[0] == 'k' ? c.k_caches : c.v_caches;
    for (size_t i = 0; i < caches.size(); ++i) {
      const at::Tensor& t = caches[i];
      const int64_t esize = static_cast<int64_t>(t.element_size());
      TORCH_CHECK_VALUE(t.stride(2) == 1 && aligned16(t.data_ptr()) && (t.stride(0) * esize) % 16 == 0 &&
                            (t.stride(1) * esize) % 16 == 0,
                        kOp, kind, "_caches[", num(i),
                        "] must have a unit inner stride and 16-byte aligned rows on CUDA, got strides ",
                        shape_of(t.strides()));
    }
  }
  // Checked here, before any launch: a later layer group's bad entry must not raise after an earlier group wrote.
  for (size_t i = 0; i < c.norm_weights.size(); ++i) {
    const std::optional<at::Tensor> w = c.norm_weights.get(i);
    TORCH_CHECK_VALUE(!w.has_value() || w->stride(0) == 1 || w->size(0) <= 1, kOp, "k_norm_weights[", num(i),
                      "] must be contiguous on CUDA");
  }
  for (size_t i = 0; i < c.tables.size(); ++i) {
    const at::Tensor& t = c.tables[i];
    const bool contiguous = t.dim() == 3 ? (t.stride(2) == 1 || t.size(2) <= 1) && (t.stride(1) == 2 || t.size(1) <= 1)
                                         : t.stride(-1) == 1 || t.size(-1) <= 1;
    TORCH_CHECK_VALUE(contiguous, kOp, "cos_sin_caches[", num(i),
                      "] must have a unit inner stride on CUDA (a [P, R/2, 2] table: each row's R factors "
                      "consecutive), got strides ",
                      shape_of(t.strides()));
  }
}

void check_values(const Call& c) {
  if (!must_check_values()) return;
  const int64_t slots = c.k_caches[0].size(0);
  check_index_range(c.loc, slots, "cache_loc",
                    c.wrap_negative ? "cache slots are [-" + num(slots) + ", " + num(slots) +
                                          ") (a negative entry l addresses slot " + num(slots) + " + l)"
                                    : "cache slots are [0, " + num(slots) + ") (negative entries skip the token)",
                    true, c.wrap_negative);
  if (c.tables.empty() || table_form_of(c.tables[0]) == kFrequencies) return;
  int64_t rows = c.tables[0].size(0);
  for (const at::Tensor& t : c.tables) rows = std::min(rows, t.size(0));
  check_index_range(c.positions, rows, "positions",
                    "positions must be in [" + num(c.wrap_negative ? -rows : 0) + ", " + num(rows) +
                        "), a row of every cos_sin_caches table",
                    false, c.wrap_negative);
}

// ------------------------------------------------------------------------------------------------ launch tables

// The epilogue table of layers [first, first + count).
KvWrite kv_table(const Call& c, size_t first, size_t count) {
  KvWrite kv{};
  for (size_t j = 0; j < count; ++j) {
    const size_t i = first + j;
    const at::Tensor* caches[2] = {&c.k_caches[i], &c.v_caches[i]};
    for (int kind = 0; kind < 2; ++kind) {
      kv.cache[kind][j] = caches[kind]->data_ptr();
      kv.slot_stride[kind][j] = caches[kind]->stride(0);
      kv.head_stride[kind][j] = caches[kind]->stride(1);
    }
    const std::optional<at::Tensor> w = c.norm_weights.get(i);
    kv.norm_weight[j] = w.has_value() ? w->data_ptr() : nullptr;
    kv.norm_fp32[j] = w.has_value() && w->scalar_type() == at::kFloat;
    kv.eps[j] = c.eps.empty() ? 0.f : static_cast<float>(c.eps[i]);
    if (!c.tables.empty()) {
      const at::Tensor& t = c.tables[i];
      kv.cos_sin[j] = t.data_ptr<float>();
      kv.table_stride[j] = t.stride(0);
    }
  }
  kv.positions = c.positions.data_ptr();
  kv.positions_stride = c.positions.stride(0);
  kv.positions_int64 = c.positions.scalar_type() == at::kLong;
  kv.loc = c.loc.data_ptr();
  kv.loc_int64 = c.loc.scalar_type() == at::kLong;
  if (c.loc.dim() == 1) {
    kv.width = static_cast<int>(std::max<int64_t>(c.x.size(0), 1));
    kv.loc_stride0 = 0;
    kv.loc_stride1 = c.loc.stride(0);
  } else {
    kv.width = static_cast<int>(c.loc.size(1));
    kv.loc_stride0 = c.loc.stride(0);
    kv.loc_stride1 = c.loc.stride(1);
  }
  if (c.commit.has_value()) {
    kv.commit_lens = c.commit->data_ptr();
    kv.commit_stride = c.commit->stride(0);
    kv.commit_int64 = c.commit->scalar_type() == at::kLong;
  }
  kv.slots = c.k_caches[0].size(0);
  kv.table_form = c.tables.empty() ? kHalves : table_form_of(c.tables[0]);
  kv.position_limit = 0;
  for (size_t i = 0; i < c.tables.size() && kv.table_form != kFrequencies; ++i) {
    kv.position_limit = i == 0 ? c.tables[i].size(0) : std::min(kv.position_limit, c.tables[i].size(0));
  }
  kv.heads = static_cast<int>(c.heads);
  kv.head_dim = static_cast<int>(c.head_dim);
  kv.rotary_dim = c.tables.empty() ? 0 : static_cast<int>(rotary_dim_of(c.tables[0]));
  kv.neox = c.neox;
  kv.has_norm = !c.eps.empty();
  kv.has_rope = !c.tables.empty();
  kv.wrap_negative = c.wrap_negative;
  return kv;
}

// The GEMM's weights, row starts and biases for layers [first, first + count): K_i then V_i.
struct Projection {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> starts, counts;
  OptionalList biases;
};

Projection projection(const Call& c, size_t first, size_t count) {
  Projection p;
  const int64_t kv = c.heads * c.head_dim;
  for (size_t i = first; i < first + count; ++i) {
    p.weights.push_back(c.k_weights[i]);
    p.starts.push_back(c.k_starts[i]);
    p.biases.push_back(c.k_biases.get(i));
    p.weights.push_back(c.v_weights[i]);
    p.starts.push_back(c.v_starts[i]);
    p.biases.push_back(c.v_biases.get(i));
    p.counts.push_back(kv);
    p.counts.push_back(kv);
  }
  return p;
}

// ------------------------------------------------------------------------------------------------ paths

// The fused kernel: one CTA per head (rows is a whole number of heads).
template <typename T, int V, int NT>
void launch_fused_instance(const KvWriteArgs& args, int64_t rows, const at::Device& device) {
  constexpr int smem = fused_smem_bytes<V, NT>();
  static_assert(smem <= 48 * 1024, "the fused kernel fits the default shared memory");
  launch(&kv_write_fused_kernel<T, V, NT>, args, rows / (32 * V), fused_threads<V, kFusedKWarps>(), smem, 1, device);
}

template <typename T, int V>
void launch_fused(const KvWriteArgs& args, int64_t rows, const at::Device& device) {
  if (token_tiles(args.gemm.tokens) == 1) {
    launch_fused_instance<T, V, 1>(args, rows, device);
  } else {
    launch_fused_instance<T, V, 2>(args, rows, device);
  }
}

// One launch per 32 layers: the GEMM of their K and V rows with the write epilogue.
template <typename T>
void run_fused(const Call& c, const at::Tensor& x) {
  const size_t n = c.k_weights.size();
  for (size_t first = 0; first < n; first += kMaxLayers) {
    const size_t count = std::min<size_t>(kMaxLayers, n - first);
    const Projection proj = projection(c, first, count);
    const std::vector<Run> runs = collect_runs(x, proj.weights, proj.starts, proj.counts, proj.biases);
    KvWriteArgs args{};
    Params& p = args.gemm;
    p.x = x.data_ptr();
    p.x_stride = x.stride(0);
    p.tokens = static_cast<int>(x.size(0));
    p.k = static_cast<int>(x.size(1));
    p.num_segments = static_cast<int>(runs.size());
    int64_t rows = 0;
    for (size_t j = 0; j < runs.size(); ++j) {
      rows += runs[j].rows;
      p.segment_end[j] = rows;
      p.weight[j] = runs[j].weight;
      p.weight_stride[j] = runs[j].weight_stride;
      p.bias[j] = runs[j].bias;
      p.bias_stride[j] = runs[j].bias_stride;
    }
    args.kv = kv_table(c, first, count);
    if (c.head_dim == 64) {
      launch_fused<T, 2>(args, rows, x.device());
    } else {
      launch_fused<T, 4>(args, rows, x.device());
    }
  }
}

// CTAs of `kernel` (a heads kernel with `smem` bytes of dynamic shared memory) resident per SM of `device`, in
// `cached` (one entry per device). Queried once per kernel and device, which also opts the kernel in to its shared
// memory there: the launch shape is fixed, so eager calls need no occupancy query.
template <typename Kernel>
int heads_ctas_per_sm(Kernel kernel, int smem, std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS>& cached,
                      const at::Device& device) {
  std::atomic<int>& known = cached.at(static_cast<size_t>(device.index()));
  int per_sm = known.load(std::memory_order_acquire);
  if (per_sm == 0) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * kHeadWarps, smem));
    per_sm = std::max(per_sm, 1);
    known.store(per_sm, std::memory_order_release);
  }
  return per_sm;
}

// The heads kernel's warp-per-unit form for the call: the kernel compiled for its form (common_form) or the general
// one, with its dynamic shared memory and the per-device cache of its CTAs per SM.
template <typename T, int kLanes>
struct UnitKernel {
  using Kernel = void (*)(KvWrite, const T*, int64_t, int, int, int);
  Kernel kernel;
  int smem;
  std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS>* per_sm;
  bool compiled_form;
};

template <typename T, int kLanes, bool kNorm>
UnitKernel<T, kLanes> compiled_kernel_for(int form) {
  static std::array<std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS>, 4> per_sm{};
  switch (form) {
    case kNeoxHalves:
      return {&kv_write_heads_common_kernel<T, kLanes, kNeoxHalves, kNorm>, 0, &per_sm[0], true};
    case kNeoxFrequencies:
      return {&kv_write_heads_common_kernel<T, kLanes, kNeoxFrequencies, kNorm>, 0, &per_sm[1], true};
    case kGptjPairs:
      return {&kv_write_heads_common_kernel<T, kLanes, kGptjPairs, kNorm>, 0, &per_sm[2], true};
    default:
      return {&kv_write_heads_common_kernel<T, kLanes, kGptjHalves, kNorm>, 0, &per_sm[3], true};
  }
}

template <typename T, int kLanes>
UnitKernel<T, kLanes> unit_kernel_for(const KvWrite& kv, int layers) {
  static std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS> general_per_sm{};
  const int form = common_form<T, kLanes>(kv, layers);
  if (form < 0) return {&kv_write_heads_unit_kernel<T, kLanes>, unit_smem_bytes(), &general_per_sm, false};
  return kv.has_norm ? compiled_kernel_for<T, kLanes, true>(form) : compiled_kernel_for<T, kLanes, false>(form);
}

// The heads kernel. Where the call has one of the forms drafts are written in (common_form: RoPE over the whole
// head from a neox halves table, neox inverse frequencies, a GPT-J pairs or halves table; norm weights of x's
// dtype, or no norm), the warp-per-unit kernel compiled for that form (kv_write_heads_common_kernel) at every T: with
// unit_heads_per_unit's units while they fit the GPU at once, else in waves of units of a batch of heads. Otherwise
// the general warp-per-unit kernel (kv_write_heads_unit_kernel) while the units fit at once, else the ring kernel's
// persistent warps (one CTA per resident slot). H100, each kernel after a GEMM-like kernel in a CUDA graph
// (benchmarks/heads_tune.cu), writing the same bytes, Qwen3-8B draft, neox halves:
//   T                            17     64    200    317    512   1024   4096
//   ring kernel                3.39   3.77   6.27   7.41  13.60  18.03  67.52 us
//   general unit kernel        2.58   2.92   4.64      (one wave only)
//   compiled-form kernel       2.25   2.49   4.17   6.52  11.57  17.65  68.41
// (head_dim 64: 66.55 against 67.66 at T = 4096). Beyond one wave the general kernel measured 1.06-1.09x of the
// ring at T = 317 / 1024 / 4096. Without a norm (Llama-style, HF's frequencies) at T = 17 / 64 / 512: compiled 2.49 /
// 2.94 / 11.38 us, general unit kernel 3.63 / 3.80 / 13.97, ring 4.51 / 4.55 / 14.80.
template <typename T, int kLanes>
void launch_heads(const KvWrite& kv, const at::Tensor& projections, int tokens, int layers,
                  const at::Device& device) {
  static std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS> ring_per_sm{};
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
  const UnitKernel<T, kLanes> unit = unit_kernel_for<T, kLanes>(kv, layers);
  const bool common = unit.compiled_form;
  const int64_t unit_warps =
      int64_t{heads_ctas_per_sm(unit.kernel, unit.smem, *unit.per_sm, device)} * sms * kHeadWarps;
  const int one_wave = unit_heads_per_unit<kLanes>(tokens, layers, kv.heads, sms, unit_warps);
  const bool per_warp = common || one_wave > 0;
  const int per_unit = one_wave > 0 ? one_wave
                       : common     ? std::min(kv.heads, head_batch<kLanes>())
                                    : heads_per_unit<kLanes>(tokens, layers, kv.heads, sms);
  const int64_t units = heads_units(tokens, layers, kv.heads, per_unit);
  const auto ring_kernel = &kv_write_heads_kernel<T, kLanes>;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  if (per_warp) {
    config.gridDim = dim3(static_cast<unsigned>((units + kHeadWarps - 1) / kHeadWarps));
    config.dynamicSmemBytes = unit.smem;
  } else {
    const int per_sm = heads_ctas_per_sm(ring_kernel, heads_smem_bytes(), ring_per_sm, device);
    config.gridDim = dim3(static_cast<unsigned>(heads_blocks(units, static_cast<int64_t>(per_sm) * sms)));
    config.dynamicSmemBytes = heads_smem_bytes();
  }
  config.blockDim = dim3(32 * kHeadWarps);
  config.stream = c10::cuda::getCurrentCUDAStream(device.index());
  config.attrs = &attr;
  config.numAttrs = syncs_on(device) ? 1 : 0;  // the kernels' dependency wait exists only in their sm_90a code
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, per_warp ? unit.kernel : ring_kernel, kv,
                                    static_cast<const T*>(projections.data_ptr()), projections.stride(0), tokens,
                                    layers, per_unit));
}

// The GEMM through dspark::multi_linear (its own kernel or cuBLAS) into a [T, 2 N kv] buffer, then the heads kernel.
template <typename T>
void run_gemm_then_heads(const Call& c) {
  static const auto multi_linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dspark::multi_linear", "")
          .typed<at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef, const OptionalList&)>();
  const size_t n = c.k_weights.size();
  const int tokens = static_cast<int>(c.x.size(0));
  for (size_t first = 0; first < n; first += kMaxLayers) {
    const size_t count = std::min<size_t>(kMaxLayers, n - first);
    const Projection proj = projection(c, first, count);
    const at::Tensor projections = multi_linear.call(c.x, proj.weights, proj.starts, proj.counts, proj.biases);
    const KvWrite kv = kv_table(c, first, count);
    const int layers = static_cast<int>(count);
    const int lanes = head_lanes(c.head_dim);  // lanes of 8 elements per head (the last ones idle below it)
    if (lanes == 8) {
      launch_heads<T, 8>(kv, projections, tokens, layers, c.x.device());
    } else if (lanes == 16) {
      launch_heads<T, 16>(kv, projections, tokens, layers, c.x.device());
    } else {
      launch_heads<T, 32>(kv, projections, tokens, layers, c.x.device());
    }
  }
}

// Whether the fused kernel takes the call: up to its largest token tile, heads of 64 or 128, weights it can read.
bool fused_fits(const Call& c, const at::Tensor& x) {
  if (x.size(0) > kFusedMaxTokens) return false;
  if (c.head_dim != 64 && c.head_dim != 128) return false;
  if (device_attribute(cudaDevAttrComputeCapabilityMajor, x.device()) < 9) return false;
  const Projection proj = projection(c, 0, c.k_weights.size());
  return kernel_blocker(x, collect_runs(x, proj.weights, proj.starts, proj.counts, proj.biases)) == nullptr;
}

void multi_linear_kv_write(const at::Tensor& x, TensorList k_weights, at::IntArrayRef k_row_starts,
                           const OptionalList& k_biases, TensorList v_weights, at::IntArrayRef v_row_starts,
                           const OptionalList& v_biases, const OptionalList& k_norm_weights,
                           at::ArrayRef<double> k_norm_eps, TensorList cos_sin_caches, const at::Tensor& positions,
                           bool is_neox, TensorList k_caches, TensorList v_caches, const at::Tensor& cache_loc,
                           const std::optional<at::Tensor>& commit_lens, int64_t num_kv_heads, int64_t head_dim,
                           bool wrap_negative) {
  const Call c{x,          k_weights, k_row_starts, k_biases,     v_weights,    v_row_starts,
               v_biases,   k_norm_weights, k_norm_eps, cos_sin_caches, positions, is_neox,
               k_caches,   v_caches,  cache_loc,    commit_lens,  num_kv_heads, head_dim,
               wrap_negative};
  check_args(c);
  check_cuda_layout(c);
  // The kernels index tokens, heads and (token, head) units with 32-bit integers.
  TORCH_CHECK_VALUE(x.size(0) * 2 * std::min<int64_t>(static_cast<int64_t>(k_weights.size()), kMaxLayers) * num_kv_heads <
                        (int64_t{1} << 31),
                    kOp, "x has too many tokens for one call (", num(x.size(0)), "): split it");
  const c10::cuda::CUDAGuard guard(x.device());
  check_values(c);
  if (x.size(0) == 0 || k_caches[0].numel() == 0) return;
  const at::Tensor activation = kernel_activation(x);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (fused_fits(c, activation)) {
    bf16 ? run_fused<__nv_bfloat16>(c, activation) : run_fused<__half>(c, activation);
  } else {
    bf16 ? run_gemm_then_heads<__nv_bfloat16>(c) : run_gemm_then_heads<__half>(c);
  }
}

}  // namespace
}  // namespace mlinear
}  // namespace dspark

TORCH_LIBRARY_IMPL(dspark, CUDA, m) { m.impl("multi_linear_kv_write", &dspark::mlinear::multi_linear_kv_write); }
