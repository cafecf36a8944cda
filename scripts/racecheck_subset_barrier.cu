// Does compute-sanitizer's racecheck report a race in a kernel that has none, when only some warps of the CTA
// use named barriers before a sequence of __syncthreads? The multi-weight GEMM's kernels do that when K is so short
// (K < 32 * 4 k-warps) that some k-warps get no K step: they skip the main loop and its per-k-group named barriers.
//
// The kernel mirrors that: 4 k-groups of 2 warps; in mode "subset" groups 1 and 3 pass their own named barrier
// (id 1 + group, 64 threads) once, groups 0 and 2 never; in mode "all" every group passes it once. Then all 256
// threads __syncthreads, and group j adds its value to a shared row in turn, a __syncthreads after each turn
// (as the kernel's tile accumulation), and every thread reads the row back. Each access is ordered by a
// CTA-wide barrier, so the kernel is race-free in either mode (and its output is checked).
//
// Seen on the H200 (CUDA 13.0's compute-sanitizer, 2026-12-01): mode "subset" drew race reports in 4 of 10 runs
// (a turn's write against the next turn's read and against the final read, the pattern racecheck reported for the
// K/V write's fused launches with K = 64), mode "all" in none of 10; every run computed the right result.
// racecheck reports only the hazards it observes in a run, hence the repeated runs.
//
// Usage on the GPU machine (scripts/gpu_check.sh sanitize runs it):
//   nvcc -O3 -arch=sm_90a -lineinfo scripts/racecheck_subset_barrier.cu -o /tmp/subset_barrier
//   compute-sanitizer --tool racecheck /tmp/subset_barrier subset   # and: ... all
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

constexpr int kGroups = 4, kWarpsPerGroup = 2, kThreads = 32 * kGroups * kWarpsPerGroup, kRow = 32 * kWarpsPerGroup;

__global__ void subset_barrier_kernel(float* out, int all_groups_pass) {
  __shared__ float row[kRow];
  const int group = static_cast<int>(threadIdx.x) / kRow, lane = static_cast<int>(threadIdx.x) % kRow;
  if (all_groups_pass || group % 2 == 1) asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(kRow) : "memory");
  __syncthreads();
  for (int j = 0; j < kGroups; ++j) {
    if (group == j) row[lane] = (j == 0 ? 0.f : row[lane]) + static_cast<float>(j + 1);
    __syncthreads();
  }
  out[threadIdx.x] = row[lane];
}

int main(int argc, char** argv) {
  if (argc != 2 || (std::strcmp(argv[1], "subset") != 0 && std::strcmp(argv[1], "all") != 0)) {
    std::fprintf(stderr, "usage: %s subset|all\n", argv[0]);
    return 2;
  }
  const int all_groups_pass = std::strcmp(argv[1], "all") == 0;
  float* out = nullptr;
  float host[kThreads];
  if (cudaMalloc(&out, sizeof(host)) != cudaSuccess) return 1;
  subset_barrier_kernel<<<1, kThreads>>>(out, all_groups_pass);
  if (cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost) != cudaSuccess) return 1;
  const float expected = kGroups * (kGroups + 1) / 2.f;
  for (float v : host) {
    if (v != expected) {
      std::printf("mode %s: wrong value %g (expected %g)\n", argv[1], v, expected);
      return 1;
    }
  }
  std::printf("mode %s: every thread read %g\n", argv[1], expected);
  return 0;
}
