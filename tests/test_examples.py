"""The README demo (`examples/dspark_draft.py`, run by scripts/demo.sh): short, readable, truthfully labelled."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_prints_a_short_summary_and_labels_its_timings_truthfully():
    demo = [sys.executable, str(ROOT / "examples" / "dspark_draft.py"), "--device", "cpu", "--tokens", "16"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(demo, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) <= 30, f"{len(lines)} lines:\n{out}"
    assert "5 GEMMs on ctx -> one multi_linear" in out  # the explain() report
    assert "dspark_backend compile: 1 fused group(s) of 5 GEMMs" in out or "served from Inductor's cache" in out
    assert "parity with eager: OK" in out
    assert "torch.compile(backend=dspark_backend)" in out and "graph diff" not in out
