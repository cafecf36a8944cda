"""`import custom_ops` registers every `torch.ops.dspark.*` op: schemas, fake impls and CPU references.

One package per op family, each with its C++ / CUDA sources in `custom_ops/csrc/<family>/`:

- `custom_ops.flashmla`: the FlashMLA V4 write ops (`writes`);
- `custom_ops.dsv4`: the DeepSeek-V4 compressor ops (`plan`, `compress`, `online`, `store`, `common`) and the
  `DSV4Compressor` module (`compressor`; also `custom_ops.DSV4Compressor`, imported on first access);
- `custom_ops.linear`: `multi_linear` and `multi_linear_kv_write`;
- `custom_ops.layouts`: what the families share, pure torch (FP8 / FP4 layouts, RoPE, norm and Hadamard math);
  `csrc/common/` is its C++ counterpart.

Beside them: `_library` (the `dspark` namespace and `register_op`, the one registration helper),
`_inductor_offsets` (the Inductor lowering that keeps the offsets of written views under dynamic shapes), `_build`
(build, cache and load the CUDA library; `build` is its `python -m custom_ops.build` command), `checks` (the opt-in
CUDA range checks) and `_torch_range` (the tested torch versions).
"""

from custom_ops import _library, dsv4, flashmla, linear  # noqa: F401  (each family registers its ops)
from custom_ops._torch_range import warn_if_untested_torch
from custom_ops.checks import checks, checks_enabled, set_checks
from custom_ops.layouts.fp8 import dequantize_flashmla_cache, flashmla_page_bytes
from custom_ops.layouts.rope import precompute_freqs

warn_if_untested_torch()

__all__ = [
    "DSV4Compressor",
    "checks",
    "checks_enabled",
    "dequantize_flashmla_cache",
    "flashmla_page_bytes",
    "precompute_freqs",
    "set_checks",
]


def __getattr__(name: str) -> object:
    """`custom_ops.DSV4Compressor`, imported on first access (an `nn.Module` most users of the ops never need)."""
    if name == "DSV4Compressor":
        from custom_ops.dsv4.compressor import DSV4Compressor

        return DSV4Compressor
    raise AttributeError(f"module 'custom_ops' has no attribute {name!r}")
