"""``Terminate``: the newer generation's callback run when a rank leaves the job."""

from __future__ import annotations

import abc

from .state import FrozenState


class Terminate(abc.ABC):
    """Base class of the ``terminate`` argument of :class:`inprocess.Wrapper`.

    Runs on a rank whose call ends with an exception (the rank leaves the job:
    a ``BaseException`` from the function, a failed health check, a discarded
    rank, ``RestartAbort``), with the rank's read-only state, before the
    exception propagates; an exception it raises propagates instead, chained
    to the original one. Chain several with :class:`inprocess.Compose`.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError
