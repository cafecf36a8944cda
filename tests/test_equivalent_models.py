"""Models that write the same draft-KV path differently must fuse too (the pass is not tuned to our module).

`HFStyleDraft` differs from the reference on purpose: separate biased `k_proj`/`v_proj` (addmm), the norm weight
multiplied *after* the cast back to the model dtype (HF RMSNorm), `rotate_half` RoPE, and cos/sin computed in the
graph from positions and an `inv_freq` buffer.
"""

import pytest
import torch
from torch import nn

from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class HFRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class HFLayer(nn.Module):
    def __init__(self, hidden, kv_heads, head_dim):
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=True)
        self.k_norm = HFRMSNorm(head_dim)

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape))
        k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
        return k, self.v_proj(x).view(shape)


class HFStyleDraft(nn.Module):
    def __init__(self, layers=4, hidden=64, kv_heads=2, head_dim=16, theta=10000.0):
        super().__init__()
        self.layers = nn.ModuleList(HFLayer(hidden, kv_heads, head_dim) for _ in range(layers))
        self.register_buffer("inv_freq", theta ** -(torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, x, positions):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return [layer(x, cos, sin) for layer in self.layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hf_style_draft_fuses(dtype):
    torch._dynamo.reset()
    model = HFStyleDraft().to(dtype)
    capture = CaptureBackend()
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for tokens in (6, 11):
            x, positions = torch.randn(tokens, 64, dtype=dtype), torch.randint(0, 4096, (tokens,))
            assert_close_for_dtype(compiled(x, positions), model(x, positions), dtype)
    capture.assert_fused(n_groups=1, n_branches=[8])
    for before, after in zip(capture.before, capture.after, strict=True):
        assert op_counts(before)["aten.addmm"] == 8 and op_counts(after)["aten.addmm"] == 0
        assert op_counts(before)["aten.rsqrt"] == 4 and op_counts(after)["aten.rsqrt"] == 1
    (group,) = capture.reports[-1].groups
    assert sorted(len(c.branches) for c in group.classes) == [4, 4]
