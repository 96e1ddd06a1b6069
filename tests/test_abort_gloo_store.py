"""The abort reads a gloo group's addresses from its store on a connection of its own,
or takes them as the monitor thread read them ahead."""

from __future__ import annotations

import datetime
import logging
import threading
import time

import psutil
import pytest
import torch.distributed as dist

from inprocess.abort import gloo
from inprocess.monitor_thread import InterruptSignal, MonitorThread
from inprocess.store import StoreMixin

#: the read's bound here: generous for a loaded machine (and for torch's server,
#: which looks up the name of every new peer: a slow resolver stalls it 5 s),
#: far below the waiter's wait
READ_TIMEOUT = 20.0


def _client_connections(port: int) -> set[tuple]:
    """Local ends of this process's established connections to the store server at ``port``."""
    return {
        tuple(c.laddr)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "inprocess-gloo-addresses"]


@pytest.mark.timeout(180)
def test_the_addresses_are_read_while_the_application_waits_on_the_group_store(caplog, monkeypatch):
    """A TCPStore client runs one operation at a time: an application thread
    blocked in a ``wait`` on the client its process group was made with would
    hold a read of the group's addresses there until the read's own timeout, and
    no blocked collective would be released. The read uses a connection of its
    own, closed right after; where the server is gone it fails at once instead
    of retrying a connection."""
    monkeypatch.setattr(gloo, "OWN_CLIENT_WAIT", READ_TIMEOUT, raising=False)  # not the busy one
    long = datetime.timedelta(seconds=120)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=long, wait_for_workers=False)
    port = server.port
    client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=long)
    dist.init_process_group("gloo", store=client, rank=0, world_size=1)
    started = threading.Event()

    def application_wait() -> None:
        started.set()
        client.wait(["released"], long)

    waiter = threading.Thread(target=application_wait, name="application-wait")
    held = threading.Thread(target=client.check, args=(["released"],), name="held-check")
    try:
        (group,) = gloo.gloo_groups()
        before = _client_connections(port)
        idle = gloo._gloo_address_blobs(*group, timeout=READ_TIMEOUT)
        assert idle, "the published addresses of an idle group"
        assert _client_connections(port) == before, "our connection is closed after the read"

        waiter.start()
        assert started.wait(30)
        held.start()  # queues behind the waiter on the application's client
        held.join(1.0)
        assert held.is_alive(), "the waiter holds the application's client"

        with caplog.at_level(logging.DEBUG, logger=gloo.__name__):
            busy = gloo._gloo_address_blobs(*group, timeout=READ_TIMEOUT)
        assert busy == idle, caplog.text
        assert "timed out" not in caplog.text
        assert waiter.is_alive(), "read while the application's client was held"
        assert _client_connections(port) == before, "our connection is closed after the read"
        assert not _reader_threads()

        server.set("released", "1")
        waiter.join(30)
        held.join(30)
        assert not (waiter.is_alive() or held.is_alive())

        # The server goes away: no connection of ours can be made, and the group's
        # own client fails at once (a client of ours would retry for minutes).
        del server
        server = None
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger=gloo.__name__):
            gone = gloo._gloo_address_blobs(*group, timeout=READ_TIMEOUT)
        assert gone == []
        assert "does not accept" in caplog.text
        assert "timed out" not in caplog.text
        assert not _reader_threads()
    finally:
        if server is not None:
            server.set("released", "1")
        for thread in (waiter, held):
            if thread.ident is not None:
                thread.join(30)
        dist.destroy_process_group()


def test_a_store_that_cannot_be_cloned_is_read_as_it_is():
    """A store implemented in Python has no ``clone``: no client of our own."""

    class PythonStore(dist.Store):
        pass

    assert gloo._own_client(dist.PrefixStore("group/", PythonStore()), timeout=1.0) is None


# --------------------------------------------------------------------------- read ahead


class _HashStore(dist.HashStore, StoreMixin):
    """A real in-memory torch store with the Wrapper protocol (the monitor thread's)."""


def _one_rank_world(port: int) -> dist.Store:
    """This process as the only rank of a gloo world whose store is served at ``port``."""
    client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=client, rank=0, world_size=1)
    return client


def _settled_read_ahead() -> None:
    gloo._wait_for_read_ahead(60)
    assert not [t for t in threading.enumerate() if t.name == "inprocess-gloo-prefetch"]


def _no_read_at_abort(monkeypatch) -> list[str]:
    """Makes every read of the store the abort could do a recorded call."""
    calls: list[str] = []
    own, read = gloo._own_client, gloo._gloo_address_blobs

    def own_client(*args, **kwargs):
        calls.append("own client")
        return own(*args, **kwargs)

    def address_blobs(*args, **kwargs):
        calls.append("group read")
        return read(*args, **kwargs)

    monkeypatch.setattr(gloo, "_own_client", own_client)
    monkeypatch.setattr(gloo, "_gloo_address_blobs", address_blobs)
    return calls


@pytest.mark.timeout(180)
def test_the_monitor_thread_reads_the_addresses_ahead_and_the_abort_opens_no_connection(
    monkeypatch,
):
    """While the function runs, the monitor thread reads each gloo group's
    addresses in the background; the abort then takes them from there and opens
    no store connection (torch's server looks up the name of each new peer:
    seconds where the resolver is slow). Once read, the monitor thread's
    interval costs no store operation and starts no thread."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    _one_rank_world(server.port)
    monitor = MonitorThread(
        store=_HashStore(),
        identity="0/test",
        target_thread_id=threading.get_ident(),
        lock=threading.RLock(),
        interval=0.01,
        last_call_wait=0.0,
        soft_timeout=60.0,
        stalled_for=lambda: 0.0,
        abort=None,
        interrupt=InterruptSignal(),
    )
    monitor.start()
    try:
        ((pg, store),) = gloo.gloo_groups()
        expected = gloo._gloo_address_blobs(pg, store, timeout=READ_TIMEOUT)
        assert expected
        assert gloo._cached_blobs(pg) is None, "not read ahead before the iteration is armed"
        armed = monitor.arm(0, 0, state=None)
        deadline = time.monotonic() + 60
        while gloo._cached_blobs(pg) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gloo._cached_blobs(pg) == expected
        _settled_read_ahead()

        calls = _no_read_at_abort(monkeypatch)
        monkeypatch.setattr(gloo, "_read_ahead", lambda due: calls.append("read ahead"))
        time.sleep(0.2)  # some intervals of the monitor thread: nothing to read
        assert gloo.prefetch() is False
        gloo.group_connections(gloo.gloo_groups(), timeout=READ_TIMEOUT)
        assert calls == [], "the store was read again"
        monitor.leave_function(armed)
        monitor.disarm()
    finally:
        monitor.shutdown()
        _settled_read_ahead()
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_a_group_made_again_under_the_same_name_is_read_anew(monkeypatch):
    """torch names default groups from 0 again once the world is destroyed: the
    group made next has the same name, the same store keys and perhaps the same
    object address, and other listening addresses. Its addresses are read anew,
    and a read that finds none (a group not set up yet) is tried again later."""
    monkeypatch.setattr(gloo, "PREFETCH_RETRY", 0.0)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    try:
        _one_rank_world(server.port)
        ((first, _store),) = gloo.gloo_groups()
        assert gloo.prefetch() is True
        _settled_read_ahead()
        old = gloo._cached_blobs(first)
        assert old
        name = first.group_name
        dist.destroy_process_group()
        del first

        _one_rank_world(server.port)
        ((second, store),) = gloo.gloo_groups()
        assert second.group_name == name
        assert gloo._cached_blobs(second) is None
        found = []
        read = gloo._read_blobs

        def nothing_the_first_time(*args):
            found.append(read(*args) if found else [])
            return found[-1]

        monkeypatch.setattr(gloo, "_read_blobs", nothing_the_first_time)
        assert gloo.prefetch() is True
        _settled_read_ahead()
        assert found == [[]] and gloo._cached_blobs(second) is None
        assert gloo.prefetch() is True, "tried again"
        _settled_read_ahead()
        new = gloo._cached_blobs(second)
        assert new and new != old
        assert new == gloo._gloo_address_blobs(second, store, timeout=READ_TIMEOUT)
        assert len(gloo._cache) == 1, "the destroyed group's entry is dropped"
    finally:
        _settled_read_ahead()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_a_read_ahead_in_progress_stands_for_the_aborts_own_attempt(monkeypatch):
    """A fault right after a group is made finds its read ahead under way (a new
    connection can take seconds): the abort waits for it rather than open
    another connection, up to the wait its own attempt would have had, then
    reads the group's client."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    _one_rank_world(server.port)
    go_on = threading.Event()
    read = gloo._read_on_own_client

    def slow_read(*args):
        go_on.wait(60)
        return read(*args)

    monkeypatch.setattr(gloo, "_read_on_own_client", slow_read)
    calls = []
    address_blobs = gloo._gloo_address_blobs

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return address_blobs(*args, **kwargs)

    monkeypatch.setattr(gloo, "_gloo_address_blobs", recorded)
    try:
        ((pg, store),) = gloo.gloo_groups()
        expected = address_blobs(pg, store, timeout=READ_TIMEOUT)
        assert gloo.prefetch() is True
        deadline = time.monotonic() + 60
        while gloo._read_ahead_state(pg)[1] is None and time.monotonic() < deadline:
            time.sleep(0.01)

        # it answers within the wait: its addresses are taken
        monkeypatch.setattr(gloo, "OWN_CLIENT_WAIT", READ_TIMEOUT)
        timer = threading.Timer(0.2, go_on.set)
        timer.start()
        gloo.group_connections([(pg, store)], timeout=3 * READ_TIMEOUT)
        timer.join()
        assert calls == []
        assert gloo._cached_blobs(pg) == expected

        # it does not: the group's client, no connection of the abort's own
        _settled_read_ahead()
        go_on.clear()
        gloo._cache.clear()
        assert gloo.prefetch() is True
        while gloo._read_ahead_state(pg)[1] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setattr(gloo, "OWN_CLIENT_WAIT", 0.2)
        gloo.group_connections([(pg, store)], timeout=READ_TIMEOUT)
        assert calls == [{"own_client": False}]
    finally:
        go_on.set()
        _settled_read_ahead()
        dist.destroy_process_group()
