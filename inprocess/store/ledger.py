"""The per-call ledger on the store: faults, terminated and departed ranks, join
requests, node heartbeats and placement, the published membership, and each
iteration's outcome.

Its invariants (the order of a death's records, the fault watch's wake-ups) are
stated in :mod:`inprocess.store` and where each is enforced below.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .. import protocol as P
from ..security import seal
from .helpers import waits_in_server

log = logging.getLogger(__name__)


class LedgerMixin:
    """What happened to the ranks of a call, recorded once and read by all: a part of
    :class:`~inprocess.store.StoreMixin` (it writes through the sealed records of
    :class:`~inprocess.store.records.RecordsMixin` and wakes through
    :class:`~inprocess.store.wakeups.WakeMixin`)."""

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
            # Order matters (see "Terminated ranks" in inprocess.store): the reason first, then
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
