"""Where the K/V write is not lowered, batching the per-branch ops must never lose to each branch's own ops.

Batching moves no fewer bytes; it saves launches. A class is kept per branch where a batched value would feed a
branch's own computation (not a write) through a reshape of computed values (Inductor then indexes every element
with integer division) or as the scale of a batched reduction (the per-branch kernel cannot join the batched
reduction and reads its input again). Graph diffs show the choice per spelling of `benchmarks/_spellings.py`
(`kv_write_op="never"`) and on small models for each of the two cases.
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dspark_fx import DsparkConfig
from dspark_fx.reference_draft import DraftKVConfig
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
spellings = importlib.import_module("_spellings")

NEVER = DsparkConfig(kv_write_op="never")
CFG = DraftKVConfig(
    num_layers=3,
    hidden=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_slots=32,
    max_position=64,
    eps=1e-5,
    dtype=torch.float32,
)
# spelling: whether its k_norm is batched (one rsqrt for all layers) or kept per layer, and the reason's words
CHOICE = {
    "reference": None,  # norm, RoPE and the write's view batched: the values leave only for the cache writes
    "hf": None,
    "gptj_stack": None,
    "sglang": "integer division",  # the per-layer RoPE (its own cos/sin cache) reads the normed heads
    "complex": "integer division",  # view_as_complex of the normed heads, per layer
}


def _compile(model, inputs, config=NEVER):
    torch._dynamo.reset()
    capture = CaptureBackend(config)
    with torch.no_grad():
        out = torch.compile(model, backend=capture)(*inputs)
    return capture, out


@pytest.mark.parametrize("name", sorted(CHOICE))
def test_spelling_batches_only_where_the_values_leave_for_writes(name):
    assert set(CHOICE) == set(spellings.SPELLINGS)
    model = spellings.build_spelling(name, CFG)
    gen = torch.Generator().manual_seed(3)
    tokens = 7
    ctx = torch.randn(tokens, CFG.hidden, generator=gen)
    positions = torch.randint(0, CFG.max_position, (tokens,), generator=gen)
    cache_loc = torch.randperm(CFG.num_slots, generator=gen)[:tokens]
    for k_cache, v_cache in model.caches():
        k_cache.normal_(generator=gen), v_cache.normal_(generator=gen)  # poison: rows not written keep these
    expected = spellings.expected_caches(model, ctx, positions, cache_loc)
    capture, _ = _compile(model, (ctx, positions, cache_loc))
    for (k, v), (k_want, v_want) in zip(model.caches(), expected, strict=True):
        assert_close_for_dtype((k.double(), v.double()), (k_want, v_want), torch.float32)
    capture.assert_fused(n_groups=1)
    before, after = op_counts(capture.before[-1]), op_counts(capture.after[-1])
    layers = CFG.num_layers
    assert before["aten.rsqrt"] == layers and after["dspark.multi_linear"] == 1, capture.graph_diff()
    (group,) = capture.report.groups
    reason = CHOICE[name]
    if reason is None:
        assert after["aten.rsqrt"] == 1 and after["aten.mean"] == 1, capture.graph_diff()
        assert any("aten.rsqrt" in c.ops for c in group.classes) and not group.unbatched, group
    else:
        assert after["aten.rsqrt"] == layers and after["aten.mean"] == layers, capture.graph_diff()
        assert not any("aten.rsqrt" in c.ops for c in group.classes), group
        kept = [u for u in group.unbatched if u.reason.startswith("kept per branch")]
        assert len(kept) == layers and reason in kept[0].reason, group
        assert "kept per branch" in str(capture.report)


class _Branches(nn.Module):
    """Three GEMMs on one input; each branch's value `[T, 4, 8]` goes through batchable ops `head`, then is
    multiplied by a per-branch table too large to stack (`max_leaf_numel`), so that op stays per branch."""

    def __init__(self, head):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(3))
        self.tables = nn.ParameterList(nn.Parameter(torch.rand(5, 4, 8) + 0.5) for _ in range(3))
        self.head = head

    def forward(self, x):
        return [self.head(lin(x).view(-1, 4, 8)) * table for lin, table in zip(self.lins, self.tables, strict=True)]


SMALL_LEAVES = DsparkConfig(kv_write_op="never", max_leaf_numel=64)  # the tables (160 elements) stay per branch
X = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))


def _group(head):
    model = _Branches(head)
    capture, out = _compile(model, (X,), SMALL_LEAVES)
    assert_close_for_dtype(out, model(X))
    (group,) = capture.report.groups
    return group, op_counts(capture.after[-1])


def test_reshape_of_computed_values_into_a_branch_op_keeps_the_branches():
    group, after = _group(lambda k: (k * 2).reshape(-1, 32).reshape(-1, 4, 8))
    assert not group.classes and after["aten.mul"] == 6, group
    assert all("integer division" in u.reason for u in group.unbatched) and len(group.unbatched) == 3, group


def test_scale_of_a_batched_reduction_into_a_branch_op_keeps_the_branches():
    group, after = _group(lambda k: k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert not group.classes and after["aten.mean"] == 3, group
    assert all("cannot join" in u.reason for u in group.unbatched) and len(group.unbatched) == 3, group


@pytest.mark.parametrize(
    "head",
    [
        lambda k: k * 2 + 1,
        lambda k: (k * 2).permute(0, 2, 1).permute(0, 2, 1),
        lambda k: k.reshape(-1, 32).reshape(-1, 4, 8) * 2,
    ],
    ids=["pointwise", "permutes", "reshapes-of-the-gemm-output"],
)
def test_other_values_into_a_branch_op_stay_batched(head):
    """Pointwise ops, permutes and reshapes of the GEMM output's memory index per branch as the branch would."""
    group, after = _group(head)
    (cls,) = group.classes
    assert cls.branches == [0, 1, 2] and not group.unbatched and after["aten.add"] <= 1, group
