"""The benchmarks' copy-engine read (benchmarks/bulk_read.cuh) run on the host by the kernel emulation
(tests/multi_linear_emulation_shim.py: bulk copies landing late and out of order on the mbarriers): every 32-bit word
of the buffer is added into the lanes' sums exactly once, for whole and ragged last stages, CTAs with several rounds of
the slot ring, CTAs with no stage, and both copy sizes of benchmarks/bulk_read.cu."""

from __future__ import annotations

import ctypes

import pytest
import torch
from multi_linear_emulation_shim import build

pytestmark = pytest.mark.slow  # builds a C++ library (seconds cold)

DRIVER = r"""
#include "bulk_read.cuh"
#include <memory>
#include <vector>

// The grid one CTA (of one warp) after the other, as the shim runs clusters.
template <int kBytes>
static void run(const char* p, int64_t n, int ctas, uint32_t* sums) {
  for (int c = 0; c < ctas; ++c) {
    EmuBarrier block(32), warp(32), cluster(32);
    std::vector<float> smem(dspark::kBulkSmemBytes / 4 + 16, NAN);
    std::vector<uint32_t> lanes(32 * 6);
    float* smem_ptr = smem.data();
    emu_launch_threads(32, [&](size_t i) {
      threadIdx.x = unsigned(i);
      blockIdx.x = unsigned(c);
      blockDim.x = 32;
      gridDim.x = unsigned(ctas);
      emu = EmuThread{&block, nullptr, &warp, &cluster, reinterpret_cast<uint32_t(*)[6]>(lanes.data()), smem_ptr,
                      &smem_ptr, unsigned(c), 0, 1};
      dspark::bulk_read_kernel<kBytes>(p, n, sums);
    });
  }
}

extern "C" int emu_bulk_read(const char* p, int64_t n, int ctas, int copy_bytes, uint32_t* sums) {
  switch (copy_bytes) {
    case 4096: run<4096>(p, n, ctas, sums); return 0;
    case 16384: run<16384>(p, n, ctas, sums); return 0;
    default: return 1;
  }
}
"""


@pytest.fixture(scope="module")
def emu(emulation_cache):
    lib = build(emulation_cache, DRIVER, "bulkreademu")
    lib.emu_bulk_read.restype = ctypes.c_int
    lib.emu_bulk_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return lib


@pytest.mark.parametrize(
    ("n_bytes", "ctas", "copy_bytes"),
    [
        (16384 * 20, 2, 16384),  # whole stages; ten per CTA: the ring of 8 slots goes round twice
        (16384 * 20 + 4112, 3, 4096),  # a ragged last stage of 4112 bytes: one copy of 4096 and one of 16
        (16384 * 3 + 48, 5, 16384),  # more CTAs than stages: one CTA reads none; a last stage of 48 bytes
        (16, 1, 4096),  # one 16-byte copy
    ],
)
def test_every_word_is_added_once(emu, n_bytes, ctas, copy_bytes):
    torch.manual_seed(n_bytes)
    words = torch.randint(-(2**31), 2**31 - 1, (n_bytes // 4,), dtype=torch.int32)
    sums = torch.full((32 * ctas,), -0x21524111, dtype=torch.int32)  # 0xDEADBEEF: a lane that writes nothing shows
    assert emu.emu_bulk_read(words.data_ptr(), n_bytes, ctas, copy_bytes, sums.data_ptr()) == 0
    assert sums.long().sum() % 2**32 == words.long().sum() % 2**32
    # each word to the lane that reads its 16-byte vector: vector v of a stage goes to lane v % 32
    stage_words = 16384 // 4
    stages = -(-n_bytes // 16384)
    expected = torch.zeros(32 * ctas, dtype=torch.int64)
    for cta in range(ctas):
        for stage in range(stages * cta // ctas, stages * (cta + 1) // ctas):
            part = words[stage * stage_words : (stage + 1) * stage_words].long().view(-1, 4).sum(1)
            expected.index_add_(0, 32 * cta + torch.arange(part.numel()) % 32, part)
    assert torch.equal(sums.long() % 2**32, expected % 2**32)
