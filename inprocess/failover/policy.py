"""Failover policy: every decision of the job controller, as pure functions.

The controller observes worker processes and reports, and executes actions;
this module decides. Each function takes a :class:`~.state.JobState` (never
modified) and returns a new state, most as a :class:`Decision` ``(state,
actions)``. No I/O, no clock: the caller passes ``now`` (seconds, e.g.
``time.time()``), which is stored as ``updated_at`` and in the event log.

How the controller uses it (one thread, one event at a time)::

    state = new_job_state(spec, now=t);  store.create(state)
    state, actions = start_job(state, now=t);  store.save(state);  execute(actions)
    loop:
        event = next observed exit (WorkerExited) or self-report (WorkerReported)
        state, actions = handle_event(state, event, now=t)
        store.save(state)          # before acting: a crash then resumes correctly
        execute(actions)           # in order; each start -> worker_started(...) + save

Whenever a function returns a new state object, save it before acting on it
(an unchanged state comes back as the same object). ``set_wrapper_managed``
records, once known, whether failover is warm (role level) or cold (job
level). Watch the processes, not only the reports: a lost report must not
leave a dead worker unnoticed; both kinds of event are deduplicated here.
After its own crash the controller loads the state and calls :func:`recover`.

Decision rules for one event (:func:`handle_event`), in this order:

1. The job is not RUNNING: ignored (a cold restart or a stop is in progress;
   the controller is stopping processes itself).
2. Unknown worker, or an incarnation other than the worker's latest: ignored
   (stale: that process was replaced already).
3. The failure ``worker:incarnation`` was already handled, or the incarnation
   has already ended: ignored. An exit and a self-report of one failure are
   thus handled once, whichever comes first.
4. The worker was being stopped on purpose (status ``stopping``: node
   relaunch): not a failure and not a success, whatever the exit code (a worker
   may exit 0 on SIGTERM). Its node's failure count was reset when the relaunch
   was decided.
5. Exit code 0: the worker succeeded; when all have, the job stops with code 0.
   A worker that reported leaving on purpose (``WorkerReported(restartable=False)``:
   its Wrapper ended with ``RestartAbort``, i.e. the job's own restart policy,
   such as ``RetryController``, gave up) is not a failure to retry: it is
   marked ``aborted`` and never relaunched (relaunching it would only override
   that decision, or wait to rejoin a job that is ending). Once no worker is
   left running, the job stops with code 0 if all succeeded, else with a
   failing code and the abort's reason.
6. Otherwise a failure: counted once per worker and per node, then
   a. worker failures > ``max_restarts``: stop;
   b. node failures > ``per_node_max_failures``: relaunch the node (to a free
      spare slot, else in place) if ``node_max_relaunches`` allows, else stop;
   c. wrapper-managed role: relaunch this worker alone (warm, it rejoins);
   d. otherwise a cold restart of the whole job if ``job_max_restarts`` allows
      (a node relaunch decided in b. is carried out by this restart), else stop.

Two job-level events end a generation that can no longer make progress:

* :class:`StoreLost`: the generation's store server died (or hung). Every key
  of the Wrapper's protocol went with it, so no worker can be relaunched into
  it: a cold restart (a new generation with a fresh store) if
  ``job_max_restarts`` allows, else stop.
* :class:`NoLiveMember`: a Wrapper-managed generation has no live member left
  (every member ended: hard timeouts, ``RestartAbort``, kills); relaunched
  workers would wait forever to be admitted by nobody. If a worker left with
  ``RestartAbort``, the job stops with that reason (its restart policy gave up
  and a cold restart would silently reset it); otherwise a cold restart if
  ``job_max_restarts`` allows, else stop.

A started worker of a Wrapper-managed job must *join* it within its deadline
(:class:`JoinOverdue`, found by :func:`overdue_joins`): arrive at the initial
barrier, ask to join the running job, or be listed as a member; the controller
reports what it sees with :func:`worker_joined`. A process that never gets
there (a stopped standby, a script stuck before its wrapped call) would
otherwise hold its worker's place forever, the job waiting for it. The deadline
is set at the start (:func:`worker_started`): ``spec.join_timeout`` for a fresh
spawn, the shorter ``spec.standby_join_timeout`` for a warm standby. An overdue
worker is replaced by a fresh process (stopped on purpose, not counted as a
failure: its code may never have run); a replacement that does not join in turn
ends the job.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal as signal_module
from collections.abc import Collection
from typing import NamedTuple

from .spec import JobSpec
from .state import (
    GPU_FAULT_EXIT_CODE,
    FailureKey,
    JobState,
    Stage,
    WorkerRecord,
    WorkerStatus,
    failure_key,
)

__all__ = [
    "FAILURE_EXIT_CODE",
    "STAGE_TRANSITIONS",
    "Action",
    "Decision",
    "Event",
    "Ignore",
    "JoinOverdue",
    "NoLiveMember",
    "NodeLost",
    "PolicyError",
    "RelaunchNode",
    "RelaunchWorker",
    "RestartJob",
    "Resume",
    "SlotBack",
    "StartJob",
    "StopJob",
    "StoreLost",
    "WorkerExited",
    "WorkerReported",
    "check_state",
    "handle_event",
    "new_job_state",
    "overdue_joins",
    "recover",
    "request_stop",
    "set_wrapper_managed",
    "start_job",
    "stopped",
    "worker_joined",
    "worker_started",
]

logger = logging.getLogger(__name__)

#: exit code of a job stopped by a failure (limits, crash recovery, inconsistency)
FAILURE_EXIT_CODE = 1

#: stage -> stages it may move to; staying in the same stage is always allowed
STAGE_TRANSITIONS: dict[Stage, frozenset[Stage]] = {
    Stage.INIT: frozenset({Stage.READY, Stage.STOPPING}),
    Stage.READY: frozenset({Stage.RUNNING, Stage.STOPPING}),
    Stage.RUNNING: frozenset({Stage.READY, Stage.STOPPING}),
    Stage.STOPPING: frozenset({Stage.STOPPED}),
    Stage.STOPPED: frozenset(),
}


class PolicyError(ValueError):
    """A policy function was called with arguments that do not fit the state."""


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PolicyError(f"{name} must be an integer >= {minimum}, got {value!r}")


# -- events: what the controller observed -----------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerExited:
    """The controller saw the process of ``worker``'s ``incarnation`` end.

    ``exit_code`` and ``signal`` are both ``None`` when the process vanished
    without a known status (e.g. it died while the controller was down).
    """

    worker: int
    incarnation: int
    exit_code: int | None = None
    signal: int | None = None
    #: set (how) when it ended with a process of the job's machinery (its standby
    #: zygote, killed with it): a fault of the machinery, not counted as the worker's
    machinery: str | None = None
    #: whether the process had a GPU (``None``: not known); only then does its
    #: :data:`GPU_FAULT_EXIT_CODE` say that its GPU faulted
    gpu: bool | None = None

    def __post_init__(self) -> None:
        _check_int("WorkerExited.worker", self.worker, 0)
        if self.gpu is not None and not isinstance(self.gpu, bool):
            raise PolicyError(f"WorkerExited.gpu must be True, False or None, got {self.gpu!r}")
        if self.machinery is not None and (
            not isinstance(self.machinery, str) or not self.machinery
        ):
            raise PolicyError(
                f"WorkerExited.machinery must be a non-empty string or None, got {self.machinery!r}"
            )
        _check_int("WorkerExited.incarnation", self.incarnation, 0)
        if self.exit_code is not None and (
            isinstance(self.exit_code, bool) or not isinstance(self.exit_code, int)
        ):
            raise PolicyError(
                f"WorkerExited.exit_code must be an integer or None, got {self.exit_code!r}"
            )
        if self.signal is not None:
            _check_int("WorkerExited.signal", self.signal, 1)

    def describe(self) -> str:
        """How the process ended, for messages."""
        if self.signal is not None:
            try:
                name = signal_module.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"was killed by {name}"
        if self.exit_code == GPU_FAULT_EXIT_CODE and self.gpu is not False:
            if self.gpu:
                return f"exited with code {self.exit_code} (its GPU faulted)"
            return (
                f"exited with code {self.exit_code} (the code of a worker whose GPU "
                "faulted, if it had one)"
            )
        if self.exit_code is not None:
            return f"exited with code {self.exit_code}"
        return "ended with an unknown exit status"


@dataclasses.dataclass(frozen=True)
class WorkerReported:
    """``worker``'s ``incarnation`` reported a failure of itself (through the store).

    The process may still be alive; a relaunch kills it first.
    """

    worker: int
    incarnation: int
    reason: str
    #: False when the worker left on purpose (``RestartAbort``): never relaunched
    restartable: bool = True

    def __post_init__(self) -> None:
        _check_int("WorkerReported.worker", self.worker, 0)
        _check_int("WorkerReported.incarnation", self.incarnation, 0)
        if not isinstance(self.reason, str):
            raise PolicyError(f"WorkerReported.reason must be a string, got {self.reason!r}")
        if not isinstance(self.restartable, bool):
            raise PolicyError(
                f"WorkerReported.restartable must be True or False, got {self.restartable!r}"
            )

    def describe(self) -> str:
        if not self.restartable:
            return f"left the job ({self.reason})"
        return f"reported a failure ({self.reason})"


@dataclasses.dataclass(frozen=True)
class StoreLost:
    """The store server of ``generation`` died or hung (``reason`` says how)."""

    generation: int
    reason: str

    def __post_init__(self) -> None:
        _check_int("StoreLost.generation", self.generation, 0)
        if not isinstance(self.reason, str) or not self.reason:
            raise PolicyError(f"StoreLost.reason must be a non-empty string, got {self.reason!r}")


@dataclasses.dataclass(frozen=True)
class NoLiveMember:
    """The Wrapper job of ``generation`` has no live member left (``reason`` says who ended)."""

    generation: int
    reason: str

    def __post_init__(self) -> None:
        _check_int("NoLiveMember.generation", self.generation, 0)
        if not isinstance(self.reason, str) or not self.reason:
            raise PolicyError(
                f"NoLiveMember.reason must be a non-empty string, got {self.reason!r}"
            )


@dataclasses.dataclass(frozen=True)
class NodeLost:
    """The machine that ran node ``node`` on slot ``slot`` is gone (``reason`` says how),
    with every worker it ran."""

    node: int
    slot: int
    reason: str

    def __post_init__(self) -> None:
        _check_int("NodeLost.node", self.node, 0)
        _check_int("NodeLost.slot", self.slot, 0)
        if not isinstance(self.reason, str) or not self.reason:
            raise PolicyError(f"NodeLost.reason must be a non-empty string, got {self.reason!r}")


@dataclasses.dataclass(frozen=True)
class JoinOverdue:
    """``worker``'s ``incarnation`` has not joined the Wrapper job ``waited`` seconds
    after its start, past its deadline (see :func:`overdue_joins`)."""

    worker: int
    incarnation: int
    waited: float

    def __post_init__(self) -> None:
        _check_int("JoinOverdue.worker", self.worker, 0)
        _check_int("JoinOverdue.incarnation", self.incarnation, 0)
        if (
            isinstance(self.waited, bool)
            or not isinstance(self.waited, int | float)
            or not math.isfinite(self.waited)
            or self.waited < 0
        ):
            raise PolicyError(
                f"JoinOverdue.waited must be a finite number of seconds >= 0, got {self.waited!r}"
            )


@dataclasses.dataclass(frozen=True)
class SlotBack:
    """A machine is on node slot ``slot`` again (``how``: e.g. a requeued machine
    joined): a slot given up after its machine was lost is a spare once more."""

    slot: int
    how: str

    def __post_init__(self) -> None:
        _check_int("SlotBack.slot", self.slot, 0)
        if not isinstance(self.how, str) or not self.how:
            raise PolicyError(f"SlotBack.how must be a non-empty string, got {self.how!r}")


Event = WorkerExited | WorkerReported | StoreLost | NoLiveMember | NodeLost | JoinOverdue | SlotBack


# -- actions: what the controller must do next ------------------------------


@dataclasses.dataclass(frozen=True)
class StartJob:
    """Start every worker (a new incarnation each) on its node's slot.

    Call :func:`worker_started` for each; the job becomes RUNNING by itself
    when the last one is started.
    """

    generation: int


@dataclasses.dataclass(frozen=True)
class RelaunchWorker:
    """Warm, role-level failover: replace one worker's process.

    Make sure the process of its latest incarnation is gone (it may still be
    alive after a self-report: check pid and ``pid_start_time``, kill it), then
    start a new incarnation on ``slot``; it rejoins the running job. ``fresh``:
    a newly spawned process, never a warm standby (the one it replaces was one
    that never joined).
    """

    worker: int
    slot: int
    fresh: bool = False


@dataclasses.dataclass(frozen=True)
class RelaunchNode:
    """Move node ``node`` from ``from_slot`` to ``to_slot`` (equal: in place).

    Stop every live process of ``workers`` (they are marked ``stopping``, so
    their exits are not failures), then start each of them on ``to_slot``. The
    node's relaunch is finished once all of them are started (tracked by
    :func:`worker_started`). Workers of the node that already succeeded are not
    in ``workers``.
    """

    node: int
    from_slot: int
    to_slot: int
    workers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RestartJob:
    """Cold, job-level failover: stop every live worker process, then start all
    workers again (generation ``generation``), each on its node's slot in the
    state (a node relaunch decided with this restart has already moved it)."""

    reason: str
    generation: int


@dataclasses.dataclass(frozen=True)
class StopJob:
    """Stop every live worker process, call :func:`stopped`, and exit with ``exit_code``."""

    exit_code: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Resume:
    """After :func:`recover`: re-attach to the workers recorded as running.

    For each, check that its pid is alive with the recorded start time; if not,
    feed ``WorkerExited(worker, incarnation)`` (unknown status) to
    :func:`handle_event` so the loss counts as a failure.
    """


@dataclasses.dataclass(frozen=True)
class Ignore:
    """Nothing to do; ``reason`` says why (for logs)."""

    reason: str


Action = StartJob | RelaunchWorker | RelaunchNode | RestartJob | StopJob | Resume | Ignore


class Decision(NamedTuple):
    """New state and the actions to execute, in order, after saving it.

    When nothing changed (always the case for :class:`Ignore`), ``state`` is
    the very object that was passed in and need not be saved; otherwise save
    it before executing ``actions`` (which may be empty).
    """

    state: JobState
    actions: list[Action]


# -- small shared steps -----------------------------------------------------


def _changed(state: JobState, now: float) -> JobState:
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise PolicyError(f"now must be a finite number of seconds, got {now!r}")
    new = state.copy()
    new.updated_at = float(now)
    return new


def _ignore(state: JobState, reason: str, level: int = logging.DEBUG) -> Decision:
    logger.log(level, "job %s: %s", state.job_id, reason)
    return Decision(state, [Ignore(reason)])


def _mark_running_as_stopping(state: JobState, workers: Collection[int] | None = None) -> None:
    """Workers whose process runs (all, or those in ``workers``) will be stopped on purpose."""
    for w, record in state.workers.items():
        if (workers is None or w in workers) and record.status is WorkerStatus.RUNNING:
            record.status = WorkerStatus.STOPPING


def _no_cold_restart_left(new: JobState, spec: JobSpec, what: str, now: float) -> Decision:
    """The job fails: ``what`` happened and every cold restart is used."""
    return _stop(
        new,
        FAILURE_EXIT_CODE,
        f"{what}; no cold restart left: job_max_restarts={spec.job_max_restarts} used",
        now,
    )


def _stop(state: JobState, exit_code: int, reason: str, now: float) -> Decision:
    """Move ``state`` (already a copy) to STOPPING with the job's result."""
    state.stage = Stage.STOPPING
    state.exit_code = exit_code
    state.reason = reason
    _mark_running_as_stopping(state)
    state.log_event("stop", f"stopping the job with exit code {exit_code}: {reason}", now)
    level = logging.INFO if exit_code == 0 else logging.ERROR
    logger.log(level, "job %s: stopping, exit code %d: %s", state.job_id, exit_code, reason)
    return Decision(state, [StopJob(exit_code, reason)])


def _count_failure(state: JobState, worker: int, key: str) -> tuple[int, int]:
    """The one place failures are counted; returns (worker failures, node failures)."""
    node = state.workers[worker].node
    state.handled_failures.add(key)
    state.worker_restarts[worker] = state.worker_restarts.get(worker, 0) + 1
    state.node_failures[node] = state.node_failures.get(node, 0) + 1
    return state.worker_restarts[worker], state.node_failures[node]


def _free_spare_slot(state: JobState) -> int | None:
    used = set(state.node_slots.values()) | set(state.removed_slots)
    free = [s for s in range(state.spec.num_slots) if s not in used]
    return min(free) if free else None


def _move_node(state: JobState, node: int, now: float) -> tuple[int, int]:
    """Decide a node relaunch: new slot, counters, in-progress marker."""
    from_slot = state.node_slots[node]
    spare = _free_spare_slot(state)
    to_slot = from_slot if spare is None else spare
    if to_slot != from_slot:
        state.removed_slots.append(from_slot)
        state.node_slots[node] = to_slot
    state.node_relaunches += 1
    state.node_failures[node] = 0
    state.relaunching_nodes.add(node)
    where = (
        f"from slot {from_slot} to spare slot {to_slot}"
        if spare is not None
        else f"in place on slot {from_slot} (no free spare slot)"
    )
    state.log_event(
        "node_relaunch",
        f"relaunching node {node} {where} (relaunch {state.node_relaunches} of "
        f"node_max_relaunches={state.spec.node_max_relaunches})",
        now,
    )
    return from_slot, to_slot


def _restart_job(state: JobState, reason: str, now: float) -> Decision:
    """Decide a cold restart (``state`` is a copy, stage RUNNING)."""
    state.job_restarts += 1
    state.generation += 1
    state.stage = Stage.READY
    _mark_running_as_stopping(state)
    reason = (
        f"{reason}; cold restart {state.job_restarts} of "
        f"job_max_restarts={state.spec.job_max_restarts}"
    )
    state.log_event("job_restart", reason, now)
    logger.warning("job %s: restarting all workers: %s", state.job_id, reason)
    return Decision(state, [RestartJob(reason, state.generation)])


# -- building and starting a job --------------------------------------------


def new_job_state(spec: JobSpec, *, now: float) -> JobState:
    """The first state of a new job: stage INIT, node ``n`` on slot ``n``,
    every worker pending (incarnation -1), all counters zero."""
    if not isinstance(spec, JobSpec):
        raise PolicyError(f"spec must be a JobSpec, got {type(spec).__name__}")
    state = JobState(job_id=spec.job_id, spec=spec)
    state.node_slots = {n: n for n in range(spec.nnodes)}
    state.node_failures = {n: 0 for n in range(spec.nnodes)}
    state.worker_restarts = {w: 0 for w in range(spec.world_size)}
    state.workers = {
        w: WorkerRecord(node=spec.node_of(w), slot=spec.node_of(w)) for w in range(spec.world_size)
    }
    state = _changed(state, now)
    state.log_event(
        "create",
        f"job created: {spec.nnodes} node(s) x {spec.nproc_per_node} worker(s), "
        f"{spec.spare_nodes} spare node slot(s)",
        now,
    )
    return state


def start_job(state: JobState, *, now: float) -> Decision:
    """INIT -> READY: the controller starts every worker ([:class:`StartJob`])."""
    if state.stage is not Stage.INIT:
        raise PolicyError(f"start_job needs stage INIT, the job is {state.stage.value}")
    new = _changed(state, now)
    new.stage = Stage.READY
    new.log_event("start", f"starting {len(new.workers)} worker(s)", now)
    return Decision(new, [StartJob(new.generation)])


def set_wrapper_managed(state: JobState, managed: bool, *, now: float) -> JobState:
    """Record whether the role runs under the in-process Wrapper (warm failover)."""
    if not isinstance(managed, bool):
        raise PolicyError(f"managed must be True or False, got {managed!r}")
    if state.wrapper_managed is managed:
        return state
    new = _changed(state, now)
    new.wrapper_managed = managed
    mode = "role level (warm)" if managed else "job level (cold)"
    new.log_event("mode", f"failover at {mode}", now)
    return new


def worker_started(
    state: JobState,
    worker: int,
    *,
    pid: int,
    start_time: float,
    now: float,
    warm: bool = False,
) -> JobState:
    """Record a new incarnation of ``worker``: process ``pid`` started at ``start_time``
    (``warm``: a warm standby took its place; its deadline to join is the shorter one).

    Allowed in READY and RUNNING, for a worker not recorded as running. Also
    finishes what the start completes: a node relaunch ends when all its
    (not succeeded) workers run, and READY becomes RUNNING when every worker
    runs in the current generation. So no in-progress marker can be left set
    by a controller that forgets to clear it.
    """
    if state.stage not in (Stage.READY, Stage.RUNNING):
        raise PolicyError(
            f"worker_started needs stage READY or RUNNING, the job is {state.stage.value}"
        )
    record = state.workers.get(worker)
    if record is None:
        raise PolicyError(
            f"worker must be an integer in 0..{state.spec.world_size - 1}, got {worker!r}"
        )
    if record.status is WorkerStatus.RUNNING:
        raise PolicyError(
            f"worker {worker} is recorded as running (incarnation {record.incarnation}, "
            f"pid {record.pid}); its exit must be handled before it is started again"
        )
    _check_int("pid", pid, 1)
    if (
        isinstance(start_time, bool)
        or not isinstance(start_time, int | float)
        or not math.isfinite(start_time)
    ):
        raise PolicyError(f"start_time must be a finite number, got {start_time!r}")
    if not isinstance(warm, bool):
        raise PolicyError(f"warm must be True or False, got {warm!r}")

    new = _changed(state, now)
    rec = new.workers[worker]
    rec.incarnation += 1
    rec.pid = pid
    rec.pid_start_time = float(start_time)
    rec.status = WorkerStatus.RUNNING
    rec.exit_code = None
    rec.signal = None
    rec.generation = new.generation
    rec.slot = new.node_slots[rec.node]
    rec.started_at = float(now)
    rec.join_timeout = new.spec.standby_join_timeout if warm else new.spec.join_timeout
    rec.joined = False
    new.log_event(
        "worker_start",
        f"worker {worker} incarnation {rec.incarnation} started on slot {rec.slot} (pid {pid}"
        f"{', a warm standby' if warm else ''})",
        now,
    )

    if new.stage is Stage.RUNNING and rec.node in new.relaunching_nodes:
        node_workers = new.spec.workers_of(rec.node)
        if all(
            new.workers[w].status
            in (WorkerStatus.RUNNING, WorkerStatus.SUCCEEDED, WorkerStatus.ABORTED)
            for w in node_workers
        ):
            new.relaunching_nodes.discard(rec.node)
            new.log_event("node_relaunched", f"node {rec.node} relaunched on slot {rec.slot}", now)
    if new.stage is Stage.READY and all(
        r.status is WorkerStatus.RUNNING and r.generation == new.generation
        for r in new.workers.values()
    ):
        new.stage = Stage.RUNNING
        new.relaunching_nodes.clear()
        new.log_event("running", f"all workers of generation {new.generation} started", now)
        logger.info("job %s: generation %d running", new.job_id, new.generation)
    return new


def worker_joined(state: JobState, worker: int, incarnation: int, *, now: float) -> JobState:
    """Record that ``worker``'s ``incarnation`` was seen in the Wrapper job (at its
    initial barrier, asking to join, or as a member): its deadline to join is met.

    The same state comes back when there is nothing to record (joined already,
    an older incarnation, a worker not running).
    """
    record = state.workers.get(worker)
    if (
        record is None
        or record.incarnation != incarnation
        or record.status is not WorkerStatus.RUNNING
        or record.joined
    ):
        return state
    new = _changed(state, now)
    rec = new.workers[worker]
    rec.joined = True
    rec.join_misses = 0
    waited = f" {now - rec.started_at:.1f}s after its start" if rec.started_at is not None else ""
    new.log_event("worker_joined", f"worker {worker} incarnation {incarnation} joined{waited}", now)
    return new


def overdue_joins(state: JobState, *, now: float) -> list[JoinOverdue]:
    """The running workers of a Wrapper-managed job that have not joined it within
    their deadline (``join_timeout`` seconds after ``started_at``), in worker order.

    Nothing while the job is not RUNNING or not known to run under the Wrapper
    (a plain script never joins anything).
    """
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise PolicyError(f"now must be a finite number of seconds, got {now!r}")
    if state.stage is not Stage.RUNNING or state.wrapper_managed is not True:
        return []
    overdue = []
    for w, r in sorted(state.workers.items()):
        if r.status is not WorkerStatus.RUNNING or r.joined or r.started_at is None:
            continue
        if r.join_timeout and now - r.started_at > r.join_timeout:
            overdue.append(JoinOverdue(w, r.incarnation, max(0.0, now - r.started_at)))
    return overdue


def _join_overdue(state: JobState, event: JoinOverdue, now: float) -> Decision:
    """A worker that did not join in time: replaced by a fresh process, once in a row."""
    w, inc = event.worker, event.incarnation
    what = f"worker {w} incarnation {inc} did not join the job {event.waited:.0f}s after its start"
    record = state.workers.get(w)
    if state.stage is not Stage.RUNNING:
        return _ignore(state, f"{what} while the job is {state.stage.value}: ignored")
    if record is None or record.incarnation != inc:
        return _ignore(state, f"{what}: stale or unknown: ignored")
    if record.status is not WorkerStatus.RUNNING or record.joined:
        return _ignore(state, f"{what}: it is {record.status.value}, joined={record.joined}")
    if state.wrapper_managed is not True:
        return _ignore(state, f"{what}: the job does not run under the Wrapper: ignored")
    new = _changed(state, now)
    rec = new.workers[w]
    limit = f"join deadline {rec.join_timeout:g}s" if rec.join_timeout else "no deadline"
    if rec.join_misses >= 1:
        rec.join_misses += 1
        return _stop(
            new,
            FAILURE_EXIT_CODE,
            f"{what} ({limit}), and it replaced an incarnation that did not join either: "
            "check its log for what it waits on before the wrapped call",
            now,
        )
    rec.join_misses += 1
    rec.status = WorkerStatus.STOPPING  # killed on purpose: its exit is no failure
    slot = new.node_slots[rec.node]
    text = f"{what} ({limit}): replacing it with a fresh process on slot {slot}"
    new.log_event("worker_join_overdue", text, now)
    logger.warning("job %s: %s", new.job_id, text)
    return Decision(new, [RelaunchWorker(w, slot, fresh=True)])


# -- the failover decision --------------------------------------------------


def _aborted(state: JobState) -> list[int]:
    return sorted(w for w, r in state.workers.items() if r.status is WorkerStatus.ABORTED)


def _abort_reason(state: JobState) -> str:
    """Why the job's own restart policy gave up: the last worker that left on purpose."""
    for event in reversed(state.events):
        if event["kind"] == "worker_aborted":
            return event["message"]
    return f"workers {_aborted(state)} left the job on purpose"


def _settle(state: JobState, now: float) -> Decision:
    """After a worker ended for good: stop once no worker is left to wait for."""
    ended = (WorkerStatus.SUCCEEDED, WorkerStatus.ABORTED)
    if not all(r.status in ended for r in state.workers.values()):
        return Decision(state, [])
    if not _aborted(state):
        return _stop(state, 0, f"completed: all {len(state.workers)} workers succeeded", now)
    return _stop(state, FAILURE_EXIT_CODE, _abort_reason(state), now)


def _generation_lost(state: JobState, event: StoreLost | NoLiveMember, now: float) -> Decision:
    """A generation that cannot progress: cold restart within the limits, else stop."""
    if state.stage is not Stage.RUNNING:
        return _ignore(state, f"{event.reason} while the job is {state.stage.value}: ignored")
    if event.generation != state.generation:
        return _ignore(state, f"{event.reason} (generation {event.generation}): stale, ignored")
    new = _changed(state, now)
    kind = "store_lost" if isinstance(event, StoreLost) else "no_live_member"
    new.log_event(kind, event.reason, now)
    if _aborted(new):
        return _stop(
            new,
            FAILURE_EXIT_CODE,
            f"{event.reason}; not restarted because {_abort_reason(new)}",
            now,
        )
    if new.job_restarts >= new.spec.job_max_restarts:
        return _stop(
            new,
            FAILURE_EXIT_CODE,
            f"{event.reason}; no cold restart left: job_max_restarts="
            f"{new.spec.job_max_restarts} used",
            now,
        )
    return _restart_job(new, event.reason, now)


def _node_lost(state: JobState, event: NodeLost, now: float) -> Decision:
    """A node's machine is gone: relaunch the node (not a failure) within the limits."""
    what = f"node {event.node} lost (slot {event.slot}): {event.reason}"
    if state.stage is not Stage.RUNNING:
        return _ignore(state, f"{what} while the job is {state.stage.value}: ignored")
    if event.node not in state.node_slots:
        return _ignore(state, f"{what}: no such node: ignored", logging.WARNING)
    if state.node_slots[event.node] != event.slot:
        return _ignore(state, f"{what}: stale, the node is on slot {state.node_slots[event.node]}")
    new = _changed(state, now)
    new.log_event("node_lost", what, now)
    logger.warning("job %s: %s", new.job_id, what)
    spec = new.spec
    ended = (WorkerStatus.SUCCEEDED, WorkerStatus.ABORTED)
    workers = tuple(x for x in spec.workers_of(event.node) if new.workers[x].status not in ended)
    if not workers:
        return Decision(new, [])
    if new.node_relaunches >= spec.node_max_relaunches:
        return _stop(
            new,
            FAILURE_EXIT_CODE,
            f"{what}; all node_max_relaunches={spec.node_max_relaunches} node relaunches are used",
            now,
        )
    if new.wrapper_managed is True:
        from_slot, to_slot = _move_node(new, event.node, now)
        _mark_running_as_stopping(new, set(workers))
        return Decision(new, [RelaunchNode(event.node, from_slot, to_slot, workers)])
    if new.job_restarts >= spec.job_max_restarts:
        return _no_cold_restart_left(new, spec, what, now)
    from_slot, to_slot = _move_node(new, event.node, now)
    return _restart_job(new, f"{what}; moved from slot {from_slot} to slot {to_slot}", now)


def _slot_back(state: JobState, event: SlotBack, now: float) -> Decision:
    """A lost slot has a machine again: the next node relaunch may move there."""
    what = f"node slot {event.slot} has a machine again ({event.how})"
    if event.slot not in state.removed_slots:
        return _ignore(state, f"{what}: it was not given up: nothing to do")
    if event.slot in state.node_slots.values():
        return _ignore(state, f"{what}: a node runs on it already")
    new = _changed(state, now)
    new.removed_slots.remove(event.slot)
    new.log_event("slot_back", f"{what}: a spare slot again", now)
    logger.info("job %s: %s: a spare slot again", new.job_id, what)
    return Decision(new, [])


def handle_event(state: JobState, event: Event, *, now: float) -> Decision:
    """Decide what a worker exit or failure report means (rules in the module doc)."""
    if isinstance(event, StoreLost | NoLiveMember):
        return _generation_lost(state, event, now)
    if isinstance(event, NodeLost):
        return _node_lost(state, event, now)
    if isinstance(event, JoinOverdue):
        return _join_overdue(state, event, now)
    if isinstance(event, SlotBack):
        return _slot_back(state, event, now)
    if not isinstance(event, WorkerExited | WorkerReported):
        raise PolicyError(
            "event must be WorkerExited, WorkerReported, StoreLost, NoLiveMember, NodeLost, "
            f"JoinOverdue or SlotBack, got {type(event).__name__}"
        )
    w, inc = event.worker, event.incarnation
    what = f"worker {w} incarnation {inc} {event.describe()}"

    # 1-3: events that change nothing
    if state.stage is not Stage.RUNNING:
        return _ignore(state, f"{what} while the job is {state.stage.value}: ignored")
    record = state.workers.get(w)
    if record is None:
        return _ignore(state, f"{what}: no such worker: ignored", logging.WARNING)
    if inc < record.incarnation:
        return _ignore(state, f"{what}: stale, incarnation {record.incarnation} is current")
    if inc > record.incarnation:
        return _ignore(
            state,
            f"{what}: incarnation never started (latest is {record.incarnation}): ignored",
            logging.WARNING,
        )
    key = failure_key(w, inc)
    if key in state.handled_failures:
        return _ignore(state, f"{what}: failure {key} already handled")
    if record.status not in (WorkerStatus.RUNNING, WorkerStatus.STOPPING):
        return _ignore(state, f"{what}: incarnation already ended ({record.status.value})")

    # 4: stopped on purpose (node relaunch)
    if record.status is WorkerStatus.STOPPING:
        if isinstance(event, WorkerReported):
            return _ignore(state, f"{what}: being stopped on purpose: ignored")
        new = _changed(state, now)
        rec = new.workers[w]
        rec.status = WorkerStatus.PENDING
        rec.exit_code, rec.signal = event.exit_code, event.signal
        new.log_event("worker_stopped", f"{what} (stopped on purpose, not a failure)", now)
        return Decision(new, [])

    # 5: success, or left on purpose
    if isinstance(event, WorkerExited) and event.exit_code == 0:
        new = _changed(state, now)
        rec = new.workers[w]
        rec.status = WorkerStatus.SUCCEEDED
        rec.exit_code, rec.signal = 0, None
        new.log_event("worker_succeeded", f"worker {w} incarnation {inc} succeeded", now)
        return _settle(new, now)
    if isinstance(event, WorkerReported) and not event.restartable:
        new = _changed(state, now)
        new.workers[w].status = WorkerStatus.ABORTED
        new.log_event("worker_aborted", f"{what}: not relaunched", now)
        logger.warning("job %s: %s: not relaunched", new.job_id, what)
        if new.wrapper_managed is not True:  # job level: the job cannot go on without it
            return _stop(new, FAILURE_EXIT_CODE, _abort_reason(new), now)
        return _settle(new, now)

    # 5b: ended with the machinery (its zygote killed with it) under the Wrapper:
    # relaunched, nothing counted (no failure key: the relaunch's new incarnation
    # makes any later event of this one stale)
    if (
        isinstance(event, WorkerExited)
        and event.machinery is not None
        and state.wrapper_managed is True
    ):
        new = _changed(state, now)
        rec = new.workers[w]
        rec.status = WorkerStatus.FAILED
        rec.exit_code, rec.signal = event.exit_code, event.signal
        slot = new.node_slots[rec.node]
        text = f"{what} ({event.machinery}: a fault of the machinery, not counted)"
        new.log_event("worker_machinery_fault", text, now)
        logger.warning("job %s: %s: relaunching it on slot %d", new.job_id, text, slot)
        return Decision(new, [RelaunchWorker(w, slot)])

    # 6: a failure
    new = _changed(state, now)
    rec = new.workers[w]
    rec.status = WorkerStatus.FAILED
    if isinstance(event, WorkerExited):
        rec.exit_code, rec.signal = event.exit_code, event.signal
    node = rec.node
    worker_failures, node_failures = _count_failure(new, w, key)
    spec = new.spec
    new.log_event(
        "worker_failed",
        f"{what} (failure {worker_failures} of worker {w}, {node_failures} of node {node})",
        now,
    )
    logger.warning("job %s: %s", new.job_id, what)

    # 6a
    if worker_failures > spec.max_restarts:
        return _stop(
            new,
            FAILURE_EXIT_CODE,
            f"worker {w} failed {worker_failures} times, more than max_restarts="
            f"{spec.max_restarts} (last: {event.describe()})",
            now,
        )

    # 6b
    relaunch_node = node_failures > spec.per_node_max_failures
    if relaunch_node and new.node_relaunches >= spec.node_max_relaunches:
        return _stop(
            new,
            FAILURE_EXIT_CODE,
            f"node {node} failed {node_failures} times, more than per_node_max_failures="
            f"{spec.per_node_max_failures}, and all node_max_relaunches="
            f"{spec.node_max_relaunches} node relaunches are used",
            now,
        )
    managed = new.wrapper_managed is True
    if relaunch_node and managed:
        from_slot, to_slot = _move_node(new, node, now)
        _mark_running_as_stopping(new, set(spec.workers_of(node)))
        ended = (WorkerStatus.SUCCEEDED, WorkerStatus.ABORTED)
        workers = tuple(x for x in spec.workers_of(node) if new.workers[x].status not in ended)
        logger.warning(
            "job %s: node %d failed %d times: relaunching it on slot %d",
            new.job_id,
            node,
            node_failures,
            to_slot,
        )
        return Decision(new, [RelaunchNode(node, from_slot, to_slot, workers)])

    # 6c
    if managed:
        slot = new.node_slots[node]
        new.log_event("worker_relaunch", f"relaunching worker {w} on slot {slot}", now)
        logger.info("job %s: relaunching worker %d (role-level failover)", new.job_id, w)
        return Decision(new, [RelaunchWorker(w, slot)])

    # 6d
    if new.job_restarts >= spec.job_max_restarts:
        return _no_cold_restart_left(new, spec, what, now)
    reason = what
    if relaunch_node:
        from_slot, to_slot = _move_node(new, node, now)
        reason += (
            f"; node {node} failed {node_failures} times (per_node_max_failures="
            f"{spec.per_node_max_failures}): moved from slot {from_slot} to slot {to_slot}"
        )
    return _restart_job(new, reason, now)


def request_stop(state: JobState, exit_code: int, reason: str, *, now: float) -> Decision:
    """Stop the job for a reason of the controller's own (signal, start error, ...).

    Ignored when a stop is already decided (the first result is kept).
    """
    if isinstance(exit_code, bool) or not isinstance(exit_code, int):
        raise PolicyError(f"exit_code must be an integer, got {exit_code!r}")
    if not isinstance(reason, str) or not reason:
        raise PolicyError(f"reason must be a non-empty string, got {reason!r}")
    if state.stage in (Stage.STOPPING, Stage.STOPPED):
        return _ignore(state, f"stop requested ({reason}) but the job is already stopping")
    return _stop(_changed(state, now), exit_code, reason, now)


def stopped(state: JobState, *, now: float) -> JobState:
    """STOPPING -> STOPPED once every worker process is gone (STOPPED: unchanged)."""
    if state.stage is Stage.STOPPED:
        return state
    if state.stage is not Stage.STOPPING:
        raise PolicyError(f"stopped needs stage STOPPING, the job is {state.stage.value}")
    new = _changed(state, now)
    new.stage = Stage.STOPPED
    new.log_event("stopped", f"job stopped, exit code {new.exit_code}", now)
    return new


# -- self-recovery ----------------------------------------------------------


def recover(state: JobState, *, now: float) -> Decision:
    """Decide how a restarted controller goes on from a loaded state.

    * RUNNING and consistent: ``[Resume(), RelaunchWorker(w)...]``: re-attach
      to the running workers and finish any relaunch that was decided but not
      done (workers pending, failed or stopping; this also completes an
      interrupted node relaunch).
    * INIT or READY: the controller crashed while starting workers; the state
      of the processes is unknown, so the job stops with a failing code.
    * STOPPING: the stop is finished with the recorded exit code if it is
      non-zero, or 0 only if every worker is recorded as succeeded (the job
      completed before the crash); else with a failing code.
    * STOPPED: the job was already over; the state is unchanged and the
      action repeats the recorded result, so the controller exits with it.
    * Any inconsistency (see :func:`check_state`): stop with a failing code.
    """
    problems = check_state(state)
    stage = state.stage
    if stage is Stage.STOPPED:
        if state.exit_code is None:
            return Decision(
                state, [StopJob(FAILURE_EXIT_CODE, "job stopped without a recorded exit code")]
            )
        return Decision(state, [StopJob(state.exit_code, state.reason or "job already stopped")])

    new = _changed(state, now)
    new.log_event("recover", f"controller restarted; job was {stage.value}", now)
    if stage is Stage.STOPPING:
        completed = (
            state.exit_code == 0
            and not problems
            and all(r.status is WorkerStatus.SUCCEEDED for r in state.workers.values())
        )
        code = state.exit_code if completed or state.exit_code else FAILURE_EXIT_CODE
        reason = f"{state.reason or 'stop'} (controller restarted while STOPPING)"
        return _stop(new, code, reason, now)
    if stage is not Stage.RUNNING:
        return _stop(
            new, FAILURE_EXIT_CODE, f"controller crashed during {stage.value}; stopped safely", now
        )
    if problems:
        return _stop(
            new,
            FAILURE_EXIT_CODE,
            "controller restarted but the state is inconsistent, stopped safely: "
            + "; ".join(problems[:5]),
            now,
        )
    pending = (WorkerStatus.PENDING, WorkerStatus.FAILED, WorkerStatus.STOPPING)
    actions: list[Action] = [Resume()]
    for w in sorted(new.workers):
        r = new.workers[w]
        if r.status in pending:
            # stopped because it never joined: its replacement is a fresh process
            fresh = r.status is WorkerStatus.STOPPING and r.join_misses > 0 and not r.joined
            actions.append(RelaunchWorker(w, new.node_slots[r.node], fresh=fresh))
    logger.info(
        "job %s: resuming generation %d (%d worker relaunch(es) pending)",
        new.job_id,
        new.generation,
        len(actions) - 1,
    )
    return Decision(new, actions)


def check_state(state: JobState) -> list[str]:
    """Problems that make ``state`` impossible under this policy (empty if none).

    Checked by :func:`recover`; the tests assert it after every decision.
    """
    spec = state.spec
    problems: list[str] = []
    add = problems.append
    nodes = set(range(spec.nnodes))
    if state.job_id != spec.job_id:
        add(f"job_id {state.job_id!r} differs from spec.job_id {spec.job_id!r}")

    if set(state.workers) != set(range(spec.world_size)):
        add(f"workers are {sorted(state.workers)}, expected 0..{spec.world_size - 1}")
    for w, r in state.workers.items():
        if 0 <= w < spec.world_size and r.node != spec.node_of(w):
            add(f"worker {w} is on node {r.node}, expected node {spec.node_of(w)}")
        if not 0 <= r.slot < spec.num_slots:
            add(f"worker {w} has slot {r.slot}, outside 0..{spec.num_slots - 1}")
        if r.incarnation < -1 or r.generation > state.generation or r.generation < 0:
            add(f"worker {w} has incarnation {r.incarnation}, generation {r.generation}")
        started = r.status not in (WorkerStatus.PENDING,)
        if started and (r.incarnation < 0 or r.pid is None):
            add(f"worker {w} is {r.status.value} but was never started")
        if r.join_misses < 0 or (r.joined and r.incarnation < 0):
            add(f"worker {w} has joined={r.joined}, join_misses={r.join_misses}")

    if set(state.node_slots) != nodes:
        add(f"node_slots covers nodes {sorted(state.node_slots)}, expected 0..{spec.nnodes - 1}")
    slots = list(state.node_slots.values())
    if len(set(slots)) != len(slots):
        add(f"two nodes share a slot: {state.node_slots}")
    if len(set(state.removed_slots)) != len(state.removed_slots):
        add(f"removed_slots has duplicates: {state.removed_slots}")
    for s in [*slots, *state.removed_slots]:
        if not 0 <= s < spec.num_slots:
            add(f"slot {s} outside 0..{spec.num_slots - 1}")
    if set(slots) & set(state.removed_slots):
        add(f"a node runs on a removed slot: {state.node_slots}, removed {state.removed_slots}")
    if not state.relaunching_nodes <= nodes:
        add(f"relaunching_nodes {sorted(state.relaunching_nodes)} names unknown nodes")
    if not set(state.node_failures) <= nodes:
        add(f"node_failures names unknown nodes: {sorted(state.node_failures)}")
    if not set(state.worker_restarts) <= set(range(spec.world_size)):
        add(f"worker_restarts names unknown workers: {sorted(state.worker_restarts)}")

    counters = {
        "generation": state.generation,
        "job_restarts": state.job_restarts,
        "node_relaunches": state.node_relaunches,
        **{f"node_failures[{k}]": v for k, v in state.node_failures.items()},
        **{f"worker_restarts[{k}]": v for k, v in state.worker_restarts.items()},
    }
    for name, value in counters.items():
        if value < 0:
            add(f"{name} is negative: {value}")
    if state.generation != state.job_restarts:
        add(f"generation {state.generation} differs from job_restarts {state.job_restarts}")
    if state.job_restarts > spec.job_max_restarts:
        add(f"job_restarts {state.job_restarts} > job_max_restarts {spec.job_max_restarts}")
    if state.node_relaunches > spec.node_max_relaunches:
        add(
            f"node_relaunches {state.node_relaunches} > node_max_relaunches "
            f"{spec.node_max_relaunches}"
        )

    for key in state.handled_failures:
        try:
            w, inc = FailureKey.parse(key)
        except ValueError:
            add(f"handled failure {key!r} is not 'worker:incarnation'")
            continue
        if w not in state.workers or not 0 <= inc <= state.workers[w].incarnation:
            add(f"handled failure {key} names no started incarnation")
    if sum(state.worker_restarts.values()) != len(state.handled_failures):
        add(
            f"worker_restarts add up to {sum(state.worker_restarts.values())}, but "
            f"{len(state.handled_failures)} failures were handled"
        )

    stopping = state.stage in (Stage.STOPPING, Stage.STOPPED)
    if stopping != (state.exit_code is not None) or stopping != (state.reason is not None):
        add(f"stage {state.stage.value} with exit_code {state.exit_code!r}")
    if not stopping:
        for w, n in state.worker_restarts.items():
            if n > spec.max_restarts:
                add(f"worker_restarts[{w}] = {n} > max_restarts {spec.max_restarts}")
        for node, n in state.node_failures.items():
            if n > spec.per_node_max_failures:
                add(f"node_failures[{node}] = {n} > per_node_max_failures")
    if state.stage is Stage.INIT and any(
        r.incarnation != -1 or r.status is not WorkerStatus.PENDING for r in state.workers.values()
    ):
        add("stage INIT but some worker was started")
    if state.stage is Stage.RUNNING:
        for w, r in state.workers.items():
            if r.status is WorkerStatus.RUNNING and r.generation != state.generation:
                add(f"worker {w} runs generation {r.generation}, job is {state.generation}")
        if state.wrapper_managed is not True:
            bad = [
                w
                for w, r in state.workers.items()
                if r.status not in (WorkerStatus.RUNNING, WorkerStatus.SUCCEEDED)
            ]
            if bad:
                add(f"job-level failover but workers {bad} are neither running nor succeeded")
    return problems
