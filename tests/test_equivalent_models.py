"""Models that write the same draft-KV path differently must fuse too (the pass is not tuned to our module).

The models (`HFStyleDraft`, `HFStyleKVWriter`) are in tests/hf_models.py.
"""

import pytest
import torch
from helpers import quick_first
from hf_models import HFStyleDraft

from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts


@pytest.mark.parametrize("dtype", quick_first(1, [torch.float32, torch.bfloat16]), ids=["fp32", "bf16"])
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
