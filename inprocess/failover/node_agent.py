"""A node agent: ``inprocess-run`` on a machine that is not the coordinator's.

It keeps this machine's workers and warm standbys (:class:`.NodeWorkers`) and
does what the job's controller asks over the job's link (:mod:`.link`): start,
stop, watch. It reports every worker's exit as it happens and beats while it
lives, so the controller sees this machine's loss at once (the link closes) or
within :data:`~.backends.nodes.SILENCE` seconds (it falls silent).

When the link ends the agent keeps its workers running and connects again for
:data:`RECONNECT_GRACE` seconds: a controller that crashed is back within a
second or two (its supervisor restarts it) and adopts them. If nobody answers
by then, the coordinator's machine is taken for lost: the agent ends its
workers, says so in one line, and exits with :data:`COORDINATOR_LOST_EXIT`.

Threads: the main thread owns the workers (they are its children: the
kernel's ``PR_SET_PDEATHSIG`` is tied to it) and answers requests; a reader
thread turns the link's frames into a queue; a beat thread sends beats. Only
the main thread changes which link is current.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..proctitle import set_title
from .backends import ProcessExit, WorkerLaunch
from .link import BEAT_INTERVAL, Link, LinkError, Refused, connect
from .node_workers import NodeWorkers
from .runtime import signal_exit_code

log = logging.getLogger(__name__)

#: seconds an agent keeps its workers while no coordinator answers
RECONNECT_GRACE = 30.0
#: seconds without a frame from the coordinator after which its link is taken for dead
COORDINATOR_SILENCE = 10.0
#: exit code of an agent whose coordinator is gone (a scheduler may requeue on it)
COORDINATOR_LOST_EXIT = 69
#: exit code of an agent the coordinator refused (its arguments or secret differ)
REFUSED_EXIT = 2
#: seconds the workers get to end after SIGTERM before they are killed
STOP_GRACE = 5.0
#: seconds between two tries to reach the coordinator
RETRY_INTERVAL = 0.2


class CoordinatorUnreachable(Exception):
    """No coordinator answered at the endpoint within the time allowed."""


def _exit_frame(exit_: ProcessExit) -> list[Any]:
    return [exit_.pid, exit_.exit_code, exit_.signal, exit_.machinery]


class NodeAgent:
    """Serves the controller's requests for this machine's workers (main thread only)."""

    def __init__(
        self,
        endpoint: tuple[str, int],
        secret: str,
        hello: dict[str, Any],
        connect_timeout: float,
        locate: Callable[[], tuple[str, int] | None] | None = None,
        on_signal: Callable[[int], None] | None = None,
    ) -> None:
        #: where the coordinator is; with ``locate`` (an elected coordinator:
        #: :mod:`.etcd_member`) looked up again before each try to connect
        self.endpoint = endpoint
        self.locate = locate
        #: told of a stop signal first, before this machine's workers stop
        #: (an elected coordinator on this machine: :mod:`.etcd_member`)
        self.on_signal = on_signal
        self.secret = secret
        self.hello = dict(hello)
        self.connect_timeout = connect_timeout
        self.workers: NodeWorkers | None = None
        self.slot: int | None = None
        self._link: Link | None = None
        self._frames: queue.Queue[tuple[Link, dict[str, Any] | None, str | None]] = queue.Queue()
        self._stop = threading.Event()
        self._signal: int | None = None
        self._result: tuple[int, str] | None = None
        self._beats: threading.Thread | None = None

    @property
    def where(self) -> str:
        return f"{self.endpoint[0]}:{self.endpoint[1]}"

    # -- the link

    def _connect(self, deadline: float, first: bool) -> Link | None:
        """A link to the coordinator, tried until ``deadline``; ``None`` if none came.

        Raises:
            Refused: the coordinator refused this machine.
        """
        last: Exception | None = None
        while time.monotonic() < deadline and self._signal is None:
            if self.locate is not None:
                try:
                    found = self.locate()
                except Exception as ex:  # (etcd unavailable: tried again)
                    found, last = None, ex
                if found is None:
                    time.sleep(RETRY_INTERVAL)
                    continue
                self.endpoint = found
            try:
                link, reply = connect(
                    self.endpoint, self.secret, self.hello, timeout=min(5.0, self.connect_timeout)
                )
            except Refused:
                raise
            except (OSError, LinkError) as ex:
                last = ex
                time.sleep(RETRY_INTERVAL)
                continue
            self.slot = int(reply["slot"])
            self.hello["slot"] = self.slot  # a reconnect claims the same slot
            set_title(f"inprocess-run node agent of job {reply.get('job')} (slot {self.slot})")
            if reply.get("reconnect"):
                # joined at the start: the controller takes over once every machine is in
                # (the coordinator waits up to the same time for the last machine)
                if not self._await_go(link, time.monotonic() + 2 * self.connect_timeout + 30):
                    continue
                continue
            if first:
                log.info(
                    "joined job %s at %s as node slot %d", reply.get("job"), self.where, self.slot
                )
            else:
                log.warning("the coordinator at %s is back: reconnected", self.where)
            return link
        if last is not None:
            log.debug("no coordinator at %s: %s", self.where, last)
        return None

    def _await_go(self, link: Link, deadline: float) -> bool:
        """Waits on a start-up link for the word to connect to the controller."""
        import select

        try:
            while time.monotonic() < deadline and self._signal is None:
                select.select([link], [], [], 0.2)
                for frame in link.poll():
                    if frame.get("t") == "go":
                        return True
                    if frame.get("t") == "end":
                        raise Refused(str(frame.get("reason", "the job did not start")))
        except LinkError as ex:
            log.debug("start-up link ended: %s", ex)
        finally:
            link.close()
        return False

    def _use(self, link: Link) -> None:
        """Makes ``link`` the current one: its reader thread feeds the queue."""
        self._link = link

        def read() -> None:
            # Invariant: this thread only reads ``link`` and puts onto the queue.
            import select

            while not self._stop.is_set() and not link.closed:
                try:
                    ready, _, _ = select.select([link], [], [], 0.2)
                    if ready:
                        for frame in link.poll():
                            self._frames.put((link, frame, None))
                except (LinkError, OSError, ValueError) as ex:
                    self._frames.put((link, None, str(ex)))
                    return

        threading.Thread(target=read, name="inprocess-agent-read", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_INTERVAL):
            link = self._link
            if link is not None and not link.closed:
                with contextlib.suppress(LinkError):
                    link.beat()

    # -- the run

    def run(self) -> int:
        """Serves the job until its end; returns this launcher's exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            link = self._connect(time.monotonic() + self.connect_timeout, first=True)
        except Refused as ex:
            return self._refused(ex)
        if link is None:
            if self._signal is not None:
                return signal_exit_code(self._signal)
            raise CoordinatorUnreachable(
                f"no coordinator answered at {self.where} within {self.connect_timeout:g}s "
                "(is the coordinator's inprocess-run started, and is the address right?)"
            )
        assert self.slot is not None
        self.workers = NodeWorkers(self.slot)
        self._use(link)
        self._beats = threading.Thread(target=self._beat, name="inprocess-agent-beat", daemon=True)
        self._beats.start()
        try:
            return self._serve()
        finally:
            self._stop.set()
            if self._link is not None:
                self._link.close()
            self._beats.join()
            self.workers.shutdown(STOP_GRACE)

    def _serve(self) -> int:
        assert self.workers is not None
        while True:
            if self._signal is not None:
                return self._stopped_by_signal()
            if self._result is not None:
                return self._result[0]
            lost = self._handle_frames()
            link = self._link
            if lost is None and link is not None:
                silent = time.monotonic() - link.last_heard
                if silent > COORDINATOR_SILENCE:
                    lost = f"nothing from the coordinator for {silent:.1f}s"
            if lost is not None:
                code = self._reconnect(lost)
                if code is not None:
                    return code
                continue
            exits = self.workers.poll(0.05)
            if exits and self._link is not None:
                try:
                    self._link.send({"t": "exits", "x": [_exit_frame(e) for e in exits]})
                except LinkError:
                    pass  # the coordinator asks again after it reconnects (exit_of)

    def _handle_frames(self) -> str | None:
        """Answers the queued requests; returns why the current link ended, if it did."""
        while True:
            try:
                link, frame, error = self._frames.get_nowait()
            except queue.Empty:
                return None
            if link is not self._link:
                continue  # from a link replaced already
            if frame is None:
                return error or "the link ended"
            if "m" in frame:
                self._answer(link, frame)
            elif frame.get("t") == "end":
                self._result = (int(frame.get("code", 1)), str(frame.get("reason", "")))
                with contextlib.suppress(LinkError):
                    link.send({"t": "bye"})
                return None

    def _answer(self, link: Link, frame: dict[str, Any]) -> None:
        assert self.workers is not None
        method, args = str(frame["m"]), list(frame.get("a", []))
        try:
            result = self._dispatch(method, args)
        except Exception as ex:  # told to the controller, which decides
            log.warning("request %s failed: %s", method, ex)
            reply: dict[str, Any] = {"id": frame.get("id"), "e": f"{type(ex).__name__}: {ex}"}
        else:
            reply = {"id": frame.get("id"), "r": result}
        with contextlib.suppress(LinkError):
            link.send(reply)

    def _dispatch(self, method: str, args: list[Any]) -> Any:
        workers = self.workers
        assert workers is not None
        if method == "start":
            launch, env = args
            return list(
                workers.start(
                    WorkerLaunch(
                        worker=int(launch["worker"]),
                        incarnation=int(launch["incarnation"]),
                        node=int(launch["node"]),
                        slot=int(launch["slot"]),
                        argv=tuple(str(a) for a in launch["argv"]),
                        env={},
                        fresh=bool(launch.get("fresh")),
                    ),
                    {str(k): str(v) for k, v in env.items()},
                )
            )
        if method == "keep_standbys":
            count, env = args
            workers.keep_standbys(int(count), {str(k): str(v) for k, v in env.items()})
            return None
        if method == "standbys":
            return workers.standbys()
        if method == "running":
            return workers.running(int(args[0]), args[1])
        if method == "attach":
            return workers.attach(int(args[0]), float(args[1]))
        if method == "exit_of":
            found = workers.exit_of(int(args[0]))
            return None if found is None else _exit_frame(found)
        if method == "stop":
            workers.stop([int(p) for p in args[0]], float(args[1]))
            return None
        raise ValueError(f"no such request: {method!r}")

    def _reconnect(self, why: str) -> int | None:
        """The link ended: connects again within the grace; the exit code if not."""
        log.warning("lost the coordinator at %s (%s): reconnecting", self.where, why)
        if self._link is not None:
            self._link.close()
            self._link = None
        try:
            link = self._connect(time.monotonic() + RECONNECT_GRACE, first=False)
        except Refused as ex:
            return self._refused(ex)
        if link is None:
            if self._signal is not None:
                return self._stopped_by_signal()
            log.error(
                "the job's coordinator at %s is gone (no answer for %.0fs): ending this "
                "machine's workers; a requeue of the job resumes it from its persisted state",
                self.where,
                RECONNECT_GRACE,
            )
            return COORDINATOR_LOST_EXIT
        self._use(link)
        return None

    def _refused(self, ex: Refused) -> int:
        """This launcher's exit code when the coordinator refused it."""
        if ex.surplus:  # not a failure: the job runs without this machine
            log.warning("not needed by the job at %s: %s", self.where, ex)
            return 0
        log.error("the coordinator at %s refused this machine: %s", self.where, ex)
        return REFUSED_EXIT

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum
        if self.on_signal is not None:
            self.on_signal(signum)

    def _stopped_by_signal(self) -> int:
        assert self._signal is not None
        name = signal.Signals(self._signal).name
        log.warning("stopped by %s: ending this machine's workers", name)
        return signal_exit_code(self._signal)


def resolve(host: str, port: int) -> tuple[str, int]:
    """``(host, port)`` checked to resolve (a clear error names it otherwise)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as ex:
        raise CoordinatorUnreachable(
            f"the coordinator's address {host}:{port} does not resolve: {ex}"
        ) from None
    return host, port
