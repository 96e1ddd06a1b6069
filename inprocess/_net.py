"""A free TCP port, for the tests and benchmarks that start jobs on this machine.

One helper in the library rather than in ``tests/``: the benchmarks run as
scripts and must not import test modules, and both already import the
installed package. The library itself never picks ports this way (its
servers bind port 0 and publish what they got: see :mod:`inprocess.security`).
"""

from __future__ import annotations

import contextlib
import random
import socket

#: ports are handed out in aligned blocks of this many: a job that binds
#: ``MASTER_PORT + 1`` and ``+ 2`` (the usage guide's stores) never reaches
#: into the block of another job running at the same time
BLOCK = 4
#: the lowest port handed out
LOWEST = 10000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (source ports of client sockets)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(following: int = 0) -> int:
    """A loopback TCP port free now, and the ``following`` ports after it too.

    Chosen at random below the kernel's ephemeral range, so that no client
    socket's source port (gloo opens many) takes ``port + 1`` before a script
    binds it, and at the start of an aligned block of :data:`BLOCK` ports (or
    more for a larger ``following``), so that two jobs never overlap. Free now
    only: whoever binds it a moment later may find it taken, which tests and
    benchmarks accept.
    """
    if not isinstance(following, int) or following < 0:
        raise ValueError(f"following must be an int >= 0, got {following!r}")
    span = max(BLOCK, following + 1)
    high = min(_ephemeral_low(), 65536)
    if high - LOWEST < 64 * span:  # an unusual ephemeral range: take any block above it
        low, high = _ephemeral_low(), 65536
    else:
        low = LOWEST
    rng = random.Random()
    for _ in range(10000):
        port = rng.randrange(-(-low // span), high // span) * span
        try:
            with contextlib.ExitStack() as stack:
                for offset in range(span):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no block of {span} free ports in [{low}, {high})")
