"""The benchmarks' CPU smoke modes run end to end: the GPU runs them rarely and in one go, so every code path they
can take on a CPU (model building, compiles with both backends, parity checks, timing, the report) runs here."""

import os
import re
import runpy
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


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--breakdown"], "--breakdown profiles CUDA kernels"),
        (["--small", "--shard", "2"], "--shard 2: the K/V heads of ['small-hd32'] do not split 2 ways"),
        (["--small", "--configs", "small-hd16", "--tp", "0"], "--tp must be at least 1"),
        (["--small", "--configs", "small-hd16", "--tp", "2", "--shard", "2"], "it takes neither --shard"),
    ],
    ids=["breakdown-on-cpu", "uneven-shard", "no-ranks", "tp-and-shard"],
)
def test_dspark_write_refuses_what_it_cannot_run(monkeypatch, capsys, args, says):
    """Arguments the script cannot run say so before anything is built (the script run in this process, as
    `python benchmarks/dspark_write.py --device cpu ...`): `--breakdown` profiles CUDA kernels; `--shard` / `--tp`
    need K/V heads that split evenly, at least one rank, and not both."""
    script = ROOT / "benchmarks" / "dspark_write.py"
    monkeypatch.syspath_prepend(str(script.parent))
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and says in stderr, stderr


def test_dspark_write_small_cpu(tmp_path):
    """One config, two spellings (the reference and HF-style code), one T (8, the parity check's: every variant
    compiles one graph): every column, the hand-stacked one too (`--sync-each` is accepted; on the CPU it changes
    nothing)."""
    report = _run_benchmark(
        "dspark_write.py",
        tmp_path / "dspark_write.md",
        *("--configs", "small-hd16", "--spellings", "reference", "hf", "--tokens", "8", "--sync-each"),
    )
    titles = [line for line in report.splitlines() if line.startswith("### ")]
    assert [t.split(":")[0] for t in titles] == ["### small, head_dim 16"] * 2 + ["### small, head_dim 16, hf spelling"]
    assert "the spellings side by side" in titles[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.splitlines() if line.startswith("| ")]
    side_by_side = [row for row in rows if len(row) == 7 and row[0].isdigit()]
    assert [row[:2] for row in side_by_side] == [["8", "reference"], ["8", "hf"]]
    assert side_by_side[0][3] == "1.00x", side_by_side  # the reference spelling ÷ itself
    for row in side_by_side:
        assert all(re.fullmatch(r"\d+\.\d\dx", cell) for cell in row[3:6]), row
        assert re.fullmatch(r"\d+\.\d{3}x", row[6]), f"control: {row[6]!r}"
    header = next(line for line in report.splitlines() if line.startswith("| T | floor"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [row for row in rows if len(row) == len(columns) and row[0].isdigit()]
    assert [row[0] for row in rows] == ["8"] * 2
    for row in rows:
        cells = dict(zip(columns, row, strict=True))
        timed = (
            "eager per-layer",
            "stacked eager",
            "torch.compile",
            "hand-stacked torch.compile",
            "dspark_backend",
            "dspark_backend, never lowered",
        )
        for name in timed:
            assert TIME_CELL.fullmatch(cells[name]), f"T={cells['T']} {name}: {cells[name]!r}"
        assert cells["torch.compile"].endswith("(1.00x)")
        assert cells["torch.compile RO"] == cells["dspark_backend RO"] == "n/a (cpu)"
        for ratio in ("dspark_backend ÷ floor", "dspark_backend ÷ hand-stacked", "colocated ÷ hand-stacked"):
            assert re.fullmatch(r"\d+\.\d\dx", cells[ratio]), f"{ratio}: {cells[ratio]!r}"
        assert cells["dspark path"] == "unfused"  # on CPU the pass leaves the GEMMs by default (fuse_on_cpu)
    parity = [line for line in report.splitlines() if "parity at T=8" in line]
    assert len(parity) == 2 * 7 and not any("WRONG" in line for line in parity), "\n".join(parity)
    assert sum("hand-stacked torch.compile: parity" in line for line in parity) == 2
    assert sum("colocated weights: parity" in line for line in parity) == 2
    assert sum("1 graph(s) compiled" in line for line in parity) == 2 * 5  # one dynamic graph for T = 8
    colocated = [line for line in report.splitlines() if line.startswith("  - colocate_weights:")]
    # on CPU the pass fuses no GEMM groups by default, so colocate_weights moves nothing: one group left per spelling
    assert (
        colocated
        == [
            "  - colocate_weights: 0 group(s) of weights moved into one allocation, 1 left as they were"
            " (which and why: DSPARK_FX_LOG=info)"
        ]
        * 2
    ), "\n".join(colocated)
    kept = [line for line in report.splitlines() if line.startswith("- dspark path: K/V writes kept off")]
    assert len(kept) == 2 and all("the tensors are on cpu" in line for line in kept), "\n".join(kept)  # CUDA only
    assert "  - error:" not in report


def test_lone_linears_small_cpu(tmp_path):
    """The lone-linears table: a row per T with a time per variant and the ratios to torch.compile."""
    report = _run_benchmark("lone_linears.py", tmp_path / "lone_linears.md")
    rows = [line for line in report.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "64"], report
    for row in rows:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        assert all(re.fullmatch(r"\d+\.\d", c) for c in cells[1:4]), row  # torch.compile and the two dspark columns
        assert all(re.fullmatch(r"\d+\.\d\dx", c) for c in cells[4:]) and len(cells) == 6, row


def test_host_cost_small_cpu(tmp_path):
    """The host-cost table: a row per layer count with host and wall µs per call (device µs only on CUDA)."""
    report = _run_benchmark("host_cost.py", tmp_path / "host_cost.md")
    rows = [line for line in report.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["5", "32"], report
    for row in rows:
        _, host, device, wall = (cell.strip() for cell in row.strip().strip("|").split("|"))
        assert re.fullmatch(r"\d+\.\d", host) and re.fullmatch(r"\d+\.\d", wall) and device == "—", row
        assert float(host) > 0 and float(wall) >= float(host), row


def test_dspark_write_tensor_parallel_small_cpu(tmp_path):
    """`--tp 1`: a rank process spawned, the row barriers, the gather and the TP table (one rank: two ranks cost a
    minute of a cold CI run; the table of two is `test_tp_table_takes_the_slowest_rank`)."""
    report = _run_benchmark(
        "dspark_write.py",
        tmp_path / "dspark_write_tp.md",
        *("--configs", "small-hd16", "--tokens", "8", "--variants", "compile", "--rounds", "3", "--tp", "1"),
    )  # one variant (torch.compile, always timed): the rank's machinery is what runs here
    titles = [line for line in report.splitlines() if line.startswith("### ")]
    assert titles[0].startswith("### small, head_dim 16, rank 0 of 1: 2 layers, hidden 64, 4/2 heads x 16"), titles
    assert titles[-1].startswith("### small, head_dim 16, tensor parallel 1: per rank 2 of 2 K/V heads"), titles
    header = next(line for line in report.splitlines() if line.startswith("| T | torch.compile | dspark_backend ÷"))
    row = report.splitlines()[report.splitlines().index(header) + 2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "8" and len(cells) == 4, row
    match = re.fullmatch(r"\*\*(\d+\.\d)\*\* \((\d+\.\d)\)", cells[1])  # **max** (rank 0)
    assert match and match[1] == match[2], cells[1]
    assert cells[2:] == ["—", "—"], row  # no dspark_backend column timed
    assert "  - error:" not in report and "WRONG" not in report


def test_tp_table_takes_the_slowest_rank(monkeypatch):
    """The TP table of two ranks: per variant each rank's time and, in bold, the larger; the ratios of the larger
    times; a variant a rank could not time shows its reason and no maximum."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = runpy.run_path(str(ROOT / "benchmarks" / "dspark_write.py"))
    cfg = bench["SMALL_CONFIGS"]["small-hd16"][1]
    variants = tuple(v for v in bench["VARIANTS"] if v.key in ("compile", "hand", "dspark"))
    names = ("torch.compile", "hand-stacked torch.compile", "dspark_backend")
    ranks = [
        bench["TPRun"]("rank 0", [(8, dict(zip(names, (10.0, 6.0, 4.0), strict=True)))]),
        bench["TPRun"]("rank 1", [(8, dict(zip(names, (8.0, "error", 5.0), strict=True)))]),
    ]
    lines = bench["tp_table"]("small", cfg, 2, ranks, variants)
    assert lines[0].startswith("### small, tensor parallel 2: per rank 1 of 2 K/V heads"), lines[0]
    assert lines[-2] == "| 8 | **10.0** (10.0 / 8.0) | 6.0 / error | **5.0** (4.0 / 5.0) | 0.50x | — |", lines[-2]
