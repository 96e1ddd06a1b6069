"""The job layer lets no one in, leaks nothing and ends with its launcher (issue 9)."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import test_failover_e2e as e2e
from launcher import free_port
from test_failover_e2e import RUN, TRAIN, Launch, check_after_run

from inprocess import protocol
from inprocess.failover.supervisor import job_processes
from inprocess.security import keyed_namespace

SLOW = pytest.mark.slow


def _reachable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        try:
            s.connect((host, port))
        except OSError:
            return False
        return True


def _client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))


def _gone_within(launch: Launch, pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = job_processes(launch.job_id) + [p for p in map(_alive, pids) if p]
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"still running {seconds}s later: {left}\n{launch.output()}")


def _alive(pid: int) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    return None


# ----------------------------------------------------------------- deliverable 1


def test_wrapper_hosted_store_listens_on_its_address_only():
    from inprocess.store import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10))
    try:
        assert _reachable("127.0.0.1", port)
        assert not _reachable("127.0.0.2", port)  # "another host" of this machine
    finally:
        del store


def test_namespace_is_keyed_with_the_secret(monkeypatch):
    from inprocess.store import job_namespace

    monkeypatch.delenv("INPROCESS_STORE_NAMESPACE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    monkeypatch.delenv("INPROCESS_JOB_SECRET", raising=False)
    plain = job_namespace()
    monkeypatch.setenv("INPROCESS_JOB_SECRET", "a" * 16)
    keyed_a = job_namespace()
    monkeypatch.setenv("INPROCESS_JOB_SECRET", "b" * 16)
    assert len({plain, keyed_a, job_namespace()}) == 3
    assert keyed_a.startswith(plain + "/") and len(keyed_a) - len(plain) == 33


#: what a stranger appends to every key that is not a counter: garbage, records in
#: the old formats, a record with a forged MAC, decisions in plain text
_GARBAGE = (
    "notanumber/x,",
    "7/1.forgedjoin,",
    '{"rank": "1/0.forged", "reason": "RuntimeError: forged", "time": 0}\n',
    "\n7/1.forgedjoin~AAAAAAAAAAAAAAAA\n",
    '{"iteration": 9, "members": ["0/0.forged"]}\n',
    "fault",
    "completed",
    "\xff\xfe",
)
_IDENTITY = re.compile(r"[0-9]+/[0-9]+\.[0-9a-f]{10}")


class _Stranger(threading.Thread):
    """A client of the job's store without the secret: lists every key (torch >= 2.13),
    adds to every counter, appends garbage to every other key, and forges deaths,
    join requests, faults and outcomes of the identities it reads, round after round
    until stopped (or until the store goes away with the job)."""

    def __init__(self, port: int) -> None:
        super().__init__(name="stranger", daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.rounds = 0
        self.keys: set[str] = set()
        self.identities: set[str] = set()
        self.counters: set[str] = set()
        self.error: BaseException | None = None

    def run(self) -> None:
        client = _client(self.port)
        try:
            while not self.stop.is_set():
                self._round(client)
                self.rounds += 1
                self.stop.wait(0.1)
        except Exception as ex:  # the store ended with the job
            self.error = ex
        finally:
            del client

    def _round(self, client) -> None:
        keys = client.list_keys()
        self.keys.update(keys)
        calls = set()
        for key in keys:
            if key.endswith("/membership"):
                calls.add(key.removesuffix("/membership"))
            value = client.get(key)
            self.identities.update(_IDENTITY.findall(value.decode(errors="replace")))
            if value.strip().isdigit():
                # A counter: only add (an appended digit could overflow it; a
                # non-number written to it is a denial of service, not tested here).
                self.counters.add(key)
                client.add(key, 3)
            else:
                for text in _GARBAGE:
                    client.append(key, text)
        for call in calls:
            forged = {
                "terminated": [f"{i}," for i in self.identities],
                "left": [f"{i}," for i in self.identities],
                "join_requests": ["notanumber/x,", "5/1.0123456789,"],
                "fault_log": ['{"rank": "0/0.0123456789", "reason": "forged", "time": 1}\n'],
                protocol.iteration_key(0, protocol.OUTCOME): ["fault"],
                protocol.done_key(protocol.iteration_key(0, protocol.TERMINATION)): [
                    '{"terminated": [], "joiners": ["5/1.0123456789"]}'
                ],
            }
            forged.update({f"terminated/{i}": ["forged"] for i in self.identities})
            for key, texts in forged.items():
                for text in texts:
                    client.append(f"{call}/{key}", text)
            client.add(f"{call}/faults", 1)
            client.add(f"{call}/{protocol.WAKE_SEQ}", protocol.DEATH_WAKE)


@SLOW
@pytest.mark.timeout(600)
def test_a_stranger_without_the_secret_cannot_steer_the_job(tmp_path, monkeypatch):
    """Bound to --master-addr only; a client without the secret that lists the keys and
    writes to every one of them, all along the job, changes nothing the job does: no
    restart, no expulsion, no crash, the exact result. Meanwhile a second launch with
    the job's id is refused, and the job's cleanup spares a process of another run
    that carries the same id (one job for these: each job costs minutes here)."""
    secret = "issue24-test-secret"
    monkeypatch.setitem(e2e.ENV, "INPROCESS_JOB_SECRET", secret)
    with Launch(tmp_path, script_args=["--steps", "200", "--step-time", "0.03"]) as launch:
        launch.wait_until(lambda: launch.running_at_step(10), what="training")
        port = launch.state()["store"]["port"]
        assert _reachable("127.0.0.1", port)
        assert not _reachable("127.0.0.2", port)
        client = _client(port)
        try:
            old = f"inprocess/{launch.job_id}/g0"  # the names the job used before the secret
            real = f"inprocess/{keyed_namespace(f'{launch.job_id}/g0', secret)}"
            assert client.check([f"{real}/wrapped"])  # with the secret: the job's keys
            assert not client.check([f"{old}/wrapped"])
        finally:
            del client
        stranger = _Stranger(port)
        stranger.start()
        # A process that is not of this run but carries the same job id (an earlier
        # run's leftover, another user's look-alike): cleanup must not touch it.
        bystander = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(3600)"],  # outlives the job
            env=dict(e2e.ENV, INPROCESS_JOB_ID=launch.job_id),
        )
        try:
            second = subprocess.run(
                [
                    *RUN,
                    *("--job-id", launch.job_id, "--state-dir", str(tmp_path / "second")),
                    str(TRAIN),
                ],
                env=e2e.ENV,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert second.returncode == 2, second.stderr
            assert (
                "already used by a live job" in second.stderr and "Traceback" not in second.stderr
            )
            code = launch.finish(timeout=360)
            assert bystander.poll() is None, "cleanup killed a process of another run"
        finally:
            stranger.stop.set()
            stranger.join(30)
            bystander.kill()
            bystander.wait()
        assert code == 0, launch.output()
        # the stranger did reach the job's keys, its identities and counters
        assert stranger.rounds >= 3, (stranger.rounds, stranger.error)
        calls = protocol.call_namespace(real, 0)  # the short namespace of the job's call
        assert any(k.startswith(calls) and k.endswith("/membership") for k in stranger.keys)
        assert len(stranger.identities) >= 4 and any(
            k.endswith("/faults") for k in stranger.counters
        ), (stranger.identities, stranger.counters)
        e2e.check_clean_success(launch, 200)
        state = launch.state()
        assert all(v == 0 for v in state["worker_restarts"].values()), state
        starts = [e for e in launch.events() if e["kind"] == "start"]
        assert sorted(e["rank"] for e in starts) == [0, 1, 2, 3], starts  # no restart
        assert all(e["world"] == 4 and e["iteration"] == 0 for e in starts), starts


# ----------------------------------------------------------------- deliverable 4


@SLOW
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["SIGKILL", "kill -9 -PGID", "SIGHUP"])
def test_launcher_death_ends_the_job(tmp_path, how):
    with Launch(tmp_path, script_args=["--steps", "100000", "--step-time", "0.03"]) as launch:
        launch.wait_until(lambda: launch.running_at_step(10), what="training")
        store_pid = launch.state()["store"]["pid"]
        if how == "SIGKILL":
            os.kill(launch.proc.pid, signal.SIGKILL)
        elif how == "kill -9 -PGID":
            os.killpg(launch.proc.pid, signal.SIGKILL)
        else:
            os.killpg(launch.proc.pid, signal.SIGHUP)  # the terminal was closed
        code = launch.finish(timeout=60)
        _gone_within(launch, [store_pid], 25)
        state = launch.state()
        assert state["stage"] == "STOPPED", state["stage"]
        if how == "SIGHUP":
            assert code == 128 + signal.SIGHUP and "SIGHUP" in state["reason"]
        else:
            assert code == -signal.SIGKILL
            assert "inprocess-run" in state["reason"] and "died" in state["reason"]
            assert state["exit_code"] != 0


# ----------------------------------------------------------------- deliverable 5
# (a second launch with a live job's id: in the stranger's test above)


# ----------------------------------------------------------------- deliverable 6


@SLOW
@pytest.mark.timeout(240)
def test_controller_restart_limit_counts_crashes_in_a_row_and_planted_symlinks_are_not_followed(
    tmp_path,
):
    """Controller crashes in a row end the job at --max-controller-restarts; one
    stable controller resets the count. Every new controller writes the pid file
    anew: symlinks planted at its names (and its temporary names) are replaced,
    never followed."""
    from inprocess.failover.supervisor import CONTROLLER_STABLE_SECONDS

    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for name in ("controller.pid", "controller.tmp", "controller.pid.tmp"):
        (state_dir / name).symlink_to(victim)
    pid_file = state_dir / "controller.pid"

    def controller() -> int:
        if pid_file.is_symlink():
            return 0  # the planted one, not yet replaced
        try:
            return int(pid_file.read_text())
        except (OSError, ValueError):
            return 0

    def kill_next(previous: int, after: float = 0.0) -> int:
        launch.wait_until(lambda: controller() not in (0, previous), what="a new controller")
        time.sleep(after)
        pid = controller()
        os.kill(pid, signal.SIGKILL)
        return pid

    with Launch(
        tmp_path,
        "--max-controller-restarts",
        "2",
        script_args=["--steps", "100000", "--step-time", "0.03"],
    ) as launch:
        launch.wait_until(lambda: launch.running_at_step(5), what="training")
        assert victim.read_text() == "precious\n" and not pid_file.is_symlink()
        pid = kill_next(0)
        pid = kill_next(pid, after=CONTROLLER_STABLE_SECONDS + 1)  # this one was stable
        launch.wait_until(lambda: launch.output().count("(1/2)") == 2, what="count reset")
        for _ in range(2):  # (2/2), then (3/2): over the limit
            pid = kill_next(pid)
        code = launch.finish(timeout=60)
        assert code == 1, launch.output()
        state = launch.state()
        assert state["stage"] == "STOPPED" and "in a row" in state["reason"], state["reason"]
        check_after_run(launch)
    # four controllers wrote the pid file: none through a planted link
    assert victim.read_text() == "precious\n"
    assert not pid_file.is_symlink()
    # the orphaned store servers' exit records (and any other) are gone with the job
    assert not (state_dir / "exits").exists()


def _run_cli(*args: str) -> tuple[int, str]:
    from inprocess.failover import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main([*args, str(TRAIN)])
    return code, err.getvalue()


def _one_line_error(result: tuple[int, str], *words: str) -> None:
    code, stderr = result
    assert code == 2, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("inprocess-run: error:"), stderr
    for word in words:
        assert word in lines[0], stderr


def test_bad_state_dirs_and_log_level_are_one_line_errors(tmp_path):
    _one_line_error(_run_cli("--log-level", "FOO"), "--log-level", "FOO", "DEBUG")
    a_file = tmp_path / "file"
    a_file.write_text("")
    _one_line_error(_run_cli("--state-dir", str(a_file)), "--state-dir", "not a directory")
    _one_line_error(_run_cli("--state-dir", str(a_file / "sub")), "--state-dir")
    _one_line_error(_run_cli("--state-dir", "/proc/1/inprocess-state"), "--state-dir")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    _one_line_error(_run_cli("--state-dir", str(shared)), "--state-dir", "writable by group")
    if os.getuid() == 0:  # only root can give a directory away
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 12345, 12345)
        _one_line_error(_run_cli("--state-dir", str(other)), "--state-dir", "owned by uid 12345")
    assert not any(Path(tmp_path).rglob("state.json"))
