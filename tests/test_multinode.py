"""One ``inprocess-run`` per machine (the ``nodes`` backend), without a scheduler:
the job's link (who may join, what a stranger can do), the launcher's refusals,
and a job of two machines by hand: a stranger, a machine with other arguments,
a machine too many, then SIGTERM to every launcher.

The same under a real Slurm, with faults: tests/test_slurm_job.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from inprocess._net import free_port
from inprocess.failover import link as L
from inprocess.failover.backends.nodes import Acceptor

REPO = Path(__file__).resolve().parent.parent
TRAIN_STATE = REPO / "examples" / "train_state.py"
RUN = [sys.executable, "-m", "inprocess.failover.cli"]
MARKER = "TEST_MULTINODE_MARKER"  # (not INPROCESS_*: the job sends those to every machine)


def _secret() -> str:
    return secrets.token_hex(32)


# -- the link -------------------------------------------------------------------


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def _join(listener, secret, hello, timeout=5.0):
    """Connects an agent in a thread; returns (agent's result or error, acceptor side)."""
    result: dict = {}

    def agent() -> None:
        try:
            result["link"] = L.connect(listener.getsockname()[:2], secret, hello, timeout)
        except Exception as ex:  # (the test reads it)
            result["error"] = ex

    thread = threading.Thread(target=agent)
    thread.start()
    return thread, result


def test_an_agent_with_the_secret_joins_and_frames_are_sealed(listener):
    secret = _secret()
    thread, result = _join(listener, secret, {"job": "j", "agent": "a1"})
    shake = L.accept(listener, secret, "j")
    assert shake.hello() == {"job": "j", "agent": "a1"}
    coordinator = shake.welcome({"slot": 3})
    thread.join(10)
    agent, reply = result["link"]
    assert reply == {"slot": 3}
    try:
        agent.send({"t": "exits", "x": [[1, 0, None, None]]})
        coordinator.send({"id": 1, "m": "stop", "a": [[1], 5]})
        deadline = time.monotonic() + 5
        got: list = []
        while not got and time.monotonic() < deadline:
            got = coordinator.poll()
        assert got == [{"t": "exits", "x": [[1, 0, None, None]]}]
        got = []
        while not got and time.monotonic() < deadline:
            got = agent.poll()
        assert got == [{"id": 1, "m": "stop", "a": [[1], 5]}]
        # a frame altered on the way (one byte of its payload) ends the link
        payload = b'{"t":"beat"}'
        mac = L._digest(b"not the session key", b"a", b"1", payload)
        agent.sock.sendall(L._HEADER.pack(len(mac + payload)) + mac + payload)
        with pytest.raises(L.LinkError, match="not authentic"):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                coordinator.poll()
    finally:
        agent.close()
        coordinator.close()


def test_without_the_secret_nobody_joins_either_way(listener):
    # an agent with another secret is refused, and told why
    thread, result = _join(listener, _secret(), {"job": "j"})
    shake = L.accept(listener, _secret(), "j")
    with pytest.raises(L.LinkError, match="does not hold this job's secret"):
        shake.hello()
    thread.join(10)
    assert isinstance(result["error"], L.Refused)
    assert "INPROCESS_JOB_SECRET" in str(result["error"])
    # a "coordinator" without the secret is never obeyed by an agent
    secret = _secret()
    thread, result = _join(listener, secret, {"job": "j"})
    impostor = L.accept(listener, secret, "j")
    impostor.hello()
    impostor._key = L._secret_key(_secret())  # it answers with a wrong key
    link = impostor.welcome({"slot": 0})
    thread.join(10)
    link.close()
    assert isinstance(result["error"], L.LinkError)
    assert "does not hold this job's secret" in str(result["error"])


def test_the_acceptor_keeps_strangers_and_other_jobs_out(listener):
    secret = _secret()
    acceptor = Acceptor(listener, secret, "job-a")
    address = listener.getsockname()[:2]
    try:
        # garbage, and a silent connection: neither stalls the others
        junk = socket.create_connection(address)
        junk.sendall(b"\xff" * 64 + b"GET / HTTP/1.0\r\n\r\n")
        silent = socket.create_connection(address)
        with pytest.raises(L.Refused, match="runs job 'job-a', not 'job-b'"):
            L.connect(address, secret, {"job": "job-b"}, timeout=10)
        with pytest.raises(L.Refused, match="INPROCESS_JOB_SECRET"):
            L.connect(address, _secret(), {"job": "job-a"}, timeout=10)
        thread, result = _join(listener, secret, {"job": "job-a", "agent": "x"}, timeout=10)
        shake, hello = acceptor.joins.get(timeout=20)
        assert hello["agent"] == "x"
        shake.welcome({"slot": 1}).close()
        thread.join(10)
        result["link"][0].close()
        assert acceptor.joins.empty()  # nothing of the strangers was queued
        junk.close()
        silent.close()
    finally:
        acceptor.close()


# -- the launcher's refusals ------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.pop("INPROCESS_JOB_SECRET", None)
    env.update(PYTHONPATH=str(REPO), RES_OPTIONS="timeout:1 attempts:1", **extra)
    return env


def _run(args, env, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*RUN, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_a_job_of_several_machines_needs_a_secret_and_a_reachable_coordinator(tmp_path):
    port = free_port()
    flags = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    script = str(TRAIN_STATE)
    result = _run([*flags, script], _env())
    assert result.returncode == 2
    assert "needs the same secret on every machine: set INPROCESS_JOB_SECRET" in result.stderr
    # nobody listens there: a bounded wait, then one line naming the endpoint
    began = time.monotonic()
    result = _run([*flags, "--rdzv-timeout", "2", script], _env(INPROCESS_JOB_SECRET=_secret()))
    assert result.returncode == 1, result.stderr
    assert f"no coordinator answered at 127.0.0.1:{port} within 2s" in result.stderr
    assert time.monotonic() - began < 60
    # a secret file others can read is refused, by name
    loose = tmp_path / "secret"
    loose.write_text(_secret())
    loose.chmod(0o644)
    result = _run([*flags, "--secret-file", str(loose), script], _env())
    assert result.returncode == 2
    assert f"--secret-file {loose}: readable or writable by others" in result.stderr
    result = _run(["--coordinator-only", script], _env(INPROCESS_JOB_SECRET=_secret()))
    assert result.returncode == 2
    assert "--coordinator-only needs a job of several machines" in result.stderr
    # a coordinator whose machines do not all come: one line naming the missing ones
    coordinator = ["--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    result = _run(
        [*coordinator, "--rdzv-timeout", "2", "--state-dir", str(tmp_path / "s"), script],
        _env(INPROCESS_JOB_SECRET=_secret()),
    )
    assert result.returncode == 2, result.stderr
    assert (
        "only 1 of the 3 machines of the job joined within --rdzv-timeout 2s "
        "(missing node rank(s) 1, 2)"
    ) in result.stderr
    assert not (tmp_path / "s").exists()  # nothing of the job was made


# -- a job of two machines --------------------------------------------------------


class Machines:
    """``inprocess-run`` launchers of one job, each in a session of its own (a machine)."""

    def __init__(self, tmp: Path, common: list[str], script_args: list[str]) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.marker = f"{os.getpid()}-{time.monotonic_ns()}"
        self.env = _env(INPROCESS_JOB_SECRET=_secret(), **{MARKER: self.marker})
        self.common = [*common, "--rdzv-endpoint", f"127.0.0.1:{self.port}"]
        self.script_args = script_args
        self.launchers: dict[str, subprocess.Popen] = {}

    def start(
        self, name: str, *flags: str, env: dict[str, str] | None = None, script: Path = TRAIN_STATE
    ) -> None:
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.launchers[name] = subprocess.Popen(
                [*RUN, *self.common, *flags, str(script), *self.script_args],
                env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=REPO,
            )  # fmt: skip

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def processes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get(MARKER) == self.marker:
                    found.append(p)
        return found

    def kill_all(self) -> None:
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                p.kill()
        for proc in self.launchers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def _wait(condition, timeout: float, what: str, machines: Machines) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {n}\n{machines.log(n)[-3000:]}" for n in machines.launchers)
    raise AssertionError(f"no {what} within {timeout}s\n{logs}")


def _progress(out: Path) -> int:
    step = -1
    with contextlib.suppress(OSError):
        for line in (out / "events.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("kind") == "progress":
                    step = max(step, int(event.get("step", -1)))
    return step


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_machines_keep_strangers_out_refuse_a_stranger_s_arguments_and_end_on_sigterm(
    tmp_path,
):
    out = tmp_path / "out"
    machines = Machines(
        tmp_path,
        ["--nnodes", "2", "--nproc-per-node", "1", "--standby", "0", "--rdzv-id", "mn-test",
         "--rdzv-timeout", "120"],
        ["--steps", "100000", "--step-time", "0.05", "--result-dir", str(out),
         "--snapshot-dir", str(tmp_path / "snapshots"), "--persist-every", "1000000"],
    )  # fmt: skip
    try:
        machines.start("coordinator", "--node-rank", "0", "--state-dir", str(tmp_path / "state"))
        machines.start("agent", "--node-rank", "1")
        _wait(lambda: _progress(out) >= 20, 240, "training", machines)
        address = ("127.0.0.1", machines.port)
        # a stranger (no secret) is refused and learns nothing of the job
        with pytest.raises(L.Refused, match="INPROCESS_JOB_SECRET"):
            L.connect(address, _secret(), {"job": "mn-test", "agent": "s"}, timeout=10)
        # two machines cannot hold one node rank
        result = subprocess.run(
            [*RUN, *machines.common, "--node-rank", "1", str(TRAIN_STATE), *machines.script_args],
            env=machines.env, capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "node rank 1 has joined already" in result.stderr
        # a machine whose arguments differ is refused, by the flag that differs
        odd = [*machines.common, "--nproc-per-node", "2"]
        result = subprocess.run(
            [*RUN, *odd, str(TRAIN_STATE), *machines.script_args],
            env=machines.env, capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "--nproc-per-node differs: 2 on this machine, 1 at the coordinator" in result.stderr
        # a machine too many (no node rank: by arrival) is not needed: exit 0
        result = subprocess.run(
            [*RUN, *machines.common, str(TRAIN_STATE), *machines.script_args],
            env=machines.env, capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "this machine is one too many" in result.stderr
        step = _progress(out)
        _wait(lambda: _progress(out) >= step + 10, 120, "training after the refusals", machines)
        # Slurm's warning before the end (--signal=USR1@N) reaches every process of
        # the job: the machinery outlives it, each rank persists its next snapshot
        # (whatever --persist-every says)
        assert not list((tmp_path / "snapshots").glob("step-*"))
        everyone = machines.processes()
        names = {}
        for p in everyone:
            with contextlib.suppress(psutil.Error):
                names[p.pid] = " ".join(p.cmdline())[:150]
        for p in everyone:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGUSR1)
        _wait(
            lambda: list((tmp_path / "snapshots").glob("step-*/shard-0.done.json")),
            60,
            "a snapshot on disk after SIGUSR1",
            machines,
        )
        step = _progress(out)
        _wait(lambda: _progress(out) >= step + 10, 120, "training after SIGUSR1", machines)
        dead = {pid: names.get(pid) for pid in (p.pid for p in everyone if not p.is_running())}
        assert not dead, dead
        state = json.loads((tmp_path / "state" / "state.json").read_text())
        assert state["node_relaunches"] == 0 and sum(state["worker_restarts"].values()) == 0
        # SIGTERM to every launcher at once (scancel, a time limit): all end within 30 s
        began = time.monotonic()
        for name in ("coordinator", "agent"):
            machines.launchers[name].send_signal(signal.SIGTERM)
        for name in ("coordinator", "agent"):
            machines.launchers[name].wait(30 - (time.monotonic() - began))
        assert machines.launchers["coordinator"].returncode == 128 + signal.SIGTERM
        assert machines.launchers["agent"].returncode == 128 + signal.SIGTERM
        _wait(lambda: not machines.processes(), 10, "every process of the job gone", machines)
    finally:
        machines.kill_all()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_coordinator_s_machine_lost_ends_every_other_machine_with_one_line(tmp_path):
    """No separate coordinator host: its machine's loss (every process of it killed
    at once) ends the other machines' agents and workers, each with one clear line
    and an exit code a requeue can act on (surviving it is etcd's business)."""
    from inprocess.failover.node_agent import COORDINATOR_LOST_EXIT, RECONNECT_GRACE

    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")  # no torch: a cheap machine
    machines = Machines(
        tmp_path,
        ["--nnodes", "2", "--nproc-per-node", "1", "--standby", "0", "--rdzv-timeout", "120"],
        [],
    )
    coordinator_env = dict(machines.env, **{MARKER: machines.marker + "-coordinator"})
    try:
        machines.start(
            "coordinator", "--node-rank", "0", "--state-dir", str(tmp_path / "state"),
            env=coordinator_env, script=sleeper,
        )  # fmt: skip
        machines.start("agent", "--node-rank", "1", script=sleeper)

        def both_running() -> bool:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads((tmp_path / "state" / "state.json").read_text())
                return all(w["status"] == "running" for w in state["workers"].values())
            return False

        _wait(both_running, 120, "both machines' workers", machines)
        agent_side = machines.processes()  # the agent and its worker
        assert len(agent_side) >= 2
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get(MARKER) == coordinator_env[MARKER]:
                    p.kill()
        lost_at = time.monotonic()
        agent = machines.launchers["agent"]
        agent.wait(RECONNECT_GRACE + 60)
        assert agent.returncode == COORDINATOR_LOST_EXIT, machines.log("agent")
        assert time.monotonic() - lost_at < RECONNECT_GRACE + 30
        lines = [x for x in machines.log("agent").splitlines() if "ERROR" in x]
        assert len(lines) == 1 and "the job's coordinator at 127.0.0.1" in lines[0], lines
        _wait(lambda: not machines.processes(), 15, "the agent's worker gone", machines)
    finally:
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get(MARKER) == coordinator_env[MARKER]:
                    p.kill()
        machines.kill_all()
