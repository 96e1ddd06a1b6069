"""Scripts in the usage guide's shape under a real launcher: torchrun (it ships with torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import MARKER, REPO, WORKERS, free_port, job_processes

pytestmark = pytest.mark.slow


def torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("store_port", ["MASTER_PORT", "MASTER_PORT+2"])
def test_torchrun_runs_the_guide_script(tmp_path, nproc, store_port):
    """torchrun's agent hosts the store at MASTER_PORT only: the Wrapper's store
    there is a client of it; at another port initial rank 0 hosts it. Both run,
    and restart after a fault."""
    port = free_port()
    marker = os.urandom(8).hex()
    env = dict(os.environ)
    env.update(
        TEST_REPORT_DIR=str(tmp_path),
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
        RES_OPTIONS="timeout:1 attempts:1",
        OMP_NUM_THREADS="1",
    )
    env[MARKER] = marker
    if store_port == "MASTER_PORT+2":
        env["TEST_STORE_PORT_OFFSET"] = "2"
    command = [
        *torchrun(),
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(port),
        str(WORKERS / "guide_train.py"),
    ]
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    finally:
        leftovers = job_processes(marker)
        for proc in leftovers:
            proc.kill()
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-10000:]
    for rank in range(nproc):
        results = json.loads((tmp_path / f"report{rank}.json").read_text())
        assert results == [{"iteration": 1, "sum": nproc * nproc}]
    assert not leftovers, f"processes left behind: {leftovers}"
