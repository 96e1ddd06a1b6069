"""SIGUSR1: a scheduler's warning that the job ends soon (Slurm's ``--signal=USR1@N``).

Slurm sends a job step's signals to every process of the step (its process
tracking finds them all, whatever their session), not only to the launchers.
So:

* every process of the job's machinery (launcher, controller, node agent,
  store server, guard, standby zygotes) survives it: :func:`survive`, a
  handler that does nothing (SIGUSR1's default action ends a process);
* a Wrapper rank takes it as a request to persist its next snapshot to disk
  (:func:`install_in_rank`; with ``snapshot_dir`` and ``persist_every`` set),
  whatever the step, so a job cut off at its time limit resumes from there.

A handler of the user's own is never replaced. The handler only sets a flag
(async-signal-safe); the snapshot writer takes it (:func:`take`) at the next
commit and logs it there.
"""

from __future__ import annotations

import signal
import threading

PERSIST_SIGNAL = signal.SIGUSR1

_requested = threading.Event()


def _machinery(signum: int, frame: object) -> None:
    """The job's machinery outlives the warning (the workers act on it)."""


def _rank(signum: int, frame: object) -> None:
    _requested.set()


def survive() -> None:
    """This process of the job's machinery is not ended by SIGUSR1 (main thread)."""
    try:
        if signal.getsignal(PERSIST_SIGNAL) in (signal.SIG_DFL, None):
            signal.signal(PERSIST_SIGNAL, _machinery)
    except ValueError:  # not the main thread: the process's owner decides
        pass


def install_in_rank() -> bool:
    """SIGUSR1 requests a persist of the next snapshot, unless the process has a
    handler of its own (main thread only); whether ours is installed."""
    try:
        if signal.getsignal(PERSIST_SIGNAL) in (signal.SIG_DFL, None, _machinery, _rank):
            signal.signal(PERSIST_SIGNAL, _rank)
            return True
    except ValueError:
        pass
    return False


def request() -> None:
    """Asks for the next snapshot to be persisted (what the signal does)."""
    _requested.set()


def take() -> bool:
    """Whether a persist was requested since the last call (the request is consumed)."""
    if _requested.is_set():
        _requested.clear()
        return True
    return False
