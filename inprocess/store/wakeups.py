"""Wake-ups and blocking waits on the store: how ranks at a rendezvous, a barrier or a
key wait without polling.

Invariant (enforced by :meth:`WakeMixin.wake_waiters`): the k-th wake-up of a call
sets key ``w/<k>``, so a waiter that read the sequence before its look misses none
(:class:`inprocess.waiting.WakeWait`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch.distributed as dist

from .. import protocol as P
from .. import quiet_wait
from ..exception import TimeoutError as RestartTimeoutError
from ..waiting import WakeWait
from .helpers import _served_name
from .records import _ABSENT


class WakeMixin:
    """Wakes the call's waiters and waits for keys: a part of
    :class:`~inprocess.store.StoreMixin` (it reads through
    :class:`~inprocess.store.records.RecordsMixin`)."""

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

