"""The monitor process: a guardian outside the training process.

One per rank. It must inherit neither a CUDA context nor a thread stuck
holding a lock. When the caller is the only Python thread and CUDA is not
initialized it is forked (instant: torch is already imported), and the child
drops everything it inherited that it must not touch: every file descriptor
but its own, the parent's signal handlers and log handlers, and the garbage
collector (frozen, so no parent object's finalizer ever closes a descriptor
number the child reuses). Otherwise it is started as a fresh interpreter
(``python -m inprocess.monitor_process_main``). It

* watches its training process through a pidfd: any death (a signal, a
  segfault, ``os._exit``) is noticed at once and recorded in the store, which
  makes every other rank restart without this one;
* enforces the hard timeout: when the progress board shows no progress for
  ``hard_timeout`` (time in the wrapped function, across restarts; see
  :mod:`inprocess.progress_watchdog`), it sends SIGCONT and SIGTERM, waits
  ``termination_grace_time``, then SIGCONT, SIGTERM and SIGKILL;
* joins its node's group (:mod:`inprocess.node`): one monitor process per node
  leads it and beats for every rank of the node, watches the nodes of their
  ring peers (the next ranks of the current membership), declaring the ranks of
  a node terminated when its beat has not changed for ``heartbeat_timeout`` as
  seen by this process's clock (clocks of different hosts are never compared),
  and declares a local rank that died with its monitor process; this process
  tells the leader its rank's peers;
* bounds the unwind: once the restart exception was sent and the abort has
  run (the board's unwind word, written then, outside ``atomic()`` only), a
  main thread that has not come
  back to the Wrapper for ``unwind_timeout`` while idle in the kernel (it used
  no CPU and was never runnable: stuck in a native call that ignored the
  abort, neither computing nor waiting for a core on a loaded machine) is
  SIGKILLed and recorded as "stuck in native code after the abort" with where
  it waits (``wchan``, system call), so the other ranks go on without it;
* hears the call's faults for its rank's monitor thread: the node leader's fault
  watch blocks in the store until the next fault and sends the fault count to
  each member, which writes it on its board, so a rank makes no store
  operation to learn of a fault (a second of polling each before);
* exits when its rank's Wrapper call ends, or right after reporting its rank's
  death, and a deadline bounds that report, so it never outlives its job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

from . import persist_signal, procfs
from .node import NodeLeader, NodeMember, group_dir
from .proctitle import set_title
from .progress_watchdog import ProgressBoard, ring
from .protocol import Peers

log = logging.getLogger(__name__)

#: seconds a monitor may spend reporting its rank's death before it gives up
REPORT_DEADLINE = 30
#: seconds a forked monitor process may take to report ready before it is
#: presumed deadlocked and replaced by a fresh interpreter (see MonitorProcess.start)
FORK_START_GRACE = 10.0
#: how many successors in the membership ring each monitor watches
WATCHED_PEERS = 2
#: seconds before the first new try at replacing a monitor process that could not
#: be replaced; each failure doubles it, up to :data:`RESTART_BACKOFF_MAX`
RESTART_BACKOFF = 0.5
RESTART_BACKOFF_MAX = 8.0

_SHUTDOWN = b"S"
_READY = b"R"


@dataclass(frozen=True)
class MonitorConfig:
    """What the monitor process watches and how, sent pickled on its stdin
    (with the :class:`_Fds` it inherits, which exist only once it is started)."""

    identity: str
    initial_rank: int
    parent_pid: int
    #: how to reach the rank's store (a :class:`inprocess.store.ClientSpec`)
    client: Any
    namespace: str
    interval: float
    heartbeat_interval: float
    heartbeat_timeout: float
    hard_timeout: float
    termination_grace_time: float
    logfile: str | None
    log_level: int = logging.INFO
    #: see the module docstring; 0 disables the bounded unwind
    unwind_timeout: float = 0.0
    #: native id of the thread running the Wrapper call (0: the process's main thread)
    thread_id: int = 0
    env: dict[str, str] = field(default_factory=dict)
    #: the node the rank runs on and its group's directory (see inprocess.node)
    node: str = "node"
    node_group: str = ""


@dataclass(frozen=True)
class _Fds:
    """The pipes a monitor process inherits: the progress board, the parent's
    control pipe (EOF: the parent is gone), the pipe it reports ready on and the
    write end of the rank's doorbell (-1: none; rung after news on the board), and
    a pidfd of the rank (-1: the child opens one; a spawned child gets it from the
    rank, so a rank that dies before its monitor is up is still seen dead, never
    another process that took its pid)."""

    board: int
    control: int
    ready: int
    doorbell: int = -1
    parent: int = -1


class _ForkedChild:
    """The few ``subprocess.Popen`` methods we use, for a forked child."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + timeout if timeout is not None else float("inf")
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"monitor process {self.pid}", timeout)
            time.sleep(0.002)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def fork_is_safe() -> bool:
    """Whether forking cannot hand the child a CUDA context or a locked Python thread."""
    if threading.active_count() != 1 or not hasattr(os, "fork"):
        return False
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return not (cuda is not None and cuda.is_initialized())


class MonitorProcess:
    """Parent-side handle of a rank's monitor process."""

    def __init__(self, config: MonitorConfig, board: ProgressBoard, doorbell: int = -1) -> None:
        self.config = config
        self.board = board
        #: write end of the rank's doorbell (the monitor thread waits on it; -1: none)
        self.doorbell = doorbell
        self.process: subprocess.Popen[bytes] | _ForkedChild | None = None
        #: pid of the latest process started (a replaced one's too, see keep_alive)
        self.last_pid: int | None = None
        self.forked = False
        self._control_w: int | None = None
        self._ready_r: int | None = None
        #: ``time.time()`` when the latest process reported ready (None: not yet)
        self.ready_at: float | None = None

    def start(
        self,
        timeout: float,
        wait: bool = True,
        send_heartbeat: Callable[[], Any] | None = None,
    ) -> bool:
        """Starts the process and waits until it is connected to the store; returns
        whether it is (always ``True`` with ``wait``).

        A forked child that is still alive but not ready after
        :data:`FORK_START_GRACE` is presumed deadlocked: :func:`fork_is_safe`
        sees Python threads only, and a native thread (a library's pool, a
        store client's loop) may have held a lock (the allocator's, the
        logging module's) at the fork. It is killed and a fresh interpreter,
        which inherits no lock, is started with the time left.

        ``wait=False``: a fresh interpreter (the fork is not safe: CUDA is
        initialized, or other threads run) imports torch before it is ready,
        seconds that the rank need not spend waiting: it is started and this
        returns ``False`` at once. A thread waits for it, calling
        ``send_heartbeat()`` every ``heartbeat_interval`` meanwhile (the
        rank's node may have no other beat yet), and kills it if it is not
        ready within ``timeout`` (the keeper of :meth:`keep_alive` then
        replaces it). Until it is ready its rank's monitor thread reads the
        store for faults itself; a death meanwhile is still reported (the
        child watches the rank through a pidfd the rank opened, see
        :class:`_Fds`). A forked child is quick and always waited for.
        """
        deadline = time.monotonic() + timeout
        self.ready_at = None
        if fork_is_safe():
            grace = min(FORK_START_GRACE, timeout / 2)
            if self._start_once(self._fork, grace):
                self.ready_at = time.time()
                return True
            assert self.process is not None
            if self.process.poll() is not None:  # it failed: a fresh one would fail alike
                self._fail(timeout)
            log.warning(
                "forked monitor process %d not ready after %.3gs; killing it and starting"
                " a fresh interpreter",
                self.process.pid,
                grace,
            )
            self._discard()
        if not wait:
            if self._start_once(self._spawn, 0.0):
                self.ready_at = time.time()
                return True
            self._await_ready(max(deadline - time.monotonic(), 0.0), send_heartbeat)
            return False
        if not self._start_once(self._spawn, max(deadline - time.monotonic(), 0.0)):
            self._fail(timeout)
        self.ready_at = time.time()
        return True

    def _await_ready(self, timeout: float, send_heartbeat: Callable[[], Any] | None) -> None:
        """Waits in a thread for the child just started to report ready (see :meth:`start`).

        The thread reads a copy of the ready pipe: the keeper may close the
        original (the child died, and is replaced). It ends when the child is
        ready, exits (EOF), is killed after ``timeout``, or :meth:`shutdown`
        closes its stop pipe.
        """
        assert self._ready_r is not None and self.process is not None
        ready_r, process = os.dup(self._ready_r), self.process
        stop_r, self._ready_stop = os.pipe()

        def wait() -> None:
            try:
                with _heartbeats_meanwhile(send_heartbeat, self.config.heartbeat_interval):
                    ready, _, _ = select.select([ready_r, stop_r], [], [], timeout)
                    if stop_r in ready:
                        return
                    if ready_r in ready:
                        if os.read(ready_r, 1) == _READY:
                            self.ready_at = time.time()
                            log.debug("monitor process %d ready", process.pid)
                        return  # (EOF: it exited; the keeper replaces it)
                    log.warning(
                        "monitor process %d not ready after %.3gs; killing it", process.pid, timeout
                    )
                    process.kill()
            finally:
                os.close(ready_r)
                os.close(stop_r)

        self._ready_waiter = threading.Thread(
            target=wait, name="inprocess-monitor-start", daemon=True
        )
        self._ready_waiter.start()

    def _stop_ready_wait(self) -> None:
        """Ends and joins the thread of :meth:`_await_ready`, if any."""
        waiter: threading.Thread | None = getattr(self, "_ready_waiter", None)
        if waiter is None:
            return
        os.close(self._ready_stop)  # EOF: the thread returns
        waiter.join()
        self._ready_waiter = None

    def _start_once(self, launch: Callable[[_Fds], None], timeout: float) -> bool:
        """Starts one child with ``launch``; whether it reported ready within ``timeout``."""
        control_r, control_w = os.pipe()
        ready_r, ready_w = os.pipe()
        fds = _Fds(board=self.board.fd, control=control_r, ready=ready_w, doorbell=self.doorbell)
        try:
            launch(fds)
        except BaseException:
            os.close(control_w)
            os.close(ready_r)
            raise
        finally:
            os.close(control_r)
            os.close(ready_w)
        self._control_w = control_w
        self._ready_r = ready_r
        ready, _, _ = select.select([ready_r], [], [], timeout)
        return (os.read(ready_r, 1) if ready else b"") == _READY

    def _discard(self) -> None:
        """Kills the child that did not start, and closes its pipes."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10.0)
        self.process = None
        self.forked = False
        for fd in (self._control_w, self._ready_r):
            if fd is not None:
                os.close(fd)
        self._control_w = self._ready_r = None

    def _fail(self, timeout: float) -> NoReturn:
        code = self.process.poll() if self.process is not None else None
        self._end_child()  # (not the keeper: it tries again, see keep_alive)
        raise RuntimeError(
            f"the monitor process did not start within {timeout:.3g}s (exit code {code})"
        )

    def _fork(self, fds: _Fds) -> None:
        keep = {fds.board, fds.control, fds.ready, fds.doorbell} - {-1}
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                _sanitize_after_fork(keep)
                code = run(self.config, fds)
            finally:
                os._exit(code)
        self.forked = True
        self.process = _ForkedChild(pid)
        self.last_pid = pid

    def _spawn(self, fds: _Fds) -> None:
        parent = os.pidfd_open(os.getpid())
        try:
            self._spawn_with(dataclasses.replace(fds, parent=parent))
        finally:
            os.close(parent)  # the child has its copy

    def _spawn_with(self, fds: _Fds) -> None:
        try:
            # Before anything is started: a fresh interpreter learns everything from this.
            payload = pickle.dumps((self.config, fds))
        except Exception as ex:
            raise TypeError(
                "the monitor process must be started as a fresh interpreter here (other "
                "threads are running, or CUDA is initialized) and cannot be told how to reach "
                f"the store: {self.config.client!r} is not picklable ({ex}). Give the "
                "store_factory class a client_spec() method, or define it at module level "
                "(with picklable store_kwargs)"
            ) from ex
        env = dict(os.environ)
        env.update(self.config.env)
        env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
        process = subprocess.Popen(
            [sys.executable, "-m", "inprocess.monitor_process_main"],
            stdin=subprocess.PIPE,
            pass_fds=tuple({fds.board, fds.control, fds.ready, fds.doorbell, fds.parent} - {-1}),
            env=env,
            start_new_session=True,
            close_fds=True,
        )
        assert process.stdin is not None
        process.stdin.write(payload)
        process.stdin.close()
        self.process = process
        self.last_pid = process.pid

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def keep_alive(
        self,
        timeout: float,
        on_restart: Callable[[int, str], None] | None = None,
        send_heartbeat: Callable[[], Any] | None = None,
    ) -> None:
        """Replaces the monitor process whenever it dies before :meth:`shutdown`.

        A dead monitor sends no heartbeats: without this its healthy rank would
        be declared terminated by its peers after ``heartbeat_timeout``. A
        thread polls the child every ``interval`` and starts a new one (a fresh
        interpreter: other threads run now) with the same board; the rank's
        training goes on untouched. ``on_restart(pid, reason)`` is called after.
        A replacement that does not start (killed while it starts, say) is
        tried again after :data:`RESTART_BACKOFF`, doubled after each failure
        up to :data:`RESTART_BACKOFF_MAX`, for as long as the rank runs: a rank
        is never left without a monitor, which alone would stop it when it
        hangs.
        A fresh interpreter imports torch before it is ready, which takes longer
        than ``heartbeat_timeout`` on a loaded machine: until it is ready,
        ``send_heartbeat()`` (this rank's heartbeat through the rank's own store
        client) is called every ``heartbeat_interval`` on the dead monitor's
        behalf, also between the tries.
        Invariant: :meth:`shutdown` first stops and joins this thread, so a
        restart under way completes before the process is shut down and nothing
        is restarted once shutdown has begun (the stop flag is read under
        ``_lock`` before each restart).
        """
        self._keeper_stop = threading.Event()
        self._lock = threading.Lock()

        def keep() -> None:
            while not self._keeper_stop.wait(self.config.interval):
                with self._lock:
                    if self._keeper_stop.is_set() or self.process is None:
                        return
                    code = self.process.poll()
                    if code is None:
                        continue
                    reason = (
                        f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
                    )
                    log.warning(
                        "monitor process %d %s: starting a new one", self.process.pid, reason
                    )
                    # Its fault watch is gone: the monitor thread reads the store
                    # itself until the new process's watch writes a count.
                    self.board.write_faults_seen(None)
                    self.process = None
                    for fd in (self._control_w, self._ready_r):
                        if fd is not None:
                            with contextlib.suppress(OSError):
                                os.close(fd)
                    self._control_w = self._ready_r = None
                    with _heartbeats_meanwhile(send_heartbeat, self.config.heartbeat_interval):
                        if not self._restart(timeout):
                            return  # shut down meanwhile
                    pid = self.process.pid if self.process is not None else -1
                if on_restart is not None:
                    try:
                        on_restart(pid, reason)
                    except Exception:
                        log.exception("on_restart failed")

        self._keeper = threading.Thread(target=keep, name="inprocess-monitor-keeper", daemon=True)
        self._keeper.start()

    def _restart(self, timeout: float) -> bool:
        """Starts a new monitor process, trying again (with a growing pause) until one
        starts; ``False`` if :meth:`shutdown` began first."""
        delay = RESTART_BACKOFF
        failures = 0
        while True:
            try:
                self.start(timeout)
                return True
            except Exception as ex:
                failures += 1
                # (text only: a record holding the exception would keep its frames,
                # and through them the rank's store, alive)
                log.log(
                    logging.ERROR if failures == 1 else logging.WARNING,
                    "cannot restart the monitor process (%d failures: %s); trying again in %.3gs",
                    failures,
                    f"{type(ex).__name__}: {ex}",
                    delay,
                )
            if self._keeper_stop.wait(delay):
                return False
            delay = min(delay * 2, RESTART_BACKOFF_MAX)

    def _stop_keeper(self) -> None:
        keeper = getattr(self, "_keeper", None)
        if keeper is None:
            return
        self._keeper_stop.set()
        if keeper is not threading.current_thread():
            keeper.join()
        self._keeper = None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tells the monitor that this rank is done, and waits for it to exit."""
        self._stop_ready_wait()
        self._stop_keeper()
        self._end_child(timeout)

    def _end_child(self, timeout: float = 10.0) -> None:
        """Tells the child to exit (it is killed after ``timeout``); closes its pipes."""
        if self._control_w is not None:
            with contextlib.suppress(OSError):
                os.write(self._control_w, _SHUTDOWN)
            os.close(self._control_w)
            self._control_w = None
        if self._ready_r is not None:
            os.close(self._ready_r)
            self._ready_r = None
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("monitor process %d did not exit; killing it", self.process.pid)
                self.process.kill()
                self.process.wait()
            self.process = None


# --------------------------------------------------------------------------- child side


class _Guardian:
    """The monitor process's loop; one instance per process."""

    def __init__(self, config: MonitorConfig, fds: _Fds) -> None:
        self.config = config
        self.control_fd = fds.control
        self.doorbell_fd = fds.doorbell
        self.board = ProgressBoard(fds.board)
        self.parent_fd = fds.parent if fds.parent >= 0 else os.pidfd_open(config.parent_pid)
        self.store: Any = None
        self.kill_started: float | None = None
        self.kill_escalated = False
        self.membership_iteration = -1
        # (no group given: a group of this rank alone)
        group = config.node_group or group_dir(
            config.namespace, config.node, f"pid:{config.parent_pid}"
        )
        self.member = NodeMember(group, config.identity, config.parent_pid)
        self.leader = NodeLeader(
            group,
            config.node,
            self._connect,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout,
            interval=config.interval,
            fault_chunk=FAULT_WATCH_CHUNK,
        )
        tid = config.thread_id or config.parent_pid
        self.task_dir = f"/proc/{config.parent_pid}/task/{tid}"
        #: (unwind start seen, last time the thread was seen busy, its CPU ticks then)
        self.unwind: tuple[float, float, int] | None = None
        self.stuck_reason: str | None = None
        #: where the main thread was when the hard timeout struck (for the report)
        self.hard_timeout_where = ""

    def _connect(self) -> Any:
        """A new client of the call's namespace."""
        from .store import PrefixStore

        return PrefixStore(self.config.namespace, self.config.client.connect())

    def connect(self) -> None:
        self.store = self._connect()
        self.store.place(self.config.identity, self.config.node)
        self.member.join()
        threading.Thread(target=self.leader.run, name="node-leader", daemon=True).start()
        threading.Thread(
            target=_hear_faults,
            args=(self.member, self._connect, self.board, self.doorbell_fd),
            name="fault-news",
            daemon=True,
        ).start()

    def leave(self, finished: bool) -> None:
        """Leaves the node group (``finished``: the rank finished or its death is
        recorded; otherwise its registration stays for the leader to report)."""
        try:
            self.member.leave(finished, self.leader.stop())
        except OSError as ex:
            log.warning("cannot leave the node group: %s", ex)

    def run(self) -> bool:
        """Watches until the rank's call ends (then ``True``) or its process exits
        (then whether it finished or its death is recorded)."""
        poller = select.poll()
        poller.register(self.parent_fd, select.POLLIN)
        poller.register(self.control_fd, select.POLLIN)
        while True:
            events = dict(poller.poll(self.config.interval * 1000))
            if self.control_fd in events:
                data = b""
                with contextlib.suppress(OSError):
                    data = os.read(self.control_fd, 1)
                if data == _SHUTDOWN:
                    log.info("rank %s done; monitor exits", self.config.identity)
                    return True
                poller.unregister(self.control_fd)  # EOF: the parent is exiting
            if self.parent_fd in events:
                return self.on_parent_exit()
            now = time.monotonic()
            self.enforce_unwind_deadline(now)
            self.enforce_hard_timeout(now)
            self.publish_peers()

    def on_parent_exit(self) -> bool:
        """Reports the rank's death; returns whether it finished or its death is recorded."""
        # The report must not hang forever on an unreachable store.
        signal.alarm(REPORT_DEADLINE)
        _, _, _, _, finished = self.board.read()
        if finished:
            log.info("rank %s finished and exited", self.config.identity)
            return True
        if self.stuck_reason is not None:
            reason = self.stuck_reason
        elif self.kill_started is not None:
            reason = (
                f"killed by the hard timeout ({self.config.hard_timeout:.3g}s without progress)"
                f"{self.hard_timeout_where}"
            )
        else:
            reason = "process died"
        log.warning("rank %s: %s", self.config.identity, reason)
        try:
            self.store.mark_terminated(self.config.identity, reason)
        except Exception as ex:
            log.error("cannot record the death of rank %s: %s", self.config.identity, ex)
            return False
        return True

    def enforce_unwind_deadline(self, now: float) -> None:
        """Ends a rank whose main thread sleeps in the kernel instead of unwinding.

        The clock runs from when the abort that follows the restart exception
        has run (never inside ``atomic()``: the monitor thread sends it only outside) and is reset
        whenever the thread used any CPU since the last check or is runnable:
        a thread computing in a slow native call is not stuck, and comes back;
        neither is one that an overloaded machine gives a few percent of a core
        (it waits in the run queue, not in a native call).
        """
        started = self.board.unwind_started()
        if not started or self.config.unwind_timeout <= 0 or self.stuck_reason is not None:
            self.unwind = None
            return
        runnable, cpu = _thread_activity(self.task_dir)
        if self.unwind is None or self.unwind[0] != started:
            self.unwind = (started, max(started, now - self.config.interval), cpu)
            return
        _, busy_at, last_cpu = self.unwind
        if runnable or cpu > last_cpu:
            self.unwind = (started, now, cpu)
            return
        self.unwind = (started, busy_at, last_cpu)
        idle = now - max(started, busy_at)
        if idle < self.config.unwind_timeout:
            return
        where = _thread_location(self.task_dir, self.board.phase())
        self.stuck_reason = (
            f"stuck in native code after the abort{where}, ended after {now - started:.1f}s"
        )
        log.warning(
            "rank %s: main thread not back in the Wrapper %.2fs after the restart began%s:"
            " killing process %d",
            self.config.identity,
            now - started,
            where,
            self.config.parent_pid,
        )
        # The death is recorded with its reason before the kill: whoever sees the
        # process exit first (the job controller, the node's leader) would record a
        # plain "killed by SIGKILL", and the first record stands. (The rank is no
        # member from here: it is stuck, and killed next.)
        try:
            self.store.mark_terminated(self.config.identity, self.stuck_reason)
        except Exception as ex:
            log.warning("cannot record why rank %s is ended: %s", self.config.identity, ex)
        # Its signals may be blocked (and SIGTERM's handlers cannot run in a
        # thread stuck in C): only SIGKILL ends it.
        _send(self.config.parent_pid, signal.SIGCONT, signal.SIGKILL)

    def enforce_hard_timeout(self, now: float) -> None:
        _, _, _, _, finished = self.board.read()
        if finished:
            return
        pid = self.config.parent_pid
        if self.kill_started is None:
            stalled = now - self.board.last_progress()
            if stalled <= self.config.hard_timeout:
                return
            where = _thread_location(self.task_dir, self.board.phase())
            log.warning(
                "rank %s made no progress in the wrapped function for %.2fs (restarts do "
                "not reset this clock)%s: terminating process %d",
                self.config.identity,
                stalled,
                where,
                pid,
            )
            self.hard_timeout_where = where
            self.kill_started = now
            _send(pid, signal.SIGCONT, signal.SIGTERM)
        elif (
            not self.kill_escalated
            and now - self.kill_started >= self.config.termination_grace_time
        ):
            self.kill_escalated = True
            log.warning("process %d still alive after the grace time: killing it", pid)
            _send(pid, signal.SIGCONT, signal.SIGTERM, signal.SIGKILL)

    def publish_peers(self) -> None:
        """Tells the node leader the peers of the rank's new iteration (its rank hands
        them over on the board: no store read, never the membership)."""
        _, _, _, iteration, _ = self.board.read()
        if iteration == self.membership_iteration:
            return
        published = Peers.parse(self.board.read_text(), "board")
        if published is None or published.iteration != iteration:
            return  # not published yet: next time
        self.membership_iteration = iteration
        try:
            self.member.set_peers(published.peers)
        except OSError as ex:
            log.warning(
                "cannot tell the node leader the peers of rank %s: %s", self.config.identity, ex
            )


#: x86-64 numbers of the system calls a stuck thread is usually found in
_SYSCALLS = {
    0: "read", 1: "write", 7: "poll", 23: "select", 34: "pause", 35: "nanosleep",
    44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 61: "wait4",
    202: "futex", 230: "clock_nanosleep", 232: "epoll_wait", 270: "pselect6",
    271: "ppoll", 281: "epoll_pwait",
}  # fmt: skip


#: seconds a fault watch blocks in the store before it reads the counter again
FAULT_WATCH_CHUNK = 30.0
#: seconds between a fault watch's attempts to reach the store again
FAULT_WATCH_RETRY = 2.0


def _hear_faults(
    member: NodeMember, connect: Callable[[], Any], board: ProgressBoard, doorbell: int
) -> None:
    """Fault news: a thread of the monitor process that writes the call's fault count on
    the board, where the rank's monitor thread reads it (no store operation of its
    own), then rings the rank's doorbell so that it reads it at once.

    The count comes from the node leader's fault watch (:mod:`inprocess.node`),
    once read here from the store after joining the group (a fault before the
    join is in that read; one after it reaches this member's socket). Counts
    never go down on the board: a late one is dropped. While the leader's watch
    cannot reach the store the board says no watch runs, and the monitor thread
    reads the store itself.
    """
    best: int | None = None

    def publish(count: int | None) -> None:
        nonlocal best
        if count is None:
            board.write_faults_seen(None)
            return
        if best is not None and count < best:
            count = best
        best = count
        board.write_faults_seen(count)  # the count first: the ring says "read it"
        if doorbell >= 0:
            ring(doorbell)

    while True:
        try:
            store = connect()
            publish(store.fault_count())
            del store
            break
        except Exception as ex:
            log.warning("fault news: the store is unavailable (%s); retrying", ex)
            time.sleep(FAULT_WATCH_RETRY)
    while True:
        try:
            news = member.receive()
        except OSError:
            return  # the member left
        if news is not False:
            publish(news)


def _thread_activity(task_dir: str) -> tuple[bool, int]:
    """(runnable, user + system CPU time in clock ticks) of a thread; (False, 0) if unreadable.

    Runnable is the state ``R``: running or waiting for a core. A thread asleep
    in the kernel (``S``, ``D``) or stopped is not.
    """
    try:
        fields = procfs.read_stat(f"{task_dir}/stat")
        return fields[0] == "R", procfs.cpu_ticks(fields)
    except (OSError, IndexError, ValueError):
        return False, 0


def _thread_location(task_dir: str, phase: str | None = None) -> str:
    """Where the thread waits (the Wrapper's ``phase``, then what /proc tells
    cheaply: it may be restricted), as a parenthesized suffix."""
    parts = [f"in {phase}"] if phase else []
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"{task_dir}/syscall") as f:
            first = f.read().split()[0]
        if first not in ("running", "-1"):
            number = int(first)
            parts.append(f"in system call {_SYSCALLS.get(number, number)}")
    with contextlib.suppress(OSError):
        with open(f"{task_dir}/wchan") as f:
            wchan = f.read().strip()
        if wchan and wchan != "0":
            parts.append(f"wchan {wchan}")
    return f" ({', '.join(parts)})" if parts else ""


def _send(pid: int, *signals: signal.Signals) -> None:
    for sig in signals:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _configure_logging(config: MonitorConfig) -> None:
    logger = logging.getLogger("inprocess")
    logger.setLevel(config.log_level)
    logger.propagate = False
    if config.logfile:
        handler: logging.Handler = logging.FileHandler(
            config.logfile.format(rank=config.initial_rank)
        )
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s monitor[{config.initial_rank}] target_pid={config.parent_pid} "
            f"training_pid={config.parent_pid} "
            "%(levelname)s %(name)s: %(message)s"
        )
    )
    logger.addHandler(handler)


def _quiet_native_stderr() -> None:
    """Drops what native code writes to this process's stderr; Python keeps it.

    torch's store client writes its warnings to file descriptor 2, not
    through Python: one pair for every timed wait that ran out. This process's
    store waits no longer run out so (:mod:`inprocess.quiet_wait`), but a
    store that cannot be reached still makes it write. What this process has
    to say goes through Python's logging, which keeps the original stderr.
    """
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
        kept = os.dup(2)
        sys.stderr = os.fdopen(kept, "w", buffering=1, errors="backslashreplace")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


def _sanitize_after_fork(keep: set[int]) -> None:
    """Drops what a forked child inherited and must not use."""
    gc.freeze()  # no finalizer of a parent object may run (and close a reused fd)
    gc.disable()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    if hasattr(signal, "SIGRTMIN"):
        for sig in range(signal.SIGRTMIN, signal.SIGRTMAX + 1):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
    os.setsid()
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in list(logging.getLogger("inprocess").handlers):
        logging.getLogger("inprocess").removeHandler(handler)


def main() -> int:
    """Entry point of a monitor process started as a fresh interpreter."""
    config, fds = pickle.loads(sys.stdin.buffer.read())
    return run(config, fds)


def run(config: MonitorConfig, fds: _Fds) -> int:
    """The monitor process's life: connect, report ready, watch until done."""
    # Lifecycle is driven by the parent (pipe, pidfd), not by terminal signals.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    persist_signal.survive()  # (a scheduler's warning reaches every process of the job)
    # A fork of its rank would show the rank's command line: pgrep -f SCRIPT must
    # find the workers alone, so the title names the rank, never the script.
    set_title(
        f"inprocess monitor of rank {config.initial_rank} (worker pid {config.parent_pid})",
        "inproc-monitor",
    )
    _quiet_native_stderr()
    _configure_logging(config)
    try:
        guardian = _Guardian(config, fds)
    except ProcessLookupError:
        return 0  # the parent is already gone
    try:
        guardian.connect()
    except ProcessLookupError:
        # The rank is gone before this process was up (started beside it, see
        # MonitorProcess.start): connected to the store, its death is reported still.
        if guardian.store is None:
            log.error("rank %s is gone and the store unreachable", config.identity)
            return 1
        return 0 if guardian.on_parent_exit() else 1
    except Exception as ex:
        log.error("cannot connect to the store: %s", ex)
        return 1
    # A rank that is not waiting for this (it started it in the background and
    # died meanwhile) left no reader: its death is reported below, not lost here.
    with contextlib.suppress(OSError):
        os.write(fds.ready, _READY)
    os.close(fds.ready)
    log.info("monitoring rank %s (pid %d)", config.identity, config.parent_pid)
    guardian.leave(guardian.run())
    return 0


@contextlib.contextmanager
def _heartbeats_meanwhile(send: Callable[[], Any] | None, interval: float) -> Iterator[None]:
    """Calls ``send()`` now and every ``interval`` seconds until the block ends."""
    if send is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                send()
            except Exception as ex:  # the store is gone: the restart will say so
                log.warning("cannot send a heartbeat while the monitor process restarts: %s", ex)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="inprocess-heartbeat-bridge", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
