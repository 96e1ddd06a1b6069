"""A GPU that faulted: the rank that leaves because of it ends cleanly.

A sticky CUDA error (a device-side assert, an illegal memory access) breaks the
process's CUDA context for good: every later CUDA call fails. Python code that
touches CUDA then raises, and our cleanup catches that. Native code does not
expect it: torch's allocators record an event when they free memory that a
stream used, and that call failing inside a destructor is ``std::terminate``,
an abort at interpreter exit (a core dump where core dumps are on).

So once this process's device is known to be broken (:func:`mark_broken`, by
the restart health check or by our own cleanup):

* our cleanup never raises over the error that ended the rank, and frees no
  pinned or device memory (:func:`keep`: held for the rest of the process);
* at interpreter exit (after the uncaught exception's traceback is printed and
  the ``atexit`` functions registered after ``inprocess`` was imported ran),
  the process ends with :data:`EXIT_CODE`, without the interpreter's and the
  native libraries' teardown.

This module does not import torch: it recognizes CUDA's errors by their type's
name and their text.
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
from typing import Any

from ._exit import exit_now

log = logging.getLogger(__name__)

#: exit status of a process whose GPU faulted (EX_TEMPFAIL: a new process gets
#: a fresh CUDA context, so relaunching the worker is worth trying)
EXIT_CODE = 75

#: the type names of torch's errors for a failed CUDA (accelerator) call
_ERROR_TYPES = frozenset({"AcceleratorError", "CudaError", "CUDAError"})
#: how CUDA's own messages start (torch prefixes the runtime's error string)
_CUDA_TEXT = re.compile(r"(CUDA error: [^\n]*|device-side assert triggered|"
                        r"an illegal memory access was encountered)")

_lock = threading.Lock()
_broken: str | None = None
#: memory that must never be freed in this process (see the module's docstring)
_kept: list[Any] = []


def cause_of(ex: BaseException | None) -> str | None:
    """What broke the device, in CUDA's words (``"CUDA error: device-side assert
    triggered"``), when ``ex`` or an exception in its chain is a CUDA error;
    else ``None``."""
    seen: set[int] = set()
    while ex is not None and id(ex) not in seen:
        seen.add(id(ex))
        text = str(ex)
        match = _CUDA_TEXT.search(text)
        if match is not None:
            return match.group(1).strip()
        if type(ex).__name__ in _ERROR_TYPES:
            return text.strip().splitlines()[0] if text.strip() else type(ex).__name__
        ex = ex.__cause__ or ex.__context__
    return None


def mark_broken(cause: str) -> None:
    """Records that this process's CUDA context is broken (logged once)."""
    global _broken
    with _lock:
        if _broken is not None:
            return
        _broken = cause
    log.error(
        "the GPU of this process faulted (%s): its memory is not freed, and the process "
        "ends with exit code %d at interpreter exit, without native teardown",
        cause,
        EXIT_CODE,
    )


def broken() -> str | None:
    """The cause recorded by :func:`mark_broken`, or ``None``."""
    return _broken


def keep(obj: Any) -> None:
    """Holds ``obj`` (pinned or device memory) for the rest of the process."""
    with _lock:
        _kept.append(obj)


def _at_exit() -> None:
    if _broken is not None:
        exit_now(EXIT_CODE)


# Registered at import, so it runs after the atexit functions registered later
# (the user's, imported after us), before the interpreter's teardown.
atexit.register(_at_exit)

__all__ = ["EXIT_CODE", "broken", "cause_of", "keep", "mark_broken"]
