"""Hangs and lost ranks: soft and hard timeouts, heartbeats, dead processes (issue 3)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
import warnings
from pathlib import Path

import psutil
import pytest
from launcher import Job, machine_is_busy

pytestmark = pytest.mark.slow

# The Wrapper's settings of these tests: the detection-latency benchmark's, so
# its figures measure what the tests check.
_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "detection_latency.py"
_spec = importlib.util.spec_from_file_location("detection_latency", _PATH)
assert _spec is not None and _spec.loader is not None
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
# The benchmark's timeouts, stretched: these tests share a small machine with
# the suite's other jobs, where a rank can be starved for seconds; in proportion,
# every path keeps its order (soft < heartbeat < hard).
TIME_SCALE = 3.0
SOFT, HARD, HEARTBEAT = (t * TIME_SCALE for t in (_bench.SOFT, _bench.HARD, _bench.HEARTBEAT))
GRACE = _bench.GRACE
TIMED = {
    **_bench.TIMED,
    "soft_timeout": SOFT,
    "hard_timeout": HARD,
    "heartbeat_timeout": HEARTBEAT,
    # the bounded unwind is tested in test_bounded_unwind.py (at its 2 s default): here a
    # healthy rank slowed by a loaded machine must not be ended by it
    "unwind_timeout": 10.0,
}
# Slack on top of each timeout. The bounds here prove *which* path recovered:
# each stays below the next slower mechanism's timeout (at once < SOFT, SOFT +
# MARGIN < HARD); the latencies themselves, at the benchmark's timeouts (the
# issue's 1.5 s bound), are measured by benchmarks/detection_latency.py.
MARGIN = 7.0  # a rank starved for seconds at load 40 still fits
assert MARGIN < SOFT and SOFT + MARGIN < HARD

WORLD = 4
VICTIM = 2


#: the heartbeat timeout where heartbeats are not the path under test: long enough
#: that a rank starved by a loaded machine is not declared lost by its peers
PATIENT_HEARTBEAT = 30.0


def spec(heartbeat: float = PATIENT_HEARTBEAT, **kw):
    wrapper = {**TIMED, "heartbeat_timeout": heartbeat}
    s = {"wrapper": wrapper, "steps": 8, "steps_after_restart": 4}
    s.update(kw)
    return s


def ready_after(result, fault_time, iteration=1):
    """Per surviving rank: seconds from the fault to being ready in ``iteration``."""
    delays = {}
    for rank in range(WORLD):
        report = result.ranks[rank].report
        if report is None:
            continue
        ready = [
            e["time"]
            for e in report["events"]
            if e["kind"] == "ready" and e["iteration"] == iteration
        ]
        if ready:
            delays[rank] = ready[0] - fault_time
    return delays


def check_only_victim_lost(result, lost=True):
    """Only the victim (if ``lost``) was lost; the others finished together.

    Returns the ranks that finished. One more rank may be missing, and only as
    the known gloo limitation (docs/known-limitations.md): ended by the bounded unwind, left in a
    send of the ring all-reduce that gloo fails for nobody after a peer's
    connection was torn down (reported as a warning rather than hidden).
    """
    expected = [r for r in range(WORLD) if r != VICTIM] if lost else list(range(WORLD))
    stranded = [r for r in expected if r != VICTIM and _stranded_in_gloo(result.ranks[r])]
    assert len(stranded) <= 1, result.describe()
    if stranded:
        warnings.warn(f"rank {stranded[0]} stranded in a gloo send after the abort", stacklevel=2)
    survivors = [r for r in expected if r not in stranded]
    for rank in survivors:
        assert result.ranks[rank].returncode == 0, result.describe()
        returned = result.report(rank)["returned"]
        assert returned["world"] == len(survivors), result.describe()
        assert returned["sum"] == len(survivors) * (len(survivors) + 1) / 2
    if lost:
        assert result.ranks[VICTIM].returncode != 0, result.describe()
    assert not result.leftovers, f"orphans: {result.leftovers}"
    return survivors


def slack(survivors, lost=True) -> float:
    """Seconds more the others may take when a rank was stranded in gloo (see
    :func:`check_only_victim_lost`): they wait for the bounded unwind to end it."""
    return TIMED["unwind_timeout"] if len(survivors) < WORLD - lost else 0.0


def _stranded_in_gloo(rank) -> bool:
    """Whether ``rank`` was ended by the bounded unwind while its main thread
    waited in a collective (``function``, a futex): the known gloo limitation."""
    return (
        rank.returncode == -signal.SIGKILL
        and "stuck in native code after the abort (in function, in system call futex" in rank.output
    )


def run_with_fault(tmp_path, kind, **kw):
    faults = [{"iteration": 0, "rank": VICTIM, "step": 3, "kind": kind, "others": "allreduce"}]
    with Job("scenario.py", WORLD, tmp_path, spec(faults=faults, **kw)) as job:
        result = job.wait(90)
    fault_time = json.loads((tmp_path / f"fault{VICTIM}.json").read_text())["time"]
    return result, fault_time


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["sleep", "socket"])
def test_hang_with_gil_released_is_recovered_in_process(tmp_path, kind):
    result, fault_time = run_with_fault(tmp_path, kind)
    # the hung rank is brought back, not killed
    survivors = check_only_victim_lost(result, lost=False)
    delays = ready_after(result, fault_time)
    assert set(delays) == set(survivors)
    # Beside other jobs (load average 4 or more) the bound is the hard timeout's:
    # the hung rank was brought back (above), not killed, whatever the delay.
    bound = HARD + GRACE + MARGIN if machine_is_busy() else SOFT + MARGIN
    bound += slack(survivors, lost=False)
    assert max(delays.values()) < bound, delays
    interrupted = [e for e in result.report(VICTIM)["events"] if e["kind"] == "interrupted"]
    assert interrupted[0]["exception"] == "RankShouldRestart"


@pytest.mark.timeout(150)
def test_hang_with_gil_held_is_killed_by_the_hard_timeout(tmp_path):
    result, fault_time = run_with_fault(tmp_path, "gil")
    survivors = check_only_victim_lost(result)
    assert result.ranks[VICTIM].returncode == -signal.SIGTERM
    delays = ready_after(result, fault_time)
    assert set(delays) == set(survivors)
    assert max(delays.values()) < HARD + GRACE + MARGIN + slack(survivors), delays
    # the healthy ranks were stuck in the collective with it, yet none was killed;
    # the hard clock runs from the victim's last progress, which a loaded machine
    # can put a few seconds before the fault's timestamp (the SIGTERM above says
    # which timeout ended it)
    assert min(delays.values()) > HARD - 3


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["kill", "segfault"])
def test_dead_rank_is_detected_at_once(tmp_path, kind):
    result, fault_time = run_with_fault(tmp_path, kind)
    survivors = check_only_victim_lost(result)
    delays = ready_after(result, fault_time)
    assert set(delays) == set(survivors)
    assert max(delays.values()) < MARGIN + slack(survivors), delays


def wait_for(path_pattern, job, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((job.workdir / path_pattern.format(rank=r)).exists() for r in range(WORLD)):
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError("ranks did not start")


def external_fault(tmp_path, action, **kw):
    """Runs a long iteration 0 and applies ``action(job)`` to rank 2 from outside."""
    s = spec(steps=100000, steps_after_restart=4, **kw)
    with Job("scenario.py", WORLD, tmp_path, s) as job:
        wait_for("started{rank}_0", job)
        time.sleep(0.3)  # everyone is inside all_reduce steps now
        fault_time = time.monotonic()
        action(job)
        result = job.wait(90)
    return result, fault_time


@pytest.mark.timeout(150)
def test_sigkill_from_outside(tmp_path):
    result, fault_time = external_fault(
        tmp_path, lambda job: os.kill(job.pid(VICTIM), signal.SIGKILL)
    )
    survivors = check_only_victim_lost(result)
    assert result.ranks[VICTIM].returncode == -signal.SIGKILL
    delays = ready_after(result, fault_time)
    assert set(delays) == set(survivors)
    assert max(delays.values()) < MARGIN + slack(survivors), delays


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ping", [False, True])
def test_sigstop_from_outside_is_killed_by_the_hard_timeout(tmp_path, ping):
    """A stopped rank costs only itself (issue 9).

    The survivors hit their soft timeout, then wait in the restart procedure
    until the stopped rank's own monitor ends it: that wait is not their hang.
    With ``ping`` their manual heartbeats, stale since the peer stopped, must
    not count there either (they once killed every healthy rank).
    """
    result, fault_time = external_fault(
        tmp_path, lambda job: os.kill(job.pid(VICTIM), signal.SIGSTOP), ping=ping
    )
    survivors = check_only_victim_lost(result)
    assert result.ranks[VICTIM].returncode == -signal.SIGTERM, result.describe()
    delays = ready_after(result, fault_time)
    assert set(delays) == set(survivors), (delays, result.describe())
    assert max(delays.values()) < HARD + GRACE + MARGIN + slack(survivors), delays


def kill_with_monitors(job, ranks):
    """Freezes the ranks and their monitor processes at once, then kills them all:
    nobody gets to report."""
    victims = []
    for r in ranks:
        rank = psutil.Process(job.pid(r))
        victims += [rank, *rank.children(recursive=True)]
    assert len(victims) == 2 * len(ranks), victims  # each rank and its monitor process
    for p in victims:
        p.send_signal(signal.SIGSTOP)
    for p in victims:
        p.kill()


@pytest.mark.timeout(150)
def test_lost_rank_and_monitor_detected_by_heartbeats(tmp_path):
    """Process and monitor die together on a node whose other ranks live: the node's
    leader (one of their monitor processes) sees both exit and declares the rank at
    once, with no heartbeat timeout (see inprocess.node)."""
    result, fault_time = external_fault(
        tmp_path, lambda job: kill_with_monitors(job, [VICTIM]), heartbeat=HEARTBEAT
    )
    survivors = check_only_victim_lost(result)
    delays = ready_after(result, fault_time)
    assert set(delays) == set(survivors)
    assert max(delays.values()) < MARGIN + slack(survivors), delays
    reasons = [line for line in result.ranks[0].output.splitlines() if "root cause" in line]
    assert any("died with its monitor process" in line for line in reasons), reasons


@pytest.mark.timeout(150)
def test_a_lost_node_is_declared_by_the_heartbeat_watch_of_the_next(tmp_path):
    """Two simulated nodes of two ranks; node 1 (ranks 2 and 3 with their monitor
    processes) is frozen and killed: node 0's leader, which watches the node of its
    ranks' ring peers, sees its heartbeat stop and declares both of its ranks; ranks 0
    and 1 finish at world 2 with the exact result."""
    result, fault_time = external_fault(
        tmp_path,
        lambda job: kill_with_monitors(job, [2, 3]),
        heartbeat=HEARTBEAT,
        ranks_per_node=2,
    )
    for rank in (0, 1):
        assert result.ranks[rank].returncode == 0, result.describe()
        returned = result.report(rank)["returned"]
        assert returned["world"] == 2 and returned["sum"] == 3, result.describe()
    assert not result.leftovers, f"orphans: {result.leftovers}"
    delays = ready_after(result, fault_time)
    assert set(delays) == {0, 1}, delays
    # declared by the heartbeat watch: not before its timeout, and not long after
    assert HEARTBEAT / 2 < max(delays.values()) < 1.5 * HEARTBEAT + MARGIN, delays
    output = result.ranks[0].output
    assert "no heartbeat for" in output and "(node node1." in output, output[-3000:]


@pytest.mark.timeout(150)
def test_manual_ping_timeout_catches_a_busy_loop(tmp_path):
    """A rank that runs bytecode but makes no progress is seen by the manual timeout."""
    result, fault_time = run_with_fault(tmp_path, "busy", ping=True)
    survivors = check_only_victim_lost(result, lost=False)
    delays = ready_after(result, fault_time)
    assert set(delays) == set(survivors)
    assert max(delays.values()) < SOFT + MARGIN + slack(survivors, lost=False), delays
    interrupted = [e for e in result.report(VICTIM)["events"] if e["kind"] == "interrupted"]
    assert interrupted[0]["exception"] == "RankShouldRestart"


@pytest.mark.timeout(180)
def test_a_hang_that_recurs_after_every_restart_reaches_the_hard_timeout(tmp_path):
    """Restarts do not reset the hard clock: the hung rank is SIGTERMed (exit -15)."""
    soft, hard = 1.5 * TIME_SCALE, 4.0 * TIME_SCALE
    with Job("recurring_hang.py", 2, tmp_path, {"soft": soft, "hard": hard, "sleep": 30}) as job:
        result = job.wait(90)
    assert result.ranks[1].returncode == -signal.SIGTERM, result.describe()
    assert result.ranks[0].returncode == 0, result.describe()
    # Rank 1 was restarted (soft timeout) at least twice before the hard timeout
    # ended it; rank 0 then finished alone.
    started = sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("started1_*"))
    assert len(started) >= 2, started
    assert result.report(0)["returned"] > max(started), result.describe()
    first = float((tmp_path / "started1_0").read_text())
    last = float((tmp_path / f"started1_{max(started)}").read_text())
    assert last - first < hard + MARGIN, (first, last)
    assert not result.leftovers


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "cause"), [("boom", "ValueError: boom"), ("kill", "died")])
def test_every_rank_logs_the_root_cause_of_a_restart(tmp_path, kind, cause):
    """Survivors name the faulty rank and its error, not their derived gloo error."""
    faults = [{"iteration": 0, "rank": 1, "step": 2, "kind": kind, "others": "allreduce"}]
    s = spec(faults=faults, steps=4, steps_after_restart=2)
    with Job("scenario.py", 3, tmp_path, s) as job:
        result = job.wait(60)
    survivors = [0, 1, 2] if kind == "boom" else [0, 2]
    assert [result.ranks[r].returncode for r in survivors] == [0] * len(survivors)
    for rank in survivors:
        output = result.ranks[rank].output
        causes = [line for line in output.splitlines() if "root cause" in line]
        assert len(causes) == 1, output
        assert "rank 1/" in causes[0] and cause in causes[0], causes
        ours = [line for line in output.splitlines() if " inprocess." in line]
        assert not [line for line in ours if "Connection closed" in line], ours
    assert not result.leftovers
