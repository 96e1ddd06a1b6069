"""A free TCP port, for the tests and benchmarks that start jobs on this machine.

One helper in the library rather than in ``tests/``: the benchmarks run as
scripts and must not import test modules, and both already import the
installed package. The library itself never picks ports this way (its
servers bind port 0 and publish what they got: see :mod:`inprocess.security`).
"""

from __future__ import annotations

import contextlib
import socket


def free_port(following: int = 0) -> int:
    """A loopback TCP port free now, and the ``following`` ports after it too.

    Free now only: whoever binds it a moment later may find it taken, which
    tests and benchmarks accept. ``following=2`` suits a script that also binds
    ``MASTER_PORT + 1`` (the usage guide's own store) and ``+ 2``.
    """
    if not isinstance(following, int) or following < 0:
        raise ValueError(f"following must be an int >= 0, got {following!r}")
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + following > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for offset in range(1, following + 1):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
