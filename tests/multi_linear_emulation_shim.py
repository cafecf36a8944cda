"""Host emulation of the multi_linear CUDA kernels (torch-free headers compiled with g++ and
`DSPARK_KERNEL_EMULATION`): one fiber per CUDA thread (`emulation_fibers.py`), barriers for `__syncthreads`,
`__syncwarp`, named barriers and the cluster barrier, distributed shared memory as an array of the cluster's CTA
buffers (poisoned with NaN bytes), cp.async copies that land only at the wait covering their group, mbarriers as a
locked table of phase counters (bulk copies landing late and out of order, each on an OS thread of its own; a
waiting fiber yields until its phase completes), warp shuffles through a per-warp exchange row, and
`mma.sync.m16n8k16` as a warp-collective exchange that rebuilds A and B from the 32 lanes' fragments with the PTX
ISA's fragment tables (written here independently of the kernel). Used by tests/test_multi_linear_emulation.py and
tests/test_multi_linear_kv_write_emulation.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from emulation_build import compile_emulation
from emulation_fibers import FIBERS_H

# Headers of the benchmark programs (experimental/...: kernels no op uses yet), included as "experimental/..."
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

SHIM = {
    "emu_fibers.h": FIBERS_H,
    "cuda_runtime.h": r"""
#pragma once
#include "emu_fibers.h"
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static
struct uint4 { uint32_t x, y, z, w; };
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct uint2 { uint32_t x, y; };
inline uint2 make_uint2(uint32_t x, uint32_t y) { return {x, y}; }
struct Dim3 { unsigned x = 0, y = 0, z = 0; };

// Where an emulated CUDA thread lives: its CTA's barrier, named barriers (id 1..) and shared memory, its warp's
// barrier and fragment exchange, its cluster's barrier and CTA buffers.
struct EmuThread {
  EmuBarrier* block;
  EmuBarrier* const* named;
  EmuBarrier* warp;
  EmuBarrier* cluster;
  uint32_t (*lanes)[6];
  float* smem;
  float* const* cluster_smem;
  unsigned id, rank, size;
};
// cp.async: a copy reads its source when issued and lands in shared memory only when a wait of its thread covers its
// group (a copy never committed never lands), so a read of a stage before its wait reads what the stage held before.
struct EmuCopy { void* dst; unsigned char bytes[16]; int size; };
// wgmma (experimental/wgmma.cuh): an MMA waits in its thread's batch until a wait covers the batch, and reads shared
// memory only then, so a slot refilled before that wait changes its result. The instructions are .sync: each one
// waits for every lane of the warp (a warp barrier here).
struct EmuMma { bool bf16; int n; float* d; uint64_t a, b; int accumulate; };
// Per emulated thread (a fiber's, emu_fibers.h), reached through the names CUDA code uses.
struct EmuLocals {
  Dim3 thread_idx, block_idx, block_dim, grid_dim;
  EmuThread thread;
  std::vector<EmuCopy> open_copies;
  std::deque<std::vector<EmuCopy>> copy_groups;
  std::vector<EmuMma> open_mmas;
  std::deque<std::vector<EmuMma>> mma_groups;
};
inline EmuLocals& emu_locals() { return emu_locals_of<EmuLocals>(); }
#define threadIdx (emu_locals().thread_idx)
#define blockIdx (emu_locals().block_idx)
#define blockDim (emu_locals().block_dim)
#define gridDim (emu_locals().grid_dim)
#define emu (emu_locals().thread)
#define emu_open_copies (emu_locals().open_copies)
#define emu_copy_groups (emu_locals().copy_groups)
template <typename Body>
void emu_launch_threads(size_t count, Body body) { emu_launch<EmuLocals>(count, body); }

inline void __syncthreads() { emu.block->arrive_and_wait(); }
inline void __syncwarp() { emu.warp->arrive_and_wait(); }
// Warp shuffles through the warp's exchange row: every lane publishes, then reads its source lane.
inline float emu_shuffle(float v, int src) {
  const int lane = threadIdx.x & 31;
  std::memcpy(&emu.lanes[lane][0], &v, 4);
  emu.warp->arrive_and_wait();
  float out;
  std::memcpy(&out, &emu.lanes[src & 31][0], 4);
  emu.warp->arrive_and_wait();
  return out;
}
// With `width` < 32 the warp is cut into aligned segments of `width` lanes: lane `src` of the caller's segment; xor
// partners outside the segment read the caller's own value.
inline float __shfl_sync(unsigned, float v, int src, int width = 32) {
  return emu_shuffle(v, (threadIdx.x & 31 & ~(width - 1)) + (src & (width - 1)));
}
inline float __shfl_xor_sync(unsigned, float v, int mask, int width = 32) {
  const int lane = threadIdx.x & 31, src = lane ^ mask;
  return emu_shuffle(v, (src ^ lane) < width ? src : lane);
}
inline void emu_copy_async(void* dst, const void* src, int size, bool live) {
  EmuCopy c{dst, {}, size};
  if (live) std::memcpy(c.bytes, src, size);
  emu_open_copies.push_back(c);
}
inline void emu_commit_copies() {
  emu_copy_groups.push_back(std::move(emu_open_copies));
  emu_open_copies.clear();
}
inline void emu_wait_copies(int pending) {
  while (int(emu_copy_groups.size()) > pending) {
    for (const EmuCopy& c : emu_copy_groups.front()) std::memcpy(c.dst, c.bytes, c.size);
    emu_copy_groups.pop_front();
  }
}
inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline void emu_group_barrier(int id, int) { emu.named[id - 1]->arrive_and_wait(); }
inline float* emu_cta_smem() { return emu.smem; }
// A shared-memory address: the offset in the emulated CTA's buffer (what descriptors and swizzles are computed from).
inline uint64_t __cvta_generic_to_shared(const void* p) {
  return uint64_t(static_cast<const char*>(p) - reinterpret_cast<const char*>(emu.smem));
}
// The 128-byte swizzle of sm_90 on a shared-memory address: the 16-byte chunk bits 4-6 XOR the 128-byte row bits 7-9.
inline uint64_t emu_swizzle128(uint64_t address) { return address ^ (((address >> 7) & 7) << 4); }
inline void emu_cluster_coord(unsigned& id, unsigned& rank, unsigned& size) {
  id = emu.id; rank = emu.rank; size = emu.size;
}
inline void emu_cluster_sync() { emu.cluster->arrive_and_wait(); }
inline const float* emu_cluster_peer(const float* local, unsigned rank) {
  return emu.cluster_smem[rank] + (local - emu.smem);
}

// mbarriers and bulk copies (common/bulk_copy.cuh): a barrier's state lives in a table keyed by its address,
// under one lock; a phase completes when its arrivals are in and its announced bytes have landed (a copy may land
// first: the byte count goes negative, the missing arrival keeps the phase open). Each copy lands asynchronously,
// on a thread of its own after a pseudo-random delay of up to 200 us, so copies land out of order and late, as on
// the GPU, and a kernel that reads a stage before its barrier says so reads poison.
struct EmuMbar { int count, pending; int64_t tx; unsigned phase; };
inline std::mutex emu_mbar_lock;
inline std::map<const void*, EmuMbar> emu_mbars;
inline void emu_mbar_settle(EmuMbar& b) {
  if (b.pending == 0 && b.tx == 0) {
    b.phase += 1;
    b.pending = b.count;
    emu_progress.fetch_add(1);
  }
}
inline void emu_mbar_init(uint64_t* bar, int count) {
  std::lock_guard<std::mutex> lock(emu_mbar_lock);
  emu_mbars[bar] = EmuMbar{count, count, 0, 0};
}
inline void emu_mbar_arrive(uint64_t* bar, uint32_t bytes) {
  std::lock_guard<std::mutex> lock(emu_mbar_lock);
  EmuMbar& b = emu_mbars.at(bar);
  if (b.pending <= 0) std::abort();  // more arrivals than the barrier's count in one phase
  b.tx += bytes;
  b.pending -= 1;
  emu_mbar_settle(b);
}
inline void emu_mbar_wait(uint64_t* bar, uint32_t parity) {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(emu_mbar_lock);
      if ((emu_mbars.at(bar).phase & 1u) != parity) return;
    }
    emu_yield();
  }
}
inline std::atomic<uint32_t> emu_copy_count{0};
// A copy-engine transfer: `land()` writes its `bytes` on a thread of its own after the pseudo-random delay, then the
// bytes complete on `bar`.
template <typename Land>
inline void emu_land_later(uint64_t* bar, int64_t bytes, Land land) {
  uint32_t h = emu_copy_count.fetch_add(1) * 2654435761u;
  h ^= h >> 15;
  const auto delay = std::chrono::microseconds(h % 200);
  std::thread([=] {
    std::this_thread::sleep_for(delay);
    land();
    std::lock_guard<std::mutex> lock(emu_mbar_lock);
    EmuMbar& b = emu_mbars.at(bar);
    b.tx -= bytes;
    emu_mbar_settle(b);
  }).detach();
}
inline void emu_bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    std::abort();  // the copy engine's alignment rules
  }
  emu_land_later(bar, bytes, [=] { std::memcpy(dst, src, bytes); });
}

inline float emu_half_to_float(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0    ? std::ldexp(float(m), -24)
                  : e == 31 ? (m ? NAN : INFINITY)
                            : std::ldexp(float(m | 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}
inline float emu_decode(uint32_t reg, int half, bool bf16) {
  const uint16_t bits = uint16_t(reg >> (16 * half));
  if (!bf16) return emu_half_to_float(bits);
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: every lane publishes its fragments, every lane rebuilds A and B
// from the PTX tables (groupID g = lane / 4, threadID_in_group t = lane % 4):
//   A element i (register i / 2, half i % 2): row g (+8 if i % 4 >= 2), col 2t + (i & 1) (+8 if i >= 4)
//   B element i (register i / 2, half i % 2): row 2t + (i & 1) (+8 if i >= 2), col g
//   C element i: row g (+8 if i >= 2), col 2t + (i & 1)
inline void emu_mma_16816(bool bf16, float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                          uint32_t b1) {
  const int lane = threadIdx.x & 31;
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(emu.lanes[lane], mine, sizeof(mine));
  emu.warp->arrive_and_wait();
  double A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 8; ++i) {
      A[g + (i % 4 >= 2 ? 8 : 0)][2 * t + (i & 1) + (i >= 4 ? 8 : 0)] = emu_decode(emu.lanes[l][i / 2], i % 2, bf16);
    }
    for (int i = 0; i < 4; ++i) {
      B[2 * t + (i & 1) + (i >= 2 ? 8 : 0)][g] = emu_decode(emu.lanes[l][4 + i / 2], i % 2, bf16);
    }
  }
  emu.warp->arrive_and_wait();
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    double sum = d[i];
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    d[i] = float(sum);
  }
}
// wgmma.mma_async m64nNk16 with both operands K-major in shared memory, 128-byte swizzle (descriptor fields of the PTX
// ISA: start address >> 4 in bits 0-13, stride byte offset >> 4 in bits 32-45, layout in bits 62-63, 1 = 128-byte
// swizzle): element (r, k) of an operand at r / 8 * stride + r % 8 * 128 + 2 k past the start, swizzled. Thread t of
// the warpgroup owns D rows 16 (t / 32 % 4) + t % 32 / 4 (+ 8) and columns 8 i + 2 (t % 4) (+ 1).
inline float emu_operand(uint64_t desc, int row, int k, bool bf16) {
  if ((desc >> 62) != 1 || ((desc >> 16) & 0x3FFF) != 1) std::abort();  // only the layout the kernels use
  const uint64_t start = (desc & 0x3FFF) << 4, stride = ((desc >> 32) & 0x3FFF) << 4;
  const uint64_t at = emu_swizzle128(start + uint64_t(row / 8) * stride + uint64_t(row % 8) * 128 + 2 * k);
  uint16_t bits;
  std::memcpy(&bits, reinterpret_cast<const char*>(emu.smem) + at, 2);
  return emu_decode(bits, 0, bf16);
}
inline void emu_wgmma(bool bf16, int n, float* d, uint64_t a, uint64_t b, int accumulate) {
  emu.warp->arrive_and_wait();
  emu_locals().open_mmas.push_back(EmuMma{bf16, n, d, a, b, accumulate});
}
inline void emu_wgmma_commit() {
  emu.warp->arrive_and_wait();
  emu_locals().mma_groups.push_back(std::move(emu_locals().open_mmas));
  emu_locals().open_mmas.clear();
}
inline void emu_wgmma_wait(int pending) {
  auto& groups = emu_locals().mma_groups;
  const int warp = int(threadIdx.x / 32) % 4, lane = int(threadIdx.x % 32);
  while (int(groups.size()) > pending) {
    for (const EmuMma& m : groups.front()) {
      for (int i = 0; i < m.n / 8; ++i) {
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * warp + lane / 4 + (e >= 2 ? 8 : 0), col = 8 * i + 2 * (lane % 4) + (e & 1);
          double sum = m.accumulate ? m.d[4 * i + e] : 0.0;
          for (int k = 0; k < 16; ++k) {
            sum += double(emu_operand(m.a, row, k, m.bf16)) * emu_operand(m.b, col, k, m.bf16);
          }
          m.d[4 * i + e] = float(sum);
        }
      }
    }
    groups.pop_front();
  }
  emu.warp->arrive_and_wait();  // the warp's MMAs are done (their reads too) when any of its lanes goes on
}
""",
    "cuda.h": r"""
#pragma once
#include "cuda_runtime.h"
// A 2-D tensor map as the emulation needs it: [rows, cols] 2-byte elements, rows `stride` bytes apart, boxes of
// box_rows x box_cols written in the 128-byte swizzle (box_cols * 2 == 128).
struct alignas(64) CUtensorMap {
  const void* base;
  int64_t rows, cols, stride;
  int box_rows, box_cols;
};
// cp.async.bulk.tensor.2d: the box at (column c0, row r0) lands late as a bulk copy does, elements past the matrix as
// zeros, completing the box's bytes on `bar`.
inline void emu_tma_load_2d(void* dst, const CUtensorMap* map, int c0, int r0, uint64_t* bar) {
  if (map->box_cols * 2 != 128 || __cvta_generic_to_shared(dst) % 1024 != 0) std::abort();
  const CUtensorMap m = *map;
  char* const smem = reinterpret_cast<char*>(emu.smem);
  const uint64_t at = __cvta_generic_to_shared(dst);
  emu_land_later(bar, int64_t(m.box_rows) * m.box_cols * 2, [=] {
    for (int r = 0; r < m.box_rows; ++r) {
      for (int c = 0; c < m.box_cols; ++c) {
        uint16_t v = 0;
        const int64_t row = r0 + r, col = c0 + c;
        if (row < m.rows && col < m.cols) {
          std::memcpy(&v, static_cast<const char*>(m.base) + row * m.stride + 2 * col, 2);
        }
        std::memcpy(smem + emu_swizzle128(at + uint64_t(r) * 128 + 2 * c), &v, 2);
      }
    }
  });
}
""",
    "cuda_bf16.h": r"""
#pragma once
#include "cuda_runtime.h"
struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __bfloat162float(__nv_bfloat16 b) { return emu_decode(b.x, 0, true); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
""",
    "cuda_fp16.h": r"""
#pragma once
#include "cuda_runtime.h"
struct __half { uint16_t x; };
inline float __half2float(__half h) { return emu_half_to_float(h.x); }
inline __half __float2half_rn(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  __half r;
  std::memcpy(&r.x, &h, 2);
  return r;
}
struct __half2 { __half x, y; };
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
""",
}


def build(cache: Path, driver: str, name: str) -> ctypes.CDLL:
    """Compile `driver` (C++ including the kernel headers, and the benchmarks' experimental ones) against the shim."""
    return compile_emulation(cache, SHIM, driver, name, ["-DDSPARK_KERNEL_EMULATION", f"-I{BENCHMARKS}"])
