"""Value-range checks of the `dspark` ops: always on CPU, opt-in on CUDA (they need a host sync there); and the
layout tests the families' structural checks share: `is_aligned`, `overlaps_itself`, `share_memory`,
`check_no_shared_memory`.

The contract (docs/contract.md): structural checks (types, dtypes, shapes, strides, devices, scalar arguments)
always raise before anything is modified, on every device. Index *values* (slots, positions, request ids) are
checked differently by device, because reading them on CUDA costs a host sync and breaks CUDA-graph capture:

- CPU: an out-of-range entry raises `ValueError` (`"<arg>[<i>] = <v> is out of range: <valid range>"`) before
  any write;
- CUDA: rows whose index is out of range are skipped by the kernels (nothing written, nothing read through a
  wrapped index);
- CUDA with checks on (`set_checks(True)`, `with checks():` or `DSPARK_CHECKS=1` in the environment): the CUDA
  bindings validate the same ranges with a host sync before launching and raise the CPU path's error. Checks are
  skipped while the current stream is capturing a CUDA graph (a sync is not allowed there) and for fake tensors.

The flag lives in two places, Python (`checks_enabled`, for the CPU-side wrappers) and the loaded CUDA library
(`dspark_set_checks`, read by every binding); `set_checks` keeps them equal, and `_build` pushes the flag into
the library when it loads it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, guard_or_false
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["check_index_range", "checks", "checks_enabled", "is_aligned", "must_check_values", "set_checks"]

_enabled = os.environ.get("DSPARK_CHECKS", "0").strip().lower() not in ("", "0", "false", "off", "no")
_native: ctypes.CDLL | None = None


def checks_enabled() -> bool:
    """Whether CUDA calls validate index ranges (with a host sync). CPU calls always do."""
    return _enabled


def set_checks(enabled: bool) -> None:
    """Turn the CUDA range checks on or off for the whole process (the CPU path always checks)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_checks: enabled must be a bool, got {type(enabled).__name__}")
    _enabled = enabled
    if _native is not None:
        _native.dspark_set_checks(ctypes.c_bool(enabled))


@contextmanager
def checks(enabled: bool = True) -> Iterator[None]:
    """`with custom_ops.checks():` runs its body with the CUDA range checks on, then restores the old setting."""
    old = _enabled
    set_checks(enabled)
    try:
        yield
    finally:
        set_checks(old)


def attach_native(library: Path) -> None:
    """Called by `_build` once the CUDA library is loaded: hand it the current flag."""
    global _native
    _native = ctypes.CDLL(str(library))
    _native.dspark_set_checks.argtypes = [ctypes.c_bool]
    _native.dspark_set_checks(ctypes.c_bool(_enabled))


def must_check_values(t: torch.Tensor) -> bool:
    """Whether a Python impl must validate index values of `t`: real CPU tensors always, CUDA tensors in checking
    mode outside graph capture, never fake or meta tensors."""
    if isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta":
        return False
    if t.device.type == "cpu":
        return True
    return _enabled and not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def check_index_range(
    name: str, index: torch.Tensor, hi: int, what: str, *, negative_skips: bool = True, wrap: bool = False
) -> None:
    """Raise `ValueError` for the first entry of `index` outside `[0, hi)` (negative entries are allowed when
    `negative_skips`: they mean "skip this row"; with `wrap` the range is `[-hi, hi)`, a negative entry counting from
    the end as in Python indexing). `what` describes the valid range for the message.

    The CUDA bindings raise the same message (`csrc/common/range_checks.h`). The caller decides whether to check
    (`must_check_values`)."""
    values = index.long()
    low = -hi if wrap else None if negative_skips else 0
    bad = values >= hi if low is None else (values < low) | (values >= hi)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        label = ", ".join(str(i) for i in where)
        raise ValueError(f"{name}[{label}] = {int(values[tuple(where)])} is out of range: {what}")


def is_aligned(t: torch.Tensor, alignment: int) -> bool:
    """Whether `t`'s first element is `alignment`-byte aligned, judged from its storage offset (torch's allocators
    align every storage to at least 16 bytes, and a fake tensor has no address): the CUDA bindings check the
    address itself, which agrees for every tensor torch allocated, so CPU, fake and CUDA raise alike."""
    return t.storage_offset() * t.element_size() % alignment == 0


def overlaps_itself(t: torch.Tensor) -> bool:
    """Sufficient test of internal overlap: in order of increasing stride, every dim steps past the whole block
    spanned by the dims before it (a broadcast or otherwise self-overlapping view fails it)."""
    span = 1
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1):
        if stride < span:
            return True
        span += (size - 1) * stride
    return False


def _offsets_meet(delta: int, dims: Sequence[tuple[int, int]]) -> bool:
    """Whether `delta == sum(d_k * stride_k)` for some `|d_k| < size_k`, dims `(stride, size)` by decreasing stride.
    For a layout that does not overlap itself each stride exceeds the reach of the dims after it, so at most two
    digits fit each level."""
    if not dims:
        return delta == 0
    (stride, size), inner = dims[0], dims[1:]
    reach = sum((n - 1) * s for s, n in inner)
    lo = max(-(size - 1), -((reach - delta) // stride))
    hi = min(size - 1, (delta + reach) // stride)
    return any(_offsets_meet(delta - d * stride, inner) for d in range(lo, hi + 1))


def check_no_shared_memory(name: str, written: torch.Tensor, inputs: Iterable[tuple[str, torch.Tensor]]) -> None:
    """`written` (a tensor the op writes) shares no byte with any of `inputs` (tensors it reads meanwhile), else
    `ValueError` (`share_memory`: storages, offsets and strides, so a fake tensor answers as a real one). The CUDA
    bindings raise the same message (`csrc/common/memory_overlap.h`)."""
    for other, t in inputs:
        if share_memory(written, t):
            raise ValueError(
                f"{name}: must not share memory with {other} (the op writes {name} while it reads {other})"
            )


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements of one storage in one layout (an op writing `a` in place of `b`;
    the stride of a dim of size 1 is no part of the layout)."""
    if StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()) or a.dim() != b.dim():
        return False
    pairs = [(a.storage_offset(), b.storage_offset()), *zip(a.shape, b.shape, strict=True)]
    pairs += [(sa, sb) for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True) if not guard_or_false(n == 1)]
    return all(guard_or_false(x == y) for x, y in pairs)


def share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` have a byte in common. Exact for two views of one storage with the same element size,
    shape and strides (e.g. the K and V halves of an interleaved `[S, 2, heads, head_dim]` buffer, or the layers of a
    stacked one); for other pairs in one storage, whether their byte ranges intersect (storage offsets and strides
    count elements of each tensor's own size). Works on fake tensors (the storage identity is `StorageWeakRef`, no
    data pointer is read); a size not known at compile time (a data-dependent token count) is taken as nonzero."""
    if StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
        return False
    if guard_or_false(a.numel() == 0) or guard_or_false(b.numel() == 0):
        return False
    if free_unbacked_symbols((a.shape, a.stride(), a.storage_offset(), b.shape, b.stride(), b.storage_offset())):
        return False  # a data-dependent size (fake tensors): the real call decides, by the same rule
    a_lo, b_lo = a.storage_offset(), b.storage_offset()
    a_hi = a_lo + sum((n - 1) * s for n, s in zip(a.shape, a.stride(), strict=True))
    b_hi = b_lo + sum((n - 1) * s for n, s in zip(b.shape, b.stride(), strict=True))
    a_size, b_size = a.element_size(), b.element_size()
    if a_size != b_size:
        return a_lo * a_size < (b_hi + 1) * b_size and b_lo * b_size < (a_hi + 1) * a_size
    if a_hi < b_lo or b_hi < a_lo:
        return False
    if a.shape != b.shape or a.stride() != b.stride() or overlaps_itself(a):
        return True
    dims = sorted(((s, n) for n, s in zip(a.shape, a.stride(), strict=True) if n > 1), reverse=True)
    return _offsets_meet(b_lo - a_lo, dims)
