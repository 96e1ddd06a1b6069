"""Exceptions raised by the in-process restart layer.

Two families:

* ``RestartError`` (an ``Exception``) and its subclasses describe something that
  went wrong in the restart machinery; most of them end the rank's process path.
* ``RestartAbort`` (a ``BaseException``) ends the :class:`inprocess.Wrapper` on
  purpose, e.g. when :class:`inprocess.initialize.RetryController` runs out of
  attempts. Being a ``BaseException`` it passes through ``except Exception``
  blocks in user code.
"""

from __future__ import annotations


class RestartError(Exception):
    """Base class of the errors raised by the restart machinery."""


class RestartAbort(BaseException):
    """Ends the Wrapper on every rank that raises it; not retried."""


class HealthCheckError(RestartError):
    """A rank-local health check found this rank unfit to continue."""


class InternalError(RestartError):
    """An invariant of the restart protocol was violated."""


class TimeoutError(RestartError):
    """A distributed operation of the restart protocol did not finish in time."""


class StoreError(RestartError):
    """The distributed store could not be created or reached."""
