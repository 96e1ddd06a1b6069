"""Warm standby workers (issue 13): a standby becomes exactly the worker a fresh
spawn would be, dead standbys are replaced, nothing outlives the job, and
``--standby 0`` is the launcher of before."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_failover_e2e import Launch

from inprocess.failover.backends import WorkerLaunch
from inprocess.failover.backends.local import LocalBackend
from inprocess.failover.standby import MAX_EARLY_DEATHS, common_env
from inprocess.failover.supervisor import job_processes

#: a worker that writes what it sees (environment, argv, path, ids) and prints a line
PROBE = """\
import json, os, sys
seen = {
    "environ": dict(os.environ),
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "main": __name__,
    "own_group": os.getpgid(0) == os.getpid() and os.getsid(0) == os.getpid(),
    "stdin": os.readlink("/proc/self/fd/0"),
}
with open(sys.argv[1], "w") as f:
    json.dump(seen, f)
# not flushed, and os._exit below: only PYTHONUNBUFFERED gets it to the file
print("probe of rank", os.environ["RANK"], "says hello")
import time
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1] + ".go") and time.monotonic() < deadline:
    time.sleep(0.01)
os._exit(int(sys.argv[2]))
"""


def _launch(tmp: Path, name: str, code: int, slot: int = 0) -> WorkerLaunch:
    env = dict(
        os.environ,
        RANK="3",
        LOCAL_RANK="1",
        GROUP_RANK="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29999",
        INPROCESS_WORKER_INCARNATION="2",
        INPROCESS_NODE_SLOT=str(slot),
        SOME_JOB_VARIABLE="x y",
        PYTHONUNBUFFERED="1",  # as the launcher sets for a worker writing to a file
    )
    return WorkerLaunch(
        worker=3,
        incarnation=2,
        node=1,
        slot=slot,
        argv=(sys.executable, str(tmp / "probe.py"), str(tmp / name), str(code)),
        env=env,
    )


def _wait_exit(backend: LocalBackend, pid: int) -> tuple[int | None, int | None]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for exit_ in backend.wait(0.1):
            if exit_.pid == pid:
                return exit_.exit_code, exit_.signal
    raise AssertionError(f"worker {pid} did not end")


def _ready_standby(backend: LocalBackend, slot: int) -> int:
    # the first standby waits for its zygote's ``import torch``: minutes on a slow machine
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        backend.wait(0.05)
        pool = backend.standbys._standbys.get(slot, [])
        if pool and all(s.check_ready() for s in pool):
            return pool[0].process.pid
    raise AssertionError("no standby got ready")


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_standby_worker_sees_what_a_fresh_worker_sees(tmp_path):
    """Same environment (exactly), argv, sys.path[0], cwd, own session, stdio
    routing and exit status; the pid is the standby's and it is watched like a
    spawned worker; a used standby is replaced."""
    (tmp_path / "probe.py").write_text(PROBE)
    fresh = LocalBackend(tmp_path / "a")
    warm = LocalBackend(tmp_path / "b")
    try:
        launch = _launch(tmp_path, "fresh.json", 7)
        pid, _ = fresh.start(launch)
        (tmp_path / "fresh.json.go").touch()
        assert _wait_exit(fresh, pid) == (7, None)

        # the standby starts without the output variables the launcher gives a
        # worker writing to a file (PYTHONUNBUFFERED): they come with the assignment
        standby_env = {k: v for k, v in launch.env.items() if k != "PYTHONUNBUFFERED"}
        warm.keep_standbys(0, 1, common_env(standby_env))
        standby = _ready_standby(warm, 0)
        # the worker's output routed to a file, as with --log-dir and --redirects
        log_file = str(tmp_path / "warm.log")
        launch = dataclasses.replace(
            _launch(tmp_path, "warm.json", 5), stdout=log_file, stderr=log_file
        )
        pid, start_time = warm.start(launch)
        assert pid == standby, "the worker was not made from the standby"
        assert warm.running(pid, start_time)
        # /proc shows the worker's variables (tools find workers by RANK), not the standby's
        _wait(lambda: (tmp_path / "warm.json").exists(), 30, "the probe")
        shown = psutil.Process(pid).environ()
        assert shown == launch.env
        (tmp_path / "warm.json.go").touch()
        assert _wait_exit(warm, pid) == (5, None)
        assert not warm.running(pid, start_time)
        replacement = _ready_standby(warm, 0)
        assert replacement != standby
    finally:
        warm.close()
        fresh.close()
    a = json.loads((tmp_path / "fresh.json").read_text())
    b = json.loads((tmp_path / "warm.json").read_text())
    assert a["argv"][0] == b["argv"][0] == str(tmp_path / "probe.py")
    assert b["argv"][1:] == [str(tmp_path / "warm.json"), "5"]
    assert a["environ"] == b["environ"]
    assert (a["path0"], a["cwd"], a["main"], a["own_group"], a["stdin"]) == (
        b["path0"],
        b["cwd"],
        b["main"],
        True,
        b["stdin"],
    )
    assert b["own_group"] and a["stdin"] == "/dev/null"
    assert (tmp_path / "warm.log").read_text() == "probe of rank 3 says hello\n"


def _zygotes(backend: LocalBackend) -> list[int]:
    return [z.process.pid for z in backend.standbys._zygotes.values()]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_zygote_forks_standbys_and_its_death_costs_no_worker(tmp_path):
    """Standbys are forked from one zygote per environment (slots share it); a
    dead standby is replaced by a fork; a killed zygote takes its standbys with
    it but not the workers made from them (their end is still seen, as an
    orphan's), and is replaced; a closed pool leaves nothing."""
    (tmp_path / "probe.py").write_text(PROBE)
    backend = LocalBackend(tmp_path / "state")
    try:
        backend.keep_standbys(0, 1, dict(os.environ, INPROCESS_NODE_SLOT="0"))
        backend.keep_standbys(1, 1, dict(os.environ, INPROCESS_NODE_SLOT="1"))
        first = _ready_standby(backend, 0)
        _ready_standby(backend, 1)
        [zygote] = _zygotes(backend)
        for slot in (0, 1):
            [standby] = backend.standbys.standbys(slot)
            proc = psutil.Process(standby)
            assert proc.ppid() == zygote and os.getsid(standby) == standby
            assert proc.environ()["INPROCESS_NODE_SLOT"] == str(slot)
            cmdline = proc.cmdline()  # a spawned standby's, as tools would look for it
            assert cmdline[1:3] == ["-m", "inprocess.failover.standby"] and len(cmdline) == 5
            assert int(cmdline[4]) == zygote
        os.kill(first, signal.SIGKILL)
        second = _wait(
            lambda: (
                (backend.wait(0.05), backend.standbys.standbys(0))[1] not in ([], [first])
                and backend.standbys.standbys(0)[0]
            ),
            60,
            "a forked replacement",
        )
        assert psutil.Process(second).ppid() == zygote

        pid, start_time = backend.start(_launch(tmp_path, "w.json", 4))
        assert pid == second
        _wait(lambda: (tmp_path / "w.json").exists(), 60, "the probe")
        os.kill(zygote, signal.SIGKILL)
        # its standbys die with it; the worker does not, and a new zygote comes
        _wait(lambda: (backend.wait(0.05), _zygotes(backend))[1] not in ([], [zygote]), 60, "z")
        assert backend.running(pid, start_time)
        (tmp_path / "w.json.go").touch()
        # an orphan of this test's process: no subreaper recorded its status
        assert _wait_exit(backend, pid) == (None, None)
        _ready_standby(backend, 0)
    finally:
        backend.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_standbys_are_spawned_when_zygotes_keep_dying(tmp_path):
    """A zygote that dies before it is ready is replaced; after
    ``MAX_EARLY_DEATHS`` in a row its environment's standbys are spawned."""
    backend = LocalBackend(tmp_path)
    real_spawn = backend.standbys._spawn
    zygote_starts = []

    def spawn(argv, env, pass_fds):
        if "--zygote" in argv:  # a zygote that cannot start
            zygote_starts.append(argv)
            return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        return real_spawn(argv, env, pass_fds)

    backend.standbys._spawn = spawn
    try:
        backend.keep_standbys(0, 1, dict(os.environ))
        standbys = _wait(
            lambda: (backend.wait(0.05), backend.standbys.standbys(0))[1], 60, "a standby"
        )
        assert len(zygote_starts) == MAX_EARLY_DEATHS
        assert "--zygote" not in psutil.Process(standbys[0]).cmdline()
        assert not backend.standbys._zygotes
    finally:
        backend.close()


# ---------------------------------------------------------------- inprocess-run end to end


def _standbys(job_id: str) -> list[psutil.Process]:
    found = []
    for p in job_processes(job_id):
        with contextlib.suppress(psutil.Error):
            cmdline = p.cmdline()
            if (
                "inprocess.failover.standby" in cmdline
                and "--zygote" not in cmdline
                and "RANK" not in p.environ()
            ):
                found.append(p)
    return found


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _state(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {"workers": {}}


def _running_pids(state_dir: Path) -> dict[int, int]:
    state = _state(state_dir)
    return {
        int(w): r["pid"]
        for w, r in state["workers"].items()
        if r["status"] == "running" and r["pid"]
    }


class _Job(Launch):
    """An ``inprocess-run`` job of 1 node x 2 workers (``examples/train.py``), with
    ``--standby 1`` unless ``flags`` say otherwise."""

    def __init__(self, tmp: Path, *flags: str, steps: int = 100000) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        if "--standby" not in flags:
            flags = ("--standby", "1", *flags)
        super().__init__(
            tmp,
            "--nnodes",
            "1",
            *flags,
            script_args=["--steps", str(steps), "--step-time", "0.05"],
        )

    def close(self) -> None:
        self.__exit__(None, None, None)

    def nothing_left(self) -> None:
        left = _wait(lambda: not job_processes(self.job_id) or None, 20, "the job's processes")
        assert left


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_standby_replaces_a_killed_worker_and_dies_with_the_controller(tmp_path):
    """A killed worker is replaced by the node's standby (same pid), which is
    replaced in turn; a SIGKILLed controller takes its standbys with it (its
    successor makes new ones); Ctrl-C of inprocess-run leaves nothing."""
    job = _Job(tmp_path, "--spare-nodes", "1")
    try:
        _wait(lambda: _state(job.state_dir).get("wrapper_managed"), 90, "the Wrapper job")
        # one per node slot, the spare's too (a relaunched node starts from it)
        # (standbys come once the node's zygote has imported torch: minutes when loaded)
        both = _wait(lambda: len(_standbys(job.job_id)) == 2 and _standbys(job.job_id), 240, "2")
        slots = {p.pid: p.environ()["INPROCESS_NODE_SLOT"] for p in both}
        assert sorted(slots.values()) == ["0", "1"]
        standby = [p for p in both if slots[p.pid] == "0"]
        workers = _running_pids(job.state_dir)
        os.kill(workers[1], signal.SIGKILL)
        relaunched = _wait(
            lambda: (p := _running_pids(job.state_dir).get(1)) != workers[1] and p,
            30,
            "the relaunch",
        )
        assert relaunched == standby[0].pid
        state = json.loads((job.state_dir / "state.json").read_text())
        assert set(state["workers"]) == {"0", "1"}  # standbys are not workers
        assert state["worker_restarts"] == {"0": 0, "1": 1}
        replacement = _wait(
            lambda: [p for p in _standbys(job.job_id) if p.pid not in slots], 30, "a new standby"
        )
        # the controller dies: its standbys (and the spare store server) with it
        controller = int((job.state_dir / "controller.pid").read_text())
        os.kill(controller, signal.SIGKILL)
        _wait(lambda: not replacement[0].is_running(), 20, "the standby's end")
        _wait(lambda: _standbys(job.job_id), 240, "the new controller's standby")
        assert _running_pids(job.state_dir) == {0: workers[0], 1: relaunched}
        job.proc.send_signal(signal.SIGINT)
        assert job.proc.wait(60) == 130
        job.nothing_left()
    finally:
        job.close()


def _store_servers(job_id: str) -> set[int]:
    found = set()
    for p in job_processes(job_id):
        with contextlib.suppress(psutil.Error):
            if "inprocess.failover.store_server" in p.cmdline():
                found.add(p.pid)
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cold_restart_takes_the_spare_store_server_and_limits_leave_nothing(tmp_path):
    """The next generation's store server runs ahead: a cold restart (here: the
    store server dies) takes it; a job ended by a limit or normally leaves
    nothing; a job of ``--standby 0`` never starts a standby or a spare server."""
    limited = _Job(tmp_path / "a", "--job-max-restarts", "1")
    plain = _Job(tmp_path / "b", "--standby", "0", steps=60)
    normal = _Job(tmp_path / "c", steps=60)
    try:
        _wait(lambda: _state(limited.state_dir).get("wrapper_managed"), 240, "the Wrapper job")
        current = _state(limited.state_dir)["store"]["pid"]
        spare = _wait(lambda: _store_servers(limited.job_id) - {current}, 240, "a spare server")
        os.kill(current, signal.SIGKILL)
        new = _wait(
            lambda: (
                (_state(limited.state_dir).get("store") or {}).get("pid", current) != current
                and _state(limited.state_dir)["store"]["pid"]
            ),
            60,
            "a cold restart",
        )
        assert _state(limited.state_dir)["generation"] == 1 and {new} == spare
        _wait(lambda: len(_running_pids(limited.state_dir)) == 2, 60, "the new generation")
        os.kill(_state(limited.state_dir)["store"]["pid"], signal.SIGKILL)
        assert limited.proc.wait(90) != 0
        assert "job_max_restarts" in _state(limited.state_dir)["reason"]
        limited.nothing_left()

        servers: set[int] = set()
        while plain.proc.poll() is None:
            for p in job_processes(plain.job_id):
                with contextlib.suppress(psutil.Error):
                    assert "inprocess.failover.standby" not in p.cmdline()
            servers |= _store_servers(plain.job_id)
            time.sleep(0.1)
        assert plain.proc.returncode == 0
        assert len(servers) == 1  # no spare store server either
        plain.nothing_left()
        assert normal.proc.wait(120) == 0
        normal.nothing_left()
    finally:
        limited.close()
        plain.close()
        normal.close()
