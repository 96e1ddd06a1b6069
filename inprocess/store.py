"""The distributed store protocol of the Wrapper: its mechanics.

Every rank (and every rank's monitor process) talks to one key-value store. This
module implements the protocol on top of any ``torch.distributed.Store``; its
key schema, its decisions and what a job controller reads of it are in
:mod:`inprocess.protocol`:

Identities
    A rank is identified by ``"<initial rank>/<token>"`` where the token is
    unique to the process. A relaunched process that rejoins a job therefore has
    a new identity, and a terminated identity can never reappear.

Records
    Every value is a sealed record (MAC'd under the job's secret and the key's
    full name, see :mod:`inprocess.security`); readers act on authentic
    records only. Counters carry no MAC, so they only wake readers.

Faults
    ``fault_log`` is an append-only list with one entry per fault; anything
    that requires a restart (an exception, a timeout, a dead rank, a rank
    asking to join) appends one. The fault count is the number of authentic
    entries. An iteration records the count when it was decided (its
    *baseline*); the iteration is faulted once the count exceeds it. Each
    entry is followed by an increment of the ``faults`` counter, which monitor
    threads poll with a single ``add(key, 0)`` per interval; they read the log
    only when it changes.

Outcome
    ``i<k>/o`` (the outcome) is a once-key: ``"completed"`` from the last rank
    arriving at the completion barrier, ``"fault"`` from whoever first acts on a
    fault. The first authentic record decides the iteration for everybody; a
    fault recorded after completion is ignored.

Terminated ranks
    ``terminated`` is an append-only list of identities. Marking a rank terminated
    appends its reason to the fault log (its fault), then appends it to the
    list, then increments the counters; deciders read the fault log *before*
    ``terminated``. So a death is either part of a decision's terminated set or
    raises the count above that decision's baseline, never neither; a listed
    death always has its reason in the fault log (every rank logs the restart's
    root cause); and a decider reads again until the log it read has each death
    it lists, so a death is not *both* either (which would restart the
    iteration it decided for nothing).

Rendezvous
    A rendezvous completes when every participant has either arrived or been
    terminated (authentic arrival records and deaths; the arrival counter only
    says when to look). Whoever notices completion (the last arrival, or a
    waiter that saw a termination) computes the decision and publishes it to a
    once-key, so all ranks read the same decision. A member that died without
    arriving is counted on its behalf by the first rank that sees it listed,
    so completion needs no one to read everyone's arrivals but the one that
    completes it. Waiters block on the store until the call's next wake-up (a
    decision published, a death listed: :meth:`StoreMixin.wake_waiters`), no
    polling, in chunks of :data:`WAIT_CHUNK` growing to :data:`WAIT_CHUNK_MAX`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from errno import EADDRINUSE
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from . import protocol as P
from . import quiet_wait
from .exception import StoreError
from .exception import TimeoutError as RestartTimeoutError
from .protocol import incarnation_of as incarnation_of
from .protocol import initial_rank_of as initial_rank_of
from .security import bound_port, keyed_namespace, listen_fd, open_records, reject, seal
from .waiting import WAIT_CHUNK, WAIT_CHUNK_MAX, WakeWait

if TYPE_CHECKING:
    from .relay import RelayClient

log = logging.getLogger(__name__)

#: seconds a decider waits for the listed deaths of its rendezvous to be counted
COUNTED_WAIT = 1.0
#: a rank waiting on its node's live relay looks at the store itself only once its
#: wait chunks grew to this, or to the store's cap (2 + 4 + 8 s into the wait; see
#: StoreMixin._relayed)
RELAYED_LOOK = 8.0


#: environment variable naming a store hosted outside the workers (torchrun's convention)
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
#: environment variable with the key namespace of this job (set by ``inprocess-run``)
NAMESPACE_ENV = "INPROCESS_STORE_NAMESPACE"
#: environment variable with the number of this process among the worker's starts
INCARNATION_ENV = "INPROCESS_WORKER_INCARNATION"


def new_identity(initial_rank: int, incarnation: int = 0) -> str:
    """A process-unique identity: ``"<initial rank>/<incarnation>.<random>"`` (see also
    :func:`inprocess.protocol.launch_identity`)."""
    return f"{initial_rank}/{incarnation}.{uuid.uuid4().hex[:10]}"


def job_namespace() -> str:
    """The store key space of this job (and generation): every process of it must agree.

    ``inprocess-run`` sets ``INPROCESS_STORE_NAMESPACE``; under torchrun each
    restart attempt gets its own (its run id and restart count), so a restarted
    attempt never reads the keys of the previous one. With a job secret
    (``INPROCESS_JOB_SECRET``) the namespace ends with a tag derived from it, so
    a store client without the secret cannot name any key of the job.
    """
    explicit = os.environ.get(NAMESPACE_ENV)
    if explicit:
        return explicit  # inprocess-run's, keyed with the job's secret already
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return keyed_namespace(f"torchelastic/{run_id}/{restart}")
    return keyed_namespace("default")


def incarnation_from_env() -> int:
    value = os.environ.get(INCARNATION_ENV)
    return int(value) if value else 0


class BarrierTimeout(RestartTimeoutError):
    """A rendezvous did not complete within its timeout."""


class BarrierRefused(StoreError):
    """A counted barrier's arrivals were refused by the rank that completed it."""


class BarrierOverflow(StoreError):
    """More ranks arrived at a rendezvous than it has participants."""


def key_path(store: Any, key: str) -> str:
    """The full name of ``key`` in the store under ``store``'s prefixes (the name records
    are sealed with). Prefixes of torch's own ``PrefixStore`` are not known: the
    name then starts below them."""
    parts = [key]
    while isinstance(store, PrefixStore):
        parts.append(store.prefix)
        store = store.base_store
    return "/".join(reversed(parts))


def _served_name(store: Any, key: str) -> tuple[dist.TCPStore, str] | None:
    """(the ``TCPStore`` under ``store``, the key's full name on its server) where
    ``store`` is a view of a ``TCPStore`` whose prefixes are all known; ``None``
    otherwise."""
    parts = [key]
    while isinstance(store, PrefixStore):
        parts.append(store.prefix)
        store = store.base_store
    if not isinstance(store, dist.TCPStore):
        return None
    # torch's TCPStore puts "/" before every key, and a PrefixStore "<prefix>/"
    return store, "/" + "/".join(reversed(parts))


def waits_in_server(store: Any) -> bool:
    """Whether ``store``'s ``wait`` blocks in a server (torch's ``TCPStore``) rather than
    polling in the client."""
    while isinstance(store, PrefixStore):
        store = store.base_store
    return isinstance(store, dist.TCPStore)


#: starts a counted barrier's decision that refuses the arrivals (no identity starts so)
_REFUSED = "!"

#: the expectation of :meth:`StoreMixin.get_or`'s compare-and-set: no value of ours
#: (a sealed record starts with a newline) and no counter is ever this text; one
#: byte, as it travels twice with every read
_ABSENT = "\x00"


class Poller:
    """Sleeps between polls, backing off from ``start`` to ``limit`` seconds."""

    def __init__(self, limit: float, start: float = 0.0005) -> None:
        self.limit = max(limit, start)
        self.delay = min(start, self.limit)

    def sleep(self, deadline: float | None = None) -> None:
        delay = self.delay
        if deadline is not None:
            delay = min(delay, max(0.0, deadline - time.monotonic()))
        time.sleep(delay)
        self.delay = min(self.delay * 1.5, self.limit)


class StoreMixin:
    """Adds the Wrapper's protocol to a ``torch.distributed.Store`` subclass.

    Subclasses must also derive from a ``torch.distributed.Store`` (see
    :class:`TCPStore`, :class:`FileStore`, :class:`PrefixStore`). Only the store
    primitives ``set``, ``get``, ``add``, ``compare_set``, ``append``, ``check``
    and ``multi_get`` are used.

    Every value the protocol acts on is a sealed record
    (:func:`inprocess.security.seal`, under the job's secret and the key's full
    name): :meth:`put` and :meth:`add_entry` write them, :meth:`read`,
    :meth:`entries` and :meth:`set_once` read the authentic ones only. A
    "once" key (a decision, an outcome, a death) is an appended list whose
    first authentic record wins, so a stranger who writes it first, or appends
    to it, decides nothing. Counters only wake readers of records.
    """

    # ------------------------------------------------------------------ construction

    @classmethod
    def client(cls, **kwargs: Any) -> StoreMixin:
        """A store connected to the same data that never hosts it.

        Used by the monitor process, which must not start a second server. The
        default constructs the store with the same arguments.
        """
        return cls(**kwargs)

    def client_spec(self) -> ClientSpec | None:
        """How another process (the monitor process) reaches this store's data.

        Describes the store by what it is, not by the class that built it, so
        any subclass works, even one defined inside a function (not picklable):
        a store over torch's ``TCPStore`` is reached by a plain
        :class:`TCPStore` client at the same host and port, one over
        ``FileStore`` by a :class:`FileStore` on the same file, a
        :class:`PrefixStore` by the same prefix over its base's description.
        ``None`` when unknown; override it for other stores.
        """
        return describe(self)

    # ------------------------------------------------------------------ primitives

    def get_or(self, key: str, default: str = "") -> str:
        """Raw value of ``key``, or ``default`` when absent, without blocking.

        One round trip: a compare-and-set that expects a value nobody writes
        (:data:`_ABSENT`) changes nothing and answers with the value there, or
        with the expectation itself when the key is absent (every torch store
        does so). ``check`` then ``get`` would take two.
        """
        value = self.compare_set(key, _ABSENT, _ABSENT)
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        return default if text == _ABSENT else text

    # ------------------------------------------------------------------ sealed records

    def full_key(self, key: str) -> str:
        """The full name of ``key`` in the store (what its records are sealed with).

        Not ``path``: torch's ``FileStore`` has a ``path`` property (its file),
        which would hide the method there."""
        return key_path(self, key)

    def put(self, key: str, value: str) -> None:
        """Sets ``key`` to one sealed record of ``value``."""
        self.set(key, seal(self.full_key(key), value))

    def add_entry(self, key: str, value: str) -> None:
        """Appends one sealed record of ``value`` to the list at ``key``."""
        self.append(key, seal(self.full_key(key), value))

    def add_entries(self, key: str, values: Sequence[str]) -> None:
        """Appends sealed records of ``values`` to the list at ``key``, in one operation."""
        name = self.full_key(key)
        self.append(key, "".join(seal(name, value) for value in values))

    def decode_entries(self, key: str, raw: bytes | str | None) -> list[str]:
        """The authentic records of a raw value read from ``key``."""
        return open_records(self.full_key(key), raw)

    def entries(self, key: str) -> list[str]:
        """The authentic records at ``key`` in order (repeats once); ``[]`` when absent."""
        return self.decode_entries(key, self.get_or(key))

    def read(self, key: str) -> str | None:
        """The first authentic record at ``key``, or ``None``."""
        found = self.entries(key)
        return found[0] if found else None

    def identities(self, key: str) -> list[str]:
        """The well-formed identities listed at ``key``, in order, each once."""
        found = []
        for entry in self.entries(key):
            if P.valid_identity(entry):
                found.append(entry)
            else:
                reject(self.full_key(key), "a malformed identity")
        return found

    def set_once(self, key: str, value: str) -> tuple[bool, str]:
        """Makes non-empty ``value`` the value of once-key ``key`` unless one stands.

        Returns ``(won, current)``: whether this call's value stands, and the
        value that does. ``value`` must be unique to the caller for ``won`` to be
        exact. The first authentic record appended wins: appends are ordered by
        the store, so every reader agrees on it, and a stranger's record never
        counts.
        """
        if not value:
            raise ValueError("set_once needs a non-empty value")
        record = seal(self.full_key(key), value)
        # One round trip when the key is new (the common case): the record is
        # then its first. Else the first authentic record there stands; only
        # if there is none (a stranger wrote the key first) is ours appended.
        current = P.first_or_none(self.decode_entries(key, self.compare_set(key, "", record)))
        if current is None:
            self.append(key, record)
            current = P.first_or_none(self.decode_entries(key, self.get(key))) or ""
        return current == value, current

    def counter(self, key: str) -> int:
        return int(self.add(key, 0))

    # ------------------------------------------------------------------ calls

    def announce_call(self, role: str, call: int) -> None:
        """Marks ``role`` as recovering in-process and raises its latest call to ``call``.

        Called on the role's (unprefixed) store at the start of each call.
        ``latest_call`` only grows (a compare-and-set loop): a relaunched process
        that passes through earlier calls on its way to the job's current one
        never lowers it, so a controller always reads the call the job is on.
        """
        self.put(f"{role}/{P.WRAPPED}", "1")
        key = f"{role}/{P.LATEST_CALL}"
        wanted = seal(self.full_key(key), str(call))
        raw = self.get_or(key)
        for _ in range(100):  # bounded: a stranger rewriting the key must not hold a rank here
            seen = P.int_or_none(P.first_or_none(self.decode_entries(key, raw)))
            if seen is not None and seen >= call:
                return
            # A value that is not ours (garbage) is replaced like an older call.
            current = self.compare_set(key, raw, wanted).decode(errors="replace")
            if current == wanted:
                return
            raw = current
        log.warning("could not raise %r to call %d: the key keeps changing", key, call)

    # ------------------------------------------------------------------ faults

    def fault_count(self) -> int:
        """Number of faults recorded in the job so far: its authentic fault log entries.

        The fault counter is not it: anyone can add to a counter. It only
        tells waiters when to read the log again (:meth:`fault_signal`).
        """
        return len(self.fault_log())

    def fault_signal(self) -> int:
        """The fault counter: it changes when a fault may have been recorded (a wake-up, not
        a count; confirm with :meth:`fault_count`)."""
        return self.counter(P.FAULTS)

    def record_fault(self, identity: str, reason: str) -> int:
        """Records a fault attributed to ``identity``; returns the fault counter."""
        self._log_fault(identity, reason)
        return self.signal_fault()

    def signal_fault(self) -> int:
        """Raises the fault counter and wakes the fault watches; returns the counter.

        Invariant: whoever raises the counter to ``k`` sets ``fw/<k>`` right
        after, so a watch that read the counter as ``s`` and then blocks on
        ``fw/<s+1>`` wakes at the next fault (:meth:`watch_faults`). The log
        entry is appended before, on this same connection: a watch that wakes
        reads it.
        """
        k = int(self.add(P.FAULTS, 1))
        self.set(P.fault_wake_key(k), "1")
        return k

    def watch_faults(
        self,
        publish: Callable[[int], None],
        chunk: float,
        pause: float,
        stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Calls ``publish(fault count)`` now and after every fault, blocking in the store
        in between; returns when ``stop()`` is true after a wait.

        No polling: one wait per fault (faults that follow within ``pause`` of
        one published are read together) or per ``chunk`` seconds, then one
        read of the counter (and of the log when it changed). The counter is read
        before the log, so a fault recorded after that read raises it past
        ``s`` and its wake-up key is one this watch waits on or has passed. A
        wake-up lost (a recorder that died between its two operations) or
        skipped (a stranger's add, which sets no key) costs at most ``chunk``;
        a forged wake-up key (it exists, the counter did not move) costs a
        ``pause``, never a spin. Blocks its client: give it a connection of
        its own. A store whose ``wait`` polls in the client (``FileStore``,
        every 10 ms) is looked at every ``pause`` instead.
        """
        served = waits_in_server(self)
        seq, published = self.fault_signal(), None
        while True:
            if seq != published:
                first = published is None
                publish(self.fault_count())
                published = seq
                if not first:
                    # At most one look per pause while faults keep coming: when a
                    # rank dies in a collective, each of N peers records a fault,
                    # and a watch woken by each would cost the store N² reads. The
                    # first fault is heard at once; a burst costs each watch a read
                    # per pause, as the polling it replaced did.
                    time.sleep(pause)
            key = P.fault_wake_key(seq + 1)
            if served:
                woke = self.wait_for(key, chunk)
            else:
                time.sleep(pause)
                woke = self.check([key])
            if stop():
                return
            newest = self.fault_signal()
            if woke and newest <= seq:
                time.sleep(pause)
            seq = newest

    def _log_fault(self, identity: str, reason: str) -> None:
        self.add_entry(P.FAULT_LOG, P.fault_entry(identity, reason, time.time()).rstrip("\n"))

    def fault_log(self) -> list[dict[str, Any]]:
        return P.parse_fault_log("\n".join(self.entries(P.FAULT_LOG)))

    # ------------------------------------------------------------------ terminated / left ranks

    def mark_terminated(self, identity: str, reason: str) -> bool:
        """Records that ``identity`` left the job for good; returns whether this call did.

        Idempotent: several observers (the rank itself, its monitor process, a
        heartbeat watcher) may report the same rank; it is recorded once.
        """
        won, _ = self.set_once(P.per_identity(P.TERMINATED, identity), uuid.uuid4().hex)
        if won:
            # Order matters, see the module docstring: the reason first, then
            # the list, then the counters. Whoever sees the death listed (a
            # rendezvous decider) finds its reason in the fault log already.
            # The log entry is the death's fault (fault_count counts the log).
            self._log_fault(identity, P.TERMINATED_PREFIX + reason)
            self.add_entry(P.TERMINATED, P.check_identity(identity))
            self.signal_fault()
            # raises the count of deaths (the terminated epoch) with the wake-up:
            # a rendezvous may be complete without its arrival
            self.wake_waiters(death=True)
        return won

    def terminated(self) -> set[str]:
        return set(self.identities(P.TERMINATED))

    def terminated_since(self, epoch: int) -> set[str]:
        """:meth:`terminated`, read again only when ``epoch`` (a terminated epoch read just
        before) is not the one of the last read by this client.

        Sound because a death is listed before the epoch is raised: a list read
        after epoch ``e`` was read holds every death that raised it to ``e``.
        """
        if epoch == 0:
            return set()  # nobody was ever listed: the epoch is raised after the listing
        cached = getattr(self, "_terminated_cache", None)
        if cached is None or cached[0] != epoch:
            cached = (epoch, frozenset(self.terminated()))
            self._terminated_cache = cached
        return set(cached[1])

    def terminated_epoch(self) -> int:
        """The call's count of deaths: changes when a death may have been listed."""
        return self.wake_state()[1]

    def is_terminated(self, identity: str) -> bool:
        return self.read(P.per_identity(P.TERMINATED, identity)) is not None

    def mark_left(self, identity: str) -> None:
        """Records a clean departure (a discarded rank); not a fault."""
        self.add_entry(P.LEFT, P.check_identity(identity))

    def left(self) -> set[str]:
        return set(self.identities(P.LEFT))

    # ------------------------------------------------------------------ joins

    def request_join(self, identity: str) -> None:
        """A new process asks to join a running job at its next restart."""
        self.add_entry(P.JOIN_REQUESTS, P.check_identity(identity))
        self.record_fault(identity, "join request")

    def join_requests(self) -> list[str]:
        return self.identities(P.JOIN_REQUESTS)

    def join_requested_since(self, count: int) -> bool:
        """Whether a fault after the first ``count`` of the fault log is a join request."""
        return any(e["reason"] == "join request" for e in self.fault_log()[count:])

    # ------------------------------------------------------------------ heartbeats

    def send_node_heartbeat(self, node: str, identities: Sequence[str]) -> int:
        """Writes a new heartbeat of ``node`` naming the ranks it hosts: a sealed record
        with an increasing stamp (the node's monotonic clock), so an old one replayed
        never reads as a new one (see :mod:`inprocess.node`)."""
        stamp = time.monotonic_ns()
        ranks = P.SEP.join(P.check_identity(i) for i in identities)
        self.put(P.node_key(P.NODE_BEAT, node), f"{stamp} {ranks}")
        return stamp

    def node_heartbeat(self, node: str) -> tuple[int, list[str]]:
        """The latest authentic heartbeat of ``node``: (stamp, its ranks); (0, []) when
        none (or only a forgery or garbage) is there."""
        return P.parse_node_beat(self.read(P.node_key(P.NODE_BEAT, node)))

    def place(self, identity: str, node: str) -> None:
        """Records the node ``identity`` runs on (its monitor process does, once)."""
        self.put(P.per_identity(P.PLACED, identity), node)

    def node_of(self, identity: str) -> str | None:
        """The node ``identity`` runs on, ``None`` before it was placed."""
        node = self.read(P.per_identity(P.PLACED, identity))
        return node if node is not None and P.valid_name(node) else None

    # ------------------------------------------------------------------ membership

    def publish_membership(self, iteration: int, members: Sequence[str]) -> None:
        """Makes the latest decided membership visible to monitors and joiners."""
        self.put(P.MEMBERSHIP, P.Membership(iteration, tuple(members)).encode())

    def membership(self) -> tuple[int, list[str]] | None:
        published = P.Membership.parse(self.read(P.MEMBERSHIP), self.full_key(P.MEMBERSHIP))
        if published is None:
            return None
        return published.iteration, list(published.members)

    # ------------------------------------------------------------------ outcome

    def outcome(self, iteration: int) -> str:
        """``"completed"``, ``"fault"``, or ``""`` while undecided."""
        return self.read(P.iteration_key(iteration, P.OUTCOME)) or ""

    def decide_outcome(self, iteration: int, outcome: str) -> str:
        """Proposes ``"completed"`` or ``"fault"`` for ``iteration``; returns what stands.

        A "completed" that stands wakes the call's waiters, once: a relaunched
        worker waiting to be admitted must see the job complete. (A fault needs
        no wake-up: the termination barrier that follows wakes the joiner, and
        ranks already at a barrier would only look again for nothing.)
        """
        if outcome not in (P.COMPLETED, P.FAULT):
            raise ValueError(f"outcome must be {P.COMPLETED!r} or {P.FAULT!r}, got {outcome!r}")
        won, standing = self.set_once(P.iteration_key(iteration, P.OUTCOME), outcome)
        if won and outcome == P.COMPLETED:
            self.wake_waiters()
        return standing

    def mark_completed(self, identity: str, iteration: int) -> None:
        """Records that ``identity`` finished the job, so its exit is not a fault."""
        self.put(P.per_identity("completed", identity), str(iteration))

    def has_completed(self, identity: str) -> bool:
        return self.read(P.per_identity("completed", identity)) is not None

    def all_arrived(self, key: str, members: Sequence[str]) -> dict[str, str] | None:
        """The authentic arrivals (``identity=value`` records) at list ``key`` once every one of
        ``members`` has one; ``None`` before. Used where a counter only wakes the reader."""
        arrivals = self.by_identity(key)
        return arrivals if all(m in arrivals for m in members) else None

    def by_identity(self, key: str, raw: bytes | str | None = None) -> dict[str, str]:
        """The authentic ``identity=value`` records at ``key`` (or in ``raw`` read from it),
        the first value of each identity."""
        found: dict[str, str] = {}
        entries = self.entries(key) if raw is None else self.decode_entries(key, raw)
        for entry in entries:
            identity, _, value = entry.partition("=")
            if P.valid_name(identity):
                found.setdefault(identity, value)
            else:
                reject(self.full_key(key), "a malformed identity")
        return found

    # ------------------------------------------------------------------ rendezvous

    def rendezvous(
        self,
        name: str,
        identity: str,
        participants: Sequence[str],
        value: str,
        timeout: datetime.timedelta,
        decide: Callable[[dict[str, str], set[str], int], str],
        poll_limit: float,
        on_wait: Callable[[], None] | None = None,
        relay: RelayClient | None = None,
    ) -> str:
        """Arrives at rendezvous ``name`` with ``value`` and returns its decision.

        The rendezvous completes when each of ``participants`` has arrived or is
        terminated. The rank that notices calls ``decide(arrivals, terminated,
        fault_baseline)`` with the values of the arrived participants, the
        terminated participants (arrived or not) and the fault count read before
        them; its result is published once and returned to everyone. ``on_wait``
        runs between polls. With ``relay``, the arrival and the wait go through
        the node's relay (:mod:`inprocess.relay`) while one runs.
        """
        members = P.roster(participants)  # (O(1) per rank for a roster it holds)
        if identity not in members:
            raise StoreError(f"{identity} is not a participant of rendezvous {name!r}")
        if "\n" in value:
            raise ValueError("rendezvous values must be single-line")
        deadline = time.monotonic() + timeout.total_seconds()
        if relay is not None:
            relayed = self._relayed(
                name, identity, members, value, deadline, decide, on_wait, relay
            )
            if relayed is not None:
                return relayed
            timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.0))
        done_key = P.done_key(name)
        # The last to arrive decides at once. Waiters block on the call's next
        # wake-up (the store wakes them: no polling): a decision published or a
        # death listed. A member that died without arriving is counted on its
        # behalf (once, by whoever sees it first), so the counter completes the
        # rendezvous on arrivals and deaths alone, and only a rank that raises
        # the counter to the number of members reads the arrivals list.
        # The wake-up sequence is read before arriving: no decision can be
        # published before this rank arrives (it is a live member), so every
        # decision wakes it, and the first look needs no read of the decision.
        # (A member wrongly listed as dead may find the decision made without
        # it: it reads it after its first wait, a chunk later.)
        # The count of deaths comes with that read (one counter, see
        # protocol.wake_state): the first look at the dead costs nothing more,
        # and a later one reads it again only when a wake-up brought no decision.
        waiter = WakeWait(self, timeout, poll_limit)
        complete = self._arrive(name, identity, value, members)  # what it read: see _complete
        seen_deaths = -1
        counted: set[str] = set()
        woken = False
        while not complete:
            deaths = waiter.deaths
            if woken:
                # None: not decided yet, or only a stranger's garbage there
                published = P.first_or_none(self.entries(done_key))
                if published is not None:
                    return published
                deaths = waiter.read_deaths()
            woken = True
            if deaths != seen_deaths:
                seen_deaths, waiter.idle = deaths, False
                complete = self._count_the_dead(name, members, counted, deaths)
                if complete:
                    break
            if waiter.remaining() <= 0:
                raise BarrierTimeout(
                    f"rendezvous {name!r} timed out after {timeout.total_seconds():.3g}s "
                    f"({self.counter(P.count_key(name))}/{len(members)} arrived)"
                )
            waiter.wait()
            if on_wait is not None:
                on_wait()
        return self._publish(name, members, decide, complete)

    def _publish(
        self,
        name: str,
        members: Sequence[str],
        decide: Callable[[dict[str, str], set[str], int], str],
        reads: _Reads,
    ) -> str:
        """Decides a complete rendezvous, publishes the decision once, wakes the waiters."""
        decision = self._decide(name, members, decide, reads)
        won, published = self.set_once(P.done_key(name), decision)
        if won:
            self.wake_waiters()
        return published

    def _relayed(
        self,
        name: str,
        identity: str,
        members: Sequence[str],
        value: str,
        deadline: float,
        decide: Callable[[dict[str, str], set[str], int], str],
        on_wait: Callable[[], None] | None,
        relay: RelayClient,
    ) -> str | None:
        """The rendezvous through the node's relay: its decision, or ``None`` where the
        rank must arrive on its own (no relay took the arrival, or its process died,
        or it stopped). Arriving again then is harmless: the first record of an
        identity stands, and the counter only says when to look."""
        if not relay.arrive(name, identity, value, len(members)):
            return None
        counted: set[str] = set()
        chunk_max = getattr(self, "wait_chunk_max", WAIT_CHUNK_MAX)
        chunk = min(WAIT_CHUNK, chunk_max)
        while True:
            answer = relay.receive(name, min(chunk, max(deadline - time.monotonic(), 0.0)))
            complete: _Reads | None = None
            if answer is None:
                # A chunk with no answer. While the relay that took the arrival
                # runs, the decision comes from it (it retries a full queue): the
                # store is looked at only once the waits grew to RELAYED_LOOK (a
                # slow barrier's every rank must not read it every chunk, as at
                # 16k simulated ranks on two cores), at the deadline, and when the
                # relay died.
                if on_wait is not None:
                    on_wait()
                alive = relay.relay_alive()
                grown = chunk >= min(RELAYED_LOOK, chunk_max)
                if not alive or grown or time.monotonic() >= deadline:
                    published = P.first_or_none(self.entries(P.done_key(name)))
                    if published is not None:
                        return published
                if time.monotonic() >= deadline:
                    raise BarrierTimeout(
                        f"rendezvous {name!r} timed out "
                        f"({self.counter(P.count_key(name))}/{len(members)} arrived)"
                    )
                # Only a relay that died sends its ranks off: each of them then
                # counts again (it cannot tell whether the relay counted it), and
                # past the number of members every count is followed by a full
                # read of the arrivals. A few ranks of a node may pay that; all
                # ranks of a slow barrier must not (O(N^2) reads).
                if not alive:
                    log.warning(
                        "%s: the node's relay died; arriving at %r on its own", identity, name
                    )
                    return None
                chunk = min(chunk * 2, chunk_max)
                continue
            kind, text = answer
            if kind == "decision":
                return text
            if kind == "fetch":
                published = P.first_or_none(self.entries(P.done_key(name)))
                if published is not None:
                    return published
            elif kind == "direct":
                return None
            elif kind == "check":
                complete = self._complete(name, members)
            elif kind == "dead":
                with contextlib.suppress(ValueError):
                    complete = self._count_the_dead(name, members, counted, int(text))
            if complete:
                return self._publish(name, members, decide, complete)

    # ------------------------------------------------------------------ wake-ups

    def wake_state(self) -> tuple[int, int]:
        """(the number of the call's latest wake-up, its count of deaths), one read.

        Counters: they wake, they decide nothing (see :func:`protocol.wake_state`).
        """
        return P.wake_state(self.counter(P.WAKE_SEQ))

    def wake_waiters(self, death: bool = False) -> None:
        """Wakes every rank blocked at a rendezvous or barrier of the call.

        Invariant: the k-th wake-up sets key ``w/<k>``. A waiter that read
        the sequence as ``s`` *before* looking at what it waits for blocks on
        ``w/<s+1>``, which the first wake-up after its look sets: none is
        missed (:class:`WakeWait`). A stranger's add to the sequence can only
        make a waiter sleep to the end of its chunk (:data:`WAIT_CHUNK` and up)
        before it looks again. ``death``: the wake-up of a death just listed,
        which also raises the count of deaths (after the listing: a list read
        once the count was read holds every death it counts).
        """
        k, _ = P.wake_state(int(self.add(P.WAKE_SEQ, P.DEATH_WAKE if death else 1)))
        self.set(P.wake_key(k), "1")

    def wait_for(self, key: str, seconds: float) -> bool:
        """Blocks until ``key`` exists or ``seconds`` passed; returns whether it exists.

        The store wakes the waiter when the key is set (one round trip, no
        polling). A store that cannot be reached raises. On a ``TCPStore`` the
        wait goes over this thread's connection of its own
        (:mod:`inprocess.quiet_wait`): torch's client would print two warnings
        for every wait that ends without its key, and a chunk that ends so
        leaves the request standing for the next chunk of the same wait.
        """
        served = _served_name(self, key)
        if served is not None:
            woke = quiet_wait.wait(*served, seconds)
            if woke is not None:
                return woke
        try:
            self.wait([key], datetime.timedelta(seconds=max(seconds, 0.001)))
            return True
        except dist.DistNetworkError:
            raise
        except (dist.DistStoreError, RuntimeError) as ex:
            # torch reports a wait's timeout as a DistStoreError ("wait
            # timeout", TCPStore) or a RuntimeError ("Timeout", FileStore)
            if "imeout" not in str(ex):
                raise
            return False

    def _arrive(
        self, name: str, identity: str, value: str, members: Sequence[str]
    ) -> _Reads | None:
        """Arrives; returns what it read when the rendezvous is complete with this arrival.

        The arrival is a sealed record (a rank and an observer acting for it
        count once: the first record of an identity stands). It is appended
        before the counter is raised, so the last to raise it reads every
        arrival. The counter only says when to read: anyone can add to it, so
        completion is checked on the authentic arrivals (and deaths).
        """
        self.add_entry(P.arrivals_key(name), f"{identity}={value}")
        return self._raise_count(name, members)

    def _raise_count(self, name: str, members: Sequence[str]) -> _Reads | None:
        """Raises the rendezvous counter; what it read when that completed it (checked
        only at the count of members or above: a member that arrived, then died,
        counts twice, so a check can come early, and the next raise checks again)."""
        count = int(self.add(P.count_key(name), 1))
        return self._complete(name, members) if count >= len(members) else None

    def _count_the_dead(
        self, name: str, members: Sequence[str], counted: set[str], epoch: int
    ) -> _Reads | None:
        """Counts each terminated member once at this rendezvous, on its behalf.

        Invariant: a dead member raises the counter once, whoever sees it first
        (a once-key per member claims it), so the counter reaches the
        number of members when every member arrived or died. Returns what it
        read when this rank's raise completed the rendezvous.
        """
        complete: _Reads | None = None
        for dead in sorted(self.terminated_since(epoch).intersection(members) - counted):
            counted.add(dead)
            # a sealed once-key, not a counter: a stranger's add must not
            # keep a death from being counted
            if self.set_once(P.dead_key(name, dead), uuid.uuid4().hex)[0]:
                complete = self._raise_count(name, members) or complete
        return complete

    def _arrivals(self, name: str) -> dict[str, str]:
        return self.by_identity(P.arrivals_key(name))

    def _complete(self, name: str, members: Sequence[str]) -> _Reads | None:
        """What it read when every member has arrived or is terminated (authentic records
        only), else ``None``; called once this rank's arrival is in (the arrivals key
        exists). Read in the decision's order (see :meth:`_decide`), so a complete
        rendezvous is decided from these reads: the arrivals, O(N) for this one
        rank, are read once, not twice."""
        entries = self.fault_log()
        terminated = self.terminated()
        arrived = self.by_identity(P.arrivals_key(name), raw=self.get(P.arrivals_key(name)))
        missing = [m for m in members if m not in arrived]
        if missing and not terminated.issuperset(missing):
            return None
        return _Reads(entries, terminated.intersection(members), arrived)

    def _decide(
        self,
        name: str,
        members: Sequence[str],
        decide: Callable[[dict[str, str], set[str], int], str],
        reads: _Reads,
    ) -> str:
        # Read order is the protocol's invariant: faults (the log), then
        # terminated, then the arrivals. The baseline is read before the
        # arrivals: a fault logged after them (a member's death once it
        # arrived) must fault the iteration decided here. A member listed as
        # dead whose fault entry was logged after the log was read would raise
        # the count above this baseline and fault the iteration for a death it
        # already handles: read all three again until the log read has every
        # listed death of a member. A death is logged before it is listed, so
        # this ends at the second read unless more ranks keep dying; it is
        # bounded by COUNTED_WAIT all the same. The common case (no death
        # listed after the log was read) decides from the reads that found
        # the rendezvous complete.
        deadline = time.monotonic() + COUNTED_WAIT
        entries, terminated, arrivals = reads.entries, reads.terminated, reads.arrivals
        while not terminated.issubset(P.terminations(entries)):
            if time.monotonic() >= deadline:
                break
            time.sleep(0.001)
            entries = self.fault_log()
            terminated = self.terminated().intersection(members)
            arrivals = self._arrivals(name)
        arrivals = {i: arrivals[i] for i in members if i in arrivals}
        return decide(arrivals, terminated, len(entries))

    def counted_barrier(
        self,
        name: str,
        identity: str,
        count: int,
        timeout: datetime.timedelta,
        poll_limit: float,
        on_wait: Callable[[], None] | None = None,
        arrange: Callable[[list[str]], str] | None = None,
        expand: Callable[[str], Sequence[str]] = P.split_identities,
        claim: str | None = None,
    ) -> Sequence[str]:
        """A barrier of ``count`` ranks whose identities are not known in advance.

        Returns the identities of the arrived ranks in arrival order; or, with
        ``arrange``, what ``expand`` makes of the text ``arrange`` made of them.
        The rank that completes the barrier arranges once, so the others
        receive the result (O(N) work once, not on every rank). A
        ``ValueError`` ``arrange`` raises reaches every rank as a
        :class:`BarrierRefused` with its message. With ``claim`` (a token unique
        to the caller) the arrival is recorded as ``<identity>=<claim>``: two
        processes that arrive with one identity (a misconfigured rank) then
        count twice, and ``arrange`` sees the identity twice and can refuse,
        where their one record would count once and the barrier wait for a
        rank that never comes.
        """
        done_key = P.done_key(name)
        if not P.valid_name(identity):
            raise ValueError(
                f"barrier {name!r}: a participant's name has no separators, got {identity!r}"
            )
        self.add_entry(P.arrivals_key(name), identity if claim is None else f"{identity}={claim}")
        # The counter says when to read; the authentic arrivals decide.
        if int(self.add(P.count_key(name), 1)) >= count:
            entries = self.entries(P.arrivals_key(name))
            if claim is not None:
                entries = [entry.partition("=")[0] for entry in entries]
            arrived = [i for i in entries if P.valid_name(i)]
            if len(arrived) > count:
                raise BarrierOverflow(f"barrier {name!r}: {len(arrived)} arrivals for {count}")
            if len(arrived) == count:
                try:
                    text = arrange(arrived) if arrange is not None else P.SEP.join(arrived)
                except ValueError as ex:
                    text = _REFUSED + str(ex).replace("\n", " ")
                if self.set_once(done_key, text)[0]:
                    self.wake_waiters()
        try:
            published = self.wait_for_key(done_key, timeout, poll_limit, on_wait, sealed=True)
        except RestartTimeoutError as ex:
            raise BarrierTimeout(
                f"barrier {name!r} timed out after {timeout.total_seconds():.3g}s "
                f"({self.counter(P.count_key(name))}/{count} arrived)"
            ) from ex
        if published.startswith(_REFUSED):
            raise BarrierRefused(f"barrier {name!r}: {published.removeprefix(_REFUSED)}")
        try:
            return expand(published)
        except ValueError as ex:
            raise BarrierRefused(f"barrier {name!r}: {ex}") from None

    def all_gather_lines(
        self,
        prefix: str,
        identity: str,
        line: str,
        count: int,
        timeout: datetime.timedelta,
        poll_limit: float,
    ) -> list[str]:
        """Every participant's ``line`` (one line, no newline), once all ``count`` gave theirs.

        Lines come in arrival order. Used by rank assignments that exchange
        rank-local facts (group keys, topology).
        """
        if "\n" in line:
            raise ValueError(f"all_gather_lines: the line of {identity!r} spans lines: {line!r}")
        self.add_entry(f"{prefix}/lines", f"{identity}={line}")
        self.counted_barrier(f"{prefix}/barrier", identity, count, timeout, poll_limit)
        return list(self.by_identity(f"{prefix}/lines").values())

    # ------------------------------------------------------------------ state and key exchange

    def send_state(self, state: Any, rank: int) -> None:
        """Publishes rank ``rank``'s state for :meth:`get_states`: its plain fields (rank,
        world sizes, initial rank, iteration, mode, active rank), not the store or the
        exception. The exchange the newer generation's rank assignments use."""
        fields = {name: getattr(state, name) for name in _STATE_FIELDS}
        fields["mode"] = state.mode.value
        self.put(f"inprocess/exchange/state/{rank}", json.dumps(fields))

    def get_states(self, ranks: Iterable[int]) -> list[Any]:
        """The states that ``ranks`` sent (:meth:`send_state`), in that order, as
        :class:`inprocess.state.State`; waits for them at most the store's timeout."""
        from .state import Mode, State

        states = []
        for text in self._gathered("state", ranks):
            fields = json.loads(text)
            fields["mode"] = Mode(fields["mode"])
            states.append(State(**fields))
        return states

    def send_key(self, key: Any, rank: int) -> None:
        """Publishes rank ``rank``'s grouping key (JSON: a string, a number, a list of
        them; anything else as its ``str``) for :meth:`get_keys`."""
        self.put(f"inprocess/exchange/key/{rank}", json.dumps(key, default=str))

    def get_keys(self, ranks: Iterable[int]) -> list[Any]:
        """The keys that ``ranks`` sent (:meth:`send_key`), in that order; waits for them
        at most the store's timeout."""
        return [json.loads(text) for text in self._gathered("key", ranks)]

    def _gathered(self, kind: str, ranks: Iterable[int]) -> list[str]:
        keys = [f"inprocess/exchange/{kind}/{rank}" for rank in ranks]
        if not keys:
            return []
        values = []
        # multi_get waits until every key exists (at most the store's timeout).
        for key, raw in zip(keys, self.multi_get(keys), strict=True):
            found = self.decode_entries(key, raw)
            if not found:
                raise StoreError(f"{key!r} holds no authentic record")
            values.append(found[0])
        return values

    def wait_for_key(
        self,
        key: str,
        timeout: datetime.timedelta,
        poll_limit: float,
        on_wait: Callable[[], None] | None = None,
        sealed: bool = False,
    ) -> str:
        """Blocks until ``key`` exists and returns its value (``sealed``: until it holds an
        authentic record, and returns the first one). The key's writer wakes the
        waiters (:meth:`wake_waiters`); ``on_wait`` runs between waits."""
        waiter = WakeWait(self, timeout, poll_limit)
        while True:
            raw = self.get_or(key, _ABSENT)
            if raw != _ABSENT:
                if not sealed:
                    return raw
                published = P.first_or_none(self.decode_entries(key, raw))
                if published is not None:
                    return published
            if waiter.remaining() <= 0:
                raise RestartTimeoutError(
                    f"key {key!r} did not appear within {timeout.total_seconds():.3g}s"
                )
            waiter.wait()
            if on_wait is not None:
                on_wait()


#: the fields of a state that :meth:`StoreMixin.send_state` sends (with ``mode``)
_STATE_FIELDS = (
    "rank",
    "world_size",
    "active_world_size",
    "initial_rank",
    "initial_world_size",
    "iteration",
    "active_rank",
)


@dataclasses.dataclass(frozen=True)
class _Reads:
    """What the rank that found a rendezvous complete read, in the decision's read
    order (the fault log, then the terminated members, then the arrivals)."""

    entries: list[dict[str, Any]]
    terminated: set[str]
    arrivals: dict[str, str]


@dataclasses.dataclass(frozen=True)
class ClientSpec:
    """A picklable recipe for a client of a store: ``factory(**kwargs)``.

    The monitor process connects with it; a spawned monitor receives it
    pickled, so ``factory`` must then be importable by name.
    """

    factory: Callable[..., StoreMixin]
    kwargs: dict[str, Any]

    def connect(self) -> StoreMixin:
        return self.factory(**self.kwargs)


def _prefixed(prefix: str, base: ClientSpec) -> StoreMixin:
    return PrefixStore(prefix, base.connect())


def describe(store: Any) -> ClientSpec | None:
    """A :class:`ClientSpec` of ``store`` from torch's store type, or ``None`` when unknown."""
    if isinstance(store, dist.TCPStore):
        # A plain client: never hosts, whatever the original's is_master was.
        kwargs = {"host_name": store.host, "port": store.port, "timeout": store.timeout}
        return ClientSpec(TCPStore.client, kwargs)
    if isinstance(store, dist.FileStore):
        # world_size -1: a client never takes part in deleting the file.
        return ClientSpec(FileStore, {"file_name": store.path, "world_size": -1})
    if isinstance(store, PrefixStore) and isinstance(store.base_store, dist.Store):
        base = describe(store.base_store)
        if base is not None:
            return ClientSpec(_prefixed, {"prefix": store.prefix, "base": base})
    return None


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def externally_hosted(host_name: str, port: int) -> bool:
    """Whether a launcher hosts the store at ``host_name:port`` (outside the workers).

    torchrun and ``inprocess-run`` set ``TORCHELASTIC_USE_AGENT_STORE=True``, but
    their agent hosts only the store at ``MASTER_ADDR:MASTER_PORT``: a store on any
    other address or port (the usage guide puts the Wrapper's at ``MASTER_PORT + 2``)
    must still be hosted by a worker.
    """
    if os.environ.get(AGENT_STORE_ENV) != str(True):
        return False
    return host_name == _env("MASTER_ADDR") and str(port) == _env("MASTER_PORT")


def _bound_listener(host_name: str, port: int) -> dict[str, int]:
    """The server's listening socket, bound to ``host_name`` only (issue 9).

    torch's own server listens on every interface whatever ``host_name`` says;
    handing it a socket we bound (``master_listen_fd``, which it owns from
    then on) keeps it on the configured address.
    """
    if port and _listening_here(port):
        return {}  # torch's multi-tenant server of this process: it is reused as it is
    fd = listen_fd(host_name, port)
    return {"port": bound_port(fd), "master_listen_fd": fd}


def _listening_here(port: int) -> bool:
    """Whether this process already listens on ``port`` (a store server we host)."""
    import psutil

    return any(
        c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
        for c in psutil.Process().net_connections(kind="tcp")
    )


class TCPStore(dist.TCPStore, StoreMixin):
    """``torch.distributed.TCPStore`` with the Wrapper protocol.

    Defaults come from the environment: ``MASTER_ADDR``, ``MASTER_PORT``. The
    server is hosted by initial rank 0 unless a launcher hosts it: torchrun's and
    ``inprocess-run``'s agent store (``TORCHELASTIC_USE_AGENT_STORE=True``) at
    exactly ``MASTER_ADDR:MASTER_PORT``; ``is_master`` overrides the choice. A port that is
    already taken by another process is an error, never a silent fallback to a
    client of whatever listens there.
    """

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = False,
        multi_tenant: bool = True,
        use_libuv: bool = True,
        is_master: bool | None = None,
    ) -> None:
        host_name = host_name if host_name is not None else _env("MASTER_ADDR")
        if host_name is None:
            raise StoreError("TCPStore needs host_name or the MASTER_ADDR environment variable")
        if port is None:
            env_port = _env("MASTER_PORT")
            if env_port is None:
                raise StoreError("TCPStore needs port or the MASTER_PORT environment variable")
            port = int(env_port)
        if not 0 <= int(port) < 65536:
            raise ValueError(f"port must be in [0, 65535] (0: any free port), got {port}")
        if is_master is None:
            is_master = (
                not externally_hosted(host_name, int(port))
                and int(os.environ.get("RANK", "0")) == 0
            )
        try:
            listen = _bound_listener(host_name, int(port)) if is_master else {}
            super().__init__(
                host_name=host_name,
                port=int(listen.get("port", port)),
                world_size=world_size,
                is_master=is_master,
                timeout=timeout,
                wait_for_workers=wait_for_workers,
                multi_tenant=multi_tenant,
                use_libuv=use_libuv,
                **{k: v for k, v in listen.items() if k != "port"},
            )
        except (RuntimeError, OSError) as ex:
            if is_master and ("EADDRINUSE" in str(ex) or getattr(ex, "errno", 0) == EADDRINUSE):
                raise StoreError(
                    f"cannot host the store on port {port}: the port is already in use by "
                    "another process; choose a free MASTER_PORT (or store_kwargs['port'])"
                ) from ex
            role = "host" if is_master else "connect to"
            raise StoreError(f"cannot {role} the store at {host_name}:{port}: {ex}") from ex
        self.host_name = host_name
        self.is_master = is_master

    @classmethod
    def client(cls, **kwargs: Any) -> TCPStore:
        kwargs = dict(kwargs)
        kwargs["is_master"] = False
        return cls(**kwargs)


class FileStore(dist.FileStore, StoreMixin):
    """``torch.distributed.FileStore`` with the Wrapper protocol (single host jobs)."""

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        self.file_name = file_name
        super().__init__(file_name, world_size)


class PrefixStore(dist.PrefixStore, StoreMixin):
    """``torch.distributed.PrefixStore`` with the Wrapper protocol."""

    def __init__(self, prefix: str | int, store: dist.Store) -> None:
        self.prefix = str(prefix)
        self.base_store = store
        # a view of a store waits like it (see WAIT_CHUNK)
        self.wait_chunk_max = getattr(store, "wait_chunk_max", WAIT_CHUNK_MAX)
        super().__init__(str(prefix), store)
