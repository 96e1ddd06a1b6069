"""No dead ends under ``inprocess-run`` (issue 9): every way a generation can stop
making progress ends in a completed job or a non-zero exit with a reason, in
bounded time, with nothing left running.

Real launcher, controller, store server and workers (``tests/workers/chaos_train.py``,
2 nodes x 2 workers, loopback).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from test_failover_e2e import REPO, Launch, check_after_run

from inprocess.failover.controller import NO_MEMBER_GRACE, STORE_STOP_GRACE

pytestmark = pytest.mark.slow

CHAOS = REPO / "tests" / "workers" / "chaos_train.py"


def launch(tmp_path, *flags: str, steps: int, extra=()) -> Launch:
    return Launch(
        tmp_path,
        *flags,
        script=CHAOS,
        script_args=["--steps", str(steps), "--step-time", "0.03", *extra],
    )


def generation(job: Launch) -> int:
    try:
        return job.state()["generation"]
    except (FileNotFoundError, ValueError):
        return -1


def check_completed(job: Launch, steps: int, timeout: float) -> dict:
    code = job.finish(timeout=timeout)
    assert code == 0, job.output()
    finishes = [e for e in job.events() if e["kind"] == "finish"]
    # each worker that ran to the end reports the exact step count and w
    assert {e["rank"] for e in finishes} == {0, 1, 2, 3}, job.output()
    for e in finishes:
        assert e["result"]["step"] == steps and e["result"]["w"] == float(steps), e
    check_after_run(job)
    return job.state()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_lost_store_server_is_replaced_by_a_new_generation(tmp_path, sig):
    steps = 80  # the store is lost at step 20: 60 more after the cold restart
    with launch(tmp_path, steps=steps) as job:
        job.wait_until(lambda: job.running_at_step(20), timeout=240, what="training")
        pid = job.state()["store"]["pid"]
        log_before = os.path.getsize(job.log.name)
        lost_at = time.monotonic()
        os.kill(pid, sig)
        job.wait_until(lambda: generation(job) == 1, timeout=120, what="a new generation")
        detected = time.monotonic() - lost_at
        state = check_completed(job, steps, timeout=360)
        assert any(e["kind"] == "store_lost" for e in state["events"]), state["events"]
        assert state["store"]["pid"] != pid and state["job_restarts"] == 1
        # no worker was relaunched into the dead store: no worker failure was counted
        assert sum(state["worker_restarts"].values()) == 0, state["events"]
        bound = 5.0 if sig == signal.SIGKILL else STORE_STOP_GRACE + 5.0
        assert detected < bound, detected
        # no log flood (issue 9 saw ~40 KB/s of c10d stack traces)
        assert os.path.getsize(job.log.name) - log_before < 100_000


@pytest.mark.timeout(480)
def test_no_live_member_left_gets_a_cold_restart(tmp_path):
    """Every member stops itself: all end at their hard timeout; the relaunched
    workers have nobody to admit them, so the controller starts a new generation."""
    steps = 80
    with launch(tmp_path, steps=steps, extra=["--stop-all-at", "20"]) as job:
        job.wait_until(lambda: generation(job) == 1, timeout=240, what="a cold restart")
        state = check_completed(job, steps, timeout=360)
        lost = [e for e in state["events"] if e["kind"] == "no_live_member"]
        assert len(lost) == 1 and "no live member" in lost[0]["message"], state["events"]
        restarted = next(e for e in state["events"] if e["kind"] == "job_restart")
        # members were lost at their hard timeout, the job a grace later, not 4 x barrier_timeout
        assert restarted["time"] - lost[0]["time"] < 1.0
        assert NO_MEMBER_GRACE < 30


@pytest.mark.timeout(480)
def test_restart_abort_on_every_rank_ends_the_job_with_its_reason(tmp_path):
    start = time.monotonic()
    with launch(
        tmp_path,
        steps=100_000,
        extra=["--max-iterations", "2", "--fault-every", "15"],
    ) as job:
        code = job.finish(timeout=400)
        assert code != 0, job.output()
        assert time.monotonic() - start < 400
        state = job.state()
        assert state["stage"] == "STOPPED" and state["exit_code"] == code
        assert "max_iterations=2" in state["reason"], state["reason"]
        # nobody was relaunched to rejoin a job that gave up
        assert all(r["incarnation"] == 0 for r in state["workers"].values()), state["workers"]
        assert {r["status"] for r in state["workers"].values()} == {"aborted"}
        check_after_run(job)
        assert "max_iterations=2" in job.output()


@pytest.mark.timeout(600)
def test_stopped_controller_is_replaced(tmp_path):
    # Long enough that the workers still train when the replacement takes over
    # (5 s after the stop): 80 steps ended within that on a quiet machine, and
    # the workers the new controller then relaunched found the job complete.
    steps = 400
    with launch(tmp_path, steps=steps) as job:
        job.wait_until(lambda: job.running_at_step(20), timeout=240, what="training")
        first = int((job.state_dir / "controller.pid").read_text())
        os.kill(first, signal.SIGSTOP)
        job.wait_until(
            lambda: int((job.state_dir / "controller.pid").read_text()) != first,
            timeout=120,
            what="a new controller",
        )
        state = check_completed(job, steps, timeout=360)
        assert any(e["kind"] == "recover" for e in state["events"])


@pytest.mark.timeout(480)
def test_stop_request_to_a_stopped_controller_still_stops_the_job(tmp_path):
    # SIGTERM cannot be acted on by a stopped controller; it is pending when the
    # supervisor replaces it, and the job stops as the request asked.
    with launch(tmp_path, steps=300) as job:
        job.wait_until(lambda: job.running_at_step(20), timeout=240, what="training")
        pid = int((job.state_dir / "controller.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        job.wait_until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED)
        os.kill(pid, signal.SIGTERM)
        code = job.finish(timeout=120)
        assert code == 128 + signal.SIGTERM, job.output()
        assert job.state()["reason"] == "stopped by SIGTERM", job.output()
        check_after_run(job)
