"""Finalize: brings the process back to a restartable state after a fault.

Runs after the abort and before the health check. An exception from a
finalizer means the process cannot be trusted: the Wrapper records the rank as
terminated and re-raises it.
"""

from __future__ import annotations

import abc
import datetime
import logging
from collections.abc import Callable
from typing import Any

from .state import State, shaped_result
from .timeouts import call_with_timeout

log = logging.getLogger(__name__)


class Finalize(abc.ABC):
    """Base class of the ``finalize`` argument of :class:`inprocess.Wrapper`.

    The Wrapper uses a returned ``State`` (alone or first in a tuple, as
    ``(state, train_ex)``) and ignores any other return value, ``None`` included.
    """

    @abc.abstractmethod
    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        raise NotImplementedError


class ThreadedFinalize(Finalize):
    """Runs ``fn(*args, **kwargs)`` in a separate thread under a timeout.

    Protects the restart from a cleanup function that hangs: past ``timeout``
    it raises :class:`inprocess.exception.TimeoutError` (the rank is then
    terminated). The thread is a daemon: it cannot be killed, but it does not
    keep the process alive. An exception of ``fn`` is re-raised.
    """

    def __init__(
        self,
        timeout: datetime.timedelta,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        if not isinstance(args, tuple):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
        self.timeout = timeout
        self.fn = fn
        self.args = args
        self.kwargs = kwargs or {}

    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        name = f"finalize {getattr(self.fn, '__name__', self.fn)!r}"
        call_with_timeout(
            lambda: self.fn(*self.args, **self.kwargs), self.timeout.total_seconds(), name
        )
        return shaped_result(state, train_ex)
