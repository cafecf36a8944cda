// The streaming kernel of dspark::multi_linear, for up to 16 tokens on sm_90: a persistent grid of at most one CTA
// per SM, each CTA an equal contiguous share of the output's 16-row blocks, every row block streamed through a ring
// of D shared-memory stages of [16 weight rows + the tokens] x KC columns in 1-D bulk copies (one per row, completing
// on the stage's mbarrier; common/bulk_copy.cuh), issued by one producer warp. CW consumer warps split each stage's
// 32-column steps, multiply with the tile kernel's fragments (multi_linear_kernels.cuh: swap AB, each lane's 16-byte
// vectors of rows group and group + 8 and of token group) and free the stage; at the end of a row block they add
// their partial sums through shared memory, add the bias, round once and store. Plain CUDA (no torch headers): the
// binding is multi_linear.cu; tests/test_multi_linear_stream_emulation.py compiles it for the host.
//
// Why (BENCHMARKS.md, "The streaming kernel"): one launch of the tile kernel (16-byte cp.async per lane, one CTA per
// tile) after an L2 flush read the K/V weights of a draft at 0.86-0.88x of the rate of the copy engine's reader
// alone; the copy engine keeps kilobytes in flight per instruction, from few threads, from the first cycles of the
// launch, and a persistent grid sized by the SM count ends its CTAs together.
//
// Shared memory rows are 2 * KC + 64 bytes apart (= 64 mod 128), so the eight lanes of a quarter-warp (two rows,
// four 16-byte columns) hit 32 different banks. Rows past the last row and tokens past the last token are never
// copied; what their slots hold reaches only outputs that are never stored. Columns past K in a ragged last chunk
// read as zeros. Requirements (kernel_blocker in multi_linear_host.h, as for the tile kernel): K a multiple of 8,
// weight and activation rows 16-byte aligned; weights are read after the dependency wait, like everything else.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/bulk_copy.cuh"
#include "linear/multi_linear_kernels.cuh"

namespace dspark {
namespace mlinear {

template <int KC, int NT>
struct StreamStage {
  static constexpr int kPitch = 2 * KC + 64;             // bytes between rows
  static constexpr int kBytes = (16 + 8 * NT) * kPitch;  // 16 weight rows, then 8 * NT token rows
};
constexpr int kStreamRedPitch = 20;  // floats between tokens of a warp's partial tile [8 NT][16 rows]

template <int KC, int NT, int CW, int D>
__host__ __device__ constexpr int stream_smem_bytes() {
  return D * StreamStage<KC, NT>::kBytes + 2 * CW * 8 * NT * kStreamRedPitch * 4 + 2 * D * 8;
}

__device__ __forceinline__ uint4 shared_vector(const char* p, bool live) {
  return live ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
}

template <typename T, int KC, int NT, int CW, int D>
__global__ void __launch_bounds__(32 * (CW + 1)) multi_linear_stream_kernel(const __grid_constant__ Params p) {
  using Stage = StreamStage<KC, NT>;
  constexpr int kPitch = Stage::kPitch, kRed = 8 * NT * kStreamRedPitch, kSteps = KC / 32;
  static_assert(KC % 64 == 0 && NT <= 2 && D >= 2, "rows 64 mod 128 bytes apart; tokens in lanes 16..31");
  char* const smem = reinterpret_cast<char*>(cta_smem());
  float* const red = reinterpret_cast<float*>(smem + D * Stage::kBytes);  // [2][CW][8 NT][kStreamRedPitch]
  uint64_t* const full = reinterpret_cast<uint64_t*>(red + 2 * CW * kRed);
  uint64_t* const empty = full + D;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t total_rows = p.segment_end[p.num_segments - 1];
  const int64_t blocks = (total_rows + 15) / 16;
  const int64_t block_begin = blocks * blockIdx.x / gridDim.x, block_end = blocks * (blockIdx.x + 1) / gridDim.x;
  if (block_begin >= block_end) return;
  const int chunks = (p.k + KC - 1) / KC;
  const int64_t stages = (block_end - block_begin) * chunks;
  if (threadIdx.x == 0) {
    for (int d = 0; d < D; ++d) {
      mbar_init(full + d, 1);
      mbar_init(empty + d, CW);
    }
    mbar_init_fence();
  }
  __syncthreads();
  pdl_wait();

  if (warp == CW) {  // the producer
    const uint64_t once = evict_first_policy();
    const T* x = static_cast<const T*>(p.x);
    for (int64_t s = 0; s < stages; ++s) {
      const int slot = static_cast<int>(s % D);
      mbar_wait(empty + slot, static_cast<uint32_t>(((s / D) & 1) ^ 1));
      const int64_t row0 = (block_begin + s / chunks) * 16;
      const int rows = total_rows - row0 < 16 ? static_cast<int>(total_rows - row0) : 16;
      const int col0 = static_cast<int>(s % chunks) * KC;
      const uint32_t row_bytes = static_cast<uint32_t>(p.k - col0 < KC ? p.k - col0 : KC) * 2;
      if (lane == 0) mbar_arrive_expect_tx(full + slot, static_cast<uint32_t>(rows + p.tokens) * row_bytes);
      __syncwarp();
      char* const dst = smem + slot * Stage::kBytes;
      if (lane < rows) {
        bulk_copy(dst + lane * kPitch, weight_row<T>(p, row0 + lane) + col0, row_bytes, full + slot, once);
      } else if (lane >= 16 && lane - 16 < p.tokens) {
        const int t = lane - 16;
        bulk_copy(dst + (16 + t) * kPitch, x + t * p.x_stride + col0, row_bytes, full + slot);
      }
    }
  } else {  // consumer warp `warp`: steps [step_lo, step_hi) of every stage
    const int group = lane / 4, quad = lane % 4;
    const int step_lo = kSteps * warp / CW, step_hi = kSteps * (warp + 1) / CW;
    float acc[NT][4] = {};
    T* const out = static_cast<T*>(p.out);
    for (int64_t s = 0; s < stages; ++s) {
      const int slot = static_cast<int>(s % D);
      const int chunk = static_cast<int>(s % chunks);
      const int valid = p.k - chunk * KC < KC ? p.k - chunk * KC : KC;
      mbar_wait(full + slot, static_cast<uint32_t>((s / D) & 1));
      const char* const base = smem + slot * Stage::kBytes + 16 * quad;
#pragma unroll 4
      for (int j = step_lo; j < step_hi; ++j) {
        if (32 * j >= valid) break;
        const bool live = 32 * j + 8 * quad < valid;
        const uint4 lo = shared_vector(base + group * kPitch + 64 * j, live);
        const uint4 hi = shared_vector(base + (group + 8) * kPitch + 64 * j, live);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const uint4 xv = shared_vector(base + (16 + 8 * n + group) * kPitch + 64 * j, live);
          mma_16816<T>(acc[n], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
          mma_16816<T>(acc[n], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
        }
      }
      fence_proxy_async_shared();  // this lane's reads of the stage before the next bulk copy into it
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + slot);
      if (chunk != chunks - 1) continue;
      // The row block is done: the CW partial tiles into shared memory (double-buffered by block parity, so one
      // barrier per block suffices), then bias + their sum, rounded once.
      const int64_t block = block_begin + s / chunks;
      float* const tiles = red + static_cast<int>(block & 1) * CW * kRed;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          tiles[warp * kRed + (8 * n + 2 * quad + (i & 1)) * kStreamRedPitch + group + 8 * (i >> 1)] = acc[n][i];
          acc[n][i] = 0.f;
        }
      }
      group_barrier(1, 32 * CW);
      const int64_t row0 = block * 16;
      const int rows = total_rows - row0 < 16 ? static_cast<int>(total_rows - row0) : 16;
      for (int e = static_cast<int>(threadIdx.x); e < p.tokens * 16; e += 32 * CW) {
        const int token = e / 16, r = e % 16;
        if (r >= rows) continue;
        float sum = bias_of_row<T>(p, row0 + r);
        for (int w = 0; w < CW; ++w) sum += tiles[w * kRed + token * kStreamRedPitch + r];
        out[token * p.out_stride + row0 + r] = from_float<T>(sum);
      }
    }
  }
  pdl_launch_next();
}

// ------------------------------------------------------------------------------------------------ launch shape

// The configurations the op launches, chosen on an H100 with benchmarks/multi_linear_tune.cu `stream` (1024 or 512
// columns per stage, 2, 4 or 8 consumer warps): stages of 1024 columns (2 KB copies; 1 KB copies measured 1.5-2x
// slower, the copy engine's cost being per copy), 8 consumer warps, 4 stages up to 8 tokens and 3 up to 16 (the
// activation rows of a stage take the room of a fourth).
constexpr int kStreamCols = 1024;
constexpr int kStreamConsumers = 8;
constexpr int kStreamMaxTokens = 16;
// The op streams a call whose row blocks give every SM one to kStreamBlocksPerSm of them: with fewer the grid would
// leave SMs idle (the kernel does not split K), with more (gate/up of a Qwen3-8B layer: 11.6 per SM) the tile kernel
// and cuBLAS measured as fast or faster.
constexpr int kStreamBlocksPerSm = 8;
// A single row range (one weight, or weights adjacent in memory: one run) streams up to this many tokens, several up
// to kStreamMaxTokens. H100, benchmarks/multi_linear.py (CUDA-graph replay, L2-cold weights), µs at 16 tokens,
// streaming kernel against cuBLAS: [12288, 4096] 45.3 / 43.2, [4096, 4096] 17.4 / 17.0, [4096, 12288] 44.3 / 43.8;
// at 1 and 8 tokens within 2 % of cuBLAS or faster. Groups of separate weights at 16 tokens: K/V 38.8 against 40.6
// for the tile kernel (the old path), q/k/v 24.2 against 24.6.
constexpr int kStreamSingleMaxTokens = 8;

inline int stream_threads() { return 32 * (kStreamConsumers + 1); }

inline int stream_smem(int tokens) {
  return tokens <= 8 ? stream_smem_bytes<kStreamCols, 1, kStreamConsumers, 4>()
                     : stream_smem_bytes<kStreamCols, 2, kStreamConsumers, 3>();
}

template <typename T>
KernelFn stream_kernel_for(int tokens) {
  static_assert(stream_smem_bytes<kStreamCols, 1, kStreamConsumers, 4>() <= kMaxSmemBytes &&
                    stream_smem_bytes<kStreamCols, 2, kStreamConsumers, 3>() <= kMaxSmemBytes,
                "one CTA per SM must fit the opt-in shared-memory limit of sm_90");
  return tokens <= 8 ? &multi_linear_stream_kernel<T, kStreamCols, 1, kStreamConsumers, 4>
                     : &multi_linear_stream_kernel<T, kStreamCols, 2, kStreamConsumers, 3>;
}

// CTAs of a launch over `rows` output rows: one per SM, or one per row block if there are fewer.
inline int64_t stream_grid(int64_t rows, int sm_count) {
  const int64_t blocks = (rows + 15) / 16;
  return blocks < sm_count ? blocks : sm_count;
}

// Whether a call of `tokens` tokens over `runs` row ranges of `rows` output rows in all takes the streaming kernel
// (on a GPU that runs the sm_90a code, with a layout the kernels can read).
inline bool stream_pays(int64_t tokens, int64_t runs, int64_t rows, int sm_count) {
  const int64_t blocks = (rows + 15) / 16;
  const int64_t max_tokens = runs >= 2 ? kStreamMaxTokens : kStreamSingleMaxTokens;
  return tokens >= 1 && tokens <= max_tokens && blocks >= sm_count &&
         blocks <= static_cast<int64_t>(kStreamBlocksPerSm) * sm_count;
}

}  // namespace mlinear
}  // namespace dspark
