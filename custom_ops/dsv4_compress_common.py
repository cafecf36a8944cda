"""Shared helpers of the DeepSeek-V4 compressor ops: plan field readers and argument checks.

The readers turn the uint8 plan bytes of spec §4.1 (see `dsv4_compress_plan`) into int64 columns with a
validity mask; they are used by the CPU references, the store op and the tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FLT_MAX = torch.finfo(torch.float32).max
HEAD_DIMS = (128, 512)
STATE_DTYPES = (torch.float32, torch.bfloat16)
INPUT_DTYPES = (torch.float32, torch.bfloat16)


class DecodeRows(NamedTuple):
    """DecodePlan columns (int64); `valid` marks rows with a non-negative write_loc."""

    seq_len: torch.Tensor
    write_loc: torch.Tensor
    read_page_0: torch.Tensor
    read_page_1: torch.Tensor
    valid: torch.Tensor


class CompressRows(NamedTuple):
    """CompressPlan columns (int64); `valid` marks rows whose seq_len is not 0xFFFFFFFF."""

    seq_len: torch.Tensor
    ragged_id: torch.Tensor
    buffer_len: torch.Tensor
    read_page_0: torch.Tensor
    read_page_1: torch.Tensor
    valid: torch.Tensor


class WriteRows(NamedTuple):
    """WritePlan columns (int64); `valid` marks rows with a valid ragged id and a non-negative write_loc."""

    ragged_id: torch.Tensor
    write_loc: torch.Tensor
    valid: torch.Tensor


def _words(plan: torch.Tensor, width: int) -> torch.Tensor:
    return plan.contiguous().view(torch.int32).reshape(-1, width // 4).long()


def read_decode_plan(plan: torch.Tensor) -> DecodeRows:
    w = _words(plan, 16)
    seq = w[:, 0] & 0xFFFFFFFF
    return DecodeRows(seq, w[:, 1], w[:, 2], w[:, 3], w[:, 1] >= 0)


def read_compress_plan(plan: torch.Tensor) -> CompressRows:
    w = _words(plan, 16)
    seq = w[:, 0] & 0xFFFFFFFF
    return CompressRows(seq, w[:, 1] & 0xFFFF, (w[:, 1] >> 16) & 0xFFFF, w[:, 2], w[:, 3], seq != 0xFFFFFFFF)


def read_write_plan(plan: torch.Tensor) -> WriteRows:
    w = _words(plan, 8)
    return WriteRows(w[:, 0], w[:, 1], (w[:, 0] >= 0) & (w[:, 1] >= 0))


def check_plan(name: str, plan: torch.Tensor, width: int, device: torch.device) -> None:
    if plan.dtype != torch.uint8:
        raise TypeError(f"{name}: expected uint8 plan bytes, got {plan.dtype}")
    if plan.dim() != 2 or plan.shape[1] != width or not plan.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous [rows, {width}] uint8 tensor, got shape {tuple(plan.shape)}")
    check_device(name, plan, device)


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")


def check_matrix(name: str, t: torch.Tensor, cols: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """A 2-D tensor with `cols` columns, unit inner stride and one of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected {names}, got {t.dtype}")
    if t.dim() != 2 or t.shape[1] != cols:
        raise ValueError(f"{name}: expected shape [rows, {cols}], got {tuple(t.shape)}")
    if cols > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit stride in the last dim, got strides {t.stride()}")


def check_head_dim(ape: torch.Tensor, rows: int) -> int:
    """Validate `ape` ([rows, D] fp32, D in HEAD_DIMS) and return D."""
    if not isinstance(ape, torch.Tensor) or ape.dtype != torch.float32:
        raise TypeError(f"ape: expected an fp32 tensor, got {getattr(ape, 'dtype', type(ape).__name__)}")
    if ape.dim() != 2 or ape.shape[0] != rows or ape.shape[1] not in HEAD_DIMS:
        raise ValueError(f"ape: expected shape [{rows}, D] with D in {HEAD_DIMS}, got {tuple(ape.shape)}")
    return ape.shape[1]
