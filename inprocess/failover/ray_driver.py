"""``inprocess-run --backend ray``: the launching process as the Ray driver.

The driver connects to a Ray cluster (``--ray-address`` or ``RAY_ADDRESS``;
without either, a local cluster already running or else a new one), then:

1. reserves one bundle per node slot (job nodes and spares) in a
   ``STRICT_SPREAD`` placement group: each slot is a different Ray node;
2. starts the job's host actor on its own node (store servers, node agents,
   see :mod:`inprocess.failover.backends.ray`) and an agent per slot;
3. runs the controller as a Ray actor on its own node too (the state dir is
   there), with ``max_restarts``: after a crash Ray restarts it and the driver
   asks it to recover from the state dir;
4. when the job ends (also on Ctrl-C or SIGTERM: the controller stops it in
   order), kills every actor of the job and removes the placement group.

It takes the place of the local backend's supervisor: Ray restarts the
controller, and the kernel ends the workers of a dead agent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from . import policy
from .backends.ray import (
    NAMESPACE,
    JobHost,
    controller_name,
    host_name,
)
from .controller import Controller, controller_pid_path, signal_exit_code
from .state import Stage, StateStore
from .supervisor import RUN_TOKEN_ENV, end_processes, record_end, run_processes

log = logging.getLogger(__name__)

#: how long the placement group (one Ray node per slot) may take to be placed
PLACEMENT_TIMEOUT = 120.0
#: time the workers get between SIGTERM and SIGKILL when the job is torn down
SHUTDOWN_GRACE = 5.0
#: driver environment variables passed on to every actor and worker (by prefix)
FORWARDED_ENV_PREFIXES = (
    "INPROCESS_",
    "TORCH",
    "NCCL_",
    "GLOO_",
    "OMP_",
    "PYTHONWARNINGS",
    "RES_OPTIONS",
)
#: the bundle reserved on each node slot unless --ray-bundle says otherwise
DEFAULT_BUNDLE = {"CPU": 1}


class ControllerActor:
    """The job controller in a Ray actor (pinned to the driver's node, restarted by Ray)."""

    def __init__(self, state_dir: str, log_level: str, env: dict[str, str]) -> None:
        self.state_dir = Path(state_dir)
        # The job's variables (id, run token, store secret), for this dedicated
        # process and the workers' environment the controller builds from it.
        os.environ.update(env)
        logging.basicConfig(
            level=log_level,
            format="%(asctime)s inprocess-run[controller] %(levelname)s %(message)s",
        )

    def run(self, recovering: bool) -> int:
        from .backends.ray import RayBackend

        controller = Controller(self.state_dir, RayBackend(self.state_dir))
        return controller.run(recovering=recovering)


def connect(address: str | None) -> dict[str, Any]:
    """Connects this process to Ray (``address``, ``RAY_ADDRESS``, a local one or a new one).

    Returns the driver's Ray node id and IP address.
    """
    import ray

    ray.init(
        address=address or os.environ.get("RAY_ADDRESS") or None,
        namespace=NAMESPACE,
        log_to_driver=True,
        logging_level=logging.WARNING,
    )
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
    }


#: largest amount of one resource in ``--ray-bundle`` (bytes of memory included)
MAX_RESOURCE = 1e15


def parse_bundle(text: str | None) -> dict[str, float]:
    """``--ray-bundle`` (a JSON object of Ray resources per node slot)."""
    if text is None:
        return dict(DEFAULT_BUNDLE)
    try:
        bundle = json.loads(text)
    except (ValueError, RecursionError):
        bundle = None
    if (
        not isinstance(bundle, dict)
        or not bundle
        or not all(
            isinstance(k, str)
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and 0 < v <= MAX_RESOURCE  # (false for nan; no float() of a huge int)
            for k, v in bundle.items()
        )
    ):
        raise ValueError(
            f"--ray-bundle must be a JSON object of resource amounts in (0, {MAX_RESOURCE:g}], "
            f'e.g. \'{{"CPU": 1, "GPU": 8}}\', got {text[:100]!r}'
        )
    return bundle


class RayDriver:
    """Runs one job on the Ray cluster this process is connected to (see the module doc)."""

    def __init__(
        self,
        state_dir: Path,
        node: dict[str, Any],
        bundle: dict[str, float],
        log_level: str,
        max_controller_restarts: int,
        run_token: str,
    ) -> None:
        self.state_dir = state_dir
        self.spec = StateStore(state_dir).load().spec
        self.node = node
        self.bundle = bundle
        self.log_level = log_level
        self.max_controller_restarts = max_controller_restarts
        self.run_token = run_token
        self.placement_group: Any = None
        self.host: Any = None
        self.controller: Any = None
        self._signal: int | None = None

    def job_env(self) -> dict[str, str]:
        """Variables of the driver's environment the job's actors and workers get.

        Passed as arguments rather than as a Ray ``runtime_env``: a runtime env
        costs a dedicated worker process start per actor (seconds each).
        """
        return {
            k: v
            for k, v in os.environ.items()
            if k.startswith(FORWARDED_ENV_PREFIXES) or k == RUN_TOKEN_ENV
        }

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            return self._run()
        finally:
            self.shutdown()

    def _on_signal(self, signum: int, frame: object) -> None:
        """Ctrl-C, SIGTERM or SIGHUP: the controller stops the job in order (same node)."""
        self._signal = signum
        pid = self._controller_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _controller_pid(self) -> int | None:
        """The pid of the live controller actor (on this node), if it wrote it."""
        try:
            pid = int(controller_pid_path(self.state_dir).read_text())
            if psutil.Process(pid).environ().get(RUN_TOKEN_ENV) == self.run_token:
                return pid
        except (OSError, ValueError, psutil.Error):
            pass
        return None

    def _run(self) -> int:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = self.spec
        here = NodeAffinitySchedulingStrategy(node_id=self.node["node_id"], soft=False)
        env = self.job_env()
        slots = spec.num_slots
        self.placement_group = placement_group(
            [dict(self.bundle) for _ in range(slots)],
            strategy="STRICT_SPREAD",
            name=f"{spec.job_id}/nodes",
        )
        if not self._wait(self.placement_group.ready(), PLACEMENT_TIMEOUT):
            return self._give_up(
                f"the Ray cluster has no {slots} nodes ({spec.nnodes} job node(s) + "
                f"{spec.spare_nodes} spare(s)) each with {self.bundle} free within "
                f"{PLACEMENT_TIMEOUT:.3g}s (one placement group bundle per node, STRICT_SPREAD)"
            )
        self.host = (
            ray.remote(JobHost)
            .options(
                name=host_name(spec.job_id),
                namespace=NAMESPACE,
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=here,
            )
            .remote(spec.job_id, self.placement_group, slots, env)
        )
        # The controller's process starts meanwhile (a Ray worker importing torch).
        self.controller = (
            ray.remote(ControllerActor)
            .options(
                name=controller_name(spec.job_id),
                namespace=NAMESPACE,
                num_cpus=0,
                max_restarts=self.max_controller_restarts,
                max_task_retries=0,
                scheduling_strategy=here,
            )
            .remote(str(self.state_dir), self.log_level, env)
        )
        try:
            where = ray.get(self.host.start_agents.remote())
        except Exception as ex:
            return self._give_up(f"cannot start the node agents: {ex}")
        for slot, w in enumerate(where):
            log.info("node slot %d: Ray node %s (%s)", slot, w["node_id"], w["ip"])
        # Where each slot started (for people and tests): <state-dir>/ray_nodes.json
        nodes = {str(slot): w for slot, w in enumerate(where)}
        (self.state_dir / "ray_nodes.json").write_text(json.dumps(nodes, indent=1))
        return self._supervise()

    def _wait(self, ref: Any, timeout: float) -> bool:
        """Waits for ``ref`` in short steps (signal handlers run in between)."""
        import ray

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._signal is not None:
                return False
            ready, _ = ray.wait([ref], timeout=0.2)
            if ready:
                return True
        return False

    def _supervise(self) -> int:
        """Runs the controller; after a crash of its actor (Ray restarts it), has it recover.

        Ray enforces ``max_restarts``: once used up, the actor is dead for good
        and the job is given up.
        """
        import ray

        crashes = 0
        while True:
            ref = self.controller.run.remote(crashes > 0)
            while not self._wait(ref, 3600.0):
                if self._signal is not None and self._controller_pid() is None:
                    # no controller to stop the job: stop it here
                    code = signal_exit_code(self._signal)
                    name = signal.Signals(self._signal).name
                    record_end(self.state_dir, code, f"stopped by {name}")
                    return code
                time.sleep(0.1)
            try:
                return int(ray.get(ref))
            except ray.exceptions.RayError as ex:
                state = StateStore(self.state_dir).load()
                if state.stage is Stage.STOPPED:
                    return state.exit_code if state.exit_code is not None else 1
                crashes += 1
                log.error(
                    "the controller actor died (%s) while the job was %s (crash %d)",
                    type(ex).__name__,
                    state.stage.value,
                    crashes,
                )
                if not self._wait_restarted():
                    return self._give_up(
                        f"the controller actor died and was not restarted "
                        f"(max_restarts={self.max_controller_restarts}): giving up the job"
                    )

    def _wait_restarted(self, timeout: float = 60.0) -> bool:
        """Waits until Ray has restarted the controller actor; False if it will not."""
        import ray

        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._signal is None:
            try:
                ray.get(self.controller.__ray_ready__.remote(), timeout=5)
                return True
            except unavailable:
                time.sleep(0.2)  # restarting
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayActorError:
                if unavailable:
                    return False  # dead for good (max_restarts used up)
                # Ray before ActorUnavailableError (< 2.2x) raises this while the
                # actor restarts too: only the timeout tells
                time.sleep(0.2)
        return False

    def _give_up(self, reason: str) -> int:
        if self._signal is not None:
            code = signal_exit_code(self._signal)
            reason = f"stopped by {signal.Signals(self._signal).name}"
        else:
            code = policy.FAILURE_EXIT_CODE
        log.error("%s", reason)
        record_end(self.state_dir, code, reason)
        return code

    def shutdown(self) -> None:
        """No actor, worker process or placement group of the job outlives it.

        Order: the workers first (the agents stop them), then the actors, then
        the placement group, then the connection; each step is bounded.
        """
        import ray

        if self.controller is not None:  # normally done already (its run returned)
            with contextlib.suppress(Exception):
                ray.kill(self.controller, no_restart=True)
        if self.host is not None:
            try:
                ray.get(self.host.shutdown.remote(SHUTDOWN_GRACE), timeout=SHUTDOWN_GRACE + 40)
            except Exception as ex:
                log.warning("the job's host actor did not shut down in order: %s", ex)
            with contextlib.suppress(Exception):
                ray.kill(self.host, no_restart=True)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.placement_group)
        self._wait_actors_gone()
        state = StateStore(self.state_dir).load()
        if state.stage is not Stage.STOPPED:
            record_end(self.state_dir, policy.FAILURE_EXIT_CODE, "the driver ended the job")
        with contextlib.suppress(Exception):
            ray.shutdown()
        # Whatever of this run is still on this machine (never another run's).
        end_processes(run_processes(self.run_token), grace=SHUTDOWN_GRACE)

    def _wait_actors_gone(self, timeout: float = 20.0) -> None:
        import ray

        prefix = f"{self.spec.job_id}/"
        deadline = time.monotonic() + timeout
        left: list[str] = []
        while time.monotonic() < deadline:
            try:
                left = [
                    a["name"] if isinstance(a, dict) else str(a)
                    for a in ray.util.list_named_actors(all_namespaces=True)
                ]
            except Exception:
                return
            left = [n for n in left if n.startswith(prefix)]
            if not left:
                return
            time.sleep(0.1)
        log.warning("actors of the job still listed by Ray: %s", left)
