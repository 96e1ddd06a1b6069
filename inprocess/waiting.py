"""A rank's wait at a barrier of the store: it blocks until the call's next wake-up.

Shared by the ranks' rendezvous and barriers (:mod:`inprocess.store`,
:mod:`inprocess.membership`) and by the node's relay (:mod:`inprocess.relay`), which
waits on the store for its ranks: a module of its own so that neither of the
two imports the other.
"""

from __future__ import annotations

import datetime
import time
from typing import Protocol

from . import protocol as P


class WakeSource(Protocol):
    """What a :class:`WakeWait` needs of a store (:class:`~inprocess.store.StoreMixin`)."""

    def wake_state(self) -> tuple[int, int]: ...

    def wait_for(self, key: str, seconds: float) -> bool: ...


#: first and longest single store wait of a rank blocked at a rendezvous or barrier.
#: Waiters are woken by the store when what they wait for changes
#: (:meth:`~inprocess.store.StoreMixin.wake_waiters`); a chunk only bounds a wake-up that a stranger
#: forged or a dying writer lost, and how long the thread stays in native code
#: (signals, ``on_wait``). Chunks start at 2 s and double: each end of a chunk costs
#: the waiter a look at the store (its request stands, see :mod:`inprocess.quiet_wait`,
#: so a chunk's end prints nothing), and a rank early at the initial barrier,
#: waiting for slow starters, looks a few times, not once every 2 s.
#: A store's ``wait_chunk_max`` caps the doubling: the Wrapper sets it to a
#: quarter of its ``hard_timeout``, because a main thread blocked in the store's
#: wait runs no bytecode, and its hard clock runs on meanwhile (see
#: :mod:`inprocess.progress_watchdog`): one chunk must never come near it.
WAIT_CHUNK = 2.0
WAIT_CHUNK_MAX = 30.0


class WakeWait:
    """One rank's wait at a barrier of ``store``: blocks until the call's next wake-up.

    Created *before* the first look at what the rank waits for (it reads the
    wake-up sequence then, see :meth:`~inprocess.store.StoreMixin.wake_waiters`). Each
    :meth:`wait` blocks at most a chunk (2 s, doubling to 30 s); after a
    wake-up that changed nothing for this rank (``idle``, until the caller
    says otherwise) the next wait pauses ``pause`` seconds first, so forged
    wake-up keys cannot make it spin.
    """

    def __init__(self, store: WakeSource, timeout: datetime.timedelta, pause: float) -> None:
        self.store, self.pause = store, pause
        self.deadline = time.monotonic() + timeout.total_seconds()
        #: the wake-ups and deaths of the call as last read
        self.seq, self.deaths = store.wake_state()
        #: whether :attr:`deaths` was read since the last wake-up (a wait that ran
        #: out its chunk reads both): :meth:`read_deaths` then needs no read
        self._deaths_fresh = False
        self.chunk_max = getattr(store, "wait_chunk_max", WAIT_CHUNK_MAX)
        self.chunk = min(WAIT_CHUNK, self.chunk_max)
        self.idle = False

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def wait(self) -> None:
        if self.idle:
            time.sleep(self.pause)
        seconds = min(self.chunk, max(self.remaining(), 0.0))
        self.chunk = min(self.chunk * 2, self.chunk_max)
        if self.store.wait_for(P.wake_key(self.seq + 1), seconds):
            self.seq += 1
            self.idle = True  # until the caller's next look finds something new
            self._deaths_fresh = False
        else:
            # a forged or lost wake-up: go on from the newest
            (self.seq, self.deaths), self.idle = self.store.wake_state(), False
            self._deaths_fresh = True

    def read_deaths(self) -> int:
        """The call's count of deaths, read again after a wake-up (the wake-ups read stay
        as they were: this read may come after the caller's look). After a wait that
        ran out its chunk, the count read then serves: it was read before the look."""
        if not self._deaths_fresh:
            self.deaths = self.store.wake_state()[1]
        self._deaths_fresh = False
        return self.deaths
