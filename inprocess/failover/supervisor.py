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
from collections.abc import Iterator
from pathlib import Path

import psutil

from .. import procfs
from .. import records as _records
from ..ownership import WRITABLE_BY_OTHERS, distrust
from . import policy
from .backends import DEFAULT_BACKEND, Backend, create_backend
from .runtime import (
    LAUNCHER_ENV,
    controller_pid_path,
    die_with_parent,
    launcher_identity,
    libc,
    signal_exit_code,
)
from .state import JobState, Stage, StateError, StateStore

__all__ = ["Supervisor", "die_with_parent", "record_end"]

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
#: a controller that keeps crashing this often in a row gives up the job
MAX_CONTROLLER_RESTARTS = 10
#: a controller that lived this long was stable: its crash starts a new count
CONTROLLER_STABLE_SECONDS = 3.0
#: environment variable naming this run of the job (one per ``inprocess-run``):
#: with the pid and start time it tells our processes from any other's
RUN_TOKEN_ENV = "INPROCESS_RUN_TOKEN"
#: environment variable with the supervisor's pid (the controller's expected parent)
SUPERVISOR_PID_ENV = "INPROCESS_SUPERVISOR_PID"
#: how long the guard lets a controller stop the job in order after the launcher died
GUARD_GRACE = 15.0
#: a controller stopped (SIGSTOP) this long is hung: it is killed and replaced
CONTROLLER_STOP_GRACE = 5.0


def _become_subreaper() -> None:
    if libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def check_private_dir(path: Path, what: str) -> None:
    """Refuses a directory another user owns or may write to (ours to trust).

    Raises:
        StateError: naming ``what``, the path, the owner or the mode.
    """
    # (a stat: the symlinks on the way were resolved and checked by the launcher)
    why = distrust(os.stat(path), directory=True)
    if why is not None:
        if why.startswith(WRITABLE_BY_OTHERS):
            why += "; make it private (chmod go-w) or choose another"
        raise StateError(f"{what} {path} {why}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise StateError(f"{what} {path} is not writable")


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


def run_processes(token: str, exclude: tuple[int, ...] = ()) -> list[psutil.Process]:
    """Live processes of this run of the job (``INPROCESS_RUN_TOKEN=<token>``).

    A psutil handle also remembers the process's start time, so signalling it
    later never hits an unrelated process that reused the pid.
    """
    return [p for p in processes_with_env(RUN_TOKEN_ENV, token) if p.pid not in exclude]


def end_processes(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds for those still alive."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace)


def record_end(state_dir: Path, exit_code: int, reason: str) -> None:
    """Records that the job ended (STOPPED, ``exit_code``, ``reason``) unless it already did.

    For the ends the controller could not record itself: its own repeated
    crashes, or the launcher's death. A stop the controller already decided
    keeps its result.
    """
    states = StateStore(state_dir)
    try:
        state = states.load()
        if state.stage is Stage.STOPPED:
            return
        now = time.time()
        if state.stage is not Stage.STOPPING:
            state = policy.request_stop(state, exit_code, reason, now=now).state
        states.save(policy.stopped(state, now=now))
    except (OSError, StateError) as ex:
        log.error("cannot record the end of the job (%s) in %s: %s", reason, state_dir, ex)


class Supervisor:
    """The ``inprocess-run`` process: restarts a crashed controller, ends the job with it.

    Invariants:

    * the guard (:mod:`inprocess.failover.guard`) starts before any other
      process of the job and holds the only read end of the lifeline pipe; its
      write end lives only here (not inheritable), so whatever ends this process
      closes it and the guard ends the job;
    * the controller gets SIGUSR2 from the kernel when this process dies
      (``PR_SET_PDEATHSIG``) and stops the job in order;
    * the job's store server watches this process (``INPROCESS_LAUNCHER``: pid
      and start time) and, should the guard be gone too, ends what is left of
      the run, then itself, soon after this process died
      (:mod:`inprocess.failover.store_server`);
    * cleanup only touches processes carrying this run's token.
    """

    def __init__(
        self,
        state_dir: Path,
        controller_args: list[str],
        run_token: str,
        max_controller_restarts: int = MAX_CONTROLLER_RESTARTS,
        pass_fds: tuple[int, ...] = (),
        recover_first: bool = False,
    ) -> None:
        self.state_dir = state_dir
        #: the first controller recovers too (a coordinator elected for a running job)
        self.recover_first = recover_first
        self.max_controller_restarts = max_controller_restarts
        self.controller_args = controller_args
        #: descriptors every controller inherits (a job of several machines: its listener)
        self.pass_fds = pass_fds
        self.run_token = run_token
        self.states = StateStore(state_dir)
        #: records how the job's orphans ended, for the next controller
        self.backend: Backend = create_backend(DEFAULT_BACKEND, state_dir)
        self.controller: subprocess.Popen[bytes] | None = None
        self.guard: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None
        self._signal: int | None = None
        self._cleaned = False
        self._result_fd: int | None = None

    def run(self) -> int:
        _become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._forward)
        os.environ[SUPERVISOR_PID_ENV] = str(os.getpid())
        # (what the job's store server watches: it ends with us, however we end)
        os.environ[LAUNCHER_ENV] = launcher_identity()
        self._start_guard()
        restarts = 0
        try:
            # the job's first state (cli.py just created it): the base of the
            # record of an end when the file is found damaged later
            initial = self.states.load()
            while True:
                status = self._run_controller(recover=restarts > 0 or self.recover_first)
                result = self._controller_result()
                try:
                    state = self.states.load()
                except (OSError, StateError) as ex:
                    if result is not None:
                        return self._finished_unsaved(result, f"{ex}")
                    return self._end_damaged(initial, ex)
                if state.stage is Stage.STOPPED:
                    return state.exit_code if state.exit_code is not None else 1
                if result is not None:  # the job ended, but its end could not be saved
                    return self._finished_unsaved(result, f"stage {state.stage.value}")
                if self._signal is not None:  # e.g. SIGTERM to our whole group
                    name = signal.Signals(self._signal).name
                    code = signal_exit_code(self._signal)
                    self._clean_up()
                    record_end(self.state_dir, code, f"stopped by {name}")
                    return code
                if self._controller_uptime() >= CONTROLLER_STABLE_SECONDS:
                    restarts = 0  # the limit counts crashes in a row
                restarts += 1
                log.error(
                    "the controller died (%s) while the job was %s; starting a new one (%d/%d)",
                    _describe(status),
                    state.stage.value,
                    restarts,
                    self.max_controller_restarts,
                )
                if restarts > self.max_controller_restarts:
                    reason = (
                        f"the controller died {restarts} times in a row (each within "
                        f"{CONTROLLER_STABLE_SECONDS:.3g}s of its start): giving up the job"
                    )
                    log.error("%s", reason)
                    self._clean_up()
                    record_end(self.state_dir, policy.FAILURE_EXIT_CODE, reason)
                    return policy.FAILURE_EXIT_CODE
        finally:
            self._clean_up()
            self._stop_guard()

    def _controller_result(self) -> tuple[int, str] | None:
        """The exit code and reason the controller reported at the job's end
        (through its result pipe), or ``None`` if it died before."""
        fd, self._result_fd = self._result_fd, None
        if fd is None:
            return None
        try:
            data = os.read(fd, 4096).decode(errors="replace")
        except OSError:
            data = ""
        finally:
            os.close(fd)
        code, _, reason = data.strip().partition(" ")
        try:
            return int(code), reason
        except ValueError:
            return None

    def _finished_unsaved(self, result: tuple[int, str], saved: str) -> int:
        """The controller finished the job but could not save its end (a full disk,
        a file-size limit): the job's exit code stands; no controller is restarted."""
        code, reason = result
        log.warning(
            "the job ended (exit code %d: %s) but its end is not in %s (%s): "
            "the state file could not be written",
            code,
            reason,
            self.states.path,
            saved,
        )
        self._clean_up()
        with contextlib.suppress(OSError, StateError):  # the disk may still refuse
            states = StateStore(self.state_dir)
            state = states.load()
            if state.stage is not Stage.STOPPED:
                now = time.time()
                if state.stage is not Stage.STOPPING:
                    state = policy.request_stop(state, code, reason or "ended", now=now).state
                states.save(policy.stopped(state, now=now))
        return code

    def _end_damaged(self, initial: JobState, problem: Exception) -> int:
        """The state file is damaged (empty, corrupt) and the controller is gone:
        the job cannot be resumed. Ends its processes, keeps the damaged file for a
        person to look at (``state.json.damaged``), records the reason in a fresh
        state and in ``events.jsonl``; one line on the console."""
        reason = f"the job's state file cannot be read ({problem}): the job cannot be resumed"
        log.error("%s; ending it", reason)
        self._clean_up()
        path = self.states.path
        with contextlib.suppress(OSError):
            os.replace(path, path + ".damaged")
        now = time.time()
        try:
            with _quiet(policy.logger):  # the reason is on the console once already
                stopping = policy.request_stop(initial, policy.FAILURE_EXIT_CODE, reason, now=now)
            self.states.save(policy.stopped(stopping.state, now=now))
        except (OSError, StateError) as ex:
            log.error("cannot record the end of the job in %s: %s", path, ex)
        with contextlib.suppress(OSError, ValueError):
            _records.append_jsonl(
                self.state_dir / _records.EVENTS_FILE,
                _records.event(
                    "job_end", returncode=policy.FAILURE_EXIT_CODE, detail=reason
                ),
                durable=True,
                nofollow=True,
            )
        return policy.FAILURE_EXIT_CODE

    def _controller_uptime(self) -> float:
        """How long the dead controller ran after its start-up (0 if it never got there).

        Measured from its pid file, written once its imports are done, so a slow
        start on a loaded machine does not pass for a stable controller.
        """
        assert self.controller is not None
        path = controller_pid_path(self.state_dir)
        try:
            if int(path.read_text()) != self.controller.pid:
                return 0.0
            return max(0.0, time.time() - path.stat().st_mtime)
        except (OSError, ValueError):
            return 0.0

    def _start_guard(self) -> None:
        read, self._lifeline = os.pipe()  # both not inheritable
        try:
            self.guard = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "inprocess.failover.guard",
                    str(self.state_dir),
                    self.run_token,
                    str(os.getpid()),
                ],
                stdin=read,
                start_new_session=True,  # signals to our process group do not reach it
            )
        finally:
            os.close(read)

    def _stop_guard(self) -> None:
        """The job ended here: the guard has nothing to do."""
        if self._lifeline is not None:
            with contextlib.suppress(OSError):
                os.write(self._lifeline, b"done\n")
            os.close(self._lifeline)
            self._lifeline = None
        if self.guard is not None:
            try:
                self.guard.wait(10)
            except subprocess.TimeoutExpired:
                self.guard.kill()
                self.guard.wait()

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
        read, write = os.pipe()  # the controller reports the job's end on it
        self._result_fd = read
        try:
            self.controller = subprocess.Popen(
                [*args, "--result-fd", str(write), *self.controller_args],
                pass_fds=(write, *self.pass_fds),
            )
        finally:
            os.close(write)
        pid = self.controller.pid
        guard = self.guard.pid if self.guard is not None else None
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
                    pending = _kill_if_still_stopped(pid, CONTROLLER_STOP_GRACE)
                    if pending is not None and self._signal is None:
                        # Someone asked the stopped controller to stop the job: that
                        # request outlives it (run() stops the job instead of replacing it).
                        self._signal = pending
                continue
            if reaped == pid:
                self.controller.returncode = os.waitstatus_to_exitcode(status)
                return status
            if reaped == guard:  # killed by someone: the job goes on unguarded
                log.warning("the job's guard process %d died (%s)", guard, _describe(status))
                self.guard.returncode = os.waitstatus_to_exitcode(status)
                continue
            # An orphaned worker or store server of a dead controller.
            try:
                self.backend.record_exit(reaped, status)
            except OSError as ex:  # a full disk: the next controller sees no status
                log.warning("cannot record how process %d ended: %s", reaped, ex)

    def _forward(self, signum: int, frame: object) -> None:
        """Ctrl-C, SIGTERM or SIGHUP: the controller stops the job and records why."""
        self._signal = signum
        if self.controller is not None and self.controller.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.controller.pid, signum)

    def _clean_up(self) -> None:
        """Nothing of this run may outlive it; nothing of any other run is touched."""
        if self._cleaned:
            return
        self._cleaned = True
        exclude = (self.guard.pid,) if self.guard is not None else ()
        end_processes(run_processes(self.run_token, exclude), grace=5)
        # Reap what we adopted, so nothing is left as a zombie either.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            children = [c.pid for c in psutil.Process().children() if c.pid not in exclude]
            if not children:
                break
            for pid in children:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            time.sleep(0.01)
        self.backend.clear_exit_records()
        self.backend.close()


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """``logger`` says nothing for the duration."""
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


def _kill_if_still_stopped(pid: int, grace: float) -> int | None:
    """Kills ``pid`` (its death is then reaped as usual) if it stays stopped for ``grace``.

    Returns the stop request (SIGINT, SIGTERM or SIGHUP) that was pending on it
    when it was killed, which it could not act on while stopped.
    """
    log.warning("the controller (pid %d) is stopped", pid)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        state = procfs.process_state(pid)
        if state is None:
            return None
        if state not in procfs.STOPPED_STATES:
            log.warning("the controller (pid %d) continues", pid)
            return None
        time.sleep(0.05)
    pending = _pending_stop_request(pid)
    log.error("the controller (pid %d) was stopped for %.3gs: replacing it", pid, grace)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return pending


def _pending_stop_request(pid: int) -> int | None:
    """SIGINT, SIGTERM or SIGHUP if one is pending on ``pid`` (``/proc/<pid>/status``)."""
    pending = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")):
                    pending |= int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if pending & (1 << (int(sig) - 1)):
            return int(sig)
    return None


def _describe(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
