// The DeepSeek-V4 compression ratios and their windows, defined once for C++: the twin of WINDOWS / RATIOS /
// window_of in custom_ops/dsv4/common.py (tests/test_layout_constants.py checks that they agree). Plain C++ usable
// from host and device code, no torch headers; the argument check with the CPU path's message is check_ratio in
// dsv4_checks.h.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DSPARK_HOST_DEVICE __host__ __device__
#else
#define DSPARK_HOST_DEVICE
#endif

namespace dspark {
namespace dsv4 {

constexpr int kRatioC4 = 4;
constexpr int kRatioC128 = 128;
constexpr int kWindowC4 = 8;  // a c4 window also covers the previous 4 rows (overlap)
constexpr int kWindowC128 = 128;

// Whether `ratio` is a valid compression ratio (c4 or c128).
DSPARK_HOST_DEVICE constexpr bool is_ratio(int64_t ratio) { return ratio == kRatioC4 || ratio == kRatioC128; }

// Window slots of one compressed entry of a valid `ratio`.
DSPARK_HOST_DEVICE constexpr int window_of(int64_t ratio) { return ratio == kRatioC4 ? kWindowC4 : kWindowC128; }

}  // namespace dsv4
}  // namespace dspark
