"""The Wrapper run inside the test process itself: what it leaves behind is checked."""

from __future__ import annotations

import datetime
import socket

import pytest
from launcher import free_port

import inprocess
from inprocess.exception import StoreError

ms = datetime.timedelta(milliseconds=1)
s = datetime.timedelta(seconds=1)


@pytest.fixture
def single_rank(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


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

    @inprocess.Wrapper(
        monitor_thread_interval=20 * ms,
        monitor_process_interval=20 * ms,
        progress_watchdog_interval=20 * ms,
        last_call_wait=10 * ms,
        soft_timeout=30 * s,
        hard_timeout=60 * s,
        monitor_process_logfile=str(tmp_path / "monitor_{rank}.log"),
    )
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
