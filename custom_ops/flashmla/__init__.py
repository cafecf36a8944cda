"""The FlashMLA V4 write ops (`dspark::fused_k_norm_rope_flashmla` and friends).

- `writes`: schemas, fake impls, CPU references and argument checks;
- `custom_ops/csrc/flashmla/`: the CUDA binding (`flashmla_writes.cu`) and kernels (`flashmla_writes_kernels.cuh`),
  on top of the device primitives of `custom_ops/csrc/common/layouts.cuh`.
"""

from custom_ops.flashmla import writes  # noqa: F401  (registers the ops)
