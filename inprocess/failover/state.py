"""Durable state of the failover controller.

:class:`JobState` holds everything the controller needs to resume a job after
its own crash: stage, counters, placement, one :class:`WorkerRecord` per
worker, failures already handled, the job's result. The policy
(:mod:`inprocess.failover.policy`) computes new states; this module only
stores them.

File format: one JSON document, indented and with sorted keys so a person can
read and diff it, with ``"format": "inprocess.failover.state"`` and
``"version": 1`` at the top. Integer dict keys (workers, nodes) become strings
in JSON and are converted back on load; sets are stored as sorted lists.

Writes are atomic and durable (:func:`save_state`): the file at ``path`` is
always either the previous complete state or the new complete state.
Reading (:func:`load_state`) never changes the file. :class:`StateStore` adds
the ownership rules that keep a new job from inheriting, or overwriting, the
state of another job.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

from .spec import JobSpec, SpecError

__all__ = [
    "FORMAT",
    "MAX_EVENTS",
    "STATE_FILENAME",
    "VERSION",
    "FailureKey",
    "JobState",
    "Stage",
    "StateError",
    "StateExistsError",
    "StateFileError",
    "StateStore",
    "WorkerRecord",
    "WorkerStatus",
    "dumps_state",
    "failure_key",
    "load_state",
    "loads_state",
    "save_state",
]

logger = logging.getLogger(__name__)

FORMAT = "inprocess.failover.state"
VERSION = 1
STATE_FILENAME = "state.json"
#: number of recent events kept in :attr:`JobState.events`
MAX_EVENTS = 200
#: a worker's exit code when its GPU faulted and it left the job
#: (``inprocess.device_fault.EXIT_CODE``; this layer does not import the Wrapper's)
GPU_FAULT_EXIT_CODE = 75


class Stage(str, enum.Enum):
    """Stage of the job, as seen by the controller.

    ``INIT -> READY -> RUNNING -> STOPPING -> STOPPED``; a job-level (cold)
    restart goes ``RUNNING -> READY -> RUNNING``; a stop may begin in any stage
    before ``STOPPING``.
    """

    #: state created, no worker started yet
    INIT = "INIT"
    #: workers of the current generation are being (re)started
    READY = "READY"
    #: every worker of the current generation was started; failures are handled
    RUNNING = "RUNNING"
    #: the job is being stopped; ``exit_code`` and ``reason`` are recorded
    STOPPING = "STOPPING"
    #: every worker is stopped; the job is over
    STOPPED = "STOPPED"


class WorkerStatus(str, enum.Enum):
    """What the controller knows about a worker's current incarnation."""

    #: no process: never started, or stopped on purpose and waiting to start again
    PENDING = "pending"
    #: a process was started and has not been seen to end
    RUNNING = "running"
    #: the controller is stopping the process on purpose (its exit is not a failure)
    STOPPING = "stopping"
    #: the process exited with code 0
    SUCCEEDED = "succeeded"
    #: the incarnation failed (exit or self-report); a relaunch may be pending
    FAILED = "failed"
    #: the incarnation left the job on purpose (its Wrapper ended with ``RestartAbort``):
    #: the job's own restart policy gave up on it, so it is never relaunched
    ABORTED = "aborted"


class StateError(Exception):
    """Base class of the errors of this module."""


class StateFileError(StateError):
    """A state file cannot be used: unparsable, wrong format or version, bad fields."""


class StateExistsError(StateError):
    """A new job was created in a state directory that already holds a state."""


class FailureKey(NamedTuple):
    """Identity of one failure: the incarnation of a worker that failed.

    Stored in :attr:`JobState.handled_failures` (and the state file) as the text
    ``"worker:incarnation"``; :meth:`encode` and :meth:`parse` are its one codec.
    """

    worker: int
    incarnation: int

    def encode(self) -> str:
        return f"{self.worker}:{self.incarnation}"

    @classmethod
    def parse(cls, text: str) -> FailureKey:
        """The key ``text`` encodes; ``ValueError`` unless it is ``"<int>:<int>"`` (digits)."""
        parts = text.split(":")
        if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
            raise ValueError(f"a failure key looks like 'worker:incarnation', got {text!r}")
        return cls(int(parts[0]), int(parts[1]))


def failure_key(worker: int, incarnation: int) -> str:
    """The stored form of :class:`FailureKey` ``(worker, incarnation)``."""
    return FailureKey(worker, incarnation).encode()


@dataclasses.dataclass
class WorkerRecord:
    """One worker and its current (latest) incarnation.

    Attributes:
        node: node the worker belongs to (fixed: ``worker // nproc_per_node``).
        slot: slot its latest process was started on (its node's slot before
            the first start).
        incarnation: number of the latest start, ``0, 1, ...``; ``-1`` before
            the first start.
        pid: process id of the latest incarnation, if started.
        pid_start_time: start time of that process as the backend measures it,
            used to tell a live worker from an unrelated process that reused the pid.
        status: see :class:`WorkerStatus`.
        exit_code: exit code of the latest incarnation once it ended, if known.
        signal: signal that ended it, if known.
        generation: job generation the latest incarnation was started in.
        started_at: when the latest incarnation was started (the policy's ``now``).
        join_timeout: seconds it has to join the Wrapper job from ``started_at``
            before it is replaced (``None`` or 0: no deadline); set when it was
            started, shorter for a warm standby than for a fresh spawn.
        joined: whether the latest incarnation was seen in the Wrapper job (at its
            initial barrier, asking to join, or as a member).
        join_misses: incarnations in a row, up to the latest, replaced because
            they never joined (0 once one joins).
    """

    node: int
    slot: int
    incarnation: int = -1
    pid: int | None = None
    pid_start_time: float | None = None
    status: WorkerStatus = WorkerStatus.PENDING
    exit_code: int | None = None
    signal: int | None = None
    generation: int = 0
    started_at: float | None = None
    join_timeout: float | None = None
    joined: bool = False
    join_misses: int = 0


@dataclasses.dataclass
class JobState:
    """Everything the controller must remember about one job.

    Build the first one with :func:`inprocess.failover.policy.new_job_state`
    and derive the others with the policy functions, which never modify the
    state they are given. Dict keys that are workers or nodes are ``int``.

    Attributes:
        job_id: the job's id (same as ``spec.job_id``).
        spec: the job spec (stored as a dict in the file).
        stage: see :class:`Stage`.
        generation: number of job starts so far minus one; a cold restart adds one.
        job_restarts: cold restarts of the whole job so far.
        node_relaunches: node relaunches so far.
        node_slots: node -> slot it runs on now.
        removed_slots: slots given up by relaunched nodes, in order; reused only once a
            machine is on one again (``policy.SlotBack``).
        node_failures: node -> failures since the node was (re)launched.
        worker_restarts: worker -> failures of that worker (each one a restart).
        workers: worker -> :class:`WorkerRecord`.
        handled_failures: :func:`failure_key` of every failure already counted.
        relaunching_nodes: nodes whose relaunch is decided but not finished.
        wrapper_managed: whether the role runs under the in-process Wrapper
            (``None``: not known yet; treated as not managed).
        store: rendezvous store details (host, port, pid, namespace); opaque here.
        exit_code: exit code of the job once a stop is decided.
        reason: why the job stops (or stopped).
        events: recent events, oldest first, at most :data:`MAX_EVENTS`, each
            ``{"time": float | None, "kind": str, "message": str}``.
        updated_at: time of the last change, as passed to the policy.
    """

    job_id: str
    spec: JobSpec
    stage: Stage = Stage.INIT
    generation: int = 0
    job_restarts: int = 0
    node_relaunches: int = 0
    node_slots: dict[int, int] = dataclasses.field(default_factory=dict)
    removed_slots: list[int] = dataclasses.field(default_factory=list)
    node_failures: dict[int, int] = dataclasses.field(default_factory=dict)
    worker_restarts: dict[int, int] = dataclasses.field(default_factory=dict)
    workers: dict[int, WorkerRecord] = dataclasses.field(default_factory=dict)
    handled_failures: set[str] = dataclasses.field(default_factory=set)
    relaunching_nodes: set[int] = dataclasses.field(default_factory=set)
    wrapper_managed: bool | None = None
    store: dict[str, Any] = dataclasses.field(default_factory=dict)
    exit_code: int | None = None
    reason: str | None = None
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    updated_at: float | None = None

    def copy(self) -> JobState:
        """Independent deep copy (the spec, being frozen, is shared)."""
        return copy.deepcopy(self, memo={id(self.spec): self.spec})

    def log_event(self, kind: str, message: str, now: float | None) -> None:
        """Append an event (in place) and keep only the last :data:`MAX_EVENTS`."""
        time = None if now is None else float(now)
        self.events.append({"time": time, "kind": kind, "message": message})
        if len(self.events) > MAX_EVENTS:
            del self.events[: len(self.events) - MAX_EVENTS]

    # -- JSON-friendly form ------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict, including the ``format`` and ``version`` header."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "job_id": self.job_id,
            "spec": self.spec.to_dict(),
            "stage": self.stage.value,
            "generation": self.generation,
            "job_restarts": self.job_restarts,
            "node_relaunches": self.node_relaunches,
            "node_slots": {str(k): v for k, v in self.node_slots.items()},
            "removed_slots": list(self.removed_slots),
            "node_failures": {str(k): v for k, v in self.node_failures.items()},
            "worker_restarts": {str(k): v for k, v in self.worker_restarts.items()},
            "workers": {str(k): _record_to_dict(r) for k, r in self.workers.items()},
            "handled_failures": sorted(self.handled_failures, key=_failure_sort_key),
            "relaunching_nodes": sorted(self.relaunching_nodes),
            "wrapper_managed": self.wrapper_managed,
            "store": copy.deepcopy(self.store),
            "exit_code": self.exit_code,
            "reason": self.reason,
            "events": copy.deepcopy(self.events),
            "updated_at": self.updated_at,
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<state>") -> JobState:
        """Inverse of :meth:`to_dict`; raises :class:`StateFileError` naming ``source``."""
        return _Reader(source).job_state(data)


def _record_to_dict(record: WorkerRecord) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    data["status"] = record.status.value
    return data


def _failure_sort_key(key: str) -> tuple[int, int] | tuple[int, str]:
    try:
        return FailureKey.parse(key)
    except ValueError:
        return (-1, key)


# -- validation on load -----------------------------------------------------

_MISSING = object()


class _Reader:
    """Converts parsed JSON back to a :class:`JobState`, checking every field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, problem: str) -> StateFileError:
        return StateFileError(f"state file {self.source}: {problem}")

    def field(self, data: dict[str, Any], name: str, where: str = "") -> Any:
        value = data.get(name, _MISSING)
        if value is _MISSING:
            raise self.fail(f"missing field {where}{name}")
        return value

    def int_(self, value: Any, what: str, minimum: int | None = None, nullable=False) -> Any:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"field {what} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(f"field {what} must be >= {minimum}, got {value}")
        return value

    def float_(self, value: Any, what: str, nullable=False) -> float | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"field {what} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise self.fail(f"field {what} must be finite, got {value!r}")
        return float(value)

    def bool_(self, value: Any, what: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(f"field {what} must be true or false, got {value!r}")
        return value

    def str_(self, value: Any, what: str, nullable=False) -> str | None:
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            raise self.fail(f"field {what} must be a string, got {value!r}")
        return value

    def dict_(self, value: Any, what: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"field {what} must be a JSON object, got {type(value).__name__}")
        return value

    def list_(self, value: Any, what: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(f"field {what} must be a JSON list, got {type(value).__name__}")
        return value

    def key(self, key: str, what: str) -> int:
        # only canonical decimal keys: "01" or " 1" would not round-trip
        if not (key.isascii() and key.isdigit() and str(int(key)) == key):
            raise self.fail(f"field {what} has key {key!r}, expected a non-negative integer")
        return int(key)

    def int_map(self, value: Any, what: str, convert: Callable[[Any, str], Any]) -> dict[int, Any]:
        return {
            self.key(k, what): convert(v, f"{what}.{k}") for k, v in self.dict_(value, what).items()
        }

    def enum_(self, cls: type[enum.Enum], value: Any, what: str) -> Any:
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise self.fail(f"field {what} must be one of {allowed}, got {value!r}") from None

    def record(self, value: Any, what: str) -> WorkerRecord:
        data = self.dict_(value, what)
        names = [f.name for f in dataclasses.fields(WorkerRecord)]
        unknown = sorted(k for k in data if k not in names)
        if unknown:
            raise self.fail(f"field {what} has unknown key(s) {', '.join(unknown)}")

        def get(name: str) -> Any:
            return self.field(data, name, f"{what}.")

        return WorkerRecord(
            node=self.int_(get("node"), f"{what}.node", 0),
            slot=self.int_(get("slot"), f"{what}.slot", 0),
            incarnation=self.int_(get("incarnation"), f"{what}.incarnation", -1),
            pid=self.int_(get("pid"), f"{what}.pid", 1, nullable=True),
            pid_start_time=self.float_(
                get("pid_start_time"), f"{what}.pid_start_time", nullable=True
            ),
            status=self.enum_(WorkerStatus, get("status"), f"{what}.status"),
            exit_code=self.int_(get("exit_code"), f"{what}.exit_code", nullable=True),
            signal=self.int_(get("signal"), f"{what}.signal", 1, nullable=True),
            generation=self.int_(get("generation"), f"{what}.generation", 0),
            started_at=self.float_(get("started_at"), f"{what}.started_at", nullable=True),
            join_timeout=self.float_(get("join_timeout"), f"{what}.join_timeout", nullable=True),
            joined=self.bool_(get("joined"), f"{what}.joined"),
            join_misses=self.int_(get("join_misses"), f"{what}.join_misses", 0),
        )

    def event(self, value: Any, what: str) -> dict[str, Any]:
        data = self.dict_(value, what)
        unknown = sorted(k for k in data if k not in ("time", "kind", "message"))
        if unknown:
            raise self.fail(f"field {what} has unknown key(s) {', '.join(unknown)}")
        return {
            "time": self.float_(self.field(data, "time", f"{what}."), f"{what}.time", True),
            "kind": self.str_(self.field(data, "kind", f"{what}."), f"{what}.kind"),
            "message": self.str_(self.field(data, "message", f"{what}."), f"{what}.message"),
        }

    def job_state(self, data: Any) -> JobState:
        if not isinstance(data, dict):
            raise self.fail(f"top level must be a JSON object, got {type(data).__name__}")
        fmt = data.get("format", _MISSING)
        if fmt != FORMAT:
            shown = "missing" if fmt is _MISSING else repr(fmt)
            raise self.fail(f"'format' is {shown}, expected {FORMAT!r}; not a state file")
        version = data.get("version", _MISSING)
        if type(version) is not int or version != VERSION:
            shown = "missing" if version is _MISSING else repr(version)
            newer = type(version) is int and version > VERSION
            hint = " (written by a newer version of inprocess?)" if newer else ""
            raise self.fail(
                f"'version' is {shown}; this program reads version {VERSION} only{hint}"
            )
        names = [f.name for f in dataclasses.fields(JobState)]
        unknown = sorted(k for k in data if k not in (*names, "format", "version"))
        if unknown:
            raise self.fail(f"unknown field(s) {', '.join(unknown)}")

        def get(name: str) -> Any:
            return self.field(data, name)

        try:
            spec = JobSpec.from_dict(self.dict_(get("spec"), "spec"))
        except SpecError as ex:
            raise self.fail(f"field spec is invalid: {ex}") from None
        job_id = self.str_(get("job_id"), "job_id")
        if job_id != spec.job_id:
            raise self.fail(f"field job_id {job_id!r} differs from spec.job_id {spec.job_id!r}")

        def nonneg(v: Any, what: str) -> int:
            return self.int_(v, what, 0)

        handled = self.list_(get("handled_failures"), "handled_failures")
        for i, key in enumerate(handled):
            try:
                FailureKey.parse(self.str_(key, f"handled_failures[{i}]"))
            except ValueError:
                raise self.fail(
                    f"field handled_failures[{i}] must look like 'worker:incarnation', got {key!r}"
                ) from None
        wrapper_managed = get("wrapper_managed")
        if wrapper_managed is not None and not isinstance(wrapper_managed, bool):
            raise self.fail(
                f"field wrapper_managed must be true, false or null, got {wrapper_managed!r}"
            )

        return JobState(
            job_id=job_id,
            spec=spec,
            stage=self.enum_(Stage, get("stage"), "stage"),
            generation=nonneg(get("generation"), "generation"),
            job_restarts=nonneg(get("job_restarts"), "job_restarts"),
            node_relaunches=nonneg(get("node_relaunches"), "node_relaunches"),
            node_slots=self.int_map(get("node_slots"), "node_slots", nonneg),
            removed_slots=[
                nonneg(v, f"removed_slots[{i}]")
                for i, v in enumerate(self.list_(get("removed_slots"), "removed_slots"))
            ],
            node_failures=self.int_map(get("node_failures"), "node_failures", nonneg),
            worker_restarts=self.int_map(get("worker_restarts"), "worker_restarts", nonneg),
            workers=self.int_map(get("workers"), "workers", self.record),
            handled_failures=set(handled),
            relaunching_nodes={
                nonneg(v, f"relaunching_nodes[{i}]")
                for i, v in enumerate(self.list_(get("relaunching_nodes"), "relaunching_nodes"))
            },
            wrapper_managed=wrapper_managed,
            store=copy.deepcopy(self.dict_(get("store"), "store")),
            exit_code=self.int_(get("exit_code"), "exit_code", nullable=True),
            reason=self.str_(get("reason"), "reason", nullable=True),
            events=[
                self.event(v, f"events[{i}]")
                for i, v in enumerate(self.list_(get("events"), "events"))
            ],
            updated_at=self.float_(get("updated_at"), "updated_at", nullable=True),
        )


# -- text and files ---------------------------------------------------------


def dumps_state(state: JobState) -> str:
    """The state as the text of a state file (indented JSON, sorted keys, final newline)."""
    return json.dumps(state.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"


def loads_state(text: str | bytes, source: str = "<string>") -> JobState:
    """Parse the text of a state file; :class:`StateFileError` names ``source``."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as ex:
            raise StateFileError(f"state file {source}: not UTF-8 text ({ex})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as ex:
        raise StateFileError(f"state file {source}: not valid JSON ({ex})") from None
    return JobState.from_dict(data, source)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _write_temp(directory: str, name: str, text: str) -> str:
    """Write ``text`` to a new, fsynced temp file in ``directory``; return its path."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def save_state(path: str | os.PathLike[str], state: JobState) -> None:
    """Write ``state`` to ``path`` atomically and durably.

    Writes a temp file in the same directory, fsyncs it, renames it onto
    ``path`` with :func:`os.replace` and fsyncs the directory. A crash at any
    point leaves ``path`` holding either the old or the new complete state (at
    worst a stray ``.state.json.*.tmp`` file, which loading ignores). The file
    is created with mode 0600.
    """
    path = os.fspath(path)
    text = dumps_state(state)  # serialize first: a bad state never touches the disk
    directory = os.path.dirname(os.path.abspath(path))
    tmp = _write_temp(directory, os.path.basename(path), text)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _create_state(path: str, state: JobState) -> None:
    """Like :func:`save_state`, but fail with FileExistsError if ``path`` exists.

    Uses :func:`os.link` of the temp file, which is atomic and never replaces an
    existing file; falls back to check-then-rename where hard links are
    unsupported.
    """
    text = dumps_state(state)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = _write_temp(directory, os.path.basename(path), text)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:
            if os.path.lexists(path):
                raise FileExistsError(path) from None
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _fsync_dir(directory)


def load_state(path: str | os.PathLike[str]) -> JobState:
    """Read a state file; never modifies it.

    Raises:
        FileNotFoundError: no file at ``path``.
        StateFileError: the file is not valid UTF-8 JSON, has the wrong
            ``format`` or an unknown ``version``, or a field is missing or ill-typed.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        text = f.read()
    return loads_state(text, source=path)


class StateStore:
    """The state file of one job in a state directory: ``<state_dir>/state.json``.

    Ownership rule: :meth:`save` writes only after this object has either
    created the file (:meth:`create`) or loaded it successfully (:meth:`load`),
    and only a state with the same ``job_id``. Hence:

    * a new job never inherits an old job's state: :meth:`create` refuses when a
      state file exists, loadable or not;
    * a file that cannot be loaded (corrupt, foreign, unknown version) is never
      overwritten: nobody can own it; a person must look at it and move it away;
    * the same job saving over its own file is the normal path, and is allowed
      even if the file was damaged after it was loaded (the controller's
      in-memory state is the authority then).

    One controller per state directory is assumed; this class does not lock.
    """

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = os.fspath(state_dir)
        self.path = os.path.join(self.state_dir, STATE_FILENAME)
        self._owner: str | None = None

    def __repr__(self) -> str:
        return f"StateStore({self.state_dir!r}, owner={self._owner!r})"

    @property
    def owner(self) -> str | None:
        """Job id this store may save for, once created or loaded; else None."""
        return self._owner

    def exists(self) -> bool:
        """Whether a state file (valid or not) is present."""
        return os.path.lexists(self.path)

    def load(self) -> JobState:
        """Load the state (see :func:`load_state`) and take ownership of the file."""
        state = load_state(self.path)
        self._owner = state.job_id
        return state

    def create(self, state: JobState) -> None:
        """Save the first state of a NEW job; refuse if the directory holds a state.

        Creates the state directory if needed.

        Raises:
            StateExistsError: a loadable state file exists (names its job and stage).
            StateFileError: a state file exists and cannot be loaded.
        """
        os.makedirs(self.state_dir, exist_ok=True)
        try:
            _create_state(self.path, state)
        except FileExistsError:
            raise self._exists_error(state.job_id) from None
        self._owner = state.job_id
        logger.info("created state of job %s in %s", state.job_id, self.path)

    def save(self, state: JobState) -> None:
        """Save a new state of the owned job atomically (see :func:`save_state`).

        Raises:
            StateError: neither :meth:`create` nor :meth:`load` succeeded on this
                store, or ``state`` belongs to another job.
        """
        if self._owner is None:
            raise StateError(
                f"refusing to write {self.path}: this StateStore neither created nor "
                "loaded it; call create() for a new job or load() to resume one"
            )
        if state.job_id != self._owner:
            raise StateError(
                f"refusing to write the state of job {state.job_id!r} to {self.path}, "
                f"which belongs to job {self._owner!r}"
            )
        save_state(self.path, state)

    def _exists_error(self, new_job_id: str) -> StateError:
        try:
            old = load_state(self.path)
        except StateFileError as ex:
            return StateFileError(
                f"cannot create job {new_job_id!r}: {self.path} already exists and cannot "
                f"be loaded ({ex}); it is left untouched: move it away or choose another "
                "state dir"
            )
        except OSError as ex:
            return StateFileError(
                f"cannot create job {new_job_id!r}: {self.path} already exists and cannot "
                f"be read ({ex}); choose another state dir"
            )
        return StateExistsError(
            f"cannot create job {new_job_id!r}: state dir {self.state_dir} belongs to job "
            f"{old.job_id!r} in stage {old.stage.value}; choose another state dir "
            "(or resume that job)"
        )
