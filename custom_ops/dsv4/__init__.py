"""The DeepSeek-V4 KV compressor ops (`dspark::dsv4_*`) and the user-facing `DSV4Compressor`.

- `common`: plan readers, argument checks and the ratio rule shared by the ops;
- `plan`: the planners (`dsv4_plan_*`);
- `compress`: offline c4 / c128 compression (`dsv4_compress_decode` / `_prefill`);
- `online`: online c128 compression (`dsv4_online_compress_*`);
- `store`: RMSNorm -> RoPE -> FP8 / FP4 store of compressed entries (`dsv4_compress_norm_rope_store`);
- `compressor`: `DSV4Compressor`, which ties them together (imported on demand);
- `custom_ops/csrc/dsv4/`: the CUDA bindings (`dsv4_*.cu`), kernels (`dsv4_*_kernels.cuh`) and the checking-mode
  plan-value checks (`dsv4_checks.h`).
"""

from custom_ops.dsv4 import compress, online, plan, store  # noqa: F401  (registers the ops)
