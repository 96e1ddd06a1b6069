"""The in-process watcher: notices faults and interrupts the wrapped function.

The monitor thread polls the store's fault counter and the progress watchdog.
When the current iteration is faulted it waits ``last_call_wait`` (so that
concurrent faults of other ranks are recorded; a join request ends the wait at
once), then, holding the lock that
:meth:`inprocess.CallWrapper.atomic` shares, raises :class:`RankShouldRestart`
in the main thread asynchronously and runs the ``Abort`` callback, which
releases a main thread blocked in a collective. It keeps raising until the main
thread acknowledges (``disarm``), because user code may swallow the exception
once, or it may be lost in a ``__del__`` or a callback.

A main thread blocked in a system call with the GIL released (``time.sleep``, a
socket read, a lock) does not run bytecode and would never see an asynchronous
exception. The monitor thread therefore also sends it a signal: the system call
returns ``EINTR``, the interpreter runs the (empty) Python signal handler, and
the pending asynchronous exception is raised there.

The exception is never sent while the main thread is importing a module. One
landing inside an import leaves the interpreter's module table damaged for the
rest of the process: the interrupted module is dropped, but its submodules stay
in ``sys.modules`` and are never bound to the package imported again, so every
later attempt fails ("partially initialized module ... has no attribute ...")
and the rank can never run the function again. Imports that user code runs
lazily are common and slow (the first ``optimizer.step()`` imports
``torch._dynamo`` and ``torch._inductor``: seconds on a loaded machine), so the
monitor thread waits for the import to end and sends the exception then.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib._bootstrap
import logging
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from .progress_watchdog import Doorbell

log = logging.getLogger(__name__)

#: signal used to interrupt a system call of the main thread; real-time signals
#: are queued and unused by Python and torch
INTERRUPT_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None
#: seconds between re-sends of an unacknowledged restart exception once they
#: have backed off (they start at the monitor thread's interval and double)
RESEND_MAX = 1.0


class RankShouldRestart(BaseException):
    """Raised asynchronously in the wrapped function to start a restart.

    A ``BaseException`` so that ``except Exception`` in user code does not stop
    it. The wrapped function must let it propagate.
    """


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = [ctypes.c_ulong, ctypes.py_object]
_set_async_exc.restype = ctypes.c_int


def async_raise(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raises ``exc_type`` in thread ``thread_id`` when it next runs bytecode.

    ``exc_type`` must be an exception class (CPython takes a type, not an
    instance); pass ``None`` to cancel a pending asynchronous exception.
    """
    if exc_type is not None and not (
        isinstance(exc_type, type) and issubclass(exc_type, BaseException)
    ):
        raise TypeError(f"exc_type must be an exception class or None, got {exc_type!r}")
    obj = ctypes.py_object(exc_type) if exc_type is not None else ctypes.py_object()
    count = _set_async_exc(ctypes.c_ulong(thread_id), obj)
    if count == 0 and exc_type is not None:
        raise ValueError(f"no thread with id {thread_id}")
    if count > 1:
        _set_async_exc(ctypes.c_ulong(thread_id), ctypes.py_object())
        raise SystemError(f"PyThreadState_SetAsyncExc affected {count} threads")


def exception_with_message(base: type[BaseException], message: str) -> type[BaseException]:
    """A subclass of ``base`` whose instances print ``message``.

    Asynchronous exceptions are raised from a type, so a message must live in
    the class.
    """
    text = str(message)

    def __init__(self: BaseException, *args: Any) -> None:
        base.__init__(self, *(args or (text,)))

    return types.new_class(base.__name__, (base,), {}, lambda ns: ns.update(__init__=__init__))


class reraise_if_unraisable(contextlib.ContextDecorator):
    """Re-raises exceptions of ``exc_type`` that the interpreter could not raise.

    An asynchronous exception that lands in a ``__del__`` method, a weakref
    callback or a ctypes callback is not propagated; the interpreter reports it
    to ``sys.unraisablehook`` and carries on. Inside this context (or decorated
    function) such an exception is raised again in the thread that lost it.
    Other unraisable exceptions go to the previous hook.

    ``lock`` and ``wanted`` (optional) gate the re-raise: it is sent holding
    ``lock``, and only if ``wanted()`` then says that the thread still expects
    the exception (the Wrapper passes the lock under which its monitor thread
    sends and cancels the restart exception, so a re-raise never lands after the
    main thread has acknowledged the restart).

    Invariant: every ``exc_type`` exception lost in the watched thread, one
    that lands in the hook itself while it runs included, is followed by an
    ``exc_type`` exception raised in that thread, and that raise happens only
    once no frame of the hook is on the thread's stack. The hook runs bytecode,
    and an exception arriving there is lost for good ("Exception ignored in
    sys.unraisablehook"); so the hook counts such an arrival as one more lost
    exception, and its helper thread waits for the hook to have returned,
    never for a fixed delay (under load a delay can run out while the hook still
    waits for the helper thread to start, and the re-raise lands in the hook).
    Losses that wait together are raised once (``_lost``/``_raised``): they are
    one request to stop what the thread runs, and a second raise would land in
    its handler. A third exception landing in the hook's own ``except`` clause
    would still be lost; the monitor thread's re-sending covers that.
    """

    def __init__(
        self,
        exc_type: type[BaseException],
        lock: Any = None,
        wanted: Callable[[], bool] | None = None,
    ) -> None:
        self.exc_type = exc_type
        self.lock = lock
        self.wanted = wanted
        self._stack: list[tuple[int, Callable[..., Any]]] = []
        # Exceptions lost (counted by the hook, in the watched thread) and
        # covered by a re-raise (written by helper threads under _count_lock).
        self._lost = 0
        self._raised = 0
        self._count_lock = threading.Lock()

    def _hook(self, unraisable: Any) -> None:
        thread_id, previous = self._stack[-1] if self._stack else (None, sys.__unraisablehook__)
        try:
            exc = unraisable.exc_value
            if (
                exc is not None
                and isinstance(exc, self.exc_type)
                and threading.get_ident() == thread_id
            ):
                self._lost += 1
                self._reraise_later(thread_id, type(exc))
                log.debug("re-raising %r lost in %r", exc, unraisable.object)
            else:
                previous(unraisable)
        except self.exc_type as arrived:
            if threading.get_ident() != thread_id:
                raise
            self._lost += 1
            self._reraise_later(thread_id, type(arrived))

    def _reraise_later(self, thread_id: int, exc_type: type[BaseException]) -> None:
        helper = threading.Thread(
            target=self._reraise_when_out,
            args=(thread_id, exc_type),
            name="inprocess-reraise",
            daemon=True,
        )
        helper.start()

    def _reraise_when_out(self, thread_id: int, exc_type: type[BaseException]) -> None:
        """Raises ``exc_type`` in the thread once no frame of the hook (nor of an
        import) is on its stack."""
        deadline = time.monotonic() + _RERAISE_WAIT
        while True:
            inside = _runs_code(thread_id, _HOOK_CODE)
            if inside is None:
                return  # the thread is gone
            if not inside and not is_importing(thread_id):
                break
            if time.monotonic() >= deadline:
                log.warning(
                    "a lost %s was not raised again: the thread stayed in the hook or an import",
                    exc_type,
                )
                return
            time.sleep(0.0005)
        # The thread may enter the hook again between the check and the raise:
        # the exception then lands in the hook, which counts it as lost again.
        with self.lock if self.lock is not None else contextlib.nullcontext():
            with self._count_lock:
                lost = self._lost
                if self._raised >= lost:
                    return  # another helper raised for these losses
                self._raised = lost
                if self.wanted is not None and not self.wanted():
                    return
                with contextlib.suppress(ValueError):  # the thread ended meanwhile
                    async_raise(thread_id, exc_type)

    def __enter__(self) -> reraise_if_unraisable:
        self._stack.append((threading.get_ident(), sys.unraisablehook))
        sys.unraisablehook = self._hook
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _, previous = self._stack.pop()
        if sys.unraisablehook == self._hook:
            sys.unraisablehook = previous


_HOOK_CODE = reraise_if_unraisable._hook.__code__
#: how long a re-raise waits for the hook to return (its one blocking step is
#: starting the helper thread) before it gives up
_RERAISE_WAIT = 30.0


def _runs_code(thread_id: int, code: types.CodeType) -> bool | None:
    """Whether a frame of ``code`` is on the thread's stack; ``None``: no such thread."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


#: the frame of every import in progress: ``import``, ``from ... import``,
#: ``importlib.import_module`` and ``__import__`` all load through it, and it
#: stays on the stack until the module (and its parents) are fully executed
_IMPORT_CODE = importlib._bootstrap._find_and_load.__code__
#: how long the restart exception waits for an import to end before it is sent
#: anyway (an import blocked for good; the hard timeout usually ends it first)
IMPORT_WAIT_LIMIT = 120.0


def is_importing(thread_id: int) -> bool:
    """Whether ``thread_id`` is executing an import (an exception there would
    leave modules half-imported for the rest of the process)."""
    return bool(_runs_code(thread_id, _IMPORT_CODE))


def frame_in_import(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` or a frame that called it is executing an import."""
    while frame is not None:
        if frame.f_code is _IMPORT_CODE:
            return True
        frame = frame.f_back
    return False


def _noop_handler(signum: int, frame: Any) -> None:
    """Running this handler is enough: the pending async exception is raised on entry."""


class InterruptSignal:
    """Installs the (empty) handler of :data:`INTERRUPT_SIGNAL` for one call.

    Only possible on the main thread; elsewhere the Wrapper cannot interrupt a
    system call and relies on the hard timeout instead.
    """

    def __init__(self) -> None:
        self.installed = False
        self._previous: Any = None

    def install(self) -> None:
        if INTERRUPT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(INTERRUPT_SIGNAL, _noop_handler)
        self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            signal.signal(INTERRUPT_SIGNAL, self._previous)
            self.installed = False

    def send(self, thread_id: int) -> None:
        if self.installed:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pthread_kill(thread_id, INTERRUPT_SIGNAL)


class Armed:
    """One iteration as seen by the monitor thread.

    ``baseline`` is the store's fault count when the iteration was decided; the
    iteration is faulted once the count exceeds it.
    """

    def __init__(self, iteration: int, baseline: int, state: Any) -> None:
        self.iteration = iteration
        self.baseline = baseline
        self.state = state
        #: set by the monitor thread (under the lock) when it starts the restart
        self.interrupted = False
        #: set by the main thread, without any eval-breaker checkpoint before it,
        #: as soon as it has caught the exception that ends the iteration
        self.acked = False
        #: whether the rank has not yet begun its arrival at the completion
        #: barrier (cleared under the lock, :meth:`MonitorThread.leave_function`):
        #: until then the iteration cannot complete (completion needs every
        #: member's arrival), so a fault needs no proposal of the outcome
        self.in_function = True
        self.cause: str | None = None


class MonitorThread(threading.Thread):
    """Watches for faults and the progress watchdog for one Wrapper call.

    Faults are learned from the board, where the monitor process's fault watch
    writes the call's fault count (it blocks in the store); only while no watch
    runs does this thread read the store's fault counter itself, each interval.

    Invariants (enforced with ``lock``, the lock :meth:`CallWrapper.atomic` uses):

    * The asynchronous exception is only ever sent while an iteration is armed,
      i.e. while the main thread is inside the interruptible region.
    * ``disarm`` (main thread) and the sending of exceptions are mutually
      exclusive, and ``disarm`` cancels any exception still pending, so nothing
      is raised into the main thread once it has left the region.
    * Abort runs at most once per iteration from this thread, under the lock.
    """

    def __init__(
        self,
        *,
        store: Any,
        identity: str,
        target_thread_id: int,
        lock: threading.RLock,
        interval: float,
        last_call_wait: float,
        soft_timeout: float,
        stalled_for: Callable[[], float],
        abort: Callable[[Any], Any] | None,
        faults_seen: Callable[[], int | None] = lambda: None,
        doorbell: Doorbell | None = None,
        interrupt: InterruptSignal,
        on_interrupt: Callable[[], None] | None = None,
        on_resend: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(name="inprocess-monitor-thread", daemon=True)
        self.store = store
        self.identity = identity
        self.target_thread_id = target_thread_id
        self.lock = lock
        self.interval = interval
        self.last_call_wait = last_call_wait
        self.soft_timeout = soft_timeout
        self.stalled_for = stalled_for
        #: the call's fault count as the monitor process's fault watch last read it
        #: (``None``: no watch runs, and this thread reads the store itself)
        self.faults_seen = faults_seen
        self.abort = abort
        self.interrupt = interrupt
        #: called under ``lock`` just before the restart exception is sent
        self.on_interrupt = on_interrupt
        #: called (without the lock) after each re-send, while unacknowledged:
        #: releases what the abort could not reach when it ran
        self.on_resend = on_resend
        self._armed: Armed | None = None
        #: the armed iteration and fault counter value last confirmed against the fault log
        self._confirmed_for: Armed | None = None
        self._signal = -1
        self._stop_event = threading.Event()
        #: wakes this thread before its interval ends: rung by arm and shutdown,
        #: and by the monitor process when it wrote a new fault count
        self._wake = doorbell if doorbell is not None else Doorbell()
        self._own_doorbell = doorbell is None

    # ---------------------------------------------------------------- main thread side

    def arm(self, iteration: int, baseline: int, state: Any) -> Armed:
        """Enters the interruptible region (see :meth:`enter`); returns the armed iteration."""
        armed = Armed(iteration, baseline, state)
        self.enter(armed)
        return armed

    def enter(self, armed: Armed) -> None:
        """Enters the interruptible region for ``armed``.

        The restart exception may land anywhere from the moment the lock is
        released, this method's own last bytecodes included: call it inside the
        ``try`` that catches the exception.
        """
        with self.lock:
            self._armed = armed
        self._wake.ring()

    def leave_function(self, armed: Armed) -> None:
        """The rank is about to arrive at the completion barrier: from now on a fault
        interrupts it only once the outcome "fault" stands (the iteration may
        complete first). Call it inside the ``try`` that catches the exception."""
        with self.lock:
            armed.in_function = False

    def disarm(self) -> Armed | None:
        """Leaves the interruptible region; returns the iteration that was armed.

        Safe against the restart exception landing while it runs: it retries
        until it has both cleared the armed iteration and cancelled any pending
        asynchronous exception under the lock.
        """
        while True:
            try:
                with self.lock:
                    armed, self._armed = self._armed, None
                    async_raise(self.target_thread_id, None)
                return armed
            except RankShouldRestart:
                continue

    @property
    def restart_in_progress(self) -> bool:
        armed = self._armed
        return armed is not None and armed.interrupted

    def expects_restart(self) -> bool:
        """Whether the restart exception was sent and not yet caught (read under ``lock``):
        the one moment when raising it again (a lost one) is right."""
        armed = self._armed
        return armed is not None and armed.interrupted and not armed.acked

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop_event.set()
        self._wake.ring()
        if self.is_alive():
            self.join(timeout)
        if self._own_doorbell and not self.is_alive():
            self._wake.close()

    # ---------------------------------------------------------------- monitor thread side

    def run(self) -> None:
        look_now = False
        while not self._stop_event.is_set():
            if not look_now:
                self._wake.wait(self.interval)
            look_now = False
            armed = self._armed
            if armed is None or armed.interrupted or armed.acked or self._stop_event.is_set():
                continue
            try:
                cause = self._check(armed)
            except Exception as ex:  # the store is unreachable: restarting will tell
                log.error("monitor thread cannot read the store: %s", ex)
                cause = f"store error: {ex}"
            if cause is None:
                if armed.in_function:
                    prefetch_gloo_addresses()
                continue
            # While the rank is in its function the iteration cannot complete,
            # so no proposal of the outcome is needed (one store operation per
            # rank and fault fewer): the faulting rank proposes its own, and
            # ranks already at the completion barrier propose theirs.
            proposed = not armed.in_function
            if proposed and not self._fault_stands(armed):
                continue  # the iteration completed first; nothing to interrupt
            if self._last_call(armed):
                return
            if not self._interrupt(armed, cause, proposed):
                # it reached the completion barrier meanwhile: the outcome first
                if not self._fault_stands(armed):
                    continue
                self._interrupt(armed, cause, True)
            # Its re-send loop took the rings meant for this loop (the next
            # iteration armed, a fault after it): look again at once.
            look_now = True

    def _last_call(self, armed: Armed) -> bool:
        """Waits ``last_call_wait`` so that concurrent faults are recorded before the
        restart; returns whether this thread is stopping.

        A join request among the faults since ``armed`` began ends the wait at
        once: a joiner is not a fault to collect with others but a rank waiting
        to train, most often the replacement of a rank that died a moment ago,
        whose restart it then joins (one restart at full size, rather than one
        without it and one more to admit it). The fault log is read once per
        fault count the fault watch writes on the board (each rings the
        doorbell); with no watch, once.
        """
        deadline = time.monotonic() + self.last_call_wait
        looked: int | None = -1
        while True:
            seen = self.faults_seen()
            if seen != looked and (seen is not None or looked == -1):
                looked = seen
                if self._join_requested(armed):
                    return self._stop_event.is_set()
            left = deadline - time.monotonic()
            if left <= 0 or self._stop_event.is_set():
                return self._stop_event.is_set()
            if seen is None:
                return self._stop_event.wait(left)
            self._wake.wait(left)

    def _join_requested(self, armed: Armed) -> bool:
        """Whether a fault recorded since ``armed`` began is a join request."""
        try:
            return bool(self.store.join_requested_since(armed.baseline))
        except Exception as ex:  # the store is unreachable: the restart will tell
            log.debug("%s: cannot read the fault log: %s", self.identity, ex)
            return False

    def _fault_stands(self, armed: Armed) -> bool:
        """Proposes "fault" for the armed iteration; whether it stands (``False``: the
        iteration completed first)."""
        try:
            outcome = self.store.decide_outcome(armed.iteration, "fault")
        except Exception as ex:
            log.error("monitor thread cannot write the store: %s", ex)
            outcome = "fault"
        return outcome == "fault"

    def _check(self, armed: Armed) -> str | None:
        stalled = self.stalled_for()
        if stalled > self.soft_timeout:
            reason = f"soft timeout: no progress for {stalled:.2f}s"
            log.warning("%s: %s", self.identity, reason)
            self.store.record_fault(self.identity, reason)
            return reason
        seen = self.faults_seen()
        if seen is not None:
            return "fault reported" if seen > armed.baseline else None
        # The counter only wakes: anyone can add to it. The authentic fault
        # log confirms (read once per change of the counter, and once per
        # armed iteration: its baseline may be behind already).
        signal = self.store.fault_signal()
        if armed is self._confirmed_for and signal == self._signal:
            return None
        self._confirmed_for, self._signal = armed, signal
        if self.store.fault_count() > armed.baseline:
            return "fault reported"
        return None

    def _interrupt(self, armed: Armed, cause: str, proposed: bool) -> bool:
        """Starts the restart; ``False`` (nothing sent) when the outcome was not
        proposed and the rank has reached the completion barrier since.

        Invariant: the check of ``in_function`` and the exception are one step
        under the lock, which :meth:`leave_function` takes to clear it; an
        exception sent while it holds lands before the completion arrival (at
        the entry of the next Python function the main thread calls).
        """
        with self.lock:
            if self._armed is not armed or armed.acked:
                return True  # the main thread got there first
            if not proposed and not armed.in_function:
                return False
            log.debug("%s: interrupting iteration %d (%s)", self.identity, armed.iteration, cause)
            armed.interrupted = True
            armed.cause = cause
            if self.on_interrupt is not None:
                self.on_interrupt()
            import_wait = _ImportWait(self.identity)
            if not import_wait.holds(self.target_thread_id):
                async_raise(self.target_thread_id, RankShouldRestart)
            # An import in progress does not hold the abort back: the import
            # runs no collective, and the exception follows once it is done.
            if self.abort is not None:
                try:
                    self.abort(armed.state)
                except Exception:
                    log.exception("abort failed in the monitor thread")
        # Keep raising until acknowledged: user code may have swallowed it. The
        # signal that breaks a blocking system call is only sent from the
        # first re-send on: a thread blocked in a collective is released by the
        # abort, and a signal arriving inside torch's wait can turn the
        # exception into a SystemError.
        # It waits on the doorbell, so the next iteration's arm ends it at once
        # (a fault right after a restart is not held back by this loop); a ring
        # before the re-send is due sends nothing.
        # The re-sends back off, to one per RESEND_MAX at most: a thread that
        # never takes the exception is one stuck in native code, and each
        # signal wakes it for nothing. Waking it often would also make it look
        # busy to the bounded unwind (a thread it sees run or use CPU is not
        # stuck), which then waits for the hard timeout instead.
        resend = max(self.interval, 0.005)
        longest = max(resend, RESEND_MAX)
        next_send = time.monotonic() + resend
        while True:
            self._wake.wait(next_send - time.monotonic())
            if self._stop_event.is_set():
                return True
            with self.lock:
                if self._armed is not armed or armed.acked:
                    return True
                if time.monotonic() < next_send:
                    continue
                resend = min(resend * 2, longest)
                next_send = time.monotonic() + resend
                if import_wait.holds(self.target_thread_id):
                    continue
                async_raise(self.target_thread_id, RankShouldRestart)
                self.interrupt.send(self.target_thread_id)
            if self.on_resend is not None:
                try:
                    self.on_resend()
                except Exception:
                    log.exception("releasing the main thread again failed")


def prefetch_gloo_addresses() -> None:
    """Reads ahead, in the background, the addresses the abort needs to release a
    collective blocked in a gloo group (:func:`inprocess.abort.gloo.prefetch`),
    so that the restart opens no store connection for them.

    Called each interval while the function runs: cheap once every group is
    read (no store operation, no thread), never raises, and does nothing in a
    process that has not imported ``torch.distributed`` (nor imports it).
    """
    if "torch.distributed" not in sys.modules:
        return
    try:
        from .abort import gloo

        gloo.prefetch()
    except Exception as ex:  # the abort reads them itself
        log.debug("cannot read gloo addresses ahead: %s", str(ex))


class _ImportWait:
    """Holds the restart exception back while the main thread imports a module.

    Checked under the monitor thread's lock right before each send; the import
    is seen from its frame on the thread's stack. A thread that is about to
    start an import when the check runs can still take the exception inside
    the importer's first bytecodes: the window is those few bytecodes, not the
    whole import. After ``IMPORT_WAIT_LIMIT`` the exception is sent anyway.
    """

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self._since: float | None = None
        self._gave_up = False

    def holds(self, thread_id: int) -> bool:
        if self._gave_up or not is_importing(thread_id):
            return False
        now = time.monotonic()
        if self._since is None:
            self._since = now
            log.info("%s: the restart waits for an import to finish", self.identity)
            return True
        if now - self._since < IMPORT_WAIT_LIMIT:
            return True
        self._gave_up = True
        log.warning(
            "%s: an import has run for %.0fs; interrupting it (modules it was loading "
            "may stay half-imported in this process)",
            self.identity,
            now - self._since,
        )
        return False
