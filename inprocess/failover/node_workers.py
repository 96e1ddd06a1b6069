"""The worker processes of one machine of a multi-machine job, kept by its node agent.

Used by both node agents: a Ray actor (:mod:`.backends.ray`) and an
``inprocess-run`` started on the machine (:mod:`.node_agent`). It starts and
watches the machine's workers and warm standbys with the local backend's
process code; the workers get SIGKILL from the kernel when the agent's
process dies (``PR_SET_PDEATHSIG``), so a machine's agent and its workers end
together.

Also the pids the controller sees: processes of different machines may have
the same pid (containers number theirs from 1), so the job layer knows a
worker by its pid qualified by its node slot (:func:`worker_pid`).

Invariant: one thread (the one that made the object, and lives as long as the
process) calls every method: the workers' ``PR_SET_PDEATHSIG`` is tied to the
thread that forked them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from ..userdir import user_dir
from .backends import ProcessExit, WorkerLaunch
from .backends.local import LocalBackend
from .processes import process_start_time
from .standby import common_env

#: Linux's pid_max is at most 2**22: a pid fits in this many bits
PID_BITS = 23
#: "pids" of workers that could not be started for want of a machine (above any real pid)
PLACEHOLDER_PID = 1 << 22
#: a node agent's working directory in this user's private directory: ``agent-<pid>-*``
AGENT_DIR_PREFIX = "agent-"


def worker_pid(slot: int, pid: int) -> int:
    """The pid by which the controller knows process ``pid`` of node slot ``slot``
    (also what ``state.json`` records); :func:`split_worker_pid` reverses it."""
    return (slot + 1) << PID_BITS | pid


def split_worker_pid(qualified: int) -> tuple[int, int]:
    """``(slot, pid on that slot's machine)`` of a pid from :func:`worker_pid`."""
    return (qualified >> PID_BITS) - 1, qualified & ((1 << PID_BITS) - 1)


def agent_dir() -> Path:
    """A fresh working directory for this process's node agent, in this user's
    private directory (else the temporary directory); first removes those of
    agents that ended without cleaning up (killed)."""
    try:
        parent = user_dir()
    except OSError:
        return Path(tempfile.mkdtemp(prefix=f"inprocess-{AGENT_DIR_PREFIX}"))
    remove_ended_agents_dirs(Path(parent))
    return Path(tempfile.mkdtemp(prefix=f"{AGENT_DIR_PREFIX}{os.getpid()}-", dir=parent))


def remove_ended_agents_dirs(parent: Path) -> None:
    """Removes ``parent``'s agent directories whose process has ended (a pid that
    lives, maybe reused, keeps its directory: a leftover, never a live one removed)."""
    for path in parent.glob(f"{AGENT_DIR_PREFIX}*-*"):
        pid = path.name[len(AGENT_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or not path.is_dir() or path.is_symlink():
            continue
        if int(pid) == os.getpid() or process_start_time(int(pid)) is not None:
            continue
        shutil.rmtree(path, ignore_errors=True)


class NodeWorkers:
    """Starts and watches the worker processes and standbys of one machine (node slot)."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self._dir = agent_dir()
        # never waits for a zygote: the controller's calls to an agent have a deadline
        self._backend = LocalBackend(self._dir, die_with_parent=True, zygote_wait=0.0)
        self._started: dict[int, float] = {}  # pid -> start time, of every worker started here
        self._exits: dict[int, ProcessExit] = {}  # every exit seen here (for exit_of)
        self._unreported: list[ProcessExit] = []

    def start(self, launch: WorkerLaunch, env: dict[str, str]) -> tuple[int, float]:
        """Starts a worker with this machine's environment plus the job's ``env``."""
        full_env = dict(os.environ)
        full_env.update(env)
        # (the console's output: this machine's own; files of the coordinator's are not here)
        pid, start_time = self._backend.start(
            dataclasses.replace(launch, env=full_env, stdout=None, stderr=None)
        )
        self._started[pid] = start_time
        return pid, start_time

    def keep_standbys(self, count: int, env: dict[str, str]) -> None:
        """Keeps ``count`` warm standbys with this machine's environment plus the job's
        common ``env``; replaced in the background on every :meth:`poll`."""
        full_env = dict(os.environ)
        full_env.update(env)
        self._backend.keep_standbys(self.slot, count, common_env(full_env))

    def standbys(self) -> list[int]:
        """Pids of this machine's standbys (tests)."""
        return self._backend.standbys.standbys(self.slot)

    def poll(self, timeout: float = 0.0) -> list[ProcessExit]:
        """Exits seen since the last poll, waiting up to ``timeout`` for the first."""
        self._collect(timeout)
        exits, self._unreported = self._unreported, []
        return exits

    def _collect(self, timeout: float = 0.0) -> None:
        for exit_ in self._backend.wait(timeout):
            self._exits[exit_.pid] = exit_
            self._unreported.append(exit_)

    def running(self, pid: int, start_time: float | None) -> bool:
        return pid in self._started and process_start_time(pid) == start_time

    def attach(self, pid: int, start_time: float) -> bool:
        """Whether ``pid`` is a live worker of this machine (a new controller adopts it)."""
        self._collect()
        return self._started.get(pid) == start_time and pid not in self._exits

    def exit_of(self, pid: int) -> ProcessExit | None:
        self._collect()
        return self._exits.get(pid)

    def stop(self, pids: list[int], grace: float) -> None:
        self._backend.stop([p for p in pids if p in self._started], grace)

    def live(self) -> list[int]:
        """Pids of the workers started here that have not ended (as far as seen)."""
        return [pid for pid in self._started if pid not in self._exits]

    def shutdown(self, grace: float) -> None:
        """Stops every worker of this machine and its standbys (the job is over)."""
        self._backend.stop(list(self._started), grace)
        self._collect()
        self._backend.close()
        shutil.rmtree(self._dir, ignore_errors=True)
