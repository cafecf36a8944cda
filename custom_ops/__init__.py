"""`import custom_ops` registers every `torch.ops.dspark.*` op: schemas, fake impls and CPU references."""

from custom_ops import (  # noqa: F401  (_library defines the dspark namespace first)
    _library,
    dsv4_compress,
    dsv4_compress_online,
    dsv4_compress_plan,
    dsv4_compress_store,
    flashmla_writes,
    multi_linear,
    multi_linear_kv_write,
)
from custom_ops._torch_range import warn_if_untested_torch
from custom_ops.checks import checks, checks_enabled, set_checks
from custom_ops.fp8_layout import dequantize_flashmla_cache, flashmla_page_bytes
from custom_ops.rope import precompute_freqs

warn_if_untested_torch()

__all__ = [
    "checks",
    "checks_enabled",
    "dequantize_flashmla_cache",
    "flashmla_page_bytes",
    "precompute_freqs",
    "set_checks",
]
