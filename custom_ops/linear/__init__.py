"""The multi-weight GEMM ops that the `dspark_fx` passes emit.

- `multi_linear`: `dspark::multi_linear` (one activation times row ranges of several weights);
- `multi_linear_kv_write`: `dspark::multi_linear_kv_write` (N layers' K/V projection, norm, RoPE and cache write);
- `custom_ops/csrc/linear/`: their CUDA bindings (`multi_linear.cu`, `multi_linear_kv_write.cu`, sharing
  `multi_linear_host.h`) and kernels (`multi_linear_kernels.cuh`, `multi_linear_kv_write_kernels.cuh`,
  `multi_linear_kv_write_common.cuh`).
"""

from custom_ops.linear import multi_linear, multi_linear_kv_write  # noqa: F401  (registers the ops)
