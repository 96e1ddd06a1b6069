"""Abort: stop whatever the wrapped function is blocked in, from another thread.

``Abort`` instances run in the monitor thread while the main thread may still
be blocked (in a collective, typically), and again in the main thread on the
restart path; they must therefore be idempotent and thread-safe.
"""

from __future__ import annotations

import abc

from ..state import State


class Abort(abc.ABC):
    """Base class of the ``abort`` argument of :class:`inprocess.Wrapper`.

    Compose several with :class:`inprocess.Compose`.
    """

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        raise NotImplementedError
