"""A job of several machines whose coordinator etcd elects (``--rdzv-backend
etcd``), against a real 3-member etcd: the launch's refusals, then one job of
two machines that keeps a stranger's leader record out, survives its
coordinator's machine frozen past its lease (a new term, the job goes on,
decisions once) and one etcd member killed, and finishes exactly, its state in
etcd sealed with the job's secret.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time

import psutil
import pytest
from test_multinode import TRAIN_STATE, Machines, _env, _run, _secret, _wait

from inprocess import security
from inprocess.failover.etcd import Etcd
from inprocess.failover.leadership import job_prefix

pytestmark = pytest.mark.timeout(120)

#: seconds the coordinator's machine is frozen (SIGSTOP): well past its lease (3 s),
#: past the agents' patience with a silent coordinator (10 s) and the new
#: coordinator's wait for the machines to come back (20 s)
FREEZE = 30


def test_an_etcd_launch_names_what_is_wrong(tmp_path):
    script = str(TRAIN_STATE)
    dead = f"127.0.0.1:{_closed_port()},127.0.0.1:{_closed_port()}"
    flags = ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-id", "j"]
    began = time.monotonic()
    result = _run([*flags, "--rdzv-endpoint", dead, script], _env(INPROCESS_JOB_SECRET=_secret()))
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.stderr
    for endpoint in dead.split(","):
        assert endpoint in errors[0]
    assert time.monotonic() - began < 60
    result = _run([*flags, "--rdzv-endpoint", "e1:0", script], _env(INPROCESS_JOB_SECRET=_secret()))
    assert result.returncode == 2 and "--rdzv-endpoint: bad etcd endpoint 'e1:0'" in result.stderr
    result = _run(
        [*flags, "--rdzv-endpoint", dead, "--coordinator-only", script],
        _env(INPROCESS_JOB_SECRET=_secret()),
    )
    assert result.returncode == 2
    assert "--coordinator-only does not go with --rdzv-backend etcd" in result.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(out) -> list[dict]:
    found = []
    with contextlib.suppress(OSError):
        for line in (out / "events.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


def _machine(marker: str) -> list[psutil.Process]:
    """Every process of one "machine": its launcher and what it started."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("TEST_MULTINODE_MARKER") == marker:
                found.append(p)
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_machines_elect_their_coordinator_and_outlive_its_machine(tmp_path, etcd_cluster):
    """Two machines train, one is a hot spare; etcd elects the coordinator. A
    stranger's leader record is ignored; the coordinator's machine frozen past its
    lease: a new term, a coordinator that finds another leading stands down; one
    etcd member lost: nothing happens; two: training goes on, the leader stays;
    then every process of the coordinator's
    machine killed: another machine's launcher is elected, takes the job over
    (a cold restart from persisted snapshots: the store went with the machine),
    the spare takes the lost machine's place, and the job finishes exactly."""
    # enough steps that the job outlasts every phase below on a busy machine
    job, steps = "etcd-job", 1500
    out = tmp_path / "out"
    machines = Machines(
        tmp_path,
        ["--nnodes", "2:3", "--nproc-per-node", "1", "--standby", "0", "--rdzv-id", job,
         "--rdzv-backend", "etcd", "--master-addr", "127.0.0.1", "--rdzv-timeout", "120"],
        ["--steps", str(steps), "--step-time", "0.05", "--result-dir", str(out),
         "--snapshot-dir", str(tmp_path / "snapshots"), "--persist-every", "10"],
    )  # fmt: skip
    # (Machines names a c10d endpoint: here it is etcd's)
    machines.common[machines.common.index("--rdzv-endpoint") + 1] = etcd_cluster.endpoint_arg()
    secret = machines.env["INPROCESS_JOB_SECRET"]
    etcd = Etcd(etcd_cluster.endpoint_arg(), timeout=5)
    leader_key, state_key = job_prefix(job) + "leader", job_prefix(job) + "state"
    # A stranger (no secret) claims the lead first, pointing at its own listener.
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(0.1)
    forged = security.seal(
        leader_key,
        json.dumps({"identity": "stranger", "endpoint": f"127.0.0.1:{trap.getsockname()[1]}",
                    "lease": 1}),
        _secret(),
    )  # fmt: skip
    etcd.put(leader_key, forged)
    markers = {name: f"{machines.marker}-{name}" for name in "abc"}
    try:
        for name in "abc":
            env = dict(machines.env, TEST_MULTINODE_MARKER=markers[name])
            machines.start(name, "--state-dir", str(tmp_path / f"state-{name}"), env=env)
        _wait(lambda: _step(out) >= 40, 240, "training", machines)
        with pytest.raises(TimeoutError):
            trap.accept()  # nobody followed the stranger's record

        def leading_machine() -> tuple[str, dict]:
            leader = _leader(etcd, leader_key, secret)
            assert leader is not None
            pid = int(leader["identity"].split("/")[1])
            return next(n for n, p in machines.launchers.items() if p.pid == pid), leader

        first_name, first = leading_machine()
        # The coordinator's machine frozen (SIGSTOP) for 30 s: a new term.
        frozen = _machine(markers[first_name])
        for p in frozen:
            with contextlib.suppress(psutil.Error):
                p.suspend()
        time.sleep(FREEZE)
        for p in frozen:
            with contextlib.suppress(psutil.Error):
                p.resume()
        _wait(
            lambda: (_leader(etcd, leader_key, secret) or {}).get("term", 0) > first["term"],
            60,
            "a new term",
            machines,
        )
        step = _step(out)
        _wait(lambda: _step(out) >= step + 20, 240, "training after the freeze", machines)
        second_name, second = leading_machine()
        if second_name == first_name:
            assert f"leading again (term {second['term']})" in machines.log(first_name)
        else:
            _wait(
                lambda: "this machine's coordinator stands down" in machines.log(first_name),
                30,
                "the frozen coordinator standing down",
                machines,
            )
        # one etcd member lost: nothing changes; two: no quorum, training goes on,
        # the leader stays (one warning); the quorum back: the same term goes on
        etcd_cluster.kill(0)
        step = _step(out)
        _wait(lambda: _step(out) >= step + 20, 120, "training without an etcd member", machines)
        etcd_cluster.kill(1)
        step = _step(out)
        time.sleep(8)  # > the lease (3 s)
        _wait(lambda: _step(out) >= step + 20, 120, "training without etcd's quorum", machines)
        etcd_cluster.restart(0)
        etcd_cluster.restart(1)
        etcd_cluster.wait_ready()
        assert _leader(etcd, leader_key, secret) == second
        # one warning of the lease; a decision taken meanwhile waited, with one of its own
        log = machines.log(second_name)
        assert log.count("is not renewed; its coordinator goes on") == 1, log[-4000:]
        assert log.count("etcd does not answer") <= 2, log[-4000:]
        assert _step(out) < steps - 200, "the job is too short for this test: more --steps"
        # every process of the coordinator's machine killed at once
        for p in _machine(markers[second_name]):
            with contextlib.suppress(psutil.Error):
                p.kill()
        _wait(
            lambda: (_leader(etcd, leader_key, secret) or {}).get("term", 0) > second["term"],
            60,
            "a coordinator elected on another machine",
            machines,
        )
        third_name, _ = leading_machine()
        assert third_name != second_name
        survivors = [n for n in "abc" if n != second_name]
        for name in survivors:
            machines.launchers[name].wait(400)
        logs = {name: machines.log(name) for name in "abc"}
        for name in survivors:
            assert machines.launchers[name].returncode == 0, logs[name][-4000:]
        # exactly the requested steps on both training ranks (w grows by 1 a step)
        finished = [e["result"] for e in _lines(out) if e.get("kind") == "finish"]
        assert len(finished) == 2, finished
        assert all(r["step"] == steps and r["w"] == steps for r in finished), finished
        # the job's state is in etcd, sealed with its secret, and ended well
        value = etcd.get(state_key)
        assert value is not None
        state = json.loads(security.open_first(state_key, value.value, secret))
        assert state["stage"] == "STOPPED" and state["exit_code"] == 0, state["reason"]
        assert etcd.get(leader_key) is None  # resigned at the end
        _wait(
            lambda: not any(_machine(m) for m in markers.values()),
            30,
            "every process of the job gone",
            machines,
        )
    finally:
        trap.close()
        etcd.close()
        for marker in markers.values():
            for p in _machine(marker):
                with contextlib.suppress(psutil.Error):
                    p.resume()
                    p.kill()
        machines.kill_all()


def _leader(etcd: Etcd, key: str, secret: str) -> dict | None:
    kv = etcd.get(key)
    text = security.open_first(key, kv.value, secret) if kv is not None else None
    if text is None:
        return None
    return dict(json.loads(text), term=kv.mod_revision)


def _step(out) -> int:
    return max((int(e.get("step", -1)) for e in _lines(out) if e.get("kind") == "progress"),
               default=-1)  # fmt: skip


@pytest.mark.timeout(300)
def test_sigterm_to_every_launcher_stops_an_etcd_job(tmp_path, shared_etcd_cluster):
    """``scancel``: every launcher gets SIGTERM; the leader's coordinator is told
    before its machine's workers stop (no relaunch of them), all exit 143."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")  # no torch: cheap machines
    machines = Machines(
        tmp_path,
        ["--nnodes", "2", "--nproc-per-node", "1", "--standby", "0", "--rdzv-id", "etcd-stop",
         "--rdzv-backend", "etcd", "--master-addr", "127.0.0.1", "--rdzv-timeout", "120"],
        [],
    )  # fmt: skip
    machines.common[machines.common.index("--rdzv-endpoint") + 1] = (
        shared_etcd_cluster.endpoint_arg()
    )
    markers = {name: f"{machines.marker}-{name}" for name in "ab"}
    try:
        for name in "ab":
            env = dict(machines.env, TEST_MULTINODE_MARKER=markers[name])
            machines.start(
                name, "--state-dir", str(tmp_path / f"state-{name}"), env=env, script=sleeper
            )

        def both_running() -> bool:
            for name in "ab":
                with contextlib.suppress(OSError, ValueError):
                    path = tmp_path / f"state-{name}" / "state.json"
                    state = json.loads(path.read_text())
                    return len(state["workers"]) == 2 and all(
                        w["status"] == "running" for w in state["workers"].values()
                    )
            return False

        _wait(both_running, 180, "both machines' workers", machines)
        for name in "ab":
            machines.launchers[name].send_signal(signal.SIGTERM)
        for name in "ab":
            machines.launchers[name].wait(60)
        logs = "".join(machines.log(name) for name in "ab")
        for name in "ab":
            assert machines.launchers[name].returncode == 128 + signal.SIGTERM, logs[-4000:]
        assert "relaunch" not in logs, logs[-4000:]
        _wait(
            lambda: not any(_machine(m) for m in markers.values()),
            30,
            "every process of the job gone",
            machines,
        )
    finally:
        for marker in markers.values():
            for p in _machine(marker):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        machines.kill_all()
