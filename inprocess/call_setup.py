"""A call's setup and teardown: its store, what watches it, its environment.

What :class:`inprocess.wrap.CallWrapper` starts when a call begins and releases
when it ends: the call's store (never an earlier call's server, see
:func:`open_store`), the monitor process, progress watchdog and monitor thread
(:func:`start_machinery`), the pidfile, the environment the wrapped function
sees; and, as the call ends, the store's release (:func:`release_store`) and a
host's wait for its peers to leave (:func:`wait_for_exit_if_hosting`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed

from . import generation as _gen
from . import monitor_thread as _mt
from . import node as _node
from . import protocol
from .abort.rendezvous import (
    complete_stranded_gloo_init,
    fresh_env_rendezvous,
    put_back_what_iterations_replaced,
)
from .exception import StoreError
from .monitor_process import MonitorConfig, MonitorProcess
from .monitor_thread import InterruptSignal, MonitorThread, RankShouldRestart
from .progress_watchdog import Doorbell, ProgressBoard, ProgressWatchdog
from .reclaim import CallHeap, clear_frames, stores_in_frames
from .relay import RelayClient
from .state import State
from .store import (
    ClientSpec,
    Poller,
    PrefixStore,
    StoreMixin,
    incarnation_from_env,
    new_identity,
)

if TYPE_CHECKING:
    from .config import WrapperConfig
    from .membership import Iteration

log = logging.getLogger(__name__)

#: set on a store server that a rank hosts (never on a launcher's): such a
#: server lives for one call only, see open_store
RANK_HOSTED_KEY = protocol.RANK_HOSTED
#: longest a host that left by RestartAbort keeps the store up for its peers' own
ABORT_WAIT = 10.0

#: frames whose locals a restart clears at once (see release_frames) and the call's end
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
TORCH_DISTRIBUTED_DIR = os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep


# --------------------------------------------------------------------------- the store


def call_identity(namespace: str, initial_rank: int, late: bool) -> str:
    """This rank's identity in the call. The ranks that start the call together
    take identities every rank can derive (so the initial membership is
    published in O(1), not as N identities read by N ranks); a process that
    comes ``late`` (a relaunched worker) takes one of its own."""
    incarnation = incarnation_from_env()
    if late or incarnation != 0:
        return new_identity(initial_rank, incarnation)
    return protocol.launch_identity(initial_rank, protocol.launch_token(namespace))


def open_store(config: WrapperConfig, namespace: str, identity: str, timeout: float) -> StoreMixin:
    """This call's store; never the server of an earlier call that is shutting down.

    A server hosted by a rank serves one call: its host shuts it down once
    every rank has left the call, so a rank that starts its next call
    sooner may reach the old server. Invariant: a rank-hosted server carries
    ``RANK_HOSTED_KEY`` from its creation on, and ``<namespace>/hosted``
    for each call it serves, set by its host before that call's initial
    barrier. A client that reaches a rank-hosted server without this call's
    mark drops that connection and connects again, with backoff, until the
    new server is up (ranks agree on the namespace: the same job makes the
    same sequence of calls). A launcher's store (torchrun's agent,
    ``inprocess-run``) lives across calls, carries no mark and is used at once;
    so is a new server reached before its host marked it.
    """
    marker = f"{namespace}/{protocol.HOSTED}"
    deadline = time.monotonic() + timeout
    poller = Poller(0.05)
    for attempt in itertools.count():
        raw = config.store_factory(**config.store_kwargs)
        if getattr(raw, "is_master", False):
            raw.put(RANK_HOSTED_KEY, "1")
            raw.put(marker, identity)
            return raw
        with contextlib.suppress(Exception):  # the old server may go away meanwhile
            # Sealed marks: a stranger's key neither sends a rank to an old server
            # nor holds one back from a launcher's store.
            if raw.read(RANK_HOSTED_KEY) is None or raw.read(marker) is not None:
                return raw
        del raw  # closes the connection to the old server
        if time.monotonic() >= deadline:
            raise StoreError(
                f"the store server reached through {config.store_factory.__name__}"
                f"(**{config.store_kwargs!r}) belongs to another call and was not replaced "
                f"within {timeout:.3g}s (barrier_timeout): did initial rank 0 call the "
                "wrapped function as often as this rank?"
            )
        if attempt == 0:
            log.debug("%s: reached the store server of an earlier call; waiting", identity)
        poller.sleep(deadline)


def release_store(states: dict[int, weakref.ref[State]], monitor: MonitorThread | None) -> None:
    """Drops the call's store from every State that may hold it and from the monitor
    thread, so its connections (and a server this rank hosts) close now, not
    whenever garbage is collected (the call drops its own reference).

    Invariant: every State that got the store is in ``states`` (the call tracks
    each, see ``CallWrapper._track``); clearing them all covers the states the
    user's callbacks kept and those the frames of a traceback hold. Their
    ``fn_exception`` goes too: its traceback reaches frames that held the store.
    """
    for ref in states.values():
        state = ref()
        if state is not None:
            state.store = None
            state.fn_exception = None
    states.clear()
    if monitor is not None:
        monitor.store = None


def wait_for_exit_if_hosting(
    raw: Any,
    store: PrefixStore,
    identity: str,
    config: WrapperConfig,
    finished: Iteration | None,
    aborted: Iteration | None,
) -> None:
    """The rank hosting the store keeps it up until every rank has left: the members of
    the iteration the call completed in (``finished``), or of the one it left by
    ``RestartAbort`` (``aborted``, see :func:`wait_for_peers_to_abort`)."""
    if not getattr(raw, "is_master", False):
        return
    if finished is None:
        wait_for_peers_to_abort(store, identity, config, aborted)
        return
    key = protocol.iteration_key(finished.index, "exit")
    deadline = time.monotonic() + config.completion_timeout
    seen = -1
    # The counter wakes; the members' sealed exit records decide.
    while time.monotonic() < deadline:
        count = store.counter(key)
        if count != seen and count >= len(finished.members):
            seen = count
            if store.all_arrived(protocol.arrivals_key(key), finished.members) is not None:
                return
        time.sleep(0.005)


def wait_for_peers_to_abort(
    store: PrefixStore, identity: str, config: WrapperConfig, aborted: Iteration | None
) -> None:
    """A host that left by ``RestartAbort`` (in iteration ``aborted``) keeps the store
    up until the other members have left too, within :data:`ABORT_WAIT`.

    A RestartAbort usually ends every rank at the same iteration (a retry
    limit is the same for all), and a peer still in that iteration's barrier
    when the store goes would end with a lost store instead of its own
    RestartAbort. A peer that goes on without this rank loses the store
    either way: the bound only keeps the host from waiting for it long.
    """
    if aborted is None:
        return
    others = set(aborted.members) - {identity}
    deadline = time.monotonic() + min(ABORT_WAIT, config.barrier_timeout)
    with contextlib.suppress(Exception):  # the store's own errors end the wait
        while time.monotonic() < deadline:
            if others <= store.terminated_since(store.terminated_epoch()):
                return
            time.sleep(0.01)


# --------------------------------------------------------------------------- what watches the call


@dataclasses.dataclass
class Machinery:
    """What watches a call, started by :func:`start_machinery`."""

    board: ProgressBoard
    relay: RelayClient
    monitor_process: MonitorProcess
    watchdog: ProgressWatchdog
    interrupt: InterruptSignal
    monitor: MonitorThread


def start_machinery(
    config: WrapperConfig,
    cleanup: contextlib.ExitStack,
    *,
    identity: str,
    initial_rank: int,
    namespace: str,
    raw: StoreMixin,
    store: PrefixStore,
    lock: threading.RLock,
    on_monitor_restart: Callable[[MonitorProcess, int, str], None],
) -> Machinery:
    """Starts the board, the node's relay, the monitor process, the progress watchdog
    and the monitor thread of a call; each is stopped by ``cleanup``, in reverse.

    ``on_monitor_restart(monitor, pid, reason)`` is told of a monitor process
    that died and was replaced.
    """
    c = config
    board = ProgressBoard()
    cleanup.callback(board.close)
    # rung by the monitor process's fault watch: the monitor thread reads the board then
    doorbell = Doorbell()
    cleanup.callback(doorbell.close)  # (after the monitor thread and process have stopped)
    # The ranks of a node share one group for their liveness (inprocess.node).
    group, node = _node.group_of(namespace, _node.node_name(), raw)
    # ...and its restarts' arrivals, through the group's leader
    relay = RelayClient(group, identity)
    cleanup.callback(relay.close)
    monitor = MonitorProcess(
        MonitorConfig(
            identity=identity,
            initial_rank=initial_rank,
            parent_pid=os.getpid(),
            # Described by the store itself: the factory need not be picklable.
            client=raw.client_spec() or ClientSpec(c.store_factory.client, c.store_kwargs),
            namespace=namespace,
            interval=c.monitor_process_interval,
            heartbeat_interval=c.heartbeat_interval,
            heartbeat_timeout=c.heartbeat_timeout,
            hard_timeout=c.hard_timeout,
            termination_grace_time=c.termination_grace_time,
            unwind_timeout=c.unwind_timeout,
            thread_id=threading.get_native_id(),
            logfile=c.monitor_process_logfile,
            # A log file asked for gets at least the INFO lines.
            log_level=min(
                logging.getLogger("inprocess").getEffectiveLevel(),
                logging.INFO if c.monitor_process_logfile else logging.WARNING,
            ),
            node=node,
            node_group=group,
        ),
        board,
        doorbell.write_fd,
    )
    beat = functools.partial(_node.beat_for, store, node, group)
    # Where the fork is not safe (CUDA initialized, other threads), the monitor
    # is a fresh interpreter that imports torch: seconds the rank does not
    # wait for (see MonitorProcess.start).
    monitor_ready = monitor.start(timeout=c.barrier_timeout, wait=False, send_heartbeat=beat)
    cleanup.callback(monitor.shutdown)
    if not monitor_ready:
        # Invariant: a rank is placed before its first barrier (its peers watch
        # its node from then on); its monitor places it once connected.
        store.place(identity, node)
    # A monitor process that dies is replaced, not mistaken for this rank's death.
    monitor.keep_alive(
        timeout=c.barrier_timeout,
        on_restart=functools.partial(on_monitor_restart, monitor),
        send_heartbeat=beat,
    )
    if c.monitor_process_pidfile is not None:
        # Left in place when the call ends (as the newer generations do); the
        # next call, or a replacement monitor process, writes it again.
        write_pidfile(c.monitor_process_pidfile, initial_rank, monitor)

    on_main_thread = threading.current_thread() is threading.main_thread()
    watchdog = ProgressWatchdog(
        c.progress_watchdog_interval,
        board,
        automatic=on_main_thread,
        soft_timeout=c.soft_timeout,
    )
    watchdog.start()
    cleanup.callback(watchdog.shutdown)

    interrupt = InterruptSignal()
    interrupt.install()
    cleanup.callback(interrupt.uninstall)

    thread = MonitorThread(
        store=store,
        identity=identity,
        target_thread_id=threading.get_ident(),
        lock=lock,
        interval=c.monitor_thread_interval,
        last_call_wait=c.last_call_wait,
        soft_timeout=c.soft_timeout,
        stalled_for=watchdog.stalled_for,
        # learned from the monitor process's fault watch, not read from the store
        faults_seen=board.faults_seen,
        doorbell=doorbell,
        on_interrupt=watchdog.freeze,
        # a gloo initialization that a faulted peer left waiting (see there)
        on_resend=functools.partial(complete_stranded_gloo_init, threading.get_ident()),
        abort=functools.partial(
            abort_then_time_unwind, board, _gen.as_state_callback(c.abort, c.generation)
        ),
        interrupt=interrupt,
    )
    thread.start()
    cleanup.callback(thread.shutdown)

    # Gated like the monitor thread's sends: never raised once the main
    # thread has caught the restart exception (see MonitorThread).
    unraisable = _mt.reraise_if_unraisable(
        RankShouldRestart, lock=lock, wanted=thread.expects_restart
    )
    cleanup.enter_context(unraisable)
    cleanup.enter_context(restore_environment("RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"))
    cleanup.callback(put_back_what_iterations_replaced)  # (an interrupted iteration's)
    return Machinery(board, relay, monitor, watchdog, interrupt, thread)


def monitor_restarted(
    identity: str,
    config: WrapperConfig,
    initial_rank: int,
    store: PrefixStore | None,
    monitor: MonitorProcess,
    pid: int,
    reason: str,
) -> None:
    """A monitor process died and ``monitor`` started a new one (``pid``): a fault of
    the machinery, not of training. Logged, the pidfile written again, and recorded
    in the call's ``store`` (if it is still held); no restart."""
    log.warning("%s: monitor process %s; started a new one (pid %d)", identity, reason, pid)
    if config.monitor_process_pidfile is not None:
        with contextlib.suppress(OSError):
            write_pidfile(config.monitor_process_pidfile, initial_rank, monitor)
    with contextlib.suppress(Exception):  # (no store once the call released it)
        store.add_entry(
            "machinery_faults",
            f"{identity}\tmonitor process {reason}\t{time.time():.3f}",
        )


def abort_then_time_unwind(
    board: ProgressBoard, abort: Callable[[Any], Any] | None, state: Any
) -> Any:
    """The abort (monitor thread, under its lock, right after the restart
    exception was sent), then the start of the monitor process's
    bounded-unwind clock: the main thread cannot come back before the abort
    is done (it needs the lock), and the abort is what releases it, so its
    duration, however long, never counts against the rank."""
    try:
        return abort(state) if abort is not None else None
    finally:
        board.write_unwind(time.monotonic())


def write_pidfile(template: str, rank: int, monitor: MonitorProcess) -> None:
    """Writes the monitor process's pid (decimal, atomically) to the rank's pidfile."""
    path = template.format(rank=rank)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{monitor.process.pid}\n")
    os.replace(tmp, path)


def release_frames(board: ProgressBoard, ex: BaseException | None) -> None:
    """Lets go of what a failed iteration left in the frames of ``ex``'s traceback
    that are ours and torch.distributed's.

    Those frames hold its aborted process groups and the work objects of
    their collectives (``group``, ``work``), and the exception lives on in
    ``State.fn_exception`` into the next iteration. Freeing them runs native
    destructors that may block for good (a gloo group joins its worker
    threads, and one left in a send the abort did not fail never returns):
    they are freed here, on the bounded-unwind clock, so a rank stuck in them
    is ended after ``unwind_timeout`` like one stuck before it came back, not
    by its hard timeout at some later fault, while its peers wait.

    The wrapped function's own frames are let go of later, once every rank
    has passed the termination barrier (:func:`reclaim_iteration`): what they
    hold may still serve the peers' restart (a store server the function
    hosts, which the others' aborts write through).
    """
    if ex is None:
        return
    board.write_phase("release")
    if not board.unwind_started():  # a fault the monitor thread did not interrupt
        board.write_unwind(time.monotonic())
    clear_frames(ex, (PACKAGE_DIR, TORCH_DISTRIBUTED_DIR))


def reclaim_iteration(board: ProgressBoard, ex: BaseException | None, heap: CallHeap) -> None:
    """Frees everything the failed iteration left, before the next one begins: the
    locals of every finished frame of ``ex``'s tracebacks (the wrapped function's
    model, optimizer, buffers, stores), then the call's garbage (see
    :mod:`inprocess.reclaim`).

    Called after the termination barrier: every rank has finished its abort,
    so nothing of this iteration still serves a peer, and before the next
    iteration barrier, so no peer can reach this iteration's objects (a store
    server the function hosted) once the next iteration starts. On the
    bounded-unwind clock, as :func:`release_frames` (native destructors may
    block). The exception and its traceback stay printable (file, line,
    function of every frame); only the frames' locals are gone.
    """
    if ex is None:
        return
    board.write_phase("reclaim")
    board.write_unwind(time.monotonic())
    try:
        heap.keep(stores_in_frames(ex))  # (see CallHeap.keep)
        clear_frames(ex)
        heap.collect()
    finally:
        board.write_unwind(0.0)


# --------------------------------------------------------------------------- the environment


def _logging_is_off() -> bool:
    """Whether records of our loggers reach no handler (``logging.lastResort`` would get them)."""
    logger: logging.Logger | None = logging.getLogger("inprocess")
    while logger is not None:
        if logger.handlers:
            return False
        logger = logger.parent if logger.propagate else None
    return True


def warn_if_logging_is_off() -> None:
    """Warns, as a call starts, that the application configured no logging (the
    warning points at the caller of the wrapped function)."""
    if _logging_is_off():
        warnings.warn(
            "inprocess: the application configured no logging, so the library's logs (faults, "
            "restarts, lost ranks) are off; only its warnings reach stderr, unformatted, "
            "through logging.lastResort. Turn them on with logging.basicConfig(level="
            "logging.INFO) or a handler on the 'inprocess' logger",
            UserWarning,
            stacklevel=4,
        )


@contextlib.contextmanager
def function_environment(
    state: State, store: PrefixStore, iteration: int, excepthook: Any
) -> Iterator[None]:
    """What the wrapped function sees in ``iteration``: ``RANK`` and ``WORLD_SIZE`` of
    ``state``, a fresh ``env://`` rendezvous, and ``excepthook`` (``sys.excepthook``
    when the call started) rid of the layer a previous iteration's
    ``init_process_group`` added."""
    s = state
    # Each init_process_group wraps sys.excepthook in one more layer that
    # prefixes "[rank<r>]: " (torch's, for the process's life); restarted
    # in-process, a traceback would carry one prefix per restart, of ranks
    # this process no longer has. Torch's layer of a previous iteration goes.
    if sys.excepthook is not excepthook and is_torch_excepthook(sys.excepthook):
        sys.excepthook = excepthook
    os.environ["RANK"] = str(s.rank if s.active_rank is None else s.active_rank)
    os.environ["WORLD_SIZE"] = str(s.active_world_size)
    with fresh_env_rendezvous(store, iteration):
        yield


def is_torch_excepthook(hook: Any) -> bool:
    """Whether ``hook`` is the one ``init_process_group`` installs."""
    return getattr(hook, "__qualname__", "").endswith("_distributed_excepthook") and getattr(
        hook, "__module__", ""
    ).startswith("torch.distributed")


@contextlib.contextmanager
def restore_environment(*names: str) -> Iterator[None]:
    """Puts the environment variables ``names`` back as they were when the block ends."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
