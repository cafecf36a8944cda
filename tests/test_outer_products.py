"""`passes/outer_products.py`: a matmul that sums over one element becomes a broadcast multiply with the same
bits, and nothing else does."""

import copy
import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dspark_fx import DsparkConfig
from dspark_fx.passes.outer_products import multiply_outer_products, rounds_fp32_matmul_inputs
from dspark_fx.testing import CaptureBackend, op_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
spellings = importlib.import_module("_spellings")

HEAD_DIM = 16
# |cos(a) - cos(a')| for the angle's own rounding, positions < 8192: fp32 ulp(8192) / 2, bf16's (the bf16 angle is
# rounded once more)
ANGLE_TOL = {torch.float32: 1e-3, torch.bfloat16: 64.0}


def hf_emb(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """HF transformers' RoPE angles: `inv_freq @ position_ids`, transposed, duplicated."""
    inv = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
    freqs = (inv @ position_ids[:, None, :].to(inv.dtype)).transpose(1, 2)
    return torch.cat((freqs, freqs), dim=-1)


def hf_angles(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """HF transformers' RoPE cos of those angles."""
    return hf_emb(inv_freq, position_ids).cos()


def outer(column: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return torch.mm(column, row) + 1


def _inv_freq(dtype: torch.dtype) -> torch.Tensor:
    exponents = torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM
    return (1.0 / (10000.0**exponents)).to(dtype)


def _positions(batch: int, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 8192, (batch, tokens), generator=gen)


def _rewritten(fn, *args):
    """`fn` traced to ATen (fake tensors), before and after the rewrite, and what the rewrite reported."""
    before = make_fx(fn, tracing_mode="fake")(*args)
    after = copy.deepcopy(before)
    replaced = multiply_outer_products(after.graph)
    after.graph.lint()
    after.recompile()
    return before, after, replaced


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_hf_rope_angles_become_a_multiply_with_the_same_bits(tokens, batch, dtype):
    inv_freq, positions = _inv_freq(dtype), _positions(batch, tokens, seed=tokens)
    before, after, replaced = _rewritten(hf_angles, inv_freq, positions)
    assert op_counts(before.graph)["aten.bmm"] == 1
    assert op_counts(after.graph)["aten.bmm"] == 0, after.graph
    assert replaced == [f"bmm [{batch}, {HEAD_DIM // 2}, 1] @ [{batch}, 1, {tokens}]"]
    for seed in range(3):
        positions = _positions(batch, tokens, seed)
        expected = hf_angles(inv_freq, positions)
        got = after(inv_freq, positions)
        assert got.stride() == expected.stride()
        assert torch.equal(got, expected)
        assert torch.allclose(got.double(), hf_angles(inv_freq.double(), positions), atol=ANGLE_TOL[dtype])


def test_an_mm_outer_product_becomes_a_multiply():
    column, row = torch.randn(5, 1), torch.randn(1, 3)
    _, after, replaced = _rewritten(outer, column, row)
    assert replaced == ["mm [5, 1] @ [1, 3]"]
    assert op_counts(after.graph)["aten.mm"] == 0
    assert torch.equal(after(column, row), outer(column, row))


def test_products_over_more_than_one_element_stay():
    _, after, replaced = _rewritten(outer, torch.randn(5, 2), torch.randn(2, 3))
    assert replaced == [] and op_counts(after.graph)["aten.mm"] == 1


def test_fp32_products_stay_where_matmuls_may_use_tf32():
    """With `set_float32_matmul_precision("high")` an fp32 matmul may round its inputs first, a multiply does not:
    fp32 products stay; bf16 ones (no TF32) are still rewritten."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        _, _, fp32 = _rewritten(hf_angles, _inv_freq(torch.float32), _positions(1, 4, 0))
        _, _, bf16 = _rewritten(hf_angles, _inv_freq(torch.bfloat16), _positions(1, 4, 0))
    finally:
        torch.set_float32_matmul_precision(previous)
    assert fp32 == [] and len(bf16) == 1


def test_fp32_products_stay_under_a_backend_precision_setting():
    """`torch.backends.mkldnn.matmul.fp32_precision = "bf16"` (the per-backend API, under which the legacy
    `get_float32_matmul_precision` raises): fp32 products stay, the rewrite does not fail; "ieee" rewrites them."""
    matmul = torch.backends.mkldnn.matmul
    previous = matmul.fp32_precision
    try:
        matmul.fp32_precision = "bf16"
        _, _, rounding = _rewritten(outer, torch.randn(5, 1), torch.randn(1, 3))
        matmul.fp32_precision = "ieee"
        _, _, exact = _rewritten(outer, torch.randn(5, 1), torch.randn(1, 3))
    finally:
        matmul.fp32_precision = previous
    assert rounding == [] and exact == ["mm [5, 1] @ [1, 3]"]


def test_a_cuda_precision_setting_leaves_cpu_products_rewritten():
    """`torch.backends.cuda.matmul.fp32_precision = "tf32"` alone (the legacy getter then raises): a CPU fp32
    matmul inherits the generic IEEE setting, so CPU products are still rewritten; CUDA ones would stay."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        _, _, replaced = _rewritten(outer, torch.randn(5, 1), torch.randn(1, 3))
        cuda_rounds = rounds_fp32_matmul_inputs("cuda")
    finally:
        matmul.fp32_precision = previous
    assert replaced == ["mm [5, 1] @ [1, 3]"] and cuda_rounds


def test_a_product_whose_multiply_would_have_other_strides_stays():
    """A transposed batch-major left operand: the multiply's result would be laid out like it, the matmul's is
    contiguous; a view of the result after the graph would see other elements, so the matmul stays."""
    left = torch.randn(3, 2, 1).permute(1, 0, 2)  # [2, 3, 1], strides (1, 2, 1)
    right = torch.randn(2, 1, 4)
    assert (left * right).stride() != torch.bmm(left, right).stride()
    _, after, replaced = _rewritten(torch.bmm, left, right)
    assert replaced == [] and op_counts(after.graph)["aten.bmm"] == 1


class Angles(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return hf_emb(self.inv_freq, positions)


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
def test_through_inductor_codegen_with_the_backend(enabled):
    """`dspark_backend` with Inductor codegen on CPU, T = 1 and T > 1: the angles have the bits of eager's; no
    `bmm` is left where the rewrite is on. (Inductor from torch 2.13 decomposes such a `bmm` itself before the pass
    sees it, and the counter stays 0; on torch 2.11 the pass does it.)"""
    torch._dynamo.reset()
    model = Angles(torch.float32)
    capture = CaptureBackend(DsparkConfig(outer_products=enabled), inner="inductor")
    compiled = torch.compile(model, backend=capture)
    counters = torch._dynamo.utils.counters["dspark_fx"]
    start = counters["outer_products_multiplied"]
    for tokens in (1, 9, 17):
        positions = _positions(1, tokens, tokens)
        assert torch.equal(compiled(positions), model(positions))
    multiplied = counters["outer_products_multiplied"] - start
    bmms_before = sum(op_counts(g)["aten.bmm"] for g in capture.before)
    bmms_after = sum(op_counts(g)["aten.bmm"] for g in capture.after)
    assert bmms_after == (0 if enabled else bmms_before)
    assert multiplied == (bmms_before if enabled else 0)
    assert sum(len(r.outer_products) for r in capture.reports) == multiplied


@pytest.mark.cuda
@pytest.mark.usefixtures("builds_cuda_library")
def test_hf_spelling_on_cuda_computes_its_angles_in_the_rope_kernels():
    """The HF draft writer on CUDA, not lowered, through Inductor codegen: its one `inv_freq @ position_ids` per
    graph becomes a multiply, and the caches equal eager's to bf16 tolerance."""
    from test_spellings import _matches_eager_on_cuda

    capture = _matches_eager_on_cuda("hf", DsparkConfig(kv_write_op="never"))
    for report in capture.reports:
        (product,) = report.outer_products  # a bmm, or the mm Inductor makes of a batch of one
        assert product.startswith(("bmm [1, 8, 1] @ [1, 1, ", "mm [8, 1] @ [1, ")), product
