"""The horizontal fusion on the reference draft across its option matrix: parity with eager + graph diffs.

These run the pass without Inductor codegen (`CaptureBackend(inner="aot_eager")`), which keeps them fast; the
Inductor path is covered in test_inductor_integration.py.
"""

import pytest
import torch
from helpers import eager_and_compiled, quick_first, small_config

from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

MATRIX = [
    dict(proj="qkv_slice", write="cache_loc"),
    dict(proj="qkv_slice", write="commit", qkv_bias=True),
    dict(proj="qkv_slice", write="return", norm="rms_norm", rope_style="gptj"),
    dict(proj="qkv_split", write="cache_loc", rope_style="gptj", rotary_dim=8),
    dict(proj="qkv_split", write="commit", norm="rms_norm", qkv_bias=True),
    dict(proj="qkv_split", write="return", rotary_dim=8),
    dict(proj="kv_separate", write="cache_loc", qkv_bias=True, rope_style="gptj"),
    dict(proj="kv_separate", write="commit", rotary_dim=12, norm="rms_norm"),
    dict(proj="kv_separate", write="return"),
    dict(proj="qkv_slice", write="cache_loc", num_layers=2),
    dict(proj="qkv_slice", write="return", num_layers=8, num_kv_heads=1, num_heads=4),
]


def _gemms(graph) -> int:
    counts = op_counts(graph)
    return counts["aten.mm"] + counts["aten.addmm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("options", quick_first(1, MATRIX), ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_parity_and_graph_diff(options, dtype):
    torch._dynamo.reset()
    cfg = small_config(dtype=dtype, **options)
    capture = CaptureBackend()
    for eager, compiled in eager_and_compiled(cfg, capture, tokens_list=(8, 13)):
        assert_close_for_dtype(compiled, eager, dtype)
    gemms_per_layer = 2 if cfg.proj == "kv_separate" else 1
    n = cfg.num_layers * gemms_per_layer
    capture.assert_fused(n_groups=1, n_branches=[n])
    for before, after in zip(capture.before, capture.after, strict=True):
        assert _gemms(before) == n and _gemms(after) == 0, capture.graph_diff()
        assert op_counts(after)["dspark.multi_linear"] == 1
        b, a = op_counts(before), op_counts(after)
        assert b["aten.rsqrt"] == cfg.num_layers and a["aten.rsqrt"] == 1, capture.graph_diff()
        assert b["aten.pow"] == cfg.num_layers and a["aten.pow"] == 1
        assert a["aten.cat"] <= b["aten.cat"] // cfg.num_layers + 1  # RoPE cat batched (+1 norm-weight gather)
    for report in capture.reports:
        (group,) = report.groups
        k_class = max(group.classes, key=lambda c: len(c.ops))
        assert len(k_class.branches) == cfg.num_layers
        assert "aten.rsqrt" in k_class.ops and "aten.mul" in k_class.ops


def test_graph_diff_and_report_text():
    torch._dynamo.reset()
    capture = CaptureBackend()
    eager_and_compiled(small_config(), capture)
    diff = capture.graph_diff()
    assert "+" in diff and "dspark.multi_linear" in diff and "-" in diff
    text = str(capture.report)
    assert "3 GEMMs on ctx -> one multi_linear" in text
    assert "layers.0.qkv_proj.weight[64:128]" in text
    assert "batched branches [0, 1, 2]" in text


def test_weights_are_never_copied_in_the_graph():
    """No cat/stack of GEMM weights: the only cat inputs are small per-layer vectors or activations."""
    torch._dynamo.reset()
    capture = CaptureBackend()
    eager_and_compiled(small_config(proj="kv_separate", qkv_bias=True), capture)
    graph = capture.after[-1]
    for node in graph.nodes:
        if node.op == "call_function" and "cat" in str(node.target):
            for arg in node.args[0]:
                assert arg.meta["val"].numel() <= 64 * 16 or "k_norm" not in arg.name, arg
                assert arg.meta["val"].dim() < 2 or arg.meta["val"].shape[-1] != 64, "a weight was concatenated"
