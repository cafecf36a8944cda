"""RMSNorm factor and Walsh-Hadamard transform shared by the FlashMLA write ops and the DeepSeek-V4 store.

Numerics shared by the CPU references and the CUDA kernels (they agree bit for bit except in rare rounding ties):
the sum of squares is accumulated in fp64 (exact for bf16/fp16 inputs, so independent of the reduction order),
`ms = fp32(sum / D)`, `nf = fp32(1 / sqrt(fp64(ms + eps)))` (fp32 `ms + eps`), every later product and sum is a
separately rounded fp32 operation (no FMA contraction). This deviates from sglang's `rsqrtf` on purpose: it makes
the reference and the kernel agree exactly, and it is more accurate.
"""

import torch

__all__ = ["rms_norm_factor", "walsh_hadamard"]


def rms_norm_factor(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 `1/sqrt(mean(x^2) + eps)` over the last dim (keepdim), with the fp64 steps described above."""
    ms = (x.double().square().sum(-1, keepdim=True) / x.shape[-1]).float()
    return torch.reciprocal(torch.sqrt((ms + eps).double())).float()


def walsh_hadamard(y: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform over the last dim (power of two), natural (Sylvester) order.

    Butterfly stages h = 1, 2, 4, ...: `(a, b) -> (a + b, a - b)` for element pairs `(i, i + h)`, `i & h == 0`,
    each a separately rounded fp32 operation in the same stage order as the CUDA kernels.
    """
    n = y.shape[-1]
    h = 1
    while h < n:
        v = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(y.shape)
        h *= 2
    return y
