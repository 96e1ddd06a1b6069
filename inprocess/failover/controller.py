"""The job controller ("PrimeMaster"): runs one job's workers through faults.

One thread, one loop::

    state = load state.json (created by the supervisor)
    decision = start_job(state)   or, after a crash of ours, recover(state)
    loop:
        apply(decision): save the new state, then execute its actions
        events = the store server's death or hang (pidfd, /proc), failures the
                 job reported in its store, process exits (pidfds), a
                 Wrapper job left with no live member, and workers that did
                 not join the Wrapper job within their deadline
        decision = handle_event(state, event) for each event
        stop once the policy says so; exit with the job's exit code

Every decision comes from :mod:`inprocess.failover.policy`; this module only
observes and acts. The state is saved before any action is taken on it, so a
controller killed at any point resumes from a state that describes what it
was doing (see :func:`inprocess.failover.policy.recover`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import functools
import logging
import os
import re
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import persist_signal, procfs, protocol
from .. import records as _records
from ..proctitle import set_title
from ..protocol import incarnation_of, initial_rank_of
from . import etcd_member, policy
from .backends import DEFAULT_BACKEND, Backend, ProcessExit, WorkerLaunch, create_backend
from .bounded_calls import BoundedCalls
from .console import worker_output
from .policy import (
    Action,
    Decision,
    Ignore,
    NodeLost,
    NoLiveMember,
    RelaunchNode,
    RelaunchWorker,
    RestartJob,
    Resume,
    StartJob,
    StopJob,
    StoreLost,
    WorkerExited,
    WorkerReported,
)
from .processes import process_start_time
from .runtime import (
    LAUNCHER_ENV,
    controller_pid_path,
    die_with_parent,
    exit_now,
    signal_exit_code,
    supervisor_gone,
    write_pid_file,
)
from .standby import common_env
from .state import JobState, Stage, StateStore, WorkerStatus
from .store_server import SpareStoreServer, StoreServer, start_store_server
from .worker_env import namespace, worker_env

__all__ = ["Controller", "controller_pid_path", "main", "namespace", "signal_exit_code"]

log = logging.getLogger(__name__)

#: exit code of the controller when told to stop by Ctrl-C (other signals: 128 + signal)
INTERRUPTED_EXIT_CODE = 130
#: what the kernel sends us when the launcher dies (``PR_SET_PDEATHSIG``): not a
#: stop signal anyone sends, so that a forwarded SIGTERM needs no second look
LAUNCHER_DEATH_SIGNAL = signal.SIGUSR2
#: time a worker gets between SIGTERM and SIGKILL when stopped
STOP_GRACE = 5.0
#: a store server seen stopped (SIGSTOP) this long is hung: it is killed and replaced
STORE_STOP_GRACE = 5.0
#: longest the controller's loop waits for one round of reads of the job's store
STORE_READ_TIMEOUT = 2.0
#: a Wrapper job seen without a live member this long is lost; covers the moment
#: between a joiner's admission and the membership that lists it
NO_MEMBER_GRACE = 3.0
#: during a long action (a launch), the state is saved at most this often
SAVE_BATCH_SECONDS = 1.0
#: saves of the final state tried before the controller exits without it
FINAL_SAVE_TRIES = 3
#: prefix of the fault-log reason of a rank whose Wrapper ended with RestartAbort
_ABORT_PREFIX = protocol.TERMINATED_PREFIX + "RestartAbort"
#: a stop reason that names one of the job's limits (an ``events.jsonl`` "limit" event)
_LIMIT = re.compile(r"\bmax_restarts=|_max_\w+=|max_relaunches=|max_failures=")


class Controller:
    """Runs the job described by ``<state_dir>/state.json`` (or, for the elected
    coordinator of a ``--rdzv-backend etcd`` job, by its state in etcd)."""

    def __init__(self, state_dir: Path, backend: Backend | None = None) -> None:
        self.state_dir = state_dir
        handoff = etcd_member.Handoff.from_env()
        self.states: StateStore | etcd_member.EtcdStateStore = StateStore(state_dir)
        if handoff is not None:  # the elected coordinator of an etcd job
            self.states = etcd_member.state_store_for(handoff, state_dir)
        self.state: JobState = self.states.load()
        self.spec = self.state.spec
        self.backend: Backend = backend or create_backend(DEFAULT_BACKEND, state_dir)
        self.server: StoreServer | None = None
        self._client: Any = None
        self._reported: set[str] = set()
        #: the first call of the Wrapper job not known to be over: read with the latest
        self._first_call = 0
        self._stop_signal: int | None = None
        self._reads = BoundedCalls()
        self._store_fd: int | None = None  # pidfd of the store server
        self._store_stopped_since: float | None = None
        self._no_member_since: float | None = None
        #: the next generation's store server, started ahead (``--standby`` > 0)
        self._spare_server: SpareStoreServer | None = None
        #: the current state is not saved yet (batched, or the save failed)
        self._unsaved = False
        self._saved_at = 0.0
        #: the first of a run of failed saves, logged once; ``None`` once one succeeds
        self._save_error: str | None = None
        self._events_failed = False
        self.events_path = state_dir / _records.EVENTS_FILE
        _records.end_torn_line(self.events_path)  # an earlier controller may have died mid-line

    # ---------------------------------------------------------------- events file

    def event(self, name: str, worker: int | None = None, **fields: Any) -> None:
        """Appends one event to ``<state_dir>/events.jsonl``, durably (fsync), like the
        state file; a failure to write is logged, never fatal."""
        state, spec = self.state, self.spec
        if worker is not None and worker in state.workers:
            record = state.workers[worker]
            fields.setdefault("node", record.node)
            fields.setdefault("slot", state.node_slots.get(record.node, record.slot))
            fields.setdefault("local_rank", spec.local_rank_of(worker))
            fields.setdefault("rank", worker)
            fields.setdefault("pid", record.pid)
        fields.setdefault("generation", state.generation)
        fields.setdefault(
            "world_size",
            sum(r.status is WorkerStatus.RUNNING for r in state.workers.values()),
        )
        fields.setdefault("target", spec.world_size)
        try:
            _records.append_jsonl(
                self.events_path, _records.event(name, **fields), durable=True, nofollow=True
            )
        except OSError as ex:
            if not self._events_failed:  # once: a full disk would repeat it every event
                log.warning("cannot write %s: %s", self.events_path, ex)
            self._events_failed = True
        else:
            self._events_failed = False

    # ---------------------------------------------------------------- main loop

    def run(self, recovering: bool) -> int:
        write_pid_file(controller_pid_path(self.state_dir))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, LAUNCHER_DEATH_SIGNAL):
            signal.signal(sig, self._on_signal)
        if self.spec.standby > 0:
            # The store client's ``import torch`` starts now, beside the zygote's:
            # the workers are forked ready-made, and a fault before we can read
            # their store (whether the Wrapper runs them) would cost a cold
            # restart. Spawned workers import torch themselves: no hurry then.
            threading.Thread(
                target=_import_store_client, name="inprocess-import", daemon=True
            ).start()
        now = time.time()
        if recovering:
            log.warning("controller restarted: recovering job %s", self.spec.job_id)
            self.event("controller_recovery", detail=f"stage {self.state.stage.value}")
            self.apply(policy.recover(self.state, now=now))
        else:
            self.event("job_start", detail=" ".join(self.spec.entrypoint)[:300])
            self.apply(policy.start_job(self.state, now=now))
        while self.state.stage is not Stage.STOPPED:
            if self.state.stage is Stage.STOPPING:
                self.finish()
                break
            if self._stop_signal is not None:
                stop = self._stop_request()
                if stop is not None:
                    code, reason = stop
                    self.apply(policy.request_stop(self.state, code, reason, now=time.time()))
                continue
            self.flush()  # a save that failed is retried every loop
            for event in self.observe():
                self.apply(policy.handle_event(self.state, event, now=time.time()))
                if self.state.stage is not Stage.RUNNING:
                    break
        code = (
            self.state.exit_code if self.state.exit_code is not None else policy.FAILURE_EXIT_CODE
        )
        end_job = getattr(self.backend, "end_job", None)
        if end_job is not None and self.state.stage is Stage.STOPPED:
            end_job(code, self.state.reason or "")  # (other machines' agents end too)
        self.backend.close()
        for attempt in range(FINAL_SAVE_TRIES):
            if self.flush():
                break
            time.sleep(0.2 * (attempt + 1))
        code = (
            self.state.exit_code if self.state.exit_code is not None else policy.FAILURE_EXIT_CODE
        )
        log.info("job %s finished with exit code %d: %s", self.spec.job_id, code, self.state.reason)
        self.event("job_end", returncode=code, detail=self.state.reason)
        return code

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop_signal = signum

    def _stop_request(self) -> tuple[int, str] | None:
        """The exit code and reason of the pending stop signal; None (and the
        signal dropped) for a launcher death signal the launcher outlived."""
        signum = self._stop_signal
        assert signum is not None
        if signum != LAUNCHER_DEATH_SIGNAL:
            return signal_exit_code(signum), f"stopped by {signal.Signals(signum).name}"
        # Sent by the kernel when the thread that started us ended: a killed
        # launcher's other threads can keep it our parent a moment longer.
        if supervisor_gone(wait=1.0):
            return policy.FAILURE_EXIT_CODE, "inprocess-run died: stopping the job"
        log.warning("%s, but inprocess-run is alive: ignored", signal.Signals(signum).name)
        self._stop_signal = None
        return None

    # ---------------------------------------------------------------- deciding

    def commit(self, state: JobState, batched: bool = False) -> None:
        """Makes ``state`` current and saves it (before anything is done about it).

        ``batched``: a step of a long action (one worker of a launch); saved at
        most every :data:`SAVE_BATCH_SECONDS`, and always once the action ends
        (:meth:`flush`), so a launch of N workers is not N saves of a growing file.
        """
        if state is self.state:
            return
        self.state = state
        self._unsaved = True
        if not batched or time.monotonic() - self._saved_at >= SAVE_BATCH_SECONDS:
            self.flush()

    def flush(self) -> bool:
        """Saves the current state if it is not saved yet; whether it is saved now.

        A failure to save (a full or read-only disk, a file-size limit, EIO) is
        an error of durability, not of the job: it is logged once with the path
        and errno, recorded in ``events.jsonl`` where that can still be written,
        and the save is retried at the next change and every loop of the
        controller. The in-memory state stays the authority meanwhile.
        """
        if not self._unsaved:
            return True
        try:
            self.states.save(self.state)
        except OSError as ex:
            if self._save_error is None:
                code = errno.errorcode.get(ex.errno or 0, str(ex.errno))
                self._save_error = (
                    f"cannot save the job's state to {self.states.path}: "
                    f"{code} {ex.strerror or ex}"
                )
                log.error("%s; the job goes on, the save is retried", self._save_error)
                self.event("state_save_failed", detail=self._save_error)
            return False
        self._unsaved = False
        self._saved_at = time.monotonic()
        if self._save_error is not None:
            log.warning("the job's state is saved again to %s", self.states.path)
            self._save_error = None
        return True

    def apply(self, decision: Decision) -> None:
        self.commit(decision.state)
        try:
            self._execute_all(decision)
        except _StopRequested:
            # The loop stops the job next (its stop request is pending); the
            # workers started so far are in the state, so they are stopped too.
            log.warning("stop requested in the middle of an action: abandoning it")
        finally:
            self.flush()

    def _check_stop(self) -> None:
        """Raises :class:`_StopRequested` once a stop request came (SIGINT, SIGTERM,
        SIGHUP) while not stopping already: long actions call it between steps."""
        if self._stop_signal is not None and self.state.stage not in (
            Stage.STOPPING,
            Stage.STOPPED,
        ):
            raise _StopRequested

    def _execute_all(self, decision: Decision) -> None:
        for action in decision.actions:
            if isinstance(action, RelaunchWorker) and (
                self.state.stage is not Stage.RUNNING
                or self.state.generation != decision.state.generation
            ):
                # an earlier action (Resume) restarted or stopped the job: the plan is stale
                log.debug("skipped %s: superseded", action)
                continue
            self.execute(action)

    def execute(self, action: Action) -> None:
        log.debug("executing %s", action)
        if isinstance(action, StartJob):
            self.start_generation()
        elif isinstance(action, RelaunchWorker):
            self.stop_workers([action.worker])
            self.start_worker(action.worker, fresh=action.fresh)
            if action.fresh:
                detail = "a fresh process: the one before did not join the job in time"
                self.event("worker_relaunch", action.worker, detail=detail)
            else:
                self.event("worker_relaunch", action.worker)
        elif isinstance(action, RelaunchNode):
            log.warning(
                "relaunching node %d: slot %d -> %d", action.node, action.from_slot, action.to_slot
            )
            self.stop_workers(list(action.workers))
            for worker in action.workers:
                self._check_stop()
                # saved one by one: a controller that dies here resumes RUNNING, and
                # must know every worker it started (no second process of a rank)
                self.start_worker(worker)
            self.event(
                "node_relaunch",
                node=action.node,
                slot=action.to_slot,
                detail=f"slot {action.from_slot} -> {action.to_slot}, workers "
                f"{list(action.workers)}",
            )
        elif isinstance(action, RestartJob):
            log.warning(
                "restarting the whole job (generation %d): %s", action.generation, action.reason
            )
            self.stop_workers(list(self.state.workers))
            self.start_generation()
            self.event("cold_restart", generation=action.generation, detail=action.reason)
        elif isinstance(action, StopJob):
            level = logging.INFO if action.exit_code == 0 else logging.WARNING
            log.log(
                level,
                "stopping job %s (exit code %d): %s",
                self.spec.job_id,
                action.exit_code,
                action.reason,
            )
            if _LIMIT.search(action.reason):
                self.event("limit", returncode=action.exit_code, detail=action.reason)
            if self.state.stage is Stage.STOPPING:
                self.finish()
        elif isinstance(action, Resume):
            self.resume()
        elif isinstance(action, Ignore):
            log.debug("ignored: %s", action.reason)

    # ---------------------------------------------------------------- observing

    def observe(self) -> list[policy.Event]:
        """Waits one interval for process exits, then checks the store and the job's reports.

        The store is read after the exits are collected, and reports come
        before exits: a worker writes why it leaves (e.g. ``RestartAbort``)
        before its process ends, so its exit is then known to be on purpose.
        """
        exits = self.backend.wait(self.spec.monitor_interval)
        # Lost machines first: whatever else is decided must not use their slots.
        lost_nodes = self._lost_nodes(exits)
        exits = [e for e in exits if not e.lost]
        running = self.state.stage is Stage.RUNNING
        lost = self._store_problem() if running else None
        if lost is not None:
            # The exits of this interval are most likely its consequence; the
            # cold restart replaces every incarnation anyway.
            return [*lost_nodes, StoreLost(self.state.generation, lost)]
        snapshot = self._read_job() if running else None
        events: list[policy.Event] = lost_nodes
        returned = getattr(self.backend, "returned_slots", None)  # (machines that came back)
        events += [policy.SlotBack(slot, how) for slot, how in (returned() if returned else [])]
        events += self._reports(snapshot) if snapshot else []
        self._declare_dead(snapshot, exits, lost_nodes)
        for exit_ in exits:
            worker = self._worker_of_pid(exit_.pid)
            if worker is None:
                continue
            record = self.state.workers[worker]
            events.append(
                WorkerExited(
                    worker,
                    record.incarnation,
                    exit_.exit_code,
                    exit_.signal,
                    machinery=exit_.machinery,
                    gpu=self._workers_gpu(),
                )
            )
            self.event(
                "worker_exit",
                worker,
                pid=exit_.pid,
                returncode=exit_.exit_code,
                signal=exit_.signal,
                detail=events[-1].describe(),
                expected=record.status is WorkerStatus.STOPPING,
                world_size=sum(
                    r.status is WorkerStatus.RUNNING and r is not record
                    for r in self.state.workers.values()
                ),
            )
        if snapshot is not None:
            self._note_joined(snapshot)
        if snapshot is not None and not events:
            dead = self._no_live_member(snapshot)
            if dead is not None:
                events.append(NoLiveMember(self.state.generation, dead))
        if not events and snapshot is not None:  # (a job it cannot read: no verdict)
            events += policy.overdue_joins(self.state, now=time.time())
        return events

    def _note_joined(self, snapshot: dict[str, Any]) -> None:
        """Records the workers whose latest incarnation the Wrapper job has seen: at
        its initial barrier, asking to join, or as a member (their deadline is met)."""
        seen: set[tuple[int, int]] = set()
        members = snapshot["membership"].members if snapshot["membership"] else ()
        for identity in (*members, *snapshot["join_requests"], *snapshot["arrivals"]):
            with contextlib.suppress(ValueError):  # (an identity of no incarnation)
                seen.add((initial_rank_of(identity), incarnation_of(identity)))
        state, now = self.state, time.time()
        for worker, record in sorted(self.state.workers.items()):
            if (
                record.status is WorkerStatus.RUNNING
                and not record.joined
                and (worker, record.incarnation) in seen
            ):
                state = policy.worker_joined(state, worker, record.incarnation, now=now)
        self.commit(state)  # one save for all the workers seen joining (a launch's too)

    def _declare_dead(
        self,
        snapshot: dict[str, Any] | None,
        exits: list[ProcessExit],
        lost_nodes: list[policy.Event],
    ) -> None:
        """Lists in the job's store, as terminated, the ranks of workers whose
        process the controller saw end with a failure or whose node was lost.

        The rank's own monitor process does so at once when it outlives its
        rank; when both are gone (their node lost, a signal to the process
        group, the OOM killer), the other ranks would otherwise wait for its
        heartbeats to time out. Idempotent with the monitor's own report (the
        first one stands), bounded like the reads (:data:`STORE_READ_TIMEOUT`).
        """
        if snapshot is None or self.state.wrapper_managed is not True or self._client is None:
            return
        from ..store import PrefixStore

        lost = {e.node: e.reason for e in lost_nodes if isinstance(e, NodeLost)}
        dead: dict[tuple[int, int], str] = {}
        for exit_ in exits:
            worker = self._worker_of_pid(exit_.pid)
            if worker is None:
                continue
            record = self.state.workers[worker]
            if exit_.lost:
                how = f"node {record.node} lost ({lost.get(record.node, exit_.lost)})"
            elif record.status is WorkerStatus.STOPPING or (
                exit_.exit_code == 0 and exit_.signal is None
            ):
                continue  # stopped on purpose, or finished
            else:
                ended = WorkerExited(
                    worker,
                    record.incarnation,
                    exit_.exit_code,
                    exit_.signal,
                    gpu=self._workers_gpu(),
                )
                how = f"its process {ended.describe()}"
            dead[(worker, record.incarnation)] = f"{how} (seen by the job controller)"
        if not dead:
            return
        members = snapshot["membership"].members if snapshot["membership"] else ()
        identities = [
            i for i in (*members, *snapshot["join_requests"])
            if (initial_rank_of(i), incarnation_of(i)) in dead
        ]  # fmt: skip
        if not identities:
            return
        role = protocol.role_namespace(namespace(self.spec.job_id, self.state.generation))
        store = PrefixStore(protocol.call_namespace(role, snapshot["call"]), self._client)

        def declare() -> None:
            for identity in identities:
                reason = dead[(initial_rank_of(identity), incarnation_of(identity))]
                if store.mark_terminated(identity, reason):
                    log.info("rank %s: declared terminated: %s", identity, reason)

        try:
            done, _ = self._reads.call(declare, STORE_READ_TIMEOUT)
        except Exception as ex:  # the store is restarting or gone: the ranks' timeouts tell
            log.debug("cannot declare dead ranks in the job's store: %s", ex)
            return
        if not done:
            log.debug("the job's store did not answer within %.3gs", STORE_READ_TIMEOUT)

    def _lost_nodes(self, exits: list[ProcessExit]) -> list[policy.Event]:
        """One :class:`NodeLost` per node whose machine the backend saw lost."""
        events: list[policy.Event] = []
        for exit_ in exits:
            worker = self._worker_of_pid(exit_.pid) if exit_.lost else None
            if worker is None:
                continue
            node = self.state.workers[worker].node
            slot = self.state.node_slots[node]
            if all(not (isinstance(e, NodeLost) and e.node == node) for e in events):
                events.append(NodeLost(node, slot, exit_.lost or "lost"))
        return events

    def _workers_gpu(self) -> bool | None:
        """Whether the workers have a GPU (``None``: the backend cannot tell): their exit
        code 75 is a GPU fault only then."""
        known = getattr(self.backend, "workers_gpu", None)
        return known() if known is not None else None

    def _worker_of_pid(self, pid: int) -> int | None:
        for worker, record in self.state.workers.items():
            if record.pid == pid and record.status in (WorkerStatus.RUNNING, WorkerStatus.STOPPING):
                return worker
        return None

    def _read_job(self) -> dict[str, Any] | None:
        """One snapshot of the Wrapper's keys in the store, or ``None`` if it cannot be read
        within :data:`STORE_READ_TIMEOUT` (the store is gone, hung or restarting).

        Follows the call the job is on (``protocol.latest_call``: workers may make
        several wrapped calls): membership from that call; terminated ranks from
        it, from the one before (a relaunched worker passes through earlier calls)
        and from every call since the last snapshot, so none is missed.
        """
        if self.server is None or _process_stopped(self.server.pid):
            return None
        role = protocol.role_namespace(namespace(self.spec.job_id, self.state.generation))
        first_call = self._first_call
        reported = frozenset(self._reported)
        server = self.server
        # the initial barrier's arrivals: only while a started worker is not seen yet
        unjoined = any(
            r.status is WorkerStatus.RUNNING and not r.joined for r in self.state.workers.values()
        )

        def read() -> tuple[Any, dict[str, Any]]:
            client = self._client
            if client is None:
                import torch.distributed as dist

                client = dist.TCPStore(
                    server.host,
                    server.port,
                    None,
                    False,
                    timeout=datetime.timedelta(seconds=STORE_READ_TIMEOUT),
                )

            latest = protocol.latest_call(client, role) or 0
            current = protocol.call_namespace(role, latest)
            snapshot: dict[str, Any] = {
                "wrapped": protocol.wrapper_present(client, role),
                "call": latest,
                "initial_done": protocol.initial_done(client, current),
                "membership": protocol.membership(client, current),
                "join_requests": protocol.join_requests(client, current),
                "arrivals": protocol.initial_arrivals(client, current) if unjoined else [],
                "terminated": [],
                "fault_log": [],
            }
            for call in range(max(0, min(first_call, latest - 1)), latest + 1):
                call_ns = protocol.call_namespace(role, call)
                terminated = protocol.terminated(client, call_ns)
                snapshot["terminated"] += terminated
                if any(i not in reported for i in terminated):
                    snapshot["fault_log"] += protocol.fault_log(client, call_ns)
            return client, snapshot

        try:
            done, result = self._reads.call(read, STORE_READ_TIMEOUT)
        except Exception as ex:  # the store is restarting or gone: exits tell the rest
            log.debug("cannot read the job's store: %s", ex)
            self._client = None
            return None
        if not done:
            log.debug("the job's store did not answer within %.3gs", STORE_READ_TIMEOUT)
            self._client = None
            return None
        self._client, snapshot = result
        self._first_call = max(0, snapshot["call"] - 1)
        return snapshot

    def _reports(self, snapshot: dict[str, Any]) -> list[policy.Event]:
        """Failures the Wrapper recorded (ranks it declared terminated), and its presence."""
        if self.state.wrapper_managed is None and snapshot["wrapped"]:
            self.commit(policy.set_wrapper_managed(self.state, True, now=time.time()))

        reasons = protocol.terminations(snapshot["fault_log"])
        events: list[policy.Event] = []
        for identity in snapshot["terminated"]:
            if identity in self._reported:
                continue
            reason = reasons.get(identity)
            if reason is None:
                # The rank writes its reason right after listing itself: read it next time.
                continue
            self._reported.add(identity)
            worker, incarnation = initial_rank_of(identity), incarnation_of(identity)
            record = self.state.workers.get(worker)
            if record is not None and record.incarnation == incarnation:
                restartable = not reason.startswith(_ABORT_PREFIX)
                alive = self.backend.running(record.pid or -1, record.pid_start_time)
                if restartable and not alive:
                    # Its process is gone: the backend collects its exit, which
                    # says more (the status or signal) and leads to the same action.
                    continue
                what = reason.removeprefix(protocol.TERMINATED_PREFIX)
                events.append(
                    WorkerReported(
                        worker,
                        incarnation,
                        # (a worker's text: logged, so its control characters escaped)
                        f"declared terminated by the job: {_records.printable(what)}"[:300],
                        restartable=restartable,
                    )
                )
        return events

    def _no_live_member(self, snapshot: dict[str, Any]) -> str | None:
        """Why the Wrapper job has no live member left, once that has lasted
        :data:`NO_MEMBER_GRACE`; ``None`` while it has one (or cannot tell)."""

        state = self.state
        members: list[str] = []
        if snapshot["membership"] is not None:
            members = list(snapshot["membership"].members)
        terminated = set(snapshot["terminated"])

        def live(identity: str) -> bool:
            record = state.workers.get(initial_rank_of(identity))
            return (
                identity not in terminated
                and record is not None
                and record.status is WorkerStatus.RUNNING
                and record.incarnation == incarnation_of(identity)
            )

        if (
            state.wrapper_managed is not True
            or not snapshot["initial_done"]
            or not members  # not published yet: the job is starting
            or any(r.status is WorkerStatus.SUCCEEDED for r in state.workers.values())
            or any(live(m) for m in members)
        ):
            self._no_member_since = None
            return None
        now = time.monotonic()
        if self._no_member_since is None:
            self._no_member_since = now
        if now - self._no_member_since < NO_MEMBER_GRACE:
            return None
        self._no_member_since = None
        ended = sorted({initial_rank_of(m) for m in members})
        waiting = sorted(w for w, r in state.workers.items() if r.status is WorkerStatus.RUNNING)
        return (
            f"no live member is left in the Wrapper job of generation {state.generation} "
            f"(its members, workers {ended}, all ended; workers {waiting} wait to rejoin it)"
        )

    def _store_problem(self) -> str | None:
        """How the store server was lost (dead, or stopped longer than
        :data:`STORE_STOP_GRACE`), or ``None`` while it serves."""
        server = self.server
        if server is None:
            return None
        pid = server.pid
        if self._store_fd is None:
            with contextlib.suppress(OSError):
                self._store_fd = os.pidfd_open(pid)
        ended = self._store_fd is None or bool(select.select([self._store_fd], [], [], 0)[0])
        if ended or not server.alive():
            how = "ended"
            with contextlib.suppress(ChildProcessError):
                reaped, status = os.waitpid(pid, os.WNOHANG)
                if reaped == pid:
                    how = WorkerExited(0, 0, *_exit_of(status), gpu=False).describe()
            self._forget_server()  # its pid may be reused from now on: never signal it
            return f"the store server (pid {pid}) {how}"
        if not _process_stopped(pid):
            self._store_stopped_since = None
            return None
        now = time.monotonic()
        if self._store_stopped_since is None:
            self._store_stopped_since = now
            log.warning("the store server (pid %d) is stopped", pid)
        if now - self._store_stopped_since < STORE_STOP_GRACE:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        self._forget_server()
        return (
            f"the store server (pid {pid}) was stopped for more than {STORE_STOP_GRACE:.3g}s "
            "(SIGSTOP): killed"
        )

    def _forget_server(self) -> None:
        self.server = None
        self._client = None
        self._store_stopped_since = None
        if self._store_fd is not None:
            os.close(self._store_fd)
            self._store_fd = None

    # ---------------------------------------------------------------- acting

    def start_generation(self) -> None:
        """A new store server (a fresh key space) and every worker (a cold start)."""
        self._stop_server()
        self._no_member_since = None
        # The standbys' zygotes first: the store server and the workers below are
        # forked from them (each would import torch otherwise).
        self._keep_standbys()
        self.server = self._new_server()
        state = self.state.copy()
        state.store = {
            "host": self.server.host,
            "port": self.server.port,
            "pid": self.server.pid,
            "start_time": process_start_time(self.server.pid),
            "generation": state.generation,
            # it ends with this launcher (see store_server): a coordinator elected
            # later, on any machine, never takes it for its own
            "owner": os.environ.get(LAUNCHER_ENV),
        }
        self.commit(state)
        self._reported.clear()
        self._first_call = 0
        # Batched saves are safe here: the stage is READY until the last worker is
        # started, and a controller that dies in READY stops the job (policy.recover),
        # whose every process the supervisor then ends by its run token.
        for worker in sorted(self.state.workers):
            self._check_stop()
            self.start_worker(worker, batched=True)
        self.flush()
        self._prepare_ahead()

    def _new_server(self) -> StoreServer:
        """The spare store server if one is ready ahead, else a new one."""
        spare, self._spare_server = self._spare_server, None
        if spare is not None:
            server = spare.take()
            if server is not None:
                return server
            log.warning("the spare store server is gone: starting a new one")
        start = getattr(self.backend, "start_store_server", None)
        if start is not None:
            server: StoreServer = start(self.spec.master_addr)
            return server
        # a server of this machine: it ends with the launcher, however that ends
        return start_store_server(
            self.spec.master_addr,
            port=self.spec.master_port,
            spawn=getattr(self.backend, "spawn_module", None),
            owner=os.environ.get(LAUNCHER_ENV),
        )

    def _keep_standbys(self) -> None:
        """With ``--standby N`` (N > 0): N warm standbys on every node slot (spares
        included, for a relaunched node)."""
        count = self.spec.standby
        keep = getattr(self.backend, "keep_standbys", None)
        if count > 0 and keep is not None:
            for slot in range(self.spec.num_slots):
                keep(slot, count, common_env(self.worker_env(0, 0, slot)))

    def _prepare_ahead(self) -> None:
        """With ``--standby N`` (N > 0): the standbys, and the next generation's
        store server."""
        if self.spec.standby <= 0 or self.server is None:
            return
        self._keep_standbys()
        # a fixed --master-port is the running server's until it stops: no spare
        if (
            self._spare_server is None
            and not self.spec.master_port
            and not hasattr(self.backend, "start_store_server")
        ):
            # forked if the zygote is ready, never waiting for it: nobody needs a
            # spare yet (after a controller crash the zygote is still importing)
            spawn = getattr(self.backend, "spawn_module", None)
            self._spare_server = SpareStoreServer(
                self.spec.master_addr,
                spawn=functools.partial(spawn, wait=0.0) if spawn is not None else None,
                owner=os.environ.get(LAUNCHER_ENV),
            )

    def start_worker(self, worker: int, batched: bool = False, fresh: bool = False) -> None:
        """Starts the next incarnation of ``worker`` (``fresh``: a new process, never a
        warm standby) and records it, with whether a standby took the place."""
        record = self.state.workers[worker]
        slot = self.state.node_slots[record.node]
        stdout, stderr, output_env = worker_output(self.spec, worker, self.state.generation)
        launch = WorkerLaunch(
            worker=worker,
            incarnation=record.incarnation + 1,
            node=record.node,
            slot=slot,
            argv=self.spec.command(sys.executable),
            env={**self.worker_env(worker, record.incarnation + 1, slot), **output_env},
            stdout=stdout,
            stderr=stderr,
            fresh=fresh,
        )
        pid, start_time = self.backend.start(launch)
        warm = getattr(self.backend, "started_warm", None)
        self.commit(
            policy.worker_started(
                self.state,
                worker,
                pid=pid,
                start_time=start_time,
                now=time.time(),
                warm=bool(warm(pid)) if warm is not None else False,
            ),
            batched=batched,
        )

    def worker_env(self, worker: int, incarnation: int, slot: int) -> dict[str, str]:
        """A worker's environment (:func:`.worker_env.worker_env`)."""
        server = self.server
        return worker_env(
            self.spec,
            self.state.generation,
            (server.host, server.port) if server is not None else None,
            self.state_dir,
            worker,
            incarnation,
            slot,
        )

    def stop_workers(self, workers: list[int]) -> None:
        pids = [
            r.pid
            for w, r in self.state.workers.items()
            if w in workers
            and r.pid is not None
            and r.status in (WorkerStatus.RUNNING, WorkerStatus.STOPPING)
        ]
        self.backend.stop([p for p in pids if p is not None], STOP_GRACE)

    def resume(self) -> None:
        """Re-attaches to the store server and to the workers that are still running.

        Every live worker is attached first, so that a cold restart decided
        because the store server is gone stops them too.
        """
        lost: list[tuple[int, WorkerExited]] = []
        for worker, record in sorted(self.state.workers.items()):
            if record.status is not WorkerStatus.RUNNING:
                continue
            assert record.pid is not None and record.pid_start_time is not None
            if self.backend.attach(record.pid, record.pid_start_time):
                log.info("re-attached to worker %d (pid %d)", worker, record.pid)
                continue
            log.warning(
                "worker %d (pid %d) ended while the controller was down", worker, record.pid
            )
            ended = self.backend.exit_of(record.pid)
            event = WorkerExited(
                worker, record.incarnation, ended.exit_code, ended.signal, gpu=self._workers_gpu()
            )
            self.event(
                "worker_exit",
                worker,
                returncode=ended.exit_code,
                signal=ended.signal,
                detail=f"{event.describe()} while the controller was down",
            )
            lost.append((worker, event))
        store = self.state.store
        ours = _owns_store(store)
        if store and ours and process_start_time(store["pid"]) == store.get("start_time"):
            self.server = StoreServer(store["host"], store["port"], store["pid"])
            self._prepare_ahead()
        else:
            why = "was lost while the controller was down" if ours else "left with its coordinator"
            event = StoreLost(self.state.generation, f"the store server {why}")
            self.apply(policy.handle_event(self.state, event, now=time.time()))
            return
        for _, event in lost:
            self.apply(policy.handle_event(self.state, event, now=time.time()))

    def finish(self) -> None:
        """Stops every live worker and the store server; the job is STOPPED."""
        self.stop_workers(list(self.state.workers))
        self._stop_server()
        if self._spare_server is not None:
            self._spare_server.discard()
            self._spare_server = None
        self.commit(policy.stopped(self.state, now=time.time()))

    def _stop_server(self) -> None:
        self._client = None
        if self.server is not None:
            self.server.stop()
            self._forget_server()
        elif self.state.store and _owns_store(self.state.store):
            store = self.state.store
            if process_start_time(store["pid"]) == store.get("start_time"):
                StoreServer(store["host"], store["port"], store["pid"]).stop()


def _owns_store(store: dict[str, Any]) -> bool:
    """Whether the store server recorded in ``store`` is this launcher's (it ends
    with its launcher): not one of an earlier coordinator's, maybe on another
    machine, whose pid means nothing here (``--rdzv-backend etcd``)."""
    mine = os.environ.get(LAUNCHER_ENV)
    return store.get("owner", mine) == mine


class _StopRequested(Exception):
    """A stop request came during a long action: the action is abandoned."""


def _import_store_client() -> None:
    with contextlib.suppress(Exception):
        import torch.distributed  # noqa: F401


def _process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, SIGTSTP, a tracer)."""
    return procfs.process_stopped(pid)


def _exit_of(status: int) -> tuple[int | None, int | None]:
    code = os.waitstatus_to_exitcode(status)
    return (code, None) if code >= 0 else (None, -code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="inprocess job controller (started by inprocess-run)"
    )
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--recover", action="store_true", help="resume after a controller crash")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--backend", default=DEFAULT_BACKEND, help="where the workers run (see backends)"
    )
    parser.add_argument(
        "--result-fd", type=int, default=None, help="where to write the job's exit code at its end"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s inprocess-run[controller] %(levelname)s %(message)s",
    )
    # The launcher's death ends the job: the kernel tells us with a signal of its
    # own (a SIGTERM the launcher forwards is then told from it at once). Set
    # before anything else; if the launcher is already gone, the signal would
    # never come: stop at once.
    persist_signal.survive()  # (a scheduler's warning reaches every process of the job)
    expected = os.environ.get("INPROCESS_SUPERVISOR_PID")
    if not die_with_parent(LAUNCHER_DEATH_SIGNAL, int(expected) if expected else None):
        os.kill(os.getpid(), LAUNCHER_DEATH_SIGNAL)
    controller = Controller(args.state_dir, create_backend(args.backend, args.state_dir))
    set_title(f"inprocess-run controller of job {controller.spec.job_id}", "inproc-control")
    code = policy.FAILURE_EXIT_CODE
    with contextlib.suppress(BrokenPipeError):
        code = controller.run(recovering=args.recover)
        if args.result_fd is not None:
            # The job's end, for the supervisor, even where it could not be saved.
            with contextlib.suppress(OSError):
                reason = (controller.state.reason or "").replace("\n", " ")
                os.write(args.result_fd, f"{code} {reason}\n".encode()[:4000])
    return code


if __name__ == "__main__":
    # The job ended and its state is saved: skip torch's teardown.
    exit_now(main())
