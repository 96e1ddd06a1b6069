"""Progress watchdog: proves that the main thread still runs Python bytecode.

Automatic heartbeats use ``Py_AddPendingCall``: a pending call runs only when
the main thread's evaluation loop runs, so it stops running as soon as the main
thread is stuck in C code, whether or not that code holds the GIL. The watchdog
queues one call, checks at its next tick whether it ran, and queues the next:
progress is known to within one ``progress_watchdog_interval``. At most one
call is queued at a time (CPython's queue holds 32).

Manual heartbeats come from :meth:`inprocess.CallWrapper.ping`; their timeout
starts at the first ping of an iteration.

Two clocks are kept:

* the soft clock (:meth:`ProgressWatchdog.stalled_for`, read by the monitor
  thread) restarts with every iteration: a hang is restarted in-process;
* the hard clock (the board, read by the monitor process) counts time in the
  wrapped function without progress, and a restart does not reset it: a hang
  that recurs after every restart still reaches the hard timeout. Only
  progress inside the wrapped function resets it, and progress means more
  than the few bytecodes a recurring hang runs before it hangs again
  (``init_process_group``, building the model): the stall carried out of
  iterations that ended stalled past ``soft_timeout`` is forgiven once an
  iteration has run for ``soft_timeout`` and still shows progress, or ends
  while progressing (a peer's fault). While the rank is in the
  restart procedure (outside the wrapped function: abort, finalize, barriers
  that wait for peers) the clock stands still as long as the main thread keeps
  running bytecode, so waiting for a lost peer never costs a healthy rank its
  life; a main thread stuck in C there lets it run on from where it stood.

This is what makes a stopped (SIGSTOP) or hung rank cost only itself: its own
hard clock runs (it runs no bytecode, in or out of the function) and its own
monitor process ends it, while the survivors, interrupted by their soft
timeout, wait in the termination barrier with their clocks standing still.
Declaring a stopped peer dead early instead would guess at intent (a debugger
or job control stops processes too) and would not help a rank hung in C; the
wait it would save is bounded anyway by the peer's ``hard_timeout`` plus the
grace time. Known limit: a rank that runs bytecode without progress (a busy
loop seen only by the manual ``ping()`` timeout) is restarted by the soft
timeout every time; its next iteration's bytecode counts as progress.

Both are published in a small shared-memory board that the monitor process
reads to enforce the hard timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import logging
import mmap
import os
import select
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

# The pending call is libc's sem_post on a semaphore that lives as long as the
# interpreter: it runs no Python code, so it can neither be interrupted by the
# asynchronous restart exception nor swallow it (a Python callback would: the
# exception would land inside it and be lost), and it may safely run after the
# watchdog that queued it has stopped.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_libc.sem_trywait.argtypes = [ctypes.c_void_p]
_SEMAPHORE = ctypes.create_string_buffer(64)  # sizeof(sem_t) is 32 on 64-bit glibc
if _libc.sem_init(_SEMAPHORE, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "sem_init failed")
_SEM_POST = ctypes.cast(_libc.sem_post, ctypes.c_void_p)
_add_pending_call = ctypes.pythonapi.Py_AddPendingCall
_add_pending_call.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_add_pending_call.restype = ctypes.c_int


def _pending_call_ran() -> bool:
    """Consumes one run of the queued pending call, if it ran."""
    return _libc.sem_trywait(_SEMAPHORE) == 0


# Semaphores of the connection watchdogs (one each, so that watchdogs never
# consume each other's runs). A semaphore goes back to the free list only when
# no call on it can still run; one whose call is still queued is kept forever.
_free_semaphores: list[Any] = []
_kept_semaphores: list[Any] = []
_semaphores_lock = threading.Lock()


def _take_semaphore() -> Any:
    with _semaphores_lock:
        if _free_semaphores:
            return _free_semaphores.pop()
    semaphore = ctypes.create_string_buffer(64)
    if _libc.sem_init(semaphore, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "sem_init failed")
    return semaphore


def _release_semaphore(semaphore: Any, queued: bool) -> None:
    with _semaphores_lock:
        (_kept_semaphores if queued else _free_semaphores).append(semaphore)


#: where a rank's Wrapper can be, as its board tells the monitor process
PHASES = (
    "starting",
    "rank_assignment",
    "function",
    "completion_barrier",
    "abort",
    "finalize",
    "health_check",
    "termination_barrier",
    "release",
    "finished",
    "reclaim",
)


class ProgressBoard:
    """Shared memory between a rank and its monitor process (``CLOCK_MONOTONIC`` times).

    Aligned 8-byte words: auto timestamp (the hard clock's reference: the
    rank has made no progress for ``now - auto``), manual timestamp (doubles),
    manual active, iteration, finished flag (int64), the bounded-unwind clock
    (double), where the Wrapper is (:data:`PHASES`, int64: what a monitor
    process that ends the rank says it was doing) and the call's fault count
    as the monitor process's fault watch last read it (int64, plus one: 0
    while no watch runs); then a small text area
    (:meth:`write_text`: the peers the monitor process watches, handed over
    here rather than through the store). Each is written with one
    8-byte store through a typed memoryview, so a reader in the other process
    never sees a torn or half-written value. (``struct.pack_into`` is not safe
    here: it clears its target before writing it, and a reader can see the
    zeros; they once read as "no progress since boot" and killed a healthy rank.)
    """

    _WORDS = 10
    (
        _AUTO,
        _MANUAL,
        _ACTIVE,
        _ITERATION,
        _FINISHED,
        _UNWIND,
        _PHASE,
        _TEXT_SEQ,
        _TEXT_LEN,
        _FAULTS_SEEN,
    ) = range(_WORDS)
    #: bytes of the text area (the peers the monitor process watches: two identities)
    TEXT_BYTES = 1024
    _TEXT_AT = _WORDS * 8
    SIZE = _TEXT_AT + TEXT_BYTES

    def __init__(self, fd: int | None = None) -> None:
        created = fd is None
        if fd is None:
            fd = os.memfd_create("inprocess-progress", 0)
            os.ftruncate(fd, self.SIZE)
        self.fd = fd
        self._map = mmap.mmap(fd, self.SIZE)
        self._doubles = memoryview(self._map).cast("d")
        self._ints = memoryview(self._map).cast("q")
        if created:
            now = time.monotonic()
            self._doubles[self._AUTO] = now
            self._doubles[self._MANUAL] = now

    def write_auto(self, ts: float) -> None:
        self._doubles[self._AUTO] = ts

    def write_manual(self, ts: float, active: bool) -> None:
        self._doubles[self._MANUAL] = ts
        self._ints[self._ACTIVE] = int(active)

    def write_iteration(self, iteration: int) -> None:
        self._ints[self._ITERATION] = iteration

    def write_unwind(self, ts: float) -> None:
        """When the restart exception was sent to the main thread (0.0: it came back):
        the monitor process's bounded-unwind clock (see :mod:`inprocess.monitor_process`)."""
        self._doubles[self._UNWIND] = ts

    def unwind_started(self) -> float:
        return self._doubles[self._UNWIND]

    def write_finished(self) -> None:
        self._ints[self._FINISHED] = 1

    def write_text(self, text: str) -> None:
        """Publishes ``text`` to the monitor process (one writer: the rank's main thread).

        A sequence lock: the sequence word is odd while the text changes, so a
        reader that sees it odd, or changed across its read, reads again.
        """
        data = text.encode()
        if len(data) > self.TEXT_BYTES:
            raise ValueError(f"board text of {len(data)} bytes, at most {self.TEXT_BYTES}")
        seq = self._ints[self._TEXT_SEQ]
        self._ints[self._TEXT_SEQ] = seq + 1
        self._map[self._TEXT_AT : self._TEXT_AT + len(data)] = data
        self._ints[self._TEXT_LEN] = len(data)
        self._ints[self._TEXT_SEQ] = seq + 2

    def read_text(self) -> str | None:
        """The text last published (``None``: none yet, or a writer kept changing it)."""
        for _ in range(1000):
            seq = self._ints[self._TEXT_SEQ]
            if seq % 2 == 0:
                length = self._ints[self._TEXT_LEN]
                data = bytes(self._map[self._TEXT_AT : self._TEXT_AT + length])
                if self._ints[self._TEXT_SEQ] == seq:
                    return data.decode(errors="replace") if seq else None
            time.sleep(0)
        return None

    def write_faults_seen(self, count: int | None) -> None:
        """The call's fault count as the fault watch read it (``None``: no watch runs:
        the rank reads the store itself)."""
        self._ints[self._FAULTS_SEEN] = 0 if count is None else count + 1

    def faults_seen(self) -> int | None:
        value = self._ints[self._FAULTS_SEEN]
        return value - 1 if value > 0 else None

    def write_phase(self, phase: str) -> None:
        """Where the Wrapper is now, one of :data:`PHASES`."""
        self._ints[self._PHASE] = PHASES.index(phase)

    def phase(self) -> str:
        index = self._ints[self._PHASE]
        return PHASES[index] if 0 <= index < len(PHASES) else "unknown"

    def read(self) -> tuple[float, float, bool, int, bool]:
        d, i = self._doubles, self._ints
        return (
            d[self._AUTO],
            d[self._MANUAL],
            bool(i[self._ACTIVE]),
            i[self._ITERATION],
            bool(i[self._FINISHED]),
        )

    def last_progress(self) -> float:
        """The older of the relevant timestamps: progress is only as fresh as both."""
        auto, manual, active, _, _ = self.read()
        return min(auto, manual) if active else auto

    def close(self) -> None:
        self._doubles.release()
        self._ints.release()
        self._map.close()
        os.close(self.fd)


class Doorbell:
    """A wake-up that another process can ring: a non-blocking pipe, what
    ``threading.Event`` is within one process.

    The rank's monitor thread waits on it; its monitor process (which inherits
    :attr:`write_fd`) rings it when it has written news on the board, so the
    thread reads the board at once rather than at its next interval.
    """

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self.read_fd, select.POLLIN)

    def ring(self) -> None:
        ring(self.write_fd)

    def wait(self, timeout: float) -> bool:
        """Blocks until rung or ``timeout`` seconds passed; whether it was rung. Rings
        before the call count (the pipe keeps them); all are consumed."""
        rung = bool(self._poll.poll(max(timeout, 0.0) * 1000))
        if rung:
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self.read_fd, 4096):
                    pass
        return rung

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def ring(fd: int) -> None:
    """Rings the :class:`Doorbell` whose write end is ``fd``; never blocks (a full
    pipe is rung already) and never raises (a closed one has nobody to wake)."""
    with contextlib.suppress(OSError):
        os.write(fd, b"\0")


class ProgressWatchdog(threading.Thread):
    """Issues automatic heartbeats and collects manual ones for one Wrapper call.

    The main thread brackets each stay in the wrapped function with
    :meth:`resume` and :meth:`pause`; the monitor thread calls :meth:`freeze`
    when it interrupts the function. Invariants, enforced under ``_lock``:

    * a heartbeat counts as progress in the function only if its pending call
      was queued after the function was entered (:meth:`resume`) and seen
      before the interrupt (:meth:`freeze`) or the exit (:meth:`pause`): the
      restart procedure's own bytecode, and the signal handler that wakes an
      interrupted main thread, never reset the hard clock;
    * the board's stall is ``_carry`` (carried from earlier iterations) plus the
      time since the last heartbeat that counts (in the function: since the
      later of entry and last progress; outside it: since the main thread last
      ran bytecode), i.e. ``board auto == _progress``.

    ``soft_timeout`` (None: forgive at once, as if every iteration were new)
    decides what an iteration must show before the carried stall is forgiven.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # The newest generation's form, ProgressWatchdog(rank, connection, interval):
        # a watchdog that sends Timestamps to the connection.
        connection = args[1] if len(args) > 1 else kwargs.get("connection")
        if cls is ProgressWatchdog and hasattr(connection, "send_timestamp"):
            return ConnectionProgressWatchdog(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        interval: float,
        board: ProgressBoard,
        automatic: bool = True,
        soft_timeout: float | None = None,
    ) -> None:
        super().__init__(name="inprocess-progress-watchdog", daemon=True)
        self.interval = interval
        self.board = board
        self.automatic = automatic
        self.soft_timeout = soft_timeout
        now = time.monotonic()
        self._lock = threading.Lock()
        self._auto = now  # soft clock: last heartbeat or start of the iteration
        self._progress = now  # hard clock reference, published as the board's auto
        self._carry = 0.0  # seconds without progress carried out of the function
        self._in_function = False
        self._frozen = False
        self._resumed_at = now
        self._queued_at = now
        self._manual = now
        self._manual_active = False
        self._call_pending = False
        self._protected = True  # False: hang protection off (see set_hang_protection)
        self._stop_event = threading.Event()
        # The semaphore is shared by every watchdog of the process (one at a
        # time runs automatic heartbeats: the main thread's). A post left by an
        # earlier watchdog would make each later "did my call run?" answer one
        # call late, for good (it once reset the hard clock at the start of a
        # hang): start from zero, and shutdown() leaves zero behind.
        while _pending_call_ran():
            pass
        if not automatic:
            log.warning(
                "the wrapped function does not run on the main thread: automatic "
                "progress heartbeats are off, only CallWrapper.ping() reports progress"
            )

    def ping(self) -> None:
        """Manual heartbeat; the first one of an iteration starts the manual timeout."""
        now = time.monotonic()
        self._manual = now
        self._manual_active = True
        self.board.write_manual(now, True)

    def set_hang_protection(self, enabled: bool) -> None:
        """Turns the soft and hard timeouts off (``False``) or on again.

        While off, both clocks read "progress now" (the soft clock reads no
        stall, the board's timestamps are kept fresh by every tick), so an
        operation that legitimately runs longer than the timeouts (a checkpoint,
        a compilation) is neither restarted nor terminated; faults are still
        detected and still restart. Turned on again, progress counts from that
        moment: the operation's duration is never held against the rank. A new
        iteration (:meth:`resume`) turns it on.
        """
        with self._lock:
            now = time.monotonic()
            self._protected = enabled
            self._auto = self._manual = now
            self._progress = now
            self._carry = 0.0
            self.board.write_auto(now)
            self.board.write_manual(now, self._manual_active)

    def resume(self, iteration: int) -> None:
        """Enters the wrapped function for ``iteration``.

        The soft clock starts afresh and the manual timeout is off; the hard
        clock goes on from where the restart procedure left it.
        """
        with self._lock:
            now = time.monotonic()
            self._carry = max(0.0, now - self._progress)
            self._in_function = True
            self._frozen = False
            self._protected = True
            self._resumed_at = now
            self._auto = now
            self._manual = now
            self._manual_active = False
            self.board.write_iteration(iteration)
            self.board.write_manual(now, False)

    #: the name of :meth:`resume` before the hard clock outlived restarts
    reset = resume

    def freeze(self) -> None:
        """The function is being interrupted: nothing seen from now on is its progress."""
        with self._lock:
            self._frozen = True

    def pause(self) -> None:
        """Leaves the wrapped function (to restart or finish): the hard clock stands still."""
        with self._lock:
            now = time.monotonic()
            self._in_function = False
            stalled = max(0.0, now - self._progress)
            if self.soft_timeout is not None and stalled - self._carry < self.soft_timeout:
                # It was progressing when the iteration ended: nothing to carry.
                self._carry = 0.0
                self._progress = now
            else:
                self._carry = stalled
            self._manual_active = False
            self.board.write_manual(now, False)

    def pause_manual(self) -> None:
        """Leaves the wrapped function: only automatic heartbeats count."""
        self._manual_active = False
        self.board.write_manual(time.monotonic(), False)

    def stalled_for(self) -> float:
        """Seconds since the least recent relevant heartbeat of this iteration (soft clock)."""
        if not self._protected:
            return 0.0
        now = time.monotonic()
        stalled = now - self._auto if self.automatic else 0.0
        if self._manual_active:
            stalled = max(stalled, now - self._manual)
        return stalled

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            if not self.automatic:
                self.board.write_auto(time.monotonic())
                if not self._protected:
                    self.board.write_manual(time.monotonic(), self._manual_active)
                continue
            with self._lock:
                self._tick(time.monotonic())

    def _tick(self, now: float) -> None:
        if not self._protected:
            # Invariant: while off, the board always reads progress within one tick.
            self._auto = self._manual = self._progress = now
            self.board.write_auto(now)
            self.board.write_manual(now, self._manual_active)
            return
        if self._call_pending and _pending_call_ran():
            # The main thread ran bytecode between the queueing and now.
            self._call_pending = False
            self._auto = now
            if not self._in_function:
                self._progress = now - self._carry
            elif not self._frozen and self._queued_at >= self._resumed_at:
                if self.soft_timeout is None or now - self._resumed_at > self.soft_timeout:
                    self._carry = 0.0  # this iteration outlived a soft timeout
                self._progress = now - self._carry
        if not self._call_pending:
            self._call_pending = _add_pending_call(_SEM_POST, _SEMAPHORE) == 0
            self._queued_at = now
        self.board.write_auto(self._progress)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)
        if self._call_pending and threading.current_thread() is threading.main_thread():
            # Let the call still queued run now (the main thread runs bytecode
            # here) and consume its post, so that no later watchdog sees it.
            deadline = time.monotonic() + 1.0
            while not _pending_call_ran() and time.monotonic() < deadline:
                time.sleep(0.001)
            self._call_pending = False


# ------------------------------------------------------- the newest generation's interface


@dataclasses.dataclass(frozen=True)
class Timestamp:
    """One heartbeat sent to a connection: ``CLOCK_MONOTONIC`` seconds of the last
    automatic (``auto``) and manual (``manual``, None before the first ping) one."""

    auto: float | None = None
    manual: float | None = None


class ConnectionProgressWatchdog(threading.Thread):
    """A watchdog that sends :class:`Timestamp` heartbeats to ``connection.send_timestamp``.

    The interface of the API's newest generation, for code that drives a
    watchdog itself (``ProgressWatchdog(rank, connection, interval)``); the
    Wrapper uses :class:`ProgressWatchdog` with a board. A heartbeat is sent
    every ``interval``; its ``auto`` is the last time the main thread was seen
    running Python code (a pending call it ran, seen at the watchdog's tick), so
    it stands still while the main thread is stuck. While paused nothing is
    observed: the first heartbeat after :meth:`resume` carries the time last
    seen before the pause, and the next one a fresh time, so the gap between
    them shows the pause. Invariants, under ``_send_lock``:

    * after :meth:`pause_and_synchronize` returns, nothing is sent until
      :meth:`resume` (a send in progress finished before it returned);
    * a pending call counts only if it was queued after the last resume
      (``_queued`` is cleared, and its run discarded, by :meth:`resume`);
    * :meth:`shutdown` sends one last heartbeat, once; later calls do nothing,
      and :meth:`resume` after it raises ``RuntimeError``.
    """

    def __init__(self, rank: int, connection: Any, interval: datetime.timedelta) -> None:
        super().__init__(name="inprocess-progress-watchdog", daemon=True)
        if not callable(getattr(connection, "send_timestamp", None)):
            raise TypeError(
                "ProgressWatchdog(connection=...) needs a send_timestamp method, "
                f"got {connection!r}"
            )
        seconds = interval.total_seconds() if hasattr(interval, "total_seconds") else interval
        if not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ValueError(f"ProgressWatchdog(interval=...) must be > 0, got {interval!r}")
        self.rank = rank
        self.connection = connection
        self.interval = float(seconds)
        self._manual: float | None = None
        self._auto = time.monotonic()  # the main thread was last seen running code
        self._paused = False
        self._stopped = False
        self._wake = threading.Event()
        self._send_lock = threading.Lock()
        self._semaphore = _take_semaphore()
        self._queued = False  # a pending call on our semaphore is queued and not yet seen

    def _send(self) -> None:
        self.connection.send_timestamp(Timestamp(auto=self._auto, manual=self._manual))

    def _observe(self) -> None:
        """Sees whether the queued pending call ran (the main thread runs code); queues
        the next one."""
        if self._queued and _libc.sem_trywait(self._semaphore) == 0:
            self._auto = time.monotonic()
            self._queued = False
        if not self._queued:
            self._queued = _add_pending_call(_SEM_POST, ctypes.addressof(self._semaphore)) == 0

    def run(self) -> None:
        while not self._wake.wait(self.interval):
            with self._send_lock:
                if self._paused or self._stopped:
                    continue
                try:
                    self._send()
                except Exception as ex:  # a broken connection must not kill the thread silently
                    log.warning("progress watchdog of rank %s: send failed: %r", self.rank, ex)
                self._observe()

    def ping(self) -> None:
        """Manual heartbeat, sent with the next automatic one."""
        self._manual = time.monotonic()

    def pause_and_synchronize(self) -> None:
        """Stops the heartbeats; returns once none is being sent."""
        with self._send_lock:
            self._paused = True

    def resume(self) -> None:
        """Sends heartbeats again (a no-op when not paused)."""
        with self._send_lock:
            if self._stopped:
                raise RuntimeError("ProgressWatchdog.resume() after shutdown()")
            if self._paused and self._queued and _libc.sem_trywait(self._semaphore) == 0:
                self._queued = False  # it ran during the pause: no progress seen since
            self._paused = False

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the thread and sends a last heartbeat; idempotent."""
        with self._send_lock:
            if self._stopped:
                return
            self._stopped = True
        self._wake.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        self._send()
        with self._send_lock:
            if self._queued and _libc.sem_trywait(self._semaphore) == 0:
                self._queued = False
            _release_semaphore(self._semaphore, self._queued)
