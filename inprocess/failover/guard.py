"""The job's guard: ends the job when ``inprocess-run`` dies, whatever killed it.

Started by the supervisor before any other process of the job, in a session of
its own (so a signal to the launcher's process group, e.g. ``kill -9 -PGID`` or
a closed terminal, does not reach it). Its stdin is the read end of a pipe whose
write end only the supervisor holds:

* ``done`` on the pipe: the job ended normally, nothing to do;
* EOF without ``done``: the supervisor is gone (SIGKILL...). The controller,
  if alive, got SIGTERM from the kernel (``PR_SET_PDEATHSIG``) and stops the
  job in order; the guard gives it :data:`~inprocess.failover.supervisor.GUARD_GRACE`
  seconds, then ends every process of this run (by its run token, never by
  name) and records the reason in ``state.json`` if nobody did.

Run as ``python -m inprocess.failover.guard STATE_DIR RUN_TOKEN SUPERVISOR_PID``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from .. import persist_signal
from ..proctitle import set_title
from .runtime import controller_pid_path
from .supervisor import GUARD_GRACE, RUN_TOKEN_ENV, end_processes, record_end, run_processes

log = logging.getLogger(__name__)

#: exit code recorded when the launcher died before the job ended
LAUNCHER_LOST_EXIT_CODE = 1


def _controller_alive(state_dir: Path, token: str) -> bool:
    """Whether the controller named in ``controller.pid`` runs, and is of this run."""
    try:
        proc = psutil.Process(int(controller_pid_path(state_dir).read_text()))
        return proc.environ().get(RUN_TOKEN_ENV) == token and proc.status() != psutil.STATUS_ZOMBIE
    except (OSError, ValueError, psutil.Error):
        return False


def main(argv: list[str] | None = None) -> int:
    state_dir_arg, token, supervisor = (argv or sys.argv[1:])[:3]
    state_dir = Path(state_dir_arg)
    set_title(f"inprocess-run guard of {state_dir} (launcher pid {supervisor})", "inproc-guard")
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    persist_signal.survive()  # (a scheduler's warning reaches every process of the job)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s inprocess-run[guard] %(levelname)s %(message)s"
    )
    message = sys.stdin.buffer.read()  # until the supervisor says done or dies
    if message.startswith(b"done"):
        return 0
    reason = f"inprocess-run (pid {supervisor}) died before the job ended"
    if os.isatty(2):  # its status line may hold the terminal's scroll region: give it back
        with contextlib.suppress(OSError):
            os.write(2, b"\0337\033[r\0338")
    log.error("%s: ending the job", reason)
    # Give a live controller the chance to stop the job in order (it got SIGTERM).
    deadline = time.monotonic() + GUARD_GRACE
    while time.monotonic() < deadline and _controller_alive(state_dir, token):
        time.sleep(0.1)
    end_processes(run_processes(token), grace=3)
    record_end(state_dir, LAUNCHER_LOST_EXIT_CODE, reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
