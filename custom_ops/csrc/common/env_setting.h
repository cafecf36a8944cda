// Integer settings read from the environment by the bindings' opt-in paths (each reads its variable once per
// process and says what it does with a value it refuses).
#pragma once

#include <cstdlib>
#include <optional>

namespace dspark {

// The text of environment variable `name` and whether it is an integer (`value`, else 0).
struct EnvInt {
  const char* text;
  long value;
  bool is_int;
};

// Environment variable `name`, or nullopt when it is unset or empty.
inline std::optional<EnvInt> env_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  return EnvInt{text, *end == '\0' ? value : 0, *end == '\0'};
}

}  // namespace dspark
