"""The node's arrival relay: a restart's rendezvous seen by the store per node, not per rank.

At a rendezvous (the termination and the iteration barrier of every restart)
each rank used to arrive, wait and read the decision on its own store client:
about five store operations per rank and barrier. With a relay, the ranks of a
node hand their arrivals to their node group's leader (:mod:`inprocess.node`)
over a local socket; the relay

* appends them to the store as one batch (one ``append`` of their sealed
  records, one ``add`` of their number) once every rank registered on the
  node arrived or :data:`BATCH_WINDOW` passed since the first;
* waits once for the node (one blocking ``wait`` on the call's next wake-up)
  and hands the published decision to each of its ranks;
* tells one of the batch's ranks to check for completion when its ``add``
  reached the number of participants (that rank reads the arrivals and
  decides, with the rank's own deciding code, as before), and one rank at a
  time to count the dead when the call's count of deaths changed.

So the central store sees each node once per barrier. The protocol's records
are the same as without a relay (first record of an identity stands, counters
only wake), so a rank may always also arrive on its own: it does when no relay
runs, and when the relay's process died after it handed over its arrival
(checked at the end of each wait chunk). A lost relay costs at most a chunk,
never a hang.

The group's directory is private to the user (mode 0700): what arrives on its
sockets comes from the job's own processes.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import protocol as P
from .procfs import process_start_time
from .waiting import WAIT_CHUNK_MAX, WakeWait

log = logging.getLogger(__name__)

#: the relay's socket and the file naming its process, in the group's directory
RELAY_SOCKET = "relay.sock"
RELAY_OWNER = "relay.pid"
#: a rank's socket for the relay's answers: ``<identity with '/' as '_'>.b``
_REPLY = ".b"
#: seconds a batch waits for the node's other ranks after its first arrival
BATCH_WINDOW = 0.01
#: larger answers are not sent: the rank reads the decision from the store
_MAX_DATAGRAM = 60_000
#: a wait with no deadline (the relay lives as long as its leader leads)
_FOREVER = datetime.timedelta(days=365)
#: separates a message's fields (never in a name, an identity, a value or JSON text)
_SEP = "\x1f"


def _reply_path(directory: str, identity: str) -> str:
    return os.path.join(directory, identity.replace("/", "_") + _REPLY)


def _owner() -> str:
    return f"{os.getpid()} {process_start_time(os.getpid())}"


# ----------------------------------------------------------------------------- rank side


class RelayClient:
    """A rank's end of its node's relay: hands over arrivals, receives the answers."""

    def __init__(self, directory: str, identity: str) -> None:
        self.directory = directory
        self.identity = identity
        self.path = _reply_path(directory, identity)
        self.relay_path = os.path.join(directory, RELAY_SOCKET)
        self.owner_path = os.path.join(directory, RELAY_OWNER)
        self.sock: socket.socket | None = None
        #: the relay process that took this rank's last arrival: (pid, start time)
        self.relay: tuple[int, float] | None = None
        #: a pidfd of that process (readable once it ended), ``None`` where unavailable
        self._relay_fd: int | None = None

    def _bind(self) -> socket.socket | None:
        if self.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                sock.bind(self.path)
            except OSError:  # no group directory (yet): no relay either
                sock.close()
                return None
            self.sock = sock
        return self.sock

    def _relay_process(self) -> tuple[int, float] | None:
        try:
            fd = os.open(self.owner_path, os.O_RDONLY)
        except OSError:
            return None
        try:
            pid, start = os.read(fd, 64).split()
            return int(pid), float(start)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def arrive(self, name: str, identity: str, value: str, participants: int) -> bool:
        """Hands an arrival at rendezvous ``name`` to the relay; whether one took it.

        The relay's process is read once, and again when it ended or the relay's
        socket stopped answering (another member leads now).
        """
        sock = self._bind()
        if sock is None:
            return False
        data = _SEP.join((name, identity, value, str(participants), self.path)).encode()
        sock.settimeout(1.0)
        for attempt in range(2):
            # Invariant: the arrival goes to the relay whose process is watched. A
            # relay that ended since the last arrival has a successor (or none):
            # read again, or its death would send this rank off at every barrier
            # while the successor holds its arrival.
            if self.relay is None or attempt or self._relay_ended():
                self._watch(self._relay_process())
                if self.relay is None:
                    return False
            try:
                sock.sendto(data, self.relay_path)
                return True
            except OSError:
                continue
        return False

    def receive(self, name: str, timeout: float) -> tuple[str, str] | None:
        """The relay's next answer about rendezvous ``name``: ``(kind, data)``; ``None``
        when none came within ``timeout``. Kinds: ``decision`` (data: the published
        text), ``fetch`` (read it from the store), ``check`` (this rank's batch
        reached the number of participants), ``dead`` (data: the count of deaths
        to count them at), ``direct`` (the relay stops: arrive on your own).
        Answers about other rendezvous (an earlier one's, left unread) are skipped."""
        sock = self.sock
        if sock is None:
            return None
        deadline = time.monotonic() + timeout
        # poll, not select: a process may hold more than 1024 descriptors
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        if self._relay_fd is not None:
            poller.register(self._relay_fd, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            # The relay's death ends the wait at once (its pidfd turns readable):
            # the caller sees no answer, finds the relay gone and arrives on its
            # own, instead of waiting out the chunk (seconds per barrier).
            ready = {fd for fd, _ in poller.poll(max(1, math.ceil(left * 1000)))}
            if sock.fileno() not in ready:
                if ready or time.monotonic() >= deadline:
                    return None
                continue
            sock.settimeout(0)
            try:
                data = sock.recv(_MAX_DATAGRAM)
            except (TimeoutError, BlockingIOError, InterruptedError):
                continue
            kind, about, text = ([*data.decode(errors="replace").split(_SEP, 2), "", ""])[:3]
            if about == name:
                return kind, text

    def relay_alive(self) -> bool:
        """Whether the process of the relay that took the last arrival still runs."""
        return self.relay is not None and process_start_time(self.relay[0]) == self.relay[1]

    def _relay_ended(self) -> bool:
        """Whether the watched relay's process ended (never waits)."""
        if self._relay_fd is None:
            return not self.relay_alive()
        poller = select.poll()
        poller.register(self._relay_fd, select.POLLIN)
        return bool(poller.poll(0))

    def _watch(self, relay: tuple[int, float] | None) -> None:
        """Takes ``relay`` as the relay's process, with a pidfd of it where the
        kernel has them. Opened before its start time is compared: the pidfd
        then names that very process, never one that reused its pid."""
        if relay == self.relay and (relay is None or self._relay_fd is not None):
            return
        self._unwatch()
        self.relay = relay
        if relay is None or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(relay[0])
        except OSError:  # gone already (or no pidfds): relay_alive() says so
            return
        if process_start_time(relay[0]) != relay[1]:
            os.close(fd)
            return
        self._relay_fd = fd

    def _unwatch(self) -> None:
        fd, self._relay_fd = self._relay_fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        self._unwatch()
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


# ----------------------------------------------------------------------------- relay side


@dataclass
class _Arrival:
    identity: str
    value: str
    reply: str


@dataclass
class _Rendezvous:
    """One rendezvous as the relay sees it."""

    participants: int
    expected: int  # ranks registered on the node when its first arrival came
    pending: list[_Arrival] = field(default_factory=list)
    first: float = 0.0
    handed: list[_Arrival] = field(default_factory=list)
    deaths_seen: int = -1
    turn: int = 0  # whose turn it is to count the dead


class NodeRelay:
    """The relay of a node group (see the module docstring), run by its leader.

    ``connect()`` gives a new store client of the call's namespace; the relay
    takes two (one blocks in waits), or one given ``append_store`` (a client to
    append batches with, which may be shared). ``expected()`` is the number of
    ranks on the node (default: the registrations in ``directory``).
    """

    def __init__(
        self,
        directory: str,
        connect: Callable[[], Any],
        expected: Callable[[], int] | None = None,
        pause: float = 0.01,
        append_store: Any | None = None,
    ) -> None:
        self.directory = directory
        self.append_store = append_store
        self.connect = connect
        self.expected = expected or self._registered
        self.pause = pause
        self.path = os.path.join(directory, RELAY_SOCKET)
        self.owner = _owner()
        self.sock: socket.socket | None = None  # the relay's socket (bound by start)
        self.out: socket.socket | None = None  # what it answers through
        #: Invariant: a rendezvous is entered in ``waiting`` (under ``cond``) before
        #: its batch's arrivals reach the store, so a decision (which needs them)
        #: is published only after the waiter can see it: its next look finds it.
        self.cond = threading.Condition()
        self.waiting: dict[str, _Rendezvous] = {}
        self.decided: dict[str, str] = {}  # recent decisions, for late local arrivals
        self.stopped = False
        self.threads: list[threading.Thread] = []
        #: arrivals handed to the store, and in how many batches (for tests and benchmarks)
        self.relayed = 0
        self.batches = 0

    def _registered(self) -> int:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return 0
        return sum(n.startswith("r.") and not n.endswith(".tmp") for n in names)

    def start(self) -> None:
        """Binds the relay's socket, names this process its owner, starts its threads.

        Raises:
            OSError: the group's directory cannot take them (nothing is left open).
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            sock.bind(self.path)
            out.setblocking(False)
            temporary = os.path.join(self.directory, f"{RELAY_OWNER}.{os.getpid()}.tmp")
            with open(temporary, "w") as f:
                f.write(self.owner)
            os.replace(temporary, os.path.join(self.directory, RELAY_OWNER))
        except OSError:
            sock.close()
            out.close()
            raise
        self.sock, self.out = sock, out
        log.info("relaying the arrivals of node group %s", os.path.basename(self.directory))
        for target, name in ((self._receive, "relay-receive"), (self._wait, "relay-wait")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self.threads.append(thread)

    def stop(self, wait: bool = True) -> None:
        """Stops the threads (``wait``: joins them; the waiter may be in a wait chunk);
        ranks still waiting are told to arrive on their own."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self.threads if wait else ():
            thread.join(timeout=WAIT_CHUNK_MAX + 5.0)
        if sock is not None:
            self._send_off_queued(sock)
            sock.close()
        owner = os.path.join(self.directory, RELAY_OWNER)
        with contextlib.suppress(OSError):
            with open(owner) as f:
                ours = f.read() == self.owner
            if ours:
                os.unlink(owner)
                os.unlink(self.path)
        with self.cond:
            left = list(self.waiting.items())
            self.waiting.clear()
        for name, rendezvous in left:
            self._tell(rendezvous.handed + rendezvous.pending, "direct", name)
        if self.out is not None:
            self.out.close()

    def _send_off_queued(self, sock: socket.socket) -> None:
        """Arrivals still queued on the relay's socket, which no thread will take now:
        their ranks are told to arrive on their own (closing the socket would drop
        them, and each rank would wait a chunk to notice). A socket shut down still
        hands over what was queued before; new senders get an error and go direct."""
        sock.setblocking(False)
        while True:
            try:
                data = sock.recv(_MAX_DATAGRAM)
            except OSError:
                return
            if not data:
                return
            fields = data.decode(errors="replace").split(_SEP)
            if len(fields) == 5:
                name, identity, value, _, reply = fields
                self._tell([_Arrival(identity, value, reply)], "direct", name)

    def _tell(self, arrivals: list[_Arrival], kind: str, name: str, text: str = "") -> None:
        data = _SEP.join((kind, name, text)).encode()
        if len(data) > _MAX_DATAGRAM:
            data = _SEP.join(("fetch", name, "")).encode()
        out = self.out
        if out is None:
            return
        for arrival in arrivals:
            # A rank must get what it is told: a full queue is waited out a while
            # (a task: check, count the dead, arrive on your own), or shortly (a
            # decision: a rank that misses it reads it from the store, late, once
            # its wait chunks grew; see StoreMixin._relayed).
            tries = 20 if kind == "decision" else 200
            for _ in range(tries):
                try:
                    out.sendto(data, arrival.reply)
                    break
                except BlockingIOError:
                    time.sleep(0.005)
                except OSError as ex:
                    # gone (its rank's process exited)
                    if ex.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                        log.debug("cannot answer %s: %s", arrival.identity, ex)
                    break

    # ------------------------------------------------------------------ arrivals

    def _receive(self) -> None:
        """Takes arrivals; appends each rendezvous' batch once complete or due."""
        store = self.append_store
        sock = self.sock
        assert sock is not None
        while not self.stopped:
            with self.cond:
                due = [r.first + BATCH_WINDOW for r in self.waiting.values() if r.pending]
            sock.settimeout(max(0.0, min(due) - time.monotonic()) if due else 1.0)
            message = None
            try:
                data = sock.recv(_MAX_DATAGRAM)
                if not data:
                    return  # shut down by stop()
                message = data.decode(errors="replace").split(_SEP)
            except (TimeoutError, BlockingIOError):
                pass
            except OSError as ex:
                if self.stopped:
                    return
                log.debug("relay: cannot receive: %s", ex)
                time.sleep(self.pause)
            if message is not None:
                try:
                    self._take(message)  # taken first: a store down gives it back (_give_up)
                except Exception as ex:  # (the arrival then ends in the barrier's timeout)
                    log.warning("relay: cannot take an arrival: %s", ex)
            try:
                if store is None:
                    store = self.connect()
                now = time.monotonic()
                with self.cond:
                    current = list(self.waiting.items())
                for name, rendezvous in current:
                    if rendezvous.pending and (
                        len(rendezvous.pending) + len(rendezvous.handed) >= rendezvous.expected
                        or now >= rendezvous.first + BATCH_WINDOW
                    ):
                        self._flush(store, name, rendezvous)
            except Exception as ex:
                log.warning("relay: the store is unavailable (%s); ranks arrive on their own", ex)
                store = None
                self._give_up()
                time.sleep(self.pause)

    def _take(self, message: list[str]) -> None:
        try:
            name, identity, value, participants, reply = message
            arrival, participants = _Arrival(identity, value, reply), int(participants)
        except ValueError:
            log.debug("relay: ignored a malformed arrival")
            return
        decided = self.decided.get(name)
        if decided is not None:  # a late local arrival: the answer is known
            self._tell([arrival], "decision", name, decided)
            return
        with self.cond:
            rendezvous = self.waiting.get(name)
            if rendezvous is None:
                rendezvous = _Rendezvous(participants, self.expected())
                self.waiting[name] = rendezvous
                self.cond.notify_all()
            if not rendezvous.pending:
                rendezvous.first = time.monotonic()
            rendezvous.pending.append(arrival)

    def _flush(self, store: Any, name: str, rendezvous: _Rendezvous) -> None:
        """One batched arrival: the records, then the count (as a rank arrives)."""
        batch, rendezvous.pending = rendezvous.pending, []
        with self.cond:
            rendezvous.handed += batch
            self.cond.notify_all()
        store.add_entries(P.arrivals_key(name), [f"{a.identity}={a.value}" for a in batch])
        count = int(store.add(P.count_key(name), len(batch)))
        self.relayed += len(batch)
        self.batches += 1
        log.info("relayed %d arrivals at %s (count %d)", len(batch), name, count)
        if count >= rendezvous.participants:
            # the batch that completed the count: one of its ranks checks and decides
            self._tell(batch[-1:], "check", name)

    def _give_up(self) -> None:
        """Without the store, every rank waiting here arrives on its own."""
        with self.cond:
            left = list(self.waiting.items())
            self.waiting.clear()
        for name, rendezvous in left:
            self._tell(rendezvous.handed + rendezvous.pending, "direct", name)

    # ------------------------------------------------------------------ answers

    def _wait(self) -> None:
        """Waits for the node: one wait on the call's next wake-up for every rendezvous
        handed to the store (:class:`~inprocess.waiting.WakeWait`, as a rank waits);
        hands out the decisions and the deaths to count."""
        store = None
        waiter: WakeWait | None = None
        while True:
            with self.cond:
                while not self.stopped and not self._handed():
                    waiter = None  # nothing to wait for: the next look reads afresh
                    self.cond.wait()
                if self.stopped:
                    return
            try:
                if store is None:
                    store = self.connect()
                if waiter is None:
                    # Invariant (WakeWait's): the wake-up sequence is read before the
                    # look at the decisions, and the wait is on the next wake-up.
                    waiter = WakeWait(store, _FOREVER, self.pause)
                    deaths = waiter.deaths
                else:
                    deaths = waiter.read_deaths()
                if self._look(store, deaths):
                    waiter.idle = False
                with self.cond:
                    if self.stopped or not self._handed():
                        continue
                waiter.wait()  # pauses first after a wake-up that brought nothing
            except Exception as ex:
                if self.stopped:
                    return
                log.warning("relay: the store is unavailable (%s); ranks arrive on their own", ex)
                store, waiter = None, None
                self._give_up()
                time.sleep(self.pause)

    def _handed(self) -> list[tuple[str, _Rendezvous]]:
        return [(n, r) for n, r in self.waiting.items() if r.handed]

    def _look(self, store: Any, deaths: int) -> bool:
        """One look at the rendezvous handed to the store; whether it found news (a
        decision handed out, a count of the dead asked for)."""
        news = False
        with self.cond:
            handed = self._handed()
        for name, rendezvous in handed:
            published = P.first_or_none(store.entries(P.done_key(name)))
            if published is not None:
                news = True
                with self.cond:
                    self.waiting.pop(name, None)
                    self.decided[name] = published
                    while len(self.decided) > 16:
                        del self.decided[next(iter(self.decided))]
                self._tell(rendezvous.handed, "decision", name, published)
                continue
            if deaths and deaths != rendezvous.deaths_seen:
                # One rank counts (once-keys make a second count harmless); the
                # next in turn at the next death, so one that died meanwhile holds
                # nothing up.
                news = True
                rendezvous.deaths_seen = deaths
                arrival = rendezvous.handed[rendezvous.turn % len(rendezvous.handed)]
                rendezvous.turn += 1
                self._tell([arrival], "dead", name, str(deaths))
        return news
