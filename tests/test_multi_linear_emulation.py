"""The multi_linear CUDA kernel, compiled for the host and checked on CPU against an fp64 formula.

`custom_ops/csrc/linear/multi_linear_kernels.cuh` is plain CUDA without torch (so is the register-streaming tile of
`multi_linear_direct.cuh`, which the tune harness measures against it). Here they are compiled with g++ against the
host shim of tests/multi_linear_emulation_shim.py (one fiber per CUDA thread, `mma.sync` rebuilt from the PTX
fragment tables). This checks the K permutation, the fragment use, the work split over warps and cluster CTAs, the
ragged last step, the segment lookup, biases and which outputs are written, for every compiled variant, on
machines without a GPU. The GPU's own numerics are checked by tests/test_multi_linear_cuda.py. Skipped without a
C++20 compiler.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from multi_linear_cases import fp64_formula
from multi_linear_emulation_shim import build

from custom_ops import _build

pytestmark = (
    pytest.mark.slow
)  # a kernel emulation builds a C++ library (seconds cold): the full run, or this file alone when editing a kernel

# C++ the multi_linear drivers share (after the kernel headers): the kernel parameters from the flat arguments that
# `_launch_args` passes.
PARAMS_OF = r"""
static dspark::mlinear::Params params_of(int tokens, int k, const void* x, int64_t x_stride, void* out,
                                         int64_t out_stride, int num_segments, const int64_t* segment_end,
                                         const void* const* weight, const int64_t* weight_stride,
                                         const void* const* bias, const int64_t* bias_stride) {
  dspark::mlinear::Params p{};
  p.x = x; p.x_stride = x_stride; p.out = out; p.out_stride = out_stride; p.tokens = tokens; p.k = k;
  p.num_segments = num_segments;
  for (int i = 0; i < num_segments; ++i) {
    p.segment_end[i] = segment_end[i]; p.weight[i] = weight[i]; p.weight_stride[i] = weight_stride[i];
    p.bias[i] = bias[i]; p.bias_stride[i] = bias_stride[i];
  }
  return p;
}
"""

DRIVER = (
    r"""
#include "linear/multi_linear_direct.cuh"
#include "linear/multi_linear_kernels.cuh"
#include <memory>
#include <vector>
using namespace dspark::mlinear;
"""
    + PARAMS_OF
    + r"""
// What a launch needs to know of a kernel: its tile's rows, its threads, its k-warps (the ring kernel's k-group
// barriers: ids 1..WK of threads / WK threads each) and its shared memory.
struct Shape {
  KernelFn kernel;
  int rows, threads, k_warps, smem_bytes;
};

template <typename T>
static Shape ring_shape(int variant, int tokens) {
  const Variant& v = kVariants[variant];
  return {kernel_for<T>(variant, tokens), cta_rows(v), cta_threads(v), v.k_warps, smem_bytes(v, token_tiles(tokens))};
}

// The register-streaming tile of linear/multi_linear_direct.cuh (up to 16 tokens) in three configurations: 128 rows,
// 2 k-warps, 8 columns per lane, 4 chunks deep; 64 rows, 1 k-warp, 16 columns, 2 deep; 32 rows, 4 k-warps, 8
// columns, 1 deep.
template <typename T, int WR, int NT, int WK, int E, int D>
static Shape direct_instance() {
  return {&multi_linear_direct_kernel<T, WR, NT, WK, E, D>, 16 * WR, direct_threads<WR, WK>(), WK,
          direct_smem_bytes<WR, NT, StoreEpilogue>()};
}

template <typename T, int NT>
static Shape direct_shape_of(int config) {
  if (config == 0) return direct_instance<T, 8, NT, 2, 8, 4>();
  if (config == 1) return direct_instance<T, 4, NT, 1, 16, 2>();
  return direct_instance<T, 2, NT, 4, 8, 1>();
}

template <typename T>
static Shape direct_shape(int config, int tokens) {
  return tokens <= 8 ? direct_shape_of<T, 1>(config) : direct_shape_of<T, 2>(config);
}

// Runs one launch: clusters one after the other, each with all its CTAs' threads at once.
static void run(const Params& p, const Shape& s, int split) {
  const int warps = s.threads / 32;
  const int64_t rows = p.segment_end[p.num_segments - 1];
  const int64_t tiles = (rows + s.rows - 1) / s.rows;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    EmuBarrier cluster(s.threads * split);
    std::vector<std::unique_ptr<EmuBarrier>> blocks, warp_bars, named;
    std::vector<EmuBarrier*> named_ptrs;
    std::vector<std::vector<float>> smem(split, std::vector<float>(s.smem_bytes / 4, NAN));
    std::vector<float*> smem_ptrs;
    std::vector<uint32_t> lanes(size_t(split) * warps * 32 * 6);
    for (int r = 0; r < split; ++r) {
      smem_ptrs.push_back(smem[r].data());
      blocks.push_back(std::make_unique<EmuBarrier>(s.threads));
      for (int w = 0; w < warps; ++w) warp_bars.push_back(std::make_unique<EmuBarrier>(32));
      for (int g = 0; g < s.k_warps; ++g) {
        named.push_back(std::make_unique<EmuBarrier>(s.threads / s.k_warps));
        named_ptrs.push_back(named.back().get());
      }
    }
    emu_launch_threads(size_t(split) * s.threads, [&](size_t i) {
      const int r = int(i) / s.threads, t = int(i) % s.threads;
      threadIdx.x = t;
      blockIdx.x = unsigned(tile * split + r);
      const int w = r * warps + t / 32;
      emu = EmuThread{blocks[r].get(), named_ptrs.data() + size_t(r) * s.k_warps, warp_bars[w].get(), &cluster,
                      reinterpret_cast<uint32_t(*)[6]>(&lanes[size_t(w) * 32 * 6]), smem_ptrs[r],
                      smem_ptrs.data(), unsigned(tile), unsigned(r), unsigned(split)};
      s.kernel(p);
    });
  }
}

extern "C" int emu_num_variants() { return kNumVariants; }

extern "C" int emu_auto_split(int variant, int64_t rows, int k, int sm_count) {
  return auto_split(kVariants[variant], rows, k, sm_count);
}

extern "C" int emu_default_variant(int64_t rows, int k, int sm_count) {
  return default_variant(rows, k, sm_count);
}

// `direct`: configuration `variant` of the register-streaming tile, else variant `variant` of multi_linear_kernel.
extern "C" void emu_multi_linear(int bf16, int direct, int variant, int split, int tokens, int k, const void* x,
                                 int64_t x_stride, void* out, int64_t out_stride, int num_segments,
                                 const int64_t* segment_end,
                                 const void* const* weight, const int64_t* weight_stride, const void* const* bias,
                                 const int64_t* bias_stride) {
  const Params p = params_of(tokens, k, x, x_stride, out, out_stride, num_segments, segment_end, weight,
                             weight_stride, bias, bias_stride);
  const Shape shape = bf16 ? (direct ? direct_shape<__nv_bfloat16>(variant, tokens)
                                     : ring_shape<__nv_bfloat16>(variant, tokens))
                            : (direct ? direct_shape<__half>(variant, tokens) : ring_shape<__half>(variant, tokens));
  run(p, shape, split);
}
"""
)


@pytest.fixture(scope="module")
def emu(emulation_cache):
    emu = build(emulation_cache, DRIVER, "mlemu")
    emu.emu_auto_split.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    emu.emu_default_variant.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return emu


def _variants(emu) -> range:
    return range(emu.emu_num_variants())


def _ptr(t: torch.Tensor | None, offset: int = 0) -> int:
    return 0 if t is None else t.data_ptr() + offset * t.element_size()


def _segments(weights, starts, counts, biases):
    """The launch's segment table (non-empty row ranges), as the binding builds it without merging."""
    table = []
    for w, s, c, b in zip(weights, starts, counts, biases, strict=True):
        if c:
            bias = (_ptr(b, s * b.stride(0)), b.stride(0)) if b is not None else (0, 0)
            table.append((c, _ptr(w, s * w.stride(0)), w.stride(0), *bias))
    return table


def _launch_args(x, weights, starts, counts, biases, out, col):
    """The launch's parameters as the drivers take them, after the kernel selectors: tokens, K, x and its row stride,
    output columns [col, col + sum(counts)) of `out` and its row stride, then the segment table (non-empty ranges)."""
    table = _segments(weights, starts, counts, biases)
    n = len(table)
    ends = [sum(t[0] for t in table[: i + 1]) for i in range(n)]

    def arr(ctype, values):
        return (ctype * n)(*values)

    return (
        ctypes.c_int(x.shape[0]),
        ctypes.c_int(x.shape[1]),
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_int64(x.stride(0)),
        ctypes.c_void_p(_ptr(out, col)),
        ctypes.c_int64(out.stride(0)),
        ctypes.c_int(n),
        arr(ctypes.c_int64, ends),
        arr(ctypes.c_void_p, [t[1] for t in table]),
        arr(ctypes.c_int64, [t[2] for t in table]),
        arr(ctypes.c_void_p, [t[3] or None for t in table]),
        arr(ctypes.c_int64, [t[4] for t in table]),
    )


def _launch(emu, x, weights, starts, counts, biases, out, *, variant, split, col=0, direct=False):
    """Emulate one launch writing output columns [col, col + sum(counts)) of `out` (`direct`: configuration
    `variant` of the register-streaming tile)."""
    emu.emu_multi_linear(
        ctypes.c_int(x.dtype == torch.bfloat16),
        ctypes.c_int(direct),
        ctypes.c_int(variant),
        ctypes.c_int(split),
        *_launch_args(x, weights, starts, counts, biases, out, col),
    )


def _case(tokens, k, counts, *, dtype=torch.bfloat16, seed=0, pad_rows=3, pad_k=16, with_bias=(False, True)):
    """Fresh random weights with `pad_rows` unused rows around each used range and rows `pad_k` elements longer
    than K (row stride != K), an activation that is a column slice of a wider tensor, mixed biases."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k + 24, generator=gen).to(dtype)[:, 8 : 8 + k]
    weights, starts, biases = [], [], []
    for i, c in enumerate(counts):
        rows = c + 2 * pad_rows
        weights.append(torch.randn(rows, k + pad_k, generator=gen).to(dtype)[:, :k])
        starts.append(pad_rows)
        has_bias = with_bias[i % len(with_bias)]
        biases.append(torch.randn(rows, generator=gen).to(dtype) if has_bias else None)
    return x, weights, starts, list(counts), biases


def _check(out, ref):
    """bf16/fp16 output rounding (one rounding of an fp32 sum) against fp64; NaN never passes."""
    assert not torch.isnan(out).any()
    scale = ref.abs().max().item() + 1e-6
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2 * scale)
    rel = (out.double() - ref).norm() / ref.norm().clamp_min(1e-12)
    assert rel < 1e-2


def _run_and_check(emu, args, *, variant, split, direct=False):
    x, weights, starts, counts, biases = args
    total = sum(counts)
    out = torch.full((x.shape[0], total + 5), float("nan"), dtype=x.dtype)  # 2 columns before, 3 after stay NaN
    _launch(emu, x, weights, starts, counts, biases, out, variant=variant, split=split, col=2, direct=direct)
    _check(out[:, 2 : 2 + total], fp64_formula(*args))
    assert torch.isnan(out[:, :2]).all() and torch.isnan(out[:, 2 + total :]).all()


@pytest.mark.parametrize(("tokens", "split"), [(5, 1), (5, 3), (5, 8), (9, 2), (33, 2)])
def test_every_variant_and_split(emu, tokens, split):
    """K = 32 * 4 * split + 8: a full step for each of the split * k_warps (<= 4) warps of a row group, so every CTA of
    the cluster contributes, and a ragged last step; 41 rows over three weights (tiles span weights, a partial
    tile); 1, 2 and 8 n-tiles of tokens."""
    args = _case(tokens, 128 * split + 8, [5, 16, 20], seed=tokens * 10 + split)
    for variant in _variants(emu):
        _run_and_check(emu, args, variant=variant, split=split)


@pytest.mark.parametrize(("tokens", "split"), [(1, 1), (5, 3), (16, 2)])
@pytest.mark.parametrize("config", [0, 1, 2])
def test_register_streaming_tile(emu, config, tokens, split):
    """The register-streaming tile (linear/multi_linear_direct.cuh; the tune harness's candidate, not launched by the
    op) on the ring kernel's cases: K = 1000 (ragged last chunk, chunks split over every k-part of the cluster), 41
    rows over three weights (a tile spanning weights, a partial last tile whose missing rows are never read), 1 and
    2 token tiles, clusters of 1 to 3 CTAs."""
    args = _case(tokens, 1000, [5, 16, 20], seed=config * 10 + tokens)
    _run_and_check(emu, args, variant=config, split=split, direct=True)


def test_register_streaming_tile_fp16_and_small_k(emu):
    """fp16; K = 8 and 40 (fewer chunks than k-parts: parts without work); one row."""
    _run_and_check(emu, _case(7, 8, [1], dtype=torch.float16, seed=1), variant=0, split=2, direct=True)
    _run_and_check(emu, _case(9, 40, [33], dtype=torch.float16, seed=2), variant=2, split=3, direct=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_wraps_around(emu, dtype):
    """K = 2048 without a split: 64 steps, so every warp of every variant (at most 4 k-warps, at most 8 stages) runs
    more steps than its ring has stages and refills every slot."""
    args = _case(4, 2048, [24, 9], dtype=dtype, seed=3)
    for variant in _variants(emu):
        _run_and_check(emu, args, variant=variant, split=1)


@pytest.mark.parametrize(("k", "split"), [(8, 1), (8, 4), (40, 2), (96, 8)])
def test_small_k(emu, k, split):
    """K = 8 has no full step (one lane of four reads, only the last warp of the cluster works); more warps than
    steps leave warps without work."""
    args = _case(3, k, [17], seed=k + split)
    for variant in (0, 3):
        _run_and_check(emu, args, variant=variant, split=split)


def test_full_token_tile_and_fp16(emu):
    args = _case(64, 64, [7, 33], dtype=torch.float16, seed=11)
    for variant in (2, 4):
        _run_and_check(emu, args, variant=variant, split=2)


def test_many_segments(emu):
    """64 segments (a launch's maximum) of 1-3 rows: the binary search over segment ends."""
    counts = [1 + i % 3 for i in range(64)]
    args = _case(2, 32, counts, seed=5, pad_rows=1, with_bias=(True, False, False))
    _run_and_check(emu, args, variant=1, split=2)


def test_single_row(emu):
    args = _case(1, 16, [1], seed=6)
    _run_and_check(emu, args, variant=3, split=1)


def test_default_choices(emu):
    """The automatic split grows only while the tiles give fewer CTAs than half the SMs, and stops where a warp would
    get less than a ring of steps; the default variant goes by the group's 64-row tiles per SM (and K)."""
    assert emu.emu_auto_split(1, 24576, 4096, 132) == 1
    assert emu.emu_auto_split(1, 1024, 4096, 132) == 2
    assert emu.emu_auto_split(0, 4096, 4096, 132) == 2
    assert emu.emu_auto_split(0, 10240, 4096, 132) == 1
    assert emu.emu_auto_split(1, 1024, 256, 132) == 1
    assert emu.emu_default_variant(24576, 4096, 132) == 3  # gate/up: 2 x 2 warps sharing the activation
    assert emu.emu_default_variant(10240, 4096, 132) == 0  # KV of 5 layers: 64-row tiles
    assert emu.emu_default_variant(6144, 4096, 132) == 2  # q/k/v: 32-row tiles
    assert emu.emu_default_variant(4096, 12288, 132) == 0  # long rows: 64-row tiles, split K
    assert emu.emu_default_variant(1024, 4096, 132) == 1


GATE_DRIVER = r"""
#include "common/pdl.cuh"
extern "C" int emu_sync_launch(int major, int minor) { return dspark::sync_launch(major, minor) ? 1 : 0; }
"""


def test_pdl_and_clusters_only_where_the_sm90a_code_runs(tmp_path):
    """The host gate of programmatic dependent launch and clusters (`sync_launch`, common/pdl.cuh) is true for
    compute capability 9.0 alone; its premise is the build: SASS for sm_90a only, PTX only for an architecture
    below 9.0 (whose code has no dependency wait and no clusters). A build that adds SASS or PTX for another
    architecture must revisit the gate. Before, the launchers asked for both on every GPU of major >= 9."""
    gate = build(tmp_path, GATE_DRIVER, "gate")
    capabilities = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]
    assert [c for c in capabilities if gate.emu_sync_launch(*c)] == [(9, 0)]
    targets = [flag.removeprefix("-gencode=").split(",") for flag in _build.CUDA_FLAGS if flag.startswith("-gencode=")]
    codes = [code.removeprefix("code=") for _, code in targets]
    assert [c for c in codes if c.startswith("sm_")] == ["sm_90a"], codes
    ptx = [int(c.removeprefix("compute_").rstrip("af")) for c in codes if c.startswith("compute_")]
    assert ptx and all(arch < 90 for arch in ptx), codes
