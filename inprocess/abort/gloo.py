"""Releasing threads blocked in gloo collectives.

A thread blocked in a gloo collective is not released by ``abort()``,
``shutdown()`` or ``destroy_process_group()`` from another thread (pytorch
issue 130345); it is released when the pair's TCP connection breaks. So we
break exactly those connections: ``shutdown(SHUT_RDWR)`` on the process group's
own established sockets. The blocked operation fails with "Connection closed by
peer" at once, locally and on every peer, and the group can then be destroyed.

Which sockets belong to a group is not guessed. Each gloo rank publishes its
listening address (a ``sockaddr``) in the group's store (``pg_map`` holds the
group's ``PrefixStore("<group>/", ...)``) under ``cpu//<device index>/<rank>``;
every pair connection of the group
has one of those addresses at one of its ends. A socket whose local or remote
address is a published listening address of the group is the group's, and no
other socket of the process can have such an address: the store's and the
user's sockets are never touched. The addresses are read on a store connection
of our own (see :func:`_gloo_address_blobs`), ahead of the abort where the
monitor thread could (see :func:`prefetch`): the restart then opens no connection.

Never touch the listening socket: gloo's accept loop treats an error there as
fatal and terminates the process (only established connections are listed).
The connections are shut down with the fd-reuse safe helpers of
:mod:`inprocess.abort.sockets`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from ..exception import TimeoutError as RestartTimeoutError
from ..native_calls import track
from ..timeouts import call_with_timeout
from .sockets import Address, TcpConnection, shutdown_connections, tcp_connections

log = logging.getLogger(__name__)


def _sockaddr_matches(blob: bytes, address: Address) -> bool:
    """Whether ``blob`` contains a ``sockaddr`` for ``address``."""
    family, host, port = address
    if family == socket.AF_INET6 and host[:12] == b"\x00" * 10 + b"\xff\xff":
        family, host = socket.AF_INET, host[12:]  # an IPv4-mapped IPv6 address
    if family == socket.AF_INET:
        return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + host in blob
    head = struct.pack("=H", socket.AF_INET6) + struct.pack("!H", port)
    start = blob.find(head)
    while start != -1:
        # sockaddr_in6: family, port, flowinfo (4 bytes), address (16 bytes), scope
        if blob[start + 8 : start + 24] == host:
            return True
        start = blob.find(head, start + 1)
    return False


#: the longest the store's server may take to accept a plain connection before
#: no client of our own is made (a dead server refuses at once)
CONNECT_TIMEOUT = 0.25

#: the longest the read on a client of our own may take (connecting included)
#: before the group's own client is read instead, at most half the read's timeout
OWN_CLIENT_WAIT = 0.5


def _server_address(store: Any) -> tuple[str, int] | None:
    """``(host, port)`` of the ``TCPStore`` under ``store``'s prefixes, or ``None``
    where the store is not over a ``TCPStore`` (no server to reach)."""
    import torch.distributed as dist

    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return base.host, base.port
    return None


def _own_client(store: Any, timeout: float) -> Any | None:
    """A client of ``store`` on a connection of its own, with every prefix of
    ``store`` kept (``Store.clone``); ``None`` where none can be made.

    A ``TCPStore`` client connecting to a server that is gone retries for the
    store's whole timeout (minutes), so the server is first asked to accept a
    plain connection within :data:`CONNECT_TIMEOUT`; the clone is made only
    where it did.
    """
    address = _server_address(store)
    if address is not None:
        try:
            socket.create_connection(address, timeout=CONNECT_TIMEOUT).close()
        except OSError as ex:
            # (the text only, here and below: an exception's frames hold the store)
            log.debug("the store server at %s:%d does not accept: %s", *address, str(ex))
            return None
    try:
        own = store.clone()  # a Python store cannot be cloned (RuntimeError)
    except Exception as ex:
        log.debug("no client of our own for the store %s: %s", type(store).__name__, str(ex))
        return None
    # every operation on it ends by then: a read left behind does not linger
    own.set_timeout(datetime.timedelta(seconds=timeout))
    return own


def _read_blobs(reader: Any, size: int, group_name: str) -> list[bytes]:
    """The address records of the ``size`` ranks of group ``group_name`` in the
    store ``reader`` (empty: none published yet)."""
    # The layout of torch 2.x; the group-name level is tried too in case a
    # version hands out the parent store.
    for layout in ("cpu//{device}/{rank}", f"{group_name}//cpu//{{device}}/{{rank}}"):
        blobs = []
        for device in range(16):
            keys = [layout.format(device=device, rank=rank) for rank in range(size)]
            if not reader.check(keys[:1]):
                break
            blobs += [bytes(reader.get(key)) for key in keys if reader.check([key])]
        if blobs:
            return blobs
    return []


def _gloo_address_blobs(
    pg: Any, store: Any, timeout: float, own_client: bool = True
) -> list[bytes]:
    """The address records gloo published for ``pg`` (read with a bounded wait).

    Read through a client of our own (:func:`_own_client`), closed right after:
    a ``TCPStore`` client runs one operation at a time, so a thread of the
    application blocked in a ``wait`` on the client the group was made with
    would hold a read there until its own timeout, and a read left behind
    (past our timeout) would stay queued on the application's client. Only
    where no client of our own can be made (a server that does not accept, a
    store that cannot be cloned), or ours has not answered within
    :data:`OWN_CLIENT_WAIT` (a slow connection: torch looks up the host name
    of either end of every new one), is the group's store read as it is; a
    dead server fails there at once. ``own_client=False``: our own attempt was
    made already (a read ahead that has not answered in time).
    """

    def read(reader: Any) -> list[bytes]:
        return _read_blobs(reader, pg.size(), pg.group_name)

    def read_on_own_client() -> list[bytes] | None:
        own = _own_client(store, timeout)
        if own is None:
            return None
        try:
            return read(own)
        finally:
            # Our connection closes here, with its last reference, whatever the
            # read did (a read we stopped waiting for too, once it ends).
            del own

    # Invariant: the group's client is read only once our own attempt has
    # answered that it cannot read or has run out of its time, so no thread of
    # ours waits on the application's client where a connection of ours serves.
    started = time.monotonic()
    own_wait = min(OWN_CLIENT_WAIT, timeout / 2)
    result: list[bytes] | None = None
    try:
        if own_client:
            result = call_with_timeout(read_on_own_client, own_wait, "inprocess-gloo-addresses")
    except RestartTimeoutError:
        log.debug("no answer on a client of our own within %.3gs", own_wait)
    except Exception as ex:  # the server went away after accepting
        log.debug("cannot read gloo addresses on a client of our own: %s", str(ex))
    try:
        if result is None:
            result = call_with_timeout(
                lambda: read(store),
                max(timeout - (time.monotonic() - started), 0.0),
                "inprocess-gloo-addresses",
            )
    except RestartTimeoutError:
        log.warning("reading gloo addresses of group %s timed out", pg.group_name)
        return []
    except Exception as ex:  # a dead store: nothing to match
        log.debug("cannot read gloo addresses of group %s: %s", pg.group_name, str(ex))
        return []
    if not result:
        log.warning(
            "no gloo addresses found for group %s: a blocked collective will only be "
            "released by its timeout",
            pg.group_name,
        )
    return result


def _is_gloo(pg: Any) -> bool:
    """Whether ``pg`` has a gloo backend for CPU tensors."""
    import torch

    try:
        backend = pg._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    return type(backend).__name__ == "ProcessGroupGloo"


def gloo_groups() -> Iterator[tuple[Any, Any]]:
    """(process group, its store) for every live process group with a gloo backend."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return
    for pg, (_backend, store) in list(c10d._world.pg_map.items()):
        if _is_gloo(pg):
            yield pg, store


# --------------------------------------------------------------------------- read ahead

#: the bound of one read ahead of a group's addresses (connecting included)
PREFETCH_TIMEOUT = 5.0
#: a group whose read ahead found nothing (not set up yet) or failed is tried
#: again after this long, the wait doubling up to PREFETCH_RETRY_MAX
PREFETCH_RETRY = 0.1
PREFETCH_RETRY_MAX = 10.0


@dataclasses.dataclass
class _Entry:
    """What is known ahead of an abort about one live process group."""

    #: the group itself, weakly: an entry never matches another group, not even
    #: one made after this one is destroyed, under the same name and at the same
    #: address (torch numbers default groups from 0 again)
    ref: weakref.ref
    name: str
    gloo: bool
    #: its address records (``None``: not read yet)
    blobs: list[bytes] | None = None
    retry_at: float = 0.0
    retry_wait: float = 0.0
    #: when the read-ahead thread began reading it (``None``: it is not reading it)
    reading_since: float | None = None

    def matches(self, pg: Any, name: str) -> bool:
        return self.ref() is pg and self.name == name


# Invariants (all enforced with _cache_lock):
# * _cache maps id(pg) to the entry of that live group; prefetch() (any
#   thread; the monitor thread in a Wrapper) adds entries and drops those of
#   groups no longer in torch's group map, and only the read-ahead thread
#   writes an entry's blobs, retry times and reading_since.
# * At most one read-ahead thread runs (_reader); prefetch() starts one only
#   when the previous one has ended.
# * The lock is never held over a store operation, a thread join or a call
#   into torch that may block: an abort reading the cache never waits on the
#   network through it (it may wait on _cache_changed, which releases it, for
#   a read in progress, bounded by its own deadline).
_cache: dict[int, _Entry] = {}
_cache_lock = threading.Lock()
#: notified (by the read-ahead thread) each time it has finished with a group
_cache_changed = threading.Condition(_cache_lock)
_reader: threading.Thread | None = None


def _cached_blobs(pg: Any) -> list[bytes] | None:
    """The address records read ahead for ``pg``; ``None`` where none were."""
    return _read_ahead_state(pg)[0]


def _read_ahead_state(pg: Any) -> tuple[list[bytes] | None, float | None]:
    """(the address records read ahead for ``pg`` or ``None``, when the read of
    them in progress began or ``None``)."""
    name = pg.group_name
    with _cache_lock:
        entry = _cache.get(id(pg))
        if entry is None or not entry.matches(pg, name):
            return None, None
        return entry.blobs, entry.reading_since


def prefetch() -> bool:
    """Starts reading the addresses of the gloo groups not read yet, in a daemon
    thread; returns whether it started one.

    Never blocks: without an initialized ``torch.distributed`` (not imported:
    never imported here) it returns at once; when every group is read, it only
    looks its groups up in the cache (no store operation, no thread). Each group
    is read on a client of its own (:func:`_own_client`), never on the group's:
    an application thread may be blocked on that one.
    """
    global _reader
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed import distributed_c10d as c10d

    groups = [(pg, store, pg.group_name) for pg, (_b, store) in list(c10d._world.pg_map.items())]
    now = time.monotonic()
    with _cache_lock:
        live = {id(pg) for pg, _store, _name in groups}
        for key in [k for k, e in _cache.items() if k not in live or e.ref() is None]:
            del _cache[key]
        if _reader is not None and _reader.is_alive():
            return False
        known = {id(pg): _cache.get(id(pg)) for pg, _store, _name in groups}
    due: list[tuple[_Entry, Any, int]] = []
    for pg, store, name in groups:
        entry = known[id(pg)]
        if entry is None or not entry.matches(pg, name):
            # a new group, looked at once (outside the lock: a call into torch)
            entry = _Entry(weakref.ref(pg), name, _is_gloo(pg))
            with _cache_lock:
                _cache[id(pg)] = entry
        # (read without the lock: no read-ahead thread runs now, and a stale
        # view costs one read more at most)
        if entry.gloo and entry.blobs is None and entry.retry_at <= now:
            due.append((entry, store, pg.size()))
    if not due:
        return False
    with _cache_lock:
        if _reader is not None and _reader.is_alive():
            return False
        # (tracked: a read that ends while the interpreter exits would abort it)
        _reader = track(
            threading.Thread(
                target=_read_ahead, args=(due,), name="inprocess-gloo-prefetch", daemon=True
            )
        )
        _reader.start()
    return True


def _read_on_own_client(store: Any, size: int, group_name: str, timeout: float) -> list[bytes]:
    """The group's address records read on a client of our own (empty: none can
    be made); the client's connection closes on return."""
    own = _own_client(store, timeout)
    return [] if own is None else _read_blobs(own, size, group_name)


def _read_ahead(due: list[tuple[_Entry, Any, int]]) -> None:
    """The read-ahead thread: reads each due group's addresses, records them."""
    for entry, store, size in due:
        blobs: list[bytes] = []
        with _cache_lock:
            entry.reading_since = time.monotonic()
        try:
            blobs = _read_on_own_client(store, size, entry.name, PREFETCH_TIMEOUT)
        except Exception as ex:  # (the text only: its frames hold our client)
            log.debug("cannot read ahead the addresses of group %s: %s", entry.name, str(ex))
        with _cache_changed:
            entry.reading_since = None
            _cache_changed.notify_all()
            if blobs:
                entry.blobs = blobs
            else:
                wait = max(entry.retry_wait * 2, PREFETCH_RETRY)
                entry.retry_wait = min(wait, PREFETCH_RETRY_MAX)
                entry.retry_at = time.monotonic() + entry.retry_wait
        if blobs:
            log.debug("read ahead %d gloo addresses of group %s", len(blobs), entry.name)


def _wait_while_read_ahead(pg: Any, timeout: float) -> list[bytes] | None:
    """Waits up to ``timeout`` while ``pg``'s addresses are being read ahead;
    returns them where they were read."""
    name = pg.group_name
    deadline = time.monotonic() + timeout
    with _cache_changed:
        while True:
            entry = _cache.get(id(pg))
            if entry is None or not entry.matches(pg, name):
                return None
            left = deadline - time.monotonic()
            if entry.reading_since is None or left <= 0:
                return entry.blobs
            _cache_changed.wait(left)


def _wait_for_read_ahead(timeout: float) -> None:
    """Waits up to ``timeout`` for a read ahead in progress to end."""
    with _cache_lock:
        reader = _reader
    if reader is not None and reader.is_alive() and reader is not threading.current_thread():
        reader.join(timeout)


def group_connections(
    groups: Iterable[tuple[Any, Any]], timeout: float = 2.0
) -> list[TcpConnection]:
    """Established connections of this process that belong to ``groups``.

    A group's addresses read ahead (:func:`prefetch`) are used as they are: no
    store connection is opened for it. A read ahead of a group still in
    progress stands for the abort's own attempt on a client of its own (it
    began earlier, and a second connection would be as slow): it gets what is
    left of that attempt's wait (:data:`OWN_CLIENT_WAIT`), then the group's
    client is read.
    The other groups are read as :func:`_gloo_address_blobs` says.
    """
    started = time.monotonic()
    own_wait = min(OWN_CLIENT_WAIT, timeout / 2)
    blobs: list[bytes] = []
    for pg, store in groups:
        cached, reading_since = _read_ahead_state(pg)
        if cached is None and reading_since is not None:
            wait = max(own_wait - (time.monotonic() - reading_since), 0.0)
            cached = _wait_while_read_ahead(pg, wait)
        if cached is None:
            left = max(timeout - (time.monotonic() - started), 0.0)
            cached = _gloo_address_blobs(pg, store, left, own_client=reading_since is None)
        blobs.extend(cached)
    if not blobs:
        return []
    return [
        conn
        for conn in tcp_connections()
        if any(_sockaddr_matches(b, conn.local) or _sockaddr_matches(b, conn.remote) for b in blobs)
    ]


def release_blocked_collectives(timeout: float = 2.0) -> int:
    """Breaks the connections of every gloo group of this process; returns how many."""
    groups = list(gloo_groups())
    if not groups:
        return 0
    released = shutdown_connections(group_connections(groups, timeout))
    log.debug("shut down %d gloo sockets of %d groups", released, len(groups))
    return released
