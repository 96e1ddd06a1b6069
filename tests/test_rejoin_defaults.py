"""A SIGKILLed worker back in the job with the Wrapper's default settings (issue 37).

``@inprocess.Wrapper()`` with no settings (1 s intervals, 1 s ``last_call_wait``)
under a default ``inprocess-run --nproc-per-node 4`` (a warm standby). The join
path must not wait on those intervals: the replacement's join request is heard
through the fault watch and ends the survivors' last-call wait; a monitor process
that is a fresh interpreter (the fork is not safe: here a thread the script
started, a stand-in for CUDA initialized before the call) starts beside the
rank instead of before its join. The figure is ``benchmarks/rejoin_defaults.py``'s;
the bound here is the behaviour's, generous for a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from launcher import run_job
from test_failover_e2e import REPO, Launch, check_after_run
from test_restart import FAST

from inprocess import records as R
from inprocess.records import read_jsonl

pytestmark = pytest.mark.slow

SCRIPT = REPO / "benchmarks" / "workers" / "default_train.py"
#: kill -> full size, seconds: the benchmark's target is 1 s; minutes before the change
BOUND = 10.0
#: a default inprocess-run, on one node (Launch's own are two nodes of 2 and a 50 ms
#: controller interval: these flags, given after, take their place)
DEFAULT_RUN = ("--nnodes", "1", "--nproc-per-node", "4", "--monitor-interval", "0.1")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("monitor", ["forked", "spawned"])
def test_killed_worker_is_back_at_full_size_with_default_settings(tmp_path, monitor):
    """The replacement is admitted at the survivors' first restart or the next, within
    :data:`BOUND` of the kill; its ``join`` record has the timeline (process start,
    call start, monitor ready, join request, admitted) in that order, and says how
    its monitor process started; the job then ends at full size with every step
    applied once, and nothing of it is left."""
    stop = tmp_path / "stop"
    script_args = ["--steps", "100000", "--step-time", "0.03", "--stop-file", str(stop)]
    if monitor == "spawned":
        script_args.append("--fork-unsafe")
    with Launch(tmp_path, *DEFAULT_RUN, script=SCRIPT, script_args=script_args) as launch:
        launch.wait_until(lambda: launch.training_under_the_wrapper(20), what="training")
        pid = launch.state()["workers"]["2"]["pid"]
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        launch.wait_until(
            lambda: launch.full_size_since(killed_at), timeout=120, what="full size again"
        )
        back = max(
            e["time"]
            for e in launch.events()
            if e["kind"] == "start" and e["time"] > killed_at and e["world"] == 4
        )
        at = launch.step()
        launch.wait_until(lambda: launch.running_at_step(at + 10), what="training")
        stop.touch()
        assert launch.finish(180) == 0, launch.output()
        finishes = [e for e in launch.events() if e["kind"] == "finish"]
        assert sorted(e["rank"] for e in finishes) == [0, 1, 2, 3], launch.output()
        steps = finishes[0]["result"]["step"]
        assert all(e["result"] == {"step": steps, "w": float(steps), "world": 4} for e in finishes)
        check_after_run(launch)
        assert back - killed_at <= BOUND, (back - killed_at, launch.output())
        joins = [r for r in read_jsonl(launch.state_dir / "restarts.jsonl") if r["type"] == "join"]
        assert len(joins) == 1, joins
        join = joins[0]
        assert join["initial_rank"] == 2 and join["monitor"] == monitor, join
        order = ["call_start", "join_request", "admitted"]
        assert [join[k] for k in order] == sorted(join[k] for k in order), join
        assert join["process_start"] <= join["call_start"], join
        assert killed_at - 1 <= join["call_start"] <= killed_at + BOUND, (killed_at, join)
        if monitor == "forked":  # ready before the join request: a fork is waited for
            assert join["call_start"] <= join["monitor_ready"] <= join["join_request"], join
        else:  # never waited for: ready after the request, or not yet at the admission
            assert join["monitor_ready"] is None or join["monitor_ready"] > join["call_start"]
        json.dumps(join)  # one plain JSON object


@pytest.mark.timeout(180)
def test_a_rank_lost_before_its_monitor_process_is_up_is_still_reported(tmp_path):
    """Rank 1 is SIGKILLed at its first step, long before its monitor process (a fresh
    interpreter importing torch, started beside it) is up; nothing else can report it
    (it never joined its node group). Once up, the monitor process finds it gone,
    through the pidfd the rank opened for it, and records its death: rank 0 goes on
    without it, well before the 90 s barrier timeout."""
    faults = [{"iteration": 0, "rank": 1, "step": 1, "kind": "kill", "others": "allreduce"}]
    path = tmp_path / "restarts.jsonl"
    started = time.monotonic()
    result = run_job(
        "scenario.py",
        2,
        tmp_path,
        {"wrapper": FAST, "steps": 3, "faults": faults, "fork_unsafe": True},
        timeout=150,
        env={R.RECORDS_ENV: str(path)},
    )
    elapsed = time.monotonic() - started
    assert result.ranks[0].returncode == 0, result.describe()
    assert result.ranks[1].returncode == -signal.SIGKILL, result.describe()
    assert elapsed < FAST["barrier_timeout"], result.describe()
    restarts = [r for r in read_jsonl(path) if r["type"] == "restart"]
    died = [f for r in restarts for f in r["faults"] if f["detail"] == "process died"]
    assert [f["initial_rank"] for f in died] == [1], restarts
