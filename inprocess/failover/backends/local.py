"""The ``local`` backend: worker processes on this machine.

Nodes are simulated: a node is a set of workers sharing a slot label. Process
death is observed directly through pidfds, for children and for workers that
an earlier controller started (after a controller crash they are orphans; the
supervisor reaps them and the backend records how they ended, see
:meth:`LocalBackend.record_exit`).

Warm standbys (:mod:`inprocess.failover.standby`): :meth:`LocalBackend.keep_standbys`
keeps pre-imported processes per slot; :meth:`LocalBackend.start` turns one of
the slot's into the worker when it can, else spawns it. Both go through one
spawn path (:meth:`LocalBackend._spawn`) and one choice of the worker's stdio
(:meth:`LocalBackend._stdio`), so a standby-made worker is started, routed and
watched like a spawned one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..console import LOG_DIR_MODE, open_log
from ..processes import process_start_time
from ..standby import StandbyPool
from ..zygote import ORPHANED, ZygoteChild
from . import ProcessExit, WorkerLaunch

log = logging.getLogger(__name__)

#: how long to wait for the supervisor's record of an orphan's exit status
EXIT_RECORD_WAIT = 2.0
#: until how long after its start a worker's (or the store server's) start waits
#: for the node's standby zygote to finish importing (no wait when no zygote
#: runs: ``--standby 0``). At a job's start the zygote was started just before
#: the server and the workers; waiting for it costs them nothing (a spawned one
#: would spend that time importing), saves the node an import per process, and
#: holds the controller for that long, once.
ZYGOTE_WAIT = 120.0


def exit_record_path(exits_dir: Path, pid: int) -> Path:
    return exits_dir / f"{pid}.json"


def write_exit_record(exits_dir: Path, pid: int, status: int) -> None:
    """Records how a reaped process ended (used by the supervisor)."""
    exits_dir.mkdir(parents=True, exist_ok=True)
    if exits_dir.is_symlink():  # planted: never write through it
        raise OSError(errno.ELOOP, "is a symlink", str(exits_dir))
    code = os.waitstatus_to_exitcode(status)
    record = {
        "pid": pid,
        "exit_code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
    }
    tmp = exits_dir / f".{pid}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover, or a planted symlink (removed, not followed)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record))
    os.replace(tmp, exit_record_path(exits_dir, pid))


def read_exit_record(exits_dir: Path, pid: int) -> ProcessExit:
    """How an orphan reaped by the supervisor ended (both codes ``None`` if not recorded)."""
    path = exit_record_path(exits_dir, pid)
    deadline = time.monotonic() + EXIT_RECORD_WAIT
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not path.exists():
        log.warning("no exit status recorded for process %d", pid)
        return ProcessExit(pid, None, None)
    record = json.loads(path.read_text())
    path.unlink()
    return ProcessExit(pid, record["exit_code"], record["signal"])


class LocalBackend:
    """Worker processes of this machine, each in its own session and process group."""

    def __init__(
        self, state_dir: Path, die_with_parent: bool = False, zygote_wait: float = ZYGOTE_WAIT
    ) -> None:
        #: workers get SIGKILL when this process dies (PR_SET_PDEATHSIG), for a host
        #: that must take its workers with it (a Ray node agent)
        self.die_with_parent = die_with_parent
        #: until how long after its start :meth:`start` waits for a zygote still importing
        self.zygote_wait = zygote_wait
        self.exits_dir = state_dir / "exits"  # the exit records of reaped orphans
        self._children: dict[int, subprocess.Popen[bytes] | ZygoteChild] = {}
        self._pidfds: dict[int, int] = {}
        self._poller = select.poll()
        self.standbys = StandbyPool(self._spawn_standby, die_with_parent)
        self._gpu: bool | None = None  # (see workers_gpu)
        #: workers made from a warm standby, until their exit is collected
        self._warm: set[int] = set()

    def start(self, launch: WorkerLaunch) -> tuple[int, float]:
        with self._stdio(launch) as stdio:
            process = None
            with _stdio_fds(stdio) as fds:
                if fds is not None and not launch.fresh:
                    process = self.standbys.take(
                        launch.slot, launch.argv, launch.env, fds, wait=self.zygote_wait
                    )
            if process is None:
                process = self._spawn(list(launch.argv), launch.env, **stdio)
            else:
                self._warm.add(process.pid)
        self._children[process.pid] = process
        # a forked worker's pidfd is the zygote's, opened at the fork: the worker may
        # have ended, and its zygote reaped it, already
        self._watch(process.pid, getattr(process, "pidfd", None))
        start_time = process_start_time(process.pid)
        return process.pid, start_time if start_time is not None else 0.0

    @contextlib.contextmanager
    def _stdio(self, launch: WorkerLaunch) -> Iterator[dict[str, Any]]:
        """The ``stdin``/``stdout``/``stderr`` arguments of ``Popen`` for a worker,
        open inside the block; a standby-made worker gets the same files.

        stdin from ``/dev/null``; stdout and stderr appended to ``launch.stdout`` /
        ``launch.stderr`` (their directories created) or inherited when ``None``.
        Appending keeps the output of every incarnation of a worker in its file.
        A log file is never opened through a symlink (:func:`open_log`): one
        planted in its place is refused, logged, and the stream inherited.
        """
        with contextlib.ExitStack() as files:
            stdio: dict[str, Any] = {"stdin": subprocess.DEVNULL}
            for name, path in (("stdout", launch.stdout), ("stderr", launch.stderr)):
                if path is None:
                    continue
                if path == os.devnull:
                    stdio[name] = subprocess.DEVNULL
                    continue
                Path(path).parent.mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
                try:
                    fd = open_log(path)
                except OSError as ex:
                    log.error("worker's %s is not written to %s: %s", name, path, ex)
                    continue
                stdio[name] = files.enter_context(os.fdopen(fd, "ab"))
            yield stdio

    def _spawn(
        self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = (), **stdio: Any
    ) -> subprocess.Popen[bytes]:
        """The one way a process of the job (worker or standby) is started here: its
        own session and process group; dies with us if :attr:`die_with_parent`."""
        return subprocess.Popen(
            argv,
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
            preexec_fn=kill_on_parent_death if self.die_with_parent else None,
            **stdio,
        )

    def _spawn_standby(
        self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...]
    ) -> subprocess.Popen[bytes]:
        return self._spawn(argv, env, pass_fds, stdin=subprocess.DEVNULL)

    def spawn_module(
        self,
        argv: list[str],
        env: dict[str, str],
        pass_fds: tuple[int, ...],
        wait: float | None = None,
    ) -> subprocess.Popen[bytes] | ZygoteChild:
        """A process of the job that is no worker (its store server): forked from a
        standby zygote when one runs (waiting for its imports until ``wait``
        seconds, default :attr:`zygote_wait`, after its start), else spawned;
        its own session, stdin from /dev/null."""
        zygote = self.standbys.any_zygote(self.zygote_wait if wait is None else wait)
        if zygote is not None:
            child = zygote.fork_module(argv, env, pass_fds)
            if child is not None:
                return child
        return self._spawn(argv, env, pass_fds, stdin=subprocess.DEVNULL)

    def workers_gpu(self) -> bool:
        """Whether the workers started here have a GPU (:func:`gpu_visible`, with this
        process's environment, which theirs extends)."""
        if self._gpu is None:
            self._gpu = gpu_visible(os.environ)
        return self._gpu

    def keep_standbys(self, slot: int, count: int, env: dict[str, str]) -> None:
        """Keeps ``count`` warm standbys for the workers of ``slot``, spawned with
        ``env`` (the workers' common environment); 0 ends those it has."""
        self.standbys.keep(slot, count, env)

    def started_warm(self, pid: int) -> bool:
        """Whether the worker ``pid`` that :meth:`start` returned is a warm standby."""
        return pid in self._warm

    def running(self, pid: int, start_time: float | None) -> bool:
        return process_start_time(pid) == start_time

    def attach(self, pid: int, start_time: float) -> bool:
        if process_start_time(pid) != start_time:
            return False
        try:
            self._watch(pid)
        except ProcessLookupError:
            return False
        return True

    def _watch(self, pid: int, pidfd: int | None = None) -> None:
        fd = os.pidfd_open(pid) if pidfd is None else os.dup(pidfd)
        self._pidfds[pid] = fd
        self._poller.register(fd, select.POLLIN)

    def stop(self, pids: list[int], grace: float) -> None:
        live = [pid for pid in pids if pid in self._pidfds]
        for pid in live:
            _signal_group(pid, signal.SIGTERM)
            # a stopped process (SIGSTOP: a standby that never joined, say) acts on
            # its SIGTERM once continued, not after the grace
            _signal_group(pid, signal.SIGCONT)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(self._running(pid) for pid in live):
            time.sleep(0.01)
        for pid in live:
            if self._running(pid):
                log.warning("worker process %d ignored SIGTERM for %.3gs: killing it", pid, grace)
            _signal_group(pid, signal.SIGKILL)  # also whatever it left in its group
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(self._running(pid) for pid in live):
            time.sleep(0.01)

    def _running(self, pid: int) -> bool:
        child = self._children.get(pid)
        if child is not None:
            return child.poll() is None
        return process_start_time(pid) is not None

    def wait(self, timeout: float) -> list[ProcessExit]:
        self.standbys.maintain()  # a used or dead standby is replaced in the background
        ready = self._poller.poll(timeout * 1000) if self._pidfds else []
        if not self._pidfds:
            time.sleep(timeout)
        fds = {fd for fd, _ in ready}
        exits = []
        for pid, fd in list(self._pidfds.items()):
            if fd in fds:
                exits.append(self._collect(pid))
        return exits

    def _collect(self, pid: int) -> ProcessExit:
        fd = self._pidfds.pop(pid)
        self._poller.unregister(fd)
        os.close(fd)
        self._warm.discard(pid)
        child = self._children.pop(pid, None)
        if child is not None:
            code = child.wait()
            if code == ORPHANED:  # ended after its zygote died: the supervisor reaped it
                ended = self.exit_of(pid)
                if (
                    isinstance(child, ZygoteChild)
                    and child.ended_with_zygote()
                    and ended.signal is not None
                ):
                    # killed with its zygote (not by us): the machinery's fault
                    return dataclasses.replace(ended, machinery="killed with its standby zygote")
                return ended
            return ProcessExit(pid, code if code >= 0 else None, -code if code < 0 else None)
        # An orphan from an earlier controller: the supervisor reaps it and records it.
        return self.exit_of(pid)

    def exit_of(self, pid: int) -> ProcessExit:
        return read_exit_record(self.exits_dir, pid)

    def record_exit(self, pid: int, status: int) -> None:
        write_exit_record(self.exits_dir, pid, status)

    def clear_exit_records(self) -> None:
        """Removes the exit records directory (the job is over); a symlink planted
        in its place is left alone (never the files of its target)."""
        if self.exits_dir.is_symlink():
            return
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.exits_dir):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            os.rmdir(self.exits_dir)

    def close(self) -> None:
        """Ends the standbys; workers keep running."""
        self.standbys.close()
        for pid in list(self._pidfds):
            fd = self._pidfds.pop(pid)
            with contextlib.suppress(OSError):
                self._poller.unregister(fd)
            os.close(fd)
        for child in self._children.values():
            if isinstance(child, ZygoteChild):
                child.close()
        self._children.clear()
        self._warm.clear()


def gpu_visible(env: Mapping[str, str]) -> bool:
    """Whether a process started on this machine with ``env`` sees a GPU: one of the
    machine's GPU device files exists (NVIDIA's, or AMD's for ROCm), and
    ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES`` does not hide them all (empty,
    or ``-1`` first: torch sees none then)."""
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        visible = env.get(name)
        if visible is not None and visible.split(",")[0].strip() in ("", "-1"):
            return False
    try:
        devices = os.listdir("/dev")
    except OSError:
        return False
    return "kfd" in devices or any(re.fullmatch(r"nvidia\d+", d) for d in devices)


@contextlib.contextmanager
def _stdio_fds(stdio: dict[str, Any]) -> Iterator[tuple[int, int, int] | None]:
    """The file descriptors that ``Popen(**stdio)`` would give a child as 0, 1, 2
    (``None`` for a pipe, which only ``Popen`` can make); valid inside the block."""
    opened: list[int] = []
    fds: list[int] = []
    try:
        for target, name in enumerate(("stdin", "stdout", "stderr")):
            value = stdio.get(name)
            if value is None:
                fds.append(target)  # inherited
            elif value == subprocess.DEVNULL:
                opened.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
                fds.append(opened[-1])
            elif value == subprocess.STDOUT and target == 2:
                fds.append(fds[1])
            elif value == subprocess.PIPE:
                yield None
                return
            elif isinstance(value, int):
                fds.append(value)
            else:
                fds.append(value.fileno())
        yield fds[0], fds[1], fds[2]
    finally:
        for fd in opened:
            os.close(fd)


def kill_on_parent_death() -> None:
    """In a forked child: SIGKILL when the thread that forked it ends (``PR_SET_PDEATHSIG``).

    The kernel ties it to the forking *thread*: fork from a thread that lives
    as long as the process (the main thread, or a dedicated one).
    """
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
