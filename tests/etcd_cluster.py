"""A real etcd cluster of several members on this one machine, for the tests of
what the launcher keeps in etcd (its durable state, its coordinator's lease).

Every member listens on 127.0.0.1 on a client and a peer port of its own and
keeps its data in a directory of its own under the test's temporary directory;
its output goes to ``<dir>/member-<i>.log`` (named in every failure's message).
Heartbeat 50 ms and election timeout 500 ms: a lost leader is replaced within
about a second. The members are children of the test process (SIGTERMed by the
kernel if it dies) and :meth:`EtcdCluster.close` reaps every one of them.

The tests need ``etcd`` on ``PATH`` (Debian's ``etcd-server``, installed with
apt-get when missing and the tests run as root); without it they skip, unless
``INPROCESS_REQUIRE_ETCD=1`` (set by CI), where they fail.

Fixtures (registered in ``tests/conftest.py``): ``etcd_cluster``, a fresh
3-member cluster per test (the test may kill and restart members), and
``shared_etcd_cluster``, one per module (tests must leave every member running).

    python tests/etcd_cluster.py [SIZE]   # a cluster for a shell, until Ctrl-C
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

from inprocess._net import free_port

log = logging.getLogger(__name__)

#: how long a start may take until the cluster has a leader and serves a put and a get
START_TIMEOUT = 30.0
#: Raft timings of the members (ms): quick failovers on one loaded machine
HEARTBEAT_MS = 50
ELECTION_MS = 500


def etcd_available() -> bool:
    """Whether an ``etcd`` program is on ``PATH``."""
    return shutil.which("etcd") is not None


def _parent_death_signal():
    """A ``preexec_fn`` that has the kernel SIGTERM the member when the test
    process dies without closing the cluster: no member outlives the run."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def set_signal() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return set_signal


def _post(endpoint: str, path: str, body: dict, timeout: float) -> dict:
    """One request to a member's JSON gateway; raises OSError (URLError) on any failure."""
    request = urllib.request.Request(
        f"http://{endpoint}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class EtcdCluster:
    """A real etcd cluster of ``size`` members on 127.0.0.1, each with its own
    data dir under ``tmp_path`` and free client and peer ports; started with
    ``--initial-cluster-state new``, ``--heartbeat-interval 50`` and
    ``--election-timeout 500`` (ms) so failovers are quick."""

    def __init__(self, tmp_path: Path, size: int = 3, enable_v2: bool = False) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self.dir = Path(tmp_path)
        self.size = size
        self.enable_v2 = enable_v2
        self.names = [f"member-{i}" for i in range(size)]
        self.client_ports = [free_port() for _ in range(size)]
        self.peer_ports = [free_port() for _ in range(size)]
        #: ``127.0.0.1:PORT`` of every member's client URL, without scheme
        self.endpoints: list[str] = [f"127.0.0.1:{p}" for p in self.client_ports]
        # a token of its own: members of another test's cluster never join this one
        self.token = f"inprocess-test-{uuid.uuid4().hex[:12]}"
        self._procs: list[subprocess.Popen | None] = [None] * size

    # -- paths ----------------------------------------------------------------

    def data_dir(self, member: int) -> Path:
        return self.dir / f"{self.names[member]}.data"

    def log_path(self, member: int) -> Path:
        return self.dir / f"{self.names[member]}.log"

    def endpoint_arg(self) -> str:
        """Every member's endpoint, comma-separated, as ``--rdzv-endpoint`` takes them."""
        return ",".join(self.endpoints)

    def pid(self, member: int) -> int | None:
        """The running member's pid (None when it is not running)."""
        proc = self._procs[member]
        return proc.pid if proc is not None and proc.poll() is None else None

    # -- start ----------------------------------------------------------------

    def _argv(self, member: int, state: str) -> list[str]:
        peers = ",".join(
            f"{name}=http://127.0.0.1:{port}"
            for name, port in zip(self.names, self.peer_ports, strict=True)
        )
        client = f"http://127.0.0.1:{self.client_ports[member]}"
        peer = f"http://127.0.0.1:{self.peer_ports[member]}"
        argv = [
            shutil.which("etcd") or "etcd",
            f"--name={self.names[member]}",
            f"--data-dir={self.data_dir(member)}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={peers}",
            f"--initial-cluster-state={state}",
            f"--initial-cluster-token={self.token}",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_MS}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.enable_v2:
            argv.append("--enable-v2=true")
        return argv

    def _spawn(self, member: int, state: str) -> None:
        if self.pid(member) is not None:
            raise RuntimeError(f"etcd {self.names[member]} is running already")
        self.dir.mkdir(parents=True, exist_ok=True)
        die_with_us = _parent_death_signal()
        # our copy of the log's fd is closed at once: the member keeps its own
        with open(self.log_path(member), "ab") as out:
            self._procs[member] = subprocess.Popen(
                self._argv(member, state),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # its own session: a terminal's Ctrl-C reaches the test only
                start_new_session=True,
                preexec_fn=die_with_us,
            )
        log.debug("started etcd %s (pid %d)", self.names[member], self._procs[member].pid)

    def start(self) -> EtcdCluster:
        """Starts every member; returns once the cluster has a leader and a put and
        a linearizable get work (within :data:`START_TIMEOUT`)."""
        try:
            for i in range(self.size):
                self._spawn(i, "new")
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Waits until every running member sees a leader and a put and a get
        through one of them work; raises with the members' logs otherwise."""
        deadline = time.monotonic() + timeout
        last = "nothing tried"
        key = _b64("/inprocess-test/ready")
        while True:
            dead = [
                (self.names[i], p.returncode)
                for i, p in enumerate(self._procs)
                if p is not None and p.poll() is not None
            ]
            if dead:
                raise RuntimeError(f"etcd members exited {dead} while starting:\n{self.logs()}")
            running = [i for i in range(self.size) if self.pid(i) is not None]
            try:
                for i in running:
                    status = _post(self.endpoints[i], "/v3/maintenance/status", {}, 2.0)
                    if int(status.get("leader", 0)) == 0:
                        raise OSError(f"{self.names[i]} sees no leader")
                if running:
                    endpoint = self.endpoints[running[0]]
                    _post(endpoint, "/v3/kv/put", {"key": key, "value": _b64("1")}, 2.0)
                    got = _post(endpoint, "/v3/kv/range", {"key": key}, 2.0)
                    if not got.get("kvs"):
                        raise OSError("the put was not read back")
                return
            except (OSError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"etcd cluster not ready after {timeout:.0f}s ({last}); logs "
                    f"{[str(self.log_path(i)) for i in range(self.size)]}:\n{self.logs()}"
                )
            time.sleep(0.1)

    # -- faults ---------------------------------------------------------------

    def _running(self, member: int) -> subprocess.Popen:
        if not isinstance(member, int) or not 0 <= member < self.size:
            raise ValueError(f"member must be an int in [0, {self.size}), got {member!r}")
        proc = self._procs[member]
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"etcd {self.names[member]} is not running")
        return proc

    def kill(self, member: int) -> None:
        """SIGKILLs member ``member`` (0-based) and reaps it."""
        proc = self._running(member)
        proc.kill()
        proc.wait(timeout=30)
        self._procs[member] = None  # not running, and no failure: killed on purpose

    def restart(self, member: int) -> None:
        """Starts a killed member again on its data dir and ports
        (``--initial-cluster-state existing``); returns once it serves (with
        a quorum running)."""
        if not isinstance(member, int) or not 0 <= member < self.size:
            raise ValueError(f"member must be an int in [0, {self.size}), got {member!r}")
        self._spawn(member, "existing")
        running = sum(self.pid(i) is not None for i in range(self.size))
        if running > self.size // 2:
            self.wait_ready()

    def stop(self, member: int) -> None:
        """SIGSTOPs member ``member``: it holds its ports and answers nothing."""
        self._running(member).send_signal(signal.SIGSTOP)

    def cont(self, member: int) -> None:
        """SIGCONTs a stopped member."""
        self._running(member).send_signal(signal.SIGCONT)

    # -- end ------------------------------------------------------------------

    def logs(self, tail: int = 2000) -> str:
        """The end of every member's log, for a failure's message."""
        parts = []
        for i in range(self.size):
            path = self.log_path(i)
            with contextlib.suppress(OSError):
                parts.append(f"--- {path}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def close(self) -> None:
        """SIGKILLs every member (a stopped one too) and reaps it; idempotent."""
        for proc in self._procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for i, proc in enumerate(self._procs):
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    log.warning("etcd %s not reaped 30 s after SIGKILL", self.names[i])
        self._procs = [None] * self.size

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


#: the Debian package of the etcd program
PACKAGE = "etcd-server"


def install() -> str | None:
    """Installs etcd with apt-get when it is missing and we are root (as the
    Slurm harness does its packages); returns why it cannot be had, or None."""
    if etcd_available():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"etcd tests need the etcd program (Debian: apt-get install {PACKAGE})"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # another test process may be installing too: wait for dpkg's lock
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends",
           "-o", "DPkg::Lock::Timeout=300", PACKAGE]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:  # stale package lists: refresh them once
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0 or not etcd_available():
        tail = (out.stdout + out.stderr)[-2000:]
        return f"installing {PACKAGE} failed (rc {out.returncode}): {tail}"
    return None


def unavailable() -> str | None:
    """Why no cluster can be started here (None: one can, etcd installed if need be)."""
    if sys.platform != "linux":
        return "etcd tests run on Linux only"
    return install()


@contextlib.contextmanager
def cluster_or_skip(
    tmp_path: Path, size: int = 3, enable_v2: bool = False
) -> Iterator[EtcdCluster]:
    """A started cluster, closed on exit; skips the test where etcd is missing
    (fails instead with ``INPROCESS_REQUIRE_ETCD=1``)."""
    import pytest

    reason = unavailable()
    if reason is not None:
        if os.environ.get("INPROCESS_REQUIRE_ETCD") == "1":
            pytest.fail(f"INPROCESS_REQUIRE_ETCD=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = EtcdCluster(tmp_path, size, enable_v2)
    try:
        yield cluster.start()
    finally:
        cluster.close()


if __name__ == "__main__":
    import tempfile

    logging.basicConfig(level=logging.INFO)
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as d, EtcdCluster(Path(d), size) as cluster:
        print(f"--rdzv-endpoint {cluster.endpoint_arg()}  (logs under {d}); Ctrl-C ends it")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
