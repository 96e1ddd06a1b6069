"""A real Slurm cluster of several nodes on this one machine, for the tests of
multi-machine launches (``inprocess-run`` once per node, under ``srun``).

Debian's ``slurm-wlm`` (slurmctld, and one slurmd per node: the Debian build
runs several on one host) with ``munge`` for authentication. Everything the
cluster keeps lives in a temporary directory: ``slurm.conf``, a munge key and
socket of its own, state, spool, logs. Every node shares this host's name and
address; a task tells its node by ``SLURMD_NODENAME`` (``n1`` .. ``nN``) and
``SLURM_NODEID``. Commands (``srun``, ``sbatch``, ``sinfo``, ``scancel``) need
:attr:`SlurmCluster.env`, which carries ``SLURM_CONF``.

The daemons run in the foreground as children of the test process, so stopping
them needs no pid file. What they start on their own (``slurmstepd``, which
Slurm detaches from slurmd, and the tasks under it) carries
:data:`MARKER` in its environment; :meth:`SlurmCluster.stop` cancels every job,
stops the daemons and then fails if any process with the marker is left.

Needs root (slurmd runs jobs as their user, munged and slurmd want root-owned
files) and installs ``slurm-wlm`` and ``munge`` with apt-get when they are
missing. Where neither can be had, :func:`unavailable` says why and the tests
skip, unless ``INPROCESS_REQUIRE_SLURM=1`` (set by CI), where they fail.

    python tests/slurm_cluster.py [NODES]   # a cluster for a shell, until Ctrl-C
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from inprocess._net import free_port

log = logging.getLogger(__name__)

#: the environment variable every process of a cluster carries (its directory):
#: how the stop finds what Slurm detached from the daemons
MARKER = "INPROCESS_TEST_SLURM_DIR"

#: the programs a cluster needs, and the Debian packages that bring them
PROGRAMS = ("slurmctld", "slurmd", "slurmstepd", "srun", "sbatch", "sinfo", "squeue", "scancel")
PACKAGES = ("slurm-wlm", "munge")

#: the cluster the tests get: 4 nodes and a spare, each with room for 2 workers,
#: a standby and the launcher (Slurm counts these CPUs; the machine may have 2:
#: ``config_overrides`` and a forced oversubscription make that fine)
DEFAULT_NODES = 5
DEFAULT_CPUS = 4

#: how long the daemons may take to bring every node to idle
START_TIMEOUT = 120.0


#: torch.distributed's variables: never passed to the cluster's tasks from here
TORCH_DISTRIBUTED_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
#: where the node names are made to resolve, and the tag of the lines added there
HOSTS_FILE = "/etc/hosts"
HOSTS_TAG = "# inprocess test slurm cluster of pid "

def _missing() -> list[str]:
    needed = (*PROGRAMS, "munged")
    return [p for p in needed if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]


def _which(program: str) -> str:
    found = shutil.which(program)
    if found is None and Path("/usr/sbin", program).exists():
        found = f"/usr/sbin/{program}"
    if found is None:
        raise FileNotFoundError(f"{program} not found")
    return found


def _parent_death_signal():
    """A ``preexec_fn`` that has the kernel SIGTERM the child when this process
    dies (killed without its stop running: a daemon must not outlive the test
    run). Resolved here, in the parent: the child only makes the call."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def set_signal() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return set_signal


def install() -> str | None:
    """Installs the packages when a program is missing and we are root; returns
    why a cluster cannot be had, or None when it can."""
    if not _missing():
        return None
    if os.geteuid() != 0:
        return f"Slurm tests need root to install {' '.join(PACKAGES)} (missing: {_missing()})"
    if shutil.which("apt-get") is None:
        return (
            f"Slurm tests need {' '.join(PACKAGES)} (missing: {_missing()}) and there is no apt-get"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # another test process may be installing too: wait for dpkg's lock
    cmd = [
        "apt-get",
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        "-o",
        "DPkg::Lock::Timeout=300",
        *PACKAGES,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:  # stale package lists: refresh them once
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0 or _missing():
        tail = (out.stdout + out.stderr)[-2000:]
        return f"installing {' '.join(PACKAGES)} failed (rc {out.returncode}): {tail}"
    return None


def unavailable() -> str | None:
    """Why no cluster can be started here (None: one can)."""
    if sys.platform != "linux":
        return "Slurm tests run on Linux only"
    if os.geteuid() != 0:
        return (
            "Slurm tests need root (slurmd runs jobs as their user; munged wants root-owned keys)"
        )
    return install()


class SlurmCluster:
    """A running cluster: :attr:`env` for its commands, :meth:`run` to call one,
    :meth:`stop` to end everything (also on exit from ``with``)."""

    def __init__(
        self,
        nodes: int = DEFAULT_NODES,
        cpus: int = DEFAULT_CPUS,
        kill_wait: int = 30,
        directory: Path | None = None,
    ) -> None:
        for name, value in (("nodes", nodes), ("cpus", cpus), ("kill_wait", kill_wait)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.nodes = nodes
        self.cpus = cpus
        self.kill_wait = kill_wait
        self._own_dir = directory is None
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-")) if directory is None else directory
        self.dir = self.dir.resolve()
        self.conf = self.dir / "slurm.conf"
        #: ``srun -N4 ...`` names nodes n1..nN
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        # (nor what a launcher or an earlier test of this process set: a task reads them)
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "PET_", "TORCHELASTIC_", "INPROCESS_"))
            and k not in TORCH_DISTRIBUTED_ENV
        }
        #: the environment for srun/sbatch/sinfo/squeue/scancel (and what their tasks inherit)
        self.env: dict[str, str] = {**base, "SLURM_CONF": str(self.conf), MARKER: str(self.dir)}
        self._daemons: list[tuple[str, subprocess.Popen]] = []
        self._hosts_line: str | None = None
        self.start_seconds: float | None = None
        self.stop_seconds: float | None = None

    @property
    def daemon_pids(self) -> list[int]:
        """Process ids of munged, slurmctld and every slurmd, while they run."""
        return [p.pid for _, p in self._daemons]

    # -- start ----------------------------------------------------------------

    def start(self) -> SlurmCluster:
        """Writes the configuration, starts munged, slurmctld and every slurmd,
        and returns once ``sinfo`` shows every node idle."""
        began = time.monotonic()
        try:
            self._write_files()
            self._add_host_names()
            self._start_daemons()
            self._wait_idle()
        except BaseException:
            self.stop(check=False)
            raise
        self.start_seconds = time.monotonic() - began
        log.info(
            "slurm cluster of %d nodes up in %.2fs: %s", self.nodes, self.start_seconds, self.conf
        )
        return self

    def _write_files(self) -> None:
        for sub in ("run", "log", "state", "munge", *(f"spool/{n}" for n in self.node_names)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir / "munge", 0o700)
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        host = socket.gethostname().split(".")[0]
        # one block: the controller's port, then one per slurmd
        ctl_port = free_port(following=self.nodes)
        d = self.dir
        lines = [
            f"ClusterName=inprocess{os.getpid()}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            # linuxproc: a job's processes are found by their parentage (no cgroups
            # here); task/none: no binding, so tasks may share the 2 real cores
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmUser=root",
            "SlurmdUser=root",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # take each node's CPUs from this file, not from the hardware
            "SlurmdParameters=config_overrides",
            f"KillWait={self.kill_wait}",
            # a loaded 2-core machine answers slowly: no command fails on the default 10 s
            "MessageTimeout=30",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
        ]
        for i, name in enumerate(self.node_names, start=1):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={ctl_port + i}"
                f" CPUs={self.cpus} RealMemory=2000 State=UNKNOWN"
            )
        # FORCE: jobs share nodes (several tests' jobs at once on a 2-core machine)
        lines.append(
            f"PartitionName=debug Nodes=n[1-{self.nodes}] Default=YES MaxTime=INFINITE"
            " State=UP OverSubscribe=FORCE:8"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def _add_host_names(self) -> None:
        """Makes n1..nN resolve (to this machine), as a real cluster's node names do:
        one line of /etc/hosts, tagged with this process, removed by :meth:`stop`.
        Skipped where the names resolve already or the file cannot be written."""
        try:
            socket.getaddrinfo(self.node_names[-1], None)
            return
        except OSError:
            pass
        line = f"127.0.0.1 {' '.join(self.node_names)} {HOSTS_TAG}{os.getpid()}\n"
        with contextlib.suppress(OSError), open(HOSTS_FILE, "a") as hosts:
            fcntl.flock(hosts, fcntl.LOCK_EX)
            hosts.write(line)
            self._hosts_line = line

    def _remove_host_names(self) -> None:
        line, self._hosts_line = self._hosts_line, None
        if line is None:
            return
        with contextlib.suppress(OSError), open(HOSTS_FILE, "r+") as hosts:
            fcntl.flock(hosts, fcntl.LOCK_EX)
            kept = [x for x in hosts.readlines() if x != line]
            hosts.seek(0)
            hosts.writelines(kept)
            hosts.truncate()

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "munge.socket"

    def _spawn(self, name: str, argv: list[str]) -> None:
        die_with_us = _parent_death_signal()
        with open(self.dir / "log" / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                # its own session: a terminal's Ctrl-C reaches the test, and the
                # stop ends the daemon itself
                start_new_session=True,
                preexec_fn=die_with_us,
            )
        self._daemons.append((name, proc))

    def _start_daemons(self) -> None:
        d = self.dir
        # --force: the temporary directory sits under a world-writable /tmp
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--key-file={d}/munge/munge.key",
                f"--socket={self.munge_socket}",
                f"--pid-file={d}/run/munged.pid",
                f"--seed-file={d}/munge/seed",
                f"--log-file={d}/log/munged.log",
            ],
        )
        self._wait_for(lambda: self.munge_socket.exists(), "munged's socket", 20)
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        for name in self.node_names:
            self._spawn(
                f"slurmd-{name}", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", name]
            )

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [(n, p.returncode) for n, p in self._daemons if p.poll() is not None]
            if dead:
                raise RuntimeError(
                    f"slurm daemons exited {dead} waiting for {what}:\n{self.logs()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout:.0f}s:\n{self.logs()}")
            time.sleep(0.1)

    def node_states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` reports it (``idle``, ``alloc``, ``down*``...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=30)
        states = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def _wait_idle(self) -> None:
        def all_idle() -> bool:
            states = self.node_states()
            return sorted(states) == sorted(self.node_names) and set(states.values()) == {"idle"}

        self._wait_for(all_idle, f"{self.nodes} idle nodes", START_TIMEOUT)

    # -- use ------------------------------------------------------------------

    def run(
        self, argv: list[str], timeout: float = 60, check: bool = True, **kwargs
    ) -> subprocess.CompletedProcess:
        """Runs a Slurm command (or any) with the cluster's :attr:`env`; text output."""
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("cwd", self.dir)
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, check=check, **kwargs
        )

    def jobs(self) -> list[str]:
        """Ids of the jobs still pending, running or completing."""
        out = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=30)
        return out.stdout.split()

    def logs(self, tail: int = 3000) -> str:
        """The end of every daemon's log, for a failure's message."""
        parts = []
        for path in sorted((self.dir / "log").glob("*")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # -- stop -----------------------------------------------------------------

    def stop(self, check: bool = True) -> None:
        """Cancels every job, stops the daemons and removes the directory. With
        ``check``, raises when a process of the cluster (a daemon, a
        ``slurmstepd``, a task) had to be killed after all that: a leak."""
        began = time.monotonic()
        if any(n == "slurmctld" and p.poll() is None for n, p in self._daemons):
            with contextlib.suppress(Exception):
                self.run(["scancel", "--full", "-u", str(os.geteuid())], check=False, timeout=30)
                # KillWait after SIGTERM, then SIGKILL: a job ends within it
                deadline = time.monotonic() + self.kill_wait + 30
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.2)
        # every slurmd before slurmctld, and munged last: they talk to both on the way out
        for name, proc in reversed(self._daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                log.warning("slurm %s ignored SIGTERM for 15s: killed", name)
                proc.kill()
                proc.wait(timeout=15)
        self._daemons.clear()
        # invariant: what is left carrying the marker outlived every job's end
        # and the daemons: a leak, killed here and reported
        leftover = self.processes()
        for p in leftover:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(leftover, timeout=10)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        self._remove_host_names()
        self.stop_seconds = time.monotonic() - began
        if check and leftover:
            raise RuntimeError(f"slurm cluster left processes behind: {leftover}")

    def processes(self) -> list[psutil.Process]:
        """Every live process of the cluster but this one: its daemons, every
        ``slurmstepd``, the tasks and the Slurm commands run with :attr:`env`."""
        mine = os.getpid()
        found = []
        for p in psutil.process_iter():
            if p.pid == mine:
                continue
            with contextlib.suppress(psutil.Error):
                if p.environ().get(MARKER) == str(self.dir):
                    found.append(p)
        return found

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(check=exc[0] is None)


@contextlib.contextmanager
def cluster_or_skip(nodes: int = DEFAULT_NODES, cpus: int = DEFAULT_CPUS) -> Iterator[SlurmCluster]:
    """A started cluster for a test session; skips the test where none can be had
    (fails instead with ``INPROCESS_REQUIRE_SLURM=1``)."""
    import pytest

    reason = unavailable()
    if reason is not None:
        if os.environ.get("INPROCESS_REQUIRE_SLURM") == "1":
            pytest.fail(f"INPROCESS_REQUIRE_SLURM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    with SlurmCluster(nodes, cpus) as cluster:
        yield cluster


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    why = unavailable()
    if why is not None:
        sys.exit(why)

    # Ctrl-C or SIGTERM ends it (SIGINT too where a shell started it ignoring SIGINT)
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    with SlurmCluster(int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_NODES) as c:
        print(f"export SLURM_CONF={c.conf} {MARKER}={c.dir}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
