// Value checks of DeepSeek-V4 plan bytes for the CUDA bindings in checking mode (custom_ops/checks.py,
// docs/contract.md). ATen ops on the plan's device and a host sync, so call them only when must_check_values().
// Each function mirrors a Python check of the CPU path, condition for condition and in the same order, and raises
// its message word for word: "<plan>[<i>].<field> = <v> is out of range: <what>"
// (custom_ops/dsv4/common.py, check_plan_field; the functions named in each comment). check_no_shared_memory
// (common/memory_overlap.h) is a structural check (no sync): every call.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>

#include "common/error_format.h"
#include "common/memory_overlap.h"
#include "dsv4/dsv4_ratio.h"

namespace dspark {
namespace dsv4 {

// custom_ops/dsv4/common.py, check_ratio: the ratio is c4 or c128 (dsv4_ratio.h), with the CPU path's message.
inline void check_ratio(int64_t ratio) {
  TORCH_CHECK_VALUE(is_ratio(ratio), "ratio: expected ", num(kRatioC4), " or ", num(kRatioC128), ", got ", num(ratio));
}

// Raise for the first row where `bad` is set; `what(i)` says what is valid for row i.
template <typename What>
void check_plan_field(const char* plan, const char* field, const at::Tensor& values, const at::Tensor& bad,
                      What&& what) {
  if (!bad.any().item<bool>()) return;
  const int64_t i = bad.nonzero()[0][0].item<int64_t>();
  TORCH_CHECK_VALUE(false, plan, "[", num(i), "].", field, " = ", num(values[i].item<int64_t>()),
                    " is out of range: ", what(i));
}

// The int64 columns of a plan of 16-byte (DecodePlan / CompressPlan) or 8-byte (WritePlan) rows, as
// custom_ops/dsv4/common.py (read_*_plan) reads them.
struct PlanColumns {
  at::Tensor words;  // [rows, width / 4] int64 (sign-extended int32 words)
  at::Tensor col(int64_t k) const { return words.select(1, k); }
  at::Tensor u32(int64_t k) const { return col(k).bitwise_and(int64_t{0xFFFFFFFF}); }
  at::Tensor low16(int64_t k) const { return col(k).bitwise_and(int64_t{0xFFFF}); }
  at::Tensor high16(int64_t k) const { return at::bitwise_right_shift(col(k), 16).bitwise_and(int64_t{0xFFFF}); }
};

inline PlanColumns plan_columns(const at::Tensor& plan, int64_t width) {
  return PlanColumns{plan.view(at::kInt).reshape({-1, width / 4}).to(at::kLong)};
}

inline at::Tensor outside(const at::Tensor& v, int64_t hi) { return v.lt(0).logical_or(v.ge(hi)); }

inline std::string rows_what(int64_t rows, const char* of) { return "expected < " + num(rows) + " (rows of " + of + ")"; }

inline std::string page_range(int64_t pages) { return "expected >= 0 and < " + num(pages) + " (pages of state)"; }

// dsv4/compress.py, check_decode_plan_values
inline void check_decode_plan_values(const at::Tensor& plan, int64_t state_rows, int64_t ratio) {
  const PlanColumns p = plan_columns(plan, 16);
  const at::Tensor seq = p.u32(0), loc = p.col(1), rp0 = p.col(2), rp1 = p.col(3);
  const at::Tensor valid = loc.ge(0);
  const int64_t pages = state_rows / ratio;
  const std::string big = rows_what(state_rows, "state");
  check_plan_field("plan", "write_loc", loc, valid.logical_and(loc.ge(state_rows)), [&](int64_t) { return big; });
  // dsv4/common.py, decode_emits: a c4 row whose read_page_0 is -1 (unmapped) makes no entry
  at::Tensor emit = valid.logical_and(seq.remainder(ratio).eq(0));
  if (ratio == 4) emit = emit.logical_and(rp0.ge(0));
  const auto page_what = [&](int64_t) { return page_range(pages); };
  check_plan_field("plan", "read_page_1", rp1, emit.logical_and(outside(rp1, pages)), page_what);
  if (ratio == 4) check_plan_field("plan", "read_page_0", rp0, emit.logical_and(outside(rp0, pages)), page_what);
  const at::Tensor last = rp1 * ratio + (ratio - 1);
  check_plan_field("plan", "write_loc", loc, emit.logical_and(loc.ne(last)), [&](int64_t i) {
    return "expected read_page_1 * " + num(ratio) + " + " + num(ratio - 1) + " = " + num(last[i].item<int64_t>()) +
           " (the window's last row)";
  });
}

// dsv4/compress.py, check_prefill_plan_values
inline void check_prefill_plan_values(const at::Tensor& plan_c, const at::Tensor& plan_w, int64_t state_rows,
                                      int64_t input_rows, int64_t ratio) {
  const PlanColumns c = plan_columns(plan_c, 16);
  const at::Tensor seq = c.u32(0), ragged = c.low16(1), buffer_len = c.high16(1), rp0 = c.col(2), rp1 = c.col(3);
  const at::Tensor valid = seq.ne(int64_t{0xFFFFFFFF});
  const int64_t window = window_of(ratio);
  const std::string inputs = rows_what(input_rows, "kv_score");
  const auto inputs_what = [&](int64_t) { return inputs; };
  check_plan_field("plan_c", "ragged_id", ragged, valid.logical_and(ragged.ge(input_rows)), inputs_what);
  check_plan_field("plan_c", "buffer_len", buffer_len, valid.logical_and(buffer_len.gt(window)),
                   [&](int64_t) { return "expected <= " + num(window) + " (window slots)"; });
  const at::Tensor first = (window - 1) - buffer_len;
  check_plan_field("plan_c", "ragged_id", ragged, valid.logical_and(ragged.lt(first)), [&](int64_t i) {
    return "expected >= " + num(first[i].item<int64_t>()) + " (window - 1 - buffer_len: the window's first input row)";
  });
  const at::Tensor buffered = valid.logical_and(buffer_len.gt(0));
  const int64_t pages = state_rows / ratio;
  const auto page_what = [&](int64_t) { return page_range(pages); };
  check_plan_field("plan_c", "read_page_1", rp1, buffered.logical_and(outside(rp1, pages)), page_what);
  if (ratio == 4) check_plan_field("plan_c", "read_page_0", rp0, buffered.logical_and(outside(rp0, pages)), page_what);
  const PlanColumns w = plan_columns(plan_w, 8);
  const at::Tensor w_ragged = w.u32(0), w_loc = w.col(1);
  const at::Tensor w_valid = w_ragged.ne(int64_t{0xFFFFFFFF}).logical_and(w_loc.ge(0));
  check_plan_field("plan_w", "ragged_id", w_ragged, w_valid.logical_and(w_ragged.ge(input_rows)), inputs_what);
  const std::string big = rows_what(state_rows, "state");
  check_plan_field("plan_w", "write_loc", w_loc, w_valid.logical_and(w_loc.ge(state_rows)),
                   [&](int64_t) { return big; });
}

// dsv4/online.py, check_online_decode_plan_values
inline void check_online_decode_plan_values(const at::Tensor& plan, int64_t slots) {
  const PlanColumns p = plan_columns(plan, 16);
  const at::Tensor seq = p.u32(0), loc = p.col(1), rp0 = p.col(2);
  const at::Tensor valid = loc.ge(0);
  const std::string big = rows_what(slots, "state");
  check_plan_field("plan", "write_loc", loc, valid.logical_and(loc.ge(slots)), [&](int64_t) { return big; });
  const at::Tensor loads = valid.logical_and((seq - 1).remainder(128).ne(0));
  check_plan_field("plan", "read_page_0", rp0, loads.logical_and(outside(rp0, slots)),
                   [&](int64_t) { return "expected >= 0 and < " + num(slots) + " (rows of state)"; });
}

// dsv4/online.py, check_online_segment_values
inline void check_online_segment_values(const char* name, const at::Tensor& plan, int64_t slots, int64_t input_rows) {
  const PlanColumns c = plan_columns(plan, 16);
  const at::Tensor seq = c.u32(0), ragged = c.low16(1), seg = c.high16(1), rp0 = c.col(2), rp1 = c.col(3);
  const at::Tensor valid = seq.ne(int64_t{0xFFFFFFFF}).logical_and(rp0.ge(0));
  const at::Tensor hi = at::minimum(seq, (seq - 1).remainder(128) + 1);
  check_plan_field(name, "buffer_len", seg, valid.logical_and(seg.lt(1).logical_or(seg.gt(hi))), [&](int64_t i) {
    return "expected 1.." + num(hi[i].item<int64_t>()) + " (a segment of the 128-chunk that ends at seq_len = " +
           num(seq[i].item<int64_t>()) + ")";
  });
  const std::string inputs = rows_what(input_rows, "kv_score");
  check_plan_field(name, "ragged_id", ragged, valid.logical_and(ragged.ge(input_rows)),
                   [&](int64_t) { return inputs; });
  check_plan_field(name, "ragged_id", ragged, valid.logical_and((ragged + 1).lt(seg)),
                   [&](int64_t i) { return "expected >= " + num(seg[i].item<int64_t>() - 1) + " (buffer_len - 1)"; });
  const std::string big = rows_what(slots, "state");
  const auto slots_what = [&](int64_t) { return big; };
  check_plan_field(name, "read_page_0", rp0, valid.logical_and(rp0.ge(slots)), slots_what);
  check_plan_field(name, "read_page_1", rp1, valid.logical_and(rp1.ge(slots)), slots_what);
}

}  // namespace dsv4
}  // namespace dspark
