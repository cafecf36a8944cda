"""multi_linear's streaming kernel (custom_ops/csrc/linear/multi_linear_stream.cuh: the op's path for 1 to 8 blocks
of 16 output rows per SM at up to 16 tokens, also timed by benchmarks/multi_linear_tune.cu) run on the host by the
kernel emulation (tests/multi_linear_emulation_shim.py: bulk copies landing late and out of order on the mbarriers,
one fiber per thread) against the fp64 formula: the CTAs' shares of row blocks, the ring going round, ragged last
chunks, a partial last row block, row blocks spanning weights, biases, 1 and 2 token tiles, and which outputs are
written."""

from __future__ import annotations

import ctypes

import pytest
import torch
from multi_linear_cases import fp64_formula
from multi_linear_emulation_shim import build
from test_multi_linear_emulation import PARAMS_OF, _case, _check, _launch_args

pytestmark = pytest.mark.slow  # builds a C++ library (seconds cold)

DRIVER = (
    r"""
#include "linear/multi_linear_stream.cuh"
#include <memory>
#include <vector>
using namespace dspark::mlinear;
"""
    + PARAMS_OF
    + r"""
// The grid one CTA after the other, each with its producer and consumer warps at once.
template <typename T, int KC, int NT, int CW, int D>
static void run(const Params& p, int ctas) {
  constexpr int threads = 32 * (CW + 1);
  for (int c = 0; c < ctas; ++c) {
    EmuBarrier block(threads), cluster(threads), consumers(32 * CW);
    std::vector<std::unique_ptr<EmuBarrier>> warps;
    for (int w = 0; w <= CW; ++w) warps.push_back(std::make_unique<EmuBarrier>(32));
    EmuBarrier* named[1] = {&consumers};
    std::vector<float> smem(stream_smem_bytes<KC, NT, CW, D>() / 4 + 16, NAN);
    std::vector<uint32_t> lanes(size_t(threads) * 6);
    float* smem_ptr = smem.data();
    emu_launch_threads(threads, [&](size_t i) {
      threadIdx.x = unsigned(i);
      blockIdx.x = unsigned(c);
      blockDim.x = threads;
      gridDim.x = unsigned(ctas);
      const int w = int(i) / 32;
      emu = EmuThread{&block, named, warps[w].get(), &cluster,
                      reinterpret_cast<uint32_t(*)[6]>(&lanes[size_t(w) * 32 * 6]), smem_ptr, &smem_ptr,
                      unsigned(c), 0, 1};
      multi_linear_stream_kernel<T, KC, NT, CW, D>(p);
    });
  }
}

// Configuration 0: 64 columns per stage, 2 consumer warps, 2 stages; 1: 128 columns, 3 consumers, 3 stages.
template <typename T, int NT>
static void run_config(int config, const Params& p, int ctas) {
  if (config == 0) {
    run<T, 64, NT, 2, 2>(p, ctas);
  } else {
    run<T, 128, NT, 3, 3>(p, ctas);
  }
}

extern "C" void emu_stream(int bf16, int config, int ctas, int tokens, int k, const void* x, int64_t x_stride,
                           void* out, int64_t out_stride, int num_segments, const int64_t* segment_end,
                           const void* const* weight, const int64_t* weight_stride, const void* const* bias,
                           const int64_t* bias_stride) {
  const Params p = params_of(tokens, k, x, x_stride, out, out_stride, num_segments, segment_end, weight,
                             weight_stride, bias, bias_stride);
  if (bf16) {
    if (tokens <= 8) run_config<__nv_bfloat16, 1>(config, p, ctas); else run_config<__nv_bfloat16, 2>(config, p, ctas);
  } else {
    if (tokens <= 8) run_config<__half, 1>(config, p, ctas); else run_config<__half, 2>(config, p, ctas);
  }
}
"""
)


@pytest.fixture(scope="module")
def emu(emulation_cache):
    return build(emulation_cache, DRIVER, "mlstreamemu")


def _run(emu, args, *, config: int, ctas: int) -> None:
    x, weights, starts, counts, biases = args
    total = sum(counts)
    out = torch.full((x.shape[0], total + 5), float("nan"), dtype=x.dtype)  # 2 columns before, 3 after stay NaN
    emu.emu_stream(
        ctypes.c_int(x.dtype == torch.bfloat16),
        ctypes.c_int(config),
        ctypes.c_int(ctas),
        *_launch_args(x, weights, starts, counts, biases, out, 2),
    )
    _check(out[:, 2 : 2 + total], fp64_formula(*args))
    assert torch.isnan(out[:, :2]).all() and torch.isnan(out[:, 2 + total :]).all()


@pytest.mark.parametrize("config", [0, 1])
@pytest.mark.parametrize(("tokens", "k", "ctas"), [(1, 64, 1), (5, 200, 2), (9, 520, 3), (16, 136, 4)])
def test_stream_kernel(emu, config, tokens, k, ctas):
    """57 rows over three weights (row blocks spanning weights, a partial last block), K ragged against the stage's
    columns (and a multiple of them at K = 64), shares of 1 to 4 row blocks per CTA so the ring goes round."""
    args = _case(tokens, k, [9, 30, 18], seed=tokens + k + config)
    _run(emu, args, config=config, ctas=ctas)


def test_stream_kernel_fp16_more_ctas_than_blocks(emu):
    """fp16; 7 CTAs for 2 row blocks: the CTAs without a share return at once."""
    _run(emu, _case(3, 96, [20], dtype=torch.float16, seed=5), config=1, ctas=7)
