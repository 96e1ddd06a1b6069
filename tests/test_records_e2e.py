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
    # A survivor's collective may break ("Connection reset by peer") and restart before
    # the killed rank's monitor records its death: then the death is the next restart's
    # root cause, and the first one's is "connection".
    caused = [r for r in restarts if r["faults"][0]["cause"] != "connection"]
    roots = [(r["faults"][0]["initial_rank"], r["faults"][0]["cause"]) for r in caused]
    assert roots == [(1, "exception"), (2, "signal"), (3, "hang")], restarts
    assert len(restarts) <= 4, restarts
    for record in restarts:
        assert set(record["phases"]) == set(R.PHASES), record
        assert 0 <= record["latency"] < 30
        # each phase (the slowest rank's) lies within the fault-to-function window
        assert max(record["phases"].values()) <= record["latency"] + 0.05, record
    raised, killed, hung = caused
    assert raised["faults"][0]["rank"] == 1 and raised["iteration"] == 0
    assert "RuntimeError: injected fault" in raised["faults"][0]["detail"]
    assert killed["world_size"] == 3 and killed["faults"][0]["detail"] == "process died"
    assert killed["terminated"] == [2] or killed["faults"][0]["rank"] is None, killed
    assert hung["faults"][0]["rank"] == 2 and hung["world_size"] == 3  # rank 2 after the kill
    # one restart record each (rank 0 writes them), iteration records of every rank
    starts = [r for r in records if r["type"] == "iteration" and r["state"] == "start"]
    assert {r["initial_rank"] for r in starts} == {0, 1, 2, 3}
    assert len([r for r in records if r["type"] == "completed"]) == 1
    s = report.summarize(records)
    assert s["restarts"] == len(restarts)
    assert {k: n for k, n in s["faults_by_kind"].items() if k != "connection"} == {
        "exception": 1,
        "signal": 1,
        "hang": 1,
    }
    assert 0 < s["goodput"] < 1


@pytest.mark.timeout(180)
def test_controller_events_of_a_worker_kill_and_the_report(tmp_path):
    steps = 5000  # trains until the test stops it (SIGTERM) once the relaunch is recorded
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

        def recorded() -> bool:
            relaunched = any(
                e["event"] == "worker_relaunch"
                for e in R.read_jsonl(launch.state_dir / R.EVENTS_FILE)
            )
            restarts = R.read_jsonl(launch.state_dir / R.RESTARTS_FILE)
            return relaunched and any(r["type"] == "restart" for r in restarts)

        launch.wait_until(recorded, what="the relaunch and the restart recorded")
        launch.proc.send_signal(signal.SIGTERM)
        code = launch.finish(120)
        assert code == 128 + signal.SIGTERM, launch.output()
    events = R.read_jsonl(launch.state_dir / R.EVENTS_FILE)
    names = [e["event"] for e in events]
    assert names[0] == "job_start" and names[-1] == "job_end", names
    assert events[0]["target"] == 2 and events[-1]["returncode"] == 128 + signal.SIGTERM
    assert "SIGTERM" in events[-1]["detail"]
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
    killed = next(r for r in restarts if r["faults"][0]["cause"] == "signal")
    assert killed["world_size"] == 1, restarts
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
    assert re.search(r"faults by kind .*signal 1", out.stdout), out.stdout
    assert "exit code 143" in out.stdout, out.stdout
    assert (tmp_path / "t.png").stat().st_size > 0
