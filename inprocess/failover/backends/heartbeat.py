"""A node's liveness, seen by one observer without Ray: a TCP heartbeat link.

The node agent serves (:class:`HeartbeatServer`): a thread of its own accepts
connections and writes one byte to each every :data:`INTERVAL` seconds. The
controller connects (:class:`HeartbeatWatch`) and reads. The agent is lost when

* its connection ends (EOF or reset): the agent's process is gone, the kernel
  of its machine closed the socket (immediate: a killed process, a removed
  node), or
* nothing arrived for :data:`SILENCE` seconds, measured on the observer's own
  monotonic clock (a machine that vanished without closing its sockets).

Why a slow but live node is not lost: the heartbeat comes from a thread of
its own, not from the agent's Ray methods, so an agent busy in a long call
(or a Ray that is slow to deliver calls) still beats; only a process that is
dead, stopped, or starved of the CPU for :data:`SILENCE` seconds is silent.
No wall clocks of two machines are ever compared.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

#: seconds between two beats of an agent
INTERVAL = 0.2
#: seconds without a beat after which the observer declares the agent lost
SILENCE = 3.0


class HeartbeatServer:
    """Beats to every connected observer from a daemon thread (in the node agent).

    Invariant: only the thread touches the client sockets; :meth:`close` only
    sets the stop event and joins it.
    """

    def __init__(self, host: str, interval: float = INTERVAL) -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inprocess-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        clients: list[socket.socket] = []
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([self._listener], [], [], self._interval)
                if readable:
                    with contextlib.suppress(OSError):
                        conn, _ = self._listener.accept()
                        conn.setblocking(False)
                        clients.append(conn)
                for conn in list(clients):
                    try:
                        conn.send(b".")
                    except BlockingIOError:
                        pass  # the observer is slow to read: it still has bytes to see
                    except OSError:
                        clients.remove(conn)
                        conn.close()
        finally:
            for conn in clients:
                conn.close()
            self._listener.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class HeartbeatWatch:
    """The observer's side of one agent's link (controller thread only)."""

    def __init__(self, address: tuple[str, int], silence: float = SILENCE) -> None:
        self._sock = socket.create_connection(address, timeout=10)
        self._sock.setblocking(False)
        self._silence = silence
        self._last = time.monotonic()
        self.lost: str | None = None

    def fileno(self) -> int:
        return self._sock.fileno()

    def check(self) -> str | None:
        """Reads what arrived (never blocks); returns why the agent is lost, or None."""
        if self.lost is not None:
            return self.lost
        while True:
            try:
                data = self._sock.recv(4096)
            except BlockingIOError:
                break
            except OSError as ex:
                self.lost = f"its heartbeat connection failed ({ex})"
                return self.lost
            if not data:
                self.lost = "its heartbeat connection was closed (the agent's process is gone)"
                return self.lost
            self._last = time.monotonic()
        silent = time.monotonic() - self._last
        if silent > self._silence:
            self.lost = f"no heartbeat for {silent:.1f}s"
        return self.lost

    def close(self) -> None:
        self._sock.close()
