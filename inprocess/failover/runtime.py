"""What the supervisor, the controller and the store server share.

The controller's pid file, the exit code of a stop by signal, the kernel's
parent-death signal, the launcher's identity and a quick exit. These processes
import this module; it imports none of them (no import circle between them).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
import time
from pathlib import Path

from .. import procfs
from .._exit import exit_now

__all__ = [
    "LAUNCHER_ENV",
    "controller_pid_path",
    "die_with_parent",
    "exit_now",
    "launcher_gone",
    "launcher_identity",
    "libc",
    "signal_exit_code",
    "supervisor_gone",
    "write_pid_file",
]

_PR_SET_PDEATHSIG = 1
#: environment variable naming the job's launcher (``inprocess-run``, the
#: supervisor) as ``<pid>:<start time>``, set by it for every process of the job:
#: with its start time, a pid reused after the launcher died never passes for it
LAUNCHER_ENV = "INPROCESS_LAUNCHER"


def launcher_identity() -> str:
    """This process's :data:`LAUNCHER_ENV` value (the launcher sets it for itself)."""
    return f"{os.getpid()}:{procfs.process_start_time(os.getpid())}"


def launcher_gone(identity: str) -> bool:
    """Whether the process that ``identity`` (a :data:`LAUNCHER_ENV` value) names has
    ended (a pid now of another process counts as ended).

    Raises:
        ValueError: ``identity`` is not ``<pid>:<start time>``.
    """
    pid, _, start = identity.partition(":")
    return procfs.process_start_time(int(pid)) != float(start)


def libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def signal_exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal that stopped the job (SIGINT: 130)."""
    return 128 + int(signum)


def controller_pid_path(state_dir: Path) -> Path:
    return state_dir / "controller.pid"


def die_with_parent(sig: int, expected_parent: int | None) -> bool:
    """Asks the kernel for ``sig`` when our parent dies (``PR_SET_PDEATHSIG``).

    Returns False when the parent is already gone (not ``expected_parent``):
    the signal would never come then.
    """
    if libc().prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return expected_parent is None or os.getppid() == expected_parent


def write_pid_file(path: Path) -> None:
    """Atomically, through a fresh temp file (mkstemp: O_EXCL, never a planted symlink)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, path)  # replaces a symlink at ``path`` itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def supervisor_gone(wait: float = 0.0) -> bool:
    """Whether the supervisor that started us (``INPROCESS_SUPERVISOR_PID``) is gone,
    waiting up to ``wait`` seconds for it to go.

    The kernel sends the death signal when the supervisor's *thread* that started
    us ends; a killed supervisor with other threads (its console) is still our
    parent for a moment after that, until its last thread is gone.
    """
    expected = os.environ.get("INPROCESS_SUPERVISOR_PID")
    if not expected:
        return False
    deadline = time.monotonic() + wait
    while os.getppid() == int(expected):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True
