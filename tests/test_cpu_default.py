"""On CPU, GEMM groups fuse only with `DsparkConfig(fuse_on_cpu=True)`: by default `dspark_backend` leaves a CPU
graph's GEMMs as they are, reporting why for each (the op's CPU path is its reference, measured slower than
Inductor's GEMMs). The other tests fuse on CPU (tests/conftest.py); these undo that. No Inductor codegen."""

import copy

import pytest
import torch
from helpers import draft_inputs, small_config

from dspark_fx import DsparkConfig
from dspark_fx.passes import horizontal
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts


@pytest.fixture
def cpu_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(horizontal, "GROUP_GEMM_DEVICES", ("cuda",))


def _run(config: DsparkConfig) -> CaptureBackend:
    torch._dynamo.reset()
    cfg = small_config()
    eager = DraftKVWriter(cfg, "cpu")
    model = copy.deepcopy(eager)
    capture = CaptureBackend(config)
    compiled = torch.compile(model, backend=capture)
    inputs = draft_inputs(cfg, 8)
    with torch.no_grad():
        eager(*inputs)
        compiled(*inputs)
    assert_close_for_dtype(model.caches(), eager.caches(), cfg.dtype)
    return capture


@pytest.mark.usefixtures("cpu_default")
def test_cpu_graphs_keep_their_gemms_by_default_and_say_why():
    capture = _run(DsparkConfig())
    (report,) = capture.reports
    assert not report.groups and not report.kv_writes
    assert report.rejected and all("on cpu: dspark::multi_linear is its reference" in r.reason for r in report.rejected)
    assert str(capture.before[0]) == str(capture.after[0]), "the graph is handed back as it came"
    assert op_counts(capture.after[0])["dspark.multi_linear"] == 0


@pytest.mark.usefixtures("cpu_default")
def test_fuse_on_cpu_fuses_as_on_cuda():
    capture = _run(DsparkConfig(fuse_on_cpu=True))
    (report,) = capture.reports
    assert len(report.groups) == 1 and not report.rejected
    assert op_counts(capture.after[0])["dspark.multi_linear"] == 1
