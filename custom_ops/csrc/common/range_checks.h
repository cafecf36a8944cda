// Opt-in value-range checks of the CUDA bindings (docs/contract.md, custom_ops/checks.py).
//
// Structural checks always run in the bindings. Index *values* (slots, positions, request ids) are only read on
// the host when the process turned checks on (`custom_ops.set_checks(True)` / DSPARK_CHECKS=1): that costs a
// sync, so by default the kernels skip out-of-range rows instead. The message matches the CPU path's
// `check_index_range` word for word: "<name>[<i>] = <v> is out of range: <what>".
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <cstdint>
#include <string>

#include "common/error_format.h"

namespace dspark {

// Defined in range_checks.cpp; set from Python through the exported C function dspark_set_checks.
bool range_checks_enabled();

// True when the bindings must validate index values now: checks on and the current stream not capturing.
inline bool must_check_values() {
  return range_checks_enabled() && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
}

// Raise ValueError for the first entry of `index` outside [0, hi) (negative entries allowed when
// `negative_skips`; with `wrap` the range is [-hi, hi), as in Python indexing). Call only when must_check_values()
// is true: it syncs with the host.
inline void check_index_range(const at::Tensor& index, int64_t hi, const char* name, const std::string& what,
                              bool negative_skips = true, bool wrap = false) {
  const at::Tensor values = index.to(at::kLong);
  const at::Tensor bad = wrap             ? values.lt(-hi).logical_or(values.ge(hi))
                         : negative_skips ? values.ge(hi)
                                          : values.lt(0).logical_or(values.ge(hi));
  if (!bad.any().item<bool>()) return;
  const at::Tensor where = bad.nonzero()[0].cpu();
  std::string label;
  at::Tensor v = values;
  for (int64_t d = 0; d < where.size(0); ++d) {
    const int64_t i = where[d].item<int64_t>();
    label += (d ? ", " : "") + std::to_string(i);
    v = v[i];
  }
  TORCH_CHECK_VALUE(false, name, "[", label, "] = ", num(v.item<int64_t>()), " is out of range: ", what);
}

}  // namespace dspark
