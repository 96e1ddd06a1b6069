"""This process's TCP sockets, identified by inode, and a safe way to shut one down.

Used to break connections that a blocked thread waits on (a gloo pair, a store
read during process group initialization). Two rules make it safe:

* sockets are identified by their inode (from ``/proc``), never by address guesses;
* an fd number is never acted on directly: gloo and the process close and reuse
  fds at any time. The fd is duplicated first and the duplicate's inode is
  compared with the socket's; ``shutdown`` on the verified duplicate acts on the
  right socket whatever happened to the original fd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)

TCP_ESTABLISHED = "01"
TCP_LISTEN = "0A"


@dataclass(frozen=True)
class TcpSocket:
    inode: int
    local: tuple[int, bytes, int]  # family, address bytes, port
    remote: tuple[int, bytes, int]
    state: str


def _parse_proc_address(text: str, family: int) -> tuple[int, bytes, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # /proc prints each 32-bit word in host byte order.
    words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    if struct.pack("=I", 1) == struct.pack("<I", 1):
        words = [w[::-1] for w in words]
    return family, b"".join(words), int(port, 16)


def process_tcp_sockets() -> list[TcpSocket]:
    """TCP sockets of this network namespace, with their inodes."""
    sockets = []
    for path, family in (
        ("/proc/self/net/tcp", socket.AF_INET),
        ("/proc/self/net/tcp6", socket.AF_INET6),
    ):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            inode = int(fields[9])
            if inode == 0:
                continue
            sockets.append(
                TcpSocket(
                    inode=inode,
                    local=_parse_proc_address(fields[1], family),
                    remote=_parse_proc_address(fields[2], family),
                    state=fields[3],
                )
            )
    return sockets


def socket_fds() -> dict[int, int]:
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


def shutdown_socket(inode: int, fd: int) -> bool:
    """``shutdown(SHUT_RDWR)`` on the socket ``inode`` if ``fd`` still refers to it."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False  # already closed by its owner
    try:
        if os.fstat(dup).st_ino != inode:
            return False  # fd was reused for something else
        sock = socket.socket(fileno=dup)
        try:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            return True
        finally:
            sock.detach()
    finally:
        os.close(dup)


def shutdown_sockets(sockets: list[TcpSocket]) -> int:
    """Shuts down each socket still open in this process; returns how many."""
    fds = socket_fds()
    count = 0
    for sock in sockets:
        fd = fds.get(sock.inode)
        if fd is not None and shutdown_socket(sock.inode, fd):
            log.debug("shut down fd %d: %s", fd, sock)
            count += 1
    return count
