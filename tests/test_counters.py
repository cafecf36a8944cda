"""`torch._dynamo.utils.counters["dspark_fx"]`: what the pass fused and why it left GEMMs alone, by key."""

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark_fx import DsparkConfig
from dspark_fx.passes import gemm_branches
from dspark_fx.report import Rejection
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

counters = torch._dynamo.utils.counters


class _Mixed(nn.Module):
    """Three normed projections of x (one fused, batched group), a dequantized GEMM on x (rejected) and a lone
    GEMM on x2 (routed through multi_linear with skinny linears on CUDA, else rejected: fewer than min_branches)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(3))
        self.norms = nn.ParameterList(nn.Parameter(torch.rand(width) + 0.5) for _ in range(3))
        self.register_buffer("w_int8", torch.randint(-127, 128, (width, width), dtype=torch.int8))
        self.register_buffer("w_scale", torch.rand(width) / 127)
        self.lone = nn.Linear(width, width, bias=False)

    def forward(self, x, x2):
        normed = [F.rms_norm(lin(x), (x.shape[-1],), w, 1e-6) for lin, w in zip(self.lins, self.norms, strict=True)]
        dequantized = F.linear(x, self.w_int8.to(x.dtype) * self.w_scale[:, None])
        return normed, dequantized, self.lone(x2)


@pytest.mark.usefixtures("lone_gemms_routed_on_cpu")
@pytest.mark.parametrize("skinny", [True, False])
def test_counters_count_fused_groups_branches_and_rejections_by_reason(skinny):
    torch._dynamo.reset()
    counters.clear()
    model, x, x2 = _Mixed(), torch.randn(5, 16), torch.randn(5, 16)
    capture = CaptureBackend(DsparkConfig(skinny_linears=skinny))
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(model, backend=capture)(x, x2), model(x, x2))
    expected = {
        "pass_runs": 1,
        "groups_fused": 1,
        "branches_fused": 3,
        "branches_batched": 3,
        "lone_gemms_routed": 1 if skinny else 0,
        "rejected": 1 if skinny else 2,
        "rejected_weight_computed": 1,
        "rejected_below_min_branches": 0 if skinny else 1,
    }
    assert {k: counters["dspark_fx"][k] for k in expected} == expected, dict(counters["dspark_fx"])
    assert sum(v for k, v in counters["dspark_fx"].items() if k.startswith("rejected_")) == expected["rejected"]
    assert [r.kind for r in capture.report.rejected] == ["weight_computed"] + ([] if skinny else ["below_min_branches"])


def test_lone_gemms_stay_inductors_on_cpu():
    """With the default `skinny_linears=True`, a lone GEMM on a CPU activation is not routed (the op's reference is
    slower than Inductor's addmm there): it stays an `mm`, counted as below min_branches."""
    torch._dynamo.reset()
    counters.clear()
    model, x, x2 = _Mixed(), torch.randn(5, 16), torch.randn(5, 16)
    capture = CaptureBackend()
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(model, backend=capture)(x, x2), model(x, x2))
    assert counters["dspark_fx"]["lone_gemms_routed"] == 0 and not capture.report.routed
    assert counters["dspark_fx"]["rejected_below_min_branches"] == 1
    assert op_counts(capture.after[-1])["aten.mm"] == 2  # the lone and the dequantized GEMM


def _reason_prefixes() -> list[str]:
    """The leading text of every reason `match_gemm` and `_row_range` return."""
    tree = ast.parse(Path(gemm_branches.__file__).read_text())
    prefixes = []
    for func in tree.body:
        if isinstance(func, ast.FunctionDef) and func.name in ("match_gemm", "_row_range"):
            for node in ast.walk(func):
                value = node.value if isinstance(node, ast.Return) else None
                value = value.left if isinstance(value, ast.BinOp) else value
                if isinstance(value, ast.JoinedStr):
                    value = value.values[0]
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    prefixes.append(value.value)
    return prefixes


def test_every_rejection_reason_has_a_kind():
    prefixes = _reason_prefixes()
    assert len(prefixes) >= 10, prefixes
    other = [p for p in prefixes if Rejection("w", p).kind == "other"]
    assert not other, f"reasons without a kind in report.REJECTION_KINDS: {other}"
    assert Rejection("w", "2 fusable GEMM(s) on x, fewer than min_branches").kind == "below_min_branches"
    assert Rejection("w", "bias: weight is computed by aten.mul").kind == "bias"


def test_counters_count_lowered_and_kept_cache_writes():
    """The draft writer's K/V cache writes: forced lowering (CPU) counts one lowered group; "auto" on CPU keeps
    them on the fused-GEMM path and counts that."""
    from helpers import draft_inputs, small_config

    from dspark_fx.reference_draft import DraftKVWriter

    cfg = small_config(write="cache_loc")
    for mode, lowered, kept in (("always", 1, 0), ("auto", 0, 1)):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(DraftKVWriter(cfg), backend=CaptureBackend(DsparkConfig(kv_write_op=mode)))
        with torch.no_grad():
            compiled(*draft_inputs(cfg, 5))
        assert counters["dspark_fx"]["kv_writes_lowered"] == lowered, dict(counters["dspark_fx"])
        assert counters["dspark_fx"]["kv_writes_kept"] == kept, dict(counters["dspark_fx"])
