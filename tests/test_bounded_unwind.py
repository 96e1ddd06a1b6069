"""A rank stuck in native code after the abort is ended in seconds, not at its
hard timeout; a long native call inside ``atomic()`` is left alone; a monitor
process that dies is replaced without costing its rank (issues 21 and 25)."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings

import pytest
from launcher import Job
from test_hangs import TIMED, WORLD, ready_after, wait_for

from inprocess import report

pytestmark = pytest.mark.slow

#: a hard timeout far above what the bounded unwind needs: reaching it fails the test
HARD = 30.0
UNWIND = 2.0
#: heartbeats are not under test here: a timeout a starved rank cannot miss on a loaded machine
WRAPPER = {
    **TIMED,
    "hard_timeout": HARD,
    "soft_timeout": 20.0,
    "heartbeat_timeout": 20.0,
    "unwind_timeout": UNWIND,
}
RAISER, STUCK = 1, 2


def _faults(stuck_kind: str, raiser: int | None = RAISER) -> list[dict]:
    stuck = {"iteration": 0, "rank": STUCK, "step": 3, "kind": stuck_kind, "others": "allreduce"}
    if raiser is None:
        return [stuck]
    return [
        {"iteration": 0, "rank": raiser, "step": 3, "kind": "raise", "others": "allreduce"},
        stuck,
    ]


def _run(tmp_path, stuck_kind: str, raiser: int | None = RAISER, **kw):
    spec = {
        "wrapper": dict(WRAPPER),
        "steps": 8,
        "steps_after_restart": 4,
        "faults": _faults(stuck_kind, raiser),
        **kw,
    }
    env = {"INPROCESS_RECORDS": str(tmp_path / "restarts.jsonl")}
    with Job("scenario.py", WORLD, tmp_path, spec, env=env) as job:
        result = job.wait(120)
    first = RAISER if raiser is not None else STUCK
    fault_time = json.loads((tmp_path / f"fault{first}.json").read_text())["time"]
    return result, fault_time


def check_stuck_rank_ended(records: list[dict], full_size: int) -> None:
    """What every stuck-rank job shows: the report names rank 2 as stuck in native
    code, ended after about the unwind timeout, and the job was back (at
    ``full_size``) well before the hard timeout."""
    from inprocess import incidents

    found = [i for i in incidents.build(records) if "stuck in native code" in i["what"]]
    ours = [i for i in found if i["what"].startswith(f"rank {STUCK} ")]
    assert len(ours) == 1, incidents.build(records)
    if len(found) > 1:
        # a survivor left in a gloo send the abort does not fail, ended the same
        # way: the known gloo limitation (docs/known-limitations.md), reported rather than hidden
        warnings.warn(f"more ranks stuck after the abort: {found}", stacklevel=2)
    stuck = ours[0]
    ended = float(stuck["what"].split("ended after ")[1].split(" s")[0])
    assert UNWIND <= ended < HARD / 2, stuck
    assert stuck["recovery"] is not None and stuck["recovery"] < HARD / 2, stuck
    back = [r for r in records if r.get("type") == "restart" and r["time"] >= stuck["time"] - 10]
    assert max(r["world_size"] for r in back) == full_size, back


def check_stuck_rank_dropped(tmp_path, result, fault_time: float, named: str) -> None:
    """What a job without a launcher shows once rank 2 was ended as stuck: it was
    SIGKILLed and says ``named``, the others finished at 3, well before the hard
    timeout (generous on a loaded machine), and nothing was left running."""
    survivors = [r for r in range(WORLD) if r != STUCK]
    for rank in survivors:
        assert result.ranks[rank].returncode == 0, result.describe()
        returned = result.report(rank)["returned"]
        assert returned["world"] == 3 and returned["sum"] == 6, result.describe()
    assert result.ranks[STUCK].returncode == -signal.SIGKILL, result.describe()
    assert named in result.ranks[STUCK].output
    check_stuck_rank_ended(report.load([tmp_path / "restarts.jsonl"]), full_size=3)
    delays = ready_after(result, fault_time)
    assert set(delays) == set(survivors), delays
    assert max(delays.values()) < HARD / 2, delays
    assert not result.leftovers


@pytest.mark.timeout(180)
def test_stuck_rank_is_dropped_well_before_the_hard_timeout(tmp_path):
    """Without a launcher: rank 2 (every signal blocked, in pause()) is ended by
    its monitor process after the unwind timeout; the others go on at 3."""
    result, fault_time = _run(tmp_path, "pause")
    check_stuck_rank_dropped(tmp_path, result, fault_time, "stuck in native code after the abort")


@pytest.mark.timeout(180)
def test_rank_stuck_freeing_what_its_fault_left_is_dropped(tmp_path):
    """Rank 2's fault leaves, in torch.distributed's frames of its traceback, an
    object whose destructor never returns (as a gloo group whose worker thread
    is left in a send does). The Wrapper frees those frames right after the
    fault, on the bounded-unwind clock: rank 2 is ended after the unwind
    timeout, named as stuck while releasing, and the others go on at 3. (Kept
    alive in ``State.fn_exception``, the object would be freed at some later
    fault, and its rank would wait there for its hard timeout.)"""
    result, fault_time = _run(tmp_path, "stuck_when_freed", raiser=None)
    named = "stuck in native code after the abort (in release"
    check_stuck_rank_dropped(tmp_path, result, fault_time, named)


@pytest.mark.timeout(180)
def test_long_native_call_inside_atomic_is_not_ended(tmp_path):
    """Rank 2 sleeps in native code for 2.5x the unwind timeout inside atomic()
    while rank 1 raises: it is not ended, and the job comes back at full size."""
    result, _ = _run(tmp_path, "atomic_native", native_seconds=2.5 * UNWIND)
    for rank in range(WORLD):
        assert result.ranks[rank].returncode == 0, result.describe()
        returned = result.report(rank)["returned"]
        assert returned["world"] == WORLD and returned["sum"] == 10, result.describe()
        assert "stuck in native code" not in result.ranks[rank].output
    assert not result.leftovers


def flock_holders() -> set[int]:
    """The pids holding a flock (the node groups' leaders among them), from /proc/locks."""
    pids = set()
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "FLOCK" in fields and "WRITE" in fields:
                pids.add(int(fields[fields.index("WRITE") + 1]))
    return pids


@pytest.mark.timeout(300)
def test_sigkilled_monitor_process_is_replaced(tmp_path):
    """SIGKILL of the monitor process that leads the node's group (inprocess.node): a
    new one is started, another leads the node meanwhile, no rank is expelled (its
    node's heartbeat goes on) and no restart happens."""
    pidfile = tmp_path / "monitor{rank}.pid"
    # Rank 2 makes no progress until its replacement is up: a fresh interpreter
    # (the rank has threads, so it is not forked), 15 s on a loaded slow machine.
    # No soft or hard timeout may strike meanwhile: that would be a restart.
    # The heartbeat bridge beats for rank 2 meanwhile; a 10 s heartbeat timeout
    # (not the benchmark's 4 s) tolerates the scheduling gaps of a machine at load 20.
    # (soft and hard under barrier_timeout, 60)
    patient = {"soft_timeout": 40.0, "hard_timeout": 55.0, "heartbeat_timeout": 10.0}
    wrapper = {**TIMED, **patient, "monitor_process_pidfile": str(pidfile)}
    spec = {"wrapper": wrapper, "steps": 300, "step_sleep": 0.03}
    with Job("scenario.py", WORLD, tmp_path, spec) as job:
        wait_for("started{rank}_0", job)
        deadline = time.monotonic() + 30
        leaders: list[int] = []
        while not leaders and time.monotonic() < deadline:
            monitors = {
                r: int((tmp_path / f"monitor{r}.pid").read_text()) for r in range(WORLD)
            }
            leaders = [r for r, pid in monitors.items() if pid in flock_holders()]
            time.sleep(0.05)
        assert len(leaders) == 1, (monitors, leaders)  # one leader for the node
        victim = leaders[0]
        path = tmp_path / f"monitor{victim}.pid"
        old = monitors[victim]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            new = int(path.read_text()) if path.exists() else old
            if new != old:
                break
            time.sleep(0.05)
        assert new != old, "the monitor process was not replaced"
        result = job.wait(240)
    for rank in range(WORLD):
        assert result.ranks[rank].returncode == 0, result.describe()
        returned = result.report(rank)["returned"]
        # the exact result, in the first iteration: no restart, nobody expelled
        assert returned == {"rank": rank, "world": WORLD, "sum": 10.0, "iteration": 0}, (
            result.describe()
        )
    assert "monitor process killed by SIGKILL" in result.ranks[victim].output
    # The pid file outlives the call (as the newer generations leave it), naming
    # the replacement.
    assert path.read_text().strip() == str(new), "the pid file does not name the replacement"
    assert not result.leftovers


@pytest.mark.timeout(240)
def test_stuck_rank_is_replaced_under_inprocess_run(tmp_path):
    """Under inprocess-run (a standby per node): rank 2 stuck in pause() with every
    signal blocked while rank 1 raises is ended, relaunched, and rejoins: the job is
    back at full size well before the hard timeout (30 s in examples/train.py), and
    the report names the stuck rank."""
    from test_failover_e2e import Launch

    from inprocess import incidents

    args = ["--steps", "150", "--stuck-rank", "2", "--raise-rank", "1", "--crash-step", "5"]
    with Launch(tmp_path, "--standby", "1", script_args=args) as launch:
        assert launch.proc.wait(200) == 0, (tmp_path / "launcher.log").read_text()[-4000:]
    records = report.load([launch.state_dir])
    restarts = [r for r in records if r.get("type") == "restart"]
    fault = min(r["time"] for r in restarts if r.get("faults"))
    full = [r for r in restarts if r["joined"] and r["world_size"] == 4 and r["time"] >= fault - 1]
    assert full, restarts
    back = full[0]["back_at"] - fault
    assert back < 15, f"back at full size {back:.1f}s after the fault"
    exits = [e for e in records if e.get("event") == "worker_exit" and e.get("rank") == 2]
    assert exits and exits[0]["signal"] == signal.SIGKILL, exits
    whats = [i["what"] for i in incidents.build(records)]
    assert any(
        w.endswith("(killed by SIGKILL)") and w.startswith("rank 2 on node 1") for w in whats
    ), whats
    check_stuck_rank_ended(records, full_size=4)
