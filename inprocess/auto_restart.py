"""Restarting a whole process from inside it: :func:`monitor_and_restart`.

The newest generation of the API offers this for a job run without a launcher
that relaunches lost processes (``srun`` or ``mpirun`` straight into the
script): called early in the script, it turns the process into a small
supervisor that forks the rest of the program as a child and forks it again
each time the child fails. It is the cold, whole-process restart, for faults
the in-process restart cannot survive (the process died); ``inprocess-run``
does the same per worker, with warm standbys and a job-wide policy.

The parent's messages are plain lines on stderr, as the newest generation
writes them (``Starting self-monitoring mode``, ``Launched child PID``,
``Child PID exited with status N`` / ``with signal N`` / ``abnormally (X)``):
scripts and tests of that generation read them.
"""

from __future__ import annotations

import errno
import os
import sys
import time


def monitor_and_restart(restart_delay: float = 5.0) -> None:
    """Forks; returns in the child, which runs the rest of the program. The
    parent never returns: it waits for the child, exits 0 once a child exits
    with status 0, and after any other end (a non-zero status, a signal) waits
    ``restart_delay`` seconds and forks a new child.

    Call it before anything that must not be forked (threads, CUDA, a process
    group): the children start from the parent as it is at the call. A fork or
    wait that fails ends the parent with status 1.

    Raises:
        ValueError: ``restart_delay`` is not a number >= 0.
    """
    if (
        isinstance(restart_delay, bool)
        or not isinstance(restart_delay, (int, float))
        or not restart_delay >= 0
    ):
        raise ValueError(
            f"monitor_and_restart(restart_delay=...) must be a number of seconds >= 0, "
            f"got {restart_delay!r}"
        )
    sys.stderr.write("Starting self-monitoring mode\n")
    while True:
        try:
            pid = os.fork()
        except OSError as ex:
            sys.stderr.write(f"fork: {ex}\n")
            os._exit(1)
        if pid == 0:
            return  # the child: the program goes on here
        sys.stderr.write(f"Launched child {pid}\n")
        status = _wait(pid)
        if os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
            sys.stderr.write(f"Child {pid} exited with status {code}\n")
            if code == 0:
                os._exit(0)
        elif os.WIFSIGNALED(status):
            sys.stderr.write(f"Child {pid} exited with signal {os.WTERMSIG(status)}\n")
        else:
            sys.stderr.write(f"Child {pid} exited abnormally ({status:x})\n")
        time.sleep(restart_delay)


def _wait(pid: int) -> int:
    """The child's wait status; a wait interrupted by a signal is tried again, any
    other failure ends the parent with status 1."""
    while True:
        try:
            _pid, status = os.waitpid(pid, 0)
            return status
        except OSError as ex:
            if ex.errno == errno.EINTR:
                continue
            sys.stderr.write(f"waitpid: {ex}\n")
            os._exit(1)
