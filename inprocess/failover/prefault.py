"""Copying, ahead of need, the pages a forked standby shares with its zygote.

A standby forked from a zygote shares the zygote's memory (torch and everything
imported) until it writes to it; every first write to a page then costs a page
fault and a copy. A standby that becomes a worker pays those faults on the
recovery path, where a spawned standby had paid for its own pages while it
waited. :func:`prefault` moves that cost into the wait: it asks the kernel to
make every page the process still shares in its private writable mappings its
own (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14: the same faults as writing to
each page, without writing anything), one chunk at a time, and stops as soon as
the standby's socket has something to read (its assignment, or the backend's
end): a worker is never kept waiting for it.

Opt-in (``INPROCESS_STANDBY_PREFAULT=1`` in the environment ``inprocess-run`` is
started with): it costs each standby CPU and memory (its own copy of the
zygote's pages, as a spawned standby has) whether or not it is ever assigned.

Safety: ``MADV_POPULATE_WRITE`` changes no byte of the process's memory, so it
needs no care for what else runs; a standby has no other thread anyway. A
region the kernel refuses (one that would fault, ``EFAULT``; a special mapping,
``EINVAL``) is skipped; a kernel without the advice (``EINVAL`` on the first
region) ends the prefault at once.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import socket
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

#: the environment variable that turns the prefault of forked standbys on ("1")
PREFAULT_ENV = "INPROCESS_STANDBY_PREFAULT"
_MADV_POPULATE_WRITE = 23
#: bytes populated between two looks at the standby's socket (a few ms of work)
CHUNK = 4 << 20


def wanted() -> bool:
    """Whether this standby's environment asks for the prefault."""
    return os.environ.get(PREFAULT_ENV, "") == "1"


def shared_writable_regions(smaps: Iterable[str]) -> list[tuple[int, int]]:
    """``(start, end)`` of the private writable mappings in ``smaps`` (the lines of
    ``/proc/PID/smaps``) that have pages shared with another process."""
    regions: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for line in smaps:
        fields = line.split()
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping's header: "lo-hi perms offset dev inode [name]"
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            perms, name = fields[1], fields[5] if len(fields) > 5 else ""
            private_writable = perms[1] == "w" and perms[3] == "p"
            current = (lo, hi) if private_writable and not name.startswith("[v") else None
        elif current is not None and fields[0] in ("Shared_Dirty:", "Shared_Clean:"):
            if int(fields[1]) > 0:
                regions.append(current)
                current = None
    return regions


def prefault(sock: socket.socket) -> tuple[int, float]:
    """Makes this process's shared pages its own until ``sock`` is readable.

    Returns (bytes of mappings populated, seconds spent).
    """
    started = time.monotonic()
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    try:
        with open("/proc/self/smaps") as f:
            regions = shared_writable_regions(f)
    except OSError as ex:  # no /proc: nothing to go by
        log.debug("cannot read /proc/self/smaps: %s", ex)
        return 0, time.monotonic() - started
    done = 0
    for lo, hi in regions:
        for start in range(lo, hi, CHUNK):
            if select.select([sock], [], [], 0)[0]:
                return done, time.monotonic() - started  # the assignment goes first
            size = min(CHUNK, hi - start)
            if madvise(start, size, _MADV_POPULATE_WRITE) != 0:
                code = ctypes.get_errno()
                if code == errno.EINVAL and done == 0 and start == regions[0][0]:
                    log.debug("no MADV_POPULATE_WRITE on this kernel: no prefault")
                    return 0, time.monotonic() - started
                break  # this region cannot be populated: the next one
            done += size
    return done, time.monotonic() - started
