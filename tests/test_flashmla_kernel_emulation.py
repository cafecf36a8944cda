"""The FlashMLA-write / norm-RoPE CUDA kernels (`custom_ops/csrc/flashmla/flashmla_writes_kernels.cuh`), compiled for
the host with the CUDA shim of tests/dsv4_emulation_shim.py and run on CPU tensors.

This runs the kernels' own index handling without a GPU: rows whose slot or position is out of range (negative
positions, positions past the table, slots at or past the capacity, huge slot ids that would wrap in int64) must be
skipped exactly as the `*_reference` functions skip them, strided `positions` / `out_loc` must be read through their
strides, and every other byte must stay as it was. The arguments are packed like csrc/flashmla/flashmla_writes.cu packs
them, and the 16-byte-load or scalar-load variant of a kernel is picked by the same rule (unaligned rows run the
scalar one). GPU numerics (and the bindings) are checked by the CUDA tests.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from dsv4_emulation_shim import SHIM
from emulation_build import compile_emulation
from flashmla_cases import (
    ALL_OPS,
    HUGE,
    MUTATED,
    QUANTIZING_OPS,
    _assert_matches_reference,
    _break_rows,
    _inputs,
    _reference_result,
    _unused_slot,
    assert_same_non_finite_coding,
    plant_non_finite,
)

pytestmark = (
    pytest.mark.slow
)  # a kernel emulation builds a C++ library (seconds cold): the full run, or this file alone when editing a kernel

DRIVER = r"""
#include "flashmla/flashmla_writes_kernels.cuh"
#include <vector>
using namespace dspark;

// Blocks one after the other; each block's threads as fibers, one barrier per warp for the shuffles.
template <typename F>
static void launch(int64_t rows, F&& kernel) {
  for (int64_t b = 0; b < (rows + kWarpsPerBlock - 1) / kWarpsPerBlock; ++b) {
    EmuBarrier block(kThreads);
    std::vector<std::unique_ptr<EmuBarrier>> warps;
    std::vector<double> lanes(kThreads);
    for (int w = 0; w < kWarpsPerBlock; ++w) warps.push_back(std::make_unique<EmuBarrier>(32));
    emu_launch_threads(size_t(kThreads), [&](size_t t) {
      blockIdx.x = b; threadIdx.x = t;
      g_block = &block; g_warp = warps[t / 32].get(); g_lanes = &lanes[t / 32 * 32];
      kernel();
    });
  }
}

template <typename F>
static void with_dtype(int bf16, int vec, F&& f) {
  if (bf16 && vec) f(__nv_bfloat16{}, std::true_type{});
  if (bf16 && !vec) f(__nv_bfloat16{}, std::false_type{});
  if (!bf16 && vec) f(float{}, std::true_type{});
  if (!bf16 && !vec) f(float{}, std::false_type{});
}

extern "C" void emu_flashmla_write(int norm_rope, int bf16, int vec, const FlashMLAWriteArgs* a) {
  with_dtype(bf16, vec, [&](auto t, auto v) {
    using T = decltype(t);
    constexpr bool V = decltype(v)::value;
    launch(a->rows, [&] {
      if (norm_rope) flashmla_write_kernel<T, V, true>(*a); else flashmla_write_kernel<T, V, false>(*a);
    });
  });
}

extern "C" void emu_norm_rope(int weighted, int bf16, int vec, const NormRopeArgs* a) {
  with_dtype(bf16, vec, [&](auto t, auto v) {
    using T = decltype(t);
    constexpr bool V = decltype(v)::value;
    launch(a->rows, [&] { if (weighted) norm_rope_kernel<T, V, true>(*a); else norm_rope_kernel<T, V, false>(*a); });
  });
}

extern "C" void emu_indexer(int bf16, int vec, const IndexerArgs* a) {
  with_dtype(bf16, vec, [&](auto t, auto v) {
    using T = decltype(t);
    constexpr bool V = decltype(v)::value;
    launch(a->rows, [&] { indexer_q_kernel<T, V>(*a); });
  });
}
"""

_p, _i64, _f32, _b = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_bool


class _WriteArgs(ctypes.Structure):
    _fields_ = [  # the ctypes layout of FlashMLAWriteArgs
        ("kv", _p), ("kv_row_stride", _i64), ("weight", _p), ("eps", _f32), ("freqs", _p), ("max_pos", _i64),
        ("positions", _p), ("positions_stride", _i64), ("positions_64", _b), ("out_loc", _p),
        ("out_loc_stride", _i64), ("out_loc_64", _b), ("cache", _p), ("num_pages", _i64), ("page_bytes", _i64),
        ("log2_page_size", ctypes.c_int), ("rows", _i64),
    ]  # fmt: skip


class _NormRopeArgs(ctypes.Structure):
    _fields_ = [  # the ctypes layout of NormRopeArgs
        ("inp", _p), ("in_stride_b", _i64), ("in_stride_h", _i64), ("out", _p), ("out_stride_b", _i64),
        ("out_stride_h", _i64), ("heads", ctypes.c_int), ("rows", _i64), ("weight", _p), ("eps", _f32),
        ("freqs", _p), ("max_pos", _i64), ("positions", _p), ("positions_stride", _i64), ("positions_64", _b),
    ]  # fmt: skip


class _IndexerArgs(ctypes.Structure):
    _fields_ = [  # the ctypes layout of IndexerArgs
        ("q", _p), ("q_stride_b", _i64), ("q_stride_h", _i64), ("weight", _p), ("w_stride_b", _i64),
        ("w_stride_h", _i64), ("weight_scale", _f32), ("freqs", _p), ("max_pos", _i64), ("positions", _p),
        ("positions_stride", _i64), ("positions_64", _b), ("q_fp8", _p), ("weights_out", _p),
        ("heads", ctypes.c_int), ("rows", _i64),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def emu(emulation_cache):
    return compile_emulation(emulation_cache, SHIM, DRIVER, "flashmlaemu")


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _aligned16(t: torch.Tensor, strides: tuple[int, ...] = ()) -> bool:
    return _ptr(t) % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in strides)


def _vec(name, args) -> bool:
    """The binding's choice of the vector-load kernel over the scalar-load one: 16-byte-aligned row pointers and
    strides (and weight); the indexer loads 4 elements at a time, so it needs 4-element alignment."""
    if name in ("fused_k_norm_rope_flashmla", "store_flashmla_cache"):
        kv = args["kv"]
        return _aligned16(kv, (kv.stride(0),)) and ("weight" not in args or _aligned16(args["weight"]))
    if name == "fused_q_norm_rope":
        q, q_out = args["q"], args["q_out"]
        return _aligned16(q, q.stride()[:2]) and _aligned16(q_out, q_out.stride()[:2])
    if name == "fused_norm_rope_inplace":
        return _aligned16(args["kv"], (args["kv"].stride(0),)) and _aligned16(args["weight"])
    q = args["q"]
    return _ptr(q) % (4 * q.element_size()) == 0 and q.stride(0) % 4 == 0 and q.stride(1) % 4 == 0


def _table(args) -> dict:
    pos = args["positions"]
    return dict(
        freqs=_ptr(args["freqs"]),
        max_pos=args["freqs"].shape[0],
        positions=_ptr(pos),
        positions_stride=pos.stride(0),
        positions_64=pos.dtype == torch.int64,
    )


def _run_write(emu, name, args):
    kv, cache, loc, page_size = args["kv"], args["kvcache"], args["out_loc"], args["page_size"]
    norm_rope = name == "fused_k_norm_rope_flashmla"
    a = _WriteArgs(
        kv=_ptr(kv),
        kv_row_stride=kv.stride(0),
        out_loc=_ptr(loc),
        out_loc_stride=loc.stride(0),
        out_loc_64=loc.dtype == torch.int64,
        cache=_ptr(cache),
        num_pages=cache.shape[0],
        page_bytes=cache.shape[1],
        log2_page_size=page_size.bit_length() - 1,
        rows=kv.shape[0],
    )
    if norm_rope:
        for key, value in _table(args).items():
            setattr(a, key, value)
        a.weight, a.eps = _ptr(args["weight"]), args["eps"]
    emu.emu_flashmla_write(int(norm_rope), int(kv.dtype == torch.bfloat16), int(_vec(name, args)), ctypes.byref(a))


def _run_norm_rope(emu, name, args):
    weighted = name == "fused_norm_rope_inplace"
    src = args["kv"] if weighted else args["q"]
    dst = args["kv"] if weighted else args["q_out"]
    heads = 1 if weighted else src.shape[1]
    stride_h = (lambda t: 0) if weighted else (lambda t: t.stride(1))
    a = _NormRopeArgs(
        inp=_ptr(src),
        in_stride_b=src.stride(0),
        in_stride_h=stride_h(src),
        out=_ptr(dst),
        out_stride_b=dst.stride(0),
        out_stride_h=stride_h(dst),
        heads=heads,
        rows=src.shape[0] * heads,
        eps=args["eps"],
        weight=_ptr(args["weight"]) if weighted else 0,
        **_table(args),
    )
    emu.emu_norm_rope(int(weighted), int(src.dtype == torch.bfloat16), int(_vec(name, args)), ctypes.byref(a))


def _run_indexer(emu, args):
    q, weight = args["q"], args["weight"]
    b, h, _ = q.shape
    q_fp8 = torch.full((b, h, 128), 0x55, dtype=torch.uint8)  # poisoned: every byte must be written
    weights_out = torch.full((b, h, 1), float("nan"))
    a = _IndexerArgs(
        q=_ptr(q),
        q_stride_b=q.stride(0),
        q_stride_h=q.stride(1),
        weight=_ptr(weight),
        w_stride_b=weight.stride(0),
        w_stride_h=weight.stride(1),
        weight_scale=args["weight_scale"],
        q_fp8=_ptr(q_fp8),
        weights_out=_ptr(weights_out),
        heads=h,
        rows=b * h,
        **_table(args),
    )
    vec = _vec("fused_q_indexer_rope_hadamard_quant", args)
    emu.emu_indexer(int(q.dtype == torch.bfloat16), int(vec), ctypes.byref(a))
    return q_fp8.view(torch.float8_e4m3fn), weights_out


def _run_emulated(emu, name, args):
    """The kernel of op `name` on `args` (CPU tensors, mutated in place); returns what _run_cuda returns."""
    if name in ("fused_k_norm_rope_flashmla", "store_flashmla_cache"):
        _run_write(emu, name, args)
    elif name in ("fused_q_norm_rope", "fused_norm_rope_inplace"):
        _run_norm_rope(emu, name, args)
    else:
        return _run_indexer(emu, args)
    return args[MUTATED[name]]


def _case(name, b, seed, dtype, pos_dtype, loc_dtype):
    args = _inputs(name, b=b, seed=seed)
    for key, value in (("kv", dtype), ("q", dtype), ("positions", pos_dtype), ("out_loc", loc_dtype)):
        if key in args:
            args[key] = args[key].to(value)
    for key in ("weight", "q_out"):
        if key in args:
            args[key] = args[key].to(dtype)
    return args


def _unalign_rows(args):
    """Replace the row tensors (kv, q, q_out) by copies one element into a buffer with one spare element per row
    (row stride 513, or 129 for the indexer's q): neither pointer nor stride is aligned, so the binding runs the
    scalar-load kernel."""
    for key in ("kv", "q", "q_out"):
        if key in args:
            t = args[key]
            args[key] = torch.empty(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)[..., 1:]
            args[key].copy_(t)


@pytest.mark.parametrize("rows", ["aligned", "unaligned"])
@pytest.mark.parametrize("name", ALL_OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_emulated_kernels_skip_out_of_range_rows(emu, name, dtype, rows):
    """Negative / too large positions, slots at the capacity and a huge slot that would wrap onto an unused slot
    (int64 slots): the kernels skip exactly the rows the references skip; nothing else changes. Aligned rows run
    the 16-byte-load kernels, unaligned rows the scalar-load ones."""
    args = _case(name, 24, 11, dtype, torch.int64, torch.int64)
    if rows == "unaligned":
        _unalign_rows(args)
    assert _vec(name, args) == (rows == "aligned")
    valid = _break_rows(name, args)
    before = args[MUTATED[name]].clone() if name in MUTATED else None
    want = _reference_result(name, args)
    got = _run_emulated(emu, name, args)
    _assert_matches_reference(name, got, want, before, valid, args, allow_empty=False)


@pytest.mark.parametrize("name", ALL_OPS)
def test_emulated_kernels_read_strided_int32_indices(emu, name):
    """int32 `positions` / `out_loc` as strided column views, with out-of-range entries."""
    args = _case(name, 16, 12, torch.bfloat16, torch.int32, torch.int32)
    valid = torch.ones(16, dtype=torch.bool)
    if "positions" in args:
        args["positions"][[2, 9]] = torch.tensor([-3, 2**31 - 1], dtype=torch.int32)
        valid[[2, 9]] = False
    if "out_loc" in args:
        args["out_loc"][11] = 2**31 - 1
        valid[11] = False
    for key in ("positions", "out_loc"):
        if key in args:
            args[key] = torch.stack([args[key], torch.zeros_like(args[key])], 1)[:, 0]
    before = args[MUTATED[name]].clone() if name in MUTATED else None
    want = _reference_result(name, args)
    got = _run_emulated(emu, name, args)
    _assert_matches_reference(name, got, want, before, valid, args, allow_empty=False)


@pytest.mark.parametrize("huge", [HUGE, 2**63 - 1])
def test_emulated_huge_slot_does_not_wrap(emu, huge):
    args = _case("store_flashmla_cache", 8, 13, torch.float32, torch.int64, torch.int64)
    args["out_loc"][1] = huge + _unused_slot(args) if huge == HUGE else huge
    valid = torch.ones(8, dtype=torch.bool)
    valid[1] = False
    before = args["kvcache"].clone()
    want = _reference_result("store_flashmla_cache", args)
    got = _run_emulated(emu, "store_flashmla_cache", args)
    _assert_matches_reference("store_flashmla_cache", got, want, before, valid, args, allow_empty=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", QUANTIZING_OPS)
def test_emulated_quantizers_code_non_finite_values_as_the_reference(emu, name, dtype):
    """NaN and infinities in a row (flashmla_cases.plant_non_finite): the kernel writes the reference's exponent
    bytes and codes the same values, NaN where the reference has NaN."""
    args = _case(name, 8, 15, dtype, torch.int64, torch.int64)
    rows = plant_non_finite(args)
    want = _reference_result(name, args)
    got = _run_emulated(emu, name, args)
    assert_same_non_finite_coding(name, got, want, args, rows)
