// The copy engine of sm_90, device side: shared-memory mbarriers and 1-D bulk copies (cp.async.bulk) from global to
// shared memory that complete on an mbarrier. Plain CUDA, no torch headers. A bulk copy is one instruction for up to
// ~1 MB of contiguous bytes, issued by one thread; the copy engine, not the SM's load units, moves the bytes, so a
// CTA keeps many kilobytes in flight without registers or per-lane requests. Used by multi_linear's streaming kernel
// (linear/multi_linear_stream.cuh), the benchmarks' copy-engine read (benchmarks/bulk_read.cuh) and the experimental
// wide tile (benchmarks/experimental/kv_write_wide_tma_kernel.cuh).
//
// An mbarrier phase completes when `count` arrivals have been made AND the bytes announced with expect_tx (on the
// arrive of the thread that issues the copies) have all landed. Waiting on parity P returns once the phase of parity
// P has completed; on a fresh barrier (phase 0 running) waiting on parity 1 returns at once, which is how a producer
// passes the first round of its "slot empty" barriers.
//
// Hooks: DSPARK_KERNEL_EMULATION (the host build of the kernel tests) supplies emu_mbar_* and emu_bulk_copy; the
// remaining branch is the host pass of nvcc, which never runs device code.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark {

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// Sets up `bar` for `count` arrivals per phase. One thread initializes; mbar_init_fence then a CTA barrier make the
// barriers visible to the other threads and to the copy engine.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count) : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_mbar_init(bar, count);
#endif
}

__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_mbar_arrive(bar, 0);
#endif
}

// One arrival that also announces `bytes` more bytes of bulk copies completing on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_mbar_arrive(bar, bytes);
#endif
}

// Returns once the phase of parity `parity` of `bar` has completed; the bytes its copies wrote are then visible.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_mbar_wait(bar, parity);
#endif
}

// Orders this thread's earlier generic-proxy accesses of shared memory before later async-proxy accesses (bulk
// copies) of it: a consumer runs it after reading a stage and before releasing the stage to a producer whose next
// bulk copy rewrites it (the PTX memory model asks for a proxy fence between accesses of one location through the
// two proxies).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// An L2 policy for data read once (weights streamed by a decode GEMM): evicted first, so it does not push out the
// activations and caches the rest of the step reuses.
__device__ __forceinline__ uint64_t evict_first_policy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
#else
  return 0;
#endif
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to this CTA's shared `dst`,
// completing on `bar` (whose phase must expect them), with L2 policy `policy`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
          "r"(smem_address(dst)),
      "l"(src), "r"(bytes), "r"(smem_address(bar)), "l"(policy)
      : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  (void)policy;
  emu_bulk_copy(dst, src, bytes, bar);
#endif
}

// The same copy with the default L2 policy (data that other CTAs read too, such as a GEMM's activation).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_address(dst)),
               "l"(src), "r"(bytes), "r"(smem_address(bar))
               : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_bulk_copy(dst, src, bytes, bar);
#endif
}

}  // namespace dspark
