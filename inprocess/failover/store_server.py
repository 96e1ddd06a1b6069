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
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":  # a zombie child: reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


def start_store_server(
    host: str,
    timeout: float = 60.0,
    preexec_fn: Callable[[], None] | None = None,
    port: int = 0,
) -> StoreServer:
    """Starts a store server and returns once it accepts connections.

    ``preexec_fn`` runs in the child before the server starts (e.g. to tie its
    life to its parent's). ``port``: the port to bind (0: a free one)."""
    ready_r, ready_w = os.pipe()
    env = dict(os.environ)
    # torch's store server resolves the name of every client that connects, for
    # its logs; with an unreachable DNS server that stalls the whole server for
    # the resolver's timeout (5 s by default). Bound it, unless the user chose.
    env.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inprocess.failover.store_server",
                host,
                str(ready_w),
                str(port),
            ],
            pass_fds=(ready_w,),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=preexec_fn,
        )
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


def main() -> int:
    host, ready_fd = sys.argv[1], int(sys.argv[2])
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
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
    with os.fdopen(ready_fd, "w") as ready:
        ready.write(f"{store.port}\n")
    while not stop:  # (signal.pause() could miss a SIGTERM arriving before it)
        time.sleep(0.1)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
