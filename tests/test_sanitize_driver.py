"""The compute-sanitizer driver (scripts/sanitize_driver.py) and the profiler's workload (scripts/profile_kv_write.py)
run on the CPU with in-range values, so the calls they make on the GPU stay valid as the ops change."""

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _driver(name: str = "sanitize_driver"):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    return driver


def test_driver_calls_every_op_on_cpu(capsys):
    _driver().main(["--device", "cpu"])
    assert "all calls made on the CPU" in capsys.readouterr().out


def test_profile_workload_writes_every_row_on_cpu(capsys):
    """5 layers x (K, V) x 7 tokens x 2 heads x 16 values written by the op's CPU reference."""
    _driver("profile_kv_write").main(["--device", "cpu", "--config", "tiny", "--tokens", "7", "--calls", "2"])
    assert "tiny write at T = 7 on cpu: 2240 values written" in capsys.readouterr().out
