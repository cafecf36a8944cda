"""The fibers the kernel emulations run CUDA threads on (`emulation_fibers.py`): each thread has its own
`threadIdx`, a barrier orders every write before every read across it, many times in a row, and a missing barrier
shows: without it, some threads read a neighbour's slot before the neighbour wrote it."""

import ctypes

import pytest
from dsv4_emulation_shim import SHIM
from emulation_build import compile_emulation

DRIVER = r"""
#include "cuda_runtime.h"
#include <vector>

// `blocks` launches of `threads` threads; per round each thread writes its slot, waits at the barrier (if
// `with_barrier`), then reads its right neighbour's slot. Returns reads of a wrong value; `stale` counts reads of
// the slot's value from before the round (the neighbour had not written yet).
extern "C" int neighbour_reads(int threads, int blocks, int rounds, int with_barrier, int* stale) {
  int wrong = 0;
  *stale = 0;
  for (int b = 0; b < blocks; ++b) {
    std::vector<int> slots(threads, -1), got(size_t(threads) * rounds, -2);
    EmuBarrier block(threads), after(threads);
    emu_launch_threads(size_t(threads), [&](size_t t) {
      g_block = &block;
      threadIdx.x = unsigned(t);
      for (int r = 0; r < rounds; ++r) {
        slots[threadIdx.x] = r * threads + int(threadIdx.x);
        if (with_barrier) __syncthreads();
        got[size_t(r) * threads + t] = slots[(threadIdx.x + 1) % threads];
        if (with_barrier) after.arrive_and_wait();  // the next round's write after every read of this one
      }
    });
    for (int r = 0; r < rounds; ++r) {
      for (int t = 0; t < threads; ++t) {
        const int value = got[size_t(r) * threads + t], want = r * threads + (t + 1) % threads;
        if (value == want) continue;
        if (value == (r == 0 ? -1 : (r - 1) * threads + (t + 1) % threads)) ++*stale;
        else ++wrong;
      }
    }
  }
  return wrong;
}
"""


@pytest.fixture(scope="module")
def lib(emulation_cache):
    return compile_emulation(emulation_cache, SHIM, DRIVER, "fibersemu")


def _reads(lib, threads: int, blocks: int, rounds: int, with_barrier: bool) -> tuple[int, int]:
    stale = ctypes.c_int(0)
    wrong = lib.neighbour_reads(threads, blocks, rounds, int(with_barrier), ctypes.byref(stale))
    return wrong, stale.value


@pytest.mark.parametrize("threads", [1, 32, 97, 512])
def test_barriers_order_writes_before_reads(lib, threads):
    assert _reads(lib, threads, blocks=2, rounds=50, with_barrier=True) == (0, 0)


def test_a_missing_barrier_shows_as_stale_reads(lib):
    wrong, stale = _reads(lib, 64, blocks=4, rounds=1, with_barrier=False)
    assert wrong == 0
    assert 0 < stale < 4 * 64, f"{stale} stale reads of {4 * 64}: the thread order did not vary"
