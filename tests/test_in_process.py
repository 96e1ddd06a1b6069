"""The Wrapper run inside the test process itself: what it leaves behind is checked."""

from __future__ import annotations

import datetime
import logging
import os
import socket

import pytest
from test_call_lifecycle import fast_wrapper

import inprocess
from inprocess.exception import StoreError

ms = datetime.timedelta(milliseconds=1)
s = datetime.timedelta(seconds=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("monitor", ["forked", "spawned"])
def test_restart_in_this_process_leaves_nothing_behind(single_rank, tmp_path, monitor):
    """Threads, the monitor process, fds, signal handlers: all gone after the call.

    With another thread alive the monitor process cannot be forked safely and is
    started as a fresh interpreter instead; both ways must work.
    """
    import signal
    import threading

    import torch
    import torch.distributed as dist

    from inprocess.monitor_process import fork_is_safe

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    if monitor == "spawned":
        other.start()
    assert fork_is_safe() == (monitor == "forked")

    handler = signal.getsignal(inprocess.monitor_thread.INTERRUPT_SIGNAL)
    calls = []

    @fast_wrapper(monitor_process_logfile=str(tmp_path / "monitor_{rank}.log"))
    def train(scale, call_wrapper: inprocess.CallWrapper = None):
        calls.append(call_wrapper.iteration)
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        if call_wrapper.iteration == 0:
            raise RuntimeError("first attempt fails")
        with call_wrapper.atomic():
            call_wrapper.ping()
        dist.destroy_process_group()
        return scale * t.item()

    assert train(3) == 3.0
    assert calls == [0, 1]
    assert not dist.is_initialized()
    assert signal.getsignal(inprocess.monitor_thread.INTERRUPT_SIGNAL) == handler
    assert "monitoring rank" in (tmp_path / "monitor_0.log").read_text()
    # callable again: a second call is independent of the first
    assert train(2) == 2.0
    stop.set()
    if other.is_alive():
        other.join()


@pytest.mark.timeout(120)
def test_forked_monitor_that_deadlocks_is_replaced_by_a_fresh_interpreter(
    single_rank, tmp_path, monkeypatch
):
    """A forked monitor stuck before it is ready (a lock a native thread held at the
    fork) is killed after the grace, and a fresh interpreter monitors the rank."""
    import time

    import torch.distributed as dist

    from inprocess import monitor_process
    from inprocess.monitor_process import fork_is_safe

    assert fork_is_safe()
    # the child inherits this: it hangs where a deadlocked child would
    monkeypatch.setattr(monitor_process, "_sanitize_after_fork", lambda keep: time.sleep(3600))
    monkeypatch.setattr(monitor_process, "FORK_START_GRACE", 0.5)
    started = []
    real_start_once = monitor_process.MonitorProcess._start_once

    def start_once(self, launch, timeout):
        ok = real_start_once(self, launch, timeout)
        started.append((launch.__name__, ok, self.process.pid))
        return ok

    monkeypatch.setattr(monitor_process.MonitorProcess, "_start_once", start_once)

    @fast_wrapper(monitor_process_logfile=str(tmp_path / "monitor_{rank}.log"))
    def train():
        dist.init_process_group("gloo")
        dist.destroy_process_group()
        return 7

    assert train() == 7
    # the fresh interpreter is started, not waited for (the rank goes on beside it);
    # the call's end waits for it to start and exit
    assert [(name, ok) for name, ok, _ in started] == [("_fork", False), ("_spawn", False)]
    forked_pid = started[0][2]
    with pytest.raises(ChildProcessError):
        os.waitpid(forked_pid, os.WNOHANG)  # killed and reaped, not left behind
    assert "monitoring rank" in (tmp_path / "monitor_0.log").read_text()


@pytest.mark.timeout(120)
def test_tracebacks_carry_one_rank_prefix_however_many_restarts(single_rank, capsys, monkeypatch):
    """init_process_group wraps sys.excepthook in a "[rank<r>]: " layer each time:
    restarted in-process, only the current iteration's layer is kept."""
    import sys

    import torch.distributed as dist

    # this process may have run other groups already: their layers stay theirs
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    printed = []

    @fast_wrapper()
    def train(call_wrapper: inprocess.CallWrapper = None):
        dist.init_process_group("gloo")
        if call_wrapper.iteration < 3:
            raise RuntimeError("again")
        try:
            raise ValueError("shown")
        except ValueError:
            sys.excepthook(*sys.exc_info())
        printed.append(capsys.readouterr().err)
        dist.destroy_process_group()

    train()
    lines = [line for line in printed[0].splitlines() if "ValueError: shown" in line]
    assert lines == ["[rank0]: ValueError: shown"], printed[0]


@pytest.mark.timeout(60)
def test_store_port_taken_by_another_socket_is_a_clear_error(single_rank, monkeypatch):
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(StoreError, match="already in use"):
            inprocess.store.TCPStore()

        @inprocess.Wrapper()
        def train():
            return 1

        with pytest.raises(StoreError, match="already in use"):
            train()


def test_store_arguments_are_checked(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(StoreError, match="MASTER_ADDR"):
        inprocess.store.TCPStore(port=1234)
    with pytest.raises(ValueError, match="port"):
        inprocess.store.TCPStore(host_name="127.0.0.1", port=70000)


def _our_handlers() -> dict[str, list]:
    names = ["", *(n for n in list(logging.root.manager.loggerDict) if n.startswith("inprocess"))]
    return {n: list(logging.getLogger(n).handlers) for n in names}


@pytest.mark.timeout(120)
def test_logging_as_a_library(single_rank, tmp_path):
    """No handler of ours, a warning per call while the application configured no
    logging, and a monitor log that names the process it watches."""
    import os
    import warnings

    @inprocess.Wrapper(
        monitor_thread_interval=20 * ms,
        monitor_process_interval=20 * ms,
        progress_watchdog_interval=20 * ms,
        monitor_process_logfile=str(tmp_path / "monitor_{rank}.log"),
    )
    def train():
        return 1

    def logging_off_warnings(caught):
        return [w for w in caught if "configured no logging" in str(w.message)]

    assert not logging.getLogger("inprocess").handlers
    # pytest's capture handlers stand for an application's configuration: off they go
    saved = list(logging.root.handlers)
    for handler in saved:
        logging.root.removeHandler(handler)
    try:
        before = _our_handlers()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert train() == 1
            assert train() == 1
        assert _our_handlers() == before
        off = logging_off_warnings(caught)
        assert len(off) == 2 and all(w.category is UserWarning for w in off)
        assert "logging.basicConfig" in str(off[0].message)
        assert off[0].filename == __file__  # points at the caller
    finally:
        for handler in saved:
            logging.root.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train() == 1
    assert not logging_off_warnings(caught)
    getattr(inprocess.wrap, "release_hosted_stores", lambda: None)()
    text = (tmp_path / "monitor_0.log").read_text()
    assert f"target_pid={os.getpid()} training_pid={os.getpid()} " in text


@pytest.mark.timeout(120)
def test_health_check_failing_after_a_fault_is_a_health_check_error(single_rank):
    """Whatever the check raises, the rank ends with a HealthCheckError caused by the
    function's exception (the check's own error is its context)."""

    class SickAfterAFault(inprocess.health_check.HealthCheck):
        def __call__(self, state, train_ex=None):
            if train_ex is not None:
                raise RuntimeError("GPU lost")

    failure = RuntimeError("the function failed")

    @inprocess.Wrapper(
        monitor_thread_interval=20 * ms,
        monitor_process_interval=20 * ms,
        progress_watchdog_interval=20 * ms,
        health_check=SickAfterAFault(),
    )
    def train():
        raise failure

    with pytest.raises(inprocess.exception.HealthCheckError, match="GPU lost") as info:
        train()
    assert info.value.__cause__ is failure
    assert str(info.value.__context__) == "GPU lost"
    del info
    getattr(inprocess.wrap, "release_hosted_stores", lambda: None)()


@pytest.mark.timeout(120)
def test_a_failed_iterations_objects_are_freed_when_it_restarts(single_rank):
    """Nothing the failed iteration made outlives its restart, without the user's help:
    its model and optimizer are gone when the function is called again, even one
    that sits in a reference cycle of its own; the exception stays printable."""
    import traceback
    import weakref

    import torch
    import torch.distributed as dist

    made: list[weakref.ref] = []
    left_alive: list[int] = []
    last_error: list[str] = []

    class Finalize(inprocess.finalize.Finalize):
        def __call__(self, state, train_ex=None):
            last_error.append("".join(traceback.format_exception(train_ex)))
            return state, train_ex

    @fast_wrapper(finalize=Finalize())
    def train(call_wrapper: inprocess.CallWrapper = None):
        left_alive.append(sum(ref() is not None for ref in made))
        dist.init_process_group("gloo")
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 256)).sum().backward()
        opt.step()
        cyclic = {"model": torch.nn.Linear(256, 256)}
        cyclic["self"] = cyclic  # only the collector frees it
        made.extend(weakref.ref(x) for x in (model, opt, cyclic["model"]))
        if call_wrapper.iteration < 4:
            raise RuntimeError(f"iteration {call_wrapper.iteration} fails")
        dist.destroy_process_group()
        return call_wrapper.iteration

    import gc

    frozen_before = gc.get_freeze_count()
    assert train() == 4
    assert left_alive == [0, 0, 0, 0, 0]
    assert gc.get_freeze_count() == frozen_before  # the call's freeze is undone
    # the traceback still names where it failed
    assert "iteration 3 fails" in last_error[-1]
    assert 'raise RuntimeError(f"iteration {call_wrapper.iteration} fails")' in last_error[-1]
    getattr(inprocess.wrap, "release_hosted_stores", lambda: None)()
