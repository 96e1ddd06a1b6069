"""Where worker processes run: the interface the job layer uses, and a factory by name.

The controller (:mod:`inprocess.failover.controller`) and the supervisor
(:mod:`inprocess.failover.supervisor`) use a backend only through
:class:`Backend` and :func:`create_backend`; neither imports a backend module.
``local`` (:mod:`.local`) runs the workers on this machine. A backend on
another engine (Ray, say) is a module of this package with a class that
implements :class:`Backend`, and one line in :data:`BACKENDS`.

The interface:

* ``start(launch) -> (pid, start_time)``: start one worker process
  (:class:`WorkerLaunch`: argv, env, worker, incarnation, node, slot). The pair
  is the process's identity, saved in the job's state: a pid alone may be reused.
* ``running(pid, start_time) -> bool``: whether that very process still runs.
* ``attach(pid, start_time) -> bool``: watch a process that an earlier
  controller started (after a controller crash); ``False`` if it is gone.
* ``wait(timeout) -> [ProcessExit]``: exits of the watched processes, waiting
  up to ``timeout`` seconds for the first. Every started or attached process
  is reported exactly once (stopped ones too).
* ``stop(pids, grace)``: SIGTERM (or the engine's equivalent), then a kill
  after ``grace`` seconds; returns once they are gone. Their exits are still
  reported by ``wait``.
* ``exit_of(pid) -> ProcessExit``: how a worker ended that ended while no
  controller watched it (codes ``None`` when nobody knows).
* ``record_exit(pid, status)``: the supervisor, the subreaper of the job's
  processes on the launching machine, reaped ``pid`` (a wait status); the
  backend keeps what ``exit_of`` needs. A backend whose workers are not
  children of the launching machine ignores it.
* ``clear_exit_records()``: the job is over; drop whatever ``record_exit`` kept.
* ``close()``: release the backend's own resources; workers keep running.

Optional, for an engine that sees machines come and go:

* a :class:`ProcessExit` from ``wait`` with ``lost`` set: the process ended
  because its machine (node) is gone; the controller then handles the loss of
  the node (``policy.NodeLost``) rather than failures of its workers.
* ``start_store_server(host) -> StoreServer``: hosts the job's store server
  somewhere that outlives a restart of the controller (by default the
  controller starts it as a process of its own).
* ``keep_standbys(slot, count, env)``: keeps ``count`` warm standby processes
  for the workers of node slot ``slot`` (``env``: the environment common to
  them), which ``start`` turns into workers of that slot
  (:mod:`inprocess.failover.standby`). ``close`` ends them. Called only with
  ``--standby`` > 0.
* ``workers_gpu() -> bool``: whether its workers have a GPU, so that a worker's
  exit code 75 is reported as a GPU fault only where there was one (without
  it the controller does not claim either).

A backend is built by :func:`create_backend` from its name and the job's state
directory (where it may keep files that outlive a controller). The methods are
called from the controller's (or supervisor's) main thread only.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Protocol

#: the backend of a job unless told otherwise
DEFAULT_BACKEND = "local"

#: backend name -> "module:class" (imported when asked for)
BACKENDS = {
    "local": "inprocess.failover.backends.local:LocalBackend",
    "nodes": "inprocess.failover.backends.nodes:NodesBackend",  # one inprocess-run per machine
    "ray": "inprocess.failover.backends.ray:RayBackend",  # needs the ``ray`` extra
}


@dataclasses.dataclass(frozen=True)
class WorkerLaunch:
    """Everything needed to start one worker process."""

    worker: int
    incarnation: int
    node: int
    slot: int
    argv: tuple[str, ...]
    env: dict[str, str]
    #: files its stdout / stderr are appended to (``None``: inherited, the console)
    stdout: str | None = None
    stderr: str | None = None
    #: a newly spawned process, never a warm standby (one in its place never joined)
    fresh: bool = False


@dataclasses.dataclass(frozen=True)
class ProcessExit:
    """An observed end of a worker process; both codes ``None`` when unknown."""

    pid: int
    exit_code: int | None
    signal: int | None
    #: set when the process's machine was lost (how): a node failure, not the worker's
    lost: str | None = None
    #: set when the process ended with a process of the job's machinery (how: its
    #: standby zygote, killed with it): relaunched, not counted as its failure
    machinery: str | None = None


class Backend(Protocol):
    """What the job layer needs from where workers run (see the module docstring)."""

    def start(self, launch: WorkerLaunch) -> tuple[int, float]:
        """Starts a worker; returns its pid and start time (for pid-reuse checks)."""

    def running(self, pid: int, start_time: float | None) -> bool:
        """Whether the process started as (``pid``, ``start_time``) still runs."""

    def attach(self, pid: int, start_time: float) -> bool:
        """Watches a process started earlier; ``False`` if it is gone (or the pid was reused)."""

    def stop(self, pids: list[int], grace: float) -> None:
        """Terminates processes (SIGTERM, then SIGKILL after ``grace``) and waits for them."""

    def wait(self, timeout: float) -> list[ProcessExit]:
        """Exits of watched processes, waiting up to ``timeout`` seconds for the first."""

    def exit_of(self, pid: int) -> ProcessExit:
        """How a worker ended while no controller watched it (codes ``None`` if unknown)."""

    def record_exit(self, pid: int, status: int) -> None:
        """Keeps how a process the supervisor reaped ended (``status``: a wait status)."""

    def clear_exit_records(self) -> None:
        """Drops the records of :meth:`record_exit` (the job is over)."""

    def close(self) -> None:
        """Releases resources; processes keep running."""


def create_backend(name: str, state_dir: Path) -> Backend:
    """The backend called ``name`` for the job whose state lives in ``state_dir``."""
    target = BACKENDS.get(name)
    if target is None:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    module, _, cls = target.partition(":")
    backend: Backend = getattr(importlib.import_module(module), cls)(state_dir)
    return backend
