"""The node group: the ranks of one node share one store client for their liveness.

Every monitor process of a Wrapper call joins its node's group: a private
directory (:func:`group_dir`: per user, call, store and node) holding a lock
file, one registration file per rank (its identity, its pid and its monitor's
pid, the ring peers it watches) and one datagram socket per monitor process.
The monitor process that holds the lock is the node's *leader*; ``flock`` is
released by the kernel when its holder dies, so the next monitor in line takes
over at once. The leader

* beats for the node: one sealed record per ``heartbeat_interval`` naming the
  node's ranks, where each rank used to beat a key of its own;
* watches the nodes that host its ranks' ring peers (a peer on this node needs
  no store read), one read per peer node per period, and declares every rank
  of a node whose beat stopped for ``heartbeat_timeout`` terminated;
* watches the node's ranks through pidfds: a rank that died with its monitor
  process (nobody left to report it) is declared at once;
* runs the node's one fault watch, and hands each fault count to every member
  over its socket (the member writes it on its rank's board);
* relays the node's arrivals at a restart's rendezvous (:mod:`inprocess.relay`).

So with no fault the central store sees, per node and ``heartbeat_interval``,
one beat and about one read, and the fault watch's two operations per chunk.

Where a monitor process of a node that is healthy stops (``SIGSTOP``) while it
leads, the node's beats stop with it and its ranks are declared lost: the
group trusts its leader's process as a node trusts its kernel.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import protocol as P
from .procfs import process_start_time
from .relay import NodeRelay
from .userdir import user_dir

log = logging.getLogger(__name__)

#: environment variable naming the node a rank runs on (default: the host name);
#: a launcher that runs several simulated nodes on one host sets it per rank
NODE_ENV = "INPROCESS_NODE"
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_LOCK = "lock"
_MEMBER = "r."  # registration files: r.<identity with '/' as '_'>
_SOCKET = ".s"  # sockets: <identity with '/' as '_'>.s
#: Unix socket paths longer than this do not fit ``sockaddr_un``
_MAX_SOCKET_PATH = 100


def node_name() -> str:
    """The name of the node this process runs on: ``$INPROCESS_NODE`` or the host name."""
    explicit = os.environ.get(NODE_ENV)
    if explicit is not None:
        if not _NODE_NAME.fullmatch(explicit):
            raise ValueError(
                f"{NODE_ENV} must be 1 to 64 characters of letters, digits, '.', '_' or '-' "
                f"starting with a letter or digit, got {explicit!r}"
            )
        return explicit
    host = socket.gethostname()
    if _NODE_NAME.fullmatch(host):
        return host
    return "h" + hashlib.blake2b(host.encode(), digest_size=8).hexdigest()


def store_address(store: Any) -> str | None:
    """Where ``store`` lives (``tcp://host:port``, ``file://path``), under its prefixes;
    ``None`` for a store type this cannot tell apart from another."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return f"tcp://{store.host}:{store.port}"
    if isinstance(store, dist.FileStore):
        return f"file://{os.path.abspath(store.path)}"
    return None


def group_dir(namespace: str, node: str, address: str) -> str:
    """The node group's directory of call ``namespace`` on store ``address``.

    Two jobs on one host share a group only if they share the store and the
    call namespace, that is, if they are one job.
    """
    # this user's private directory, found alike by every process of the job
    root = user_dir()
    if len(root) + 40 > _MAX_SOCKET_PATH:
        root = user_dir("/tmp")  # a long TMPDIR: sockets must fit
    # the root is in the digest: the name a group beats under (group_of) is its own
    digest = hashlib.blake2b(f"{root}\0{address}\0{namespace}\0{node}".encode(), digest_size=8)
    return os.path.join(root, digest.hexdigest())


def group_of(namespace: str, node: str, store: Any) -> tuple[str, str]:
    """The node group of a rank of call ``namespace`` on ``node`` using ``store``: its
    directory, and the name it beats under (``<node>.<group digest>``).

    The name is the group's own, so two groups of one node (ranks with another
    temporary directory) beat apart and each is watched; on a store this cannot
    tell apart from another, each rank is a group of its own.
    """
    address = store_address(store)
    if address is None:
        address = f"pid:{os.getpid()}"
    directory = group_dir(namespace, node, address)
    return directory, f"{node}.{os.path.basename(directory)[:8]}"


def _private_dir(path: str) -> None:
    """Creates ``path`` (and its parent) readable by this user only, or checks it is."""
    for directory in (os.path.dirname(path), path):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        info = os.lstat(directory)
        if info.st_uid != os.getuid() or info.st_mode & 0o077 or not os.path.isdir(directory):
            raise PermissionError(
                f"{directory} must be a directory of user {os.getuid()} that only it can use"
            )


@dataclass
class Registration:
    """A rank's registration file: who it is and which processes stand for it."""

    identity: str
    rank_pid: int
    rank_start: float  # (with the pid, one process: see process_start_time)
    monitor_pid: int
    peers: list[str] = field(default_factory=list)

    def encode(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def parse(cls, text: str) -> Registration | None:
        try:
            data = json.loads(text)
            found = cls(
                identity=str(data["identity"]),
                rank_pid=int(data["rank_pid"]),
                rank_start=float(data["rank_start"]),
                monitor_pid=int(data["monitor_pid"]),
                peers=[str(p) for p in data["peers"]],
            )
        except (ValueError, KeyError, TypeError):
            return None
        if not P.valid_identity(found.identity) or not all(map(P.valid_identity, found.peers)):
            return None
        return found


def _member_file(identity: str) -> str:
    return _MEMBER + identity.replace("/", "_")


def registrations(directory: str) -> list[Registration]:
    """The well-formed registrations in a group's directory."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        if not name.startswith(_MEMBER) or name.endswith(".tmp"):
            continue
        with contextlib.suppress(OSError):
            with open(os.path.join(directory, name)) as f:
                registration = Registration.parse(f.read())
            if registration is not None:
                found.append(registration)
    return found


def beat_for(store: Any, node: str, directory: str) -> int:
    """Beats once for ``node``, naming the ranks registered in ``directory``.

    The leader's beat; also the rank's own while its monitor process restarts
    (with no leader on the node, nobody else beats for it).
    """
    return store.send_node_heartbeat(node, sorted(r.identity for r in registrations(directory)))


class NodeMember:
    """A monitor process's place in its node group: its registration and socket."""

    def __init__(self, directory: str, identity: str, rank_pid: int) -> None:
        self.directory = directory
        self.identity = identity
        self.rank_pid = rank_pid
        self.path = os.path.join(directory, _member_file(identity))
        self.socket_path = os.path.join(directory, identity.replace("/", "_") + _SOCKET)
        self.peers: list[str] = []
        self.sock: socket.socket | None = None

    def join(self) -> None:
        """Creates the group's directory if needed, binds the socket, registers.

        The socket is bound before the registration is written: a leader that
        finds the registration can reach the member.
        """
        start = process_start_time(self.rank_pid)
        if start is None:
            raise ProcessLookupError(self.rank_pid)
        self.rank_start = start
        for attempt in range(3):
            _private_dir(self.directory)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)  # the rank's monitor process's before this one
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                self.sock.bind(self.socket_path)
                self._write()
                return
            except FileNotFoundError:
                # the directory was swept as stale between its creation and now (see
                # sweep_stale_groups: it holds no live rank until this one registers)
                self.sock.close()
                if attempt == 2:
                    raise

    def set_peers(self, peers: Sequence[str]) -> None:
        """Tells the leader which ring peers this rank watches now."""
        if list(peers) != self.peers:
            self.peers = list(peers)
            self._write()

    def _write(self) -> None:
        registration = Registration(
            self.identity, self.rank_pid, self.rank_start, os.getpid(), self.peers
        )
        # replaced whole (rename): a leader never reads half a file
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            f.write(registration.encode())
        os.replace(temporary, self.path)

    def receive(self, timeout: float | None = None) -> int | bool | None:
        """The next fault count the leader sends: an ``int``; ``None`` when the
        leader's fault watch cannot reach the store; ``False`` when nothing came
        within ``timeout``.

        Raises:
            OSError: the member left (:meth:`leave`).
        """
        sock = self.sock
        if sock is None:
            raise OSError("the member left its node group")
        sock.settimeout(timeout)
        try:
            data = sock.recv(64)
        except TimeoutError:
            return False
        if not data:  # shut down by leave()
            raise OSError("the member left its node group")
        if data == b"-":
            return None
        try:
            return int(data)
        except ValueError:
            return False

    def leave(self, finished: bool, lock_fd: int | None = None) -> None:
        """Deregisters (a rank finished or reported only: the leader reports one that
        was not) and removes the group's directory when nobody is left in it
        (``lock_fd``: the group's lock, when this process led it)."""
        if finished:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        sock, self.sock = self.sock, None
        if sock is not None:
            # Invariant: a thread blocked in receive() is woken by the shutdown (its
            # recv returns no data: it raises and never touches the socket again)
            # before the descriptor is closed, so it never reads a number reused.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        remove_if_empty(self.directory, lock_fd)


def remove_if_empty(directory: str, lock_fd: int | None = None) -> None:
    """Removes a group's directory once no rank is registered in it.

    Only under the group's lock (``lock_fd``: the caller's, as the leader; else
    taken here if free): while another process leads, that leader removes it
    when it leaves. A process that opened the lock file just before it was
    removed sees it locked a removed file and starts over (:func:`_try_leadership`).
    """
    fd = lock_fd if lock_fd is not None else _try_leadership(directory)
    if fd is None:
        return
    try:
        if any(n.startswith(_MEMBER) and not n.endswith(".tmp") for n in os.listdir(directory)):
            return
        _remove_group(directory)
    finally:
        os.close(fd)


def _remove_group(directory: str) -> bool:
    """Removes a group's directory and what is in it (its lock held); whether it did."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return False
    for name in names:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(os.path.join(directory, name))
    try:
        os.rmdir(directory)
    except OSError:
        return False
    return True


#: seconds a node's fault watch pauses after a fault it published before it looks
#: again: the faults of a burst (a death, then each peer's) are read together,
#: and a fault that follows a burst (a replacement's join request) is heard this
#: soon, whatever the monitor interval (see StoreMixin.watch_faults)
FAULT_BURST_PAUSE = 0.1
#: seconds a group's directory must be left unchanged before another group's leader
#: may sweep it (a fresh one is being joined)
STALE_AFTER = 60.0
_GROUP_NAME = re.compile(r"[0-9a-f]{16}")


def sweep_stale_groups(root: str, keep: str) -> int:
    """Removes the group directories under ``root`` that nobody can use again: unchanged
    for :data:`STALE_AFTER`, their lock free, and none of their ranks' processes alive
    (a job killed whole leaves them). Returns how many it removed.

    Safe against a live group: one with a live rank or a leader is kept, and a
    group whose ranks are all gone has nobody left to report them (their
    peers' nodes do). A member joining one being swept starts over
    (:meth:`NodeMember.join`).
    """
    removed = 0
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 0
    now = time.time()
    for name in names:
        directory = os.path.join(root, name)
        if directory == keep or not _GROUP_NAME.fullmatch(name):
            continue
        try:
            if now - os.lstat(directory).st_mtime < STALE_AFTER:
                continue
        except FileNotFoundError:
            continue
        alive = any(
            process_start_time(r.rank_pid) == r.rank_start
            or process_start_time(r.monitor_pid) is not None
            for r in registrations(directory)
        )
        if alive:
            continue
        fd = _try_leadership(directory)
        if fd is None:
            continue
        try:
            removed += _remove_group(directory)
        finally:
            os.close(fd)
    return removed


def _try_leadership(directory: str) -> int | None:
    """The group's lock file's descriptor, locked by this call; ``None`` while another
    holds it (or when the directory is gone).

    ``flock`` is released by the kernel when its holder dies. The lock file may
    be removed (the group emptied) between its open and its lock: then the
    lock is on a file nobody else will open, and it counts as not taken.
    """
    path = os.path.join(directory, _LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino == os.stat(path).st_ino:
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None


@dataclass
class _Watched:
    """A local rank the leader watches: pidfds of the rank and of its monitor."""

    registration: Registration
    rank_fd: int
    monitor_fd: int | None

    def close(self) -> None:
        for fd in (self.rank_fd, self.monitor_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _open_pidfd(pid: int, start: float | None = None) -> int | None:
    """A pidfd of ``pid`` (of the process started at ``start`` if given); ``None``: gone."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return None
    if start is not None and process_start_time(pid) != start:
        os.close(fd)  # the pid names another process now
        return None
    return fd


def _exited(fd: int | None) -> bool:
    if fd is None:
        return True
    return bool(select.select([fd], [], [], 0)[0])


@dataclass
class _NodeSeen:
    """What a leader last saw of a peer node: its stamp, when, and its ranks."""

    stamp: int
    at: float
    identities: set[str]


class NodeLeader:
    """The duties of the node's leader (see the module docstring), in a monitor process.

    :meth:`run` waits until this process holds the group's lock, then leads
    until :meth:`stop` (the member leaving) or the process's exit, which hands
    the lock to the next member. ``connect()`` gives a new store client (a
    thread's own: the fault watch blocks its client).
    """

    def __init__(
        self,
        directory: str,
        node: str,
        connect: Callable[[], Any],
        heartbeat_interval: float,
        heartbeat_timeout: float,
        interval: float,
        fault_chunk: float,
    ) -> None:
        self.directory = directory
        self.node = node
        self.connect = connect
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.interval = interval
        self.fault_chunk = fault_chunk
        # As before per rank: a check period plus a beat period stays under the
        # timeout, so a live node's newest stamp is always seen in time.
        beat, timeout = heartbeat_interval, heartbeat_timeout
        self.watch_period = max(interval, min(beat, (timeout - beat) / 2))
        self.watched: dict[str, _Watched] = {}
        self.node_of: dict[str, str] = {}
        self.nodes_seen: dict[str, _NodeSeen] = {}
        self.unplaced: set[str] = set()  # peers whose placement cannot be read
        self.declared: set[str] = set()
        #: registrations found with their processes already gone, for reap
        self.unseen: dict[str, Registration] = {}
        self.leading = threading.Event()
        #: guards ``fd`` and ``stopped``: a member that leaves takes the lock file's
        #: descriptor from here, and no leadership is taken after it did
        self._lock = threading.Lock()
        self.fd: int | None = None
        self.stopped = False
        self.fault_watch: threading.Thread | None = None
        self.relay: NodeRelay | None = None

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Takes the lead once the lock is free (tried every ``interval``), then leads
        until :meth:`stop`."""
        while True:
            with self._lock:
                if self.stopped:
                    return
                self.fd = _try_leadership(self.directory)
                if self.fd is not None:
                    break
            time.sleep(self.interval)
        self.leading.set()
        log.info("leading node %s's group", self.node)
        try:
            swept = sweep_stale_groups(os.path.dirname(self.directory), self.directory)
            if swept:
                log.info("removed %d stale node group directories", swept)
        except OSError as ex:
            log.debug("cannot sweep stale node groups: %s", ex)
        self.fault_watch = threading.Thread(
            target=self._watch_faults, name="node-fault-watch", daemon=True
        )
        self.fault_watch.start()
        # the node's restarts' arrivals (inprocess.relay)
        relay: NodeRelay | None = NodeRelay(self.directory, self.connect)
        try:
            relay.start()
        except OSError as ex:
            log.warning("node %s: no arrival relay (%s); ranks arrive on their own", self.node, ex)
            relay = None
        with self._lock:
            self.relay = relay
        if self.stopped:
            self._stop_relay()
        try:
            self._lead()
        finally:
            self.close()

    def close(self) -> None:
        """Stops the relay; closes the pidfds of the ranks watched."""
        self._stop_relay()
        for watched in self.watched.values():
            watched.close()
        self.watched.clear()

    def stop(self) -> int | None:
        """Ends the lead (and any attempt to take it); returns the lock file's descriptor
        while held (the caller then owns it), else ``None``."""
        with self._lock:
            self.stopped = True
            fd, self.fd = self.fd, None
        # at once, not when the leading thread next looks: the ranks waiting on
        # the relay are told to arrive on their own now (this process is leaving)
        self._stop_relay()
        return fd

    def _stop_relay(self) -> None:
        with self._lock:
            relay, self.relay = self.relay, None
        if relay is not None:
            relay.stop(wait=False)

    def _lead(self) -> None:
        store = None
        next_beat = next_watch = 0.0
        while not self.stopped:
            now = time.monotonic()
            try:
                if store is None:
                    store = self.connect()
                self.refresh()
                self.reap(store)
                if now >= next_beat:
                    beat_for(store, self.node, self.directory)
                    next_beat = now + self.heartbeat_interval
                if now >= next_watch:
                    self.watch_nodes(store, now)
                    next_watch = now + self.watch_period
            except Exception as ex:
                log.warning("node %s: the store is unavailable (%s)", self.node, ex)
                store = None
            # only the processes still alive: a pidfd stays readable once its process exited
            fds = [
                fd
                for w in self.watched.values()
                for fd in (w.rank_fd, w.monitor_fd)
                if fd is not None and not _exited(fd)
            ]
            wait = max(0.0, min(next_beat, next_watch, now + self.interval) - time.monotonic())
            if fds:
                select.select(fds, [], [], wait)
            else:
                time.sleep(wait)

    def refresh(self) -> None:
        """Reads the registrations again (a few small local files)."""
        current = {r.identity: r for r in registrations(self.directory)}
        for identity in list(self.watched):
            if identity not in current:  # finished and deregistered
                self.watched.pop(identity).close()
        for identity, registration in current.items():
            watched = self.watched.get(identity)
            if watched is not None and watched.registration.monitor_pid == registration.monitor_pid:
                watched.registration = registration  # new peers
                continue
            rank_fd = _open_pidfd(registration.rank_pid, registration.rank_start)
            if rank_fd is None:
                if watched is None:
                    # dead before this leader saw it: a rank of this job that died
                    # at once, or a registration another job left (see reap)
                    self.unseen[identity] = registration
                continue
            if watched is not None:
                watched.close()
            self.watched[identity] = _Watched(
                registration, rank_fd, _open_pidfd(registration.monitor_pid)
            )

    def reap(self, store: Any) -> None:
        """Declares a local rank terminated once it and its monitor process both exited
        and it neither finished nor was reported (nobody else can report it).

        A registration whose processes had exited before this leader first saw
        it counts only if its rank was placed on this node in this store (its
        monitor process did, once connected): one another job left behind with
        the same directory is removed, never reported.
        """
        for identity, watched in list(self.watched.items()):
            if not (_exited(watched.rank_fd) and _exited(watched.monitor_fd)):
                continue
            if os.path.exists(os.path.join(self.directory, _member_file(identity))):
                self._report(store, identity)
            self.watched.pop(identity).close()
            self._forget(watched.registration)
        for identity, registration in list(self.unseen.items()):
            if store.node_of(identity) == self.node:
                self._report(store, identity)
            del self.unseen[identity]
            self._forget(registration)

    def _report(self, store: Any, identity: str) -> None:
        if store.has_completed(identity) or store.is_terminated(identity):
            return
        log.warning("rank %s died with its monitor process: declaring it terminated", identity)
        reason = f"process died with its monitor process (seen by node {self.node})"
        store.mark_terminated(identity, reason)

    def _forget(self, registration: Registration) -> None:
        path = os.path.join(self.directory, _member_file(registration.identity))
        with contextlib.suppress(OSError):
            with open(path) as f:
                text = f.read()
            if Registration.parse(text) == registration:
                os.unlink(path)

    def watch_nodes(self, store: Any, now: float) -> None:
        """Reads the beats of the nodes that host the local ranks' peers; declares the
        ranks of a node silent for ``heartbeat_timeout`` terminated."""
        local = set(self.watched)
        peers = {p for w in self.watched.values() for p in w.registration.peers} - local
        nodes: dict[str, set[str]] = {}
        for peer in sorted(peers):
            node = self.node_of.get(peer)
            if node is None:
                node = store.node_of(peer)
                if node is None:
                    # Every rank is placed by its monitor process before it first
                    # arrives at a barrier: a member with no readable placement
                    # was tampered with (a stranger overwrote the key). Its node
                    # cannot be watched; a lost one then ends at the barriers'
                    # timeouts, never in an expulsion by a stranger's write.
                    if peer not in self.unplaced:
                        self.unplaced.add(peer)
                        log.warning(
                            "rank %s has no authentic placement: its node is not watched", peer
                        )
                    continue
                self.node_of[peer] = node
                self.unplaced.discard(peer)
            if node != self.node:
                nodes.setdefault(node, set()).add(peer)
        for node, its_peers in nodes.items():
            stamp, identities = store.node_heartbeat(node)
            seen = self.nodes_seen.get(node)
            if seen is None or stamp > seen.stamp:
                self.nodes_seen[node] = _NodeSeen(stamp, now, set(identities) | its_peers)
                continue
            seen.identities |= its_peers
            silent = now - seen.at
            if silent > self.heartbeat_timeout:
                self._declare(
                    store, seen.identities, f"no heartbeat for {silent:.2f}s (node {node})"
                )

    def _declare(self, store: Any, identities: set[str], reason: str) -> None:
        for identity in sorted(identities - self.declared):
            if not (store.has_completed(identity) or store.is_terminated(identity)):
                log.warning("rank %s: %s; declaring it terminated", identity, reason)
                store.mark_terminated(identity, reason)
            self.declared.add(identity)

    # ------------------------------------------------------------------ fault news

    def _watch_faults(self) -> None:
        """The node's one fault watch: blocks in the store until a fault, then sends the
        count to every member (a member registered after a send reads it itself)."""
        down = False
        while not self.stopped:
            try:
                store = self.connect()
                down = False
                store.watch_faults(
                    self.send,
                    self.fault_chunk,
                    min(self.interval, FAULT_BURST_PAUSE),
                    stop=lambda: self.stopped,
                )
            except Exception as ex:
                if self.stopped:
                    return
                self.send(None)
                (log.debug if down else log.warning)(
                    "node fault watch: the store is unavailable (%s); the ranks read it", ex
                )
                down = True
                time.sleep(2.0)

    def send(self, count: int | None) -> None:
        """Hands ``count`` (``None``: no watch runs) to every member's socket."""
        data = b"-" if count is None else str(count).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            try:
                names = os.listdir(self.directory)
            except FileNotFoundError:
                return
            for name in names:
                if not name.endswith(_SOCKET):
                    continue
                try:
                    sock.sendto(data, os.path.join(self.directory, name))
                except OSError as ex:
                    # gone (its process exited) or not reading (a full queue): it
                    # gets the next count, which is never lower
                    if ex.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN):
                        log.debug("cannot reach %s: %s", name, ex)
