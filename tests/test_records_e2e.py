"""Restart records and controller events of real jobs (issue 14)."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
from launcher import run_job
from test_failover_e2e import ENV, RUN, Launch
from test_restart import FAST

from inprocess import records as R
from inprocess import report

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
def test_records_name_rank_cause_and_phases_of_injected_faults(tmp_path):
    # iteration 0: rank 1 raises; 1: rank 2 is SIGKILLed; 2: rank 3 hangs (soft timeout)
    faults = [
        {"iteration": 0, "rank": 1, "step": 1, "kind": "raise", "others": "allreduce"},
        {"iteration": 1, "rank": 2, "step": 1, "kind": "kill", "others": "allreduce"},
        # the others run Python meanwhile (1.2 s of steps): rank 3 is the first to stall
        {"iteration": 2, "rank": 3, "step": 1, "kind": "sleep", "others": "python"},
    ]
    wrapper = dict(FAST, soft_timeout=2, hard_timeout=40)
    path = tmp_path / "restarts.jsonl"
    result = run_job(
        "scenario.py",
        4,
        tmp_path,
        {"wrapper": wrapper, "steps": 4, "faults": faults, "python_step_seconds": 0.3},
        timeout=120,
        env={R.RECORDS_ENV: str(path)},
    )
    for rank in (0, 1, 3):
        assert result.ranks[rank].returncode == 0, result.describe()
    records = R.read_jsonl(path)
    restarts = [r for r in records if r["type"] == "restart"]
    assert [r["iteration"] for r in restarts] == [0, 1, 2], restarts
    expected = [(1, 1, "exception"), (2, 2, "signal"), (2, 3, "hang")]  # (rank, initial, cause)
    for record, (rank, initial, cause) in zip(restarts, expected, strict=True):
        root = record["faults"][0]
        assert (root["rank"], root["initial_rank"], root["cause"]) == (rank, initial, cause), record
        assert set(record["phases"]) == set(R.PHASES), record
        assert 0 <= record["latency"] < 30
        assert sum(record["phases"].values()) <= record["latency"] * 1.5 + 0.05, record
    assert "RuntimeError: injected fault" in restarts[0]["faults"][0]["detail"]
    assert restarts[1]["terminated"] == [2] and restarts[1]["world_size"] == 3
    assert restarts[2]["world_size"] == 3
    # one restart record each (rank 0 writes them), iteration records of every rank
    starts = [r for r in records if r["type"] == "iteration" and r["state"] == "start"]
    assert {r["initial_rank"] for r in starts} == {0, 1, 2, 3}
    assert len([r for r in records if r["type"] == "completed"]) == 1
    s = report.summarize(records)
    assert s["restarts"] == 3 and s["faults_by_kind"] == {"exception": 1, "signal": 1, "hang": 1}
    assert 0 < s["goodput"] < 1


@pytest.mark.timeout(180)
def test_controller_events_of_a_worker_kill_and_the_report(tmp_path):
    steps = 500  # 10 s of training: the kill lands while it trains, even on a loaded machine
    flags = ("--nnodes", "1", "--nproc-per-node", "2")
    with Launch(
        tmp_path, *flags, script_args=["--steps", str(steps), "--step-time", "0.02"]
    ) as launch:
        # killed once the controller knows the job recovers in-process: a relaunch, not a
        # cold restart
        launch.wait_until(
            lambda: launch.running_at_step(20) and launch.state()["wrapper_managed"] is True,
            what="training under the Wrapper",
        )
        pid = launch.state()["workers"]["1"]["pid"]
        os.kill(pid, signal.SIGKILL)
        code = launch.finish(150)
        assert code == 0, launch.output()
    events = R.read_jsonl(launch.state_dir / R.EVENTS_FILE)
    names = [e["event"] for e in events]
    assert names[0] == "job_start" and names[-1] == "job_end", names
    assert events[0]["target"] == 2 and events[-1]["returncode"] == 0
    kill = next(e for e in events if e["event"] == "worker_exit" and e["pid"] == pid)
    assert (kill["rank"], kill["node"], kill["local_rank"], kill["signal"]) == (1, 0, 1, 9)
    assert kill["expected"] is False and kill["world_size"] == 1
    relaunch = next(e for e in events if e["event"] == "worker_relaunch")
    assert relaunch["rank"] == 1 and relaunch["pid"] != pid and relaunch["time"] >= kill["time"]
    for e in events:
        assert set(R.EVENT_FIELDS) <= set(e)
    # the Wrapper's records went to the state dir by default
    restarts = R.read_jsonl(launch.state_dir / R.RESTARTS_FILE)
    restarts = [r for r in restarts if r["type"] == "restart"]
    assert any(
        f["initial_rank"] == 1 and f["cause"] == "signal" for r in restarts for f in r["faults"]
    ), restarts
    assert restarts[0]["terminated"] == [1] and restarts[0]["world_size"] == 1, restarts
    pytest.importorskip("matplotlib")
    out = subprocess.run(
        [*RUN, "report", str(launch.state_dir), "--plot", str(tmp_path / "t.png")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"worker relaunches +1\n", out.stdout), out.stdout
    assert re.search(r"faults by kind +signal 1\n", out.stdout), out.stdout
    assert "exit code 0" in out.stdout, out.stdout
    assert (tmp_path / "t.png").stat().st_size > 0
