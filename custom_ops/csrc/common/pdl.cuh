// Programmatic dependent launch, device side (sm_90+; both are no-ops when the kernel was launched without the
// attribute, and when compiled for the host). A kernel waits for the previous kernel's memory before its first global
// access that depends on it, and lets the next kernel start launching once its own loads are issued (triggering at
// kernel start measured slower on the H200). Used by the DeepSeek-V4 compression and multi_linear kernels.
//
// Host side, `sync_launch`: which GPUs may be launched with PDL and thread-block clusters at all.
#pragma once

#include <cuda_runtime.h>

namespace dspark {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_next() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether a GPU of compute capability major.minor runs this library's sm_90a code. The build (CUDA_FLAGS in
// custom_ops/_build.py) makes sm_90a SASS, which only compute capability 9.0 runs, and compute_80 PTX, which the
// driver compiles for every other GPU; in that PTX pdl_wait, pdl_launch_next and the cluster primitives of
// linear/multi_linear_kernels.cuh are empty (__CUDA_ARCH__ < 900). So only there may a launch ask for programmatic
// dependent launch (elsewhere a kernel could read its inputs before the previous kernel has written them) or for
// clusters of more than one CTA (elsewhere each CTA of a cluster would compute alone, as cluster 0 of 1).
__host__ __device__ constexpr bool sync_launch(int major, int minor) { return major == 9 && minor == 0; }

}  // namespace dspark
