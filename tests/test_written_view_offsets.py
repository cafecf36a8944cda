"""Ops writing into views of a larger buffer under `torch.compile(dynamic=True)`: the views keep their offsets.

Without `custom_ops._inductor_offsets`, Inductor (torch 2.11 to 2.13) gave a written view whose storage offset is
symbolic the offset 0: `fused_norm_rope_inplace(buf[1], ...)` wrote `buf[0]`, and `multi_linear_kv_write` into the
layers of a stacked cache buffer refused the call (its caches looked overlapping). Each case compiles for real
(Inductor's caches off, so the graph is lowered in this process) and compares every byte with eager.
"""

from __future__ import annotations

import pytest
import torch

import custom_ops
from custom_ops._inductor_offsets import storage_offset_lowering_registered

pytestmark = pytest.mark.slow  # real Inductor codegen

FREQS = custom_ops.precompute_freqs(64)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _norm_rope_second_half(buf, weight, freqs, positions) -> None:
    torch.ops.dspark.fused_norm_rope_inplace(buf[1], weight, 1e-6, freqs, positions)


def _kv_write_layer_one(x, buf, w, positions, loc) -> None:
    """Layer 1's K and V caches of a stacked [2, layers, S, heads, head_dim] buffer: views at offsets S-dependent."""
    torch.ops.dspark.multi_linear_kv_write(
        x, [w], [32], [None], [w], [64], [None], [None], [], [], positions, True,
        [buf[0, 1]], [buf[1, 1]], loc, None, 2, 16,
    )  # fmt: skip


def _compiled_equals_eager(fn, make_args) -> None:
    eager_args = make_args()
    compiled_args = [a.clone() for a in eager_args]
    before = [a.clone() for a in eager_args]
    fn(*eager_args)
    assert any(not torch.equal(a, b) for a, b in zip(eager_args, before, strict=True)), "eager wrote nothing"
    torch._dynamo.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        torch.compile(fn, fullgraph=True, dynamic=True)(*compiled_args)
    for got, want in zip(compiled_args, eager_args, strict=True):
        assert torch.equal(got, want)
    assert storage_offset_lowering_registered()


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_norm_rope_into_the_second_half_of_a_buffer(device):
    gen = torch.Generator().manual_seed(0)
    _compiled_equals_eager(
        _norm_rope_second_half,
        lambda: tuple(
            t.to(device)
            for t in (
                torch.randn(2, 3, 512, generator=gen),
                torch.randn(512, generator=gen),
                FREQS,
                torch.tensor([1, 2, 3]),
            )
        ),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_kv_write_into_one_layer_of_a_stacked_buffer(device):
    """bf16 on CUDA (the binding's dtypes), fp32 on CPU."""
    gen = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    _compiled_equals_eager(
        _kv_write_layer_one,
        lambda: (
            torch.randn(3, 32, generator=gen).to(device, dtype),
            torch.randn(2, 2, 12, 2, 16, generator=gen).to(device, dtype),
            torch.randn(96, 32, generator=gen).to(device, dtype),
            torch.arange(3, device=device),
            torch.tensor([4, -1, 7], device=device),
        ),
    )
