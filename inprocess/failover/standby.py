"""Warm standby workers: pre-imported processes that become a worker at once.

Starting a worker costs seconds, most of it ``import torch``. A backend keeps a
few *standbys* per node slot (``inprocess-run --standby N``, default 1; 0: none,
every worker is spawned as before): processes that have already imported
``torch``, ``torch.distributed`` and ``inprocess`` and wait for an assignment.
When a worker of that slot is to be started, a standby takes its place:

* the backend sends it, over a unix socket pair made when it was spawned, the
  worker's command line, environment and working directory, and the worker's
  stdin/stdout/stderr as file descriptors (``SCM_RIGHTS``): the ones the
  backend's single spawn path would give a fresh worker, so output goes where
  any worker's goes;
* the standby puts those fds on 0/1/2, replaces ``os.environ`` by the worker's
  environment exactly, changes directory, sets ``sys.argv`` and ``sys.path[0]``
  as ``python SCRIPT`` / ``python -m MODULE`` would, and runs the script with
  :mod:`runpy` as ``__main__``. Its exit status is the script's.

Standbys are forked from a per-node :class:`~inprocess.failover.zygote.Zygote`
that did these imports once (a standby then costs milliseconds, not an import);
one wanted while none is left is forked on the spot, and where zygotes keep
dying before they are ready, standbys are spawned with the same imports.

It is the worker from then on: same pid (the backend watches it by pidfd like a
spawned worker; its zygote, or the backend for a spawned one, reaps it and
reports its status; after a controller crash it is an orphan whose exit the
supervisor records), its own session and process group, the job's run token in
its environment (cleanup finds it). Standbys are not workers: they hold no rank,
are not in the job's state, never count as restarts. The backend replaces a
used or dead standby in the background (the next ``wait``); one that keeps
dying before it is ready stops the pool of its slot (logged), so a broken
environment never turns into a spawn loop.

Where standbys are kept: the controller asks the backend for ``--standby``
standbys on *every* node slot, spares included, so that a node relaunched onto
a spare slot (the policy's node relaunch) starts its workers from that slot's
standbys, and a cold restart takes as many as there are. The local backend
keeps them itself (:class:`StandbyPool`); the Ray backend's node agents keep
theirs with the same pool, on their machines. With standbys on, the
controller also keeps the next generation's store server started ahead
(:class:`~inprocess.failover.store_server.SpareStoreServer`).

What tools see: ``/proc/PID/environ`` (``ps e``, ``psutil``) shows the
worker's variables once it is assigned (:func:`~inprocess.preloaded.show_environ` rewrites the
initial environment block in place, room for it is reserved at spawn), so a
worker is found by ``RANK`` as usual; ``/proc/PID/cmdline`` (``ps``, ``pgrep
-f``, py-spy) shows the standby's command line (``python -m
inprocess.failover.standby FD PID``) until it is assigned, then the worker's
(``python SCRIPT ARGS``, as a fresh worker's), written over the argument
area (:mod:`inprocess.proctitle`; room for it is reserved at spawn too).

What a standby cannot change: whatever the interpreter and the warm imports
read from the environment *before* the assignment (``PYTHON*`` variables such as
``PYTHONPATH``, ``PYTHONHASHSEED``, ``PYTHONWARNINGS``; ``OMP_NUM_THREADS``,
``MKL_*``, ``TORCH_*`` read when torch is imported). A standby is therefore
spawned with the environment common to every worker of its slot (everything
``inprocess-run`` sets but the per-worker and per-generation variables:
``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ``INPROCESS_STORE_NAMESPACE``,
``INPROCESS_WORKER_INCARNATION``, see :data:`PER_WORKER_ENV`), so those
variables have the values a fresh worker would see. Also not the same as a
fresh interpreter: ``sys.orig_argv``, and modules the script would import
anyway are already imported (their import-time side effects happened with the
common environment). Only ``python SCRIPT ...`` and ``python -m MODULE ...``
with the backend's own interpreter and no interpreter options can run on a
standby; any other command is spawned as usual.

Process invariants (enforced in :func:`main`):

* a standby has no threads, no CUDA context and no distributed state until it
  runs the script (the warm imports create none);
* it dies with the process that spawned it while it is a standby
  (``PR_SET_PDEATHSIG`` = SIGKILL, and EOF on its socket): a controller killed
  by SIGKILL leaves no standby behind. Once assigned it keeps that tie only if
  the backend's workers die with their parent (a Ray node agent); a local
  worker must outlive a controller crash, so the tie is cleared.
* the backend's end of the socket is not inheritable: only the backend can
  hold it open, so EOF means the backend is gone (or stopped the standby).

Run as ``python -m inprocess.failover.standby SOCKET_FD PARENT_PID``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
from typing import Any

from ..preloaded import (
    ROOM_ENV,
    ROOM_SIZE,
    die_with_parent,
    reopen_stdio,
    show_environ,
    warm_imports,
)
from ..proctitle import ROOM_ARG, set_title, worker_title
from ..reclaim import lazy_imports
from .zygote import ZYGOTE_FLAG, Spawn, Zygote, ZygoteChild, zygote_env

log = logging.getLogger(__name__)

#: variables of a worker's environment that differ between the workers of a slot
#: (or between generations): a standby is spawned without them, they come with
#: its assignment
PER_WORKER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "INPROCESS_STORE_NAMESPACE",
    "INPROCESS_WORKER_INCARNATION",
)
#: a standby that dies this many times in a row before it is ready stops its slot's pool
MAX_EARLY_DEATHS = 3
_HEADER = struct.Struct("!Q")
_READY = b"R"


def common_env(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment without the per-worker variables (a standby's own)."""
    return {k: v for k, v in env.items() if k not in PER_WORKER_ENV}


def can_run(argv: tuple[str, ...] | list[str]) -> bool:
    """Whether a standby can run the worker command ``argv``: ``python SCRIPT ...``
    or ``python -m MODULE ...`` with this interpreter and no interpreter options."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        return len(argv) >= 3 and bool(argv[2])
    return not argv[1].startswith("-")


@dataclasses.dataclass
class Standby:
    """One standby process of a slot, as its backend sees it."""

    process: subprocess.Popen[bytes] | ZygoteChild
    sock: socket.socket  # the backend's end (not inheritable)
    slot: int
    env: dict[str, str]
    ready: bool = False

    def check_ready(self) -> bool:
        """Reads the standby's readiness byte if it has come (never blocks)."""
        if not self.ready:
            with contextlib.suppress(BlockingIOError, OSError):
                if self.sock.recv(1, socket.MSG_DONTWAIT) == _READY:
                    self.ready = True
        return self.ready

    def discard(self) -> None:
        """Ends the standby (SIGKILL: it runs nothing of the job yet). Never signals
        a reaped pid (it may be another process's by now)."""
        self.sock.close()
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        self.process.wait()


class StandbyPool:
    """The standbys of a backend, per node slot.

    Used from one thread (the backend's caller). Invariants: every standby in
    :attr:`_standbys` is a child of this process or of one of its zygotes that
    nobody else holds; a standby leaves the pool exactly once, by :meth:`take`
    (it becomes a worker, the backend watches it) or by :meth:`discard`-ing it
    (dead, unwanted, or the pool is closed); a zygote ends when no slot wants
    standbys of its environment.
    """

    def __init__(self, spawn: Spawn, die_with_parent: bool, fork: bool = True) -> None:
        self._spawn = spawn
        self.die_with_parent = die_with_parent
        self._wanted: dict[int, tuple[int, dict[str, str]]] = {}  # slot -> (count, env)
        self._standbys: dict[int, list[Standby]] = {}
        self._early_deaths: dict[int, int] = {}
        #: standbys are forked from a zygote per zygote environment (False: spawned)
        self.fork = fork
        self._zygotes: dict[str, Zygote] = {}  # zygote_env as JSON -> its zygote
        self._zygote_deaths: dict[str, int] = {}  # in a row, before it was ready

    def keep(self, slot: int, count: int, env: dict[str, str]) -> None:
        """Keeps ``count`` standbys for ``slot``, spawned with environment ``env``
        (the workers' common environment: see :func:`common_env`)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        env = dict(env)
        if self._wanted.get(slot, (None, None))[1] != env:
            for standby in self._standbys.pop(slot, []):  # made for another environment
                standby.discard()
            self._early_deaths.pop(slot, None)
        self._wanted[slot] = (count, env)
        self.maintain()

    def standbys(self, slot: int) -> list[int]:
        """Pids of the standbys of ``slot`` (tests, logs)."""
        return [s.process.pid for s in self._standbys.get(slot, [])]

    def take(
        self,
        slot: int,
        argv: tuple[str, ...],
        env: dict[str, str],
        stdio: tuple[int, int, int],
        wait: float = 0.0,
    ) -> subprocess.Popen[bytes] | ZygoteChild | None:
        """A standby of ``slot`` turned into the worker ``argv`` with ``env`` and the
        file descriptors ``stdio`` (stdin, stdout, stderr); ``None`` if there is none
        (or the command cannot run on one): the caller spawns the worker then.

        Ready standbys first; one still importing is better than none (it runs
        the worker as soon as its imports are done); with none left, one forked
        on the spot from the slot's zygote, waiting for one still importing
        until ``wait`` seconds after it was started (a spawned worker would
        spend that time importing too). Its replacement is made by the next :meth:`maintain`.
        """
        if not can_run(argv):
            return None
        pool = self._standbys.get(slot, [])
        pool.sort(key=lambda s: not s.check_ready())
        while True:
            if pool:
                standby = pool.pop(0)
            else:  # none left: one forked on the spot, if the slot's zygote is ready
                count, slot_env = self._wanted.get(slot, (0, {}))
                made = self._start(slot, slot_env, wait) if count > 0 else None
                if made is None:
                    return None
                standby = made
            if standby.process.poll() is not None:
                standby.discard()
                continue
            try:
                message = {
                    "argv": list(argv),
                    "env": env,
                    "cwd": os.getcwd(),
                    "die_with_parent": self.die_with_parent,
                }
                _send(standby.sock, message, stdio)
            except OSError as ex:  # it died meanwhile
                log.debug("standby %d of slot %d is gone: %s", standby.process.pid, slot, ex)
                standby.discard()
                continue
            standby.sock.close()  # the standby needs nothing more from us
            log.debug("standby %d of slot %d becomes a worker", standby.process.pid, slot)
            return standby.process

    def maintain(self) -> None:
        """Replaces dead standbys and fills every slot up to its count (never blocks
        on a standby: a new one imports in the background)."""
        for slot, (count, env) in self._wanted.items():
            pool = self._standbys.setdefault(slot, [])
            for standby in list(pool):
                if standby.process.poll() is None:
                    if standby.check_ready():
                        self._early_deaths[slot] = 0
                    continue
                pool.remove(standby)
                early = not standby.check_ready()
                log.warning(
                    "standby %d of node slot %d ended (exit code %s)%s: replacing it",
                    standby.process.pid,
                    slot,
                    standby.process.returncode,
                    " before it was ready" if early else "",
                )
                standby.discard()
                if early:
                    self._early_deaths[slot] = self._early_deaths.get(slot, 0) + 1
                    if self._early_deaths[slot] == MAX_EARLY_DEATHS:
                        log.error(
                            "standbys of node slot %d died %d times in a row before they were "
                            "ready: no more standbys for it (workers are spawned)",
                            slot,
                            MAX_EARLY_DEATHS,
                        )
            if self._early_deaths.get(slot, 0) >= MAX_EARLY_DEATHS:
                continue
            while len(pool) < count:
                standby = self._start(slot, env)
                if standby is None:  # its zygote is still importing
                    break
                pool.append(standby)
            while len(pool) > count:
                pool.pop().discard()
        self._close_unused_zygotes()

    def _start(self, slot: int, env: dict[str, str], wait: float = 0.0) -> Standby | None:
        """A new standby of ``slot``: forked from its zygote, or spawned where
        standbys are not forked; ``None`` while the zygote is still importing
        (after waiting for it until ``wait`` seconds after its start)."""
        zygote = self._zygote(env)
        if zygote is not None and not zygote.ready():
            if not zygote.wait_ready(wait):
                return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process: subprocess.Popen[bytes] | ZygoteChild | None
            if zygote is not None:
                process = zygote.fork_standby(env, theirs.fileno())
            else:
                argv = [
                    sys.executable,
                    "-m",
                    "inprocess.failover.standby",
                    str(theirs.fileno()),
                    str(os.getpid()),
                    ROOM_ARG,  # room for the worker's command line (see serve)
                ]
                process = self._spawn(argv, {**env, ROOM_ENV: "." * ROOM_SIZE}, (theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        if process is None:  # the zygote died: the next maintain replaces it
            ours.close()
            return None
        return Standby(process, ours, slot, env)

    def _zygote(self, env: dict[str, str]) -> Zygote | None:
        """The zygote for standbys of ``env``, started if need be (it imports in the
        background); ``None`` where standbys are spawned: forking is off, or this
        environment's zygotes kept dying before they were ready."""
        if not self.fork:
            return None
        key = json.dumps(zygote_env(env), sort_keys=True)
        if self._zygote_deaths.get(key, 0) >= MAX_EARLY_DEATHS:
            return None
        zygote = self._zygotes.get(key)
        if zygote is not None and not zygote.alive():
            del self._zygotes[key]
            early = not zygote.was_ready
            log.warning(
                "standby zygote %d ended (exit code %s)%s: replacing it",
                zygote.process.pid,
                zygote.process.returncode,
                " before it was ready" if early else "",
            )
            zygote.close()
            self._zygote_deaths[key] = self._zygote_deaths.get(key, 0) + 1 if early else 0
            if self._zygote_deaths[key] >= MAX_EARLY_DEATHS:
                log.error(
                    "standby zygotes died %d times in a row before they were ready: "
                    "standbys of their environment are spawned",
                    MAX_EARLY_DEATHS,
                )
                return None
            zygote = None
        if zygote is None:
            zygote = self._zygotes[key] = Zygote(self._spawn, zygote_env(env))
        return zygote

    def any_zygote(self, wait: float = 0.0) -> Zygote | None:
        """A live zygote of this pool, ready if one is; waits for one still
        importing until ``wait`` seconds after its start; ``None`` if none is ready."""
        live = [z for z in self._zygotes.values() if z.alive()]
        ready = [z for z in live if z.ready()]
        if ready:
            return ready[0]
        if live and live[0].wait_ready(wait):
            return live[0]
        return None

    def _close_unused_zygotes(self) -> None:
        used = {
            json.dumps(zygote_env(env), sort_keys=True)
            for count, env in self._wanted.values()
            if count > 0
        }
        for key in [k for k in self._zygotes if k not in used]:
            self._zygotes.pop(key).close()

    def close(self) -> None:
        """Ends every standby (the job is over, or the backend is closed)."""
        self._wanted.clear()
        for pool in self._standbys.values():
            for standby in pool:
                standby.discard()
        self._standbys.clear()
        for zygote in self._zygotes.values():
            zygote.close()
        self._zygotes.clear()


def _send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, int, int]) -> None:
    payload = json.dumps(message).encode()
    data = _HEADER.pack(len(payload)) + payload
    sent = socket.send_fds(sock, [data], list(fds))
    if sent < len(data):
        sock.sendall(data[sent:])


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The assignment and its fds; ``None`` on EOF (the backend is gone)."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
    if not data:
        return None
    while len(data) < _HEADER.size:
        more = sock.recv(1 << 16)
        if not more:
            return None
        data += more
    (size,) = _HEADER.unpack_from(data)
    while len(data) < _HEADER.size + size:
        more = sock.recv(1 << 16)
        if not more:
            return None
        data += more
    return json.loads(data[_HEADER.size : _HEADER.size + size]), fds


def standby_title(fd: int, parent: int) -> str:
    """What ``ps`` shows for a standby that waits for its worker: its command line."""
    return " ".join([sys.executable, "-m", "inprocess.failover.standby", str(fd), str(parent)])


def main(argv: list[str] | None = None) -> int:
    args = list(argv or sys.argv[1:])
    if args and args[0] == ZYGOTE_FLAG:
        from .zygote import main as zygote_main

        return zygote_main(int(args[1]), int(args[2]), _forked_standby)
    fd, parent = (int(a) for a in args[:2])
    set_title(standby_title(fd, parent), "inproc-standby")  # (its room argument hidden)
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the backend died before the tie was made
        return 0
    sock = socket.socket(fileno=fd)
    # The warm imports. No threads, no CUDA, no process group: a worker's own.
    warm_imports()
    return serve(sock)


def _forked_standby(env: dict[str, str], fd: int, parent: int) -> int:
    """A child just forked by a zygote becomes a standby of ``env``, as if spawned so."""
    os.setsid()  # a spawned standby has its own session and process group
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the zygote died meanwhile
        return 0
    os.environ.clear()
    os.environ.update(env)
    show_environ(env)
    set_title(standby_title(fd, parent), "inproc-standby")
    return serve(socket.socket(fileno=fd))


def serve(sock: socket.socket) -> int:
    """A warm standby's life after its imports (spawned, or forked by a zygote):
    ready, then its assignment, then the worker it is assigned to be."""
    with contextlib.suppress(OSError):
        sock.sendall(_READY)
    lazy_imports()  # (a forked standby's zygote made them: nothing left to do)
    try:
        received = _receive(sock)
    except OSError:
        received = None
    if received is None:  # the backend is gone or discarded us: nothing to run
        return 0
    message, fds = received
    sock.close()
    # Become the worker: stdio, environment, directory, the tie to our parent.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for target, source in enumerate(fds):
        os.dup2(source, target)
        os.close(source)
    reopen_stdio(unbuffered=bool(message["env"].get("PYTHONUNBUFFERED")))
    os.environ.clear()
    os.environ.update(message["env"])
    show_environ(message["env"])
    os.chdir(message["cwd"])
    if not message["die_with_parent"]:
        die_with_parent(0)
    command = message["argv"][1:]
    # ps, pgrep -f, py-spy: the command line a fresh worker would show
    set_title(worker_title(message["argv"]), os.path.basename(message["argv"][0]))
    del message, received
    import runpy

    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]  # run_module puts the module's file first
        sys.path[0] = os.getcwd()
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(command)
        sys.path[0] = os.path.dirname(os.path.realpath(command[0]))
        runpy.run_path(command[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
