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
user's sockets are never touched.

Never touch the listening socket: gloo's accept loop treats an error there as
fatal and terminates the process (only established connections are listed).
The connections are shut down with the fd-reuse safe helpers of
:mod:`inprocess.abort.sockets`.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Iterable, Iterator
from typing import Any

from ..exception import TimeoutError as RestartTimeoutError
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


def _gloo_address_blobs(pg: Any, store: Any, timeout: float) -> list[bytes]:
    """The address records gloo published for ``pg`` (read with a bounded wait)."""

    def read() -> list[bytes]:
        size = pg.size()
        # The layout of torch 2.x; the group-name level is tried too in case a
        # version hands out the parent store.
        for layout in ("cpu//{device}/{rank}", f"{pg.group_name}//cpu//{{device}}/{{rank}}"):
            blobs = []
            for device in range(16):
                keys = [layout.format(device=device, rank=rank) for rank in range(size)]
                if not store.check(keys[:1]):
                    break
                blobs += [bytes(store.get(key)) for key in keys if store.check([key])]
            if blobs:
                return blobs
        return []

    try:
        result = call_with_timeout(read, timeout, "inprocess-gloo-addresses")
    except RestartTimeoutError:
        log.warning("reading gloo addresses of group %s timed out", pg.group_name)
        return []
    except Exception as ex:  # a dead store: nothing to match
        log.debug("cannot read gloo addresses of group %s: %s", pg.group_name, ex)
        return []
    if not result:
        log.warning(
            "no gloo addresses found for group %s: a blocked collective will only be "
            "released by its timeout",
            pg.group_name,
        )
    return result


def gloo_groups() -> Iterator[tuple[Any, Any]]:
    """(process group, its store) for every live process group with a gloo backend."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return
    for pg, (_backend, store) in list(c10d._world.pg_map.items()):
        try:
            backend = pg._get_backend(torch.device("cpu"))
        except RuntimeError:
            continue
        if type(backend).__name__ == "ProcessGroupGloo":
            yield pg, store


def group_connections(
    groups: Iterable[tuple[Any, Any]], timeout: float = 2.0
) -> list[TcpConnection]:
    """Established connections of this process that belong to ``groups``."""
    blobs: list[bytes] = []
    for pg, store in groups:
        blobs.extend(_gloo_address_blobs(pg, store, timeout))
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
