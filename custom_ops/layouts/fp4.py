"""FP4 e2m1 with UE8M0 group scales, and the DeepSeek-V4 indexer cache's FP4 page layout (pure torch, any device).

This module is the single source of truth for the FP4 indexer store (`dsv4_compress_norm_rope_store(fp4=True)`);
the CUDA kernel reproduces it bit for bit.

Quantization of a row of D values (D a multiple of 32; the indexer's D = 128 after its Hadamard transform):
- groups of 32 consecutive values; per group `sraw = max(amax, 1e-4) / 6` (fp32) and the UE8M0 exponent byte
  `e = ue8m0_exponent(sraw)`, rounded up as for the FP8 tiles (`custom_ops.layouts.fp8`), so `2^(e-127) >= sraw`;
- `v = min(|y| * 2^(127-e), 6)` (exact: a power-of-two scale); the code's magnitude is the number of the
  thresholds (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0) strictly below `v`, i.e. the nearest e2m1 value of
  (0, 0.5, 1, 1.5, 2, 3, 4, 6) with ties going to the smaller one; bit 0x8 is the sign, set only for a negative
  value with a nonzero magnitude (no negative zero); non-finite values as for the FP8 tiles (`finite_amax`: the
  scale stays finite), an infinity coded +-6 and a NaN 0 (e2m1 has no NaN);
- two codes per byte, the even element in the low nibble.

Page of `68 * page_size` bytes for slot `loc` (`page = loc // page_size`, `o = loc % page_size`):

| bytes (relative to the page)  | content                                      |
|-------------------------------|----------------------------------------------|
| `o*64 + [0, 64)`              | 128 e2m1 codes, two per byte                 |
| `page_size*64 + o*4 + [0, 4)` | 4 UE8M0 exponents, one per group of 32       |

Decoding: `e2m1_value(code) * 2^(e-127)`.
"""

import torch

from custom_ops.layouts.fp8 import finite_amax, ue8m0_exponent, ue8m0_inverse_scale, ue8m0_scale

E2M1_MAX = 6.0
E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_GROUP = 32
SIGN_BIT = 0x8

__all__ = [
    "E2M1_MAX",
    "E2M1_THRESHOLDS",
    "E2M1_VALUES",
    "FP4_GROUP",
    "dequantize_groups_e2m1",
    "quantize_groups_e2m1",
]


def quantize_groups_e2m1(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `y` (N, D) fp32, D a multiple of 32, to packed e2m1 codes with one UE8M0 exponent per 32 values.

    Returns `(codes, exponents)`: uint8 (N, D / 2), two codes per byte (even element low), and uint8 (N, D / 32).
    """
    n, d = y.shape
    if d % FP4_GROUP:
        raise ValueError(f"y: expected a width that is a multiple of {FP4_GROUP}, got {d}")
    groups = y.to(torch.float32).reshape(n, d // FP4_GROUP, FP4_GROUP)
    exponent = ue8m0_exponent(finite_amax(groups, -1) / E2M1_MAX)
    v = (groups.abs() * ue8m0_inverse_scale(exponent)[..., None]).clamp(max=E2M1_MAX)
    thresholds = torch.tensor(E2M1_THRESHOLDS, dtype=torch.float32, device=y.device)
    magnitude = (v[..., None] > thresholds).sum(-1)
    code = (magnitude | torch.where((groups < 0) & (magnitude > 0), SIGN_BIT, 0)).reshape(n, d).to(torch.uint8)
    return code[:, 0::2] | (code[:, 1::2] << 4), exponent.to(torch.uint8)


def dequantize_groups_e2m1(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_groups_e2m1`: fp32 (N, D) from uint8 codes (N, D / 2) and exponents (N, D / 32)."""
    code = torch.stack([codes & 0xF, codes >> 4], -1).flatten(1).long()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[code & 0x7]
    values = torch.where((code & SIGN_BIT) != 0, -values, values)
    return values * ue8m0_scale(exponents).repeat_interleave(FP4_GROUP, 1)
