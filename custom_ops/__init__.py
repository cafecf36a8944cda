"""`import custom_ops` registers every `torch.ops.dspark.*` op: schemas, fake impls and CPU references."""

from custom_ops import _library, dsv4, flashmla, linear  # noqa: F401  (each family registers its ops)
from custom_ops._torch_range import warn_if_untested_torch
from custom_ops.checks import checks, checks_enabled, set_checks
from custom_ops.layouts.fp8 import dequantize_flashmla_cache, flashmla_page_bytes
from custom_ops.layouts.rope import precompute_freqs

warn_if_untested_torch()

__all__ = [
    "checks",
    "checks_enabled",
    "dequantize_flashmla_cache",
    "flashmla_page_bytes",
    "precompute_freqs",
    "set_checks",
]
