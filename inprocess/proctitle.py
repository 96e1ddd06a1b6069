"""What ``ps``, ``pgrep -f``, ``top``/``htop`` and py-spy show for a process of the job.

A warm standby becomes a worker without an ``exec`` (:mod:`inprocess.failover.standby`),
and a monitor process is a fork of its rank: without help, the system shows
every one of them with the command line it was started with. :func:`set_title`
writes the process's title over its argument area, the memory that
``/proc/PID/cmdline`` is read from (between ``arg_start`` and ``arg_end`` of
``/proc/self/stat``); where that area's last byte is not NUL, Linux shows it as
one string up to its first NUL, so the title is written, then a NUL, then
spaces to the end of the area. The area's size is fixed when the process
starts: a longer title is cut (processes that need room, such as standbys,
are started with an argument of spaces that reserves it, :data:`ROOM_ARG`).
Python copied its arguments at start-up (``sys.argv``, ``sys.orig_argv``), so
nothing reads the area afterwards.

Standard library only (``ctypes``), by choice: the runtime dependencies are
torch, psutil and nvidia-ml-py, and what the maintained ``setproctitle``
package does on Linux comes down to the few lines here (it also moves the
environment to make more room: we keep the environment area, where a standby
shows its worker's variables).
"""

from __future__ import annotations

import ctypes
import logging

from .procfs import own_area

log = logging.getLogger(__name__)

#: an argument of spaces that reserves room for a later title in a process's
#: argument area (standbys, their zygote); nothing reads it
ROOM_ARG = " " * 2048
_PR_SET_NAME = 15


def set_title(title: str, name: str | None = None) -> bool:
    """Shows ``title`` as this process's command line (cut to the room there is), and
    ``name`` (at most 15 bytes shown) as its name (``ps -o comm``, ``top``); returns
    whether the command line was written."""
    if name is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    start, end = own_area(48)  # arg_start, arg_end
    size = end - start
    if start <= 0 or size < 2:
        return False
    text = " ".join(title.replace("\0", " ").split("\n")).encode(errors="replace")
    text = text[: size - 1] + b"\0"
    ctypes.memmove(start, text.ljust(size, b" "), size)
    return True


def worker_title(argv: list[str] | tuple[str, ...]) -> str:
    """A worker's title: its command line as a fresh ``python SCRIPT ...`` shows it."""
    return " ".join(argv)
