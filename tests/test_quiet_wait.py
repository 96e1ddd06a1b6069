"""The library's blocking store waits print nothing and cost one request per wait
(issue 39): :mod:`inprocess.quiet_wait` under ``StoreMixin.wait_for``, over real
``TCPStore`` servers in this process (torch's ``libuv`` one and its classic one)."""

from __future__ import annotations

import datetime
import os
import threading
import time

import pytest

from inprocess import quiet_wait
from inprocess.store import PrefixStore, TCPStore


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def stores(request):
    """(a waiter's view of the store, a setter's view of the same keys)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=request.param)
    client = TCPStore.client(host_name="127.0.0.1", port=server.port)
    held = [PrefixStore("a", PrefixStore("b", client)), PrefixStore("a", PrefixStore("b", server))]
    del server, client
    yield held
    held.clear()


def test_a_wait_that_runs_out_prints_nothing_where_torchs_own_prints(stores, capfd):
    waiter, _ = stores
    assert waiter.wait_for("never", 0.2) is False
    assert "waitForInput" not in capfd.readouterr().err
    with pytest.raises(Exception, match="imeout"):
        waiter.wait(["never"], datetime.timedelta(seconds=0.2))  # torch's: the control
    if os.environ.get("TORCH_CPP_LOG_LEVEL", "WARNING").upper() in ("", "WARNING", "INFO"):
        assert "waitForInput" in capfd.readouterr().err


def test_chunks_of_one_wait_share_one_request_and_a_set_wakes_it(stores):
    waiter, setter = stores
    sent = quiet_wait.requests_sent()
    for _ in range(3):
        assert waiter.wait_for("k", 0.1) is False
    assert quiet_wait.requests_sent() - sent == 1, "one request stands for every chunk"
    timer = threading.Timer(0.2, setter.set, args=("k", "1"))
    timer.start()
    start = time.monotonic()
    try:
        assert waiter.wait_for("k", 30.0) is True
    finally:
        timer.join()
    assert time.monotonic() - start < 20  # woken by the set, not by the end of the chunk
    assert quiet_wait.requests_sent() - sent == 1
    start = time.monotonic()
    assert waiter.wait_for("k", 30.0) is True  # it exists: answered at once
    assert time.monotonic() - start < 20


def test_another_key_cancels_the_standing_request_even_if_its_key_came_meanwhile(stores):
    waiter, setter = stores
    assert waiter.wait_for("x", 0.05) is False
    setter.set("x", "1")  # the standing request is answered now, unread
    sent = quiet_wait.requests_sent()
    assert waiter.wait_for("y", 0.05) is False
    assert quiet_wait.requests_sent() - sent == 2  # a cancel, a wait
    setter.set("y", "1")
    assert waiter.wait_for("y", 10.0) is True


@pytest.mark.timeout(60)
def test_a_forked_child_waits_on_a_connection_of_its_own(stores):
    waiter, setter = stores
    assert waiter.wait_for("parent", 0.05) is False  # a request stands in the parent
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if waiter.wait_for("child", 0.05) is False else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    setter.set("parent", "1")
    assert waiter.wait_for("parent", 10.0) is True  # the parent's request is intact


def test_a_server_that_answers_wrongly_hands_the_waits_back_to_torch(stores, monkeypatch):
    waiter, setter = stores
    monkeypatch.setattr(quiet_wait, "_STOP_WAITING", 7)  # every answer is now unexpected
    setter.set("z", "1")
    assert waiter.wait_for("z", 5.0) is True  # torch's wait answered
    sent = quiet_wait.requests_sent()
    assert waiter.wait_for("z", 5.0) is True
    assert quiet_wait.requests_sent() == sent, "the store's waits stay with torch's client"
