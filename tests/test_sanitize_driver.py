"""The compute-sanitizer driver (scripts/sanitize_driver.py) and the profiler's workload (scripts/profile_kv_write.py)
run on the CPU with in-range values, so the calls they make on the GPU stay valid as the ops change."""

import importlib.util
from pathlib import Path
from unittest import mock

import torch

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


def test_benchmark_dims_group_is_opt_in_and_runs_on_cpu():
    """The write at the benchmark's dims runs only when named (its tensors are hundreds of MB); here at small dims on
    the CPU, each call changes exactly the cache slots it addresses (the caches start random)."""
    driver = _driver()
    assert "benchmark_dims" not in driver.GROUPS
    driver.DEV = "cpu"
    tokens_seen = []
    real = torch.ops.dspark.multi_linear_kv_write

    def checked(*args):
        caches, loc = args[12] + args[13], args[14]
        before = [c.clone() for c in caches]
        real(*args)
        addressed = torch.zeros(caches[0].shape[0], dtype=torch.bool)
        addressed[loc] = True
        for old, new in zip(before, caches, strict=True):
            assert torch.equal((old != new).flatten(1).any(1), addressed)
        tokens_seen.append(args[0].shape[0])

    with mock.patch.object(torch.ops.dspark, "multi_linear_kv_write", checked):
        driver.write_at_benchmark_dims(
            torch.Generator().manual_seed(0), dims=((64, 2, 16, 32),), token_counts=(1, 5), layers=2, slots=16
        )
    assert tokens_seen == [1, 5]


def test_only_takes_several_groups():
    """`--only dsv4 flashmla` (gpu_check.sh's SANITIZE_ONLY="dsv4 flashmla") makes those two groups and no other."""
    driver = _driver()
    made = []
    with (
        mock.patch.object(driver, "flashmla_ops", lambda gen: made.append("flashmla")),
        mock.patch.object(driver, "dsv4_compressor", lambda *args: made.append("dsv4")),
        mock.patch.object(driver, "multi_linear", lambda gen: made.append("multi_linear")),
        mock.patch.object(driver, "multi_linear_kv_write", lambda gen: made.append("multi_linear_kv_write")),
    ):
        driver.main(["--device", "cpu", "--only", "dsv4", "flashmla"])
    assert set(made) == {"flashmla", "dsv4"}
