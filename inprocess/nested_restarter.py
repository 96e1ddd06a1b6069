"""Callbacks that tell an outer (job-level) restarter what the in-process restarter is doing.

An outer launcher that restarts whole jobs reads, from each job's output, one
line per state transition of the in-process restarter, in this form::

    [<time>] [INFO] [InprocessRestarter@<host>] active_rank=<r> \
        [NestedRestarter] name=[InProcess] state=<state> stage=<stage>

(one line; broken here for width)

(``stage=`` only where the state has one). The states, in the order one rank
goes through them:

* ``initialize``: the first iteration starts (:class:`NestedRestarterHandlingCompleted`
  as ``initialize``, first call);
* ``handling`` / ``starting``: a fault is being handled (:class:`NestedRestarterHandlingStarting`
  as ``abort``);
* ``handling`` / ``completed``: the restart is done, the next iteration starts
  (:class:`NestedRestarterHandlingCompleted`, every later call);
* ``finalized``: the call completed (:class:`NestedRestarterFinalized` as ``completion``);
* ``aborted``: the rank leaves the job (:class:`NestedRestarterAborted` as ``terminate``).

Only the rank launched as ``special_rank`` writes the lines (one rank speaks for
the job). Each callback takes either generation's state (a ``State`` or a
``FrozenState``) and returns it, so it composes with :class:`inprocess.Compose`
and with the other callbacks of either generation. The lines go to standard
error directly, not through :mod:`logging`, so that the outer launcher sees them
whatever the application's logging configuration is; a callback given a
:class:`NestedRestarterLogger` (``logger=``) sends them through :mod:`logging`
instead.

Under ``inprocess-run`` (the records file named by
:data:`inprocess.records.RECORDS_ENV`), each line is also appended there as a
``restarter`` record (``state``, ``stage``, ``iteration``, ``rank``), so that
the restart records and the report show the restarter's states of every
restart (:func:`inprocess.report.restarter_states`).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import sys
import threading
import time
from typing import IO, Any

from .abort.base import Abort
from .completion import Completion
from .initialize import Initialize
from .records import RECORDS_ENV, append_jsonl
from .terminate import Terminate

log = logging.getLogger(__name__)

#: the name the lines carry, and the prefix an outer launcher looks for
LOGGER_NAME = "InprocessRestarter"
MARKER = "[NestedRestarter] name=[InProcess]"

# Lines from the monitor thread (abort) and the main thread must not interleave.
_write_lock = threading.Lock()


_LINE = re.compile(
    r"active_rank=(?P<active_rank>\S+) \[NestedRestarter\] name=\[InProcess\] "
    r"state=(?P<state>\w+)(?: stage=(?P<stage>\w+))?"
)


def parse_line(line: str) -> dict[str, Any] | None:
    """``{"active_rank", "state", "stage"}`` of a restarter line (any prefix), else None."""
    m = _LINE.search(line)
    if m is None:
        return None
    return {"active_rank": m["active_rank"], "state": m["state"], "stage": m["stage"]}


def format_line(active_rank: Any, state: str, stage: str | None = None) -> str:
    """The message of one state transition (without the time/level/host prefix)."""
    msg = f"active_rank={active_rank} {MARKER} state={state}"
    return msg if stage is None else f"{msg} stage={stage}"


class NestedRestarterLogger:
    """Sends the lines through :mod:`logging` (logger ``InprocessRestarter``), for code
    that captures them there; it adds no handler: whoever uses it configures one."""

    def __init__(self, name: str = LOGGER_NAME) -> None:
        self.restarter_logger = logging.getLogger(name)

    def log_for_restarter(self, message: str) -> None:
        self.restarter_logger.info(message)


class NestedRestarterCallback:
    """Writes one restarter state line on the rank launched as ``special_rank``.

    Args:
        special_rank: the initial rank (``RANK`` at launch) that writes the lines.
        stream: where the lines go; default: ``sys.stderr`` at the time of writing.

    A callback invoked several times for the same restart iteration (an abort
    runs in the monitor thread and again on the restart path) writes its line
    once: one line per transition.
    """

    #: the restarter state this callback reports, and its stage
    restarter_state: str = ""
    restarter_stage: str | None = None

    # Read by inprocess.generation: takes the state of either generation.
    _takes_either_generation = True

    def __init__(
        self,
        special_rank: int = 0,
        stream: IO[str] | None = None,
        *,
        restarter_state: str | None = None,
        restarter_stage: str | None = None,
        logger: NestedRestarterLogger | None = None,
    ) -> None:
        if not isinstance(special_rank, int) or isinstance(special_rank, bool) or special_rank < 0:
            raise ValueError(f"special_rank must be an int >= 0, got {special_rank!r}")
        self.special_rank = special_rank
        self.stream = stream
        if restarter_state is not None:
            self.restarter_state = restarter_state
        if restarter_stage is not None:
            self.restarter_stage = restarter_stage
        #: when set, the lines go through it (``logging``) instead of ``stream``
        self.logger = logger
        self._last: tuple[Any, ...] | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(special_rank={self.special_rank})"

    def _transition(self) -> tuple[str, str | None]:
        return self.restarter_state, self.restarter_stage

    def _report(self, state: Any) -> None:
        if getattr(state, "initial_rank", None) != self.special_rank:
            return
        restarter_state, stage = self._transition()
        key = (restarter_state, stage, getattr(state, "iteration", None))
        with self._lock:
            if key == self._last:
                return
            self._last = key
        message = format_line(getattr(state, "active_rank", None), restarter_state, stage)
        if self.logger is not None:
            self.logger.log_for_restarter(message)
            self._record(state, restarter_state, stage)
            return
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
        line = f"[{now}] [INFO] [{LOGGER_NAME}@{socket.gethostname()}] {message}\n"
        stream = self.stream if self.stream is not None else sys.stderr
        with _write_lock:
            stream.write(line)
            stream.flush()
        self._record(state, restarter_state, stage)

    def _record(self, state: Any, restarter_state: str, stage: str | None) -> None:
        path = os.environ.get(RECORDS_ENV)
        if path:
            record = {
                "type": "restarter",
                "time": time.time(),
                "state": restarter_state,
                "stage": stage,
                "iteration": getattr(state, "iteration", None),
                "rank": self.special_rank,
            }
            try:
                append_jsonl(path, record, owned=True)  # (never through a symlink, never theirs)
            except OSError as ex:  # a record never stops a restart
                log.debug("cannot append the restarter record to %s: %s", path, ex)

    def __call__(self, state: Any, *rest: Any) -> Any:
        """Writes the line (on ``special_rank``) and returns what it was given."""
        self._report(state)
        return (state, *rest) if rest else state


class NestedRestarterHandlingCompleted(NestedRestarterCallback, Initialize):
    """``initialize``: ``state=initialize`` on the first call, then
    ``state=handling stage=completed`` at the start of every restarted iteration."""

    restarter_state = "initialize"

    def __init__(
        self,
        special_rank: int = 0,
        stream: IO[str] | None = None,
        *,
        logger: NestedRestarterLogger | None = None,
    ) -> None:
        super().__init__(special_rank, stream, logger=logger)
        self._called_once = False

    def _transition(self) -> tuple[str, str | None]:
        if self._called_once:
            return "handling", "completed"
        return "initialize", None

    def __call__(self, state: Any, *rest: Any) -> Any:
        self._report(state)
        self._called_once = True
        return (state, *rest) if rest else state


class NestedRestarterHandlingStarting(NestedRestarterCallback, Abort):
    """``abort``: ``state=handling stage=starting`` as a fault starts being handled."""

    restarter_state = "handling"
    restarter_stage = "starting"


class NestedRestarterFinalized(NestedRestarterCallback, Completion):
    """``completion``: ``state=finalized`` once the call completed."""

    restarter_state = "finalized"


class NestedRestarterAborted(NestedRestarterCallback, Terminate):
    """``terminate``: ``state=aborted`` as this rank leaves the job."""

    restarter_state = "aborted"


__all__ = [
    "LOGGER_NAME",
    "MARKER",
    "NestedRestarterAborted",
    "NestedRestarterCallback",
    "NestedRestarterFinalized",
    "NestedRestarterHandlingCompleted",
    "NestedRestarterHandlingStarting",
    "NestedRestarterLogger",
    "format_line",
    "parse_line",
]
