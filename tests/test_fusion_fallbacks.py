"""Branches that are only partly compatible: exactly the incompatible part stays unfused, and explain() says why."""

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import dspark_log_messages, eager_and_compiled, small_config
from torch import nn

from dspark_fx import DsparkConfig, explain
from dspark_fx.passes.graph_utils import op_name
from dspark_fx.reference_draft import DraftKVLayer, DraftKVWriter
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts


def _run(cfg, model_factory=None, dtype=torch.float32):
    torch._dynamo.reset()
    capture = CaptureBackend()
    for eager, compiled in eager_and_compiled(cfg, capture, tokens_list=(8,), model_factory=model_factory):
        assert_close_for_dtype(compiled, eager, dtype)
    return capture


def _batched_ops(report, branch: int) -> list[str]:
    group = report.groups[0]
    return next((c.ops for c in group.classes if branch in c.branches), [])


def test_eps_mismatch_shares_the_gemm_but_keeps_its_own_norm():
    capture = _run(small_config(num_layers=4, eps=(1e-6, 1e-5, 1e-6, 1e-6)))
    capture.assert_fused(n_groups=1, n_branches=[4])
    report = capture.report
    assert _batched_ops(report, 1) == [] and "aten.rsqrt" in _batched_ops(report, 0)
    assert [c.branches for c in report.groups[0].classes] == [[0, 2, 3]]
    (unbatched,) = report.groups[0].unbatched
    assert unbatched.branch == 1 and "aten.add" in unbatched.reason
    assert op_counts(capture.after[-1])["aten.rsqrt"] == 2  # one batched norm + layer 1's own


def test_bias_on_some_layers_only_is_folded_per_weight():
    capture = _run(small_config(qkv_bias=(True, False, True)))
    capture.assert_fused(n_groups=1, n_branches=[3])
    report = capture.report
    assert [c.branches for c in report.groups[0].classes] == [[0, 1, 2]]
    assert "+ bias" in report.groups[0].branches[0] and "+ bias" not in report.groups[0].branches[1]


class _WeightOnlyInt8Layer(DraftKVLayer):
    """Layer whose KV weight is stored as int8 + per-row scale and dequantized in the forward."""

    def __init__(self, cfg, eps):
        super().__init__(cfg, False, eps)
        weight = self.qkv_proj.weight.detach().float()
        scale = weight.abs().amax(1) / 127
        self.register_buffer("w_int8", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("w_scale", scale.to(cfg.dtype))

    def project(self, ctx):
        cfg = self.cfg
        rows = slice(cfg.q_size, cfg.q_size + 2 * cfg.kv_size)
        weight = self.w_int8[rows].to(ctx.dtype) * self.w_scale[rows, None]
        k, v = F.linear(ctx, weight).split([cfg.kv_size, cfg.kv_size], dim=-1)
        return k, v


def _with_quantized_layer(cfg, device):
    model = DraftKVWriter(cfg, device)
    model.layers[1] = _WeightOnlyInt8Layer(cfg, 1e-6).to(device)
    return model


def test_weight_only_quantized_layer_keeps_its_own_gemm():
    capture = _run(small_config(), model_factory=_with_quantized_layer)
    capture.assert_fused(n_groups=1, n_branches=[2])
    assert op_counts(capture.after[-1])["aten.mm"] == 1
    assert any("quantized" in r.reason for r in capture.report.rejected), capture.report
    assert [c.branches for c in capture.report.groups[0].classes] == [[0, 1]]


def test_float64_gemms_stay_with_a_reason():
    """dspark::multi_linear takes bf16 / fp16 / fp32 activations: a float64 draft's GEMMs are left as they are, with
    a reason (the compile used to fail in the op's checks)."""
    capture = _run(small_config(dtype=torch.float64), dtype=torch.float64)
    capture.assert_fused(n_groups=0)
    assert any("torch.float64" in r.reason for r in capture.report.rejected), capture.report


def test_different_rope_table_is_not_batched_with_the_others():
    capture = _run(small_config(rope_theta=(1e6, 1e4, 1e6)))
    report = capture.report
    capture.assert_fused(n_groups=1, n_branches=[3])
    assert [c.branches for c in report.groups[0].classes] == [[0, 2]]
    assert report.groups[0].unbatched[0].branch == 1


class _TwoInputs(nn.Module):
    """GEMMs on two different activations, plus a branch whose ops read another branch (dependent)."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(3))
        self.b = nn.Linear(32, 32, bias=False)
        self.w = nn.ParameterList(nn.Parameter(torch.rand(32) + 0.5) for _ in range(3))

    def forward(self, x, x2):
        normed = [F.rms_norm(lin(x), (32,), w, 1e-6) for lin, w in zip(self.a, self.w, strict=True)]
        dependent = normed[1] * torch.sigmoid(normed[0])
        return normed[0], dependent, normed[2], self.b(x2)


@pytest.mark.usefixtures("lone_gemms_routed_on_cpu")
@pytest.mark.parametrize("skinny", [True, False])
def test_dependent_branches_and_different_inputs(skinny):
    """The three GEMMs on x fuse; the lone GEMM on x2 is routed through multi_linear on its own (skinny linears,
    the default, routed as on CUDA) or, with the switch off, stays an `mm` with the reason in the report."""
    torch._dynamo.reset()
    model = _TwoInputs()
    x, x2 = torch.randn(5, 32), torch.randn(5, 32)
    capture = CaptureBackend(DsparkConfig(skinny_linears=skinny))
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(model, backend=capture)(x, x2), model(x, x2))
    capture.assert_fused(n_groups=1, n_branches=[3])
    counts = op_counts(capture.after[-1])
    assert counts["aten.sigmoid"] == 1  # the dependent op stays per branch
    assert (counts["aten.mm"], counts["dspark.multi_linear"]) == ((0, 2) if skinny else (1, 1))
    if skinny:
        assert capture.report.routed == ["b.weight[0:32] on x2"]
        assert "lone GEMMs routed through multi_linear" in str(capture.report)
    else:
        assert not capture.report.routed
        assert any("fewer than min_branches" in r.reason for r in capture.report.rejected)


def test_explain_report():
    cfg = small_config(num_layers=4, eps=(1e-6, 1e-5, 1e-6, 1e-6))
    model = DraftKVWriter(cfg)
    before = model.k_cache_0.clone()
    from helpers import draft_inputs

    report = explain(model, *draft_inputs(cfg, 6))
    text = str(report)
    assert "4 GEMMs on ctx -> one multi_linear" in text
    assert "branch 1 keeps its own ops" in text and "aten.add" in text
    assert torch.equal(model.k_cache_0, before), "explain() must not change the model's state"


class _SymbolicColumns(nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(2))

    def forward(self, x):
        return [lin(x)[:, : x.shape[0]] * 2 for lin in self.lins]


def test_column_slice_with_a_symbolic_bound_fuses_without_narrowing():
    torch._dynamo.reset()
    model = _SymbolicColumns()
    capture = CaptureBackend()
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for tokens in (5, 7, 9):  # the second compile has a symbolic T
            x = torch.randn(tokens, 32)
            assert_close_for_dtype(compiled(x), model(x))
    assert capture.reports[-1].groups[0].branches == ["lins.0.weight[0:32]", "lins.1.weight[0:32]"]


class _EmptyColumnSlice(nn.Module):
    def __init__(self):
        super().__init__()
        self.o, self.p = nn.Linear(32, 48), nn.Linear(32, 8)

    def forward(self, x):
        y = self.o(x)
        return y[:, 16:32] * 2, y[:, 20:10], y[:, 20:10].sum(-1), self.p(x)


def test_an_empty_column_slice_stays_empty_when_the_gemm_is_narrowed():
    """`y[:, 20:10]` (start past stop: empty) next to `y[:, 16:32]`: the GEMM is narrowed to columns [16, 32); the
    empty slice was rebased to [4, -6), which reads columns, and its sum was not 0."""
    torch._dynamo.reset()
    model, capture = _EmptyColumnSlice(), CaptureBackend()
    x = torch.randn(5, 32)
    with torch.no_grad():
        got, want = torch.compile(model, backend=capture)(x), model(x)
    assert capture.report.groups[0].branches == ["o.weight[16:32] + bias", "p.weight[0:8] + bias"]
    assert got[1].shape == (5, 0) and torch.equal(got[2], torch.zeros(5))
    assert_close_for_dtype(got, want)


class _NoHeads(nn.Module):
    """Layers whose K/V projections have no rows and caches no heads: a tensor-parallel rank that owns no K/V head
    has these shards."""

    def __init__(self, layers: int = 3, hidden: int = 32, head_dim: int = 16) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.k, self.v = (nn.ModuleList(nn.Linear(hidden, 0, bias=False) for _ in range(layers)) for _ in range(2))
        self.norm = nn.Parameter(torch.rand(head_dim) + 0.5)

    def forward(self, x, loc, caches):
        for k_proj, v_proj, (k_cache, v_cache) in zip(self.k, self.v, caches, strict=True):
            k_cache[loc] = F.rms_norm(k_proj(x).unflatten(-1, (-1, self.head_dim)), (self.head_dim,), self.norm)
            v_cache[loc] = v_proj(x).unflatten(-1, (-1, self.head_dim))
        return x.sum()


@pytest.mark.parametrize("kv_write_op", ["never", "always"])
def test_weights_without_rows_stay_as_they_are_with_a_reason(kv_write_op):
    """GEMMs of `[0, hidden]` weights (no K/V head on this rank): nothing to fuse, so they stay, each with a
    reason, and nothing is logged (batching them raised inside the pass, logged as an unexpected error with its
    traceback on every compile)."""
    torch._dynamo.reset()
    model, capture = _NoHeads(), CaptureBackend({"fuse_on_cpu": True, "kv_write_op": kv_write_op})
    caches = [tuple(torch.randn(8, 0, 16) for _ in "kv") for _ in range(3)]
    x, loc = torch.randn(5, 32), torch.randperm(8)[:5]
    with torch.no_grad(), dspark_log_messages(logging.WARNING) as messages:
        assert_close_for_dtype(torch.compile(model, backend=capture)(x, loc, caches), model(x, loc, caches))
    assert not messages, messages
    capture.assert_fused(n_groups=0)
    assert [r.reason for r in capture.report.rejected] == [
        "weight has no rows (a GEMM without output columns: nothing to read or share)"
    ] * 6, str(capture.report)


class _Chained(nn.Module):
    """GEMMs reading another GEMM's output with nothing in between: `b(a(x))`, `c(a(x))` (a down projection
    straight after an up projection, o_proj straight after q_proj); `a` and `a2` share x."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.a2, self.b, self.c = (nn.Linear(width, width, bias=i == 2) for i in range(4))

    def forward(self, x):
        h = self.a(x)
        return self.b(h), self.c(h), self.a2(x)


@pytest.mark.usefixtures("lone_gemms_routed_on_cpu")
@pytest.mark.parametrize("skinny", [True, False])
def test_a_group_whose_activation_is_the_output_of_another_fused_gemm(skinny):
    """The group on `a(x)` is rewritten after the group on x replaced `a`'s GEMM: it reads `a`'s column block."""
    torch._dynamo.reset()
    model, x = _Chained(), torch.randn(3, 8)
    capture = CaptureBackend(DsparkConfig(skinny_linears=skinny))
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(model, backend=capture)(x), model(x))
    capture.assert_fused(n_groups=2, n_branches=[2, 2])
    counts = op_counts(capture.after[-1])
    assert counts["dspark.multi_linear"] == 2 and counts["aten.mm"] + counts["aten.addmm"] == 0
    (first, second) = [n for n in capture.after[-1].nodes if op_name(n) == "dspark.multi_linear"]
    assert second.args[0].args[0] is first, "the second group reads the first group's output"
