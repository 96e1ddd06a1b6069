"""Runs a job of real rank processes on this machine, and makes sure nothing outlives it.

``Job(script, nprocs, workdir)`` starts ``nprocs`` processes of a Python script
with the ``torch.distributed`` environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ...) on loopback, each in a session of its
own and marked (``INPROCESS_TEST_JOB``) so that every process the ranks start
(their monitor processes, forked or not) is found and ended with them. Used
by the test suite and the benchmarks; a script gets its settings as JSON in
``INPROCESS_TEST_SPEC``. With a :class:`~inprocess.tools.fork_template.ForkTemplate`
(``template=``) the ranks are forked from it instead of spawned, so a job does
not pay ``import torch`` per rank; ranks whose start-up environment differs
from the template's are spawned as usual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from .._net import free_port
from ..failover.supervisor import processes_with_env
from .fork_template import ForkedProcess, ForkTemplate

#: environment variable that marks every process of a job
MARKER = "INPROCESS_TEST_JOB"


def base_env(pythonpath: str | Path | None = None) -> dict[str, str]:
    """What every rank of a job sees beyond its own variables (and a fork template's
    environment for such ranks): this process's environment, quiet numpy warnings,
    a short DNS timeout and ``pythonpath`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env.update(
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
        # torch's store server resolves client names; never wait long on DNS.
        RES_OPTIONS="timeout:1 attempts:1",
    )
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def job_processes(marker: str) -> list[psutil.Process]:
    """Every live process carrying the job's marker (ranks and their monitors, forked or not)."""
    return processes_with_env(MARKER, marker)


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int | None
    output: str
    report: dict[str, Any] | None


@dataclasses.dataclass
class JobResult:
    ranks: list[RankResult]
    duration: float
    leftovers: list[int]

    @property
    def returncodes(self) -> list[int | None]:
        return [r.returncode for r in self.ranks]

    def report(self, rank: int) -> dict[str, Any]:
        report = self.ranks[rank].report
        assert report is not None, f"rank {rank} wrote no report:\n{self.ranks[rank].output}"
        return report

    def describe(self) -> str:
        parts = [f"returncodes={self.returncodes} duration={self.duration:.1f}s"]
        for r in self.ranks:
            parts.append(f"--- rank {r.rank} (rc={r.returncode}) ---\n{r.output[-6000:]}")
        return "\n".join(parts)


class Job:
    """``nprocs`` processes of ``script`` with the torch.distributed environment.

    ``pythonpath`` is prepended to the ranks' ``PYTHONPATH``.
    """

    def __init__(
        self,
        script: str | Path,
        nprocs: int,
        workdir: Path,
        spec: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        pythonpath: str | Path | None = None,
        template: ForkTemplate | None = None,
    ) -> None:
        self.script = Path(script)
        self.template = template
        self.pythonpath = pythonpath
        self.nprocs = nprocs
        self.workdir = workdir
        self.marker = uuid.uuid4().hex
        self.port = free_port()
        self.spec = dict(spec or {})
        self.spec.setdefault("report_dir", str(workdir))
        self.extra_env = env or {}
        self.args = args or []
        self.procs: list[subprocess.Popen[bytes] | ForkedProcess] = []
        self.logs: list[Path] = []

    def env(self, rank: int) -> dict[str, str]:
        env = base_env(self.pythonpath)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.nprocs),
            LOCAL_WORLD_SIZE=str(self.nprocs),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            INPROCESS_TEST_SPEC=json.dumps(self.spec),
        )
        env[MARKER] = self.marker
        env.update(self.extra_env)
        return env

    def start(self) -> Job:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for rank in range(self.nprocs):
            log = self.workdir / f"rank{rank}.log"
            self.logs.append(log)
            env = self.env(rank)
            with open(log, "wb") as out:
                if self.template is not None and self.template.can_fork(env):
                    proc: subprocess.Popen[bytes] | ForkedProcess = self.template.fork(
                        self.script, self.args, env, os.getcwd(), out.fileno()
                    )
                else:
                    proc = subprocess.Popen(
                        [sys.executable, str(self.script), *self.args],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                self.procs.append(proc)
        self.started = time.monotonic()
        return self

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def wait(self, timeout: float) -> JobResult:
        deadline = self.started + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        duration = time.monotonic() - self.started
        return self._collect(duration)

    def _collect(self, duration: float) -> JobResult:
        self.kill()
        leftovers = self._wait_for_leftovers()
        ranks = []
        for rank, proc in enumerate(self.procs):
            report_path = self.workdir / f"report{rank}.json"
            report = json.loads(report_path.read_text()) if report_path.exists() else None
            ranks.append(
                RankResult(
                    rank, proc.returncode, self.logs[rank].read_text(errors="replace"), report
                )
            )
        return JobResult(ranks, duration, leftovers)

    def _wait_for_leftovers(self, grace: float = 15.0) -> list[int]:
        """Monitor processes exit on their own once their rank is gone; give them a moment."""
        deadline = time.monotonic() + grace
        while True:
            alive = job_processes(self.marker)
            if not alive or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for proc in alive:  # never leave anything behind, even when failing the test
            with contextlib.suppress(psutil.Error):
                proc.kill()
        return [p.pid for p in alive]

    def kill(self) -> None:
        """Kills rank processes still running (a test timed out or failed)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> Job:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.kill()
        for proc in job_processes(self.marker):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def run_job(
    script: str | Path,
    nprocs: int,
    workdir: Path,
    spec: dict[str, Any] | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    pythonpath: str | Path | None = None,
    template: ForkTemplate | None = None,
) -> JobResult:
    """Runs a :class:`Job` to its end (or ``timeout`` seconds) and returns its result."""
    with Job(script, nprocs, workdir, spec, env, pythonpath=pythonpath, template=template) as job:
        return job.wait(timeout)
