"""Calls that may hang (a store read of a server that stopped answering), each
bounded in time without ever running two at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class BoundedCalls:
    """Runs blocking calls (store reads) on a daemon thread, waiting a bounded time.

    A TCPStore client call blocks as long as its server does not answer (a
    SIGSTOPped server: forever), whatever the client's timeout; the
    controller's loop must never block on it.

    Invariant: at most one call is in flight. A call that does not return in
    time is left to finish on its thread (it does once the server is killed
    or continues), and no other call is made until it has.
    """

    def __init__(self) -> None:
        self._pending: threading.Thread | None = None

    def call(self, fn: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
        """``(True, fn())``, or ``(False, None)`` if it did not return within ``timeout``."""
        if self._pending is not None and self._pending.is_alive():
            return False, None
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as ex:  # handed over to the caller
                box["error"] = ex

        thread = threading.Thread(target=run, name="inprocess-store-read", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            self._pending = thread
            return False, None
        self._pending = None
        if "error" in box:
            raise box["error"]
        return True, box.get("value")
