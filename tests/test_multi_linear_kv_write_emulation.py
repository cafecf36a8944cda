"""The multi_linear_kv_write CUDA kernels, compiled for the host and checked on CPU against the op's reference.

`custom_ops/csrc/linear/multi_linear_kv_write_kernels.cuh` and `multi_linear_kv_write_fused.cuh` are plain CUDA
without torch; here they are compiled with g++ against the shim of tests/multi_linear_emulation_shim.py (one fiber per
CUDA thread, warp shuffles and barriers emulated). The op's kernels run: the fused one (weights loaded into MMA
fragments, the norm/RoPE/cache-write epilogue, head_dim 64 and 128, with and without a cluster split) and both forms
of the GEMM path's heads kernel, persistent warps through a ring and a warp per unit (any head_dim multiple of 8 up
to 256, fed the projections rounded to the input dtype as the GEMM path does), the warp per unit compiled for each
form drafts are written in (linear/multi_linear_kv_write_common.cuh, also bit for bit against the general one). So
do the experimental kernels in benchmarks/experimental/, which no op launches, so that a change of one can be checked
here first: the wide tile (warpgroup MMA, kv_write_wide_kernel.cuh) and the same tile with tensor-map copies
(kv_write_wide_tma_kernel.cuh), and that tile spread over a grid by stream-K (kv_write_streamk_kernel.cuh). Every
cache byte outside the written rows must keep its poison; written rows must match the reference within the dtype's
rounding. The GPU's own runs are
tests/test_multi_linear_kv_write_cuda.py. Skipped without a C++20 compiler.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import pytest
import torch
from multi_linear_emulation_shim import build

from custom_ops.linear.multi_linear_kv_write import multi_linear_kv_write_reference, rotary_dim, table_form

pytestmark = (
    pytest.mark.slow
)  # a kernel emulation builds a C++ library (seconds cold): the full run, or this file alone when editing a kernel

DRIVER = r"""
#include "linear/multi_linear_kv_write_fused.cuh"
#include "experimental/kv_write_streamk_kernel.cuh"
#include "linear/multi_linear_kv_write_common.cuh"
#include <memory>
#include <utility>
#include <vector>
using namespace dspark::mlinear;

// Runs a grid: clusters of `split` CTAs one after the other, each with all its threads at once.
template <typename Args>
static void run_grid(void (*kernel)(Args), const Args& args, int64_t clusters, int split, int threads, int row_warps,
                     int k_warps, size_t smem_bytes) {
  const int warps = threads / 32;
  for (int64_t c = 0; c < clusters; ++c) {
    EmuBarrier cluster(threads * split);
    std::vector<std::unique_ptr<EmuBarrier>> blocks, warp_bars, named;
    std::vector<EmuBarrier*> named_ptrs;
    std::vector<std::vector<float>> smem(split, std::vector<float>(smem_bytes / 4 + 16, NAN));
    std::vector<float*> smem_ptrs;
    std::vector<uint32_t> lanes(size_t(split) * warps * 32 * 6);
    for (int r = 0; r < split; ++r) {
      smem_ptrs.push_back(smem[r].data());
      blocks.push_back(std::make_unique<EmuBarrier>(threads));
      for (int w = 0; w < warps; ++w) warp_bars.push_back(std::make_unique<EmuBarrier>(32));
      for (int g = 0; g < k_warps; ++g) {
        named.push_back(std::make_unique<EmuBarrier>(32 * row_warps));
        named_ptrs.push_back(named.back().get());
      }
    }
    emu_launch_threads(size_t(split) * threads, [&](size_t i) {
      const int r = int(i) / threads, t = int(i) % threads;
      threadIdx.x = t;
      blockIdx.x = unsigned(c * split + r);
      blockDim.x = unsigned(threads);
      gridDim.x = unsigned(clusters * split);
      const int w = r * warps + t / 32;
      emu = EmuThread{blocks[r].get(), named_ptrs.data() + size_t(r) * k_warps, warp_bars[w].get(), &cluster,
                      reinterpret_cast<uint32_t(*)[6]>(&lanes[size_t(w) * 32 * 6]), smem_ptrs[r],
                      smem_ptrs.data(), unsigned(c), unsigned(r), unsigned(split)};
      kernel(args);
    });
  }
}

// The op's fused kernel (`variant` 0: the op's configuration; 1: one k-warp, 16 columns per lane, 2 chunks deep),
// `grid` times as many clusters as the rows have heads (> 1: clusters past the last head).
template <typename T, int V, int NT>
static void fused(const KvWriteArgs& args, int64_t rows, int split, int grid, int variant) {
  auto kernel = variant == 0 ? &kv_write_fused_kernel<T, V, NT> : &kv_write_fused_kernel<T, V, NT, 1, 16, 2>;
  const int threads = variant == 0 ? fused_threads<V, kFusedKWarps>() : fused_threads<V, 1>();
  run_grid<KvWriteArgs>(kernel, args, rows / (32 * V) * grid, split, threads, 1, 1, fused_smem_bytes<V, NT>());
}

// The wide tile (one warpgroup per head of kRows rows).
template <typename T, int kRows>
static void wide(const KvWriteArgs& args, int64_t rows) {
  using E = KvWriteEpilogue<kRows / 32>;
  run_grid<KvWriteArgs>(&wide_head_kernel<T, kRows, E>, args, rows / kRows, 1, kWideThreads, 1, 1,
                        wide_smem_bytes(kRows, E::extra_bytes(kWideTokens)));
}

// The tensor maps of the wide tiles, made from the GEMM parameters.
template <typename E, int kRows>
static WideTmaArgs<E> tma_args(const KvWriteArgs& args) {
  WideTmaArgs<E> t{};
  t.base = args;
  const Params& p = args.gemm;
  t.x_map = CUtensorMap{p.x, p.tokens, p.k, p.x_stride * 2, kWideTokens, kWideChunk};
  for (int s = 0; s < p.num_segments; ++s) {
    const int64_t first = s == 0 ? 0 : p.segment_end[s - 1];
    t.w_map[s] = CUtensorMap{p.weight[s], p.segment_end[s] - first, p.k, p.weight_stride[s] * 2, kRows, kWideChunk};
  }
  return t;
}

// The experimental wide tile with tensor-map copies (4 stages).
template <typename T, int kRows>
static void wide_tma(const KvWriteArgs& args, int64_t rows) {
  using E = KvWriteEpilogue<kRows / 32>;
  constexpr int kStages = 4;
  run_grid<WideTmaArgs<E>>(&wide_tma_kernel<T, kRows, kStages, E>, tma_args<E, kRows>(args), rows / kRows, 1,
                           kTmaThreads, 1, 1, wide_tma_smem_bytes(kRows, kStages, E::extra_bytes(kWideTokens)));
}

// Arrival counters a stream-K launch left nonzero, since the last emu_streamk_leftover().
static int streamk_leftover = 0;
extern "C" int emu_streamk_leftover() { return std::exchange(streamk_leftover, 0); }

// The experimental stream-K tile on `grid` CTAs (4 stages), launched twice: the second launch finds the arrival
// counters the first left (each should be zero again) and the partial slots holding the first launch's values.
template <typename T, int kRows>
static void streamk(const KvWriteArgs& args, int64_t rows, int grid) {
  using E = KvWriteEpilogue<kRows / 32>;
  constexpr int kStages = 4;
  StreamKArgs<E> s{};
  s.tma = tma_args<E, kRows>(args);
  std::vector<float> partials(size_t(grid) * 2 * kTmaConsumerThreads * kRows / 2, NAN);
  std::vector<int> arrivals(size_t(rows / kRows), 0);
  s.partials = partials.data();
  s.arrivals = arrivals.data();
  for (int launch = 0; launch < 2; ++launch) {
    run_grid<StreamKArgs<E>>(&streamk_kernel<T, kRows, kStages, E>, s, grid, 1, kTmaThreads, 4, 1,
                             streamk_smem_bytes(kRows, kStages, E::extra_bytes(kWideTokens)));
    for (int& a : arrivals) {
      streamk_leftover += a != 0;
      a = 0;
    }
  }
}

struct HeadsArgs {
  KvWrite kv;
  const void* projections;
  int64_t ld;
  int tokens, layers, per_unit, ctas;
};

template <typename T, int kLanes>
static void heads_entry(HeadsArgs a) {
  kv_write_heads_kernel<T, kLanes>(a.kv, static_cast<const T*>(a.projections), a.ld, a.tokens, a.layers, a.per_unit);
}

template <typename T, int kLanes>
static void unit_entry(HeadsArgs a) {
  kv_write_heads_unit_kernel<T, kLanes>(a.kv, static_cast<const T*>(a.projections), a.ld, a.tokens, a.layers,
                                        a.per_unit);
}

// The heads kernel on a grid of at most `ctas` CTAs (so that the warps loop over several units each), with at
// most `per_unit` heads per unit (clipped to a batch, as the binding's rule does).
template <typename T, int kLanes>
static void heads(HeadsArgs a) {
  a.per_unit = std::min(a.per_unit, head_batch<kLanes>());
  const int64_t units = heads_units(a.tokens, a.layers, a.kv.heads, a.per_unit);
  run_grid<HeadsArgs>(&heads_entry<T, kLanes>, a, heads_blocks(units, a.ctas), 1, 32 * kHeadWarps, 1, 1,
                      heads_smem_bytes());
}

template <typename T, int kLanes, int kForm, bool kNorm>
static void common_entry(HeadsArgs a) {
  kv_write_heads_common_kernel<T, kLanes, kForm, kNorm>(a.kv, static_cast<const T*>(a.projections), a.ld, a.tokens,
                                                        a.layers, a.per_unit);
}

template <typename T, int kLanes, bool kNorm>
static void (*common_for_norm(int form))(HeadsArgs) {
  switch (form) {
    case kNeoxHalves: return &common_entry<T, kLanes, kNeoxHalves, kNorm>;
    case kNeoxFrequencies: return &common_entry<T, kLanes, kNeoxFrequencies, kNorm>;
    case kGptjPairs: return &common_entry<T, kLanes, kGptjPairs, kNorm>;
    case kGptjHalves: return &common_entry<T, kLanes, kGptjHalves, kNorm>;
    default: std::abort();
  }
}

// The compiled-form kernel for the case's form (which it must have), as the binding picks it.
template <typename T, int kLanes>
static void (*common_for(const HeadsArgs& a))(HeadsArgs) {
  const int form = common_form<T, kLanes>(a.kv, a.layers);
  return a.kv.has_norm ? common_for_norm<T, kLanes, true>(form) : common_for_norm<T, kLanes, false>(form);
}

// The unit kernel (or, `common`, the one compiled for the case's form): a warp per unit, the last CTA's warps past
// the last unit idle.
template <typename T, int kLanes>
static void heads_unit(HeadsArgs a, bool common) {
  a.per_unit = std::min(a.per_unit, head_batch<kLanes>());
  const int64_t units = heads_units(a.tokens, a.layers, a.kv.heads, a.per_unit);
  run_grid<HeadsArgs>(common ? common_for<T, kLanes>(a) : &unit_entry<T, kLanes>, a,
                      (units + kHeadWarps - 1) / kHeadWarps, 1, 32 * kHeadWarps, 1, 1, unit_smem_bytes());
}

template <typename T>
static void dispatch(int path, int split, int variant, int grid, const KvWriteArgs& args, const HeadsArgs& h) {
  const int d = args.kv.head_dim;
  if (path == 7) {
    const int64_t rows = args.gemm.segment_end[args.gemm.num_segments - 1];
    d == 64 ? streamk<T, 64>(args, rows, grid) : streamk<T, 128>(args, rows, grid);
  } else if (path == 3 || path == 4) {
    const int64_t rows = args.gemm.segment_end[args.gemm.num_segments - 1];
    if (d == 64) path == 3 ? wide<T, 64>(args, rows) : wide_tma<T, 64>(args, rows);
    else path == 3 ? wide<T, 128>(args, rows) : wide_tma<T, 128>(args, rows);
  } else if (path == 1) {
    const int64_t rows = args.gemm.segment_end[args.gemm.num_segments - 1];
    const bool two = token_tiles(args.gemm.tokens) > 1;
    auto run = d == 64 ? (two ? &fused<T, 2, 2> : &fused<T, 2, 1>) : (two ? &fused<T, 4, 2> : &fused<T, 4, 1>);
    run(args, rows, split, grid, variant);
  } else if (head_lanes(d) == 8) {
    path >= 5 ? heads_unit<T, 8>(h, path == 6) : heads<T, 8>(h);
  } else if (head_lanes(d) == 16) {
    path >= 5 ? heads_unit<T, 16>(h, path == 6) : heads<T, 16>(h);
  } else {
    path >= 5 ? heads_unit<T, 32>(h, path == 6) : heads<T, 32>(h);
  }
}

// ints: bf16, path (0 heads (ring), 1 fused kernel, 3 wide tile, 4 wide tile with tensor maps, 5 heads (a warp per
//       unit), 6 the compiled-form heads kernel, 7 the stream-K tile on `fused grid multiple` CTAs),
//       split (fused) or heads per warp (heads),
//       tokens, k, layers, heads, head_dim, has_norm, rotary_dim, neox, has_rope,
//       positions_int64, loc_int64, width, commit_int64, x_stride(unused), has_commit
extern "C" void emu_kv_write(const int* ints, const int64_t* longs, const void* const* ptrs, const int64_t* strides,
                             const float* eps) {
  const int bf16 = ints[0], path = ints[1], split = ints[2], tokens = ints[3], k = ints[4], layers = ints[5];
  KvWriteArgs args{};
  Params& p = args.gemm;
  KvWrite& kv = args.kv;
  // longs: x_stride, loc_s0, loc_s1, commit_stride, positions_stride, slots, ld, wrap_negative, variant (fused),
  //        heads-kernel CTAs at most, fused grid multiple, table form
  p.x = ptrs[0];
  p.x_stride = longs[0];
  p.tokens = tokens;
  p.k = k;
  p.num_segments = 2 * layers;
  kv.heads = ints[6];
  kv.head_dim = ints[7];
  const int64_t kv_rows = int64_t(kv.heads) * kv.head_dim;
  // per layer i, ptrs: 8 + 8 i: k weight, v weight, k bias, v bias, k cache, v cache, norm weight, table
  // strides per layer: 8 i: k weight, v weight, k slot, k head, v slot, v head, table rows, table stride
  for (int i = 0; i < layers; ++i) {
    const void* const* q = ptrs + 8 + 8 * i;
    const int64_t* s = strides + 8 * i;
    for (int kind = 0; kind < 2; ++kind) {
      p.segment_end[2 * i + kind] = (2 * i + kind + 1) * kv_rows;
      p.weight[2 * i + kind] = q[kind];
      p.weight_stride[2 * i + kind] = s[kind];
      p.bias[2 * i + kind] = q[2 + kind];
      p.bias_stride[2 * i + kind] = 1;
      kv.cache[kind][i] = const_cast<void*>(q[4 + kind]);
      kv.slot_stride[kind][i] = s[2 + 2 * kind];
      kv.head_stride[kind][i] = s[3 + 2 * kind];
    }
    kv.norm_weight[i] = q[6];
    kv.norm_fp32[i] = ints[18 + i];
    kv.eps[i] = eps[i];
    kv.cos_sin[i] = static_cast<const float*>(q[7]);
    kv.position_limit = i == 0 ? s[6] : std::min<int64_t>(kv.position_limit, s[6]);
    kv.table_stride[i] = s[7];
  }
  // ptrs[5], ptrs[6] (if set): a cache and a cos/sin table laid out like layer 0's, for every layer entry past the
  // last (eps 1e-6, no norm weight), so that a tile resolved to a layer past the last writes there
  for (int i = layers; ptrs[5] != nullptr && i < kMaxLayers; ++i) {
    for (int kind = 0; kind < 2; ++kind) {
      kv.cache[kind][i] = const_cast<void*>(ptrs[5]);
      kv.slot_stride[kind][i] = kv.slot_stride[0][0];
      kv.head_stride[kind][i] = kv.head_stride[0][0];
    }
    kv.eps[i] = 1e-6f;
    kv.cos_sin[i] = static_cast<const float*>(ptrs[6]);
    kv.table_stride[i] = kv.table_stride[0];
  }
  kv.has_norm = ints[8];
  kv.rotary_dim = ints[9];
  kv.neox = ints[10];
  kv.has_rope = ints[11];
  kv.positions = ptrs[1];
  kv.positions_stride = longs[4];
  kv.positions_int64 = ints[12];
  kv.loc = ptrs[2];
  kv.loc_stride0 = longs[1];
  kv.loc_stride1 = longs[2];
  kv.loc_int64 = ints[13];
  kv.width = ints[14];
  kv.commit_lens = ints[17] ? ptrs[3] : nullptr;
  kv.commit_stride = longs[3];
  kv.commit_int64 = ints[15];
  kv.slots = longs[5];
  kv.wrap_negative = static_cast<int>(longs[7]);
  kv.table_form = static_cast<int>(longs[11]);
  const HeadsArgs h{kv, ptrs[4], longs[6], tokens, layers, split, static_cast<int>(longs[9])};
  const int variant = static_cast<int>(longs[8]);
  if (bf16) {
    dispatch<__nv_bfloat16>(path, split, variant, static_cast<int>(longs[10]), args, h);
  } else {
    dispatch<__half>(path, split, variant, static_cast<int>(longs[10]), args, h);
  }
}

// The binding's host rules. unit_heads_per_unit at `lanes` lanes per head:
extern "C" int emu_unit_heads_per_unit(int lanes, int tokens, int layers, int heads, int sms, int64_t resident) {
  if (lanes == 8) return unit_heads_per_unit<8>(tokens, layers, heads, sms, resident);
  if (lanes == 16) return unit_heads_per_unit<16>(tokens, layers, heads, sms, resident);
  return unit_heads_per_unit<32>(tokens, layers, heads, sms, resident);
}

// common_form<bf16, head_dim / 8> of 3 layers; ints: head_dim, rotary_dim, table form, neox, has_norm, has_rope, the
// last layer's norm weight (0 none, 1 bf16, 2 fp32), its byte offset from a 16-byte boundary, the last layer's table
// offset in bytes and row stride in floats.
extern "C" int emu_common_form(const int* ints) {
  alignas(16) static float memory[4096];
  KvWrite kv{};
  kv.head_dim = ints[0];
  kv.rotary_dim = ints[1];
  kv.table_form = ints[2];
  kv.neox = ints[3];
  kv.has_norm = ints[4];
  kv.has_rope = ints[5];
  for (int i = 0; i < 3; ++i) {
    const bool last = i == 2;
    kv.norm_weight[i] = memory;
    kv.cos_sin[i] = memory + 1024;
    kv.table_stride[i] = kv.head_dim;
    if (last) {
      kv.norm_weight[i] = ints[6] == 0 ? nullptr : reinterpret_cast<const char*>(memory) + ints[7];
      kv.norm_fp32[i] = ints[6] == 2;
      kv.cos_sin[i] = reinterpret_cast<const float*>(reinterpret_cast<const char*>(memory + 1024) + ints[8]);
      kv.table_stride[i] = ints[9];
    }
  }
  const int lanes = head_lanes(kv.head_dim);
  if (lanes == 8) return common_form<__nv_bfloat16, 8>(kv, 3);
  if (lanes == 16) return common_form<__nv_bfloat16, 16>(kv, 3);
  return common_form<__nv_bfloat16, 32>(kv, 3);
}
"""


@pytest.fixture(scope="module")
def emu(emulation_cache):
    return build(emulation_cache, DRIVER, "kvemu")


@dataclass(frozen=True)
class Spec:
    tokens: int = 5
    layers: int = 2
    hidden: int = 96
    heads: int = 1
    head_dim: int = 64
    rot: int = 64
    neox: bool = True
    norm: bool = True
    rope: bool = True
    commit: bool = False
    dtype: torch.dtype = torch.bfloat16
    slots: int = 24
    table_form: str = "halves"  # the RoPE table form: "halves", "pairs" or "frequencies"


def _case(spec: Spec, seed: int) -> dict:
    """Inputs of the op: K and V from row ranges of one qkv weight per layer (row stride padded), biases on layer
    0, a fp32 norm weight on layer 0 and an x-typed one on layer 1, a cos/sin table per layer, shuffled slots with a
    negative one (from 3 tokens on), caches with padded slot rows and NaN poison."""
    gen = torch.Generator().manual_seed(seed)
    t, d, h = spec.tokens, spec.head_dim, spec.heads
    kv = h * d

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(spec.dtype)

    x = rnd(t, spec.hidden)
    weights = [rnd(3 * kv, spec.hidden + 8, scale=spec.hidden**-0.5)[:, : spec.hidden] for _ in range(spec.layers)]
    biases = [rnd(3 * kv) if i == 0 else None for i in range(spec.layers)]
    norm_w = [
        (torch.rand(d, generator=gen) + 0.5).to(torch.float32 if i == 0 else spec.dtype) for i in range(spec.layers)
    ]
    table_shape = {"halves": (spec.rot,), "pairs": (spec.rot // 2, 2), "frequencies": ()}[spec.table_form]
    rows = () if spec.table_form == "frequencies" else (40,)
    tables = []
    if spec.rope:
        for i in range(spec.layers):
            if spec.table_form == "frequencies":
                tables.append(torch.rand(spec.rot // 2, generator=gen) * (i + 1) / 4)
            else:
                tables.append(torch.randn(rows[0] + i, *table_shape, generator=gen))
    positions = torch.randint(0, 40, (t,), generator=gen)
    slots = torch.randperm(spec.slots, generator=gen)[:t]
    if t > 2:
        slots[t // 2] = -1
    if spec.commit:
        width = 1 if t % 2 else 2
        loc, commit = slots.reshape(t // width, width), torch.randint(0, width + 1, (t // width,), generator=gen)
        commit[0] = width  # the first row is committed whole, so every case writes a row
    else:
        loc, commit = slots, None

    def cache():
        return torch.full((spec.slots, h, d + 8), float("nan"), dtype=spec.dtype)[:, :, :d]

    return dict(
        x=x,
        k_weights=weights,
        k_row_starts=[kv] * spec.layers,
        k_biases=biases,
        v_weights=weights,
        v_row_starts=[2 * kv] * spec.layers,
        v_biases=biases,
        k_norm_weights=norm_w if spec.norm else [None] * spec.layers,
        k_norm_eps=[1e-6 * (i + 1) for i in range(spec.layers)] if spec.norm else [],
        cos_sin_caches=tables,
        positions=positions,
        is_neox=spec.neox,
        k_caches=[cache() for _ in range(spec.layers)],
        v_caches=[cache() for _ in range(spec.layers)],
        cache_loc=loc,
        commit_lens=commit,
        num_kv_heads=h,
        head_dim=d,
    )


PATHS = {"heads": 0, "fused": 1, "wide": 3, "wide_tma": 4, "heads_unit": 5, "heads_common": 6, "streamk": 7}
# the GEMM path's heads kernels: persistent warps through a ring, a warp per unit, and a warp per unit compiled for
# the call's form (linear/multi_linear_kv_write_common.cuh; only the tests named heads_common_form run it)
HEADS_KERNELS = ["heads", "heads_unit", "heads_common"]
GENERAL_HEADS_KERNELS = HEADS_KERNELS[:2]  # any form
TABLE_FORMS = {"halves": 0, "pairs": 1, "frequencies": 2}  # kHalves, kPairs, kFrequencies of the kernels


def _emulate(
    emu,
    a: dict,
    *,
    kernel: str,
    split: int = 1,
    per_unit: int = 4,
    ctas: int = 1,
    variant: int = 0,
    grid: int = 1,
    past_last: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Run the fused kernel (variant `variant`, in clusters of `split` CTAs), a wide tile or,
    with the projections of the GEMM path rounded to x's dtype, the heads kernel (up to `per_unit` heads per unit,
    at most `ctas` CTAs of persistent warps). The fused kernel runs `grid` times as many clusters as it has heads,
    the stream-K tile `grid` CTAs;
    `past_last` (a cache laid out like layer 0's, a cos/sin table) fills the table entries past the last layer."""
    fused = kernel not in HEADS_KERNELS
    layers, kv = len(a["k_weights"]), a["num_kv_heads"] * a["head_dim"]
    keep = []  # tensors whose pointers the driver reads

    def ptr(t, offset=0):
        if t is None:
            return None
        keep.append(t)
        return t.data_ptr() + offset * t.element_size()

    projections = None
    if not fused:
        blocks = []
        for i in range(layers):
            for w, s, b in (
                (a["k_weights"][i], a["k_row_starts"][i], a["k_biases"][i]),
                (a["v_weights"][i], a["v_row_starts"][i], a["v_biases"][i]),
            ):
                out = a["x"].float() @ w[s : s + kv].float().t()
                blocks.append(out + b[s : s + kv].float() if b is not None else out)
        projections = torch.cat(blocks, dim=1).to(a["x"].dtype).contiguous()
    per_layer, strides, norm_fp32 = [], [], []
    tables = a["cos_sin_caches"]
    for i in range(layers):
        kw, vw = a["k_weights"][i], a["v_weights"][i]
        kb, vb = a["k_biases"][i], a["v_biases"][i]
        kc, vc = a["k_caches"][i], a["v_caches"][i]
        nw = a["k_norm_weights"][i]
        per_layer += [
            ptr(kw, a["k_row_starts"][i] * kw.stride(0)),
            ptr(vw, a["v_row_starts"][i] * vw.stride(0)),
            ptr(kb, a["k_row_starts"][i]) if kb is not None else None,
            ptr(vb, a["v_row_starts"][i]) if vb is not None else None,
            ptr(kc),
            ptr(vc),
            ptr(nw),
            ptr(tables[i]) if tables else None,
        ]
        strides += [kw.stride(0), vw.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1)]
        if tables and table_form(tables[i]) != "frequencies":
            strides += [tables[i].shape[0], tables[i].stride(0)]
        else:
            strides += [0, 0]
        norm_fp32.append(int(nw is not None and nw.dtype == torch.float32))
    loc, commit = a["cache_loc"], a["commit_lens"]
    two_d = loc.dim() == 2
    ints = [
        int(a["x"].dtype == torch.bfloat16),
        PATHS[kernel],
        split if fused else per_unit,
        a["x"].shape[0],
        a["x"].shape[1],
        layers,
        a["num_kv_heads"],
        a["head_dim"],
        int(bool(a["k_norm_eps"])),
        rotary_dim(tables[0]) if tables else 0,
        int(a["is_neox"]),
        int(bool(tables)),
        int(a["positions"].dtype == torch.int64),
        int(loc.dtype == torch.int64),
        loc.shape[1] if two_d else max(a["x"].shape[0], 1),
        int(commit is not None and commit.dtype == torch.int64),
        0,
        int(commit is not None),
        *norm_fp32,
    ]
    longs = [
        a["x"].stride(0),
        loc.stride(0) if two_d else 0,
        loc.stride(1) if two_d else loc.stride(0),
        commit.stride(0) if commit is not None else 0,
        a["positions"].stride(0),
        a["k_caches"][0].shape[0],
        projections.stride(0) if projections is not None else 0,
        int(a.get("wrap_negative", False)),
        variant,
        ctas,
        grid,
        TABLE_FORMS[table_form(tables[0])] if tables else 0,
    ]
    extra = [ptr(t) for t in past_last] if past_last is not None else [None, None]
    ptrs = [ptr(a["x"]), ptr(a["positions"]), ptr(loc), ptr(commit), ptr(projections), *extra, None, *per_layer]
    eps = a["k_norm_eps"] or [0.0] * layers
    emu.emu_kv_write(
        (ctypes.c_int * len(ints))(*ints),
        (ctypes.c_int64 * len(longs))(*longs),
        (ctypes.c_void_p * len(ptrs))(*ptrs),
        (ctypes.c_int64 * len(strides))(*strides),
        (ctypes.c_float * layers)(*eps),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _check(emu, spec: Spec, *, kernel: str, seed: int = 0, edit=None, **launch) -> None:
    """Emulate `kernel` (`launch`: its split, variant or heads per warp) on one case and the reference on an
    identical one; `edit(got, want)` may change both."""
    got = _case(spec, seed)
    want = _case(spec, seed)
    if edit is not None:
        edit(got, want)
    before = [_bits(c.clone()) for c in got["k_caches"] + got["v_caches"]]
    _emulate(emu, got, kernel=kernel, **launch)
    if kernel == "streamk":
        assert emu.emu_streamk_leftover() == 0, "a stream-K launch left an arrival counter nonzero"
    want_caches = [c.clone() for c in want["k_caches"] + want["v_caches"]]
    ref_args = {**want, "k_caches": want_caches[: spec.layers], "v_caches": want_caches[spec.layers :]}
    multi_linear_kv_write_reference(**ref_args)
    written = torch.zeros(spec.slots, dtype=torch.bool)
    loc = want["cache_loc"].reshape(-1)
    if want.get("wrap_negative"):
        loc = torch.where(loc < 0, loc + spec.slots, loc)
    keep = loc >= 0
    if want["commit_lens"] is not None:
        width = want["cache_loc"].shape[1]
        keep &= (torch.arange(width)[None, :] < want["commit_lens"][:, None]).reshape(-1)
    written[loc[keep]] = True
    assert written.any(), "the case writes no cache row: it would check nothing"
    rtol, atol = (2**-7, 1e-3) if kernel not in HEADS_KERNELS else (2**-6, 2**-8)
    for c, old, ref in zip(got["k_caches"] + got["v_caches"], before, want_caches, strict=True):
        assert torch.equal(_bits(c)[~written], old[~written]), "a cache row outside the written slots changed"
        g, w = c[written].double(), ref[written].double()
        assert not g.isnan().any(), "a written row still holds poison"
        if w.numel():
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol * w.abs().max().item())


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rot"), [(64, 64), (64, 24), (128, 128), (128, 44)])
def test_fused_kernel(emu, head_dim, rot, neox):
    """The GEMM with the write epilogue: one head per tile, full and partial rotary (R/2 not a multiple of a lane's
    elements: the shared-memory partner path), both RoPE styles, 1 and 2 token tiles."""
    for tokens in (3, 11):
        _check(emu, Spec(tokens=tokens, head_dim=head_dim, rot=rot, neox=neox), kernel="fused", seed=tokens)


def test_fused_kernel_cluster_split_commit_fp16(emu):
    """Split K over a cluster of 3 CTAs (partial sums through distributed shared memory), a [B, W] commit mask,
    fp16, two heads per layer."""
    spec = Spec(tokens=6, hidden=256, heads=2, head_dim=64, commit=True, dtype=torch.float16)
    _check(emu, spec, kernel="fused", split=3)


@pytest.mark.parametrize(("head_dim", "rot", "neox"), [(64, 64, True), (128, 44, True), (128, 128, False)])
@pytest.mark.parametrize(("variant", "split"), [(0, 2), (1, 1), (1, 3)])
def test_fused_kernel_chunks_over_k_parts(emu, head_dim, rot, neox, variant, split):
    """K = 1000 in chunks over the k-parts of a cluster: the op's configuration (2 k-warps, chunks of 32 columns: 31
    whole and a ragged one of 8) and one k-warp with chunks of 64 columns (15 and a ragged one of 40, lanes past K
    loading nothing), clusters of 1 to 3 CTAs; 1 and 11 tokens (one and two token tiles)."""
    for tokens in (1, 11):
        spec = Spec(tokens=tokens, hidden=1000, head_dim=head_dim, rot=rot, neox=neox)
        _check(emu, spec, kernel="fused", split=split, variant=variant, seed=tokens)


def test_fused_kernel_without_norm_or_rope(emu):
    _check(emu, Spec(norm=False), kernel="fused")
    _check(emu, Spec(rope=False, head_dim=128, rot=128), kernel="fused")


@pytest.mark.parametrize("kernel", ["wide", "wide_tma"])
@pytest.mark.parametrize(
    ("head_dim", "rot", "neox"), [(64, 64, True), (64, 24, False), (128, 128, True), (128, 44, False)]
)
def test_wide_kernels(emu, kernel, head_dim, rot, neox):
    """The warpgroup-MMA tiles (with cp.async copies; with tensor-map copies), both experimental: 1, 17 and
    64 tokens by one head, hidden 600 (ten chunks of 64 columns, the last ragged: every ring slot refilled), full and
    partial rotary, both RoPE styles. The emulated MMAs read shared memory only when a wait covers them, and the
    tensor-map copies land late and out of order."""
    for tokens in (1, 17, 64):
        spec = Spec(tokens=tokens, hidden=600, head_dim=head_dim, rot=rot, neox=neox, slots=80)
        _check(emu, spec, kernel=kernel, seed=tokens)


@pytest.mark.parametrize("kernel", ["wide", "wide_tma"])
def test_wide_kernels_commit_fp16_two_heads(emu, kernel):
    spec = Spec(tokens=12, hidden=200, heads=2, head_dim=64, commit=True, dtype=torch.float16)
    _check(emu, spec, kernel=kernel)


@pytest.mark.parametrize("kernel", ["wide", "wide_tma"])
def test_wide_kernels_frequencies_table_without_norm(emu, kernel):
    """An inverse-frequencies RoPE table (its factors staged by every thread of the CTA, the producer warp's too),
    and no norm."""
    _check(emu, Spec(tokens=9, table_form="frequencies", head_dim=128, rot=128), kernel=kernel)
    _check(emu, Spec(tokens=9, norm=False), kernel=kernel)


@pytest.mark.parametrize("grid", [1, 3, 7, 40])
def test_streamk_kernel_splits_heads_over_ctas(emu, grid):
    """The stream-K tile: 4 heads of 10 chunks (hidden 600, the last chunk ragged) over 1 CTA (every head whole), 3
    and 7 (heads cut in two or three parts, a CTA ending one head's part and starting the next's) and 40 (one chunk
    per CTA: a head summed from ten partial slots); 1, 17 and 64 tokens. Launched twice: the arrival counters are
    back to zero after each launch."""
    for tokens in (1, 17, 64):
        spec = Spec(tokens=tokens, hidden=600, head_dim=128, rot=44, neox=False, slots=80)
        _check(emu, spec, kernel="streamk", grid=grid, seed=tokens)


@pytest.mark.parametrize("grid", [2, 5])
def test_streamk_kernel_head_dim_64_commit_frequencies(emu, grid):
    """head_dim 64, two heads per layer, a commit mask, fp16; an inverse-frequencies table (its factors staged by the
    consumer warpgroup alone) without a norm."""
    spec = Spec(tokens=12, hidden=200, heads=2, head_dim=64, commit=True, dtype=torch.float16)
    _check(emu, spec, kernel="streamk", grid=grid)
    spec = Spec(tokens=9, table_form="frequencies", head_dim=128, rot=128, norm=False)
    _check(emu, spec, kernel="streamk", grid=grid)


@pytest.mark.parametrize("kernel", GENERAL_HEADS_KERNELS)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rot"), [(16, 16), (64, 40), (96, 96), (128, 36), (256, 128)])
def test_heads_kernel(emu, head_dim, rot, neox, kernel):
    """The GEMM path's per-head kernels: head_dims that fill a head's lanes or leave some empty (16: 2 of 8 lanes, 96:
    12 of 16), partial rotary (R/2 a multiple of a lane's 8 elements or not), both RoPE styles, a commit mask,
    several heads per layer."""
    spec = Spec(tokens=7, heads=3, head_dim=head_dim, rot=rot, neox=neox, commit=True)
    _check(emu, spec, kernel=kernel)


@pytest.mark.parametrize("kernel", GENERAL_HEADS_KERNELS)
@pytest.mark.parametrize("per_unit", [4, 12])
@pytest.mark.parametrize("heads", [4, 5, 9])
def test_heads_kernel_heads_per_unit(emu, heads, per_unit, kernel):
    """Heads split into units of 4 (small T: 5 and 9 heads leave a last unit with one head, whose missing heads are
    neither read nor written) or one unit for all of a segment's heads (9 of 12: the unit's missing heads are neither
    read nor written)."""
    spec = Spec(tokens=5, heads=heads, head_dim=32, rot=32, commit=True)
    _check(emu, spec, kernel=kernel, per_unit=per_unit, seed=heads)


@pytest.mark.parametrize("kernel", GENERAL_HEADS_KERNELS)
@pytest.mark.parametrize(("head_dim", "heads"), [(64, 17), (128, 9), (256, 9)])
def test_heads_kernel_units_of_a_batch(emu, head_dim, heads, kernel):
    """A unit is at most 2 KB of heads, 4 steps of 32 / lanes heads side by side (16 heads of 64, 8 of 128, 4 of
    256): a segment of one more head than a unit, and for head_dim 256 two full units and one head, so a unit of
    one head and lane groups without a head (they copy and store nothing) are run."""
    spec = Spec(tokens=3, heads=heads, head_dim=head_dim, rot=head_dim // 2, commit=True)
    _check(emu, spec, kernel=kernel, per_unit=heads, seed=head_dim)


@pytest.mark.parametrize(("ctas", "tokens", "per_unit"), [(1, 13, 1), (1, 9, 2), (3, 11, 1)])
def test_heads_kernel_persistent_warps(emu, ctas, tokens, per_unit):
    """Fewer CTAs than units: each warp runs through 5 to 20 units, so its ring of 3 stages is refilled while it
    writes, runs start and end inside a token, and skipped tokens (a negative slot, masked commit columns) lie
    inside runs; 3 heads of 64 per layer in units of 1 or 2 heads."""
    spec = Spec(tokens=tokens, heads=3, head_dim=64, rot=64, commit=True)
    _check(emu, spec, kernel="heads", per_unit=per_unit, ctas=ctas, seed=tokens)


@pytest.mark.parametrize("kernel", GENERAL_HEADS_KERNELS)
def test_heads_kernel_fp16_without_norm(emu, kernel):
    _check(emu, Spec(tokens=4, heads=2, norm=False, dtype=torch.float16), kernel=kernel)


def _norm_weights_in_x_dtype(*cases: dict) -> None:
    for a in cases:
        a["k_norm_weights"] = [w if w is None else w.to(a["x"].dtype) for w in a["k_norm_weights"]]


# The forms the compiled-form kernel has (table form, neox): sglang's and this repository's drafts, HF
# transformers', DeepSeek's reference (a complex table), and GPT-J rotation from a halves table.
COMMON_FORMS = [("halves", True), ("frequencies", True), ("pairs", False), ("halves", False)]
COMMON_SHAPES = [(64, 3, 4), (128, 5, 4), (128, 8, 8), (256, 5, 4)]  # head_dim, heads, heads per unit
# (head_dim, heads, heads per unit, k_norm): every shape with a norm, two without
COMMON_CASES = [(*shape, True) for shape in COMMON_SHAPES] + [(*shape, False) for shape in COMMON_SHAPES[1:3]]


def _common_against_unit(emu, spec: Spec, per_unit: int, edit=None) -> None:
    """The compiled-form kernel against the reference, then against the op's general unit kernel bit for bit."""

    def edit_both(got: dict, want: dict) -> None:
        _norm_weights_in_x_dtype(got, want)
        if edit is not None:
            edit(got, want)

    _check(emu, spec, kernel="heads_common", per_unit=per_unit, edit=edit_both)
    caches = {}
    for kernel in ("heads_common", "heads_unit"):
        got, want = _case(spec, 0), _case(spec, 0)
        edit_both(got, want)
        _emulate(emu, got, kernel=kernel, per_unit=per_unit)
        caches[kernel] = [_bits(c) for c in got["k_caches"] + got["v_caches"]]
    for common, unit in zip(caches["heads_common"], caches["heads_unit"], strict=True):
        assert torch.equal(common, unit), "the compiled-form kernel wrote other bits than the unit kernel"


@pytest.mark.parametrize(("head_dim", "heads", "per_unit", "norm"), COMMON_CASES)
@pytest.mark.parametrize(("form", "neox"), COMMON_FORMS)
def test_heads_common_form(emu, head_dim, heads, per_unit, norm, form, neox):
    """The heads kernel compiled for each form drafts are written in (RoPE over the whole head: neox from a halves
    table or from inverse frequencies, GPT-J from a pairs or a halves table; norm weights of x's dtype, or no k_norm
    as in Llama-style drafts), bf16: against the reference, and against the op's unit kernel bit for bit; 64-, 128-
    and 256-wide heads, units of 4 heads (the last one short) or a whole segment, a commit mask with skipped
    tokens."""
    spec = Spec(
        tokens=9,
        heads=heads,
        head_dim=head_dim,
        rot=head_dim,
        neox=neox,
        table_form=form,
        commit=True,
        norm=norm,
        dtype=torch.bfloat16,
    )
    _common_against_unit(emu, spec, per_unit)


@pytest.mark.parametrize(("head_dim", "heads", "per_unit"), COMMON_SHAPES)
def test_heads_common_form_fp16(emu, head_dim, heads, per_unit):
    spec = Spec(tokens=9, heads=heads, head_dim=head_dim, rot=head_dim, commit=True, dtype=torch.float16)
    _common_against_unit(emu, spec, per_unit)


@pytest.mark.parametrize(
    ("lanes", "tokens", "heads", "expected"),
    [
        (16, 17, 8, 4),  # 340 units of 4 heads (Qwen3-8B draft: 5 layers, 8 heads of 128)
        (16, 158, 8, 4),  # 3160 units: the last T at which 4-head units fit 3168 warps
        (16, 159, 8, 8),  # 4-head units would be 3180: 8 heads, 1590 units
        (16, 316, 8, 8),
        (16, 317, 8, 0),  # 3170 units even of a segment's 8 heads: the ring (or the compiled kernel in waves)
        (8, 79, 16, 4),  # head_dim 64, 16 heads: 3160 units of 4
        (8, 80, 16, 8),
        (8, 159, 16, 16),  # 8-head units 3180, 16-head 1590
        (8, 317, 16, 0),
        (16, 150, 12, 8),  # 12 heads: 4500 units of 4; of 8 (two per segment, the second of 4 heads) 3000
        (16, 300, 12, 0),  # 6000 units of 8: never fits, 8 being a batch of 128-wide heads
        (32, 100, 8, 4),  # 256-wide heads: a batch is 4 heads, so units never widen
        (32, 200, 8, 0),
    ],
)
def test_unit_heads_per_unit(emu, lanes, tokens, heads, expected):
    """The binding's heads per unit of the warp-per-unit kernels (5 layers, 132 SMs, 3168 resident warps): the ring's
    heads per unit (4 while whole segments are fewer than 16 per SM), doubled up to a segment's heads and a batch
    until every unit has a warp at once; 0 where no width fits."""
    emu.emu_unit_heads_per_unit.argtypes = [ctypes.c_int] * 5 + [ctypes.c_int64]
    assert emu.emu_unit_heads_per_unit(lanes, tokens, 5, heads, 132, 3168) == expected


COMMON_FORM_CASES = {  # head_dim, rotary dim, table form, neox, norm, rope, last norm weight, its offset, table
    # offset, table stride -> the form (kNeoxHalves 0, kNeoxFrequencies 1, kGptjPairs 2, kGptjHalves 3) or -1
    "neox halves": ((128, 128, 0, 1, 1, 1, 1, 0, 0, 128), 0),
    "neox frequencies": ((128, 128, 2, 1, 1, 1, 1, 0, 0, 0), 1),
    "GPT-J pairs": ((128, 128, 1, 0, 1, 1, 1, 0, 0, 128), 2),
    "GPT-J halves": ((128, 128, 0, 0, 1, 1, 1, 0, 0, 128), 3),
    "head_dim 64": ((64, 64, 0, 1, 1, 1, 1, 0, 0, 64), 0),
    "head_dim 256, frequencies": ((256, 256, 2, 1, 1, 1, 1, 0, 0, 0), 1),
    "neox pairs (no such spelling)": ((128, 128, 1, 1, 1, 1, 1, 0, 0, 128), -1),
    "GPT-J frequencies (not compiled)": ((128, 128, 2, 0, 1, 1, 1, 0, 0, 0), -1),
    "partial rotary": ((128, 64, 0, 1, 1, 1, 1, 0, 0, 128), -1),
    "head_dim 96 (lanes past head_dim)": ((96, 96, 0, 1, 1, 1, 1, 0, 0, 96), -1),
    "no norm (Llama-style)": ((128, 128, 0, 1, 0, 1, 1, 0, 0, 128), 0),
    "no norm: the weights do not count": ((128, 128, 2, 1, 0, 1, 2, 8, 0, 0), 1),
    "no rope": ((128, 128, 0, 1, 1, 0, 1, 0, 0, 128), -1),
    "a layer without a norm weight": ((128, 128, 0, 1, 1, 1, 0, 0, 0, 128), -1),
    "a layer's fp32 norm weight": ((128, 128, 0, 1, 1, 1, 2, 0, 0, 128), -1),
    "a layer's norm weight 8 bytes off": ((128, 128, 0, 1, 1, 1, 1, 8, 0, 128), -1),
    "a layer's table 4 bytes off": ((128, 128, 0, 1, 1, 1, 1, 0, 4, 128), -1),
    "a layer's table rows 2 floats apart past 16 bytes": ((128, 128, 0, 1, 1, 1, 1, 0, 0, 130), -1),
    "frequencies: the row stride does not count": ((128, 128, 2, 1, 1, 1, 1, 0, 0, 3), 1),
}


@pytest.mark.parametrize("case", list(COMMON_FORM_CASES))
def test_common_form(emu, case):
    """Which compiled form the binding's host check gives a call of 3 layers (the last one varied), or -1 (the
    general kernels): the four forms, and each condition that rules a call out."""
    ints, expected = COMMON_FORM_CASES[case]
    assert emu.emu_common_form((ctypes.c_int * len(ints))(*ints)) == expected


def _position_past_the_shortest_table(got: dict, want: dict) -> None:
    got["positions"][1] = 40
    want["cache_loc"].view(-1)[1] = -1


def _wrap_negative(got: dict, want: dict) -> None:
    for a in (got, want):
        a["wrap_negative"] = True
        loc, slots = a["cache_loc"].view(-1), a["k_caches"][0].shape[0]
        free = min(set(range(slots)) - set(loc.tolist()))
        loc[loc == -1] = free - slots
        loc[0] -= slots
        a["positions"][2] -= 40


@pytest.mark.parametrize("kernel", ["fused", *GENERAL_HEADS_KERNELS])
def test_position_past_the_shortest_table_skips_the_token(emu, kernel):
    """Token 1's position is a row of layer 1's table (41 rows) but not of layer 0's (40): the kernel writes it in no
    layer (the CPU op raises for it), as the reference does with the token's slot made negative."""
    _check(emu, Spec(tokens=6, head_dim=64), kernel=kernel, edit=_position_past_the_shortest_table)


@pytest.mark.parametrize("kernel", ["fused", *GENERAL_HEADS_KERNELS])
def test_wrap_negative_counts_from_the_end(emu, kernel):
    """With wrap_negative, slot l - S addresses slot l and position p - P row p (P: rows of the shortest table, 40)
    in both kernels, as the reference does; the token whose slot was -1 (skipped) gets a free slot counted from the
    end."""
    _check(emu, Spec(tokens=6, head_dim=64), kernel=kernel, edit=_wrap_negative)


@pytest.mark.parametrize("edit", [_position_past_the_shortest_table, _wrap_negative])
def test_heads_common_form_skips_and_wraps_as_the_general_kernels(emu, edit):
    """The two tests above on the compiled-form kernel (their case in the drafts' form: full-head neox RoPE from a
    halves table, bf16 with bf16 norm weights)."""
    _common_against_unit(emu, Spec(tokens=6, head_dim=64, rot=64, dtype=torch.bfloat16), 4, edit=edit)


def test_fused_kernel_tiles_past_the_last_head_return_early(emu):
    """The code GPUs other than sm_90 run (the portable PTX) has no clusters: each CTA is a cluster of one, numbered
    by its block index, so a launch with a split would give tiles past the last head. Here twice as many clusters of
    one CTA as there are heads; the tables' entries past the last layer point to a cache poisoned with 12.5 and a real
    cos/sin table. A tile past the last head must return before resolving them: that cache keeps every poison bit
    and the real caches match the reference (before, such tiles wrote zeros into the cache of 'layer' 2 and 3)."""
    spec = Spec(tokens=6, heads=2, head_dim=64)
    cache = torch.full((spec.slots, spec.heads, spec.head_dim + 8), 12.5, dtype=spec.dtype)[:, :, : spec.head_dim]
    before = _bits(cache.clone())
    table = torch.randn(40, spec.rot, generator=torch.Generator().manual_seed(7))
    _check(emu, spec, kernel="fused", grid=2, past_last=(cache, table))
    assert torch.equal(_bits(cache), before), "a tile past the last head wrote"


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("form", ["pairs", "frequencies"])
@pytest.mark.parametrize("kernel", ["fused", *GENERAL_HEADS_KERNELS])
def test_table_forms(emu, kernel, form, neox):
    """A `[P, R/2, 2]` pairs table (a complex table's real view) and `[R/2]` inverse frequencies (cos/sin computed
    from the position) in every kernel, partial rotary, against the reference."""
    _check(emu, Spec(tokens=6, head_dim=64, rot=40, neox=neox, table_form=form), kernel=kernel)


def _angles_past_any_table(got: dict, want: dict) -> None:
    for a in (got, want):
        a["wrap_negative"] = True
        loc, slots = a["cache_loc"].view(-1), a["k_caches"][0].shape[0]
        loc[loc == -1] = min(set(range(slots)) - set(loc.tolist())) - slots
        a["positions"][1] = -7
        a["positions"][4] = 100_000


@pytest.mark.parametrize("kernel", ["fused", *GENERAL_HEADS_KERNELS])
def test_frequency_positions_are_angles(emu, kernel):
    """With inverse frequencies a position is an angle: a negative one or one past any table's rows is written
    (rotated by its own angle) and never wrapped, with `wrap_negative` too."""
    _check(emu, Spec(tokens=6, head_dim=64, table_form="frequencies"), kernel=kernel, edit=_angles_past_any_table)


def test_heads_common_form_frequency_positions_are_angles(emu):
    """The test above on the compiled-form kernel (HF's form: inverse frequencies, neox, over the whole head)."""
    spec = Spec(tokens=6, head_dim=64, rot=64, table_form="frequencies", dtype=torch.bfloat16)
    _common_against_unit(emu, spec, 4, edit=_angles_past_any_table)
