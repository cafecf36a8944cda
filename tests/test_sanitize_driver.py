"""The compute-sanitizer driver (scripts/sanitize_driver.py) runs on the CPU with in-range values, so the calls it
makes on the GPU stay valid as the ops change."""

import importlib.util
from pathlib import Path

DRIVER = Path(__file__).resolve().parents[1] / "scripts" / "sanitize_driver.py"


def _driver():
    spec = importlib.util.spec_from_file_location("sanitize_driver", DRIVER)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    return driver


def test_driver_calls_every_op_on_cpu(capsys):
    _driver().main(["--device", "cpu"])
    assert "all calls made on the CPU" in capsys.readouterr().out


def test_driver_racecheck_calls_on_cpu(capsys):
    """The calls of racecheck's run (every fused k-warp with a K step) stay valid too."""
    driver = _driver()
    driver.main(["--device", "cpu", "--only", "multi_linear_kv_write", "--racecheck"])
    assert "all calls made on the CPU" in capsys.readouterr().out
    assert driver.RACECHECK
