"""``Wrapper`` and ``CallWrapper``: the in-process restart loop.

The loop of one call, as in the seed::

    store = store_factory(**store_kwargs)
    initial_barrier()
    while True:
        rank_assignment(); rank_filter(); iteration_barrier()
        try:
            initialize(); health_check()
            fn() if active else wait_as_spare()
            completion_barrier()
        except:
            abort(); finalize(); health_check(); termination_barrier()
        else:
            return

The distributed protocol lives in :mod:`inprocess.protocol` (its keys and its
decisions, as pure functions) and :mod:`inprocess.store` (barriers and
rendezvous over the store); interrupting the function lives in
:mod:`inprocess.monitor_thread`; the hard timeout and dead-rank detection live in
:mod:`inprocess.monitor_process`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import itertools
import logging
import os
import re
import sys
import threading
import time
import types
import typing
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed

from . import device_fault, protocol
from . import generation as _gen
from . import monitor_thread as _mt
from . import node as _node
from . import records as _records
from . import security as _security
from .abort import Abort, AbortTorchDistributed
from .abort.rendezvous import (
    complete_stranded_gloo_init,
    fresh_env_rendezvous,
    release_held_servers,
)
from .completion import Completion
from .compose import Compose
from .config import DEFAULT_RANK_ASSIGNMENT, WrapperConfig
from .exception import HealthCheckError, InternalError, RestartAbort, StoreError
from .exception import TimeoutError as RestartTimeoutError
from .finalize import Finalize
from .health_check import HealthCheck
from .health_check.base import env_local_rank
from .health_check.restart import (
    ChainedGPUHealthCheck,
    ChainedNicHealthCheck,
    ChainedNVLHealthCheck,
)
from .initialize import Initialize
from .monitor_process import WATCHED_PEERS, MonitorConfig, MonitorProcess
from .monitor_thread import InterruptSignal, MonitorThread, RankShouldRestart
from .progress_watchdog import Doorbell, ProgressBoard, ProgressWatchdog
from .rank_assignment import RankAssignment, RankDiscarded
from .rank_filter import RankFilter
from .relay import RelayClient
from .state import Mode, State
from .store import (
    WAIT_CHUNK,
    WAIT_CHUNK_MAX,
    BarrierRefused,
    ClientSpec,
    Poller,
    PrefixStore,
    StoreMixin,
    TCPStore,
    WakeWait,
    incarnation_from_env,
    initial_rank_of,
    job_namespace,
    new_identity,
    waits_in_server,
)
from .terminate import Terminate

if TYPE_CHECKING:
    from .snapshot import Snapshots

log = logging.getLogger(__name__)

_UNSET: Any = object()
_call_counter = itertools.count()

#: set on a store server that a rank hosts (never on a launcher's): such a
#: server lives for one call only, see CallWrapper._open_store
_RANK_HOSTED_KEY = protocol.RANK_HOSTED


# The poll interval of barriers inside the restart procedure: short waits that
# everybody is blocked on, so they poll fast, backing off up to this (or up to
# monitor_thread_interval when that is shorter).
_RESTART_POLL_LIMIT = 0.02
#: longest a host that left by RestartAbort keeps the store up for its peers' own
_ABORT_WAIT = 10.0


def _returned_state(result: Any, current: State) -> State:
    """The state a callback returned: a State, or the first item of a tuple; else ``current``."""
    if isinstance(result, State):
        return result
    if isinstance(result, tuple) and result and isinstance(result[0], State):
        return result[0]
    return current


def _logging_is_off() -> bool:
    """Whether records of our loggers reach no handler (``logging.lastResort`` would get them)."""
    logger: logging.Logger | None = logging.getLogger("inprocess")
    while logger is not None:
        if logger.handlers:
            return False
        logger = logger.parent if logger.propagate else None
    return True


def _warn_if_logging_is_off() -> None:
    if _logging_is_off():
        warnings.warn(
            "inprocess: the application configured no logging, so the library's logs (faults, "
            "restarts, lost ranks) are off; only its warnings reach stderr, unformatted, "
            "through logging.lastResort. Turn them on with logging.basicConfig(level="
            "logging.INFO) or a handler on the 'inprocess' logger",
            UserWarning,
            stacklevel=4,
        )


class Wrapper:
    """Restarts the wrapped function in-process on every healthy rank after a fault.

    Use as a decorator: ``@inprocess.Wrapper(...)`` on ``train()``. When any
    rank raises, hangs or dies, every healthy rank aborts the distributed
    backend, runs ``finalize`` and ``health_check``, reassigns ranks (dropping
    lost ranks, activating spares) and calls ``train()`` again, in the same
    process. Returns the function's return value on active ranks and ``None``
    on inactive (spare) ranks.

    The wrapped function must initialize ``torch.distributed`` itself on every
    call (reading ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and
    let ``BaseException`` propagate. See the README for the full contract.

    Args:
        store_factory: class (a :class:`inprocess.store.StoreMixin`) of the internal store.
        store_kwargs: keyword arguments of ``store_factory``.
        initialize: runs at the start of every iteration (e.g. ``RetryController``).
        abort: stops what the function is blocked in; default ``AbortTorchDistributed()``.
        finalize: rank-local cleanup after a fault.
        health_check: rank-local check after a fault; raising excludes the rank.
        rank_assignment: computes the next ranks; default ``ShiftRanks()``.
        rank_filter: selects the active ranks; the others are spares.
        monitor_thread_interval: how often the monitor thread looks for faults
            (on the board its monitor process writes: the store itself only
            while no monitor process watches it) and re-sends an unacknowledged
            restart exception; a fault the monitor process hears of wakes it
            at once.
        monitor_process_interval: how often the monitor process checks its rank.
        progress_watchdog_interval: how often automatic heartbeats are issued.
        soft_timeout: no progress for this long restarts the job in-process.
        hard_timeout: no progress in the function for this long, counted across
            restarts (a hang that recurs after every restart), terminates the
            rank's process with SIGTERM; waiting for peers in the restart
            procedure does not count.
        heartbeat_timeout: the ranks of a node whose heartbeats stop for this long
            are terminated (one heartbeat per node, see :mod:`inprocess.node`).
        heartbeat_interval: how often a node's heartbeat is sent and the nodes of
            its ranks' peers are checked (default: a quarter of
            ``heartbeat_timeout``, at least ``monitor_process_interval``).
        barrier_timeout: timeout of the restart procedure's barriers.
        completion_timeout: how long finished ranks wait for the others.
        last_call_wait: collects concurrent faults before interrupting (a join
            request among them ends it at once: the joiner is admitted then).
        termination_grace_time: time between SIGTERM and SIGKILL on a hard timeout.
        monitor_process_logfile: absolute path of the monitor process's log file,
            may contain ``{rank}`` (the initial rank).
        enabled: ``False`` returns the function untouched.
        monitor_process_pidfile: absolute path of a file the monitor process's
            pid is written to (decimal) when it starts, may contain ``{rank}``;
            the file is left in place after the call returns.
        completion: runs on every rank still in the job once the call completed.
        terminate: runs on a rank whose call ends with an exception.
        records: file that restart records are appended to as JSON lines
            (:mod:`inprocess.records`); ``None``: the file named by the
            ``INPROCESS_RECORDS`` environment variable, if set, else none.
        snapshot_dir: directory that :meth:`CallWrapper.commit` persists snapshots
            to and :meth:`CallWrapper.restore` falls back to (a cold restart);
            it must be this user's and not writable by group or others
            (created with mode 0700 when missing), else it is refused.
        persist_every: persist the snapshots of steps that are multiples of
            this (asynchronously); needs ``snapshot_dir``; ``None``: never.
        snapshot_staging: whether :meth:`CallWrapper.commit` copies CUDA state
            to a staging buffer on the device first, so that training waits
            only for that device copy, not for the copy to host memory
            (``None``: where the device has room for it; ``False``: the
            optimizer step waits for the host copy instead).
        unwind_timeout: once a restart has begun (the restart exception sent,
            the abort run), a rank whose main thread has not come back to the
            Wrapper for this long while idle in the kernel
            (stuck in native code that ignored the abort; never inside
            ``atomic()``) is ended by its monitor process and recorded as lost.

    Callbacks may be written for the usage guide's generation of the API or
    for the newer one (``(frozen_state)``, ``(ctx)``, ``completion``,
    ``terminate``); which one each expects is read from the callback itself
    (:mod:`inprocess.generation`), and mixing them is an error. Without a
    ``rank_assignment``, the default is the generation's: ``ShiftRanks()``, or
    ``Compose(ActivateAllRanks(), ShiftRanks())``.
    """

    def __init__(
        self,
        *,
        store_factory: type[StoreMixin] = TCPStore,
        store_kwargs: dict[str, Any] | None = None,
        initialize: Initialize | None = None,
        abort: Abort | None = _UNSET,
        finalize: Finalize | None = None,
        health_check: HealthCheck | None = None,
        rank_assignment: RankAssignment = DEFAULT_RANK_ASSIGNMENT,
        rank_filter: RankFilter | None = None,
        monitor_thread_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        monitor_process_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        progress_watchdog_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        soft_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        hard_timeout: datetime.timedelta = datetime.timedelta(seconds=90),
        heartbeat_timeout: datetime.timedelta = datetime.timedelta(seconds=30),
        heartbeat_interval: datetime.timedelta | None = None,
        barrier_timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        completion_timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        last_call_wait: datetime.timedelta = datetime.timedelta(seconds=1),
        termination_grace_time: datetime.timedelta = datetime.timedelta(seconds=5),
        unwind_timeout: datetime.timedelta = datetime.timedelta(seconds=2),
        monitor_process_logfile: str | None = None,
        enabled: bool = True,
        monitor_process_pidfile: str | None = None,
        completion: Completion | None = None,
        terminate: Terminate | None = None,
        records: str | os.PathLike[str] | None = None,
        snapshot_dir: str | os.PathLike[str] | None = None,
        persist_every: int | None = None,
        snapshot_staging: bool | None = None,
    ) -> None:
        if abort is _UNSET:
            abort = AbortTorchDistributed()
        # Every argument by name: the config's fields are their one list, and
        # it checks them all, once.
        arguments = dict(locals())
        del arguments["self"]
        self.config = WrapperConfig.from_arguments(**arguments)
        #: the check after a fault: GPU, NVLink and NIC checks of the rank's device
        #: (``LOCAL_RANK``), then the user's ``health_check``; None without LOCAL_RANK
        self.restart_health_check = (
            _restart_health_check(self.config.health_check) if self.config.enabled else None
        )

    def __getattr__(self, name: str) -> Any:
        """The settings as attributes: ``wrapper.soft_timeout`` is a ``datetime.timedelta``
        as given, ``wrapper.rank_assignment`` the (composed) callback, and so on."""
        if name == "config":  # not set yet: __init__ failed
            raise AttributeError(name)
        value = getattr(self.config, name)
        return _td(value) if name in WrapperConfig.durations() else value

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self.config.enabled:
            return fn
        if not callable(fn):
            raise TypeError(f"Wrapper can only wrap a callable, got {fn!r}")
        injected = call_wrapper_parameters(fn)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            call = CallWrapper(self)
            for name in injected:
                kwargs[name] = call
            return call(fn, args, kwargs)

        return wrapped


def _restart_health_check(user: Any) -> Compose | None:
    """``Compose(user..., nic, nvl, gpu)``: runs GPU, NVLink, NIC, then the user's check.

    The chained classes are looked up in this module when a Wrapper is built
    (a caller may replace them here), and each is built as ``cls(device_index=...)``.
    The NIC check is always in the chain; where the node has no InfiniBand
    counters it passes and says so.
    """
    local_rank = env_local_rank()
    if local_rank is None:
        return None
    checks: list[Any] = []
    if user is not None:
        checks += user.instances if isinstance(user, Compose) else [user]
    # Compose runs the last listed first: GPU, NVLink, NIC, then the user's.
    checks.append(ChainedNicHealthCheck(device_index=local_rank))
    checks.append(ChainedNVLHealthCheck(device_index=local_rank))
    checks.append(ChainedGPUHealthCheck(device_index=local_rank))
    return Compose(*checks)


class _HangProtectionOff:
    """What ``disable_hang_protection()`` returns: leaving it as a block turns it on again."""

    def __init__(self, call: CallWrapper) -> None:
        self._call = call

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._call.enable_hang_protection()


# --------------------------------------------------------------------------- CallWrapper injection

_ANNOTATION_PATTERNS = [
    re.compile(r"^(?:[\w.]+\.)?CallWrapper$"),
    re.compile(r"^(?:typing\.)?Optional\[(?:[\w.]+\.)?CallWrapper\]$"),
    re.compile(r"^(?:[\w.]+\.)?CallWrapper\|None$"),
    re.compile(r"^None\|(?:[\w.]+\.)?CallWrapper$"),
    re.compile(r"^(?:typing\.)?Union\[(?:[\w.]+\.)?CallWrapper,None\]$"),
    re.compile(r"^(?:typing\.)?Union\[None,(?:[\w.]+\.)?CallWrapper\]$"),
]


def _is_call_wrapper_annotation(annotation: Any) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):
        text = annotation.replace(" ", "").strip("'\"")
        return any(p.match(text) for p in _ANNOTATION_PATTERNS)
    if annotation is CallWrapper:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        args = set(typing.get_args(annotation))
        return args == {CallWrapper, type(None)}
    return False


def _resolve(annotation: Any, fn: Callable[..., Any]) -> Any:
    """Evaluates a string annotation in ``fn``'s globals; the string itself if that fails."""
    if not isinstance(annotation, str):
        return annotation
    namespace = dict(getattr(inspect.unwrap(fn), "__globals__", {}))
    namespace.setdefault("CallWrapper", CallWrapper)
    namespace.setdefault("typing", typing)
    namespace.setdefault("Optional", typing.Optional)
    namespace.setdefault("Union", typing.Union)
    try:
        return eval(annotation, namespace)  # what typing.get_type_hints does, per parameter
    except Exception:
        return annotation


def call_wrapper_parameters(fn: Callable[..., Any]) -> list[str]:
    """Names of ``fn``'s parameters that receive the :class:`CallWrapper`."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [
        name
        for name, param in signature.parameters.items()
        if param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        and _is_call_wrapper_annotation(_resolve(param.annotation, fn))
    ]


# --------------------------------------------------------------------------- the call


@dataclasses.dataclass
class _Iteration:
    """What every rank agreed on at an iteration barrier."""

    index: int
    members: protocol.Roster  # identities, in rank order
    baseline: int  # fault count when the iteration was decided


class CallWrapper:
    """One call of a wrapped function: its restart loop, state and controls.

    Passed to the wrapped function through any parameter annotated
    ``CallWrapper`` (or ``Optional[CallWrapper]``, ``CallWrapper | None``).
    """

    def __init__(self, wrapper: Wrapper) -> None:
        self.wrapper = wrapper
        self._config = wrapper.config
        #: every State that may hold this call's store (weakly), see _release_store
        self._states: dict[int, weakref.ref[State]] = {}
        self.state = State()
        self.identity = new_identity(self.state.initial_rank, incarnation_from_env())
        #: whether the job had started without this process (set by _start)
        self._late = False
        self._lock = threading.RLock()
        # Set up by _start (the call's resources, released by its cleanup):
        self.namespace = ""
        self.store: PrefixStore | None = None
        self._board: ProgressBoard | None = None
        #: the node's arrival relay (inprocess.relay); None: arrivals go to the store
        self._relay: RelayClient | None = None
        self._monitor_process: MonitorProcess | None = None
        self._watchdog: ProgressWatchdog | None = None
        self._interrupt: InterruptSignal | None = None
        self._monitor: MonitorThread | None = None
        # polls of the barriers inside the restart procedure
        self._restart_poll = min(_RESTART_POLL_LIMIT, self._config.monitor_thread_interval)
        # Set as the call goes: the root cause of the latest restart (termination
        # barrier), and the iteration the call completed in (_finish).
        self._restart_cause: protocol.RootCause | None = None
        self._finished_iteration: _Iteration | None = None
        #: the iteration this rank left by RestartAbort (its peers abort there too)
        self._aborted_iteration: _Iteration | None = None
        self._records = _records.Recorder(None, self.identity, "", 0)  # disabled until _start
        #: sys.excepthook when the call started (see _function_environment)
        self._excepthook = sys.excepthook
        #: this call's training-state snapshots (restore/commit), set up by _start
        self._snapshots: Snapshots | None = None
        #: the latest restore's record (see :meth:`restore`), ``None`` before one
        self.last_restore: dict[str, Any] | None = None

    # ---------------------------------------------------------------- public controls

    @property
    def state(self) -> State:
        """This rank's :class:`State` in the current iteration."""
        return self._state

    @state.setter
    def state(self, value: State) -> None:
        self._state = self._track(value)

    def _track(self, state: State) -> State:
        """Remembers a State that may hold the call's store, so releasing can clear it."""
        known = self._states.get(id(state))
        if known is None or known() is not state:
            if len(self._states) >= 64:
                self._states = {k: r for k, r in self._states.items() if r() is not None}
            self._states[id(state)] = weakref.ref(state)
        return state

    @property
    def iteration(self) -> int:
        """Index of the current restart iteration (0 for the first run)."""
        return self.state.iteration

    def ping(self) -> None:
        """Reports progress; the first ping of an iteration starts the manual timeout."""
        if self._watchdog is not None:
            self._watchdog.ping()

    def disable_hang_protection(self) -> _HangProtectionOff:
        """Turns the soft and hard timeouts off, e.g. around a long checkpoint.

        Faults are still detected and still restart the function (a peer's
        fault, an exception here, a dead rank); only "no progress" is not a
        fault until :meth:`enable_hang_protection` (or the next iteration).
        The result is also a context manager (the newest generation's form,
        ``with call_wrapper.disable_hang_protection(): ...``) that turns them
        on again when the block ends.
        """
        if self._watchdog is not None:
            self._watchdog.set_hang_protection(False)
        return _HangProtectionOff(self)

    def enable_hang_protection(self) -> None:
        """Turns the soft and hard timeouts on again; progress counts from now."""
        if self._watchdog is not None:
            self._watchdog.set_hang_protection(True)

    @contextlib.contextmanager
    def hang_protection_disabled(self) -> Iterator[None]:
        """The soft and hard timeouts off inside the block (see :meth:`disable_hang_protection`)."""
        self.disable_hang_protection()
        try:
            yield
        finally:
            self.enable_hang_protection()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block that the termination procedure never interrupts.

        Shares a re-entrant lock with the monitor thread: a restart is not
        started while the block runs, and the block is not entered once a
        restart has started (``RankShouldRestart`` is raised instead).
        """
        with self._lock:
            if self._monitor is not None and self._monitor.restart_in_progress:
                raise RankShouldRestart("a restart is in progress")
            yield

    # ---------------------------------------------------------------- training state

    def restore(self, state: dict[str, Any], *, replicated: bool = True) -> int:
        """Loads the newest snapshot every active rank can have into ``state``; returns its step.

        Call it once per iteration, on every active rank, after the function has
        initialized ``torch.distributed``. ``state`` maps names to objects with
        ``state_dict()``/``load_state_dict()``, tensors, or picklable values.
        Returns the same step on every rank, ``0`` (``state`` untouched) when no
        snapshot exists. ``replicated``: every rank holds the same state (data
        parallel); ``False``: each rank's differs, and each keeps a copy of its
        ring predecessor's. The record of the restore is :attr:`last_restore`
        (and a ``restore`` line in the restart records). See the README.
        """
        snapshots = self._require_snapshots("restore")
        try:
            step = snapshots.restore(state, replicated, self.iteration)
        finally:
            record = snapshots.last_restore
            if record is not None and record is not self.last_restore:
                self.last_restore = record
                s = self.state
                if (s.active_rank if s.active_rank is not None else s.rank) == 0:
                    self._records.restore(record)
        return step

    def commit(self, state: dict[str, Any], step: int) -> None:
        """Snapshots ``state`` as the state after ``step`` steps (a copy; see :meth:`restore`)."""
        self._require_snapshots("commit").commit(state, step, self.iteration)

    def _require_snapshots(self, method: str) -> Snapshots:
        if self._snapshots is None:
            raise RuntimeError(
                f"CallWrapper.{method}() is only available while the wrapped function runs"
            )
        return self._snapshots

    # ---------------------------------------------------------------- the loop

    def __call__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise ValueError(
                f"{getattr(fn, '__qualname__', fn)!r} wrapped by inprocess.Wrapper requires "
                "`not torch.distributed.is_initialized()`, but torch.distributed is already "
                "initialized: the wrapped function initializes it itself (it is aborted and "
                "initialized again on every restart); call "
                "torch.distributed.destroy_process_group() before calling it"
            )
        # every process of the job keys the store with it: refuse a guessable one
        # before anything is started (ValueError naming INPROCESS_JOB_SECRET)
        _security.check_job_secret()
        _warn_if_logging_is_off()
        try:
            return self._run(fn, args, kwargs)
        except BaseException as ex:
            # The call owns what it created: the frames of ours that the
            # caller's traceback holds must not keep a store (or its server) alive.
            _clear_frames(ex, (_PACKAGE_DIR,))
            self._on_terminate(ex)
            raise

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with contextlib.ExitStack() as cleanup:
            self._start(cleanup)
            if self._joining():
                previous = None
                membership = self._join()
                if membership is None:
                    return None
                prev_members, terminated, joiners, iteration = membership
            else:
                prev_members = self._initial_barrier()
                previous, terminated, joiners, iteration = self._copy_state(), set(), [], 0
                if self._config.generation is _gen.Generation.NEWER:
                    # The newer generation's first assignment sees a state it
                    # has not decided on yet.
                    previous.mode, previous.active_rank = Mode.INITIALIZED, None

            records = self._records
            termination: protocol.Termination | None = None
            while True:
                with self._phase("rank_assignment"):
                    current = self._iteration_barrier(
                        iteration, previous, prev_members, terminated, joiners, termination
                    )
                result = self._run_iteration(current, fn, args, kwargs)
                records.iteration_ended(current, result.completed, self.state)
                if result.completed:
                    records.completed(current, self.state)
                    self._finish(current)
                    self._on_completion()
                    return result.value if self.state.mode == Mode.ACTIVE else None
                previous = self._copy_state()
                with self._phase("abort"):
                    self._abort()
                with self._phase("finalize"):
                    self._finalize(result.exception)
                with self._phase("health_check"):
                    self._health_check(result.exception)
                with self._phase("termination_barrier"):
                    termination = self._termination_barrier(current)
                terminated, joiners = set(termination.terminated), list(termination.joiners)
                records.publish_phases(self.store, terminated)
                self._log_root_cause(result.exception)
                prev_members, iteration = current.members, current.index + 1

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """One phase of the restart: timed in the records, and named on the board
        (what the monitor process says the rank was doing if it ends it)."""
        self._board.write_phase(name)
        with self._records.phase(name):
            yield

    # ---------------------------------------------------------------- setup / teardown

    def _start(self, cleanup: contextlib.ExitStack) -> None:
        self._call_started = time.time()
        c = self._config
        role, call = protocol.role_namespace(job_namespace()), next(_call_counter)
        self.namespace = protocol.call_namespace(role, call)
        raw = self._open_store(c.barrier_timeout)
        cleanup.callback(self._release_store)
        cleanup.callback(release_held_servers)
        cleanup.callback(self._wait_for_exit_if_hosting, raw)
        self.store = PrefixStore(self.namespace, raw)
        self._late = self.store.read(protocol.done_key(protocol.INITIAL)) is not None
        self.identity = self._call_identity()
        # A wait for peers blocks in the store, where the hard clock runs on
        # (no bytecode): no single wait comes near the hard timeout.
        self.store.wait_chunk_max = min(WAIT_CHUNK_MAX, c.hard_timeout / 4)
        # Tells a job controller that this role recovers in-process (role level),
        # and which call the job is on.
        raw.announce_call(role, call)
        self._records = _records.Recorder(
            _records.records_path(c.records), self.identity, self.namespace, call
        )
        from .snapshot import Snapshots

        self._snapshots = Snapshots(c.snapshot_dir, c.persist_every, c.snapshot_staging)
        cleanup.callback(self._snapshots.close)

        board = ProgressBoard()
        cleanup.callback(board.close)
        self._board = board
        # rung by the monitor process's fault watch: the monitor thread reads the board then
        doorbell = Doorbell()
        cleanup.callback(doorbell.close)  # (after the monitor thread and process have stopped)
        # The ranks of a node share one group for their liveness (inprocess.node).
        group, node = _node.group_of(self.namespace, _node.node_name(), raw)
        # ...and its restarts' arrivals, through the group's leader
        self._relay = RelayClient(group, self.identity)
        cleanup.callback(self._relay.close)
        monitor = MonitorProcess(
            MonitorConfig(
                identity=self.identity,
                initial_rank=self.state.initial_rank,
                parent_pid=os.getpid(),
                # Described by the store itself: the factory need not be picklable.
                client=raw.client_spec() or ClientSpec(c.store_factory.client, c.store_kwargs),
                namespace=self.namespace,
                interval=c.monitor_process_interval,
                heartbeat_interval=c.heartbeat_interval,
                heartbeat_timeout=c.heartbeat_timeout,
                hard_timeout=c.hard_timeout,
                termination_grace_time=c.termination_grace_time,
                unwind_timeout=c.unwind_timeout,
                thread_id=threading.get_native_id(),
                logfile=c.monitor_process_logfile,
                # A log file asked for gets at least the INFO lines.
                log_level=min(
                    logging.getLogger("inprocess").getEffectiveLevel(),
                    logging.INFO if c.monitor_process_logfile else logging.WARNING,
                ),
                node=node,
                node_group=group,
            ),
            board,
            doorbell.write_fd,
        )
        beat = functools.partial(_node.beat_for, self.store, node, group)
        # Where the fork is not safe (CUDA initialized, other threads), the monitor
        # is a fresh interpreter that imports torch: seconds the rank does not
        # wait for (see MonitorProcess.start).
        monitor_ready = monitor.start(timeout=c.barrier_timeout, wait=False, send_heartbeat=beat)
        cleanup.callback(monitor.shutdown)
        if not monitor_ready:
            # Invariant: a rank is placed before its first barrier (its peers watch
            # its node from then on); its monitor places it once connected.
            self.store.place(self.identity, node)
        # A monitor process that dies is replaced, not mistaken for this rank's death.
        monitor.keep_alive(
            timeout=c.barrier_timeout, on_restart=self._monitor_restarted, send_heartbeat=beat
        )
        self._monitor_process = monitor
        if c.monitor_process_pidfile is not None:
            # Left in place when the call ends (as the newer generations do); the
            # next call, or a replacement monitor process, writes it again.
            _write_pidfile(c.monitor_process_pidfile, self.state.initial_rank, monitor)

        on_main_thread = threading.current_thread() is threading.main_thread()
        self._watchdog = ProgressWatchdog(
            c.progress_watchdog_interval,
            board,
            automatic=on_main_thread,
            soft_timeout=c.soft_timeout,
        )
        self._watchdog.start()
        cleanup.callback(self._watchdog.shutdown)

        self._interrupt = InterruptSignal()
        self._interrupt.install()
        cleanup.callback(self._interrupt.uninstall)

        self._monitor = MonitorThread(
            store=self.store,
            identity=self.identity,
            target_thread_id=threading.get_ident(),
            lock=self._lock,
            interval=c.monitor_thread_interval,
            last_call_wait=c.last_call_wait,
            soft_timeout=c.soft_timeout,
            stalled_for=self._watchdog.stalled_for,
            # learned from the monitor process's fault watch, not read from the store
            faults_seen=board.faults_seen,
            doorbell=doorbell,
            on_interrupt=self._watchdog.freeze,
            # a gloo initialization that a faulted peer left waiting (see there)
            on_resend=functools.partial(complete_stranded_gloo_init, threading.get_ident()),
            abort=functools.partial(
                self._abort_then_time_unwind, _gen.as_state_callback(c.abort, c.generation)
            ),
            interrupt=self._interrupt,
        )
        self._monitor.start()
        cleanup.callback(self._monitor.shutdown)

        # Gated like the monitor thread's sends: never raised once the main
        # thread has caught the restart exception (see MonitorThread).
        unraisable = _mt.reraise_if_unraisable(
            RankShouldRestart, lock=self._lock, wanted=self._monitor.expects_restart
        )
        cleanup.enter_context(unraisable)
        cleanup.enter_context(
            _restore_environment("RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE")
        )

    def _call_identity(self) -> str:
        """This rank's identity in the call. The ranks that start the call together
        take identities every rank can derive (so the initial membership is
        published in O(1), not as N identities read by N ranks); a process that
        comes late (a relaunched worker) takes one of its own."""
        incarnation = incarnation_from_env()
        if self._late or incarnation != 0:
            return new_identity(self.state.initial_rank, incarnation)
        return protocol.launch_identity(
            self.state.initial_rank, protocol.launch_token(self.namespace)
        )

    def _open_store(self, timeout: float) -> StoreMixin:
        """This call's store; never the server of an earlier call that is shutting down.

        A server hosted by a rank serves one call: its host shuts it down once
        every rank has left the call, so a rank that starts its next call
        sooner may reach the old server. Invariant: a rank-hosted server carries
        ``_RANK_HOSTED_KEY`` from its creation on, and ``<namespace>/hosted``
        for each call it serves, set by its host before that call's initial
        barrier. A client that reaches a rank-hosted server without this call's
        mark drops that connection and connects again, with backoff, until the
        new server is up (ranks agree on the namespace: the same job makes the
        same sequence of calls). A launcher's store (torchrun's agent,
        ``inprocess-run``) lives across calls, carries no mark and is used at once;
        so is a new server reached before its host marked it.
        """
        w = self._config
        marker = f"{self.namespace}/{protocol.HOSTED}"
        deadline = time.monotonic() + timeout
        poller = _poller(0.05)
        for attempt in itertools.count():
            raw = w.store_factory(**w.store_kwargs)
            if getattr(raw, "is_master", False):
                raw.put(_RANK_HOSTED_KEY, "1")
                raw.put(marker, self.identity)
                return raw
            with contextlib.suppress(Exception):  # the old server may go away meanwhile
                # Sealed marks: a stranger's key neither sends a rank to an old server
                # nor holds one back from a launcher's store.
                if raw.read(_RANK_HOSTED_KEY) is None or raw.read(marker) is not None:
                    return raw
            del raw  # closes the connection to the old server
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"the store server reached through {w.store_factory.__name__}"
                    f"(**{w.store_kwargs!r}) belongs to another call and was not replaced "
                    f"within {timeout:.3g}s (barrier_timeout): did initial rank 0 call the "
                    "wrapped function as often as this rank?"
                )
            if attempt == 0:
                log.debug("%s: reached the store server of an earlier call; waiting", self.identity)
            poller.sleep(deadline)

    def _copy_state(self) -> State:
        return self._track(self.state.copy())

    def _release_store(self) -> None:
        """Drops every reference of ours to the store, so its connections (and a
        server this rank hosts) close now, not whenever garbage is collected.

        Invariant: every State that got the store is tracked (``state`` setter,
        :meth:`_track`); clearing them all covers the states the user's
        callbacks kept and those the frames of a traceback hold. Their
        ``fn_exception`` goes too: its traceback reaches frames that held the store.
        """
        self.store = None
        for ref in self._states.values():
            state = ref()
            if state is not None:
                state.store = None
                state.fn_exception = None
        self._states.clear()
        if self._monitor is not None:
            self._monitor.store = None

    def _wait_for_exit_if_hosting(self, raw: Any) -> None:
        """The rank hosting the store keeps it up until every rank has left."""
        finished = self._finished_iteration
        if not getattr(raw, "is_master", False):
            return
        if finished is None:
            self._wait_for_peers_to_abort()
            return
        key = protocol.iteration_key(finished.index, "exit")
        deadline = time.monotonic() + self._config.completion_timeout
        seen = -1
        # The counter wakes; the members' sealed exit records decide.
        while time.monotonic() < deadline:
            count = self.store.counter(key)
            if count != seen and count >= len(finished.members):
                seen = count
                if self.store.all_arrived(protocol.arrivals_key(key), finished.members) is not None:
                    return
            time.sleep(0.005)

    def _wait_for_peers_to_abort(self) -> None:
        """A host that left by ``RestartAbort`` keeps the store up until the other members
        have left too, within :data:`_ABORT_WAIT`.

        A RestartAbort usually ends every rank at the same iteration (a retry
        limit is the same for all), and a peer still in that iteration's barrier
        when the store goes would end with a lost store instead of its own
        RestartAbort. A peer that goes on without this rank loses the store
        either way: the bound only keeps the host from waiting for it long.
        """
        aborted = self._aborted_iteration
        if aborted is None:
            return
        others = set(aborted.members) - {self.identity}
        deadline = time.monotonic() + min(_ABORT_WAIT, self._config.barrier_timeout)
        with contextlib.suppress(Exception):  # the store's own errors end the wait
            while time.monotonic() < deadline:
                if others <= self.store.terminated_since(self.store.terminated_epoch()):
                    return
                time.sleep(0.01)

    # ---------------------------------------------------------------- barriers

    def _initial_barrier(self) -> protocol.Roster:
        """All launched ranks meet; returns their identities ordered by initial rank."""
        s = self.state
        size = s.initial_world_size
        token = protocol.launch_token(self.namespace)

        def by_initial_rank(arrived: list[str]) -> str:
            # Run once, by the rank that completes the barrier: every other
            # rank derives the membership from what it publishes (O(1) read
            # when every rank has its launch identity) and checks its own place.
            # (With claims, two processes with one identity arrive twice: refused.)
            members = sorted(arrived, key=initial_rank_of)
            ranks = [initial_rank_of(m) for m in members]
            if ranks != list(range(size)):
                raise ValueError(
                    f"initial ranks {ranks} are not 0..{size - 1}: "
                    "check RANK and WORLD_SIZE of every process"
                )
            return protocol.encode_initial(members, token)

        try:
            members = self.store.counted_barrier(
                protocol.INITIAL,
                self.identity,
                size,
                _td(self._config.barrier_timeout),
                self._restart_poll,
                arrange=by_initial_rank,
                expand=functools.partial(protocol.decode_initial, token=token),
                claim=uuid.uuid4().hex[:12],
            )
        except BarrierRefused as ex:
            raise InternalError(str(ex)) from None
        if len(members) != size or members[s.initial_rank] != self.identity:
            raise InternalError(
                f"{self.identity}: not at its initial rank {s.initial_rank} of the "
                f"initial membership of {len(members)}"
            )
        return protocol.roster(members)

    def _iteration_barrier(
        self,
        iteration: int,
        previous: State | None,
        prev_members: protocol.Roster,
        terminated: set[str],
        joiners: list[str],
        following: protocol.Termination | None = None,
    ) -> _Iteration:
        """Rank assignment, rank filter, then agreement on the new membership.

        Survivors compute their new rank with the user's rank assignment and
        meet the joiners at a rendezvous; if a participant dies before it
        arrives, everyone recomputes without it (a new attempt).

        After a termination barrier (``following``, its decision) that admitted
        nobody, with a rank assignment that keeps the survivors in their order
        (:func:`~inprocess.generation.derives_membership`: the default), every
        rank derives the membership itself and checks it against the decision's
        digest: no rendezvous (see :meth:`_derived_membership`).
        """
        w = self._config
        prev_members = protocol.roster(prev_members)  # (itself, in the Wrapper's loop)
        for attempt in itertools.count():
            name = protocol.barrier_name(iteration, attempt)
            if previous is not None:
                value, assigned = self._assign_rank(previous, prev_members, terminated, name)
            else:
                value, assigned = protocol.JOIN, self.state.copy()
            planned = assigned.copy()
            # In the common case (nobody out, nobody joins) the roster it holds:
            # no O(N) work on any rank but the decider.
            out = terminated.intersection(prev_members) if terminated else ()
            participants = prev_members
            if out or joiners:
                participants = protocol.Roster(
                    [m for m in prev_members if m not in out] + list(joiners)
                )
            try:
                if attempt == 0 and self._derives(following, previous, joiners):
                    assert following is not None
                    decision = self._derived_membership(participants, value, following)
                    log.info(
                        "%s: iteration %d membership derived from the termination barrier",
                        self.identity,
                        iteration,
                    )
                else:
                    published = self.store.rendezvous(
                        name,
                        self.identity,
                        participants,
                        value.encode(),
                        _td(self._config.barrier_timeout),
                        functools.partial(_decide_membership, self.store, participants),
                        self._restart_poll,
                        relay=self._relay,
                    )
                    decision = protocol.decode_membership(published, participants)
            except protocol.MembershipMismatch as ex:
                raise InternalError(f"iteration {iteration}: {ex}") from None
            if isinstance(decision, protocol.Failed):
                raise InternalError(f"iteration {iteration}: {decision.error}")
            if isinstance(decision, protocol.Retry):
                dead = set(decision.terminated)
                terminated = terminated | dead
                joiners = [j for j in joiners if j not in dead]
                continue
            members = protocol.roster(decision.members)
            if self.identity not in members:
                self.store.mark_left(self.identity)
                raise RankDiscarded(f"rank {self.identity} was discarded by the rank assignment")
            self.state = s = assigned
            s.store = self.store
            s.iteration = iteration
            # where it was, in the common case (nobody before it left): no search
            s.rank = members.position(self.identity, hint=s.rank)
            s.world_size = len(members)
            if w.generation is _gen.Generation.NEWER:
                # Its rank assignment decided the modes (its filters are steps of it).
                _gen.settle(s, planned, joined=previous is None)
            else:
                s.activate_all()
                if w.rank_filter is not None:
                    self.state = s = w.rank_filter(s)
                s.apply_active_world_size()
            if s.rank == 0:
                self.store.publish_membership(iteration, members)
            # Whom this rank's monitor process watches now: handed over on the
            # board (local memory), not through the store.
            self._board.write_text(
                protocol.Peers(
                    iteration,
                    tuple(protocol.ring_successors(members, self.identity, WATCHED_PEERS, s.rank)),
                ).encode()
            )
            log.info(
                "%s: iteration %d rank %d/%d (%s)",
                self.identity,
                iteration,
                s.rank,
                s.world_size,
                s.mode.value,
            )
            return _Iteration(iteration, members, decision.baseline)
        raise AssertionError("unreachable")

    def _derives(
        self,
        following: protocol.Termination | None,
        previous: State | None,
        joiners: Sequence[str],
    ) -> bool:
        """Whether this restart's membership is derived on every rank (see
        :meth:`_iteration_barrier`). Every rank answers alike: from the decision
        they share and the rank assignment every rank of a job is given."""
        return (
            following is not None
            and following.baseline is not None
            and following.digest is not None
            and previous is not None
            and not joiners
            and _gen.derives_membership(self._config.rank_assignment)
        )

    def _derived_membership(
        self,
        participants: protocol.Roster,
        value: protocol.Arrival,
        following: protocol.Termination,
    ) -> protocol.Members:
        """The membership that follows ``following``, derived, not agreed at a barrier.

        Why no barrier is needed: the assignment keeps the survivors (the
        ``participants``: the members less the terminated) in their order, so
        the decision every rank would wait for is known to each; the decider of
        the termination barrier read the fault count (``following.baseline``)
        before every arrival, so a fault after it, including a join request's
        (appended after its request) and a death after the barrier, faults the
        new iteration. The digest catches a rank whose view of the members
        diverged. A rank its assignment drops (it was listed as terminated) is
        not among the participants and leaves, as at a barrier.

        Raises:
            MembershipMismatch: this rank derived another membership than the decider.
        """
        derived = protocol.membership_digest(participants)
        if derived != following.digest:
            raise protocol.MembershipMismatch(
                f"the membership this rank derived ({len(participants)} members, digest "
                f"{derived}) is not the termination barrier's (digest {following.digest})"
            )
        if self.identity in participants and value != protocol.Arrival(
            "rank", participants.position(self.identity, hint=value.rank)
        ):
            raise InternalError(
                f"{self.identity}: its rank assignment gave {value}, not its place among the "
                f"{len(participants)} survivors"
            )
        assert following.baseline is not None
        return protocol.Members(participants, following.baseline)

    def _assign_rank(
        self, previous: State, prev_members: protocol.Roster, terminated: set[str], name: str
    ) -> tuple[protocol.Arrival, State]:
        """This rank's new state per the user's rank assignment, and its barrier value.

        The value is the new rank, or ``discard`` when the assignment drops this rank.
        """
        state = self._track(previous.copy())
        state.store = PrefixStore(f"{name}/assignment", self.store)
        terminated_ranks = {prev_members.position(t) for t in terminated if t in prev_members}
        try:
            state, unhandled = _gen.assign(
                self._config.rank_assignment, self._config.generation, state, terminated_ranks
            )
            self._track(state)
        except RankDiscarded:
            return protocol.DISCARD, previous
        except RestartTimeoutError as ex:
            # A rank died during an exchange inside the assignment (e.g.
            # FilterGroupedByKey): the barrier decides whether to retry without it.
            log.warning("%s: rank assignment timed out: %s", self.identity, str(ex))
            return protocol.TIMEOUT, previous
        except Exception:
            self._terminate_self("rank assignment failed")
            raise
        if unhandled:
            self._terminate_self("rank assignment left terminated ranks unhandled")
            raise InternalError(f"rank assignment left terminated ranks {unhandled} unhandled")
        return protocol.Arrival("rank", state.rank), state

    def _termination_barrier(self, current: _Iteration) -> protocol.Termination:
        """Every member arrives or is terminated; decides who is out, who joins next
        and (for a membership derived from it) the fault count it starts from."""
        store = self.store

        def decide(arrivals: dict[str, str], terminated: set[str], baseline: int) -> str:
            gone = store.terminated() | store.left()
            requests = store.join_requests()
            cause = _root_cause(store, current.baseline)
            return protocol.encode(
                protocol.decide_termination(
                    terminated, current.members, requests, gone, cause, baseline
                )
            )

        decision = protocol.decode_termination(
            store.rendezvous(
                protocol.iteration_key(current.index, protocol.TERMINATION),
                self.identity,
                current.members,
                "",
                _td(self._config.barrier_timeout),
                decide,
                self._restart_poll,
                relay=self._relay,
            )
        )
        self._restart_cause = decision.cause
        return decision

    def _completion_barrier(self, current: _Iteration) -> None:
        """Waits until every member finished; a fault meanwhile raises ``RankShouldRestart``.

        An active rank waits at most ``completion_timeout`` for the others. A
        spare arrives at once and may wait as long as training lasts; its
        deadline starts when the first active rank finishes.
        """
        store = self.store
        key = protocol.iteration_key(current.index, protocol.COMPLETION)
        active = self.state.mode == Mode.ACTIVE
        # Counters wake; the sealed arrivals (with each rank's mode) decide.
        mode = "active" if active else "spare"
        store.add_entry(protocol.arrivals_key(key), f"{self.identity}={mode}")
        if active:
            store.add(f"{key}/active", 1)
        arrived = int(store.add(key, 1))
        if arrived >= len(current.members) and store.all_arrived(
            protocol.arrivals_key(key), current.members
        ):
            proposal = protocol.completion_outcome(store.fault_count(), current.baseline)
            store.decide_outcome(current.index, proposal)
        timeout = self._config.completion_timeout
        deadline = time.monotonic() + timeout if active else None
        wait = _OutcomeWait(store, current.index, self._config)
        seen_active = 0
        while True:
            outcome = store.outcome(current.index)
            if outcome == protocol.COMPLETED:
                return
            if outcome == protocol.FAULT:
                raise _mt.exception_with_message(RankShouldRestart, "fault at completion")()
            if deadline is None:
                count = store.counter(f"{key}/active")
                if count != seen_active:
                    seen_active = count
                    arrivals = store.by_identity(protocol.arrivals_key(key))
                    if "active" in arrivals.values():
                        deadline = time.monotonic() + timeout
            elif time.monotonic() >= deadline:
                reason = f"completion timeout ({self._config.completion_timeout:.3g}s)"
                store.record_fault(self.identity, reason)
                raise _mt.exception_with_message(RankShouldRestart, reason)()
            wait.wait(deadline)

    # ---------------------------------------------------------------- one iteration

    def _run_iteration(
        self,
        current: _Iteration,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> _Result:
        """Runs initialize, the function (or the spare's wait) and the completion barrier.

        The interruptible region: the monitor thread may raise
        ``RankShouldRestart`` anywhere inside it until it is disarmed.
        """
        self._board.write_iteration(current.index)
        self._board.write_phase("function")
        self._watchdog.resume(current.index)
        monitor = self._monitor
        armed = _mt.Armed(current.index, current.baseline, self.state)
        outcome = _Result()
        try:
            monitor.enter(armed)  # inside the try: the exception may land in it already
            self._initialize()
            if self._config.health_check is not None:
                # A check failing here is a fault of this iteration: it takes the
                # normal restart path (the check runs again after the fault).
                self.state = _returned_state(self._invoke("health_check", None), self.state)
            # initialize and the health check may have returned a new State.
            self._records.function_starting(self.store, current, self.state)
            if self.state.mode == Mode.ACTIVE:
                with self._function_environment(current):
                    outcome.value = fn(*args, **kwargs)
                self._watchdog.pause_manual()
            # from here on the iteration may complete: a fault restarts it only
            # once the outcome "fault" stands (see MonitorThread._interrupt)
            monitor.leave_function(armed)
            self._board.write_phase("completion_barrier")
            self._completion_barrier(current)
            outcome.completed = True
        except BaseException as ex:
            # No eval-breaker checkpoint (call, loop) may precede this line: the
            # monitor stops sending once it sees `acked`, so at most one
            # exception sent before it can still arrive, and the nested
            # handler below absorbs it.
            armed.acked = True
            outcome.exception = ex
        try:
            monitor.disarm()
        except RankShouldRestart:
            monitor.disarm()
        # Out of the function: the hard clock stands still while this rank only
        # waits for its peers (see inprocess.progress_watchdog).
        self._watchdog.pause()
        try:
            if outcome.completed:
                return outcome
            try:
                result = self._classify_fault(outcome, armed)  # raises if this rank leaves
            except RestartAbort:
                self._aborted_iteration = current  # see _wait_for_peers_to_abort
                raise
            self._release(result.exception)
            return result
        finally:
            self._board.write_unwind(0.0)  # back in the Wrapper: the unwind is over

    def _release(self, ex: BaseException | None) -> None:
        """Lets go of what the failed iteration left in the frames of ``ex``'s traceback.

        Those frames hold its aborted process groups and the work objects of
        their collectives (torch.distributed's own frames: ``group``, ``work``),
        and the exception lives on in ``State.fn_exception`` into the next
        iteration. Freeing them runs native destructors that may block for good
        (a gloo group joins its worker threads, and one left in a send the
        abort did not fail never returns): they are freed here, on the
        bounded-unwind clock, so a rank stuck in them is ended after
        ``unwind_timeout`` like one stuck before it came back, not by its hard
        timeout at some later fault, while its peers wait.

        Only our frames and torch.distributed's are cleared: the caller's and
        the wrapped function's stay intact for post-mortem debugging.
        """
        if ex is None:
            return
        self._board.write_phase("release")
        if not self._board.unwind_started():  # a fault the monitor thread did not interrupt
            self._board.write_unwind(time.monotonic())
        _clear_frames(ex, (_PACKAGE_DIR, _TORCH_DISTRIBUTED_DIR))

    def _classify_fault(self, outcome: _Result, armed: _mt.Armed) -> _Result:
        ex = outcome.exception
        s = self.state
        if isinstance(ex, RankShouldRestart):
            log.info(
                "%s: restarting iteration %d (%s)",
                self.identity,
                s.iteration,
                armed.cause or str(ex),
            )
        elif isinstance(ex, Exception):
            # Format now: a log record must not keep the exception (and the
            # frames its traceback holds) alive.
            # Logged at INFO: it may be derived from a peer's fault; the root
            # cause is logged once the termination barrier has seen them all.
            log.info("%s: iteration %d failed: %s", self.identity, s.iteration, repr(ex))
            self.store.record_fault(self.identity, f"{type(ex).__name__}: {ex}")
            self.store.decide_outcome(s.iteration, protocol.FAULT)
        else:
            # KeyboardInterrupt, SystemExit, RestartAbort, ...: this rank leaves.
            self._terminate_self(f"{type(ex).__name__}: {ex}")
            raise ex
        s.fn_exception = ex
        return outcome

    def _log_root_cause(self, ex: BaseException | None) -> None:
        """Logs, in one line, the fault that started this restart: which rank, which error.

        Not this rank's own error, which is usually derived from a peer's fault
        (gloo's "Connection closed by peer"): the termination barrier's decision
        names the root cause (see :func:`_root_cause`).
        """
        root = self._restart_cause
        if root is None:
            cause = f"{type(ex).__name__}: {ex}" if ex is not None else "unknown"
            log.warning(
                "%s: restarted iteration %d: %s", self.identity, self.state.iteration, cause
            )
            return
        log.warning(
            "%s: restarted iteration %d; root cause: rank %s%s: %s",
            self.identity,
            self.state.iteration,
            root.rank,
            " (this rank)" if root.rank == self.identity else "",
            root.reason,
        )

    @contextlib.contextmanager
    def _function_environment(self, current: _Iteration) -> Iterator[None]:
        s = self.state
        # Each init_process_group wraps sys.excepthook in one more layer that
        # prefixes "[rank<r>]: " (torch's, for the process's life); restarted
        # in-process, a traceback would carry one prefix per restart, of ranks
        # this process no longer has. Torch's layer of a previous iteration goes.
        if sys.excepthook is not self._excepthook and _is_torch_excepthook(sys.excepthook):
            sys.excepthook = self._excepthook
        os.environ["RANK"] = str(s.rank if s.active_rank is None else s.active_rank)
        os.environ["WORLD_SIZE"] = str(s.active_world_size)
        with fresh_env_rendezvous(self.store, current.index):
            yield

    # ---------------------------------------------------------------- callbacks

    # A callback's return value is used only when it is a State (or a tuple
    # starting with one); anything else, ``None`` included, keeps the current state.

    def _invoke(self, name: str, *exception: BaseException | None) -> Any:
        """Calls the callback ``name`` in the shape of its generation (``exception``: the
        usage guide's second argument, the newer generation's ``fn_exception``)."""
        callback = getattr(self._config, name)
        return _gen.invoke(callback, self._config.generation, self.state, *exception)

    def _initialize(self) -> None:
        if self._config.initialize is not None:
            self.state = _returned_state(self._invoke("initialize"), self.state)

    def _abort(self) -> None:
        if self._config.abort is None:
            return
        try:
            self.state = _returned_state(self._invoke("abort"), self.state)
        except Exception:
            self._terminate_self("abort failed")
            raise

    def _finalize(self, ex: BaseException | None) -> None:
        if self._config.finalize is None:
            return
        try:
            self.state = _returned_state(self._invoke("finalize", ex), self.state)
        except BaseException as failure:
            self._terminate_self(f"finalize failed: {failure!r}")
            raise

    def _health_check(self, ex: BaseException | None) -> None:
        """The check after a fault: failing it ends this rank with a ``HealthCheckError``
        whose ``__cause__`` is ``ex``, the exception that ended the function here.
        With ``LOCAL_RANK`` set, the device checks run first (GPU, NVLink, NIC),
        then the user's (``Wrapper.restart_health_check``)."""
        check = self.wrapper.restart_health_check or self._config.health_check
        if check is None:
            return
        try:
            result = _gen.invoke(check, self._config.generation, self.state, ex)
            self.state = _returned_state(result, self.state)
        except Exception as failure:
            gpu = device_fault.cause_of(failure)
            if gpu is not None:
                # this process's CUDA context is gone: it must end without freeing CUDA memory
                device_fault.mark_broken(gpu)
            reason = f"GPU fault ({gpu}): " if gpu is not None else ""
            self._terminate_self(f"health check failed: {reason}{failure!r}")
            if isinstance(failure, HealthCheckError) and failure.__cause__ in (None, ex):
                raise failure from ex
            raise HealthCheckError(
                f"{self.identity}: unhealthy after a fault: {type(failure).__name__}: {failure}"
            ) from ex
        except BaseException as failure:
            self._terminate_self(f"health check failed: {failure!r}")
            raise

    def _on_completion(self) -> None:
        """The newer generation's ``completion``: its failure is logged, not raised."""
        if self._config.completion is None:
            return
        try:
            self._config.completion(_gen.frozen(self.state))
        except Exception as ex:
            log.error("%s: completion failed: %r", self.identity, ex)

    def _on_terminate(self, ex: BaseException) -> None:
        """The newer generation's ``terminate``, as this rank's call ends with ``ex``."""
        if self._config.terminate is None:
            return
        try:
            self._config.terminate(_gen.frozen(self.state, ex))
        except Exception as failure:
            log.error("%s: terminate failed: %r", self.identity, failure)
            raise failure from ex

    def _terminate_self(self, reason: str) -> None:
        """Records that this rank leaves the job, so the others go on without it."""
        log.warning("%s: leaving the job: %s", self.identity, reason)
        with contextlib.suppress(Exception):
            self.store.mark_terminated(self.identity, reason)
        self._board.write_finished()

    # ---------------------------------------------------------------- joining a running job

    def _joining(self) -> bool:
        """Whether the job already started without this process (it was relaunched):
        read once, when the call started (see :meth:`_call_identity`)."""
        return self._late

    def _join(self) -> tuple[protocol.Roster, set[str], list[str], int] | None:
        """Asks to join and waits for the termination barrier that admits this rank."""
        store = self.store
        store.request_join(self.identity)
        requested = time.time()
        log.info("%s: asked to join the running job", self.identity)
        # Blocks on the call's wake-ups: a termination barrier's decision and an
        # iteration's outcome (the job completing) both wake it. The wake-up
        # state is read before the first look (see WakeWait).
        waiter = WakeWait(
            store,
            datetime.timedelta(seconds=self._config.barrier_timeout * 4),
            self._restart_poll,
        )
        membership = store.membership()
        iteration = membership[0] if membership else 0
        while waiter.remaining() > 0:
            termination = protocol.iteration_key(iteration, protocol.TERMINATION)
            done = store.read(protocol.done_key(termination))
            if done is not None:
                decision = protocol.decode_termination(done)
                if protocol.admitted(decision, self.identity):
                    members = store.membership()
                    if members is None or members[0] != iteration:
                        raise InternalError(f"no membership published for iteration {iteration}")
                    self._record_join(iteration, requested)
                    return (
                        protocol.Roster(members[1]),
                        set(decision.terminated),
                        list(decision.joiners),
                        iteration + 1,
                    )
                iteration += 1
                waiter.idle = False  # a decision, not for this rank: look at the next at once
                continue
            if store.outcome(iteration) == protocol.COMPLETED:
                log.warning("%s: the job completed before this rank could join", self.identity)
                self._board.write_finished()
                return None
            # a wake-up that brought nothing (another barrier's, or a stranger's
            # key) costs the next wait a pause first: never a busy loop
            waiter.wait()
        raise InternalError(f"{self.identity}: not admitted to the running job in time")

    def _record_join(self, iteration: int, requested: float) -> None:
        """The ``join`` record of this rank's admission (see :meth:`Recorder.joined`)."""
        if not self._records.enabled:
            return
        import psutil

        monitor = self._monitor_process
        try:
            created: float | None = psutil.Process().create_time()
        except psutil.Error:
            created = None
        timeline = {
            "process_start": created,
            "call_start": self._call_started,
            "monitor_ready": monitor.ready_at if monitor is not None else None,
            "join_request": requested,
            "admitted": time.time(),
        }
        kind = "forked" if monitor is not None and monitor.forked else "spawned"
        self._records.joined(iteration, timeline, kind)

    # ---------------------------------------------------------------- completion

    def _abort_then_time_unwind(self, abort: Callable[[Any], Any] | None, state: Any) -> Any:
        """The abort (monitor thread, under its lock, right after the restart
        exception was sent), then the start of the monitor process's
        bounded-unwind clock: the main thread cannot come back before the abort
        is done (it needs the lock), and the abort is what releases it, so its
        duration, however long, never counts against the rank."""
        try:
            return abort(state) if abort is not None else None
        finally:
            self._board.write_unwind(time.monotonic())

    def _monitor_restarted(self, pid: int, reason: str) -> None:
        """A fault of the machinery, not of training: recorded, no restart."""
        log.warning(
            "%s: monitor process %s; started a new one (pid %d)", self.identity, reason, pid
        )
        if self._config.monitor_process_pidfile is not None:
            with contextlib.suppress(OSError):
                _write_pidfile(
                    self._config.monitor_process_pidfile,
                    self.state.initial_rank,
                    self._monitor_process,
                )
        with contextlib.suppress(Exception):
            self.store.add_entry(
                "machinery_faults",
                f"{self.identity}\tmonitor process {reason}\t{time.time():.3f}",
            )

    def _finish(self, current: _Iteration) -> None:
        self._board.write_finished()
        self.store.mark_completed(self.identity, current.index)
        self._finished_iteration = current
        self._monitor_process.shutdown()
        key = protocol.iteration_key(current.index, "exit")
        self.store.add_entry(protocol.arrivals_key(key), f"{self.identity}=exit")
        self.store.add(key, 1)


@dataclasses.dataclass
class _Result:
    completed: bool = False
    value: Any = None
    exception: BaseException | None = None


def _is_torch_excepthook(hook: Any) -> bool:
    """Whether ``hook`` is the one ``init_process_group`` installs."""
    return getattr(hook, "__qualname__", "").endswith("_distributed_excepthook") and getattr(
        hook, "__module__", ""
    ).startswith("torch.distributed")


def _decide_membership(
    store: StoreMixin,
    participants: Sequence[str],
    arrivals: dict[str, str],
    terminated: set[str],
    baseline: int,
) -> str:
    """The iteration barrier's decider: reads the call's joins, then decides
    (:func:`inprocess.protocol.decide_membership`), published as a change to
    ``participants``."""
    gone = store.terminated() | store.left()
    parsed = {identity: protocol.Arrival.parse(v) for identity, v in arrivals.items()}
    decision = protocol.decide_membership(
        {identity: v for identity, v in parsed.items() if v is not None},
        terminated,
        baseline,
        store.join_requests(),
        gone,
    )
    return protocol.encode(decision, participants)


def _root_cause(store: StoreMixin, baseline: int) -> protocol.RootCause | None:
    """The fault that started a restart, read once by the termination barrier's decider.

    At the barrier every fault of the iteration is in the fault log (one entry
    per increment of the fault counter, appended before it, so the entries
    from ``baseline`` on are this iteration's, in order); see
    :func:`inprocess.protocol.root_cause`.
    """
    try:
        entries = store.fault_log()[baseline:]
    except Exception:
        return None
    return protocol.root_cause(entries)


#: frames whose locals a restart clears (see CallWrapper._release)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DISTRIBUTED_DIR = os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep


def _clear_frames(ex: BaseException, prefixes: tuple[str, ...]) -> None:
    """Clears the locals of the finished frames of ``ex``'s tracebacks (chained
    exceptions too) whose code lives under one of ``prefixes``.

    Also breaks the cycle result -> exception -> traceback -> our frames ->
    result, so what they hold goes now, not whenever the garbage collector runs.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [ex]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_filename.startswith(prefixes):
                with contextlib.suppress(RuntimeError):  # still executing
                    frame.clear()
            tb = tb.tb_next
        pending += [current.__cause__, current.__context__]


def _write_pidfile(template: str, rank: int, monitor: MonitorProcess) -> None:
    """Writes the monitor process's pid (decimal, atomically) to the rank's pidfile."""
    path = template.format(rank=rank)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{monitor.process.pid}\n")
    os.replace(tmp, path)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class _OutcomeWait:
    """A rank's wait at the completion barrier: blocks until the iteration's outcome is
    decided (its once-key appears), at most a chunk.

    Every way out of the barrier decides the outcome first: the last arrival
    decides "completed", and a fault's monitor threads decide "fault" before
    they interrupt, so the store wakes every waiter at once and nobody polls.
    A chunk bounds how long the main thread stays in native code, where it
    runs no bytecode: the barrier is inside the iteration, so its soft and hard
    clocks run on meanwhile, and a chunk stays under a quarter of either
    (``wait_chunk_max`` is a quarter of ``hard_timeout``). It also bounds how
    late a spare sees the first active arrival that starts its deadline (at
    most a quarter of ``completion_timeout``). A stranger's garbage in the key makes
    every wait return at once: after a wake-up that decided nothing the next
    wait first pauses ``monitor_thread_interval`` (the polling it replaced),
    never a spin. A store whose ``wait`` polls in the client is polled at
    that interval instead.
    """

    def __init__(self, store: Any, iteration: int, config: Any) -> None:
        self.store, self.iteration = store, iteration
        self.pause = max(config.monitor_thread_interval, 0.001)
        self.served = waits_in_server(store)
        self.chunk_max = max(
            min(
                getattr(store, "wait_chunk_max", WAIT_CHUNK_MAX),
                config.soft_timeout / 4,
                config.completion_timeout / 4,
            ),
            0.001,
        )
        self.chunk = min(WAIT_CHUNK, self.chunk_max)
        self.idle = False

    def wait(self, deadline: float | None) -> None:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self.served or self.idle:
            time.sleep(self.pause if left is None else min(self.pause, left))
            if not self.served:
                return
        seconds = self.chunk if left is None else min(self.chunk, left)
        self.chunk = min(self.chunk * 2, self.chunk_max)
        key = protocol.iteration_key(self.iteration, protocol.OUTCOME)
        # woken with nothing decided: garbage in the key (it stays: pause from now on)
        self.idle = self.store.wait_for(key, seconds)


def _poller(limit: float) -> Poller:
    return Poller(max(limit, 0.001))


@contextlib.contextmanager
def _restore_environment(*names: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
