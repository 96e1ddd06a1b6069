"""A fork template: rank processes of a local job without paying ``import torch`` each.

Starting a rank process costs seconds of CPU, most of it ``import torch``; a
test suite or a benchmark that starts hundreds of them spends most of its time
there, and on a slow machine the start-up alone outlasts the timeouts under
test. A :class:`ForkTemplate` is one process that has imported ``torch``,
``torch.distributed`` and ``inprocess`` (as a warm standby of ``inprocess-run``
does, see :mod:`inprocess.failover.standby`) and forks a rank process from that
state on request: the child puts the rank's log on 1 and 2, ``/dev/null`` on 0,
closes the template's own fds, starts a session of its own, takes the rank's
environment and directory and runs the script with :mod:`runpy` as
``__main__``, exactly as a standby becomes a worker. Its exit status is the
script's; the template reaps it and reports the status to its client.

What a forked rank cannot change is what a standby cannot change: the variables
read at interpreter start-up or by the warm imports. :meth:`ForkTemplate.can_fork`
says whether an environment agrees with the template's on every one of them
(:data:`STARTUP_PREFIXES`); a job whose ranks do not is started as usual.

Process invariants:

* the template runs no Python thread but its main one when it forks (checked
  before every fork: a fork can hand the child a lock another thread held;
  the one native thread that ``import torch`` starts waits idle on a condition
  variable, as in every monitor process forked from a rank); it never runs
  user code itself;
* a child never returns into the template's loop: it runs the script and
  leaves the interpreter through ``SystemExit`` or an uncaught exception, the
  way a fresh ``python SCRIPT`` would (atexit handlers, thread joins);
* the template dies with its client (``PR_SET_PDEATHSIG``); its children do
  not (they are ended by their job, as spawned ranks are).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
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

#: environment variables read at interpreter start-up or by the warm imports:
#: a rank is forked only when its values of these equal the template's
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "TORCH_", "LD_", "CUDA_", "KMP_", "GOMP_")

_MAX_MESSAGE = 1 << 20
#: seconds a fork request may take to be answered (a fork takes milliseconds)
FORK_TIMEOUT = 120.0


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


class ForkedProcess:
    """A rank process forked by a template: the few ``subprocess.Popen`` methods a job uses."""

    def __init__(self, template: ForkTemplate, pid: int) -> None:
        self._template = template
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._template._pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            self._template._pump(0.5 if left is None else min(left, 0.5))
        assert self.returncode is not None
        return self.returncode


class ForkTemplate:
    """A preloaded process that forks rank processes (see the module's doc).

    ``env`` is the template's own environment: the start-up variables every
    rank forked from it must share. Not thread-safe: one client thread.
    """

    def __init__(self, env: dict[str, str] | None = None, ready_timeout: float = 600.0) -> None:
        self.env = dict(os.environ if env is None else env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._processes: dict[int, ForkedProcess] = {}
        try:
            self.process = subprocess.Popen(
                # (room for a rank's command line, see _run)
                [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid()), ROOM_ARG],
                env={**self.env, ROOM_ENV: "." * ROOM_SIZE},
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock.settimeout(ready_timeout)
        try:
            ready = self._sock.recv(_MAX_MESSAGE)
        except OSError:
            ready = b""
        if ready != b"ready":
            self.close()
            raise RuntimeError("the fork template did not start (see its output above)")

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether a rank with environment ``env`` may be forked from this template."""
        return self.process.poll() is None and _startup_env(env) == _startup_env(self.env)

    def fork(
        self, script: str | Path, args: list[str], env: dict[str, str], cwd: str | Path, log_fd: int
    ) -> ForkedProcess:
        """Forks ``python SCRIPT ARGS`` with ``env`` in ``cwd``, its output on ``log_fd``."""
        message = {"argv": [str(script), *args], "env": env, "cwd": str(cwd)}
        socket.send_fds(self._sock, [json.dumps(message).encode()], [log_fd])
        while True:
            reply = self._receive(FORK_TIMEOUT)
            if "pid" in reply:
                break
            self._exited(reply)
        if reply["pid"] is None:
            raise RuntimeError(f"the fork template cannot fork: {reply.get('error')}")
        process = ForkedProcess(self, reply["pid"])
        self._processes[process.pid] = process
        return process

    def close(self) -> None:
        """Ends the template (its forked ranks are their jobs' to end)."""
        self._sock.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def __enter__(self) -> ForkTemplate:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _receive(self, timeout: float | None) -> dict[str, Any]:
        self._sock.settimeout(timeout)
        data = self._sock.recv(_MAX_MESSAGE)
        if not data:
            raise RuntimeError(f"the fork template (pid {self.process.pid}) is gone")
        return json.loads(data)

    def _pump(self, timeout: float) -> None:
        """Takes the exit reports that arrive within ``timeout`` seconds."""
        try:
            self._exited(self._receive(timeout))
            while True:
                self._exited(self._receive(0.0))
        except (TimeoutError, BlockingIOError):
            pass

    def _exited(self, report: dict[str, Any]) -> None:
        process = self._processes.pop(report["exited"], None)
        if process is not None:
            process.returncode = report["returncode"]


# --- the template process -------------------------------------------------------


def _main(fd: int, parent: int) -> None:
    die_with_parent(signal.SIGKILL)
    sock = socket.socket(fileno=fd)
    if os.getppid() != parent:
        return
    # The warm imports (what every rank imports): no threads, no process group.
    warm_imports()
    sock.sendall(b"ready")
    lazy_imports()  # after "ready": a fork asked for meanwhile waits for it, its children have it
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([sock, *children], [], [])
        for pidfd in [r for r in readable if r is not sock]:
            pid = children.pop(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(pid, 0)
            sock.sendall(
                json.dumps(
                    {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)}
                ).encode()
            )
        if sock not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
        if not data:  # the client is gone
            return
        request = json.loads(data)
        # ``import torch`` leaves one native thread of its own, idle on a condition
        # variable; a Python thread would be ours and could hold a lock the child needs
        if threading.active_count() != 1:
            for f in fds:
                os.close(f)
            error = f"{threading.active_count()} Python threads"
            sock.sendall(json.dumps({"pid": None, "error": error}).encode())
            continue
        became_r, became_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            # none of the template's own fds stays open in a rank
            for own in (sock.detach(), *children, became_r):
                os.close(own)
            _become(request, fds[0])
            os.write(became_w, b"1")
            os.close(became_w)
            return _run(request["argv"])  # leaves the interpreter: never back in this loop
        os.close(fds[0])
        os.close(became_w)
        # the reply waits until the child is the rank: from then on tools see its
        # environment (a child that died on the way reads as EOF)
        os.read(became_r, 1)
        os.close(became_r)
        children[os.pidfd_open(pid)] = pid
        sock.sendall(json.dumps({"pid": pid}).encode())


def _become(request: dict[str, Any], log_fd: int) -> None:
    """This forked child takes the rank's session, fds, environment and directory."""
    os.setsid()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null)
    os.close(log_fd)
    env = request["env"]
    reopen_stdio(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
    os.environ.clear()
    os.environ.update(env)
    show_environ(env)
    os.chdir(request["cwd"])


def _run(argv: list[str]) -> None:
    import runpy

    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    # what ps and pgrep -f show for a fresh `python SCRIPT ARGS`
    set_title(worker_title([sys.executable, *argv]))
    runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


if __name__ == "__main__":
    set_title(" ".join([sys.executable, "-m", "inprocess.tools.fork_template", *sys.argv[1:3]]))
    _main(int(sys.argv[1]), int(sys.argv[2]))
