// EXPERIMENTAL. Hopper warpgroup MMA (wgmma) primitives for the wide fused tiles beside it (kv_write_wide_kernel.cuh,
// kv_write_wide_tma_kernel.cuh). sm_90a only: in every other compile pass (the compute_80 PTX, the host pass)
// DSPARK_WGMMA is 0 and the functions are empty (or, in the host emulation of the kernel tests, call its emu_*), so
// the kernels that use them must only be launched where the sm_90a code runs.
//
// Operands come from shared memory through matrix descriptors: K-major tiles whose rows are 128 bytes (64 bf16/fp16
// elements) written with the 128-byte swizzle, i.e. the 16-byte chunk c of row r stored at chunk c ^ (r % 8) of the
// row, in groups of 8 rows (1024 bytes) that start 1024-byte aligned. Descriptor fields (PTX ISA, "Matrix
// Descriptor Format" of wgmma): start address >> 4 in bits 0-13, leading-dimension byte offset >> 4 in bits 16-29
// (unused by swizzled K-major layouts; 1), stride byte offset >> 4 in bits 32-45 (1024: the next group of 8 rows),
// base offset 0 in bits 49-51 (the groups are 1024-byte aligned), swizzle mode in bits 62-63 (1: 128 bytes). The K
// steps of 16 elements inside a 128-byte row advance the start address by 32 bytes (2 in the encoded field): the
// hardware applies the swizzle to the address bits, as the copies did.
//
// Accumulators of m64nNk16 with f32 D (N / 2 registers per thread of the warpgroup): thread t (warp w = t / 32,
// lane l) holds, for i < N / 8, d[4 i + {0, 1}] = D(16 w + l / 4, 8 i + 2 (l % 4) + {0, 1}) and d[4 i + {2, 3}] =
// D(16 w + l / 4 + 8, 8 i + 2 (l % 4) + {0, 1}).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSPARK_WGMMA 1
#else
#define DSPARK_WGMMA 0
#endif
// Whether kernels built on these primitives have a body: the sm_90a code, and the host emulation of the kernel tests
// (DSPARK_KERNEL_EMULATION, tests/multi_linear_emulation_shim.py: emu_wgmma* run the MMAs of a batch when a wait
// covers it, reading shared memory through the descriptors then).
#if DSPARK_WGMMA || defined(DSPARK_KERNEL_EMULATION)
#define DSPARK_WGMMA_CODE 1
#else
#define DSPARK_WGMMA_CODE 0
#endif

namespace dspark {
namespace mlinear {

// The descriptor of a K-major, 128-byte-swizzled operand tile at shared address `smem` (1024-byte aligned).
__device__ __forceinline__ uint64_t swizzle128_descriptor(uint32_t smem) {
  return static_cast<uint64_t>((smem & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// Orders this thread's earlier generic-proxy writes of shared memory (stores, cp.async) before later wgmma reads.
__device__ __forceinline__ void fence_async_shared() {
#if DSPARK_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Before the first wgmma of a batch: the accumulator registers' earlier accesses are ordered before it.
__device__ __forceinline__ void wgmma_fence() {
#if DSPARK_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

// Closes the batch of wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
#if DSPARK_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_wgmma_commit();
#endif
}

// Waits until at most kPending of this warpgroup's committed batches are still running (the others have completed,
// their shared-memory reads included).
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if DSPARK_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_wgmma_wait(kPending);
#endif
}

// Keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs that write them.
template <int N>
__device__ __forceinline__ void pin_accumulators(float (&d)[N]) {
#if DSPARK_WGMMA
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

// One instruction per element type: TYPE is the PTX type name of A and B ("bf16" or "f16").
#define DSPARK_WGMMA_M64N64K16(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "l"(a), "l"(b), "r"(accumulate))

#define DSPARK_WGMMA_M64N128K16(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(a), "l"(b), "r"(accumulate))

// D (64 x N, f32) = A (64 x 16, descriptor a) * B (16 x N, descriptor b, a K-major N x 16 tile) + (accumulate ? D
// : 0), asynchronously: the accumulators are defined after wgmma_commit and wgmma_wait<0>.
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
#if DSPARK_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    DSPARK_WGMMA_M64N64K16("bf16");
  } else {
    DSPARK_WGMMA_M64N64K16("f16");
  }
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_wgmma(std::is_same_v<T, __nv_bfloat16>, 64, d, a, b, accumulate);
#endif
}

template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
#if DSPARK_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    DSPARK_WGMMA_M64N128K16("bf16");
  } else {
    DSPARK_WGMMA_M64N128K16("f16");
  }
#elif defined(DSPARK_KERNEL_EMULATION)
  emu_wgmma(std::is_same_v<T, __nv_bfloat16>, 128, d, a, b, accumulate);
#endif
}

#undef DSPARK_WGMMA_M64N64K16
#undef DSPARK_WGMMA_M64N128K16

}  // namespace mlinear
}  // namespace dspark
