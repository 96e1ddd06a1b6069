"""A fresh ``env://`` rendezvous for every restart iteration.

A training function typically calls ``torch.distributed.init_process_group()``
with the default ``env://`` method, on every restart iteration. Without help,
iteration 2 would rendezvous in the same store keys as iteration 1 and read
its predecessors' stale gloo addresses, and after a rank reassignment a new
rank 0 would try to host a second store on ``MASTER_PORT``.

While the wrapped function runs, this module therefore substitutes the
``env://`` handler: the store it yields is prefixed with the iteration, and
when the Wrapper's own store is the TCPStore at ``MASTER_ADDR:MASTER_PORT``
every rank connects to it as a client (torch's ``TORCHELASTIC_USE_AGENT_STORE``
convention) instead of rank 0 hosting another one.

Process group initialization blocks in store reads (in C++, not
interruptible) until every peer has published its address, and a peer that
failed before initializing never will. The same holds for whatever store the
function builds itself: a ``TCPStore`` master waiting for its workers
(``wait_for_workers``), a client reading a key that a failed peer will never
write. So the sockets this process has when the function starts are recorded,
and :func:`release_iteration_connections` (run by ``AbortTorchDistributed``)
shuts down every TCP connection this process opened since, on the client
side: the ``env://`` rendezvous connections, the user's own store clients,
gloo's clones of them and pairs of a group still connecting. The blocked call
fails at once ("Connection reset", "Broken pipe"). Connections opened before the
function started (the Wrapper's own store client, anything the application
opened before calling the wrapped function) and the server side of connections
to this process's listeners (a store it hosts; gloo's listener) are never
touched. A connection the function opens in an iteration that fails is that
iteration's: open one that must survive restarts before calling the wrapped
function.
(A Python store wrapper that polls cannot be used instead: torch 2.13's gloo
clones its store, and a ``PrefixStore`` over a Python store cannot be cloned.)

Scripts that build their own store and pass ``store=`` to
``init_process_group`` (the usage guide's pattern: a ``TCPStore`` on
``MASTER_PORT + 1`` hosted by rank 0, built again in every call) meet the same
stale-key problem in their own store: rank 0's store server may outlive the
iteration (torch shares one server per port between ``multi_tenant`` stores of
a process, and the failed iteration's traceback keeps the old store alive), so
iteration 2's group would read iteration 1's gloo addresses, connect to
listeners that are gone or to the wrong peer, and block in C++ for the gloo
timeout. Gloo's keys are prefixed with the process group's name, which torch
draws from a counter; so every iteration starts the counter at its own offset
(``iteration * GROUP_NAME_STRIDE``), which every rank agrees on: the default
group of iteration ``i`` is named ``str(i * GROUP_NAME_STRIDE)``, and its keys
are fresh in any store, whoever hosts it and however long it lives.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import logging
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .. import protocol
from ..store import AGENT_STORE_ENV, PrefixStore, TCPStore
from .sockets import (
    listening_addresses,
    listening_sockets,
    shutdown_connections,
    socket_inodes,
    tcp_connections,
)

log = logging.getLogger(__name__)


#: distance between the process group counters of consecutive iterations
GROUP_NAME_STRIDE = 100_000

#: socket inodes of this process when the current call of the function began
_baseline: set[int] | None = None

#: store servers of the function that this process keeps up between iterations
#: (see hold_iteration_servers); the lock orders the monitor thread's abort
#: and the main thread's.
_held_servers: list[Any] = []
_held_lock = threading.Lock()


def hold_iteration_servers() -> int:
    """Keeps the ``multi_tenant`` TCPStore servers the function started up; returns how many.

    The usage guide's function builds ``TCPStore(..., is_master=(rank == 0),
    multi_tenant=True, wait_for_workers=True)`` on every call. The server lives
    in rank 0's process only as long as a store object refers to it; when the
    iteration is aborted while rank 0 waits for its workers, the constructor
    fails and takes the server down. Peers that connect meanwhile meet a refused
    connection, and torch's client then retries with back-off delays of
    seconds, up to the store's timeout, blocked in C++ where no abort reaches
    it: the next iteration cannot start until it gives up.

    So the abort takes a reference to every such server first: a second
    ``multi_tenant`` master store on the same port in this process shares the
    running server (torch keeps one per port), so the server stays up, and the
    next iteration's store shares it again. At most the servers of the latest
    aborted iteration are kept, until the call ends
    (:func:`release_held_servers`). A listener this process opened in the
    iteration that is not a shareable store server (gloo's, a store without
    ``multi_tenant``) makes the attempt fail on its busy port, and it is
    skipped; if the server went away in between, the store we would have
    started instead is closed at once, so a port is never taken from the user.
    """
    baseline = _baseline
    if baseline is None:
        return 0
    import torch.distributed as dist

    listening = listening_sockets()
    fresh = {inode: port for inode, port in listening.items() if inode not in baseline}
    held = []
    for inode, port in fresh.items():
        try:
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                is_master=True,
                multi_tenant=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=1),
            )
        except Exception as ex:  # not a shareable store server
            log.debug("port %d is not a shared store server: %s", port, ex)
            continue
        now = listening_sockets()
        if inode not in now or any(p == port and i not in listening for i, p in now.items()):
            del store  # we started a server of our own: not the user's
            continue
        held.append(store)
    with _held_lock:
        _held_servers[:] = held  # the new references first: no gap for a shared server
    log.debug("holding %d store servers of the function", len(held))
    return len(held)


def release_held_servers() -> None:
    """Drops the store servers kept by :func:`hold_iteration_servers` and the
    groups kept by :func:`_keep_destroyed_groups` (at the end of a call)."""
    with _held_lock:
        _held_servers.clear()
    _destroyed_groups.clear()
    close_stranded_connections()


# --------------------------------------------------------------------------- a stranded gloo init

#: connections opened by complete_stranded_gloo_init, and how many rounds it
#: ran for the current initialization (both under _held_lock)
_stranded: list[socket.socket] = []
_stranded_rounds = 0
#: rounds at most per initialization: each parks up to ``group_size``
#: connections in gloo's listener until the group is freed
MAX_STRANDED_ROUNDS = 20


def _building_gloo_group(thread_id: int) -> int:
    """The size of the gloo group whose constructor ``thread_id`` is in, else 0."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return 0
    code = frame.f_code
    if code.co_name != "_new_process_group_helper" or not code.co_filename.endswith(
        "distributed_c10d.py"
    ):
        return 0
    local = frame.f_locals
    if str(local.get("backend_str", "")).lower() != "gloo":
        return 0
    try:
        return int(local.get("group_size") or 0)
    except (TypeError, ValueError):
        return 0


def complete_stranded_gloo_init(thread_id: int) -> int:
    """Releases ``thread_id`` from a gloo group's initialization that a peer gave up on.

    Run by the monitor thread after it interrupted the function (every re-send
    of the restart exception, until the main thread acknowledges). The gloo
    constructor (``connectFullMesh``) connects its pairs one by one; for half
    of them this rank is the listening side and waits for the peer to connect
    to its listener, for 5 x the group's timeout, in C++ where neither the
    restart exception nor the abort reaches it (there is no connection yet to
    shut down). A peer that faulted, or whose initialization failed because a
    faulted rank closed its pairs, never connects: this rank would sit out the
    timeout, and the hard timeout ends it first (a healthy rank lost to a
    peer's exception). So, while the thread is inside gloo's constructor, each
    listener this process opened in the iteration that is not a store server
    it holds gets one connection per sequence number the group can use
    (``0 .. group_size - 1``), announcing that number, as a peer does: the
    pairs still waiting get connected and the constructor returns (to the
    pending restart exception). The connections of the previous round are
    closed first, which fails a pair that was connected to one of them. A
    number nobody waits for is parked by gloo with its connection until the
    group is freed. Does nothing outside the wrapped function or outside
    gloo's constructor; returns the number of connections opened.
    """
    global _stranded_rounds
    baseline = _baseline
    size = _building_gloo_group(thread_id) if baseline is not None else 0
    with _held_lock:
        previous, _stranded[:] = list(_stranded), []
        for sock in previous:
            sock.close()
        if size < 2 or _stranded_rounds >= MAX_STRANDED_ROUNDS:
            return 0
        _stranded_rounds += 1
        stores = {getattr(store, "port", None) for store in _held_servers}
    targets = [
        (family, address)
        for inode, (family, address) in listening_addresses().items()
        if inode not in baseline and address[1] not in stores
    ]
    opened = []
    for family, address in targets:
        for seq in range(size):
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(1.0)
                sock.connect(address)
                sock.sendall(struct.pack("=Q", seq))  # gloo's sequence_number_t
            except OSError as ex:
                sock.close()
                log.debug("cannot reach listener %s: %s", address, ex)
                break
            opened.append(sock)
    with _held_lock:
        _stranded.extend(opened)
    if opened:
        log.info(
            "still in gloo's group initialization after the interrupt: announced sequence "
            "numbers 0..%d to %d listeners of the iteration",
            size - 1,
            len(targets),
        )
    return len(opened)


def close_stranded_connections() -> None:
    """Closes what :func:`complete_stranded_gloo_init` opened (the restart is under way)."""
    global _stranded_rounds
    with _held_lock:
        for sock in _stranded:
            sock.close()
        _stranded.clear()
        _stranded_rounds = 0


#: process groups the function destroyed, kept until the next iteration starts
_destroyed_groups: list[Any] = []

#: attribute of what this module puts in torch's place for an iteration (the
#: ``env://`` handler, ``destroy_process_group``): what it replaced
_ORIGINAL = "_inprocess_replaced"


@contextlib.contextmanager
def _keep_destroyed_groups() -> Iterator[None]:
    """Keeps a Python reference to every group the function destroys.

    Works around a deadlock in torch 2.13 (seen in the usage guide's pattern,
    with or without the Wrapper): a function ending with ``barrier()`` and
    ``destroy_process_group()`` leaves its DDP model's reducer as the last owner
    of the gloo group; when the function returns, the reducer is freed with the
    GIL held and joins the group's worker thread, which is freeing the barrier's
    work and needs the GIL for that: the rank hangs for good. Held here, the
    group is freed later from Python, which releases the GIL while it joins.
    The previous iteration's groups are dropped when the next one starts.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _destroyed_groups.clear()
    # torch's function, also under a wrapper that an interrupted iteration left
    # behind (see fresh_env_rendezvous): wrappers never nest
    original = getattr(c10d.destroy_process_group, _ORIGINAL, c10d.destroy_process_group)

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        _destroyed_groups.extend(list(c10d._world.pg_map) if group is None else [group])
        original(group)

    setattr(destroy_process_group, _ORIGINAL, original)
    patched = [(module, "destroy_process_group") for module in (dist, c10d)]
    saved = [getattr(module, name) for module, name in patched]
    saved = [getattr(value, _ORIGINAL, value) for value in saved]
    try:
        for module, name in patched:
            setattr(module, name, destroy_process_group)
        yield
    finally:
        for (module, name), value in zip(patched, saved, strict=True):
            if getattr(module, name) is destroy_process_group:
                setattr(module, name, value)


def release_iteration_connections() -> int:
    """Shuts down the client-side TCP connections opened since the function started.

    Returns how many. Does nothing outside the wrapped function.
    """
    baseline = _baseline
    if baseline is None:
        return 0
    inodes = socket_inodes()
    fresh = {inode: fd for inode, fd in inodes.items() if inode not in baseline}
    # The server side of a connection has a listener's port as its local port;
    # the peer that opened it releases its own side.
    served = set(listening_sockets(inodes).values())
    released = shutdown_connections(
        [conn for conn in tcp_connections(fresh) if conn.local[2] not in served]
    )
    log.debug("shut down %d connections opened in this iteration", released)
    return released


def _serves_master_address(raw: Any) -> bool:
    if not isinstance(raw, TCPStore):
        return False
    return raw.host_name == os.environ.get("MASTER_ADDR") and str(raw.port) == os.environ.get(
        "MASTER_PORT"
    )


def _start_group_names(iteration: int) -> None:
    """Process groups created in ``iteration`` get names (and store keys) of their own."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        c10d._world.group_count = iteration * GROUP_NAME_STRIDE


def put_back_what_iterations_replaced() -> None:
    """Torch's ``env://`` handler and ``destroy_process_group`` back in place where an
    iteration cut short (see :func:`fresh_env_rendezvous`) left its own installed:
    at the end of a call, so that code after it rendezvouses as torch does."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    left_behind = getattr(handlers.get("env"), _ORIGINAL, None)
    if left_behind is not None:
        handlers["env"] = left_behind[0]
    for module in (dist, c10d):
        original = getattr(module.destroy_process_group, _ORIGINAL, None)
        if original is not None:
            module.destroy_process_group = original


@contextlib.contextmanager
def fresh_env_rendezvous(store: PrefixStore, iteration: int) -> Iterator[None]:
    """Makes ``env://`` rendezvous of this iteration use fresh keys.

    ``store`` is the Wrapper's namespaced store; its underlying store decides
    whether ranks connect to it as clients.
    """
    # The module, not the function of the same name that torch.distributed exports.
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers = rdzv._rendezvous_handlers
    original = handlers.get("env")
    saved_agent = os.environ.get(AGENT_STORE_ENV)
    # Invariant: at most one handler of ours is installed, over torch's own, and
    # AGENT_STORE_ENV is the user's whenever none is. The restart exception is
    # raised asynchronously, at any bytecode of the iteration: in the setup
    # below before its `try`, or in the `finally` before it restores. A handler
    # left behind so is replaced here, never wrapped: wrapped, this iteration's
    # keys would carry both prefixes on this rank alone, its peers would wait for
    # its address in the group's rendezvous for good (and so would it for
    # theirs), and so in every later iteration. It carries what it replaced.
    left_behind = getattr(original, _ORIGINAL, None)
    if left_behind is not None:
        original, saved_agent = left_behind
    if original is None:
        yield
        return
    prefix = f"{store.prefix}/{protocol.iteration_key(iteration, 'env')}"

    def handler(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[Any]:
        args = (url,) if timeout is None else (url, timeout)
        for user_store, rank, world_size in original(*args, **kwargs):
            yield PrefixStore(prefix, user_store), rank, world_size

    setattr(handler, _ORIGINAL, (original, saved_agent))
    global _baseline
    try:
        if _serves_master_address(store.base_store):
            os.environ[AGENT_STORE_ENV] = str(True)
        handlers["env"] = handler
        _start_group_names(iteration)
        _baseline = set(socket_inodes())
        with _keep_destroyed_groups():
            yield
    finally:
        _baseline = None
        if handlers.get("env") is handler:
            handlers["env"] = original
        if saved_agent is None:
            os.environ.pop(AGENT_STORE_ENV, None)
        else:
            os.environ[AGENT_STORE_ENV] = saved_agent
