"""Rendezvous and counted barriers on the store, and the relay path of a rendezvous.

A rendezvous completes when every participant has either arrived or been
terminated; whoever notices computes the decision and publishes it to a once-key
(see "Rendezvous" in :mod:`inprocess.store`). Its invariants (each dead member
counted once, the decision's read order) are stated where they are enforced below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..exception import StoreError
from ..exception import TimeoutError as RestartTimeoutError
from ..waiting import WAIT_CHUNK, WAIT_CHUNK_MAX, WakeWait
from .helpers import BarrierOverflow, BarrierRefused, BarrierTimeout

if TYPE_CHECKING:
    from ..relay import RelayClient

log = logging.getLogger(__name__)

#: seconds a decider waits for the listed deaths of its rendezvous to be counted
COUNTED_WAIT = 1.0
#: a rank waiting on its node's live relay looks at the store itself only once its
#: wait chunks grew to this, or to the store's cap (2 + 4 + 8 s into the wait; see
#: RendezvousMixin._relayed)
RELAYED_LOOK = 8.0

#: starts a counted barrier's decision that refuses the arrivals (no identity starts so)
_REFUSED = "!"


@dataclasses.dataclass(frozen=True)
class _Reads:
    """What the rank that found a rendezvous complete read, in the decision's read
    order (the fault log, then the terminated members, then the arrivals)."""

    entries: list[dict[str, Any]]
    terminated: set[str]
    arrivals: dict[str, str]


class RendezvousMixin:
    """Rendezvous, counted barriers and line exchanges of a call: a part of
    :class:`~inprocess.store.StoreMixin` (it reads and writes through
    :class:`~inprocess.store.records.RecordsMixin`, reads the deaths of
    :class:`~inprocess.store.ledger.LedgerMixin` and waits and wakes through
    :class:`~inprocess.store.wakeups.WakeMixin`)."""

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
        supersede: Callable[[list[str]], list[str]] | None = None,
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
        rank that never comes. With ``supersede``, only the arrivals it keeps
        count (e.g. :func:`inprocess.protocol.latest_incarnations`: a
        relaunched process replaces its predecessor's arrival); the barrier
        completes once ``count`` of them are there.
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
            if supersede is not None:
                # Invariant: the counter counts every arrival, superseded ones
                # too, so it may pass ``count`` before the barrier is full; each
                # arrival from then on reads the list again until it is.
                arrived = supersede(arrived)
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
