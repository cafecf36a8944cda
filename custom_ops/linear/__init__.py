"""The multi-weight GEMM ops that the `dspark_fx` passes emit.

- `multi_linear`: `dspark::multi_linear` (one activation times row ranges of several weights);
- `multi_linear_kv_write`: `dspark::multi_linear_kv_write` (N layers' K/V projection, norm, RoPE and cache write);
- `custom_ops/csrc/multi_linear*`: their CUDA bindings and kernels.
"""

from custom_ops.linear import multi_linear, multi_linear_kv_write  # noqa: F401  (registers the ops)
