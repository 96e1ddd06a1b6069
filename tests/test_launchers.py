"""Store hosting that matches the launcher, and the usage guide's script under a real
torchrun (it ships with torch)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from launcher import MARKER, REPO, WORKERS, free_port, job_processes

import inprocess
from inprocess.store import externally_hosted


def torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def run_torchrun(
    tmp_path: Path, script: str, nproc: int, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], list]:
    """Runs ``tests/workers/<script>`` under a real torchrun; returns the run and
    whatever of it was still alive 15 s after torchrun ended (then killed)."""
    port = free_port()
    marker = os.urandom(8).hex()
    env = dict(os.environ)
    env.update(
        TEST_REPORT_DIR=str(tmp_path),
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
        RES_OPTIONS="timeout:1 attempts:1",
        OMP_NUM_THREADS="1",
        **(extra_env or {}),
    )
    env[MARKER] = marker
    command = [
        *torchrun(),
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(port),
        str(WORKERS / script),
    ]
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    finally:
        deadline = time.monotonic() + 15  # monitor processes exit on their own, soon
        while (leftovers := job_processes(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in leftovers:
            proc.kill()
    return run, leftovers


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("store_port", "nproc"), [("MASTER_PORT", 2), ("MASTER_PORT+2", 4)])
def test_torchrun_runs_the_guide_script(tmp_path, nproc, store_port):
    """torchrun's agent hosts the store at MASTER_PORT only: the Wrapper's store
    there is a client of it; at another port initial rank 0 hosts it. Both run,
    and restart after a fault (one world size each: every rank of a torchrun job
    pays ``import torch``, the slow part of these tests)."""
    extra = {"TEST_STORE_PORT_OFFSET": "2"} if store_port == "MASTER_PORT+2" else {}
    run, leftovers = run_torchrun(tmp_path, "guide_train.py", nproc, extra)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-10000:]
    for rank in range(nproc):
        results = json.loads((tmp_path / f"report{rank}.json").read_text())
        assert results == [{"iteration": 1, "sum": nproc * nproc}]
    assert not leftovers, f"processes left behind: {leftovers}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_runs_a_newer_generation_script(tmp_path):
    """A script in the newer generation's style (frozen-state callbacks, ctx rank
    assignment, hang protection off around a step) under a real torchrun: four
    injected faults, four in-process restarts, every rank finishes."""
    run, leftovers = run_torchrun(tmp_path, "newer_train.py", 4)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-10000:]
    finished = [json.loads((tmp_path / f"report{rank}.json").read_text()) for rank in range(4)]
    assert finished == [4] * 4, finished
    assert not leftovers, f"processes left behind: {leftovers}"


def test_store_is_hosted_where_the_launcher_does_not(monkeypatch):
    """A launcher (torchrun's agent, inprocess-run) hosts only MASTER_ADDR:MASTER_PORT;
    any other store is hosted by initial rank 0, and an explicit is_master wins."""
    short = {"timeout": datetime.timedelta(seconds=30)}
    agent_port, other_port = free_port(), free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_port))
    monkeypatch.setenv("RANK", "0")
    # without a launcher's agent store, initial rank 0 hosts even MASTER_PORT
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert not externally_hosted("127.0.0.1", agent_port)
    store = inprocess.store.TCPStore(**short)
    assert store.is_master
    del store

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert externally_hosted("127.0.0.1", agent_port)
    assert not externally_hosted("127.0.0.1", other_port)
    assert not externally_hosted("127.0.0.2", agent_port)
    agent = dist.TCPStore("127.0.0.1", agent_port, None, True, **short)  # the launcher's
    stores = []
    try:
        # at MASTER_PORT every rank, initial rank 0 too, is a client of the agent
        stores.append(inprocess.store.TCPStore(**short))
        assert not stores[-1].is_master
        stores[-1].set("seen", "1")
        assert agent.get("seen") == b"1"
        # at another port (the guide's MASTER_PORT + 2) initial rank 0 hosts ...
        stores.append(inprocess.store.TCPStore(port=other_port, **short))
        assert stores[-1].is_master
        # ... and the others connect to it
        monkeypatch.setenv("RANK", "1")
        stores.append(inprocess.store.TCPStore(port=other_port, **short))
        assert not stores[-1].is_master
        # the user's is_master is final
        stores.clear()
        stores.append(inprocess.store.TCPStore(port=other_port, is_master=True, **short))
        assert stores[-1].is_master
        monkeypatch.setenv("RANK", "0")
        stores.append(inprocess.store.TCPStore(port=other_port, is_master=False, **short))
        assert not stores[-1].is_master
    finally:
        stores.clear()
        del agent
