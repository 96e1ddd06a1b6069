"""The job's store server: a TCPStore hosted outside every worker.

One process per job generation, started by the controller. Workers reach it as
``MASTER_ADDR:MASTER_PORT`` with ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch's
convention for a store hosted by the launcher), so no worker hosts it and
losing any worker, rank 0 included, leaves it up. It is a process of its own so
that it also outlives a crash of the controller. A cold restart of the job gets
a new one on a new port, so a plain ``env://`` script never reads the keys of
an earlier generation.

Run as ``python -m inprocess.failover.store_server HOST READY_FD [PORT]``: binds
``PORT`` (default: a free one) of ``HOST`` (that address only, see
:mod:`inprocess.security`), writes the port as text to ``READY_FD``, then
serves until SIGTERM.

With warm standbys on (``inprocess-run --standby N``, N > 0) the controller
keeps the *next* generation's server started ahead (:class:`SpareStoreServer`),
so a cold restart never waits for a server's start-up (``import torch``).
Such a server runs as ``... HOST READY_FD 0 HOLD_FD PARENT_PID``: it dies with
its parent (``PR_SET_PDEATHSIG``, and EOF on ``HOLD_FD``) until the parent
takes it into use (``go`` on ``HOLD_FD``; ``keep`` keeps the tie, for a host
whose servers must die with it), so a spare never outlives a crashed controller.

A server in use outlives a controller crash, so its parent's death cannot end
it; it ends with the job's launcher instead. The controller names the launcher
in :data:`OWNER_ENV` (``<pid>:<start time>``), and the server, polling, exits
:data:`OWNER_GRACE` seconds after that process is gone, first ending what else
is left of the run: however the launcher ended, SIGKILL of its whole process
group and of its guard included (a server left behind holds its port and its
memory until someone kills it by hand).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import persist_signal, procfs
from .runtime import exit_now, launcher_gone

#: environment variable naming the process a store server ends with (``<pid>:<start
#: time>``, see :data:`~inprocess.failover.runtime.LAUNCHER_ENV`); set only by the
#: one who starts it (never inherited), unset: it ends when stopped
OWNER_ENV = "INPROCESS_STORE_OWNER"
#: seconds a store server outlives its owner: longer than the launcher's guard takes
#: to let the controller stop the job in order and then end what is left
#: (``GUARD_GRACE`` plus its kill), so that an orderly end stays theirs
OWNER_GRACE = 20.0
#: seconds between two looks at the owner
OWNER_POLL = 0.5


@dataclass
class StoreServer:
    """Handle of a running store server process."""

    host: str
    port: int
    pid: int

    def stop(self, timeout: float = 10.0) -> None:
        """Terminates the server (a child, or one re-attached after a controller crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(self.pid):
                return
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def alive(self) -> bool:
        return _alive(self.pid)


def _alive(pid: int) -> bool:
    state = procfs.process_state(pid)
    if state is None:
        return False
    if state == "Z":  # a zombie child: reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


#: starts ``python -m MODULE ARGS`` in a session of its own with stdin from
#: /dev/null: (argv, env, pass_fds) -> the process (``poll``, ``kill``, ``wait``).
#: A backend may fork it from a preloaded process instead of spawning it.
Spawn = Callable[[list[str], dict[str, str], tuple[int, ...]], Any]


#: seconds a store server may take to accept connections (its ``import torch``
#: when spawned: minutes on a loaded machine that is slow to hand out memory)
START_TIMEOUT = 180.0


def start_store_server(
    host: str,
    timeout: float = START_TIMEOUT,
    preexec_fn: Callable[[], None] | None = None,
    port: int = 0,
    spawn: Spawn | None = None,
    owner: str | None = None,
) -> StoreServer:
    """Starts a store server and returns once it accepts connections.

    ``preexec_fn`` runs in the child before the server starts (e.g. to tie its
    life to its parent's). ``port``: the port to bind (0: a free one).
    ``spawn``: how to start it (default: a new interpreter). ``owner``: the
    process it ends with (:data:`OWNER_ENV`)."""
    ready_r, ready_w = os.pipe()
    env = _server_env(owner)
    argv = [sys.executable, "-m", "inprocess.failover.store_server", host, str(ready_w), str(port)]
    try:
        process = (spawn or _spawner(preexec_fn))(argv, env, (ready_w,))
    finally:
        os.close(ready_w)
    try:
        with os.fdopen(ready_r, "rb") as ready:
            import select

            readable, _, _ = select.select([ready], [], [], timeout)
            text = ready.readline().decode().strip() if readable else ""
    except OSError:
        text = ""
    if not text:
        process.kill()
        process.wait()
        raise RuntimeError(f"the store server did not start within {timeout:.3g}s")
    return StoreServer(host, int(text), process.pid)


class SpareStoreServer:
    """A store server started ahead of need; :meth:`take` makes it the job's."""

    def __init__(
        self,
        host: str,
        preexec_fn: Callable[[], None] | None = None,
        spawn: Spawn | None = None,
        owner: str | None = None,
    ) -> None:
        self.host = host
        ready_r, ready_w = os.pipe()
        hold_r, self._hold = os.pipe()
        argv = [
            sys.executable,
            "-m",
            "inprocess.failover.store_server",
            host,
            str(ready_w),
            "0",
            str(hold_r),
            str(os.getpid()),  # the parent it dies with until taken
        ]
        try:
            spawn = spawn or _spawner(preexec_fn)
            self.process = spawn(argv, _server_env(owner), (ready_w, hold_r))
        except BaseException:
            os.close(ready_r)
            os.close(self._hold)
            raise
        finally:
            os.close(ready_w)
            os.close(hold_r)
        self._ready = os.fdopen(ready_r, "rb")

    def take(
        self, timeout: float = START_TIMEOUT, die_with_parent: bool = False
    ) -> StoreServer | None:
        """The server, once it accepts connections (waits up to ``timeout``), no
        longer tied to our life unless ``die_with_parent``; ``None`` if it died."""
        try:
            port = _read_port(self._ready, timeout)
            if port is None or self.process.poll() is not None:
                return None
            os.write(self._hold, b"keep\n" if die_with_parent else b"go\n")
            return StoreServer(self.host, port, self.process.pid)
        except OSError:
            return None
        finally:
            self._close_pipes()

    def discard(self) -> None:
        """Ends the spare (it serves nobody yet)."""
        self._close_pipes()
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()

    def _close_pipes(self) -> None:
        if not self._ready.closed:
            self._ready.close()
        if self._hold >= 0:
            os.close(self._hold)
            self._hold = -1


def _spawner(preexec_fn: Callable[[], None] | None) -> Spawn:
    def spawn(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...]) -> Any:
        return subprocess.Popen(
            argv,
            pass_fds=pass_fds,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=preexec_fn,
        )

    return spawn


def _server_env(owner: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(OWNER_ENV, None)  # (another server's, inherited: never ours)
    if owner is not None:
        env[OWNER_ENV] = owner
    # torch's store server resolves the name of every client that connects, for
    # its logs; with an unreachable DNS server that stalls the whole server for
    # the resolver's timeout (5 s by default). Bound it, unless the user chose.
    env.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    return env


def _read_port(ready: Any, timeout: float) -> int | None:
    import select

    readable, _, _ = select.select([ready], [], [], timeout)
    text = ready.readline().decode().strip() if readable else ""
    return int(text) if text else None


def _tie_to_parent(parent: int) -> bool:
    """A spare dies with ``parent`` until it is taken; ``False`` if it is gone already."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    return os.getppid() == parent


def main() -> int:
    host, ready_fd = sys.argv[1], int(sys.argv[2])
    persist_signal.survive()  # (a scheduler's warning reaches every process of the job)
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    hold_fd = int(sys.argv[4]) if len(sys.argv) > 4 else None
    if hold_fd is not None and not _tie_to_parent(int(sys.argv[5])):
        return 0
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides when to stop
    import torch.distributed as dist

    from ..security import bound_port, listen_fd

    # Bound to the job's address only: torch's own server would listen on all.
    fd = listen_fd(host, port)
    store = dist.TCPStore(
        host,
        bound_port(fd),
        None,
        True,
        timeout=datetime.timedelta(seconds=300),
        wait_for_workers=False,
        use_libuv=True,
        master_listen_fd=fd,
    )
    # Until now a SIGTERM ends us at once (its default): a server stopped while
    # still importing torch (a launch stopped early) has nothing to end in order.
    signal.signal(signal.SIGTERM, on_term)
    with os.fdopen(ready_fd, "w") as ready:
        ready.write(f"{store.port}\n")
    if hold_fd is not None:
        # A spare: serve nobody until taken; end if our parent is gone (EOF).
        import ctypes
        import select

        word = b""
        while not stop and not word:
            with contextlib.suppress(InterruptedError):
                if select.select([hold_fd], [], [], 0.1)[0]:
                    word = os.read(hold_fd, 16) or b"eof"
        os.close(hold_fd)
        if stop or not word.startswith((b"go", b"keep")):
            del store
            return 0
        if word.startswith(b"go"):
            ctypes.CDLL(None, use_errno=True).prctl(1, 0, 0, 0, 0)  # outlive a controller crash
    owner = os.environ.get(OWNER_ENV)
    try:
        if owner is not None:
            launcher_gone(owner)
    except ValueError:
        owner = None  # (not one we set: nothing to watch)
    gone_since: float | None = None
    checked = 0.0
    while not stop:  # (signal.pause() could miss a SIGTERM arriving before it)
        time.sleep(0.1)
        now = time.monotonic()
        if owner is None or now - checked < OWNER_POLL:
            continue
        checked = now
        if gone_since is None and launcher_gone(owner):
            gone_since = now
        if gone_since is not None and now - gone_since >= OWNER_GRACE:
            # The job's launcher is gone and nobody stopped us: its guard and
            # controller are gone too. What else is left of this run (workers
            # of a script without the Wrapper) ends now, while we still serve.
            _end_run()
            break
    del store
    return 0


def _end_run() -> None:
    """Ends every other process of this run of the job (found by its run token,
    never by name: nothing of another run or user is touched)."""
    from .supervisor import RUN_TOKEN_ENV, end_processes, run_processes

    token = os.environ.get(RUN_TOKEN_ENV)
    if token:
        end_processes(run_processes(token), grace=3.0)


if __name__ == "__main__":
    # Served and closed: skip torch's teardown, for which whoever stops us would wait.
    exit_now(main())
