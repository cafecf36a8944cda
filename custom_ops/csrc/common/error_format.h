// Formatting of numbers in TORCH_CHECK messages for every binding of this library.
//
// Numbers are turned into text with std::to_string, never streamed: on the H200 image (torch 2.11+cu130) a
// TORCH_CHECK whose message streamed an integer or an IntArrayRef from this library crashed the process (SIGSEGV)
// instead of raising, while messages made only of strings, devices and dtypes raised cleanly. With these
// helpers every bad-input test raises the expected ValueError / TypeError there (tests/test_flashmla_writes.py).
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace dspark {

template <typename T>
std::string num(T v) {
  static_assert(std::is_arithmetic_v<T>, "num() formats numbers");
  return std::to_string(v);
}

inline std::string dims(c10::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

}  // namespace dspark
