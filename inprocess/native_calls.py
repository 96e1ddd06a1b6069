"""Our daemon threads that may be inside a native (torch) call when the
interpreter exits.

A native call such as a store read or a store client's connect releases the
GIL. Where it returns after the interpreter has begun finalizing, CPython ends
the calling daemon thread with ``pthread_exit`` as it asks for the GIL back;
the forced unwind crosses pybind11's GIL guard, a destructor that may not
throw, and the whole process dies of ``std::terminate`` ("terminate called
without an active exception", SIGABRT, exit status 134) instead of exiting
with its own status. A rank whose training returned looked crashed.

So each such thread is tracked here, and at interpreter exit (``atexit``
functions run before finalization begins) the process waits up to
:data:`EXIT_WAIT` seconds in all for the tracked threads to end. A call still
blocked past that is one that hangs (a dead peer): it stays blocked through the
short finalization, which is harmless.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref

#: the longest the interpreter's exit waits for tracked threads, in all
EXIT_WAIT = 5.0

_lock = threading.Lock()
_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def track(thread: threading.Thread) -> threading.Thread:
    """Has the interpreter's exit wait for ``thread`` (a started or about to be
    started daemon thread that calls into native code); returns it."""
    with _lock:
        _threads.add(thread)
    return thread


def join_tracked(timeout: float) -> list[threading.Thread]:
    """Waits up to ``timeout`` seconds in all for the tracked threads to end;
    returns those still alive."""
    deadline = time.monotonic() + timeout
    with _lock:
        pending = [t for t in _threads if t is not threading.current_thread()]
    for thread in pending:
        if thread.ident is None:  # never started: nothing to wait for
            continue
        thread.join(max(deadline - time.monotonic(), 0.0))
    return [t for t in pending if t.is_alive()]


def _at_exit() -> None:
    join_tracked(EXIT_WAIT)


atexit.register(_at_exit)

__all__ = ["EXIT_WAIT", "join_tracked", "track"]
