"""What the supervisor, the controller and the store server share.

The controller's pid file, the exit code of a stop by signal, the kernel's
parent-death signal and a quick exit. These processes import this module; it
imports none of them (no import circle between them).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from .._exit import exit_now

__all__ = [
    "controller_pid_path",
    "die_with_parent",
    "exit_now",
    "libc",
    "signal_exit_code",
]

_PR_SET_PDEATHSIG = 1


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
