// Programmatic dependent launch, device side (sm_90+; both are no-ops when the kernel was launched without the
// attribute, and when compiled for the host). A kernel waits for the previous kernel's memory before its first global
// access that depends on it, and lets the next kernel start launching once its own loads are issued (triggering at
// kernel start measured slower on the H200). Used by the DeepSeek-V4 compression and multi_linear kernels.
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

}  // namespace dspark
