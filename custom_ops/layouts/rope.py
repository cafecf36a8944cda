"""Interleaved (GPT-J style) RoPE for DeepSeek-V4: the frequency table the ops take, and the rotation itself.

The ops take a real fp32 table `freqs` of shape (max_pos, rope_dim) laid out `[cos0, sin0, cos1, sin1, ...]`;
row `positions[b]` rotates pair j `(r[2j], r[2j+1])` of token b:
`r'[2j] = r[2j]*c - r[2j+1]*s`, `r'[2j+1] = r[2j]*s + r[2j+1]*c` with `(c, s) = (freqs[p, 2j], freqs[p, 2j+1])`.
Positions have no sentinel: a position outside `[0, max_pos)` is out of range (`rope_table_rows` reports it).
"""

import math

import torch

__all__ = ["apply_rope_interleaved", "precompute_freqs", "rope_table_rows"]


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, original_seq_len: int) -> float:
    return dim * math.log(original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def precompute_freqs(
    max_pos: int,
    dim: int = 64,
    base: float = 10000.0,
    *,
    original_seq_len: int = 0,
    factor: float = 1.0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The fp32 (max_pos, dim) interleaved cos/sin table of DeepSeek-V4 (unit magnitude, no mscale).

    Plain RoPE: `f_j = base^(-2j/dim)`. YaRN when `original_seq_len > 0`: with
    `low = floor(corr(beta_fast))`, `high = ceil(corr(beta_slow))` clamped to [0, dim-1] where
    `corr(r) = dim*ln(original_seq_len/(r*2*pi)) / (2*ln(base))`, `ramp_j = clamp((j-low)/(high-low), 0, 1)`
    (`high += 0.001` if equal) and `f_j <- f_j/factor * ramp_j + f_j * (1-ramp_j)`.
    Uses: non-compressed layers `base=rope_theta` plain; compressed layers `base=compress_rope_theta` with YaRN.
    """
    if max_pos < 0 or dim <= 0 or dim % 2:
        raise ValueError(f"need max_pos >= 0 and an even dim > 0, got max_pos={max_pos}, dim={dim}")
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if original_seq_len > 0:
        low = max(math.floor(_yarn_correction_dim(beta_fast, dim, base, original_seq_len)), 0)
        high = min(math.ceil(_yarn_correction_dim(beta_slow, dim, base, original_seq_len)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=device), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(cis).flatten(-2).contiguous()


def apply_rope_interleaved(r: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
    """Rotate fp32 `r` (..., 2k) by fp32 `table_rows` (..., 2k) (rows of `freqs` already gathered).

    Every product and sum is a separately rounded fp32 operation, the order the CUDA kernels use.
    """
    c, s = table_rows[..., 0::2], table_rows[..., 1::2]
    re, im = r[..., 0::2], r[..., 1::2]
    return torch.stack([re * c - im * s, re * s + im * c], dim=-1).flatten(-2)


def rope_table_rows(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather `freqs[positions]` without wrapping: returns the rows (N, dim) and a bool (N,) mask of the positions
    inside `[0, max_pos)`. Rows of out-of-range positions are zeros (nothing is read through a negative or too
    large index), so callers can skip those rows. No host sync; works for an empty table."""
    pos = positions.long()
    valid = (pos >= 0) & (pos < freqs.shape[0])
    if freqs.shape[0] == 0:
        return freqs.new_zeros(pos.shape[0], freqs.shape[1]), valid
    rows = freqs[torch.where(valid, pos, 0)]
    return torch.where(valid[:, None], rows, 0.0), valid
