"""Scripts written for the usage guide's API, run unchanged (issue 8).

The guide's recommended pattern (``benchmarks/workers/user_script.py``): every
call builds its own ``torch.distributed.TCPStore`` on ``MASTER_PORT + 1``
(``is_master=(rank == 0)``, ``multi_tenant``, ``wait_for_workers``,
``use_libuv``), passes it to ``init_process_group('gloo')``, wraps a model in
``DistributedDataParallel``, reloads a ``torch.save`` checkpoint and trains,
while a random rank raises. A restart must not depend on what the others are
blocked in: the user's store (a master waiting for its workers, clients reading
a key a failed peer never writes), DDP construction, ``barrier()``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from launcher import MARKER, REPO, WORKERS, Job, free_port, job_processes, machine_is_busy

pytestmark = pytest.mark.slow

USER_SCRIPT = REPO / "benchmarks" / "workers" / "user_script.py"
WORLD = 4
RESTART_BOUND = 8.0  # below its smallest timeout (10 s): no restart waited on one; figures printed


def events(out: Path) -> list[dict]:
    found = []
    for path in out.glob("rank*.jsonl"):
        rank = int(path.stem[4:])
        found += [dict(json.loads(line), rank=rank) for line in path.read_text().splitlines()]
    return found


def restart_times(found: list[dict]) -> tuple[int, list[float]]:
    """(faults, per rank and fault: seconds from the fault to that rank back in the function)."""
    faults = {e["iteration"]: e["time"] for e in found if e["event"] == "fault"}
    starts = {(e["iteration"], e["rank"]): e["time"] for e in found if e["event"] == "start"}
    delays = []
    for iteration, t in sorted(faults.items()):
        for rank in range(WORLD):
            back = starts.get((iteration + 1, rank))
            assert back is not None, f"rank {rank} never came back after fault {iteration}"
            delays.append(back - t)
    return len(faults), delays


@pytest.mark.timeout(240)
def test_guide_pattern_restarts_fast_whatever_the_ranks_are_blocked_in(tmp_path):
    # 2 faults strike before the faulty rank builds its store, while rank 0 waits
    # for its workers in the TCPStore constructor and the others wait for the
    # faulty rank's address in init_process_group; 20 more at random training
    # steps, while the others are in DDP's all-reduce or in barrier().
    faults = 22
    out = tmp_path / "out"
    args = ["--out", str(out), "--faults", str(faults), "--early-faults", "2", "--steps", "5"]
    with Job(USER_SCRIPT, WORLD, tmp_path, args=[*args, "--wrapped"]) as job:
        result = job.wait(200)
    assert result.returncodes == [0] * WORLD, result.describe()
    assert not result.leftovers
    found = events(out)
    injected, delays = restart_times(found)
    assert injected == faults
    assert sum(e["event"] == "done" for e in found) == WORLD
    print(
        f"\n{injected} faults, {len(delays)} rank restarts: median {statistics.median(delays):.3f}"
        f" s, max {max(delays):.3f} s, job {result.duration:.1f} s"
    )
    assert max(delays) < RESTART_BOUND, sorted(delays)[-5:]


# --------------------------------------------------------------------------- the faulty app

FAULTY_APP = "faulty_app.py"
#: exit status of a rank lost to each kind (None: nobody is lost)
LOST_STATUS = {
    "exception": None,
    "exit": 0,
    "kill": -9,
    "term": -15,
    "inject-kill": -9,
    "inject-term": -15,
}
#: per restart: none of these faults waits out a timeout (the smallest, the
#: heartbeat's, is 5 s), so well under one each on an idle machine; the bound
#: only tells a restart that waited on a timeout from one that did not, with
#: slack for a loaded machine (the figures are printed; speed is benchmarked)
PER_RESTART = 4.5
#: beside other jobs (load average 4 or more), where a lost rank's own exit
#: takes seconds: below the app's soft timeout (10 s), so no restart waited it out
PER_RESTART_LOADED = 9.5


def check_faulty_app(out: Path, kind: str, returncodes: list[int | None] | None) -> None:
    """Faults, restarts and returns as the kind says; exit statuses unless ``None``."""
    found = events(out)
    faults = sorted((e["iteration"], e["time"]) for e in found if e["event"] == "fault")
    starts = {(e["iteration"], e["rank"]): e for e in found if e["event"] == "start"}
    returned = [e for e in found if e["event"] == "returned"]
    lethal = LOST_STATUS[kind] is not None
    # A restart without an injected fault (a soft timeout on a heavily loaded
    # machine) is tolerated once and reported; the faults' accounting stays exact.
    iterations = sorted({i for i, _ in starts})
    spurious = [i for i in iterations[:-1] if i not in dict(faults)]
    assert len(spurious) <= 1, f"restarts without a fault after iterations {spurious}"
    # lethal: one rank per fault until rank 0 is alone; exceptions: in iterations 0-3
    assert len(faults) == (3 if lethal else 4 - len(spurious)), faults
    delays = []
    for iteration, t in faults:
        started = sum(i == iteration for i, _ in starts)
        back = [e["time"] - t for (i, _), e in starts.items() if i == iteration + 1]
        assert back, f"nobody came back after the fault of iteration {iteration}"
        assert len(back) == (started - 1 if lethal else started), (iteration, started, back)
        delays += back
    print(
        f"\n{kind}: {len(faults)} restarts, all back in the function within {max(delays):.3f} s"
        f"; restarts without a fault: {spurious}"
    )
    bound = PER_RESTART_LOADED if machine_is_busy() else PER_RESTART
    assert max(delays) < bound, delays
    if lethal:
        # The survivors return (rank 0 alone at the end); the lost ranks ended as their fault says.
        assert [e["rank"] for e in returned] == [0] and returned[0]["value"] == 1
        if returncodes is None:
            return
        assert returncodes[0] == 0
        assert sorted(returncodes[1:]) == [LOST_STATUS[kind]] * (WORLD - 1), returncodes
    else:
        assert sorted(e["rank"] for e in returned) == list(range(WORLD))
        assert returncodes in (None, [0] * WORLD)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", list(LOST_STATUS))
def test_faulty_app_ends_by_itself(tmp_path, kind):
    out = tmp_path / "out"
    limit = "0" if kind.startswith("inject-") else "5"  # no limit for the external faults
    with Job(FAULTY_APP, WORLD, tmp_path, args=[kind, str(out), limit]) as job:
        result = job.wait(170)
    assert all(rc is not None for rc in result.returncodes), result.describe()
    assert not result.leftovers, f"orphans: {result.leftovers}"
    check_faulty_app(out, kind, result.returncodes)


@pytest.mark.timeout(240)
def test_gloo_init_left_waiting_by_a_peer_is_released(tmp_path):
    # The faulty app's exception at step 0 once cost a healthy rank (1 run in
    # 60 on a loaded machine): still inside gloo's constructor, it waited as
    # the listening side of a pair for a peer that had given up, for 5 x the
    # group's timeout, unreachable by the abort, until the hard timeout ended
    # it. Here the peer stops once it published its address; with the release
    # the wait ends at once (without it: 50 s).
    out = tmp_path / "attempts.json"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "stranded_gloo_init.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = json.loads(out.read_text())
    print(f"\n{attempts}")
    assert attempts[-1]["released"], "rank 0 was never the listening side"
    assert max(a["seconds"] or 0.0 for a in attempts) < 5.0, attempts


@pytest.mark.timeout(150)
def test_faulty_app_under_torchrun(tmp_path):
    # Real torchrun: its agent hosts the store at MASTER_PORT (the Wrapper's),
    # rank 0 hosts the application's on MASTER_PORT + 1; a rank that leaves with
    # sys.exit(0) is a finished worker for torchrun, and the others go on.
    out = tmp_path / "out"
    marker = uuid.uuid4().hex
    env = dict(
        os.environ,
        RES_OPTIONS="timeout:1 attempts:1",
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    env[MARKER] = marker
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", str(WORLD), "--master-port", str(free_port())]
    cmd += [str(WORKERS / FAULTY_APP), "exit", str(out), "5"]
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        returncode = proc.wait(120)
    finally:
        proc.kill()
        proc.wait()
        leftovers = job_processes(marker)
        for p in leftovers:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert returncode == 0, log.read_text(errors="replace")[-6000:]
    assert not leftovers
    check_faulty_app(out, "exit", None)


# --------------------------------------------------------------------------- units


def test_abort_keeps_the_functions_store_server_and_never_takes_a_port(monkeypatch):
    import datetime
    import socket

    import torch.distributed as dist

    from inprocess.abort import rendezvous as user_rendezvous
    from inprocess.abort.sockets import listening_sockets

    monkeypatch.setattr(user_rendezvous, "_baseline", set(user_rendezvous.socket_inodes()))
    port = free_port()
    user = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                         wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    plain = socket.socket()  # a listener that is no store server (like gloo's)
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    try:
        before = listening_sockets()
        assert user_rendezvous.hold_iteration_servers() == 1
        assert sorted(listening_sockets().values()) == sorted(before.values())  # no new listener
        user.set("key", "value")
        del user  # the function's store is gone, its server is not
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=datetime.timedelta(seconds=5))
        assert client.get("key") == b"value"
        del client
    finally:
        user_rendezvous.release_held_servers()
        plain.close()
    assert port not in listening_sockets().values()
