// EXPERIMENTAL, not used by any op: a streaming variant of the fused kernel of dspark::multi_linear_kv_write (small
// T, head_dim 64 or 128), the whole write (projection, K norm, RoPE, cache stores) of one head per CTA with its
// weights streamed through shared memory by the copy engine. Plain CUDA (no torch headers); it reuses the op's
// epilogue (KvWriteEpilogue of custom_ops/csrc/linear/multi_linear_kv_write_kernels.cuh); the copy primitives are
// bulk_copy.cuh beside it. benchmarks/kv_write_tune.cu times it against the op's fused tile;
// tests/test_multi_linear_kv_write_emulation.py runs it on the CPU.
//
// Why it is not in the op (H200, benchmarks/kv_write_tune.cu, BENCHMARKS.md "Copy-engine experiment"):
//   * it is barely faster: Qwen3-8B draft dims, T = 8, 29.6 -> 28.6 us back to back and 35.3 -> 32.5 us for one
//     launch after an L2 flush; at T = 16 and for hidden 7168 / head_dim 64 it is slower;
//   * with 160 heads of 64 at T = 16 and 6 stages (two waves of CTAs) some launches wrote K/V values off by 0.07 to
//     0.17 where values reach 3.0 (several bf16 steps); the cause is not found (memcheck is clean on two launches,
//     racecheck stops with an internal error on this kernel, the CPU emulation with late, out-of-order copies
//     passes). Until it is found, nothing may launch it.
//
// Why a second main loop was tried. The fused tile of multi_linear_kernel (one head per CTA) feeds its ring with
// 16-byte cp.async copies, one per lane: a head of 128 rows gives 80 CTAs for the Qwen3-8B draft's 80 heads, and
// 80 SMs issuing per-lane copies pulled the 83.9 MB of weights in 29-30 us (66 % of the copy rate), where 160 CTAs
// of the plain GEMM reach the 24 us of a plain read. The copy engine has no such per-SM limit as long as each copy
// is large: 80 CTAs reading the same 83.9 MB through 8 stages of 16 KB took, in 1-D bulk copies of 512 B, 68 us; of
// 1 KB, 41 us; of 4 KB, 21.5 us (91 % of the copy rate); 2-D tensor-map boxes of 128 rows x 128 B, 24 us. So a
// stage here is 16 weight rows of kCols columns, one bulk copy of 2 kCols bytes per row.
//
// Work of a CTA: head `cluster id` (rows row0 = id * head_dim .. + head_dim of the concatenated K/V rows, inside one
// weight segment), K cut into chunks of kCols columns; a cluster of S CTAs splits the chunks S ways (CTA `rank`
// takes chunks [rank * C / S, (rank + 1) * C / S)) and the epilogue sums the S partial tiles through distributed
// shared memory, as the GEMM's split-K epilogue does. Per chunk the CTA runs head_dim / 16 weight stages: rows
// 16 g .. 16 g + 15 of the head, [16][kCols].
//
// Warps: 8 consumers, then 1 producer. Consumer warp c owns columns [c kCols / 8, (c + 1) kCols / 8) of every
// chunk. It loads that slice of every token's activation from global memory (L2: every CTA reads the same T x K
// values) into registers one chunk ahead, then multiplies it with the chunk's head_dim / 16 weight stages, with
// the lane mapping and mma.sync m16n8k16 "swap AB" fragments of multi_linear_kernels.cuh (weight rows as M, tokens
// as N; lane (group, quad) reads 8 consecutive columns of rows group and group + 8 and of token group), accumulating
// every m-tile of the head (head_dim / 16 x n-tiles x 4 fp32). The activation needs no shared memory and no
// barrier (a consumer waiting for it would hold its ring slots and stop the producer). Shared-memory rows have a
// pitch of 2 kCols + 64 bytes, so the two rows a quarter-warp reads sit 16 banks apart: no bank conflict.
//
// Ring protocol (an mbarrier per slot and direction): the producer waits for a slot's "empty" phase (8 consumer
// arrivals), announces the stage's bytes on its "full" barrier and issues the copies (16 lanes, one row each); a
// consumer waits for "full", reads, and arrives on "empty" (lane 0, after __syncwarp). Columns past K (a ragged last
// chunk) are never copied and tokens past T never read; the lanes that would use them use zeros instead (shared
// memory is not cleared, and 0 * NaN is NaN).
//
// Finish: consumer warps add their accumulators into the fp32 tile [tokens][head_dim + 4] in turn (it aliases the
// weight ring, drained by then), then all warps run KvWriteEpilogue::finish: the bias, the cluster's partial tiles,
// norm, RoPE and one vector store per lane straight into the caches. The epilogue's slots, norm weight and cos/sin
// rows are loaded after the dependency wait and staged to shared memory after the first chunk, off the critical path.
//
// Dependencies: nothing is read before griddepcontrol.wait (a kernel before this one may write the activation, the
// indices or, in place, the weights); griddepcontrol.launch_dependents once the CTA's main loop is done.
#pragma once

#include "bulk_copy.cuh"
#include "linear/multi_linear_kv_write_kernels.cuh"

namespace dspark {
namespace mlinear {

constexpr int kStreamConsumerWarps = 8;
constexpr int kStreamConsumers = 32 * kStreamConsumerWarps;
constexpr int kStreamThreads = kStreamConsumers + 32;
constexpr int kStreamStageRows = 16;  // weight rows per stage: one m-tile

// A streaming configuration: D weight stages of kStreamStageRows x cols columns; with `rotate`, head h walks its
// chunks starting at chunk h % chunks (so the heads' copies spread over all of K at any moment) instead of at 0.
struct StreamVariant {
  int cols;
  int stages;
  int rotate;
};

// Byte offsets of the shared-memory regions of one CTA (16-byte aligned): bias [rows] fp32, the mbarriers
// (full[D], empty[D]), the weight ring [D][16][pitch], the epilogue's staging area; the fp32 tile
// [tokens][rows + 4] reuses the weight ring.
struct StreamLayout {
  int pitch, stage_bytes;
  int bias, bars, ring, extra, total;
};

__host__ __device__ constexpr int align16(int bytes) { return (bytes + 15) / 16 * 16; }

__host__ __device__ constexpr StreamLayout stream_layout(const StreamVariant& v, int rows, int extra_bytes) {
  StreamLayout l{};
  l.pitch = 2 * v.cols + 64;
  l.stage_bytes = kStreamStageRows * l.pitch;
  l.bias = 0;
  l.bars = align16(4 * rows);
  l.ring = l.bars + align16(8 * 2 * v.stages);
  l.extra = l.ring + v.stages * l.stage_bytes;
  l.total = l.extra + align16(extra_bytes);
  return l;
}

// The configurations compiled in, by index (the emulation test and the tune program address them so).
constexpr StreamVariant kStreamVariants[] = {
    {1024, 6, 0},  // 6 stages of 16 rows x 2 KB (203 KB): one CTA per SM
    {1024, 6, 1},  // the same, chunks rotated by head
    {1024, 3, 0},  // 3 stages (104 KB): two CTAs per SM
    {1024, 3, 1},
};
constexpr int kNumStreamVariants = sizeof(kStreamVariants) / sizeof(kStreamVariants[0]);

// Copies of one CTA (the producer warp): the weight stages of its chunks, in order.
template <typename T, int kCols, int D, int kGroups>
__device__ __forceinline__ void stream_produce(const Params& p, const StreamLayout& l, char* smem, uint64_t* full,
                                               uint64_t* empty, int64_t row0, int first, int last, int rot,
                                               int lane) {
  const int s = find_segment(p, row0);
  const T* rows = static_cast<const T*>(p.weight[s]) + row_in_segment(p, s, row0) * p.weight_stride[s];
  const int64_t row_stride = p.weight_stride[s];
  const uint64_t once = evict_first_policy();
  int stage = 0;  // the CTA's running weight-stage index
  for (int i = 0; i < last - first; ++i) {
    const int c = first + (i + rot) % (last - first);
    const int64_t col = static_cast<int64_t>(c) * kCols;
    const int64_t left = p.k - col;
    const uint32_t bytes = static_cast<uint32_t>((left < kCols ? left : kCols) * static_cast<int64_t>(sizeof(T)));
#pragma unroll 1
    for (int g = 0; g < kGroups; ++g, ++stage) {
      const int slot = stage % D;
      mbar_wait(empty + slot, ((stage / D) & 1) ^ 1);
      if (lane == 0) mbar_arrive_expect_tx(full + slot, bytes * kStreamStageRows);
      __syncwarp();
      if (lane < kStreamStageRows) {
        bulk_copy(smem + l.ring + slot * l.stage_bytes + lane * l.pitch,
                  rows + (g * kStreamStageRows + lane) * row_stride + col, bytes, full + slot, once);
      }
    }
  }
}

__device__ __forceinline__ uint4 smem_vector(const char* at, bool live) {
  return live ? *reinterpret_cast<const uint4*>(at) : make_uint4(0, 0, 0, 0);
}

// The main loop of one consumer warp: acc[g][n] += rows 16 g.. of the head x tokens 8 n.. over its column slices.
// `staged` runs once, after the first chunk (or at once without chunks).
template <typename T, int kCols, int D, int kGroups, int NT, typename Staged>
__device__ __forceinline__ void stream_consume(float (&acc)[kGroups][NT][4], const Params& p, const StreamLayout& l,
                                               const char* smem, uint64_t* full, uint64_t* empty, int first, int last,
                                               int rot, int warp, int lane, Staged&& staged) {
  constexpr int kWarpCols = kCols / kStreamConsumerWarps;
  constexpr int kWarpSteps = kWarpCols / kStepCols;
  static_assert(kWarpCols % kStepCols == 0, "a consumer's slice is whole steps");
  const int group = lane / 4, quad = lane % 4;
  const T* x = static_cast<const T*>(p.x);
  // This warp's slice of every token's activation in chunk c (zeros past K and past T).
  const auto load_slice = [&](uint4 (&xv)[kWarpSteps][NT], int c) {
    const int64_t col = static_cast<int64_t>(c) * kCols;
    const int64_t left = p.k - col;
#pragma unroll
    for (int s = 0; s < kWarpSteps; ++s) {
      const int cc = warp * kWarpCols + s * kStepCols + 8 * quad;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int token = n * 8 + group;
        xv[s][n] = cc < left && token < p.tokens ? *reinterpret_cast<const uint4*>(x + token * p.x_stride + col + cc)
                                                 : make_uint4(0, 0, 0, 0);
      }
    }
  };
  const int n_chunks = last - first;
  if (n_chunks <= 0) {
    staged();
    return;
  }
  // The slice of the next chunk is loaded one chunk ahead: a consumer waiting on an L2 load holds its ring slots,
  // and the producer then stops copying (the ring is at most D stages deep).
  uint4 xv[kWarpSteps][NT], next[kWarpSteps][NT];
  load_slice(next, first + rot % n_chunks);
  int stage = 0;
  for (int i = 0; i < n_chunks; ++i) {
    const int c = first + (i + rot) % n_chunks;
    const int64_t left = p.k - static_cast<int64_t>(c) * kCols;
    const int cols = left < kCols ? static_cast<int>(left) : kCols;
#pragma unroll
    for (int s = 0; s < kWarpSteps; ++s) {
#pragma unroll
      for (int n = 0; n < NT; ++n) xv[s][n] = next[s][n];
    }
    if (i + 1 < n_chunks) load_slice(next, first + (i + 1 + rot) % n_chunks);
    if (i == 0) staged();
#pragma unroll
    for (int g = 0; g < kGroups; ++g, ++stage) {
      const int slot = stage % D;
      mbar_wait(full + slot, (stage / D) & 1);
      const char* ws = smem + l.ring + slot * l.stage_bytes;
#pragma unroll
      for (int s = 0; s < kWarpSteps; ++s) {
        const int cc = warp * kWarpCols + s * kStepCols + 8 * quad;
        const bool live = cc < cols;
        const uint4 lo = smem_vector(ws + group * l.pitch + cc * 2, live);
        const uint4 hi = smem_vector(ws + (group + 8) * l.pitch + cc * 2, live);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          mma_16816<T>(acc[g][n], lo.x, hi.x, lo.y, hi.y, xv[s][n].x, xv[s][n].y);
          mma_16816<T>(acc[g][n], lo.z, hi.z, lo.w, hi.w, xv[s][n].z, xv[s][n].w);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + slot);
    }
  }
}

template <typename T, int V, int NT, int kCols, int D, bool kRotate>
__global__ void __launch_bounds__(kStreamThreads, 1)
    kv_write_stream_kernel(const __grid_constant__ KvWriteArgs args) {
  using Epilogue = KvWriteEpilogue<V>;
  constexpr int kRows = 32 * V, kGroups = kRows / kStreamStageRows, kTokens = 8 * NT, kPitch = tile_pitch(kRows);
  constexpr StreamLayout l = stream_layout(StreamVariant{kCols, D, kRotate}, kRows, Epilogue::extra_bytes(kTokens));
  static_assert(kTokens * kPitch * 4 <= D * l.stage_bytes, "the fp32 tile fits the weight ring");
  static_assert(kRows <= kStreamConsumers && kTokens <= kStreamConsumers,
                "the epilogue's staging threads are consumer threads");
  const Params& p = args.gemm;
  char* smem = reinterpret_cast<char*>(cta_smem());
  float* bias = reinterpret_cast<float*>(smem + l.bias);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + l.bars);
  uint64_t* empty = full + D;
  float* tile = reinterpret_cast<float*>(smem + l.ring);
  float* extra = reinterpret_cast<float*>(smem + l.extra);
  const ClusterCoord cluster = cluster_coord();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row0 = static_cast<int64_t>(cluster.id) * kRows;
  const int chunks = (p.k + kCols - 1) / kCols;
  const int first = chunks * static_cast<int>(cluster.rank) / static_cast<int>(cluster.size);
  const int last = chunks * static_cast<int>(cluster.rank + 1) / static_cast<int>(cluster.size);
  const int rot = kRotate && last > first ? static_cast<int>(cluster.id % static_cast<unsigned>(last - first)) : 0;

  if (threadIdx.x == 0) {
    for (int d = 0; d < D; ++d) {
      mbar_init(full + d, 1);
      mbar_init(empty + d, kStreamConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();
  pdl_wait();

  if (warp == kStreamConsumerWarps) {
    stream_produce<T, kCols, D, kGroups>(p, l, smem, full, empty, row0, first, last, rot, lane);
  } else {
    const typename Epilogue::Prefetch prefetched = Epilogue::template prefetch<T, kTokens>(args, row0);
    for (int r = static_cast<int>(threadIdx.x); r < kRows; r += kStreamConsumers) {
      bias[r] = bias_of_row<T>(p, row0 + r);
    }
    float acc[kGroups][NT][4];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[g][n][i] = 0.f;
      }
    }
    stream_consume<T, kCols, D, kGroups, NT>(
        acc, p, l, smem, full, empty, first, last, rot, warp, lane,
        [&] { Epilogue::template stage<T, kTokens>(args, prefetched, extra, row0); });
    pdl_launch_next();
    group_barrier(1, kStreamConsumers);  // every consumer has read its last stage before the tile overwrites the ring
#pragma unroll 1
    for (int j = 0; j < kStreamConsumerWarps; ++j) {
      if (warp == j) add_to_tile<kGroups, NT, kPitch>(tile, acc, 0, lane, j == 0);
      group_barrier(1, kStreamConsumers);
    }
    commit_copies();  // the epilogue's staged cos/sin rows (cp.async, in no group yet) ...
    wait_copies<0>();  // ... have landed
  }
  __syncthreads();
  Epilogue::template finish<T, kRows, kTokens, kStreamThreads>(args, tile, bias, extra, row0, kRows, cluster);
}

// ------------------------------------------------------------------------------------------------ launch shape

using StreamKernelFn = void (*)(KvWriteArgs);

// Shared memory of variant `variant` for heads of 32 V elements.
template <int V>
constexpr int stream_smem_bytes(int variant, int n_tiles) {
  return stream_layout(kStreamVariants[variant], 32 * V, KvWriteEpilogue<V>::extra_bytes(8 * n_tiles)).total;
}

template <typename T, int V, int NT, int S>
StreamKernelFn stream_instance() {
  constexpr StreamVariant v = kStreamVariants[S];
  static_assert(stream_smem_bytes<V>(S, NT) <= kMaxSmemBytes, "a CTA must fit the opt-in shared memory of sm_90");
  return &kv_write_stream_kernel<T, V, NT, v.cols, v.stages, v.rotate != 0>;
}

template <typename T, int V, int... S>
StreamKernelFn select_stream_kernel(int variant, int n_tiles, std::integer_sequence<int, S...>) {
  StreamKernelFn f = nullptr;
  ((variant == S ? (f = n_tiles == 1 ? stream_instance<T, V, 1, S>() : stream_instance<T, V, 2, S>(), 0) : 0), ...);
  return f;
}

// The streaming kernel of variant `variant` for heads of 32 V elements and `tokens` (1..16) tokens.
template <typename T, int V>
StreamKernelFn stream_kernel_for(int variant, int tokens) {
  return select_stream_kernel<T, V>(variant, token_tiles(tokens),
                                    std::make_integer_sequence<int, kNumStreamVariants>{});
}

}  // namespace mlinear
}  // namespace dspark
