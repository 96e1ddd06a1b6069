"""Blocking waits on a ``TCPStore`` that print nothing: the store's wait request on a
connection of our own.

torch's store client writes two warnings to stderr (``waitForInput: poll for
socket ... returned 0, likely a timeout`` and ``... timed out after N ms``) each
time a ``wait`` with a timeout ends before its key appears. The library's waits
end so by design, healthy or not: a rank waits in chunks (a spare in the
completion barrier for the whole run, a rank early at a barrier for its slowest
peer), so a quiet job printed pairs of them for as long as it ran. Changing
torch's log level would change the user's settings, so the waits do not go
through torch's client at all.

Each thread of a process that waits keeps one connection per store client
object (:func:`wait`), closed with that object. It sends the server's own
wait request (the request torch's client sends: the server answers "stop
waiting" once every key named exists) and blocks in ``poll`` on the socket
for the chunk. A chunk that ends without an answer leaves the request
standing on the server: the next chunk of the same wait blocks on the same
request, so a long wait costs one request, not one per chunk (torch's client
sends a wait and a cancel each chunk). Only a wait for another key cancels
it first (the server's cancel request, answered "wait canceled"). A wake-up
is the server's answer on the socket: as fast as with torch's client.

What the wait request looks like is torch's wire format (one byte of request
type, lengths as native 8-byte integers; a connection's first request is the
"validate" magic number), stable across the torch versions this library
supports. Anything unexpected drops the connection, and the caller falls back
to torch's own timed wait: never a wrong answer, at worst the old warnings. A
connection that fails is replaced once per wait; a server that answers what
the protocol does not allow keeps that store's waits on torch's client from
then on (logged once, at INFO).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time
import weakref
from typing import Any

log = logging.getLogger(__name__)

#: torch's request types (``QueryType``) and wait answers (``WaitResponseType``)
_VALIDATE, _WAIT, _CANCEL_WAIT = 0, 6, 12
_STOP_WAITING, _WAIT_CANCELED = 0, 1
_MAGIC = 0x3C85F7CE
#: seconds to connect, and to get the answer of a cancel (the server answers at once)
_IO_TIMEOUT = 30.0


class WaitProtocolError(ConnectionError):
    """The server answered something the wait protocol does not allow."""


class QuietWaiter:
    """One thread's connection to one store server for blocking waits (see the module).

    Invariant: at most one wait request stands on the connection, the one for
    :attr:`pending`; its answer has not been read yet.
    """

    def __init__(self, host: str, port: int) -> None:
        self.pid = os.getpid()
        self.sock = socket.create_connection((host, port), timeout=_IO_TIMEOUT)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.sendall(struct.pack("=BI", _VALIDATE, _MAGIC))
        except BaseException:
            self.sock.close()
            raise
        self.pending: str | None = None
        self._poll = select.poll()
        self._poll.register(self.sock.fileno(), select.POLLIN)

    def wait(self, name: str, seconds: float) -> bool:
        """Blocks until the store's key ``name`` (its full name on the server) exists or
        ``seconds`` passed; returns whether it exists. Raises ``OSError`` when the
        connection fails (it is then unusable)."""
        if self.pending != name:
            if self.pending is not None:
                self._cancel()
            data = name.encode()
            self.sock.sendall(struct.pack("=BQQ", _WAIT, 1, len(data)) + data)
            _count()
            self.pending = name
        deadline = time.monotonic() + max(seconds, 0.001)  # torch's least wait too
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            # poll retries on EINTR itself, after running Python's signal handlers
            if self._poll.poll(int(left * 1000 + 0.999)):
                break
            if time.monotonic() >= deadline:
                return False  # the request stands: the next chunk waits on it
        answer = self._read()
        if answer != _STOP_WAITING:
            raise WaitProtocolError(f"unexpected answer {answer} to a store wait")
        self.pending = None
        return True

    def _cancel(self) -> None:
        """Withdraws the standing request. Its key may have appeared meanwhile: the
        answer "stop waiting" then comes before "wait canceled"."""
        self.sock.sendall(struct.pack("=B", _CANCEL_WAIT))
        _count()
        self.pending = None
        for _ in range(2):
            answer = self._read()
            if answer == _WAIT_CANCELED:
                return
            if answer != _STOP_WAITING:
                break
        raise WaitProtocolError("a store wait was not canceled")

    def _read(self) -> int:
        data = self.sock.recv(1)
        if not data:
            raise ConnectionResetError("the store server closed the connection")
        return data[0]

    def close(self) -> None:
        if self.pid == os.getpid():
            self.sock.close()
        else:
            self.sock.detach()  # a fork's copy: the fd number may be another's by now

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


_local = threading.local()
#: the connections of each store object (torch's ``TCPStore``), by thread: they close
#: when the store object goes (a thread waits on one store at a time)
_connections: weakref.WeakKeyDictionary[Any, dict[int, QuietWaiter]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
#: stores whose server answered the wait protocol wrongly: torch's wait serves them
_refused: weakref.WeakSet[Any] = weakref.WeakSet()


def _count() -> None:
    _local.sent = getattr(_local, "sent", 0) + 1


def requests_sent() -> int:
    """The wait and cancel requests this thread sent so far (store operations, as
    the server counts them; a chunk that leaves its request standing sends none)."""
    return getattr(_local, "sent", 0)


def _forget_after_fork() -> None:
    """A forked child must never use (or close) its parent's connections."""
    global _lock
    _lock = threading.Lock()
    for by_thread in list(_connections.values()):
        for waiter in by_thread.values():
            waiter.pid = -1  # closing it detaches the socket: the fd stays the parent's
        by_thread.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def wait(store: Any, name: str, seconds: float) -> bool | None:
    """Waits for the key ``name`` (full name on the server) of ``store`` (torch's
    ``TCPStore``) on this thread's connection to its server; ``None`` when that is
    not possible (no connection, a protocol failure): use torch's wait instead."""
    if store in _refused:
        return None
    thread = threading.get_ident()
    with _lock:
        by_thread = _connections.setdefault(store, {})
    for _ in range(2):  # a connection found dead (its server restarted) is replaced once
        waiter = by_thread.get(thread)
        fresh = waiter is None
        try:
            if waiter is None:
                waiter = by_thread[thread] = QuietWaiter(store.host, store.port)
            return waiter.wait(name, seconds)
        except WaitProtocolError as ex:
            _drop(by_thread, thread)
            _refused.add(store)
            log.info("store waits of %s:%s go through torch's client: %s", *_at(store), ex)
            return None
        except OSError:
            _drop(by_thread, thread)
            if fresh:
                return None
        except BaseException:
            _drop(by_thread, thread)  # interrupted (a signal's exception): state unknown
            raise
    return None


def _at(store: Any) -> tuple[str, int]:
    return store.host, store.port


def _drop(by_thread: dict[int, QuietWaiter], thread: int) -> None:
    dropped = by_thread.pop(thread, None)
    if dropped is not None:
        dropped.close()
