"""What a preloaded process needs to become another: standbys, their zygote, a fork template.

A process that did the warm imports once (``import torch``...) and then turns
into a worker, or forks children that do, has to look and behave like a fresh
one: its environment as ``/proc/PID/environ`` shows it, its stdio buffering, its
tie to its parent. :mod:`inprocess.failover.standby`,
:mod:`inprocess.failover.zygote` and :mod:`inprocess.tools.fork_template` all
use these helpers from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

from .procfs import own_area

#: a preloaded process's own variable, room in its initial environment block for
#: the variables of the process it becomes (see :func:`show_environ`)
ROOM_ENV = "INPROCESS_STANDBY_ROOM"
ROOM_SIZE = 4096
_PR_SET_PDEATHSIG = 1


def warm_imports() -> None:
    """The imports every worker makes, done ahead of time by a preloaded process:
    ``torch``, ``torch.distributed`` and the Wrapper's modules. None of them starts
    a thread, initializes CUDA or makes a process group: a fork stays safe."""
    import torch
    import torch.distributed

    import inprocess.wrap  # noqa: F401  (the Wrapper's modules: most of a second)

    del torch


def die_with_parent(sig: int) -> None:
    """Has the kernel send ``sig`` to this process when its parent dies (``0``: nothing)."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def show_environ(env: dict[str, str]) -> bool:
    """Writes ``env`` over our initial environment block, the one that
    ``/proc/PID/environ`` (``ps e``, ``psutil.Process.environ()``) shows, so that
    tools see the worker's variables (``RANK``...), not the standby's.

    Safe once ``os.environ`` was cleared and refilled: libc's ``environ`` then
    points at new strings only, nothing reads the old block. The block keeps
    its size (the standby's environment plus :data:`ROOM_ENV`); ``False`` if
    the worker's does not fit (``/proc`` then shows the standby's).
    """
    start, end = own_area(50)  # env_start, env_end
    block = b"".join(f"{k}={v}".encode(errors="surrogateescape") + b"\0" for k, v in env.items())
    if start <= 0 or len(block) + 1 > end - start:
        return False
    ctypes.memmove(start, block.ljust(end - start, b"\0"), end - start)
    return True


def reopen_stdio(unbuffered: bool) -> None:
    """``sys.stdout`` / ``sys.stderr`` on the worker's fds 1 and 2, buffered as a fresh
    interpreter would buffer them there: line-buffered on a terminal (stderr always),
    and with ``PYTHONUNBUFFERED`` (read at start-up, so not applied by the
    environment alone) written through to the fd at once, nothing held in a buffer."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        with contextlib.suppress(Exception):
            old.flush()
        binary: io.RawIOBase | io.BufferedWriter = io.FileIO(fd, "w", closefd=False)
        if not unbuffered:
            binary = io.BufferedWriter(binary)
        setattr(
            sys,
            name,
            io.TextIOWrapper(
                binary,
                encoding=getattr(old, "encoding", None),
                errors=getattr(old, "errors", None),
                line_buffering=os.isatty(fd) or name == "stderr",
                write_through=unbuffered,
            ),
        )
