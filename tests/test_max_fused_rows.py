"""`DsparkConfig.max_fused_rows`: on CUDA, GEMMs that share an activation fuse only up to that many rows; a
dynamic-shape model compiles one graph per side of the limit (a guard on the symbolic row count), never one per
token count. The K/V-write lowering is not limited."""

import copy
import dataclasses

import helpers
import pytest
import torch

from dspark_fx import DsparkConfig
from dspark_fx.passes import horizontal
from dspark_fx.passes.horizontal import fuse_kv_branches
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

CFG = helpers.small_config(num_slots=1024, max_position=64, eps=1e-5)
NEVER = DsparkConfig(kv_write_op="never", max_fused_rows=6)


def _draft(device: str = "cpu", dtype: torch.dtype = torch.float32) -> DraftKVWriter:
    """The reference draft's writer, its caches poisoned with random values (slots not written must keep them)."""
    model = DraftKVWriter(dataclasses.replace(CFG, dtype=dtype), device).requires_grad_(False)
    helpers.poison_caches(model)
    return model


def _inputs(
    tokens: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32, dynamic: bool = True
) -> tuple[torch.Tensor, ...]:
    """`helpers.draft_inputs` (ctx, positions, distinct slots), the token dim marked dynamic (or not)."""
    inputs = helpers.draft_inputs(dataclasses.replace(CFG, dtype=dtype), tokens, device, seed)
    for t in inputs if dynamic else ():
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return inputs


def _captured(tokens: int, dtype: torch.dtype = torch.float32) -> torch.fx.Graph:
    """The draft's pre-pass graph at a static token count."""
    torch._dynamo.reset()
    capture = CaptureBackend(DsparkConfig(horizontal_fusion=False))
    with torch.no_grad():
        torch.compile(_draft(dtype=dtype), backend=capture)(*_inputs(tokens, 0, dtype=dtype, dynamic=False))
    return capture.before[0]


@pytest.mark.usefixtures("builds_cuda_library")
@pytest.mark.parametrize("fake_cuda", [False, True], ids=["cpu", "fake-cuda"])
@pytest.mark.parametrize("tokens", [6, 7])
def test_groups_above_the_limit_keep_their_gemms_on_cuda_only(tokens, fake_cuda):
    """At 6 rows (the limit) the K/V GEMMs fuse; at 7 they stay per layer on CUDA, each rejected with its reason,
    in the graph as it came (Inductor then generates torch.compile's own kernels), and fuse on CPU."""
    graph = _captured(tokens)
    if fake_cuda:
        helpers.as_fake_cuda(graph)
    before = str(graph)
    report = fuse_kv_branches(graph, NEVER, None)
    counts = op_counts(graph)
    if fake_cuda and tokens > NEVER.max_fused_rows:
        assert not report.groups and counts["dspark.multi_linear"] == 0 and counts["aten.mm"] == CFG.num_layers
        assert str(graph) == before, "nothing rewritten: the graph must come back as it came, not even normalized"
        assert [r.kind for r in report.rejected] == ["above_max_fused_rows"] * CFG.num_layers, str(report)
        assert report.rejected[0].reason.startswith("rows above max_fused_rows (this graph is for 7 > 6 rows)")
    else:
        assert len(report.groups) == 1 and counts["dspark.multi_linear"] == 1 and counts["aten.mm"] == 0, str(report)


@pytest.mark.usefixtures("builds_cuda_library")
def test_the_kv_write_lowering_is_not_limited():
    """Lowered writes take one `multi_linear_kv_write` above the limit too."""
    graph = _captured(7, torch.bfloat16)
    helpers.as_fake_cuda(graph)
    report = fuse_kv_branches(graph, DsparkConfig(kv_write_op="always", max_fused_rows=6), None)
    assert len(report.kv_writes) == 1 and op_counts(graph)["dspark.multi_linear_kv_write"] == 1, str(report)


def _one_graph_per_side(device: str, inner: str, dtype: torch.dtype, config: DsparkConfig, sizes: list[int]) -> None:
    """Calls at `sizes` (below, above, below, above the limit): parity with eager after each, two graphs compiled,
    the first with the fused GEMM and the second without."""
    torch._dynamo.reset()
    eager = _draft(device, dtype)
    compiled_model = copy.deepcopy(eager)
    capture = CaptureBackend(config, inner=inner)
    compiled = torch.compile(compiled_model, backend=capture)
    with torch.no_grad():
        for seed, tokens in enumerate(sizes):
            inputs = _inputs(tokens, seed, device, dtype)
            eager(*inputs)
            compiled(*inputs)
            expected = [t for kv in eager.caches() for t in kv]
            assert_close_for_dtype([t for kv in compiled_model.caches() for t in kv], expected, dtype)
    assert len(capture.after) == 2, [str(r) for r in capture.reports]
    fused, per_layer = (op_counts(graph)["dspark.multi_linear"] for graph in capture.after)
    assert (fused, per_layer) == (1, 0), [str(r) for r in capture.reports]
    assert {r.kind for r in capture.reports[1].rejected} == {"above_max_fused_rows"}


def test_a_dynamic_model_compiles_one_graph_per_side_of_the_limit(monkeypatch):
    """The limit on a symbolic row count is a guard: Dynamo compiles the other side's graph once, when a call first
    crosses the limit, and reuses both (here on CPU, with CPU counted as a limited device)."""
    monkeypatch.setattr(horizontal, "ROW_LIMITED_DEVICES", ("cpu",))
    _one_graph_per_side("cpu", "aot_eager", torch.float32, NEVER, [3, 9, 5, 6, 12, 7])


@pytest.mark.cuda
@pytest.mark.slow
def test_a_dynamic_model_compiles_one_graph_per_side_of_the_limit_on_cuda():
    """The same on CUDA through Inductor codegen, bf16, the default limit (512 rows)."""
    _one_graph_per_side("cuda", "inductor", torch.bfloat16, DsparkConfig(kv_write_op="never"), [9, 600, 17, 512, 1000])
