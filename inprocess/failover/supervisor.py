"""The supervisor: keeps a job's controller alive.

The ``inprocess-run`` process itself. It creates the job's state file, then
runs the controller as a child and starts a new one (``--recover``) whenever
the controller dies before the job reached STOPPED in the state file: a crash
of the controller never ends the job by itself.

It is a child subreaper (``PR_SET_CHILD_SUBREAPER``): when the controller dies,
its workers and store server become the supervisor's children instead of
init's. The supervisor reaps them when they end and records how each ended, so
the next controller knows the exit status of workers it did not start. When
the job is over it makes sure no process of the job is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from .backends.local import write_exit_record
from .controller import exits_dir
from .state import Stage, StateStore

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
#: a controller that keeps crashing this often in a row gives up the job
MAX_CONTROLLER_RESTARTS = 10
#: a controller stopped (SIGSTOP) this long is hung: it is killed and replaced
CONTROLLER_STOP_GRACE = 5.0


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def processes_with_env(name: str, value: str) -> list[psutil.Process]:
    """Live processes (but this one) whose environment has ``name=value``.

    Children inherit their parent's environment, so a marker set when a job
    starts finds every process of it, forked or not, whoever its parent is now.
    """
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def job_processes(job_id: str) -> list[psutil.Process]:
    """Live processes of the job: those started with ``INPROCESS_JOB_ID=<job_id>``."""
    return processes_with_env("INPROCESS_JOB_ID", job_id)


class Supervisor:
    def __init__(self, state_dir: Path, controller_args: list[str]) -> None:
        self.state_dir = state_dir
        self.controller_args = controller_args
        self.states = StateStore(state_dir)
        self.controller: subprocess.Popen[bytes] | None = None
        self._signal: int | None = None

    def run(self) -> int:
        _become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._forward)
        job_id = self.states.load().job_id
        restarts = 0
        try:
            while True:
                status = self._run_controller(recover=restarts > 0)
                state = self.states.load()
                if state.stage is Stage.STOPPED:
                    return state.exit_code if state.exit_code is not None else 1
                restarts += 1
                log.error(
                    "the controller died (%s) while the job was %s; starting a new one (%d/%d)",
                    _describe(status),
                    state.stage.value,
                    restarts,
                    MAX_CONTROLLER_RESTARTS,
                )
                if restarts > MAX_CONTROLLER_RESTARTS:
                    log.error("the controller keeps dying: giving up the job")
                    return 1
        finally:
            self._clean_up(job_id)

    def _run_controller(self, recover: bool) -> int:
        args = [
            sys.executable,
            "-m",
            "inprocess.failover.controller",
            "--state-dir",
            str(self.state_dir),
        ]
        if recover:
            args.append("--recover")
        self.controller = subprocess.Popen(args + self.controller_args)
        pid = self.controller.pid
        while True:
            try:
                reaped, status = os.waitpid(-1, os.WUNTRACED)
            except InterruptedError:
                continue
            except ChildProcessError:
                return 1
            if os.WIFSTOPPED(status):
                # A stopped worker is its Wrapper's business (hard timeout); a
                # stopped controller would hold the whole job: replace it.
                if reaped == pid:
                    _kill_if_still_stopped(pid, CONTROLLER_STOP_GRACE)
                continue
            if reaped == pid:
                self.controller.returncode = os.waitstatus_to_exitcode(status)
                return status
            # An orphaned worker or store server of a dead controller.
            write_exit_record(exits_dir(self.state_dir), reaped, status)

    def _forward(self, signum: int, frame: object) -> None:
        """Ctrl-C or SIGTERM: the controller stops the job and records why."""
        self._signal = signum
        if self.controller is not None and self.controller.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.controller.pid, signum)

    def _clean_up(self, job_id: str) -> None:
        """Nothing of the job may outlive it."""
        leftovers = job_processes(job_id)
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(leftovers, timeout=5)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        # Reap what we adopted, so nothing is left as a zombie either.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.01)


def _kill_if_still_stopped(pid: int, grace: float) -> None:
    """Kills ``pid`` (its death is then reaped as usual) if it stays stopped for ``grace``."""
    log.warning("the controller (pid %d) is stopped", pid)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stopped = f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except OSError:
            return
        if not stopped:
            log.warning("the controller (pid %d) continues", pid)
            return
        time.sleep(0.05)
    log.error("the controller (pid %d) was stopped for %.3gs: replacing it", pid, grace)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _describe(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
