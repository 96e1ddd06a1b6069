"""The in-process machinery: asynchronous exceptions, the monitor thread, the watchdog."""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest
import torch.distributed as dist

from inprocess.monitor_thread import (
    InterruptSignal,
    MonitorThread,
    RankShouldRestart,
    async_raise,
    exception_with_message,
    reraise_if_unraisable,
)
from inprocess.progress_watchdog import ProgressBoard, ProgressWatchdog
from inprocess.store import StoreMixin


class HashStore(dist.HashStore, StoreMixin):
    """A real in-memory torch store with the Wrapper protocol."""


class Boom(BaseException):
    pass


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def settle_within(condition, timeout: float = 30.0) -> None:
    """Runs bytecode until ``condition()`` holds: a thread the test waits on
    may be starved for seconds on a loaded machine, never for good."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "never settled"
        spin(0.02)


def test_async_raise_interrupts_running_bytecode():
    main = threading.get_ident()
    timer = threading.Timer(0.05, async_raise, args=(main, Boom))
    timer.start()
    with pytest.raises(Boom):
        spin(5)
    timer.join()


def test_async_raise_validates_arguments():
    with pytest.raises(TypeError):
        async_raise(threading.get_ident(), Boom())  # an instance, not a type
    with pytest.raises(ValueError, match="no thread"):
        async_raise(123456789, Boom)
    async_raise(threading.get_ident(), None)  # cancelling nothing is fine


def test_exception_with_message():
    exc = exception_with_message(RankShouldRestart, "soft timeout")
    assert issubclass(exc, RankShouldRestart)
    assert str(exc()) == "soft timeout"


class RaisesInDel:
    def __del__(self):
        raise Boom("lost in __del__")


def test_exception_lost_in_del_is_reraised():
    with pytest.raises(Boom), reraise_if_unraisable(Boom):
        RaisesInDel()  # the exception is "unraisable": printed and dropped by CPython
        gc.collect()
        spin(1)  # ... and raised again here, at the next bytecode
    assert threading.current_thread() is threading.main_thread()


def _hook_held_up(monkeypatch, arriving: bool = False) -> list[int]:
    """Holds the hook up as a loaded machine does: ``Thread.start`` returns late,
    after its helper thread started; ``arriving``: another asynchronous
    exception lands in the hook before the helper starts. Returns the holds."""
    main, original, holds = threading.get_ident(), threading.Thread.start, []

    def start(thread):
        if thread.name != "inprocess-reraise" or holds:
            return original(thread)
        holds.append(1)
        if arriving:
            async_raise(main, Boom)
            spin(0.3)  # raises Boom here, in the hook
        original(thread)
        spin(0.3)

    monkeypatch.setattr(threading.Thread, "start", start)
    return holds


@pytest.mark.parametrize("arriving", [False, True], ids=["late-start", "arriving-in-hook"])
def test_exception_lost_in_del_is_reraised_however_long_the_hook_takes(monkeypatch, arriving):
    # Once the helper's exception (or another one) landed in the hook while it
    # still waited for the helper to start: lost, and the test saw DID NOT RAISE.
    holds = _hook_held_up(monkeypatch, arriving)
    raised = 0
    with reraise_if_unraisable(Boom):
        try:
            RaisesInDel()
            gc.collect()
            spin(2)
        except Boom:
            raised += 1
        spin(0.3)  # ... exactly once: a second one would land here
    assert holds and raised == 1


def test_reraise_if_unraisable_as_decorator_passes_other_exceptions_on():
    seen = []
    previous = __import__("sys").unraisablehook

    class Other(Exception):
        pass

    class RaisesOther:
        def __del__(self):
            raise Other("not ours")

    import sys

    sys.unraisablehook = lambda u: seen.append(type(u.exc_value))
    try:

        @reraise_if_unraisable(Boom)
        def f():
            RaisesOther()
            gc.collect()

        f()
    finally:
        sys.unraisablehook = previous
    assert seen == [Other]
    assert sys.unraisablehook is previous


def test_interrupt_signal_breaks_a_blocking_sleep():
    interrupt = InterruptSignal()
    interrupt.install()
    main = threading.get_ident()

    def fire():
        async_raise(main, Boom)
        interrupt.send(main)

    timer = threading.Timer(0.1, fire)
    try:
        timer.start()
        start = time.monotonic()
        with pytest.raises(Boom):
            time.sleep(30)  # the GIL is released; no bytecode runs until the signal
        assert time.monotonic() - start < 5
    finally:
        timer.join()
        interrupt.uninstall()


def make_monitor(store, **kw):
    lock = threading.RLock()
    aborted = []
    params = dict(
        store=store,
        identity="0/test",
        target_thread_id=threading.get_ident(),
        lock=lock,
        interval=0.01,
        last_call_wait=0.0,
        soft_timeout=60.0,
        stalled_for=lambda: 0.0,
        abort=lambda state: aborted.append(time.monotonic()),
        interrupt=InterruptSignal(),
    )
    params.update(kw)
    monitor = MonitorThread(**params)
    monitor.start()
    return monitor, lock, aborted


def test_monitor_interrupts_on_a_recorded_fault_and_stops_after_disarm():
    store = HashStore()
    monitor, _lock, aborted = make_monitor(store)
    try:
        armed = monitor.arm(0, store.fault_count(), state=None)
        with pytest.raises(RankShouldRestart):
            store.record_fault("1/x", "boom")
            spin(5)
        armed.acked = True
        monitor.disarm()
        assert aborted, "abort must run"
        # in its function the iteration cannot complete: no proposal (a store
        # operation per rank and fault fewer; the faulting rank proposes its own)
        assert store.outcome(0) == ""
        spin(0.2)  # nothing more may arrive once disarmed
    finally:
        monitor.shutdown()


def test_a_rank_at_the_completion_barrier_is_interrupted_once_the_fault_stands():
    store = HashStore()
    monitor, _lock, aborted = make_monitor(store)
    try:
        armed = monitor.arm(0, store.fault_count(), state=None)
        with pytest.raises(RankShouldRestart):
            monitor.leave_function(armed)
            store.record_fault("1/x", "boom")
            spin(5)
        armed.acked = True
        monitor.disarm()
        assert aborted and store.outcome(0) == "fault"
    finally:
        monitor.shutdown()


@pytest.mark.parametrize("completed", [False, True], ids=["fault-stands", "completed-first"])
def test_a_rank_that_reaches_the_completion_barrier_while_the_monitor_waits(completed):
    """The race the outcome settles: the monitor saw the fault while the rank was in its
    function (no proposal), and the rank reached the completion barrier during the
    monitor's last-call wait. The monitor then proposes before it interrupts, and
    leaves a rank alone whose iteration completed first."""
    store = HashStore()
    monitor, _lock, aborted = make_monitor(store, last_call_wait=0.5)
    try:
        armed = monitor.arm(0, store.fault_count(), state=None)
        raised = False
        try:
            store.record_fault("1/x", "boom")
            time.sleep(0.2)  # the monitor saw it (in the function) and waits
            if completed:  # (decided first: a monitor that saw the fault late sees it too)
                assert store.decide_outcome(0, "completed") == "completed"
            monitor.leave_function(armed)
            spin(1.5)
        except RankShouldRestart:
            raised = True
        armed.acked = True
        assert raised is not completed
        assert store.outcome(0) == ("completed" if completed else "fault")
        assert bool(aborted) is not completed
    finally:
        monitor.disarm()
        monitor.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("watch", [True, False], ids=["fault-watch", "no-watch"])
def test_a_join_request_ends_the_last_call_wait(watch):
    """A fault waits ``last_call_wait`` (here 30 s) for concurrent ones, unless a join
    request is among the faults: the joiner is admitted by this restart, at once.
    With a fault watch the request may come during the wait (the watch's new count
    rings the doorbell); without one, the request is seen when the wait begins."""
    from inprocess.progress_watchdog import Doorbell

    store = HashStore()
    seen: list[int | None] = [store.fault_count() if watch else None]
    doorbell = Doorbell()
    monitor, _lock, aborted = make_monitor(
        store, last_call_wait=30.0, interval=1.0, faults_seen=lambda: seen[0], doorbell=doorbell
    )
    try:
        armed = monitor.arm(0, store.fault_count(), state=None)
        start = time.monotonic()
        with pytest.raises(RankShouldRestart):
            if watch:
                store.record_fault("1/x", "process died")  # a death: the wait begins
                seen[0] = store.fault_count()
                doorbell.ring()
                time.sleep(0.3)
                assert not aborted  # still waiting for concurrent faults
            store.request_join("1/y")  # the replacement
            if watch:
                seen[0] = store.fault_count()
                doorbell.ring()
            spin(20)
        assert time.monotonic() - start < 15, "the join request did not end the wait"
        armed.acked = True
        assert aborted
    finally:
        monitor.disarm()
        monitor.shutdown()
        doorbell.close()


def test_monitor_keeps_raising_until_acknowledged():
    store = HashStore()
    monitor, _lock, _ = make_monitor(store)
    swallowed = 0
    try:
        monitor.arm(0, store.fault_count(), state=None)
        end = time.monotonic() + 5
        recorded = False
        with pytest.raises(RankShouldRestart):
            while time.monotonic() < end:
                try:
                    # Inside the handler's reach: the exception may land as soon
                    # as the fault counter moves, before record_fault returns.
                    if not recorded:
                        recorded = True
                        store.record_fault("1/x", "boom")
                    spin(5)
                except RankShouldRestart:
                    swallowed += 1  # user code that swallows it...
                    if swallowed == 3:
                        raise  # ... until it finally lets it through
    finally:
        monitor.disarm()
        monitor.shutdown()
    assert swallowed == 3


def test_fault_after_completion_is_ignored():
    store = HashStore()
    monitor, _lock, aborted = make_monitor(store)
    try:
        armed = monitor.arm(0, store.fault_count(), state=None)
        monitor.leave_function(armed)  # at the completion barrier
        assert store.decide_outcome(0, "completed") == "completed"
        store.record_fault("1/x", "late")
        spin(0.3)  # no exception: the iteration completed first
        assert not aborted
    finally:
        monitor.disarm()
        monitor.shutdown()


def test_atomic_block_is_never_interrupted():
    store = HashStore()
    monitor, lock, aborted = make_monitor(store)
    try:
        monitor.arm(0, store.fault_count(), state=None)
        with pytest.raises(RankShouldRestart):
            try:
                with lock:  # what CallWrapper.atomic() holds
                    store.record_fault("1/x", "boom")
                    spin(0.3)
                    inside_done = time.monotonic()
                spin(60)  # ends with the exception, sent once the lock is free
            finally:
                # The monitor sends the exception, then aborts, both under the lock,
                # and re-sends until disarmed: disarming (under the lock) waits for
                # the abort, and a re-send landing meanwhile is caught here.
                monitor.disarm()
        assert aborted and aborted[0] >= inside_done
    finally:
        monitor.disarm()
        monitor.shutdown()


def test_atomic_refuses_to_start_once_a_restart_began():
    import inprocess

    store = HashStore()
    call = inprocess.CallWrapper(inprocess.Wrapper())
    monitor, _, _ = make_monitor(store, lock=call._lock)
    call._monitor = monitor
    try:
        monitor.arm(0, store.fault_count(), state=None)
        with pytest.raises(RankShouldRestart):
            store.record_fault("1/x", "boom")  # the exception may land in here
            spin(5)
        assert monitor.restart_in_progress
        with pytest.raises(RankShouldRestart), call.atomic():
            pytest.fail("entered an atomic block during a restart")
    finally:
        monitor.disarm()
        monitor.shutdown()


SLOW_PACKAGE = """
import time
from . import first
time.sleep(0.05)  # blocked in the kernel: the re-sent signal must not break the import
end = time.monotonic() + 3.0  # long enough for the abort on a loaded machine
while time.monotonic() < end:
    pass  # running bytecode: where an asynchronous exception lands
from . import second
done_at = time.monotonic()
"""


def test_restart_waits_for_an_import_to_finish(tmp_path, monkeypatch):
    """An exception landing inside an import would leave the package half-imported
    for the rest of the process (its submodules stay in sys.modules, unbound to
    the package imported again); the monitor thread sends it once the import is done."""
    package = tmp_path / "slowly_imported"
    package.mkdir()
    (package / "__init__.py").write_text(SLOW_PACKAGE)
    (package / "first.py").write_text("VALUE = 1\n")
    (package / "second.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    store = HashStore()
    interrupt = InterruptSignal()
    interrupt.install()
    monitor, _lock, aborted = make_monitor(store, interrupt=interrupt)
    fault = threading.Timer(0.2, store.record_fault, args=("1/x", "boom"))
    try:
        monitor.arm(0, store.fault_count(), state=None)
        fault.start()
        with pytest.raises(RankShouldRestart):
            import slowly_imported  # noqa: F401

            spin(5)
        module = sys.modules["slowly_imported"]  # an exception inside the import drops it
        assert module.first.VALUE == 1 and module.second.VALUE == 2
        assert aborted and aborted[0] < module.done_at, "the abort is not held back"
    finally:
        fault.cancel()
        fault.join()
        monitor.disarm()
        monitor.shutdown()
        interrupt.uninstall()
        for name in ("slowly_imported", "slowly_imported.first", "slowly_imported.second"):
            sys.modules.pop(name, None)


def test_soft_timeout_records_a_fault():
    store = HashStore()
    monitor, _, _ = make_monitor(store, soft_timeout=0.05, stalled_for=lambda: 1.0)
    try:
        with pytest.raises(RankShouldRestart):
            try:
                # the fault stands before arming: the exception may land in arm() already
                monitor.arm(0, store.fault_count(), state=None)
                spin(60)
            finally:
                # the monitor re-sends until disarmed: disarm where a re-send is caught
                monitor.disarm()
        assert any("soft timeout" in f["reason"] for f in store.fault_log())
    finally:
        monitor.disarm()
        monitor.shutdown()


def test_progress_watchdog_sees_a_blocked_main_thread():
    board = ProgressBoard()
    watchdog = ProgressWatchdog(0.01, board)
    watchdog.start()
    try:
        spin(0.1)
        # running bytecode reads as progress once the watchdog's thread ticks
        # (it may be starved for a while on a loaded machine: never for good)
        settle_within(lambda: watchdog.stalled_for() < 0.1)
        # blocked in C: no pending call can run (a tick starved up to 0.3 s
        # can still date the progress before the block late)
        # (sampled by another thread while this one still waits in C: once it
        # wakes, the next tick's pending call dates the progress anew)
        seen: list[tuple[float, float]] = []
        sampled = threading.Event()

        def sample() -> None:
            seen.append((watchdog.stalled_for(), time.monotonic() - board.last_progress()))
            sampled.set()

        sampler = threading.Timer(0.8, sample)
        sampler.start()
        assert sampled.wait(60)
        sampler.join()
        ((stalled, since_progress),) = seen
        assert stalled > 0.3
        assert since_progress > 0.3
        settle_within(lambda: watchdog.stalled_for() < 0.1)
        watchdog.ping()
        time.sleep(0.2)
        spin(0.05)  # automatic heartbeats are fresh, the manual one is not
        assert watchdog.stalled_for() > 0.15
        before = time.monotonic()
        watchdog.reset(1)
        assert watchdog.stalled_for() <= time.monotonic() - before
    finally:
        watchdog.shutdown()
        board.close()


def test_hard_clock_outlives_restarts_and_stands_still_outside_the_function():
    # A soft timeout of 2 s: on a loaded machine a tick can see progress late
    # enough that a shorter one would read as outlived (and forgive the stall).
    soft = 2.0
    board = ProgressBoard()
    watchdog = ProgressWatchdog(0.01, board, soft_timeout=soft)
    watchdog.start()

    def hard_stall():
        return time.monotonic() - board.last_progress()

    try:
        spin(0.05)
        released = threading.Event()

        def hang():
            # The main thread enters the function and hangs there at once (it is
            # already blocked: no bytecode of its own between entry and interrupt,
            # however late this thread runs), past the soft timeout...
            watchdog.resume(0)
            time.sleep(soft + 0.3)
            watchdog.freeze()  # ... then the monitor thread interrupts it ...
            released.set()

        helper = threading.Thread(target=hang)
        helper.start()
        released.wait()
        helper.join()
        spin(0.05)  # ... and the interrupted function's own bytecode is no progress
        watchdog.pause()
        carried = watchdog._carry  # what the board must read from now on
        assert carried > soft + 0.3
        spin(0.3)  # the restart procedure runs Python: the clock stands still
        # ... as of the watchdog's next tick: on a loaded machine its thread can
        # be starved for a while, and the board reads the stall as of its last
        # tick. Standing still: back at ``carried`` once ticks run; a running
        # clock would only grow.
        settle_within(lambda: abs(hard_stall() - carried) < 0.1)
        resumed = time.monotonic()
        watchdog.resume(1)
        spin(0.05)  # a little setup bytecode does not forgive the carried stall...
        start = time.monotonic()
        time.sleep(0.15)  # ... when the hang recurs; the soft clock restarted
        elapsed = time.monotonic() - start
        assert watchdog.stalled_for() <= time.monotonic() - resumed
        assert hard_stall() > carried - 0.05 + elapsed
        spin(soft + 0.2)  # progress that outlives a soft timeout does
        settle_within(lambda: hard_stall() < 0.2)
    finally:
        watchdog.shutdown()
        board.close()


def test_progress_board_is_never_read_half_written():
    """A reader in another process must never see a timestamp being written.

    ``struct.pack_into`` clears a field before writing it; a monitor process
    that read such a zero took it for "no progress since boot" and killed a
    healthy rank. The board writes each field with one 8-byte store.
    """
    import os

    board = ProgressBoard()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader
        code = 0
        try:
            reader = ProgressBoard(os.dup(board.fd))
            os.write(ready_w, b"r")
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                auto, manual, _, _, _ = reader.read()
                if auto <= 0 or manual <= 0:
                    code = 1
                    break
        finally:
            os._exit(code)
    try:
        os.read(ready_r, 1)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            board.write_auto(time.monotonic())
            board.write_manual(time.monotonic(), True)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)
        board.close()
    assert os.waitstatus_to_exitcode(status) == 0, "the reader saw a half-written field"
