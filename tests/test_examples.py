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
    assert "torch.compile(backend=dspark_backend, fuse_on_cpu)" in out and "graph diff" not in out


@pytest.mark.slow
def test_demo_diff_shows_the_rewrite_it_reports():
    """`--diff` compiles with the demo's config (on CPU `fuse_on_cpu`): the diff holds the fused GEMM."""
    demo = [sys.executable, str(ROOT / "examples" / "dspark_draft.py"), "--device", "cpu", "--tokens", "8", "--diff"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(demo, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    diff = out.split("--- graph diff (post-grad ATen graph, before/after dspark_fx) ---", 1)[1]
    assert "+" in diff and "torch.ops.dspark.multi_linear.default" in diff, out


@pytest.mark.slow
def test_tp_example_runs_under_torchrun_on_two_cpu_ranks():
    """`torchrun --nproc-per-node 2 examples/tp_draft.py` on CPU (gloo, Inductor): one line per rank, lowering the
    K/V writes of the rank's heads, keeping the collectives in order in Inductor's post-grad graph and matching the
    unsharded draft. One sharding kind (DTensor), as each kind compiles the draft on every rank again: both kinds, on 2
    and 4 ranks, are tests/test_tensor_parallel.py's."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run += [str(ROOT / "examples" / "tp_draft.py"), "--kv-write-op", "always", "--kinds", "dtensor"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        # each rank's pass runs (a graph from the FX graph or AOTAutograd cache would skip it); the ranks share
        # Inductor's cache of compiled kernels (both build the same ones: one builds, the other loads)
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }
    out = _torchrun(run, env)
    lines = [line for line in out.splitlines() if line.startswith("[rank ")]
    fused = {"dtensor": "4 fused GEMM groups (10 GEMMs), 0 lone GEMMs"}  # lone GEMMs are routed on CUDA only
    expected = [(rank, "dtensor") for rank in (0, 1)]
    assert len(lines) == len(expected), out
    for line, (rank, kind) in zip(lines, expected, strict=True):
        assert line.startswith(f"[rank {rank}] {kind}") and fused[kind] in line, out
        assert "K/V writes -> 1 multi_linear_kv_write; 4 all-reduces kept in order;" in line, out
        assert f"parity (K/V heads {4 * rank}:{4 * rank + 4}): OK" in line, out


_PORT_TAKEN = ("address already in use", "eaddrinuse", "failed to bind", "server socket has failed to listen")


def _torchrun(run: list[str], env: dict[str, str]) -> str:
    """torchrun's stdout; a failure shows its stderr. One retry when a rendezvous port was taken in between (another
    test process can bind the free port torchrun picked before torchrun does): that is the machine, not the example.
    A second failure fails, and so does any other failure (a gloo rank aborting at exit included: the example ends
    its gloo ranks before the interpreter's teardown, see `_exit_before_interpreter_teardown`)."""
    for attempt in range(2):
        done = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout
        if attempt == 0 and any(s in done.stderr.lower() for s in _PORT_TAKEN):
            continue
        break
    pytest.fail(f"torchrun exited {done.returncode}\nstdout:\n{done.stdout}\nstderr (tail):\n{done.stderr[-6000:]}")
