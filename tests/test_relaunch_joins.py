"""A relaunched worker joins the job, or is replaced; the job never waits for it forever.

* At the initial barrier a newer incarnation of a rank replaces the arrival its
  predecessor left there (one arrival per rank), while two processes given one
  rank are still refused.
* The job controller gives a started worker of a Wrapper job a bounded time to
  join (a stopped standby that took a dead worker's place never does): it is
  replaced by a fresh process, and the job goes on and finishes exactly.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import threading

import psutil
import pytest
from test_failover_e2e import check_after_run
from test_failover_standby import _Job, _running_pids, _standbys, _state, _wait

from inprocess import Wrapper
from inprocess import protocol as P
from inprocess.exception import InternalError
from inprocess.state import State
from inprocess.store import BarrierTimeout, PrefixStore, TCPStore, new_identity
from inprocess.wrap import CallWrapper

TD = datetime.timedelta(seconds=120)
NS = "inprocess/relaunch/call0"


# ---------------------------------------------------------------- the initial barrier


def _initial_barrier(port: int, initial_rank: int, identity: str | None, timeout: float):
    """One rank's initial barrier of a 2-rank job, through a Wrapper's call; returns
    the initial membership or the exception it raised."""
    s = datetime.timedelta(seconds=1)
    wrapper = Wrapper(
        abort=None,
        monitor_thread_interval=s / 20,
        monitor_process_interval=s / 20,
        progress_watchdog_interval=s / 20,
        heartbeat_interval=s / 20,
        soft_timeout=s / 5,
        hard_timeout=s / 4,
        heartbeat_timeout=s / 3,
        barrier_timeout=s * timeout,
    )
    cw = CallWrapper(wrapper)
    cw.state = State(rank=initial_rank, world_size=2)
    cw.namespace = NS
    cw.identity = identity or cw._call_identity()
    cw.store = PrefixStore(NS, TCPStore(host_name="127.0.0.1", port=port))
    try:
        return cw._initial_barrier()
    except BaseException as ex:  # reported to the test
        return ex
    finally:
        cw.store = None


@pytest.mark.timeout(300)
def test_a_relaunched_rank_replaces_its_predecessors_initial_arrival():
    """Rank 1's first process arrives, times out and is gone; its relaunch (a newer
    incarnation) arrives before rank 0: the barrier counts rank 1 once and completes
    with the relaunched process when rank 0 comes."""
    server = TCPStore(host_name="127.0.0.1", port=0, is_master=True, timeout=TD)
    port = server.port
    results: dict[int, object] = {}
    try:
        first = _initial_barrier(port, 1, None, timeout=1.0)
        assert isinstance(first, InternalError | BarrierTimeout), first
        del first
        relaunched = new_identity(1, 1)

        def rank(initial_rank: int, identity: str | None) -> None:
            results[initial_rank] = _initial_barrier(port, initial_rank, identity, 120.0)

        late = threading.Thread(target=rank, args=(1, relaunched))
        late.start()
        # rank 0 comes once the relaunch's arrival is in (it makes two for rank 1)
        count = P.count_key(P.INITIAL)
        look = PrefixStore(NS, TCPStore(host_name="127.0.0.1", port=port))
        _wait(lambda: look.counter(count) >= 2, 60, "the relaunch's arrival")
        look = None
        rank(0, None)
        late.join(150)
        assert not late.is_alive()
        errors = {r: repr(v) for r, v in results.items() if isinstance(v, BaseException)}
        assert not errors, errors
        token = P.launch_token(NS)
        expected = (P.launch_identity(0, token), relaunched)
        assert tuple(results[0]) == expected, results
        assert tuple(results[1]) == expected, results
    finally:
        results.clear()  # (an exception holds its frames: their stores)
        del server


def test_latest_incarnations_keeps_one_incarnation_per_rank():
    arrivals = ["1/0.aaaa", "0/0.bbbb", "1/2.cccc", "1/1.dddd", "2/0.eeee", "2/0.ffff", "x"]
    assert P.latest_incarnations(arrivals) == ["0/0.bbbb", "1/2.cccc", "2/0.eeee", "2/0.ffff", "x"]
    assert P.latest_incarnations([]) == []
    assert P.latest_incarnations(["3/x.abc", "3/1.abc"]) == ["3/x.abc", "3/1.abc"]


# ---------------------------------------------------------------- the job controller


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stopped_standby_in_a_dead_workers_place_is_replaced_and_the_job_finishes(tmp_path):
    """A standby is stopped (SIGSTOP), then worker 1 is killed: the controller hands
    worker 1's place to the stopped standby, which never joins; past its deadline
    it is replaced by a fresh process (not the node's next standby), which joins;
    the job then finishes at full size with every step applied exactly once, and
    nothing of it is left running."""
    job = _Job(tmp_path, "--standby-join-timeout", "8")
    standby = None
    try:
        _wait(lambda: _state(job.state_dir).get("wrapper_managed"), 240, "the Wrapper job")
        # (a standby comes once the node's zygote has imported torch: minutes when loaded)
        (standby,) = _wait(lambda: _standbys(job.job_id), 240, "the node's standby")
        workers = _running_pids(job.state_dir)
        assert set(workers) == {0, 1}
        os.kill(standby.pid, signal.SIGSTOP)
        os.kill(workers[1], signal.SIGKILL)
        _wait(
            lambda: _running_pids(job.state_dir).get(1) == standby.pid, 60, "the stopped standby"
        )
        fresh = _wait(
            lambda: (p := _running_pids(job.state_dir).get(1)) not in (None, standby.pid) and p,
            120,
            "its replacement",
        )
        assert not psutil.pid_exists(standby.pid) or _zombie(standby.pid)
        assert fresh not in {p.pid for p in _standbys(job.job_id)}
        record = _state(job.state_dir)["workers"]["1"]
        assert record["incarnation"] == 2, record
        assert record["join_timeout"] == 300, record  # a fresh process: the generous default
        _wait(lambda: _state(job.state_dir)["workers"]["1"]["joined"], 300, "it joins")
        state = _state(job.state_dir)
        assert state["worker_restarts"] == {"0": 0, "1": 1}  # the stopped standby: no failure
        assert any(e["kind"] == "worker_join_overdue" for e in state["events"])
        relaunches = [
            json.loads(line)
            for line in (job.state_dir / "events.jsonl").read_text().splitlines()
            if '"worker_relaunch"' in line
        ]
        assert [e["detail"] for e in relaunches][-1].startswith("a fresh process"), relaunches
        # back at full size, then the end
        _wait(
            lambda: any(
                e["kind"] == "start" and e["world"] == 2 and e["incarnation"] == 2
                for e in job.events()
            ),
            240,
            "full size again",
        )
        job.stop_file.touch()
        assert job.proc.wait(240) == 0, job.output()
        finishes = [e for e in job.events() if e["kind"] == "finish"]
        assert sorted(e["rank"] for e in finishes) == [0, 1], job.output()
        steps = finishes[0]["result"]["step"]
        for e in finishes:
            assert e["result"] == {"step": steps, "w": float(steps), "world": 2}
        check_after_run(job)
    finally:
        if standby is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(standby.pid, signal.SIGKILL)
        job.close()


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stopped_standby_in_a_cold_restart_is_replaced_at_the_initial_barrier(tmp_path):
    """The store server is killed while a standby is stopped: the cold restart's new
    generation hands a worker's place to the stopped standby, and the other worker
    waits at the initial barrier; past its deadline the stopped one is replaced by a
    fresh process, whose arrival completes the barrier, and the job finishes exactly."""
    job = _Job(tmp_path, "--standby-join-timeout", "8")
    standby = None
    try:
        _wait(lambda: _state(job.state_dir).get("wrapper_managed"), 240, "the Wrapper job")
        (standby,) = _wait(lambda: _standbys(job.job_id), 240, "the node's standby")
        os.kill(standby.pid, signal.SIGSTOP)
        os.kill(_state(job.state_dir)["store"]["pid"], signal.SIGKILL)
        taken = _wait(
            lambda: [w for w, p in _running_pids(job.state_dir).items() if p == standby.pid],
            120,
            "the cold restart taking the stopped standby",
        )
        (worker,) = taken
        assert _state(job.state_dir)["generation"] == 1
        _wait(
            lambda: (r := _state(job.state_dir)["workers"][str(worker)])["pid"] != standby.pid
            and r["joined"],
            300,
            "its replacement at the initial barrier",
        )
        job.stop_file.touch()
        assert job.proc.wait(240) == 0, job.output()
        finishes = [e for e in job.events() if e["kind"] == "finish"]
        assert sorted(e["rank"] for e in finishes) == [0, 1], job.output()
        steps = finishes[0]["result"]["step"]
        for e in finishes:
            assert e["result"] == {"step": steps, "w": float(steps), "world": 2}
        state = _state(job.state_dir)
        assert state["generation"] == 1 and state["worker_restarts"] == {"0": 0, "1": 0}
        check_after_run(job)
    finally:
        if standby is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(standby.pid, signal.SIGKILL)
        job.close()
