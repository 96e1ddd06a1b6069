"""Where worker processes run. The controller only needs this small interface.

A backend starts worker processes, stops them, attaches to processes started
by an earlier controller (after its crash), and reports exits. ``local`` runs
them on this machine; a multi-machine backend on an existing engine (Ray) can
implement the same four operations.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class WorkerLaunch:
    """Everything needed to start one worker process."""

    worker: int
    incarnation: int
    node: int
    slot: int
    argv: tuple[str, ...]
    env: dict[str, str]


@dataclasses.dataclass(frozen=True)
class ProcessExit:
    """An observed end of a worker process; both codes ``None`` when unknown."""

    pid: int
    exit_code: int | None
    signal: int | None


class Backend(Protocol):
    """What the controller needs from where workers run."""

    def start(self, launch: WorkerLaunch) -> tuple[int, float]:
        """Starts a worker; returns its pid and start time (for pid-reuse checks)."""

    def attach(self, pid: int, start_time: float) -> bool:
        """Watches a process started earlier; ``False`` if it is gone (or the pid was reused)."""

    def stop(self, pids: list[int], grace: float) -> None:
        """Terminates processes (SIGTERM, then SIGKILL after ``grace``) and waits for them."""

    def wait(self, timeout: float) -> list[ProcessExit]:
        """Exits of watched processes, waiting up to ``timeout`` seconds for the first."""

    def close(self) -> None:
        """Releases resources; processes keep running."""
