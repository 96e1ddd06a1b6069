"""The fault watch (issue 24, item 2): a rank learns of a fault from a wait in the store,
made by its monitor process, not from a counter it reads every second.

Over a real ``TCPStore`` (server in this process): the watch's store operations
are counted on its own client; a stranger's wake-up keys and counter adds neither
make it spin nor blind it for longer than a chunk. The end-to-end path (monitor
process, board, monitor thread) runs in every restart test; the last test here
checks that a rank's monitor thread reads no store while the watch runs.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from test_monitor_thread import HashStore, make_monitor, spin

from inprocess import protocol as P
from inprocess import quiet_wait
from inprocess.monitor_thread import RankShouldRestart
from inprocess.progress_watchdog import Doorbell, ProgressBoard
from inprocess.store import FileStore, PrefixStore
from inprocess.store import TCPStore as WrapperTCPStore

NS = "ip/test/0"
TD = datetime.timedelta(seconds=20)


class CountingStore(PrefixStore):
    """The watch's client: counts the store operations it makes."""

    def __init__(self, prefix: str, store: dist.Store) -> None:
        super().__init__(prefix, store)
        self.ops = 0

    def add(self, *args):
        self.ops += 1
        return super().add(*args)

    def compare_set(self, *args):
        self.ops += 1
        return super().compare_set(*args)

    def wait(self, *args):
        self.ops += 1
        return super().wait(*args)

    def wait_for(self, *args):
        # a blocking wait goes over the thread's own connection (inprocess.quiet_wait)
        sent = quiet_wait.requests_sent()
        try:
            return super().wait_for(*args)
        finally:
            self.ops += quiet_wait.requests_sent() - sent


class Watch:
    """``watch_faults`` on a connection of its own, in a thread, writing a board."""

    def __init__(self, port: int, chunk: float, pause: float = 0.5) -> None:
        self.board = ProgressBoard()
        self.client = CountingStore(
            NS, dist.TCPStore("127.0.0.1", port, None, False, timeout=TD)
        )
        self.stopping = False
        self.thread = threading.Thread(
            target=self.client.watch_faults,
            args=(self.board.write_faults_seen, chunk, pause, lambda: self.stopping),
            daemon=True,
        )
        self.thread.start()

    def seen_within(self, count: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.board.faults_seen() == count:
                return True
            time.sleep(0.01)
        return False

    def stop(self, wake: PrefixStore) -> None:
        self.stopping = True
        wake.signal_fault()  # ends the current wait (a wake-up: it decides nothing)
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.board.close()
        self.client = None


@pytest.fixture
def server():
    """The port of a real store server (this process), a view of it and a stranger's client."""
    server = WrapperTCPStore("127.0.0.1", 0, is_master=True, timeout=TD)
    stranger = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=TD)
    held = [server.port, PrefixStore(NS, server), stranger]
    del server, stranger
    yield held
    held.clear()  # the fixture's value outlives this teardown: it must hold no store


def test_a_fault_reaches_the_board_from_a_wait_and_a_quiet_store_costs_nothing(server):
    port, store, _ = server
    watch = Watch(port, chunk=60.0)
    try:
        assert watch.seen_within(0, 10)
        ops = watch.client.ops
        time.sleep(1.0)
        assert watch.client.ops == ops, "a quiet watch makes no store operation"
        start = time.monotonic()
        store.record_fault("1/0.aaaaaaaaaa", "RuntimeError: boom")
        assert watch.seen_within(1, 10)
        latency = time.monotonic() - start
        store.mark_terminated("2/0.bbbbbbbbbb", "process died")  # a death is a fault too
        assert watch.seen_within(2, 10)
        # a wake-up is a wait, a counter read and a log read: no polling
        assert watch.client.ops - ops <= 2 * 3, watch.client.ops - ops
    finally:
        watch.stop(store)
    assert latency < 5  # generous: the figure is in benchmarks/, not here


def test_a_strangers_wake_up_keys_and_adds_neither_spin_nor_blind_the_watch(server):
    port, store, stranger = server
    watch = Watch(port, chunk=1.0, pause=0.5)
    try:
        assert watch.seen_within(0, 10)
        seq = int(stranger.add(f"{NS}/{P.FAULTS}", 0))
        # forged wake-up keys, ahead of the counter: each costs a pause, not a spin
        for k in range(seq + 1, seq + 50):
            stranger.set(f"{NS}/{P.fault_wake_key(k)}", "1")
        ops = watch.client.ops
        time.sleep(2.0)
        assert watch.client.ops - ops <= 4 * 3, watch.client.ops - ops
        assert watch.board.faults_seen() == 0, "a wake-up is not a fault"
        # the counter raised by a stranger (no key set): a real fault's key is then
        # one the watch does not wait on; it still arrives within a chunk
        stranger.add(f"{NS}/{P.FAULTS}", 100)
        store.record_fault("1/0.aaaaaaaaaa", "RuntimeError: boom")
        assert watch.seen_within(1, 10)
    finally:
        watch.stop(store)


def test_the_monitor_thread_reads_no_store_while_the_watch_runs():
    store = HashStore()
    counts = {"reads": 0}
    fault_signal = store.fault_signal

    def counted():
        counts["reads"] += 1
        return fault_signal()

    store.fault_signal = counted
    seen = {"count": 0}
    monitor, _lock, _ = make_monitor(store, faults_seen=lambda: seen["count"])
    try:
        armed = monitor.arm(0, 0, state=None)
        spin(0.3)  # about 30 checks at the test's interval of 10 ms
        assert counts["reads"] == 0
        with pytest.raises(RankShouldRestart):
            seen["count"] = 1  # what the watch writes after a fault
            spin(5)
        armed.acked = True
        monitor.disarm()
        assert counts["reads"] == 0
    finally:
        monitor.shutdown()


def test_the_doorbell_wakes_the_monitor_thread_long_before_its_interval():
    store = HashStore()
    bell = Doorbell()
    seen = {"count": 0}
    monitor, _lock, _ = make_monitor(
        store, interval=30.0, faults_seen=lambda: seen["count"], doorbell=bell
    )
    try:
        armed = monitor.arm(0, 0, state=None)
        spin(0.2)  # the thread has checked once and waits its 30 s
        start = time.monotonic()
        with pytest.raises(RankShouldRestart):
            seen["count"] = 1
            # what the monitor process does after writing the board: from another
            # process, through the inherited write end
            subprocess.run(
                [sys.executable, "-c", f"import os; os.write({bell.write_fd}, b'x')"],
                pass_fds=(bell.write_fd,),
                check=True,
            )
            spin(20)
        armed.acked = True
        monitor.disarm()
        assert time.monotonic() - start < 15  # far below the 30 s interval
    finally:
        monitor.shutdown()
        bell.close()


def test_over_a_file_store_the_watch_looks_every_pause(tmp_path):
    # FileStore's wait polls the file every 10 ms in the client: the watch looks
    # once per pause instead, and still hears of every fault
    store = FileStore(str(tmp_path / "store"))
    board = ProgressBoard()
    stopping = []
    thread = threading.Thread(
        target=store.watch_faults,
        args=(board.write_faults_seen, 60.0, 0.2, lambda: bool(stopping)),
        daemon=True,
    )
    thread.start()
    try:
        writer = FileStore(str(tmp_path / "store"))
        writer.record_fault("1/0.aaaaaaaaaa", "RuntimeError: boom")
        deadline = time.monotonic() + 10
        while board.faults_seen() != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert board.faults_seen() == 1
    finally:
        stopping.append(True)
        thread.join(10)
        board.close()
    assert not thread.is_alive()


def test_a_burst_of_faults_costs_a_watch_a_look_per_pause(server):
    # N peers of a dead rank record a fault each: the watch hears of the first at
    # once and reads the rest together, a look per pause, not a wake-up per fault
    port, store, _ = server
    watch = Watch(port, chunk=60.0, pause=0.5)
    try:
        assert watch.seen_within(0, 10)
        ops = watch.client.ops
        start = time.monotonic()
        for i in range(40):
            store.record_fault(f"{i}/0.aaaaaaaaaa", "RuntimeError: Connection closed by peer")
            time.sleep(0.025)
        looks = (time.monotonic() - start) / 0.5 + 2
        assert watch.seen_within(40, 10)
        assert watch.client.ops - ops <= 3 * looks, (watch.client.ops - ops, looks)
    finally:
        watch.stop(store)
