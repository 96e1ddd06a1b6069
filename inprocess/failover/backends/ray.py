"""The ``ray`` backend: a node of the job is a Ray node (``pip install 'inprocess[ray]'``).

Who runs where (all actors in the Ray namespace :data:`NAMESPACE`, named after the job):

* ``<job>/host`` (:class:`JobHost`, on the driver's node): owns the node
  agents and hosts the job's store servers, so both outlive a restart of the
  controller actor. Store servers are its children and die with it.
* ``<job>/agent<slot>`` (:class:`NodeAgent`, one per node slot, spares
  included): pinned to its bundle of the job's ``STRICT_SPREAD`` placement
  group, so each slot is a different Ray node. It starts and watches that
  node's worker processes with the local backend's process code; the workers
  are SIGKILLed by the kernel when the agent's process dies. It keeps the
  node's warm standbys (``--standby``) with the local backend's standby pool
  (:mod:`inprocess.failover.standby`): they die with the agent too.
* the controller actor (:mod:`inprocess.failover.ray_driver`) uses
  :class:`RayBackend`, which implements :class:`~inprocess.failover.backends.Backend`
  by calling the agents.

Node loss is seen by the controller itself, within about a second or two and
at Ray's default health-check settings: each agent keeps a TCP heartbeat link
to the controller (:mod:`.heartbeat`), whose end or silence means the agent is
gone. Ray's own signs are kept as a backstop: an agent whose actor died, or
whose node the GCS reports dead (only after Ray's health check, ~15 s at its
defaults). Its workers are then
reported as exits with ``lost`` set, which the controller handles as the
loss of the node (a relaunch on a spare slot, not counted as failures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import ray

from ..node_workers import (  # noqa: F401 (AGENT_DIR_PREFIX, remove_ended_agents_dirs: tests)
    AGENT_DIR_PREFIX,
    PLACEHOLDER_PID,
    NodeWorkers,
    remove_ended_agents_dirs,
    split_worker_pid,
    worker_pid,
)
from ..store_server import SpareStoreServer, StoreServer, start_store_server
from . import ProcessExit, WorkerLaunch
from .heartbeat import HeartbeatServer, HeartbeatWatch
from .local import kill_on_parent_death

log = logging.getLogger(__name__)

#: the Ray namespace of every actor of every job (names carry the job id)
NAMESPACE = "inprocess"
#: how long a call to an agent may take before the agent is treated as unreachable
CALL_TIMEOUT = 30.0
#: how long a new agent may take to start on its node
AGENT_START_TIMEOUT = 60.0
#: how often the GCS is asked which nodes are dead
NODE_CHECK_INTERVAL = 1.0


def host_name(job_id: str) -> str:
    return f"{job_id}/host"


def agent_name(job_id: str, slot: int) -> str:
    return f"{job_id}/agent{slot}"


def controller_name(job_id: str) -> str:
    return f"{job_id}/controller"


class NodeAgent(NodeWorkers):
    """Starts and watches the worker processes of one node (a Ray actor).

    Single-threaded (a plain Ray actor): its methods run one at a time, on the
    process's main thread, which lives as long as the process: the workers'
    ``PR_SET_PDEATHSIG`` (tied to the forking thread) fires only when the
    agent's process dies.
    """

    def __init__(self, job_id: str, slot: int) -> None:
        super().__init__(slot)
        self.job_id = job_id
        # beats from a thread of its own: a busy method of this actor does not silence it
        self._heartbeat = HeartbeatServer(ray.util.get_node_ip_address())

    def where(self) -> dict[str, Any]:
        """This agent's Ray node id, IP address and pid."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "raylet_pid": os.getppid(),  # Ray workers are children of their node's raylet
            "heartbeat": list(self._heartbeat.address),
        }

    def shutdown(self, grace: float) -> None:
        """Stops every worker of this node (the job is over)."""
        super().shutdown(grace)
        self._heartbeat.close()


class JobHost:
    """Owns the node agents and the store servers of one job (a Ray actor on the driver's node).

    A Ray actor dies with its owner: agents created here survive a restart of
    the controller actor, and die with this actor (and it with the driver).
    """

    def __init__(
        self,
        job_id: str,
        placement_group: Any,
        num_slots: int,
        env: dict[str, str],
    ) -> None:
        self.job_id = job_id
        self.placement_group = placement_group
        self.num_slots = num_slots
        # The job's variables, for the store servers (this process is the actor's own).
        os.environ.update(env)
        self._agents: dict[int, Any] = {}
        self._stores: list[StoreServer] = []
        self._spare: SpareStoreServer | None = None

    def start_agents(self) -> list[dict[str, Any]]:
        """An agent on every slot, started together; returns where each runs."""
        for slot in range(self.num_slots):
            if slot not in self._agents:
                self._agents[slot] = self._new_agent(slot)
        return [self.agent(slot)[1] for slot in range(self.num_slots)]

    def _new_agent(self, slot: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return (
            ray.remote(NodeAgent)
            .options(
                name=agent_name(self.job_id, slot),
                namespace=NAMESPACE,
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group,
                    placement_group_bundle_index=slot,
                ),
            )
            .remote(self.job_id, slot)
        )

    def agent(self, slot: int) -> tuple[Any, dict[str, Any]]:
        """The live agent of ``slot`` (a new one if it died) and where it runs.

        Raises:
            RuntimeError: no agent could be started on the slot's bundle within
                :data:`AGENT_START_TIMEOUT` (no Ray node to place it on).
        """
        handle = self._agents.get(slot)
        if handle is not None:
            try:
                return handle, ray.get(handle.where.remote(), timeout=AGENT_START_TIMEOUT)
            except (ray.exceptions.RayError, TimeoutError):
                with contextlib.suppress(Exception):
                    ray.kill(handle)
                self._agents.pop(slot, None)
        handle = self._new_agent(slot)
        try:
            where = ray.get(handle.where.remote(), timeout=AGENT_START_TIMEOUT)
        except (ray.exceptions.RayError, TimeoutError) as ex:
            ray.kill(handle)
            raise RuntimeError(
                f"no agent could start on node slot {slot} within {AGENT_START_TIMEOUT:.3g}s "
                f"(no Ray node for its placement group bundle?): {ex}"
            ) from ex
        self._agents[slot] = handle
        log.info("agent of slot %d runs on node %s (%s)", slot, where["node_id"], where["ip"])
        return handle, where

    def forget(self, slot: int) -> None:
        """The agent of ``slot`` is gone (its node died)."""
        handle = self._agents.pop(slot, None)
        if handle is not None:
            with contextlib.suppress(Exception):
                ray.kill(handle)

    def start_store_server(self, host: str, spare: bool = False) -> StoreServer:
        """A store server, child of this actor, killed by the kernel if this actor dies.

        With ``spare``, the next one is started ahead (the next call returns it)."""
        self._stores = [s for s in self._stores if s.alive()]
        server = None
        if self._spare is not None and self._spare.host == host:
            server = self._spare.take(die_with_parent=True)
            self._spare = None
        if server is None:
            server = start_store_server(host, preexec_fn=kill_on_parent_death)
        self._stores.append(server)
        if spare and self._spare is None:
            self._spare = SpareStoreServer(host, preexec_fn=kill_on_parent_death)
        return server

    def shutdown(self, grace: float) -> None:
        """Stops every worker (through the agents), kills the agents and the store servers."""
        refs = {slot: h.shutdown.remote(grace) for slot, h in self._agents.items()}
        for slot, ref in refs.items():
            try:
                ray.get(ref, timeout=grace + CALL_TIMEOUT)
            except (ray.exceptions.RayError, TimeoutError) as ex:
                log.warning("agent of slot %d did not shut down: %s", slot, ex)
        for handle in self._agents.values():
            with contextlib.suppress(Exception):
                ray.kill(handle)
        self._agents.clear()
        for server in self._stores:
            server.stop()
        self._stores.clear()
        if self._spare is not None:
            self._spare.discard()
            self._spare = None


def _died(ex: BaseException) -> bool:
    """Whether ``ex`` says an actor is dead for good (not merely unreachable for now)."""
    unavailable = getattr(ray.exceptions, "ActorUnavailableError", None)
    if unavailable is not None and isinstance(ex, unavailable):
        return False
    return isinstance(ex, ray.exceptions.RayActorError)


class RayBackend:
    """Workers on the Ray nodes of the job's placement group (controller side).

    Built by the controller actor (``create_backend("ray", state_dir)``) on the
    driver's node; finds the job's host actor by name, and through it the agents.
    Methods are called from the controller's thread only. The pids it takes and
    gives are slot-qualified (:func:`worker_pid`); the agents see plain pids.
    """

    def __init__(self, state_dir: Path) -> None:
        from ..state import StateStore

        self._states = StateStore(state_dir)
        spec = self._states.load().spec
        self.job_id = spec.job_id
        self.num_slots = spec.num_slots
        self.host = ray.get_actor(host_name(self.job_id), namespace=NAMESPACE)
        self._agents: dict[int, Any] = {}
        self._nodes: dict[int, str] = {}  # slot -> Ray node id of its agent
        self._watches: dict[int, HeartbeatWatch] = {}  # slot -> its agent's heartbeat link
        self._watched: set[int] = set()  # qualified pids of started or attached workers
        self._polls: dict[int, Any] = {}  # slot -> the poll call in flight
        self._lost: list[ProcessExit] = []
        self._last_node_check = 0.0
        self._base_env = dict(os.environ)
        self._placeholders = 0
        self.standby = spec.standby

    # -- agents

    def _agent(self, slot: int) -> Any:
        """The agent of ``slot``; the host starts a new one if it is gone."""
        handle = self._agents.get(slot)
        if handle is None:
            handle, where = ray.get(self.host.agent.remote(slot), timeout=AGENT_START_TIMEOUT + 10)
            self._agents[slot] = handle
            self._nodes[slot] = where["node_id"]
            self._watch(slot, where)
        return handle

    def _existing_agent(self, slot: int) -> Any | None:
        """The live agent of ``slot`` if there is one (never starts one)."""
        if slot in self._agents:
            return self._agents[slot]
        try:
            handle = ray.get_actor(agent_name(self.job_id, slot), namespace=NAMESPACE)
            where = ray.get(handle.where.remote(), timeout=CALL_TIMEOUT)
        except (ValueError, ray.exceptions.RayError, TimeoutError):
            return None
        self._agents[slot] = handle
        self._nodes[slot] = where["node_id"]
        self._watch(slot, where)
        return handle

    def _watch(self, slot: int, where: dict[str, Any]) -> None:
        """Opens the heartbeat link to the agent of ``slot`` (replacing an old one)."""
        old = self._watches.pop(slot, None)
        if old is not None:
            old.close()
        try:
            self._watches[slot] = HeartbeatWatch((where["heartbeat"][0], where["heartbeat"][1]))
        except OSError as ex:  # reached its agent through Ray but not directly: Ray's signs only
            log.warning("no heartbeat link to the agent of node slot %d: %s", slot, ex)

    def _check_heartbeats(self) -> None:
        """Agents whose heartbeat link ended or fell silent are lost (Ray not asked)."""
        for slot, watch in list(self._watches.items()):
            reason = watch.check()
            if reason is not None:
                self._lose(slot, f"the agent of node slot {slot}: {reason}")

    def _call(self, slot: int, method: str, *args: Any) -> Any:
        return ray.get(getattr(self._agent(slot), method).remote(*args), timeout=CALL_TIMEOUT)

    def _lose(self, slot: int, reason: str) -> None:
        """The agent of ``slot`` is gone: its workers are reported lost with ``reason``."""
        log.warning("node slot %d lost: %s", slot, reason)
        self._agents.pop(slot, None)
        self._nodes.pop(slot, None)
        self._polls.pop(slot, None)
        watch = self._watches.pop(slot, None)
        if watch is not None:
            watch.close()
        with contextlib.suppress(Exception):
            self.host.forget.remote(slot)
        for pid in sorted(self._watched):
            if split_worker_pid(pid)[0] == slot:
                self._watched.discard(pid)
                self._lost.append(ProcessExit(pid, None, None, lost=reason))

    def _check_nodes(self) -> None:
        """Agents whose Ray node the GCS reports dead are lost (also when a call would hang)."""
        now = time.monotonic()
        if now - self._last_node_check < NODE_CHECK_INTERVAL or not self._nodes:
            return
        self._last_node_check = now
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception as ex:  # the GCS is unreachable for now: ask again later
            log.debug("cannot list Ray nodes: %s", ex)
            return
        for slot, node in list(self._nodes.items()):
            if node not in alive:
                self._lose(slot, f"Ray node {node} is dead")

    # -- Backend

    def _job_env(self, env: dict[str, str]) -> dict[str, str]:
        """The job's variables only: the rest of the environment is the node's own."""
        job = {k: v for k, v in env.items() if self._base_env.get(k) != v}
        job.update({k: v for k, v in env.items() if k.startswith("INPROCESS_")})
        return job

    def keep_standbys(self, slot: int, count: int, env: dict[str, str]) -> None:
        """Asks the agent of ``slot`` (if it runs) to keep ``count`` warm standbys."""
        handle = self._existing_agent(slot)
        if handle is None:
            return
        try:
            ray.get(handle.keep_standbys.remote(count, self._job_env(env)), timeout=CALL_TIMEOUT)
        except (ray.exceptions.RayError, TimeoutError) as ex:
            log.warning("no standbys on node slot %d: %s", slot, ex)

    def start(self, launch: WorkerLaunch) -> tuple[int, float]:
        env = self._job_env(launch.env)
        bare = WorkerLaunch(
            launch.worker,
            launch.incarnation,
            launch.node,
            launch.slot,
            launch.argv,
            {},
            fresh=launch.fresh,
        )
        try:
            handle = self._agent(launch.slot)
        except (RuntimeError, ray.exceptions.RayError, TimeoutError) as ex:
            # No machine for this slot (its node was lost and Ray has none to
            # replace it): a placeholder process, lost at once, so that the
            # policy decides (another relaunch within its limits, or the end).
            self._placeholders += 1
            pid = worker_pid(launch.slot, PLACEHOLDER_PID + self._placeholders)
            self._lost.append(ProcessExit(pid, None, None, lost=f"node slot {launch.slot}: {ex}"))
            return pid, 0.0
        pid, start_time = ray.get(handle.start.remote(bare, env), timeout=CALL_TIMEOUT)
        qualified = worker_pid(launch.slot, pid)
        self._watched.add(qualified)
        return qualified, start_time

    def running(self, pid: int, start_time: float | None) -> bool:
        if pid not in self._watched:
            return False
        slot, local = split_worker_pid(pid)
        try:
            return bool(self._call(slot, "running", local, start_time))
        except (ray.exceptions.RayError, TimeoutError):
            return False

    def attach(self, pid: int, start_time: float) -> bool:
        """Adopts a worker of an earlier controller. One whose agent is gone is adopted
        too, and reported lost with its node by the next :meth:`wait`."""
        slot, local = split_worker_pid(pid)
        if not 0 <= slot < self.num_slots:
            return False
        handle = self._existing_agent(slot)
        if handle is None:
            self._watched.add(pid)
            self._lose(slot, f"the agent of node slot {slot} is gone")
            return True
        try:
            if ray.get(handle.attach.remote(local, start_time), timeout=CALL_TIMEOUT):
                self._watched.add(pid)
                return True
        except (ray.exceptions.RayError, TimeoutError) as ex:
            if _died(ex):
                self._watched.add(pid)
                self._lose(slot, f"the agent of node slot {slot} died: {type(ex).__name__}")
                return True
        return False

    def stop(self, pids: list[int], grace: float) -> None:
        by_slot: dict[int, list[int]] = {}
        for pid in pids:
            if pid in self._watched:
                slot, local = split_worker_pid(pid)
                by_slot.setdefault(slot, []).append(local)
        refs = {}
        for slot, slot_pids in by_slot.items():
            handle = self._agents.get(slot)
            if handle is not None:
                refs[slot] = handle.stop.remote(slot_pids, grace)
        for slot, ref in refs.items():
            try:
                ray.get(ref, timeout=grace + CALL_TIMEOUT)
            except (ray.exceptions.RayError, TimeoutError) as ex:
                log.warning("cannot stop the workers of slot %d: %s", slot, ex)

    def wait(self, timeout: float) -> list[ProcessExit]:
        """Polls every agent in use once (one call in flight per agent), up to ``timeout``."""
        deadline = time.monotonic() + timeout
        self._check_heartbeats()
        self._check_nodes()
        for slot in {split_worker_pid(pid)[0] for pid in self._watched}:
            if slot not in self._polls and slot in self._agents:
                self._polls[slot] = self._agents[slot].poll.remote()
        exits, self._lost = self._lost, []
        if self._polls:
            ready, _ = ray.wait(
                list(self._polls.values()), num_returns=len(self._polls), timeout=timeout
            )
            ready_set = set(ready)
            for slot, ref in list(self._polls.items()):
                if ref not in ready_set:
                    continue  # still in flight: collected by a later wait
                del self._polls[slot]
                try:
                    polled = ray.get(ref)
                except ray.exceptions.RayError as ex:
                    if _died(ex):
                        self._lose(slot, f"the agent of node slot {slot} died: {type(ex).__name__}")
                    continue
                for exit_ in polled:
                    qualified = dataclasses.replace(exit_, pid=worker_pid(slot, exit_.pid))
                    if qualified.pid in self._watched:
                        self._watched.discard(qualified.pid)
                        exits.append(qualified)
            exits += self._lost
            self._lost = []
        if not exits:
            time.sleep(max(0.0, deadline - time.monotonic()))
        return exits

    def exit_of(self, pid: int) -> ProcessExit:
        slot, local = split_worker_pid(pid)
        handle = self._existing_agent(slot) if 0 <= slot < self.num_slots else None
        if handle is not None:
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                found = ray.get(handle.exit_of.remote(local), timeout=CALL_TIMEOUT)
                if found is not None:
                    return dataclasses.replace(found, pid=pid)
        return ProcessExit(pid, None, None)

    def record_exit(self, pid: int, status: int) -> None:
        """Workers are children of the agents, never of the launching machine."""

    def clear_exit_records(self) -> None:
        """Nothing kept on this machine."""

    def start_store_server(self, host: str) -> StoreServer:
        """The store server is hosted by the job's host actor: it outlives this controller."""
        server: StoreServer = ray.get(
            self.host.start_store_server.remote(host, self.standby > 0), timeout=90
        )
        return server

    def close(self) -> None:
        self._polls.clear()
        for watch in self._watches.values():
            watch.close()
        self._watches.clear()
