"""The FlashMLA V4 write ops (`dspark::fused_k_norm_rope_flashmla` and friends).

- `writes`: schemas, fake impls, CPU references and argument checks;
- `custom_ops/csrc/flashmla_writes*.cu[h]`: the CUDA binding and kernels.
"""

from custom_ops.flashmla import writes  # noqa: F401  (registers the ops)
