"""The benchmarks' CPU smoke modes run end to end: the GPU runs them rarely and in one go, so every code path they
can take on a CPU (model building, compiles with both backends, parity checks, timing, the report) runs here."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TIME_CELL = re.compile(r"\d+\.\d \(\d+\.\d\dx\)")


def _run_benchmark(script: str, out: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's dspark_fx, not an installed one
    command = [sys.executable, f"benchmarks/{script}", "--device", "cpu", "--small", "--out", str(out), *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    return out.read_text()


def test_dspark_write_breakdown_needs_cuda():
    """`--breakdown` profiles CUDA kernels: on CPU it says so instead of failing somewhere inside."""
    command = [sys.executable, "benchmarks/dspark_write.py", "--breakdown", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--breakdown profiles CUDA kernels" in result.stderr, result.stderr


def test_dspark_write_small_cpu(tmp_path):
    report = _run_benchmark("dspark_write.py", tmp_path / "dspark_write.md")
    assert report.count("\n### small, head_dim") == 2
    header = next(line for line in report.splitlines() if line.startswith("| T |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.splitlines() if line.startswith("| ")]
    rows = [row for row in rows if row[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "8"] * 2
    for row in rows:
        cells = dict(zip(columns, row, strict=True))
        for name in ("eager per-layer", "stacked eager", "torch.compile", "dspark_backend"):
            assert TIME_CELL.fullmatch(cells[name]), f"T={cells['T']} {name}: {cells[name]!r}"
        assert cells["torch.compile"].endswith("(1.00x)")
        assert cells["torch.compile RO"] == cells["dspark_backend RO"] == "n/a (cpu)"
        assert re.fullmatch(r"\d+\.\d\dx", cells["dspark_backend ÷ floor"])
        assert cells["dspark path"] == "multi_linear"  # the K/V write lowering runs on CUDA only
    parity = [line for line in report.splitlines() if "parity at T=8" in line]
    assert len(parity) == 2 * 4 and not any("WRONG" in line for line in parity), "\n".join(parity)
    assert sum("2 graph(s) compiled" in line for line in parity) == 2 * 2  # T=1 and one graph for T > 1
    assert "  - error:" not in report
