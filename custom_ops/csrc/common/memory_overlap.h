// Byte-level layout tests the bindings' structural checks share (custom_ops/checks.py mirrors them: the same rules, so
// CPU, fake and CUDA raise alike): whether a tensor overlaps itself, whether two tensors have a byte in common.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

namespace dspark {

// Sufficient test of internal overlap (as custom_ops.checks.overlaps_itself): by increasing stride, every dim steps
// past the block spanned by the dims before it.
inline bool overlaps_itself(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;
  for (const auto& [stride, size] : dims) {
    if (stride < span) return true;
    span += (size - 1) * stride;
  }
  return false;
}

// Whether delta == sum(d_k * stride_k) with |d_k| < size_k, dims (stride, size) by decreasing stride (as
// custom_ops.checks._offsets_meet).
inline bool offsets_meet(int64_t delta, const std::vector<std::pair<int64_t, int64_t>>& dims, size_t level) {
  if (level == dims.size()) return delta == 0;
  const auto [stride, size] = dims[level];
  int64_t reach = 0;
  for (size_t k = level + 1; k < dims.size(); ++k) reach += (dims[k].second - 1) * dims[k].first;
  const auto floor_div = [](int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); };
  const int64_t lo = std::max(-(size - 1), -floor_div(reach - delta, stride));
  const int64_t hi = std::min(size - 1, floor_div(delta + reach, stride));
  for (int64_t d = lo; d <= hi; ++d) {
    if (offsets_meet(delta - d * stride, dims, level + 1)) return true;
  }
  return false;
}

// Whether a and b have a byte in common (as custom_ops.checks.share_memory: exact for equal element sizes and layouts
// in one storage, byte ranges otherwise; offsets and strides count elements of each tensor's own size).
inline bool share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto hi = [](const at::Tensor& t) {
    int64_t end = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) end += (t.size(d) - 1) * t.stride(d);
    return end;
  };
  const int64_t a_size = a.element_size(), b_size = b.element_size();
  if (a_size != b_size) {
    return a.storage_offset() * a_size < (hi(b) + 1) * b_size && b.storage_offset() * b_size < (hi(a) + 1) * a_size;
  }
  if (hi(a) < b.storage_offset() || hi(b) < a.storage_offset()) return false;
  if (a.sizes() != b.sizes() || a.strides() != b.strides() || overlaps_itself(a)) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1) dims.emplace_back(a.stride(d), a.size(d));
  }
  std::sort(dims.rbegin(), dims.rend());
  return offsets_meet(b.storage_offset() - a.storage_offset(), dims, 0);
}

// Whether a and b are the same elements of one storage in one layout, the stride of a dim of size 1 no part of it (as
// custom_ops.checks.same_view).
inline bool same_view(const at::Tensor& a, const at::Tensor& b) {
  if (!a.storage().is_alias_of(b.storage()) || a.storage_offset() != b.storage_offset() || a.sizes() != b.sizes()) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// custom_ops.checks.check_no_shared_memory: `written` (a tensor the op writes) shares no byte with any of `inputs`
// (tensors it reads meanwhile), with the Python message word for word.
inline void check_no_shared_memory(const char* name, const at::Tensor& written,
                                   std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  for (const auto& [other, t] : inputs) {
    TORCH_CHECK_VALUE(!share_memory(written, *t), name, ": must not share memory with ", other, " (the op writes ",
                      name, " while it reads ", other, ")");
  }
}

}  // namespace dspark
