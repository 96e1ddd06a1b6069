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
import socket
import time

import psutil
import pytest
from test_multinode import TRAIN_STATE, Machines, _env, _run, _secret, _wait

from inprocess import security
from inprocess.failover.etcd import Etcd
from inprocess.failover.leadership import job_prefix

pytestmark = pytest.mark.timeout(120)


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


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_machines_elect_their_coordinator_through_etcd(tmp_path, etcd_cluster):
    job, steps = "etcd-job", 400
    out = tmp_path / "out"
    machines = Machines(
        tmp_path,
        ["--nnodes", "2", "--nproc-per-node", "1", "--standby", "0", "--rdzv-id", job,
         "--rdzv-backend", "etcd", "--master-addr", "127.0.0.1", "--rdzv-timeout", "120",
         "--state-dir", str(tmp_path / "state")],
        ["--steps", str(steps), "--step-time", "0.05", "--result-dir", str(out)],
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
    b_env = dict(machines.env, **{"TEST_MULTINODE_MARKER": machines.marker + "-b"})
    try:
        machines.start("a")
        _wait(lambda: _leader(etcd, leader_key, secret), 120, "a leader", machines)
        first = _leader(etcd, leader_key, secret)
        machines.start("b", env=b_env)
        _wait(lambda: _step(out) >= 60, 240, "training on both machines", machines)
        with pytest.raises(TimeoutError):
            trap.accept()  # nobody followed the stranger's record
        # The coordinator's machine ("a": its launcher, coordinator and worker)
        # frozen past its lease: a new term, the same coordinator, the job goes on.
        frozen = [p for p in machines.processes() if p.environ().get("TEST_MULTINODE_MARKER")
                  == machines.marker]  # fmt: skip
        for p in frozen:
            with contextlib.suppress(psutil.Error):
                p.suspend()
        time.sleep(6)  # > the lease (3 s), < an agent's patience with silence (10 s)
        for p in frozen:
            with contextlib.suppress(psutil.Error):
                p.resume()
        _wait(
            lambda: (_leader(etcd, leader_key, secret) or {}).get("term", 0) > first["term"],
            60,
            "a new term",
            machines,
        )
        second = _leader(etcd, leader_key, secret)
        assert second["identity"] == first["identity"]
        # one etcd member lost: nothing changes
        etcd_cluster.kill(0)
        step = _step(out)
        _wait(lambda: _step(out) >= step + 20, 120, "training without an etcd member", machines)
        for name in ("a", "b"):
            machines.launchers[name].wait(300)
        logs = {name: machines.log(name) for name in ("a", "b")}
        assert machines.launchers["a"].returncode == 0, logs["a"][-3000:]
        assert machines.launchers["b"].returncode == 0, logs["b"][-3000:]
        # exactly the requested steps on both ranks (w grows by 1 a step)
        finished = [e["result"] for e in _lines(out) if e.get("kind") == "finish"]
        assert len(finished) == 2, finished
        assert all(r["step"] == steps and r["w"] == steps for r in finished), finished
        # the job's state is in etcd, sealed with its secret, and ended well
        value = etcd.get(state_key)
        assert value is not None
        state = json.loads(security.open_first(state_key, value.value, secret))
        assert state["stage"] == "STOPPED" and state["exit_code"] == 0, state["reason"]
        assert etcd.get(leader_key) is None  # resigned at the end
        # nothing started twice: no worker restarted, no machine relaunched
        assert state["node_relaunches"] == 0 and sum(state["worker_restarts"].values()) == 0
        # one leader per term: the frozen one stood aside, led again, saved under it
        assert logs["a"].count("lost the leadership of job") == 1, logs["a"][-4000:]
        assert f"leading again (term {second['term']})" in logs["a"], logs["a"][-4000:]
        _wait(lambda: not machines.processes(), 30, "every process of the job gone", machines)
    finally:
        trap.close()
        etcd.close()
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get("TEST_MULTINODE_MARKER", "").startswith(machines.marker):
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
