"""``WrapperConfig``: the arguments of an ``inprocess.Wrapper``, validated once.

The Wrapper takes its durations as ``datetime.timedelta`` (the usage guide's
API); the config carries them in seconds (``float``), the unit every part of
the restart machinery works in. The fields of :class:`WrapperConfig` are the one
list of the Wrapper's settings: validation, the Wrapper's attributes and the
call's timings are derived from it.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
import pathlib
from typing import Any

from .abort import Abort
from .completion import Completion
from .compose import Compose
from .finalize import Finalize
from .generation import Generation, wrapper_generation
from .health_check import HealthCheck
from .initialize import Initialize
from .rank_assignment import ActivateAllRanks, RankAssignment, ShiftRanks
from .rank_filter import RankFilter
from .store import StoreMixin
from .terminate import Terminate

#: the Wrapper's ``rank_assignment`` when none is given: the default of the
#: generation its other callbacks are written for
DEFAULT_RANK_ASSIGNMENT: Any = object()

#: longest duration any timeout or interval may have: longer ones are mistakes
#: (and overflow the waits of threads and of the store)
MAX_DURATION = datetime.timedelta(days=30)

#: durations that may be zero (the others must be positive)
_MAY_BE_ZERO = ("last_call_wait", "termination_grace_time")
#: (shorter, longer): each pair's first duration must be shorter than its second
_ORDERING = (
    ("soft_timeout", "hard_timeout"),
    ("hard_timeout", "barrier_timeout"),
    ("heartbeat_timeout", "barrier_timeout"),
    ("monitor_process_interval", "heartbeat_timeout"),
    ("heartbeat_interval", "heartbeat_timeout"),
    ("monitor_thread_interval", "soft_timeout"),
    ("progress_watchdog_interval", "soft_timeout"),
)


def _duration() -> Any:
    return dataclasses.field(metadata={"duration": True})


@dataclasses.dataclass(frozen=True)
class WrapperConfig:
    """A Wrapper's settings; durations in seconds. Build it with :meth:`from_arguments`."""

    store_factory: type[StoreMixin]
    store_kwargs: dict[str, Any]
    initialize: Initialize | None
    abort: Abort | None
    finalize: Finalize | None
    health_check: HealthCheck | None
    rank_assignment: RankAssignment
    rank_filter: RankFilter | None
    monitor_thread_interval: float = _duration()
    monitor_process_interval: float = _duration()
    progress_watchdog_interval: float = _duration()
    soft_timeout: float = _duration()
    hard_timeout: float = _duration()
    heartbeat_timeout: float = _duration()
    heartbeat_interval: float = _duration()
    barrier_timeout: float = _duration()
    completion_timeout: float = _duration()
    last_call_wait: float = _duration()
    termination_grace_time: float = _duration()
    #: a main thread not back in the Wrapper this long after the restart
    #: exception was sent and the abort ran (and idle in the kernel) is ended
    #: by its monitor process
    unwind_timeout: float = _duration()
    monitor_process_logfile: str | None = None
    enabled: bool = True
    monitor_process_pidfile: str | None = None
    completion: Completion | None = None
    terminate: Terminate | None = None
    #: the restart records' file (absolute), or ``None``: ``INPROCESS_RECORDS``, if set
    records: str | None = None
    #: directory of persisted snapshots (absolute), see :mod:`inprocess.snapshot.persist`
    snapshot_dir: str | None = None
    #: persist the snapshots of steps that are multiples of this (needs ``snapshot_dir``)
    persist_every: int | None = None
    #: stage CUDA snapshots on the device first (``None``: where the device has
    #: room; see :class:`inprocess.snapshot.buffers.DeviceCopier`)
    snapshot_staging: bool | None = None
    #: derived from the callbacks' shapes (see :mod:`inprocess.generation`)
    generation: Generation = Generation.GUIDE

    @staticmethod
    def durations() -> tuple[str, ...]:
        """Names of the duration fields, in order."""
        return tuple(f.name for f in dataclasses.fields(WrapperConfig) if f.metadata)

    @classmethod
    def from_arguments(cls, **arguments: Any) -> WrapperConfig:
        """Checks the Wrapper's arguments (durations as ``datetime.timedelta``) and
        builds the config; raises ``TypeError``/``ValueError`` naming the argument.

        A tuple (or list) of callbacks is their composition (this also accepts the
        usage guide's ``rank_assignment=(Compose(...),)``); ``heartbeat_interval``
        ``None`` means a quarter of ``heartbeat_timeout`` (at least
        ``monitor_process_interval``): four heartbeats per timeout, not one a
        second from every rank.
        """
        a = dict(arguments)
        callbacks = ("initialize", "abort", "finalize", "health_check", "rank_assignment")
        for name in (*callbacks, "rank_filter", "completion", "terminate"):
            a[name] = _compose_sequence(a.get(name))
        if a["heartbeat_interval"] is None:
            interval, timeout = a["monitor_process_interval"], a["heartbeat_timeout"]
            durations = isinstance(interval, datetime.timedelta) and isinstance(
                timeout, datetime.timedelta
            )
            # (wrong types are reported below, under their own names)
            a["heartbeat_interval"] = max(interval, timeout / 4) if durations else interval

        store_factory = a["store_factory"]
        if not (isinstance(store_factory, type) and issubclass(store_factory, StoreMixin)):
            raise TypeError(
                "Wrapper(store_factory=...) must be a subclass of inprocess.store.StoreMixin, "
                f"got {store_factory!r}"
            )
        _check_type("store_kwargs", a["store_kwargs"], (dict, type(None)), "a dict or None")
        store_kwargs = a["store_kwargs"] = dict(a["store_kwargs"] or {})
        if not all(isinstance(k, str) for k in store_kwargs):
            raise TypeError(
                "Wrapper(store_kwargs=...) must have str keys (argument names), "
                f"got {store_kwargs!r}"
            )
        _check_store_kwargs(store_factory, store_kwargs)
        _check_type(
            "initialize", a["initialize"], (Initialize, type(None)), "an Initialize or None"
        )
        _check_type("abort", a["abort"], (Abort, type(None)), "an Abort or None")
        _check_type("finalize", a["finalize"], (Finalize, type(None)), "a Finalize or None")
        _check_type(
            "health_check", a["health_check"], (HealthCheck, type(None)), "a HealthCheck or None"
        )
        _check_type(
            "rank_filter", a["rank_filter"], (RankFilter, type(None)), "a RankFilter or None"
        )
        _check_type("completion", a["completion"], (Completion, type(None)), "a Completion or None")
        _check_type("terminate", a["terminate"], (Terminate, type(None)), "a Terminate or None")
        default_assignment = a["rank_assignment"] is DEFAULT_RANK_ASSIGNMENT
        if not default_assignment:
            _check_type("rank_assignment", a["rank_assignment"], RankAssignment, "a RankAssignment")
        # Each callback's shape says which generation of the API it is written
        # for; mixing them is an error naming the arguments.
        shaped = (*callbacks, "rank_filter", "completion", "terminate")
        a["generation"] = wrapper_generation(
            {n: a[n] for n in shaped if not (n == "rank_assignment" and default_assignment)}
        )
        if default_assignment:
            a["rank_assignment"] = (
                Compose(ActivateAllRanks(), ShiftRanks())
                if a["generation"] is Generation.NEWER
                else ShiftRanks()
            )

        for name in cls.durations():
            value = a[name]
            _check_type(name, value, datetime.timedelta, "a datetime.timedelta")
            may_be_zero = name in _MAY_BE_ZERO
            if value.total_seconds() < 0 or (not may_be_zero and value.total_seconds() == 0):
                bound = ">= 0" if may_be_zero else "> 0"
                raise ValueError(f"Wrapper({name}=...) must be {bound}, got {value}")
            if value > MAX_DURATION:
                raise ValueError(
                    f"Wrapper({name}=...) must be at most {MAX_DURATION.days} days, got {value}"
                )
        for shorter, longer in _ORDERING:
            if not a[shorter] < a[longer]:
                raise ValueError(
                    f"Wrapper({shorter}=...) must be shorter than {longer}: got "
                    f"{shorter}={a[shorter]}, {longer}={a[longer]}"
                )

        a.setdefault("monitor_process_pidfile", None)
        for name in ("monitor_process_logfile", "monitor_process_pidfile"):
            _check_path(name, a[name])
        _check_type("enabled", a["enabled"], bool, "a bool")
        a.setdefault("records", None)
        _check_type("records", a["records"], (str, os.PathLike, type(None)), "a path or None")
        if a["records"] is not None:
            a["records"] = os.path.abspath(os.fspath(a["records"]))

        _check_snapshots(a)

        for name in cls.durations():
            a[name] = a[name].total_seconds()
        return cls(**a)


def _check_snapshots(a: dict[str, Any]) -> None:
    """``snapshot_dir`` (a path, made absolute); ``persist_every`` (an int >= 1, needs it)."""
    a.setdefault("snapshot_dir", None)
    a.setdefault("persist_every", None)
    a.setdefault("snapshot_staging", None)
    _check_type("snapshot_staging", a["snapshot_staging"], (bool, type(None)), "a bool or None")
    _check_type("snapshot_dir", a["snapshot_dir"], (str, os.PathLike, type(None)), "a path or None")
    if a["snapshot_dir"] is not None:
        a["snapshot_dir"] = os.path.abspath(os.fspath(a["snapshot_dir"]))
    every = a["persist_every"]
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int):
            raise TypeError(
                f"Wrapper(persist_every=...) must be an int >= 1 or None, got {every!r}"
            )
        if every < 1:
            raise ValueError(
                f"Wrapper(persist_every=...) must be an int >= 1 or None, got {every!r}"
            )
        if a["snapshot_dir"] is None:
            raise ValueError(
                "Wrapper(persist_every=...) needs Wrapper(snapshot_dir=...): the directory "
                f"the snapshots are written to (got persist_every={every}, snapshot_dir=None)"
            )


def _check_path(name: str, path: Any) -> None:
    """An absolute path that may contain the ``{rank}`` placeholder, or None."""
    _check_type(name, path, (str, type(None)), "a str or None")
    if path is None:
        return
    if not pathlib.Path(path).is_absolute():
        raise ValueError(f"Wrapper({name}=...) must be an absolute path, got {path!r}")
    try:
        path.format(rank=0)
    except (KeyError, IndexError, ValueError) as ex:
        raise ValueError(
            f"Wrapper({name}=...) may only contain the {{rank}} placeholder, got {path!r}"
        ) from ex


def _compose_sequence(value: Any) -> Any:
    if isinstance(value, (tuple, list)) and value and all(callable(v) for v in value):
        return value[0] if len(value) == 1 else Compose(*value)
    return value


def _check_type(name: str, value: Any, types_: tuple[type, ...] | type, allowed: str) -> None:
    if not isinstance(value, types_):
        raise TypeError(f"Wrapper({name}=...) must be {allowed}, got {value!r}")


def _check_store_kwargs(factory: type, kwargs: dict[str, Any]) -> None:
    """Fails at construction what would fail only when the store is built (issue 9)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: torch checks
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        allowed = [
            n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        unknown = sorted(k for k in kwargs if k not in allowed)
        if unknown:
            raise TypeError(
                f"Wrapper(store_kwargs=...) has unknown key(s) {', '.join(map(repr, unknown))} "
                f"for {factory.__name__}; allowed: {', '.join(allowed)}"
            )
    if "port" in kwargs and kwargs["port"] is not None:
        port = kwargs["port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(
                "Wrapper(store_kwargs=...): 'port' must be an int in [0, 65535] "
                f"(0: any free port), got {port!r}"
            )
    if "timeout" in kwargs:
        timeout = kwargs["timeout"]
        if isinstance(timeout, datetime.timedelta) and not (
            datetime.timedelta(0) < timeout <= MAX_DURATION
        ):
            raise ValueError(
                "Wrapper(store_kwargs=...): 'timeout' must be a datetime.timedelta in "
                f"(0, {MAX_DURATION.days} days], got {timeout!r}"
            )
