"""Byte layouts and shared math of the dspark ops (pure torch, any device; no op is registered here).

- `fp8`: FP8 e4m3 / UE8M0 scale math and the FlashMLA V4 paged-cache layout;
- `fp4`: FP4 e2m1 with UE8M0 group scales (the DeepSeek-V4 FP4 indexer cache);
- `rope`: interleaved RoPE tables (`precompute_freqs`) and the rotation;
- `norm`: the RMSNorm factor and the Walsh-Hadamard transform of the FlashMLA and DeepSeek-V4 ops.
"""
