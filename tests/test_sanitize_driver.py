"""The compute-sanitizer driver (scripts/sanitize_driver.py) runs on the CPU with in-range values, so the calls it
makes on the GPU stay valid as the ops change."""

import importlib.util
from pathlib import Path

DRIVER = Path(__file__).resolve().parents[1] / "scripts" / "sanitize_driver.py"


def test_driver_calls_every_op_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("sanitize_driver", DRIVER)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    driver.main(["--device", "cpu"])
    assert "all calls made on the CPU" in capsys.readouterr().out
