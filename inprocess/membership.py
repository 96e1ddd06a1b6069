"""The restart procedure's barriers and the membership they decide.

One rank's side of the initial, iteration, termination and completion barriers,
of a relaunched process joining the running job, and of the root cause of a
restart. :class:`Barriers` takes what the barriers need from the call
(:class:`inprocess.wrap.CallWrapper`) when they run and returns what they
decided: the call applies it (its State, its board, its records). The keys and
the decisions themselves are :mod:`inprocess.protocol`'s; the rendezvous and
the waits are :mod:`inprocess.store`'s.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import generation as _gen
from . import monitor_thread as _mt
from . import protocol
from .exception import InternalError
from .exception import TimeoutError as RestartTimeoutError
from .monitor_process import WATCHED_PEERS
from .monitor_thread import RankShouldRestart
from .rank_assignment import RankDiscarded
from .state import State
from .store import (
    WAIT_CHUNK,
    WAIT_CHUNK_MAX,
    BarrierRefused,
    PrefixStore,
    StoreMixin,
    WakeWait,
    initial_rank_of,
    waits_in_server,
)

if TYPE_CHECKING:
    from . import records as _records
    from .config import WrapperConfig
    from .monitor_process import MonitorProcess
    from .progress_watchdog import ProgressBoard
    from .relay import RelayClient

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Iteration:
    """What every rank agreed on at an iteration barrier."""

    index: int
    members: protocol.Roster  # identities, in rank order
    baseline: int  # fault count when the iteration was decided


@dataclasses.dataclass
class Agreement:
    """An iteration barrier's outcome for this rank: the members it agreed on, and the
    State its rank assignment gave it (``planned``: a copy, as the assignment left it)."""

    members: protocol.Roster
    baseline: int
    assigned: State
    planned: State


@dataclasses.dataclass
class Admission:
    """The termination barrier that admitted a joining rank: the membership it joins
    after, and when it asked (``time.time()``)."""

    members: protocol.Roster
    terminated: set[str]
    joiners: list[str]
    decided: int  # the iteration whose termination barrier admitted it
    requested: float


class Barriers:
    """This rank's side of the restart procedure's barriers in one call.

    Args:
        store: the call's store (namespaced to the call).
        identity: this rank's identity in the call.
        config: the Wrapper's settings (timeouts, rank assignment, generation).
        poll: the poll interval of the barriers inside the restart procedure.
        relay: the node's arrival relay; ``None``: arrivals go to the store.
        track: remembers a State that may hold the store (the call releases them all).
        leave: records that this rank leaves the job, with the reason.
    """

    def __init__(
        self,
        store: PrefixStore,
        identity: str,
        config: WrapperConfig,
        poll: float,
        relay: RelayClient | None = None,
        track: Callable[[State], State] = lambda state: state,
        leave: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.store, self.identity, self.config = store, identity, config
        self.poll, self.relay, self.track, self.leave = poll, relay, track, leave

    # ---------------------------------------------------------------- initial

    def initial(self, namespace: str, initial_rank: int, size: int) -> protocol.Roster:
        """All launched ranks meet; returns their identities ordered by initial rank."""
        token = protocol.launch_token(namespace)

        def by_initial_rank(arrived: list[str]) -> str:
            # Run once, by the rank that completes the barrier: every other
            # rank derives the membership from what it publishes (O(1) read
            # when every rank has its launch identity) and checks its own place.
            # (With claims, two processes with one identity arrive twice: refused.
            # A relaunched worker's arrival replaces its predecessor's: see
            # protocol.latest_incarnations.)
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
                _td(self.config.barrier_timeout),
                self.poll,
                arrange=by_initial_rank,
                expand=functools.partial(protocol.decode_initial, token=token),
                claim=uuid.uuid4().hex[:12],
                supersede=protocol.latest_incarnations,
            )
        except BarrierRefused as ex:
            raise InternalError(str(ex)) from None
        if len(members) != size or members[initial_rank] != self.identity:
            raise InternalError(
                f"{self.identity}: not at its initial rank {initial_rank} of the "
                f"initial membership of {len(members)}"
            )
        return protocol.roster(members)

    # ---------------------------------------------------------------- iteration

    def agree(
        self,
        iteration: int,
        previous: State | None,
        current: State,
        prev_members: Sequence[str],
        terminated: set[str],
        joiners: list[str],
        following: protocol.Termination | None = None,
    ) -> Agreement:
        """Rank assignment, then agreement on the new membership.

        Survivors compute their new rank with the user's rank assignment and
        meet the joiners at a rendezvous; if a participant dies before it
        arrives, everyone recomputes without it (a new attempt). A joiner
        (``previous`` is ``None``) runs no assignment: it arrives with a copy of
        ``current``.

        After a termination barrier (``following``, its decision) that admitted
        nobody, with a rank assignment that keeps the survivors in their order
        (:func:`~inprocess.generation.derives_membership`: the default), every
        rank derives the membership itself and checks it against the decision's
        digest: no rendezvous (see :meth:`derived_membership`).

        Raises:
            RankDiscarded: the rank assignment dropped this rank (marked as left).
        """
        prev_members = protocol.roster(prev_members)  # (itself, in the Wrapper's loop)
        for attempt in itertools.count():
            name = protocol.barrier_name(iteration, attempt)
            if previous is not None:
                value, assigned = self.assign_rank(previous, prev_members, terminated, name)
            else:
                value, assigned = protocol.JOIN, current.copy()
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
                if attempt == 0 and self.derives(following, previous, joiners):
                    assert following is not None
                    decision = self.derived_membership(participants, value, following)
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
                        _td(self.config.barrier_timeout),
                        functools.partial(decide_membership, self.store, participants),
                        self.poll,
                        relay=self.relay,
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
            return Agreement(members, decision.baseline, assigned, planned)
        raise AssertionError("unreachable")

    def derives(
        self,
        following: protocol.Termination | None,
        previous: State | None,
        joiners: Sequence[str],
    ) -> bool:
        """Whether this restart's membership is derived on every rank (see
        :meth:`agree`). Every rank answers alike: from the decision they share
        and the rank assignment every rank of a job is given."""
        return (
            following is not None
            and following.baseline is not None
            and following.digest is not None
            and previous is not None
            and not joiners
            and _gen.derives_membership(self.config.rank_assignment)
        )

    def derived_membership(
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

    def assign_rank(
        self, previous: State, prev_members: protocol.Roster, terminated: set[str], name: str
    ) -> tuple[protocol.Arrival, State]:
        """This rank's new state per the user's rank assignment, and its barrier value.

        The value is the new rank, or ``discard`` when the assignment drops this rank.
        """
        state = self.track(previous.copy())
        state.store = PrefixStore(f"{name}/assignment", self.store)
        terminated_ranks = {prev_members.position(t) for t in terminated if t in prev_members}
        try:
            state, unhandled = _gen.assign(
                self.config.rank_assignment, self.config.generation, state, terminated_ranks
            )
            self.track(state)
        except RankDiscarded:
            return protocol.DISCARD, previous
        except RestartTimeoutError as ex:
            # A rank died during an exchange inside the assignment (e.g.
            # FilterGroupedByKey): the barrier decides whether to retry without it.
            log.warning("%s: rank assignment timed out: %s", self.identity, str(ex))
            return protocol.TIMEOUT, previous
        except Exception:
            self.leave("rank assignment failed")
            raise
        if unhandled:
            self.leave("rank assignment left terminated ranks unhandled")
            raise InternalError(f"rank assignment left terminated ranks {unhandled} unhandled")
        return protocol.Arrival("rank", state.rank), state

    # ---------------------------------------------------------------- termination

    def report_fault(self, iteration: int, ex: BaseException | None, cause: str | None) -> None:
        """Tells the peers of what ended this rank's function in ``iteration``.

        A restart exception (a peer's fault, or the monitor thread's ``cause``)
        is only logged; any other ``Exception`` is recorded as a fault and
        decides the iteration's outcome; anything else (``KeyboardInterrupt``,
        ``SystemExit``, ``RestartAbort``) ends this rank: it leaves, and ``ex``
        is raised.
        """
        if isinstance(ex, RankShouldRestart):
            log.info(
                "%s: restarting iteration %d (%s)",
                self.identity,
                iteration,
                cause or str(ex),
            )
        elif isinstance(ex, Exception):
            # Format now: a log record must not keep the exception (and the
            # frames its traceback holds) alive.
            # Logged at INFO: it may be derived from a peer's fault; the root
            # cause is logged once the termination barrier has seen them all.
            log.info("%s: iteration %d failed: %s", self.identity, iteration, repr(ex))
            self.store.record_fault(self.identity, f"{type(ex).__name__}: {ex}")
            self.store.decide_outcome(iteration, protocol.FAULT)
        else:
            # KeyboardInterrupt, SystemExit, RestartAbort, ...: this rank leaves.
            self.leave(f"{type(ex).__name__}: {ex}")
            raise ex

    def termination(self, current: Iteration) -> protocol.Termination:
        """Every member arrives or is terminated; decides who is out, who joins next,
        the root cause of the restart and (for a membership derived from it) the
        fault count it starts from."""
        store = self.store

        def decide(arrivals: dict[str, str], terminated: set[str], baseline: int) -> str:
            gone = store.terminated() | store.left()
            requests = store.join_requests()
            cause = root_cause(store, current.baseline)
            return protocol.encode(
                protocol.decide_termination(
                    terminated, current.members, requests, gone, cause, baseline
                )
            )

        return protocol.decode_termination(
            store.rendezvous(
                protocol.iteration_key(current.index, protocol.TERMINATION),
                self.identity,
                current.members,
                "",
                _td(self.config.barrier_timeout),
                decide,
                self.poll,
                relay=self.relay,
            )
        )

    # ---------------------------------------------------------------- completion

    def completion(self, current: Iteration, active: bool) -> None:
        """Waits until every member finished; a fault meanwhile raises ``RankShouldRestart``.

        An active rank waits at most ``completion_timeout`` for the others. A
        spare (``active`` false) arrives at once and may wait as long as
        training lasts; its deadline starts when the first active rank finishes.
        """
        store = self.store
        key = protocol.iteration_key(current.index, protocol.COMPLETION)
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
        timeout = self.config.completion_timeout
        deadline = time.monotonic() + timeout if active else None
        wait = OutcomeWait(store, current.index, self.config)
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
                reason = f"completion timeout ({self.config.completion_timeout:.3g}s)"
                store.record_fault(self.identity, reason)
                raise _mt.exception_with_message(RankShouldRestart, reason)()
            wait.wait(deadline)

    # ---------------------------------------------------------------- joining

    def join(self) -> Admission | None:
        """Asks to join the running job and waits for the termination barrier that
        admits this rank; ``None``: the job completed first."""
        store = self.store
        store.request_join(self.identity)
        requested = time.time()
        log.info("%s: asked to join the running job", self.identity)
        # Blocks on the call's wake-ups: a termination barrier's decision and an
        # iteration's outcome (the job completing) both wake it. The wake-up
        # state is read before the first look (see WakeWait).
        waiter = WakeWait(
            store,
            datetime.timedelta(seconds=self.config.barrier_timeout * 4),
            self.poll,
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
                    return Admission(
                        protocol.Roster(members[1]),
                        set(decision.terminated),
                        list(decision.joiners),
                        iteration,
                        requested,
                    )
                iteration += 1
                waiter.idle = False  # a decision, not for this rank: look at the next at once
                continue
            if store.outcome(iteration) == protocol.COMPLETED:
                log.warning("%s: the job completed before this rank could join", self.identity)
                return None
            # a wake-up that brought nothing (another barrier's, or a stranger's
            # key) costs the next wait a pause first: never a busy loop
            waiter.wait()
        raise InternalError(f"{self.identity}: not admitted to the running job in time")


def announce(
    store: PrefixStore,
    board: ProgressBoard,
    identity: str,
    iteration: int,
    members: protocol.Roster,
    state: State,
) -> None:
    """Makes this rank's place in the agreed membership known: rank 0 publishes the
    membership (for joiners and the job controller), every rank hands its monitor
    process the peers it watches now."""
    s = state
    if s.rank == 0:
        store.publish_membership(iteration, members)
    # Whom this rank's monitor process watches now: handed over on the
    # board (local memory), not through the store.
    board.write_text(
        protocol.Peers(
            iteration,
            tuple(protocol.ring_successors(members, identity, WATCHED_PEERS, s.rank)),
        ).encode()
    )
    log.info(
        "%s: iteration %d rank %d/%d (%s)",
        identity,
        iteration,
        s.rank,
        s.world_size,
        s.mode.value,
    )


def record_join(
    records: _records.Recorder,
    monitor: MonitorProcess | None,
    call_started: float | None,
    admission: Admission,
) -> None:
    """The ``join`` record of this rank's admission (see :meth:`Recorder.joined`)."""
    if not records.enabled:
        return
    import psutil

    try:
        created: float | None = psutil.Process().create_time()
    except psutil.Error:
        created = None
    timeline = {
        "process_start": created,
        "call_start": call_started,
        "monitor_ready": monitor.ready_at if monitor is not None else None,
        "join_request": admission.requested,
        "admitted": time.time(),
    }
    kind = "forked" if monitor is not None and monitor.forked else "spawned"
    records.joined(admission.decided, timeline, kind)


def decide_membership(
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


def root_cause(store: StoreMixin, baseline: int) -> protocol.RootCause | None:
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


def log_root_cause(
    identity: str,
    iteration: int,
    root: protocol.RootCause | None,
    ex: BaseException | None,
) -> None:
    """Logs, in one line, the fault that started this restart: which rank, which error.

    Not this rank's own error ``ex``, which is usually derived from a peer's
    fault (gloo's "Connection closed by peer"): the termination barrier's
    decision names the root cause ``root`` (see :func:`root_cause`).
    """
    if root is None:
        cause = f"{type(ex).__name__}: {ex}" if ex is not None else "unknown"
        log.warning("%s: restarted iteration %d: %s", identity, iteration, cause)
        return
    log.warning(
        "%s: restarted iteration %d; root cause: rank %s%s: %s",
        identity,
        iteration,
        root.rank,
        " (this rank)" if root.rank == identity else "",
        root.reason,
    )


class OutcomeWait:
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


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
