"""The base class of health checks, and what the checks share."""

from __future__ import annotations

import abc
import logging
import os

from ..state import State

log = logging.getLogger(__name__)


class HealthCheck(abc.ABC):
    """Base class of the ``health_check`` argument of :class:`inprocess.Wrapper`.

    ``__call__(state, train_ex=None)`` returns ``(state, train_ex)`` when the
    rank is healthy and raises when it is not. ``train_ex`` is the exception that
    ended the wrapped function on this rank, if any. The Wrapper uses a returned
    ``State`` (alone or first in a tuple) and ignores any other return value.

    Run at the start of an iteration (``train_ex=None``), a failing check is a
    fault of that iteration and every rank restarts; run after a fault, it ends
    this rank with a :class:`~inprocess.exception.HealthCheckError` whose
    ``__cause__`` is ``train_ex``.
    """

    @abc.abstractmethod
    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        raise NotImplementedError


def env_local_rank() -> int | None:
    """``LOCAL_RANK`` of the environment, if set to an integer."""
    value = os.environ.get("LOCAL_RANK")
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("ignoring LOCAL_RANK=%r: not an integer", value)
        return None
