"""This process's TCP connections, and a safe way to shut one down.

Used to break connections that a blocked thread waits on (a gloo pair, a store
read during process group initialization). Two rules make it safe:

* a socket is identified by its inode, read from the fd's ``/proc`` link;
* an fd number is never acted on directly: gloo and the process close and reuse
  fds at any time. The fd is duplicated first and the duplicate's inode is
  compared with the socket's; every query and the ``shutdown`` go through the
  verified duplicate, which refers to the right socket whatever happens to the
  original fd.

Addresses come from ``getsockname``/``getpeername`` on the duplicate, for this
process's sockets only (reading ``/proc/net/tcp`` instead costs time in
proportion to every socket of the machine).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

Address = tuple[int, bytes, int]  # family, packed host, port


@dataclass(frozen=True)
class TcpConnection:
    """An established TCP connection of this process."""

    inode: int
    local: Address
    remote: Address


def socket_inodes() -> dict[int, int]:
    """Map socket inode -> fd for this process's open sockets."""
    result = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            result[int(target[8:-1])] = int(name)
    return result


@contextlib.contextmanager
def _verified(inode: int, fd: int) -> Iterator[socket.socket | None]:
    """A socket object on a duplicate of ``fd``, if ``fd`` still is socket ``inode``."""
    try:
        dup = os.dup(fd)
    except OSError:
        yield None  # already closed by its owner
        return
    sock = None
    try:
        if os.fstat(dup).st_ino == inode:
            sock = socket.socket(fileno=dup)
            yield sock
        else:
            yield None  # the fd was reused for something else
    finally:
        if sock is not None:
            sock.detach()
        os.close(dup)


def _tcp_sockets(inodes: dict[int, int] | None) -> Iterator[tuple[int, socket.socket]]:
    """``(inode, socket)`` for each TCP socket of this process (all when ``inodes`` is None).

    Each socket is a verified duplicate, valid only until the next one is
    yielded: callers must not close or keep it (the duplicate is closed here).
    """
    for inode, fd in (inodes if inodes is not None else socket_inodes()).items():
        with _verified(inode, fd) as sock:
            if sock is None or sock.type != socket.SOCK_STREAM:
                continue
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            yield inode, sock


def _address(family: int, raw: tuple) -> Address:
    return family, socket.inet_pton(family, raw[0].split("%")[0]), raw[1]


def tcp_connections(inodes: dict[int, int] | None = None) -> list[TcpConnection]:
    """Established TCP connections of this process (listening sockets excluded)."""
    found = []
    for inode, sock in _tcp_sockets(inodes):
        try:
            local = _address(sock.family, sock.getsockname())
            remote = _address(sock.family, sock.getpeername())
        except OSError:
            continue  # listening, or not connected
        found.append(TcpConnection(inode, local, remote))
    return found


def listening_sockets(inodes: dict[int, int] | None = None) -> dict[int, int]:
    """Map inode -> local port of this process's listening TCP sockets."""
    ports = {}
    for inode, sock in _tcp_sockets(inodes):
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                ports[inode] = sock.getsockname()[1]
        except OSError:
            continue
    return ports


def listening_addresses(inodes: dict[int, int] | None = None) -> dict[int, tuple[int, tuple]]:
    """Map inode -> (family, ``getsockname()``) of this process's listening TCP sockets."""
    found = {}
    for inode, sock in _tcp_sockets(inodes):
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found[inode] = (sock.family, sock.getsockname())
        except OSError:
            continue
    return found


def shutdown_connections(connections: list[TcpConnection]) -> int:
    """``shutdown(SHUT_RDWR)`` each connection still open; returns how many."""
    inodes = socket_inodes()
    count = 0
    for conn in connections:
        fd = inodes.get(conn.inode)
        if fd is None:
            continue
        with _verified(conn.inode, fd) as sock:
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            log.debug("shut down fd %d: %s", fd, conn)
            count += 1
    return count
