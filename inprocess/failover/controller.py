"""The job controller ("PrimeMaster"): runs one job's workers through faults.

One thread, one loop::

    state = load state.json (created by the supervisor)
    decision = start_job(state)   or, after a crash of ours, recover(state)
    loop:
        apply(decision): save the new state, then execute its actions
        events = process exits (pidfds) + failures the job reported in its store
        decision = handle_event(state, event) for each event
        stop once the policy says so; exit with the job's exit code

Every decision comes from :mod:`inprocess.failover.policy`; this module only
observes and acts. The state is saved before any action is taken on it, so a
controller killed at any point resumes from a state that describes what it
was doing (see :func:`inprocess.failover.policy.recover`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..security import keyed_namespace
from . import policy
from .backends import Backend, WorkerLaunch
from .backends.local import LocalBackend, process_start_time, read_exit_record
from .policy import (
    Action,
    Decision,
    Ignore,
    RelaunchNode,
    RelaunchWorker,
    RestartJob,
    Resume,
    StartJob,
    StopJob,
    WorkerExited,
    WorkerReported,
)
from .state import JobState, Stage, StateStore, WorkerStatus
from .store_server import StoreServer, start_store_server

log = logging.getLogger(__name__)

#: exit code of the controller when told to stop by Ctrl-C (other signals: 128 + signal)
INTERRUPTED_EXIT_CODE = 130
#: time a worker gets between SIGTERM and SIGKILL when stopped
STOP_GRACE = 5.0


def signal_exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal that stopped the job (SIGINT: 130)."""
    return 128 + int(signum)


def controller_pid_path(state_dir: Path) -> Path:
    return state_dir / "controller.pid"


def exits_dir(state_dir: Path) -> Path:
    return state_dir / "exits"


def namespace(job_id: str, generation: int) -> str:
    """Store namespace of a generation's Wrapper keys (``INPROCESS_STORE_NAMESPACE``).

    Keyed with the job's secret: a store client without it cannot name them.
    """
    return keyed_namespace(f"{job_id}/g{generation}")


class Controller:
    """Runs the job described by ``<state_dir>/state.json``."""

    def __init__(self, state_dir: Path, backend: Backend | None = None) -> None:
        self.state_dir = state_dir
        self.states = StateStore(state_dir)
        self.state: JobState = self.states.load()
        self.spec = self.state.spec
        self.backend: Backend = backend or LocalBackend(exits_dir(state_dir))
        self.server: StoreServer | None = None
        self._client: Any = None
        self._reported: set[str] = set()
        self._stop_signal: int | None = None

    # ---------------------------------------------------------------- main loop

    def run(self, recovering: bool) -> int:
        _write_pid_file(controller_pid_path(self.state_dir))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        now = time.time()
        if recovering:
            log.warning("controller restarted: recovering job %s", self.spec.job_id)
            self.apply(policy.recover(self.state, now=now))
        else:
            self.apply(policy.start_job(self.state, now=now))
        while self.state.stage is not Stage.STOPPED:
            if self.state.stage is Stage.STOPPING:
                self.finish()
                break
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                code, reason = signal_exit_code(self._stop_signal), f"stopped by {name}"
                if _launcher_gone():  # our SIGTERM came from the kernel (PR_SET_PDEATHSIG)
                    code, reason = policy.FAILURE_EXIT_CODE, "inprocess-run died: stopping the job"
                self.apply(policy.request_stop(self.state, code, reason, now=time.time()))
                continue
            for event in self.observe():
                self.apply(policy.handle_event(self.state, event, now=time.time()))
                if self.state.stage is not Stage.RUNNING:
                    break
        self.backend.close()
        code = (
            self.state.exit_code if self.state.exit_code is not None else policy.FAILURE_EXIT_CODE
        )
        log.info("job %s finished with exit code %d: %s", self.spec.job_id, code, self.state.reason)
        return code

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop_signal = signum

    # ---------------------------------------------------------------- deciding

    def commit(self, state: JobState) -> None:
        """Saves ``state`` (before anything is done about it) and makes it current."""
        if state is not self.state:
            self.states.save(state)
            self.state = state

    def apply(self, decision: Decision) -> None:
        self.commit(decision.state)
        for action in decision.actions:
            self.execute(action)

    def execute(self, action: Action) -> None:
        log.debug("executing %s", action)
        if isinstance(action, StartJob):
            self.start_generation()
        elif isinstance(action, RelaunchWorker):
            self.stop_workers([action.worker])
            self.start_worker(action.worker)
        elif isinstance(action, RelaunchNode):
            log.warning(
                "relaunching node %d: slot %d -> %d", action.node, action.from_slot, action.to_slot
            )
            self.stop_workers(list(action.workers))
            for worker in action.workers:
                self.start_worker(worker)
        elif isinstance(action, RestartJob):
            log.warning(
                "restarting the whole job (generation %d): %s", action.generation, action.reason
            )
            self.stop_workers(list(self.state.workers))
            self.start_generation()
        elif isinstance(action, StopJob):
            level = logging.INFO if action.exit_code == 0 else logging.WARNING
            log.log(
                level,
                "stopping job %s (exit code %d): %s",
                self.spec.job_id,
                action.exit_code,
                action.reason,
            )
            if self.state.stage is Stage.STOPPING:
                self.finish()
        elif isinstance(action, Resume):
            self.resume()
        elif isinstance(action, Ignore):
            log.debug("ignored: %s", action.reason)

    # ---------------------------------------------------------------- observing

    def observe(self) -> list[policy.Event]:
        """Waits one interval for process exits and polls the job's own reports."""
        events: list[policy.Event] = []
        for exit_ in self.backend.wait(self.spec.monitor_interval):
            worker = self._worker_of_pid(exit_.pid)
            if worker is None:
                continue
            record = self.state.workers[worker]
            events.append(WorkerExited(worker, record.incarnation, exit_.exit_code, exit_.signal))
        events.extend(self._reports())
        return events

    def _worker_of_pid(self, pid: int) -> int | None:
        for worker, record in self.state.workers.items():
            if record.pid == pid and record.status in (WorkerStatus.RUNNING, WorkerStatus.STOPPING):
                return worker
        return None

    def _reports(self) -> list[policy.Event]:
        """Failures the Wrapper recorded (ranks it declared terminated), and its presence."""
        client = self._store_client()
        if client is None:
            return []
        ns = f"inprocess/{namespace(self.spec.job_id, self.state.generation)}"
        events: list[policy.Event] = []
        try:
            if self.state.wrapper_managed is None and client.check([f"{ns}/wrapped"]):
                self.commit(policy.set_wrapper_managed(self.state, True, now=time.time()))
            key = f"{ns}/call0/terminated"
            if not client.check([key]):
                return []
            identities = [i for i in client.get(key).decode().split(",") if i]
        except Exception as ex:  # the store is restarting or gone: exits tell the rest
            log.debug("cannot read the job's reports: %s", ex)
            return []
        from ..store import incarnation_of, initial_rank_of

        for identity in identities:
            if identity in self._reported:
                continue
            self._reported.add(identity)
            worker, incarnation = initial_rank_of(identity), incarnation_of(identity)
            record = self.state.workers.get(worker)
            if record is not None and record.incarnation == incarnation:
                events.append(WorkerReported(worker, incarnation, "declared terminated by the job"))
        return events

    def _store_client(self) -> Any:
        if self.server is None:
            return None
        if self._client is None:
            import torch.distributed as dist

            try:
                self._client = dist.TCPStore(
                    self.server.host,
                    self.server.port,
                    None,
                    False,
                    timeout=datetime.timedelta(seconds=10),
                )
            except Exception as ex:
                log.debug("cannot connect to the store: %s", ex)
                return None
        return self._client

    # ---------------------------------------------------------------- acting

    def start_generation(self) -> None:
        """A new store server (a fresh key space) and every worker (a cold start)."""
        self._stop_server()
        self.server = start_store_server(self.spec.master_addr)
        state = self.state.copy()
        state.store = {
            "host": self.server.host,
            "port": self.server.port,
            "pid": self.server.pid,
            "start_time": process_start_time(self.server.pid),
            "generation": state.generation,
        }
        self.commit(state)
        self._reported.clear()
        for worker in sorted(self.state.workers):
            self.start_worker(worker)

    def start_worker(self, worker: int) -> None:
        record = self.state.workers[worker]
        slot = self.state.node_slots[record.node]
        launch = WorkerLaunch(
            worker=worker,
            incarnation=record.incarnation + 1,
            node=record.node,
            slot=slot,
            argv=(sys.executable, *self.spec.entrypoint),
            env=self.worker_env(worker, record.incarnation + 1, slot),
        )
        pid, start_time = self.backend.start(launch)
        self.commit(
            policy.worker_started(
                self.state, worker, pid=pid, start_time=start_time, now=time.time()
            )
        )

    def worker_env(self, worker: int, incarnation: int, slot: int) -> dict[str, str]:
        spec, server = self.spec, self.server
        assert server is not None
        env = dict(os.environ)
        env.update(
            RANK=str(worker),
            LOCAL_RANK=str(spec.local_rank_of(worker)),
            WORLD_SIZE=str(spec.world_size),
            LOCAL_WORLD_SIZE=str(spec.nproc_per_node),
            GROUP_RANK=str(spec.node_of(worker)),
            GROUP_WORLD_SIZE=str(spec.nnodes),
            ROLE_NAME="default",
            ROLE_RANK=str(worker),
            ROLE_WORLD_SIZE=str(spec.world_size),
            MASTER_ADDR=server.host,
            MASTER_PORT=str(server.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RUN_ID=spec.job_id,
            TORCHELASTIC_RESTART_COUNT=str(self.state.generation),
            TORCHELASTIC_MAX_RESTARTS=str(spec.job_max_restarts),
            INPROCESS_JOB_ID=spec.job_id,
            INPROCESS_STORE_NAMESPACE=namespace(spec.job_id, self.state.generation),
            INPROCESS_WORKER_INCARNATION=str(incarnation),
            INPROCESS_NODE_SLOT=str(slot),
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def stop_workers(self, workers: list[int]) -> None:
        pids = [
            r.pid
            for w, r in self.state.workers.items()
            if w in workers
            and r.pid is not None
            and r.status in (WorkerStatus.RUNNING, WorkerStatus.STOPPING)
        ]
        self.backend.stop([p for p in pids if p is not None], STOP_GRACE)

    def resume(self) -> None:
        """Re-attaches to the store server and to the workers that are still running."""
        store = self.state.store
        if store and process_start_time(store["pid"]) == store.get("start_time"):
            self.server = StoreServer(store["host"], store["port"], store["pid"])
        else:
            self.apply(
                policy.request_stop(
                    self.state,
                    policy.FAILURE_EXIT_CODE,
                    "the store server was lost while the controller was down",
                    now=time.time(),
                )
            )
            return
        for worker, record in sorted(self.state.workers.items()):
            if record.status is not WorkerStatus.RUNNING:
                continue
            assert record.pid is not None and record.pid_start_time is not None
            if self.backend.attach(record.pid, record.pid_start_time):
                log.info("re-attached to worker %d (pid %d)", worker, record.pid)
                continue
            log.warning(
                "worker %d (pid %d) ended while the controller was down", worker, record.pid
            )
            ended = read_exit_record(exits_dir(self.state_dir), record.pid)
            event = WorkerExited(worker, record.incarnation, ended.exit_code, ended.signal)
            self.apply(policy.handle_event(self.state, event, now=time.time()))

    def finish(self) -> None:
        """Stops every live worker and the store server; the job is STOPPED."""
        self.stop_workers(list(self.state.workers))
        self._stop_server()
        self.commit(policy.stopped(self.state, now=time.time()))

    def _stop_server(self) -> None:
        self._client = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        elif self.state.store:
            store = self.state.store
            if process_start_time(store["pid"]) == store.get("start_time"):
                StoreServer(store["host"], store["port"], store["pid"]).stop()


def _write_pid_file(path: Path) -> None:
    """Atomically, through a fresh temp file (mkstemp: O_EXCL, never a planted symlink)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, path)  # replaces a symlink at ``path`` itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _launcher_gone() -> bool:
    """Whether the supervisor that started us (``INPROCESS_SUPERVISOR_PID``) is gone."""
    expected = os.environ.get("INPROCESS_SUPERVISOR_PID")
    return bool(expected) and os.getppid() != int(expected)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="inprocess job controller (started by inprocess-run)"
    )
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--recover", action="store_true", help="resume after a controller crash")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s inprocess-run[controller] %(levelname)s %(message)s",
    )
    # The launcher's death ends the job: the kernel tells us with SIGTERM (handled
    # like any stop request). Set before anything else; if the launcher is
    # already gone, the signal would never come: stop at once.
    from .supervisor import die_with_parent

    expected = os.environ.get("INPROCESS_SUPERVISOR_PID")
    if not die_with_parent(signal.SIGTERM, int(expected) if expected else None):
        os.kill(os.getpid(), signal.SIGTERM)
    controller = Controller(args.state_dir)
    with contextlib.suppress(BrokenPipeError):
        return controller.run(recovering=args.recover)
    return policy.FAILURE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
