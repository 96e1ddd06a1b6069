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

This rank's side of the barriers and the membership they decide lives in
:mod:`inprocess.membership`; opening the call's store, starting what watches the
call and releasing it all in :mod:`inprocess.call_setup`. The distributed
protocol lives in :mod:`inprocess.protocol` (its keys and its decisions, as pure
functions) and :mod:`inprocess.store` (barriers and rendezvous over the store);
interrupting the function lives in :mod:`inprocess.monitor_thread`; the hard
timeout and dead-rank detection live in :mod:`inprocess.monitor_process`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import call_setup as _setup
from . import generation as _gen
from . import monitor_thread as _mt
from . import persist_signal, protocol
from . import records as _records
from . import security as _security
from .abort import Abort, AbortTorchDistributed
from .abort.rendezvous import release_held_servers
from .callbacks import Callbacks
from .completion import Completion
from .compose import Compose
from .config import DEFAULT_RANK_ASSIGNMENT, WrapperConfig
from .exception import RestartAbort
from .finalize import Finalize
from .health_check import HealthCheck
from .health_check.base import env_local_rank
from .health_check.restart import (
    ChainedGPUHealthCheck,
    ChainedNicHealthCheck,
    ChainedNVLHealthCheck,
)
from .initialize import Initialize
from .injection import parameters_of_type
from .membership import Barriers, Iteration, announce, log_root_cause, record_join
from .monitor_process import MonitorProcess
from .monitor_thread import InterruptSignal, MonitorThread, RankShouldRestart
from .progress_watchdog import ProgressBoard, ProgressWatchdog
from .rank_assignment import RankAssignment
from .rank_filter import RankFilter
from .reclaim import CallHeap
from .relay import RelayClient
from .slurm_env import apply_slurm_task_env
from .state import Mode, State
from .store import (
    WAIT_CHUNK_MAX,
    PrefixStore,
    StoreMixin,
    TCPStore,
    incarnation_from_env,
    job_namespace,
    new_identity,
)
from .terminate import Terminate

if TYPE_CHECKING:
    from .snapshot import Snapshots

log = logging.getLogger(__name__)

_UNSET: Any = object()
_call_counter = itertools.count()

# The poll interval of barriers inside the restart procedure: short waits that
# everybody is blocked on, so they poll fast, backing off up to this (or up to
# monitor_thread_interval when that is shorter).
_RESTART_POLL_LIMIT = 0.02


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
    let ``BaseException`` propagate. See docs/wrapper.md for the full contract.
    In a task that ``srun`` started directly (no launcher), those variables are
    filled in from Slurm's when unset (docs/multi-node.md).

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
        if self.config.enabled:
            # a script srun started directly, one task per rank: RANK, WORLD_SIZE,
            # LOCAL_RANK, MASTER_ADDR, ... from Slurm's variables (none overridden),
            # before anything below or the call reads them
            apply_slurm_task_env()
        #: the check after a fault: NIC, NVLink and GPU checks of the rank's device
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
        durations = WrapperConfig.durations()
        return datetime.timedelta(seconds=value) if name in durations else value

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
    """``Compose(user..., gpu, nvl, nic)``: runs NIC, NVLink, GPU, then the user's
    checks (the last listed first), as the API's newest generation builds it.

    The chained classes are looked up in this module when a Wrapper is built
    (a caller may replace them here), and each is built as ``cls(device_index=...)``.
    The NIC check is always in the chain; where the node has no InfiniBand
    counters it passes and says so. All three run before the user's checks, so
    those meet a device already known to be usable.
    """
    local_rank = env_local_rank()
    if local_rank is None:
        return None
    checks: list[Any] = []
    if user is not None:
        checks += user.instances if isinstance(user, Compose) else [user]
    # Compose runs the last listed first: NIC, NVLink, GPU, then the user's.
    checks.append(ChainedGPUHealthCheck(device_index=local_rank))
    checks.append(ChainedNVLHealthCheck(device_index=local_rank))
    checks.append(ChainedNicHealthCheck(device_index=local_rank))
    return Compose(*checks)


class _HangProtectionOff:
    """What ``disable_hang_protection()`` returns: leaving it as a block turns it on again."""

    def __init__(self, call: CallWrapper) -> None:
        self._call = call

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._call.enable_hang_protection()


def call_wrapper_parameters(fn: Callable[..., Any]) -> list[str]:
    """Names of ``fn``'s parameters that receive the :class:`CallWrapper` (annotated
    with it, see :mod:`inprocess.injection`)."""
    return parameters_of_type(fn, CallWrapper)


# --------------------------------------------------------------------------- the call


class CallWrapper:
    """One call of a wrapped function: its restart loop, state and controls.

    Passed to the wrapped function through any parameter annotated
    ``CallWrapper`` (or ``Optional[CallWrapper]``, ``CallWrapper | None``).
    """

    def __init__(self, wrapper: Wrapper) -> None:
        self.wrapper = wrapper
        self._config = wrapper.config
        #: every State that may hold this call's store (weakly), see _release_store:
        #: invariant, every State the call makes or is given is tracked (_track)
        self._states: dict[int, weakref.ref[State]] = {}
        self.state = State()
        self.identity = new_identity(self.state.initial_rank, incarnation_from_env())
        #: whether the job had started without this process (read once, by _start)
        self._late = False
        self._lock = threading.RLock()
        # Set up by _start (the call's resources, released by its cleanup):
        self._call_started: float | None = None
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
        self._finished_iteration: Iteration | None = None
        #: the iteration this rank left by RestartAbort (its peers abort there too)
        self._aborted_iteration: Iteration | None = None
        self._records = _records.Recorder(None, self.identity, "", 0)  # disabled until _start
        #: sys.excepthook when the call started (see call_setup.function_environment)
        self._excepthook = sys.excepthook
        #: the garbage collector's view of the call (see inprocess.reclaim), set up by _start
        self._heap: CallHeap | None = None
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
        (and a ``restore`` line in the restart records). See docs/training-state.md.
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
        _setup.warn_if_logging_is_off()
        try:
            return self._run(fn, args, kwargs)
        except BaseException as ex:
            # The call owns what it created: the frames of ours that the
            # caller's traceback holds must not keep a store (or its server) alive.
            _setup.clear_frames(ex, (_setup.PACKAGE_DIR,))
            self._on_terminate(ex)
            raise

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with contextlib.ExitStack() as cleanup:
            self._start(cleanup)
            if self._late:  # the job started without this process (relaunched): it joins
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
                # what the failed iteration made, freed before the next one
                _setup.reclaim_iteration(self._board, result.exception, self._heap)
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
        """Opens the call's store and starts what watches the call; ``cleanup`` stops
        and releases them, in reverse (see :mod:`inprocess.call_setup`)."""
        self._call_started = time.time()
        c = self._config
        # a failed iteration's garbage is collected at its restart (release_frames),
        # over what the call created only
        self._heap = CallHeap()
        cleanup.callback(self._heap.close)
        role, call = protocol.role_namespace(job_namespace()), next(_call_counter)
        self.namespace = protocol.call_namespace(role, call)
        raw = _setup.open_store(c, self.namespace, self.identity, c.barrier_timeout)
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
        persist_signal.install_in_rank()  # SIGUSR1 (the job ends soon): persist the next one
        cleanup.callback(self._snapshots.close)
        m = _setup.start_machinery(
            c,
            cleanup,
            identity=self.identity,
            initial_rank=self.state.initial_rank,
            namespace=self.namespace,
            raw=raw,
            store=self.store,
            lock=self._lock,
            on_monitor_restart=self._monitor_restarted,
        )
        self._board, self._relay, self._monitor_process = m.board, m.relay, m.monitor_process
        self._watchdog, self._interrupt, self._monitor = m.watchdog, m.interrupt, m.monitor

    def _call_identity(self) -> str:
        """This rank's identity in the call (see :func:`inprocess.call_setup.call_identity`)."""
        return _setup.call_identity(self.namespace, self.state.initial_rank, self._late)

    def _copy_state(self) -> State:
        return self._track(self.state.copy())

    def _release_store(self) -> None:
        """Drops every reference of ours to the store, so its connections (and a server
        this rank hosts) close now (see :func:`inprocess.call_setup.release_store`)."""
        self.store = None
        _setup.release_store(self._states, self._monitor)

    def _wait_for_exit_if_hosting(self, raw: Any) -> None:
        """The rank hosting the store keeps it up until every rank has left."""
        done, aborted = self._finished_iteration, self._aborted_iteration
        _setup.wait_for_exit_if_hosting(raw, self.store, self.identity, self._config, done, aborted)

    # ---------------------------------------------------------------- barriers

    def _barriers(self) -> Barriers:
        """The barriers (:mod:`inprocess.membership`) over what the call holds now."""
        return Barriers(
            self.store,
            self.identity,
            self._config,
            self._restart_poll,
            relay=self._relay,
            track=self._track,
            leave=self._terminate_self,
        )

    def _initial_barrier(self) -> protocol.Roster:
        """All launched ranks meet; returns their identities ordered by initial rank."""
        s = self.state
        return self._barriers().initial(self.namespace, s.initial_rank, s.initial_world_size)

    def _iteration_barrier(
        self,
        iteration: int,
        previous: State | None,
        prev_members: Sequence[str],
        terminated: set[str],
        joiners: list[str],
        following: protocol.Termination | None = None,
    ) -> Iteration:
        """Rank assignment, rank filter, then agreement on the new membership (see
        :meth:`inprocess.membership.Barriers.agree`); sets this rank's State in it."""
        w = self._config
        agreed = self._barriers().agree(
            iteration, previous, self.state, prev_members, terminated, joiners, following
        )
        members = agreed.members
        self.state = s = agreed.assigned
        s.store = self.store
        s.iteration = iteration
        # where it was, in the common case (nobody before it left): no search
        s.rank = members.position(self.identity, hint=s.rank)
        s.world_size = len(members)
        if w.generation is _gen.Generation.NEWER:
            # Its rank assignment decided the modes (its filters are steps of it).
            _gen.settle(s, agreed.planned, joined=previous is None)
        else:
            s.activate_all()
            if w.rank_filter is not None:
                self.state = s = w.rank_filter(s)
            s.apply_active_world_size()
        announce(self.store, self._board, self.identity, iteration, members, s)
        return Iteration(iteration, members, agreed.baseline)

    def _termination_barrier(self, current: Iteration) -> protocol.Termination:
        """Every member arrives or is terminated; decides who is out, who joins next
        and the restart's root cause (see :meth:`_log_root_cause`)."""
        decision = self._barriers().termination(current)
        self._restart_cause = decision.cause
        return decision

    def _log_root_cause(self, ex: BaseException | None) -> None:
        """Logs, in one line, the fault that started this restart: which rank, which error."""
        log_root_cause(self.identity, self.state.iteration, self._restart_cause, ex)

    # ---------------------------------------------------------------- one iteration

    def _run_iteration(
        self,
        current: Iteration,
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
            # A health check failing here is a fault of this iteration: it takes
            # the normal restart path (the check runs again after the fault).
            self.state = self._callbacks().health_check(self.state)
            # initialize and the health check may have returned a new State.
            self._records.function_starting(self.store, current, self.state)
            if self.state.mode == Mode.ACTIVE:
                with _setup.function_environment(
                    self.state, self.store, current.index, self._excepthook
                ):
                    outcome.value = fn(*args, **kwargs)
                self._watchdog.pause_manual()
            # from here on the iteration may complete: a fault restarts it only
            # once the outcome "fault" stands (see MonitorThread._interrupt)
            monitor.leave_function(armed)
            self._board.write_phase("completion_barrier")
            self._barriers().completion(current, self.state.mode == Mode.ACTIVE)
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
                self._aborted_iteration = current  # see call_setup.wait_for_peers_to_abort
                raise
            # on the bounded-unwind clock (see call_setup.release_frames)
            _setup.release_frames(self._board, result.exception)
            return result
        finally:
            self._board.write_unwind(0.0)  # back in the Wrapper: the unwind is over

    def _classify_fault(self, outcome: _Result, armed: _mt.Armed) -> _Result:
        """Tells the peers of the fault that ended this iteration here (see
        :meth:`inprocess.membership.Barriers.report_fault`); raises if this rank leaves."""
        s = self.state
        self._barriers().report_fault(s.iteration, outcome.exception, armed.cause)
        s.fn_exception = outcome.exception
        return outcome

    # ---------------------------------------------------------------- callbacks

    def _callbacks(self) -> Callbacks:
        """The user's callbacks (:mod:`inprocess.callbacks`); a failure ends this rank."""
        check = self.wrapper.restart_health_check or self._config.health_check
        return Callbacks(self._config, self.identity, check, self._terminate_self)

    def _initialize(self) -> None:
        self.state = self._callbacks().initialize(self.state)

    def _abort(self) -> None:
        self.state = self._callbacks().abort(self.state)

    def _finalize(self, ex: BaseException | None) -> None:
        self.state = self._callbacks().finalize(self.state, ex)

    def _health_check(self, ex: BaseException | None) -> None:
        """The check after a fault: failing it ends this rank with a ``HealthCheckError``."""
        self.state = self._callbacks().restart_health_check(self.state, ex)

    def _on_completion(self) -> None:
        self._callbacks().completion(self.state)

    def _on_terminate(self, ex: BaseException) -> None:
        self._callbacks().terminate(self.state, ex)

    def _terminate_self(self, reason: str) -> None:
        """Records that this rank leaves the job, so the others go on without it."""
        log.warning("%s: leaving the job: %s", self.identity, reason)
        with contextlib.suppress(Exception):
            self.store.mark_terminated(self.identity, reason)
        self._board.write_finished()

    # ---------------------------------------------------------------- joining a running job

    def _join(self) -> tuple[protocol.Roster, set[str], list[str], int] | None:
        """Asks to join and waits for the termination barrier that admits this rank
        (:meth:`inprocess.membership.Barriers.join`); ``None``: the job completed first."""
        admitted = self._barriers().join()
        if admitted is None:
            self._board.write_finished()
            return None
        record_join(self._records, self._monitor_process, self._call_started, admitted)
        return admitted.members, admitted.terminated, admitted.joiners, admitted.decided + 1

    # ---------------------------------------------------------------- completion

    def _monitor_restarted(self, monitor: MonitorProcess, pid: int, reason: str) -> None:
        """A fault of the machinery, not of training: recorded, no restart."""
        c, rank = self._config, self.state.initial_rank
        _setup.monitor_restarted(self.identity, c, rank, self.store, monitor, pid, reason)

    def _finish(self, current: Iteration) -> None:
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
