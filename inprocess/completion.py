"""``Completion``: the newer generation's callback run when a call completes."""

from __future__ import annotations

import abc

from .state import FrozenState


class Completion(abc.ABC):
    """Base class of the ``completion`` argument of :class:`inprocess.Wrapper`.

    Runs on every rank that is still in the job once the wrapped function has
    completed on all of them, with the rank's read-only state; an exception it
    raises is logged, the call still returns. Chain several with
    :class:`inprocess.Compose`.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError
