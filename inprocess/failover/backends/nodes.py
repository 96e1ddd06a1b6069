"""The ``nodes`` backend: one ``inprocess-run`` per machine, no cluster engine.

The coordinator's ``inprocess-run`` (node rank 0, or one started with
``--coordinator-only``) runs the controller and the job's store; every other
machine's ``inprocess-run`` is a node agent (:mod:`..node_agent`) that keeps
that machine's workers. Agents connect to the coordinator over the job's link
(:mod:`..link`): authenticated with the job's secret, each one on the node
slot it was given when it joined (:mod:`..multinode`).

The controller side, :class:`NodesBackend`, implements
:class:`~inprocess.failover.backends.Backend`:

* the coordinator's own slot (unless ``--coordinator-only``) through the
  local backend, exactly as a one-machine job;
* every other slot through requests on its agent's link; the agent pushes
  its workers' exits as they happen.

A machine is lost when its link closes (its launcher is gone: the kernel
closed the socket), fails, or stays silent for :data:`SILENCE` seconds (each
side beats every :data:`~..link.BEAT_INTERVAL`); its workers are then
reported with ``lost`` set, which the controller handles as the loss of the
node (a relaunch on a hot spare). A machine that joins later (a hot spare, a
requeued one) is given a free slot.

The listening socket belongs to the coordinator's launcher, which outlives
the controller: a new controller (after a crash) accepts on the same socket,
and the agents, which keep their workers while they reconnect, come back to it.

Threads: an accept thread does handshakes (so a stranger that says nothing
cannot stall the controller) and queues authentic hellos; a beat thread
beats on every link. Everything else runs on the controller's thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ...node import NODE_ENV
from ...security import JOB_SECRET_ENV
from ..link import BEAT_INTERVAL, Handshake, Link, LinkError, accept
from ..node_workers import PLACEHOLDER_PID, split_worker_pid, worker_pid
from . import ProcessExit, WorkerLaunch
from .local import LocalBackend

log = logging.getLogger(__name__)

#: how a refusal of a machine the job has no room for ends
SURPLUS = "this machine is one too many"
#: seconds without a frame from an agent after which its machine is lost
SILENCE = 3.0
#: how long a request to an agent may take before its machine is taken for lost
CALL_TIMEOUT = 30.0
#: seconds a new controller waits for the agents of its running workers to reconnect
RECONNECT_WAIT = 20.0
#: the file of the coordinator's settings in the job's state directory
NODES_FILE = "nodes.json"
#: the environment variable with the listening socket's descriptor (the launcher's)
LISTEN_FD_ENV = "INPROCESS_NODES_LISTEN_FD"
#: environment variables that are each machine's own, never sent to an agent
MACHINE_ENV = (
    JOB_SECRET_ENV,
    "INPROCESS_RUN_TOKEN",
    "INPROCESS_SUPERVISOR_PID",
    "INPROCESS_LAUNCHER",
    "INPROCESS_STORE_OWNER",
    "INPROCESS_USER_DIR",
    NODE_ENV,
    LISTEN_FD_ENV,
)
#: the arguments every machine of a job must agree on (hello key -> flag shown)
AGREED = {
    "entrypoint": "the script and its arguments",
    "run_as": "-m/--no-python",
    "nproc_per_node": "--nproc-per-node",
    "nnodes": "--nnodes",
    "spare_nodes": "--spare-nodes (or --nnodes MIN:MAX)",
}


@dataclasses.dataclass(frozen=True)
class NodesConfig:
    """The coordinator's settings, written by its launcher into :data:`NODES_FILE`."""

    #: the coordinator machine's own slot (``None``: ``--coordinator-only``)
    own_slot: int | None
    #: slot -> the agent id that holds it, as joined at the start
    joined: dict[int, str]
    #: what every agent's hello must carry (:data:`AGREED`)
    agreed: dict[str, Any]

    def to_json(self) -> str:
        """One line of JSON (also what an etcd job keeps in etcd)."""
        data = {
            "own_slot": self.own_slot,
            "joined": {str(k): v for k, v in self.joined.items()},
            "agreed": self.agreed,
        }
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodesConfig:
        data = json.loads(text)
        return cls(
            own_slot=data["own_slot"],
            joined={int(k): str(v) for k, v in data["joined"].items()},
            agreed=data["agreed"],
        )

    def save(self, state_dir: Path) -> None:
        path = state_dir / NODES_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, state_dir: Path) -> NodesConfig:
        return cls.from_json((state_dir / NODES_FILE).read_text())


def difference(agreed: dict[str, Any], hello: dict[str, Any]) -> str | None:
    """What differs between an agent's arguments and the coordinator's, in words."""
    theirs = hello.get("args", {})
    for key, flag in AGREED.items():
        if key in agreed and theirs.get(key) != agreed[key]:
            return (
                f"{flag} differs: {theirs.get(key)!r} on this machine, "
                f"{agreed[key]!r} at the coordinator"
            )
    return None


@dataclasses.dataclass
class _Agent:
    slot: int
    link: Link
    agent_id: str
    name: str


class Acceptor:
    """Accepts agents' connections in a thread of its own; queues authentic hellos.

    Invariant: the thread only accepts, handshakes and puts onto :attr:`joins`;
    whoever takes from the queue answers (welcome or refuse) on its thread.
    """

    def __init__(self, listener: socket.socket, secret: str, job_id: str) -> None:
        self.listener = listener
        self.joins: queue.Queue[tuple[Handshake, dict[str, Any]]] = queue.Queue()
        self._secret = secret
        self._job_id = job_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inprocess-accept", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.listener], [], [], 0.2)
            except (OSError, ValueError):
                return
            if not ready:
                continue
            try:
                shake = accept(self.listener, self._secret, self._job_id)
            except OSError:
                continue
            try:
                hello = shake.hello()
            except LinkError as ex:
                log.warning("refused a connection: %s", ex)
                continue
            if hello.get("job") not in (None, self._job_id):  # (None: any job will do)
                shake.refuse(
                    f"this coordinator runs job {self._job_id!r}, not {hello.get('job')!r}"
                )
                continue
            self.joins.put((shake, hello))

    def close(self) -> None:
        """Stops accepting; the handshakes nobody answered are closed."""
        self._stop.set()
        self._thread.join()
        while True:
            try:
                shake, _ = self.joins.get_nowait()
            except queue.Empty:
                return
            shake.sock.close()


class NodesBackend:
    """Workers on the machines whose agents joined the job (controller side)."""

    def __init__(self, state_dir: Path) -> None:
        from ..state import StateStore

        state = StateStore(state_dir).load()
        self.spec = state.spec
        self.config = NodesConfig.load(state_dir)
        self.local = LocalBackend(state_dir)
        fd = int(os.environ[LISTEN_FD_ENV])
        self._listener = socket.socket(fileno=os.dup(fd))  # (a dup is not inheritable)
        os.set_inheritable(fd, False)  # the workers and servers started here never get it
        self._acceptor = Acceptor(self._listener, os.environ[JOB_SECRET_ENV], self.spec.job_id)
        self._agents: dict[int, _Agent] = {}
        self._lock = threading.Lock()  # guards _agents against the beat thread
        self._watched: set[int] = set()  # qualified pids of remote workers
        self._pending: list[ProcessExit] = []
        self._responses: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        self._placeholders = 0
        self._lost_slots: set[int] = set()  # slots whose machine was lost (free for another)
        self._back: list[tuple[int, str]] = []  # lost slots with a machine again, unreported
        #: slot -> (count, env) of the standbys the controller wants there
        self._standbys: dict[int, tuple[int, dict[str, str]]] = {}
        self._base_env = dict(os.environ)
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="inprocess-beat", daemon=True)
        self._beats.start()
        # The machines the nodes run on come back first (they joined at the start, or
        # reconnect after a controller's crash); a lost slot or a spare is not waited for.
        self._await(set(state.node_slots.values()) - {self.config.own_slot}, RECONNECT_WAIT)

    # -- agents

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_INTERVAL):
            with self._lock:
                links = [a.link for a in self._agents.values()]
            for link in links:
                with contextlib.suppress(LinkError):
                    link.beat()

    def _await(self, slots: set[int], timeout: float) -> None:
        """Admits joining agents until those of ``slots`` are back, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while not slots <= set(self._agents) and time.monotonic() < deadline:
            try:
                shake, hello = self._acceptor.joins.get(timeout=0.1)
            except queue.Empty:
                continue
            self._admit(shake, hello)

    def _admit_waiting(self) -> None:
        while True:
            try:
                shake, hello = self._acceptor.joins.get_nowait()
            except queue.Empty:
                return
            self._admit(shake, hello)

    def _admit(self, shake: Handshake, hello: dict[str, Any]) -> None:
        """Welcomes an authentic agent on a slot, or refuses it with the reason."""
        problem = difference(self.config.agreed, hello)
        if problem is not None:
            log.warning("refused the machine %s (%s): %s", hello.get("name"), shake.peer, problem)
            shake.refuse(problem)
            return
        agent_id = str(hello.get("agent"))
        slot = self._slot_for(hello, agent_id)
        if isinstance(slot, str):
            log.warning("refused the machine %s (%s): %s", hello.get("name"), shake.peer, slot)
            shake.refuse(slot, surplus=slot.endswith(SURPLUS))
            return
        try:
            link = shake.welcome({"slot": slot, "job": self.spec.job_id})
        except LinkError as ex:
            log.warning("the machine %s left while joining: %s", hello.get("name"), ex)
            return
        with self._lock:
            old = self._agents.pop(slot, None)
            self._agents[slot] = _Agent(slot, link, agent_id, str(hello.get("name", shake.peer)))
        if old is not None:
            old.link.close()
        if slot in self._standbys:
            self._send_standbys(slot)
        if slot in self._lost_slots:
            self._lost_slots.discard(slot)
            self._back.append((slot, f"machine {hello.get('name', shake.peer)} joined"))
        log.info("machine %s (%s) is node slot %d", hello.get("name"), shake.peer, slot)

    def _slot_for(self, hello: dict[str, Any], agent_id: str) -> int | str:
        """The slot of a joining agent, or why it cannot have one."""
        slots = range(self.spec.num_slots)
        claimed = hello.get("slot")
        if isinstance(claimed, int) and claimed in slots and claimed != self.config.own_slot:
            holder = self._agents.get(claimed)
            if holder is None or holder.agent_id == agent_id:
                return claimed
        for slot, holder in self.config.joined.items():
            if holder == agent_id and slot not in self._agents:
                return slot
        for slot, agent in self._agents.items():
            if hello.get("agent") and agent.agent_id == agent_id:
                # the same machine again: the answer to its earlier handshake was
                # lost (it gave up waiting on a busy controller); its slot, with
                # the new link (the old one is closed by _admit)
                return slot
        rank = hello.get("node_rank")
        if isinstance(rank, int):  # its own slot, if that is free (a requeued machine's)
            if rank in self._agents or rank == self.config.own_slot:
                return f"node rank {rank} has joined already (two machines with one node rank?)"
            if rank not in slots:
                return f"node rank {rank} is not one of this job's 0..{len(slots) - 1}"
            if rank in self.config.joined and rank not in self._lost_slots:
                return f"node rank {rank} is kept for the machine that joined as it"
            return rank
        # slots nobody held first, then those whose machine was lost (a requeued one)
        taken = set(self._agents) | set(self.config.joined.keys()) | {self.config.own_slot}
        free = [s for s in slots if s not in taken]
        free += sorted(s for s in self._lost_slots if s not in self._agents)
        if not free:
            return (
                f"the job has no free node slot ({self.spec.nnodes} node(s) + "
                f"{self.spec.spare_nodes} spare(s), all taken): {SURPLUS}"
            )
        return free[0]

    def _lose(self, slot: int, reason: str) -> None:
        """The machine of ``slot`` is gone: its workers are reported lost with ``reason``."""
        with self._lock:
            agent = self._agents.pop(slot, None)
        if agent is not None:
            log.warning("node slot %d (%s) lost: %s", slot, agent.name, reason)
            agent.link.close()
        self._lost_slots.add(slot)
        for pid in sorted(self._watched):
            if split_worker_pid(pid)[0] == slot:
                self._watched.discard(pid)
                self._pending.append(ProcessExit(pid, None, None, lost=reason))

    def _pump(self, timeout: float) -> None:
        """Reads every agent's frames (waiting up to ``timeout`` for one); loses the
        machines whose link ended or fell silent."""
        self._admit_waiting()
        links = {a.link: slot for slot, a in self._agents.items()}
        if links:
            poller = select.poll()  # (no FD_SETSIZE limit: a job may have many machines)
            for link in links:
                poller.register(link.fileno(), select.POLLIN)
            with contextlib.suppress(InterruptedError):
                poller.poll(timeout * 1000)
        elif timeout > 0:
            time.sleep(timeout)
        now = time.monotonic()
        for link, slot in links.items():
            try:
                frames = link.poll()
            except LinkError as ex:
                self._lose(slot, f"its link closed ({ex}): the machine's inprocess-run is gone")
                continue
            for frame in frames:
                self._on_frame(slot, frame)
            if now - link.last_heard > SILENCE:
                self._lose(slot, f"nothing heard for {now - link.last_heard:.1f}s")

    def _on_frame(self, slot: int, frame: dict[str, Any]) -> None:
        if "id" in frame:
            self._responses[int(frame["id"])] = frame
        elif frame.get("t") == "exits":
            for pid, code, sig, machinery in frame.get("x", []):
                qualified = worker_pid(slot, int(pid))
                if qualified in self._watched:
                    self._watched.discard(qualified)
                    self._pending.append(ProcessExit(qualified, code, sig, machinery=machinery))

    def _call(self, slot: int, method: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        """One request to the agent of ``slot``; its result.

        Raises:
            LinkError: no agent, or it was lost before answering.
            RuntimeError: the agent could not do it (its error).
        """
        return self._result(slot, self._request(slot, method, *args), method, timeout)

    def _request(self, slot: int, method: str, *args: Any) -> int:
        """Sends a request to the agent of ``slot``; its id (for :meth:`_result`)."""
        agent = self._agents.get(slot)
        if agent is None:
            raise LinkError(f"no machine on node slot {slot}")
        self._next_id += 1
        ident = self._next_id
        try:
            agent.link.send({"id": ident, "m": method, "a": list(args)})
        except LinkError as ex:
            self._lose(slot, str(ex))
            raise
        return ident

    def _result(self, slot: int, ident: int, method: str, timeout: float) -> Any:
        """The answer to request ``ident`` of the agent of ``slot`` (see :meth:`_call`)."""
        agent = self._agents.get(slot)
        if agent is None and ident not in self._responses:
            raise LinkError(f"node slot {slot} was lost")
        deadline = time.monotonic() + timeout
        while ident not in self._responses:
            if self._agents.get(slot) is not agent:
                raise LinkError(f"node slot {slot} was lost")
            if time.monotonic() > deadline:
                self._lose(slot, f"no answer to {method} within {timeout:g}s")
                raise LinkError(f"node slot {slot} did not answer")
            self._pump(0.05)
        reply = self._responses.pop(ident)
        if "e" in reply:
            raise RuntimeError(f"node slot {slot}: {reply['e']}")
        return reply.get("r")

    def _remote(self, slot: int) -> bool:
        return slot != self.config.own_slot

    def _job_env(self, env: dict[str, str]) -> dict[str, str]:
        """The job's variables only (the rest is each machine's own environment)."""
        job = {k: v for k, v in env.items() if self._base_env.get(k) != v}
        job.update({k: v for k, v in env.items() if k.startswith("INPROCESS_")})
        for key in MACHINE_ENV:
            job.pop(key, None)
        return job

    # -- Backend

    def start(self, launch: WorkerLaunch) -> tuple[int, float]:
        if not self._remote(launch.slot):
            pid, start_time = self.local.start(launch)
            return worker_pid(launch.slot, pid), start_time
        self._admit_waiting()
        request = {
            "worker": launch.worker,
            "incarnation": launch.incarnation,
            "node": launch.node,
            "slot": launch.slot,
            "argv": list(launch.argv),
            "fresh": launch.fresh,
        }
        try:
            pid, start_time = self._call(launch.slot, "start", request, self._job_env(launch.env))
        except (LinkError, RuntimeError) as ex:
            # No machine on this slot: a placeholder, lost at once, so that the policy
            # decides (a relaunch on a hot spare within its limits, or the end).
            self._placeholders += 1
            qualified = worker_pid(launch.slot, PLACEHOLDER_PID + self._placeholders)
            self._pending.append(ProcessExit(qualified, None, None, lost=str(ex)))
            return qualified, 0.0
        qualified = worker_pid(launch.slot, int(pid))
        self._watched.add(qualified)
        return qualified, float(start_time)

    def keep_standbys(self, slot: int, count: int, env: dict[str, str]) -> None:
        if not self._remote(slot):
            self.local.keep_standbys(slot, count, env)
            return
        # kept for a machine that joins later (a hot spare, a requeued one): warm at once
        self._standbys[slot] = (count, self._job_env(env))
        if slot in self._agents:
            self._send_standbys(slot)

    def _send_standbys(self, slot: int) -> None:
        count, env = self._standbys[slot]
        try:
            self._call(slot, "keep_standbys", count, env)
        except (LinkError, RuntimeError) as ex:
            log.warning("no standbys on node slot %d: %s", slot, ex)

    def started_warm(self, pid: int) -> bool:
        slot, local = split_worker_pid(pid)
        return not self._remote(slot) and self.local.started_warm(local)

    def workers_gpu(self) -> bool:
        return self.local.workers_gpu() if self.config.own_slot is not None else False

    def running(self, pid: int, start_time: float | None) -> bool:
        slot, local = split_worker_pid(pid)
        if not self._remote(slot):
            return self.local.running(local, start_time)
        if pid not in self._watched:
            return False
        try:
            return bool(self._call(slot, "running", local, start_time))
        except (LinkError, RuntimeError):
            return False

    def attach(self, pid: int, start_time: float) -> bool:
        """Adopts a worker of an earlier controller; one whose machine did not come
        back is adopted too, and reported lost by the next :meth:`wait`."""
        slot, local = split_worker_pid(pid)
        if not 0 <= slot < self.spec.num_slots:
            return False
        if not self._remote(slot):
            return self.local.attach(local, start_time)
        if slot not in self._agents:
            self._watched.add(pid)
            self._lose(slot, "its machine did not reconnect after the controller's restart")
            return True
        try:
            if self._call(slot, "attach", local, start_time):
                self._watched.add(pid)
                return True
        except LinkError:
            self._watched.add(pid)
            self._lose(slot, "its machine was lost")
            return True
        except RuntimeError:
            pass
        return False

    def stop(self, pids: list[int], grace: float) -> None:
        by_slot: dict[int, list[int]] = {}
        for pid in pids:
            slot, local = split_worker_pid(pid)
            by_slot.setdefault(slot, []).append(local)
        own = by_slot.pop(self.config.own_slot, None) if self.config.own_slot is not None else None
        # every machine stops its workers at once: the requests first, then the answers
        asked = {}
        for slot, local_pids in by_slot.items():
            if slot in self._agents:
                with contextlib.suppress(LinkError):
                    asked[slot] = self._request(slot, "stop", local_pids, grace)
        for slot, ident in asked.items():
            try:
                self._result(slot, ident, "stop", grace + CALL_TIMEOUT)
            except (LinkError, RuntimeError) as ex:
                log.warning("cannot stop the workers of node slot %d: %s", slot, ex)
        if own:
            self.local.stop(own, grace)

    def wait(self, timeout: float) -> list[ProcessExit]:
        deadline = time.monotonic() + timeout
        exits: list[ProcessExit] = []
        while True:
            if self.config.own_slot is not None:
                exits += [
                    dataclasses.replace(e, pid=worker_pid(self.config.own_slot, e.pid))
                    for e in self.local.wait(0)
                ]
            left = deadline - time.monotonic()
            self._pump(max(0.0, min(0.02, left)) if not exits else 0.0)
            exits += self._pending
            self._pending = []
            if exits or time.monotonic() >= deadline:
                return exits

    def exit_of(self, pid: int) -> ProcessExit:
        slot, local = split_worker_pid(pid)
        if not self._remote(slot):
            return dataclasses.replace(self.local.exit_of(local), pid=pid)
        with contextlib.suppress(LinkError, RuntimeError):
            found = self._call(slot, "exit_of", local) if slot in self._agents else None
            if found is not None:
                return ProcessExit(pid, found[1], found[2], machinery=found[3])
        return ProcessExit(pid, None, None)

    def record_exit(self, pid: int, status: int) -> None:
        self.local.record_exit(pid, status)

    def clear_exit_records(self) -> None:
        self.local.clear_exit_records()

    def returned_slots(self) -> list[tuple[int, str]]:
        """Slots lost earlier that have a machine again, and how (each reported once)."""
        back, self._back = self._back, []
        return back

    def end_job(self, code: int, reason: str) -> None:
        """The job is over: every agent is told, ends its machine's workers and exits."""
        for slot, agent in list(self._agents.items()):
            try:
                agent.link.send({"t": "end", "code": code, "reason": reason})
            except LinkError as ex:
                log.debug("node slot %d: %s", slot, ex)

    def close(self) -> None:
        self._stop.set()
        self._beats.join()
        self._acceptor.close()
        with self._lock:
            agents, self._agents = dict(self._agents), {}
        for agent in agents.values():
            agent.link.close()
        self._listener.close()
        self.local.close()
