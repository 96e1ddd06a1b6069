"""Bounding a call that may hang (a GPU synchronization, a cleanup, a store read)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .exception import TimeoutError as RestartTimeoutError
from .native_calls import track

T = TypeVar("T")


def call_with_timeout(fn: Callable[[], T], timeout: float, name: str) -> T:
    """Runs ``fn()`` in a daemon thread and waits at most ``timeout`` seconds.

    Returns its result or re-raises its exception. Past the timeout it raises
    :class:`inprocess.exception.TimeoutError`; the thread cannot be killed and
    is left behind, but as a daemon it never keeps the process alive (the
    interpreter's exit waits a little for it: :mod:`inprocess.native_calls`).
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as ex:
            outcome["error"] = ex

    thread = track(threading.Thread(target=target, name=name, daemon=True))
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RestartTimeoutError(f"{name} did not finish within {timeout:.3g}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
