// The process-wide switch of the CUDA bindings' value-range checks (see range_checks.h).
#include <atomic>

namespace dspark {
namespace {
std::atomic<bool> g_range_checks{false};
}  // namespace

bool range_checks_enabled() { return g_range_checks.load(std::memory_order_relaxed); }

}  // namespace dspark

// Called from custom_ops/checks.py through ctypes when the library is loaded and on every set_checks().
extern "C" __attribute__((visibility("default"))) void dspark_set_checks(bool enabled) {
  dspark::g_range_checks.store(enabled, std::memory_order_relaxed);
}
