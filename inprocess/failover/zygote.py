"""Standbys forked from one preloaded process: a node pays ``import torch`` once.

A warm standby (:mod:`inprocess.failover.standby`) saves a worker the seconds of
``import torch``, but each standby pays them itself, in the background: one per
node slot at the start of a job, and one more each time a standby becomes a
worker. On a node with few cores, or a host slow to hand out memory, those
imports compete with the job's own workers.

A :class:`Zygote` is one process that does the standby's warm imports once and
then forks standbys on request, in milliseconds. A forked standby is exactly a
spawned one from the moment it runs: it takes its slot's environment (also in
``/proc/PID/environ``) and the standby's command line (in ``/proc/PID/cmdline``,
``python -m inprocess.failover.standby FD PID``), its own session, reports
ready, waits for its assignment on its own socket and becomes the worker
through the same code (:func:`inprocess.failover.standby.serve`).

One zygote serves every slot whose standby environment differs only in the
per-slot variables (:data:`PER_SLOT_ENV`); the imports then ran with the
zygote's environment, which agrees with the slot's on everything else.

The zygote is the parent of what it forks, so it reaps them and reports each
exit status to the backend; the backend holds a :class:`ZygoteChild` (the few
``subprocess.Popen`` methods it uses) with a pidfd the zygote opened before the
child could end, so a signal never reaches a recycled pid. If the zygote itself
is killed, its standbys die with it and its workers, whose tie to their parent
was cleared when they were assigned, become orphans: the job's supervisor (a
child subreaper) reaps them and records their status, as for any orphan
(:data:`ORPHANED`).

Process invariants (enforced in :func:`main`):

* the zygote runs no Python thread but its main one when it forks (checked
  before every fork; the one native thread ``import torch`` starts idles on a
  condition variable); it never runs job code itself;
* a forked child never returns into the zygote's loop: it leaves through
  :class:`SystemExit` (the standby's exit, or the worker script's);
* the zygote dies with the backend that spawned it (``PR_SET_PDEATHSIG`` and EOF
  on its socket), a standby with its zygote.

Run as ``python -m inprocess.failover.standby --zygote SOCKET_FD PARENT_PID``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import persist_signal
from ..preloaded import (
    ROOM_ENV,
    ROOM_SIZE,
    die_with_parent,
    show_environ,
    warm_imports,
)
from ..proctitle import set_title
from ..reclaim import lazy_imports

log = logging.getLogger(__name__)

#: a standby environment's variables that differ between the slots one zygote serves
PER_SLOT_ENV = ("INPROCESS_NODE_SLOT",)
#: the command-line flag that makes ``python -m inprocess.failover.standby`` a zygote
ZYGOTE_FLAG = "--zygote"
#: :attr:`ZygoteChild.returncode` of a child that ended after its zygote died: its
#: status is the subreaper's record (:meth:`LocalBackend.exit_of`)
ORPHANED = 1 << 16
#: seconds a fork request may take to be answered (a fork takes milliseconds)
FORK_TIMEOUT = 10.0
#: seconds the zygote may take to report the status of a child that ended (it
#: reaps at once): a zygote that does not (stopped, hung) is killed, and the
#: child's status is the subreaper's record (:data:`ORPHANED`)
REPORT_TIMEOUT = 5.0
#: seconds between a zygote's death and a child's end seen as one fault (see
#: :meth:`ZygoteChild.ended_with_zygote`)
WITH_ZYGOTE = 2.0
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 8
#: bytes of the zygote's command line kept for the command lines of what it forks
#: (room for a worker's command line too: a standby shows it once it is one)
ARGV_ROOM = 2048


def zygote_env(env: dict[str, str]) -> dict[str, str]:
    """A standby environment without its per-slot variables: the zygote's."""
    return {k: v for k, v in env.items() if k not in PER_SLOT_ENV}


class ZygoteChild:
    """A process forked by a :class:`Zygote`, as the backend holds it."""

    def __init__(self, zygote: Zygote, pid: int, pidfd: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.pidfd = pidfd  # opened by the zygote at the fork: never a recycled pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._zygote.lost:
                if _has_ended(self.pidfd):
                    self._ended(ORPHANED)
            else:
                self._zygote.pump(0.0)
        return self.returncode

    def _ended(self, returncode: int) -> None:
        self.returncode = returncode
        self.close()

    def wait(self, timeout: float | None = None) -> int:
        """The child's status once it ended (``subprocess.Popen.wait``).

        Invariant: never waits on the zygote without a bound. Once the child
        has ended (its pidfd says so), the zygote has :data:`REPORT_TIMEOUT` to
        report its status; a zygote that does not is killed (:meth:`Zygote.abandon`),
        which hands the child to the subreaper: :data:`ORPHANED` then.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        ended_at: float | None = None
        while self.poll() is None:
            now = time.monotonic()
            left = None if deadline is None else deadline - now
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            step = 0.1 if left is None else min(left, 0.1)
            if self._zygote.lost:
                select.select([self.pidfd], [], [], step)
                continue
            if ended_at is None and _has_ended(self.pidfd):
                ended_at = now
            if ended_at is not None and now - ended_at > REPORT_TIMEOUT:
                self._zygote.abandon(
                    f"no exit report for its child {self.pid} within {REPORT_TIMEOUT:.3g}s"
                )
                continue
            self._zygote.pump(step)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def ended_with_zygote(self) -> bool:
        """Whether this child ended (:data:`ORPHANED`) within :data:`WITH_ZYGOTE`
        seconds of its zygote's own death (one we did not cause): both killed
        together, say, which is a fault of the machinery rather than of the
        child."""
        zygote = self._zygote
        return (
            self.returncode == ORPHANED
            and not zygote.ended_by_us
            and zygote.lost_at is not None
            and time.monotonic() - zygote.lost_at <= WITH_ZYGOTE
        )

    def close(self) -> None:
        """Closes the pidfd (done once the child's status is known)."""
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


#: spawns a process: (argv, env, pass_fds) -> the child (the backend's one spawn path)
Spawn = Callable[[list[str], dict[str, str], tuple[int, ...]], "subprocess.Popen[bytes]"]


class Zygote:
    """A preloaded process that forks standbys (see the module's doc).

    Spawned through the backend's ``spawn`` with ``env`` (a :func:`zygote_env`);
    never blocks while it imports: :meth:`ready` says when it can fork. Used
    from one thread (the backend's caller).
    """

    def __init__(self, spawn: Spawn, env: dict[str, str]) -> None:
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [
                sys.executable,
                "-m",
                "inprocess.failover.standby",
                ZYGOTE_FLAG,
                str(theirs.fileno()),
                str(os.getpid()),
                "." * ARGV_ROOM,
            ]
            self.process = spawn(argv, {**env, ROOM_ENV: "." * ROOM_SIZE}, (theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self.started = time.monotonic()
        self._ready = False
        self.lost = False  # the zygote died: its children are the subreaper's now
        #: ``time.monotonic()`` when it was found lost, and whether we ended it
        self.lost_at: float | None = None
        self.ended_by_us = False
        self._children: dict[int, ZygoteChild] = {}

    def ready(self) -> bool:
        """Whether the zygote has done its imports and forks (never blocks)."""
        if not self._ready and not self.lost:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                data = self._sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
                if data == b"ready":
                    self._ready = True
                else:
                    self._lose()
        return self._ready and self.alive()

    def wait_ready(self, within: float) -> bool:
        """Waits for :meth:`ready` until ``within`` seconds after the zygote was
        started (so that many callers wait for it once, not once each)."""
        deadline = self.started + within
        while not self.ready():
            left = deadline - time.monotonic()
            if left <= 0 or self.lost:
                return False
            with contextlib.suppress(OSError, ValueError):
                select.select([self._sock], [], [], min(left, 0.5))
        return True

    @property
    def was_ready(self) -> bool:
        """Whether the zygote finished its imports (a death before is an early one)."""
        return self._ready

    def alive(self) -> bool:
        if not self.lost and self.process.poll() is not None:
            self._lose()
        return not self.lost

    def fork_standby(self, env: dict[str, str], sock_fd: int) -> ZygoteChild | None:
        """A standby forked with environment ``env`` that talks on ``sock_fd`` (the
        standby's end of its socket, passed over); ``None`` if the zygote is gone."""
        return self._fork({"env": env}, [sock_fd])

    def fork_module(
        self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()
    ) -> ZygoteChild | None:
        """``argv`` (``python -m MODULE ARGS...``) forked instead of spawned, as
        ``Popen(argv, env=env, pass_fds=pass_fds, start_new_session=True,
        stdin=DEVNULL)`` would run it: an argument naming one of ``pass_fds``
        names the child's copy of it, one naming this process (``str(os.getpid())``)
        names the child's parent, the zygote; stdout and stderr are the zygote's,
        which are ours. ``None`` if the zygote is gone or ``argv`` is not of
        that form (the caller spawns it then)."""
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
            return None
        args = argv[3:]
        fd_args = {
            str(i): pass_fds.index(int(a))
            for i, a in enumerate(args)
            if a.isdigit() and int(a) in pass_fds
        }
        parent_args = [i for i, a in enumerate(args) if a == str(os.getpid())]
        request = {
            "module": argv[2],
            "args": args,
            "env": env,
            "fd_args": fd_args,
            "parent_args": parent_args,
        }
        return self._fork(request, list(pass_fds))

    def _fork(self, request: dict[str, Any], fds: list[int]) -> ZygoteChild | None:
        if not self.ready():
            return None
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            deadline = time.monotonic() + FORK_TIMEOUT
            while True:
                # (the socket stays blocking: a timeout on it would make pump's
                # MSG_DONTWAIT reads wait for it too)
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._sock], [], [], left)[0]:
                    raise TimeoutError(f"no reply in {FORK_TIMEOUT:.3g}s")
                data, got, _, _ = socket.recv_fds(self._sock, _MAX_MESSAGE, 1)
                if not data:
                    raise ConnectionError("EOF")
                reply = json.loads(data)
                if "pid" in reply:
                    break
                self._exited(reply)
        except (OSError, ValueError) as ex:
            # (a zygote that did not answer is killed: it would hold its standbys)
            self.abandon(f"is gone or does not answer: {ex}")
            return None
        if reply["pid"] is None or not got:
            for fd in got:
                os.close(fd)
            log.warning("standby zygote %d cannot fork: %s", self.process.pid, reply.get("error"))
            return None
        child = ZygoteChild(self, reply["pid"], got[0])
        self._children[child.pid] = child
        return child

    def pump(self, timeout: float) -> None:
        """Takes the exit reports that arrive within ``timeout`` seconds."""
        if self.lost:
            return
        try:
            readable, _, _ = select.select([self._sock], [], [], timeout)
            while readable:
                data = self._sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
                if not data:
                    self._lose()
                    return
                if data == b"ready":
                    self._ready = True
                    continue
                message = json.loads(data)
                if "exited" in message:
                    self._exited(message)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._lose()

    def _exited(self, report: dict[str, Any]) -> None:
        child = self._children.pop(report["exited"], None)
        if child is not None:
            child._ended(report["returncode"])

    def _lose(self) -> None:
        if not self.lost:
            self.lost = True
            self.lost_at = time.monotonic()
            self._sock.close()

    def abandon(self, reason: str) -> None:
        """Kills a zygote that does not answer (stopped, hung): :meth:`close`, logged.
        Its children that had ended are the subreaper's to reap and record."""
        if self.process.poll() is None:
            log.warning("standby zygote %d: %s; killing it", self.process.pid, reason)
        self.close()

    def close(self) -> None:
        """Ends the zygote; its standbys die with it, its workers run on."""
        if not self.lost:
            self.ended_by_us = True
        self._lose()
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        self.process.wait()


def _has_ended(pidfd: int) -> bool:
    readable, _, _ = select.select([pidfd], [], [], 0)
    return bool(readable)


# --- the zygote process ---------------------------------------------------------


def main(fd: int, parent: int, become_standby: Callable[[dict[str, str], int, int], int]) -> int:
    """The zygote: warm imports, then a fork per request (see the module's doc).

    A forked standby's life is ``become_standby(env, fd, parent)`` (the standby
    module's, which passes it: this module does not import that one).
    """
    die_with_parent(signal.SIGKILL)
    persist_signal.survive()  # (its standbys too; a Wrapper rank takes the signal over)
    sock = socket.socket(fileno=fd)
    if os.getppid() != parent:  # the backend died before the tie was made
        return 0
    argv = [sys.executable, "-m", "inprocess.failover.standby", ZYGOTE_FLAG, str(fd), str(parent)]
    set_title(" ".join(argv), "inproc-zygote")  # (its room argument hidden)
    # The warm imports of a standby. No threads, no CUDA, no process group.
    warm_imports()
    # What the imports made is shared with every fork until written to. The
    # collector would write to all of it in each child (its first full pass
    # copies every page of the heap, seconds where page faults are slow):
    # frozen objects are never traversed again.
    gc.collect()
    gc.freeze()
    with contextlib.suppress(OSError):
        sock.sendall(b"ready")
    lazy_imports()  # after "ready": a fork asked for meanwhile waits for it, its children have it
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([sock, *children], [], [])
        for pidfd in [r for r in readable if r is not sock]:
            pid = children.pop(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(pid, 0)
            report = {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)}
            with contextlib.suppress(OSError):
                sock.sendall(json.dumps(report).encode())
        if sock not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:  # the backend is gone
            return 0
        request = json.loads(data)
        if threading.active_count() != 1:
            for fd in fds:
                os.close(fd)
            error = f"{threading.active_count()} Python threads"
            sock.sendall(json.dumps({"pid": None, "error": error}).encode())
            continue
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            # Invariant: never back in this loop; none of the zygote's fds stays open.
            for own in (sock.detach(), *children):
                os.close(own)
            if "module" in request:
                sys.exit(_module(request, fds, parent=zygote))
            sys.exit(become_standby(request["env"], fds[0], zygote))
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)  # before we reap it: the pid is still ours
        children[os.dup(pidfd)] = pid
        socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
        os.close(pidfd)


def _module(request: dict[str, Any], fds: list[int], parent: int) -> int:
    """This forked child runs ``python -m MODULE ARGS`` as a spawned one would."""
    import runpy

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    args = list(request["args"])
    for index, which in request["fd_args"].items():
        args[int(index)] = str(fds[which])
    for index in request["parent_args"]:
        args[index] = str(parent)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    show_environ(env)
    # the command line a spawned one shows, and its name (not the zygote's)
    set_title(
        " ".join([sys.executable, "-m", request["module"], *args]),
        os.path.basename(sys.executable),
    )
    sys.argv = [request["module"], *args]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    return 0
