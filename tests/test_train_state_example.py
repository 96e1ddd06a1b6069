"""``examples/train_state.py`` under ``inprocess-run``: exceptions redo no step, no file."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from inprocess import report
from inprocess.failover.supervisor import job_processes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train_state.py"


@pytest.mark.timeout(240)
def test_exceptions_redo_no_step_and_the_report_shows_the_state(tmp_path):
    state_dir, out = tmp_path / "state", tmp_path / "out"
    job_id = f"test-{os.getpid()}-{time.monotonic_ns()}"
    steps = 45
    env = dict(
        os.environ,
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
        RES_OPTIONS="timeout:1 attempts:1",
    )
    command = [
        sys.executable, "-m", "inprocess.failover.cli",
        "--nnodes", "1", "--nproc-per-node", "2",
        "--state-dir", str(state_dir), "--job-id", job_id, "--monitor-interval", "0.05",
        str(TRAIN), "--result-dir", str(out), "--steps", str(steps),
        "--step-time", "0.01", "--fault-every", "15", "--seed", "1",
    ]  # fmt: skip
    with open(tmp_path / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=200)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for p in job_processes(job_id):
                with contextlib.suppress(psutil.Error):
                    p.kill()
    output = (tmp_path / "launcher.log").read_text(errors="replace")
    assert returncode == 0, output
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x]
    finishes = [e["result"] for e in events if e["kind"] == "finish"]
    assert finishes == [{"step": steps, "w": float(steps), "world": 2}] * 2, output
    assert not (out / "checkpoint.json").exists()  # the state lived in memory only
    faults = [e["step"] for e in events if e["kind"] == "fault"]
    assert faults == [15, 30], output
    # every restart resumed at the step of its fault: nothing redone, from own memory
    restarted = [e for e in events if e["kind"] == "start" and e["iteration"] > 0]
    assert sorted({e["step"] for e in restarted}) == faults
    assert all(e["completed"] - e["step"] == 0 for e in restarted)
    state = report.summarize(report.load([state_dir]))["state"]
    assert state["recoveries"] == 2 and state["redone_steps"]["total"] == 0
    assert state["sources"] == {"memory": 4, "none": 2}
