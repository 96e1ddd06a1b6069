"""The suite's jobs of real rank processes: :mod:`inprocess.tools.local_job` with
the worker scripts of ``tests/workers`` and the repository importable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from inprocess._net import free_port
from inprocess.tools import local_job
from inprocess.tools.fork_template import ForkTemplate
from inprocess.tools.local_job import MARKER, JobResult, RankResult, job_processes

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"

__all__ = [
    "MARKER",
    "REPO",
    "WORKERS",
    "Job",
    "JobResult",
    "RankResult",
    "free_port",
    "job_processes",
    "machine_is_busy",
    "run_job",
]

#: a 1-minute load average from which a 2-core machine counts as busy with other
#: jobs: speed bounds then only tell "no timeout waited out" (speed is benchmarked)
BUSY_LOAD = 4.0


def machine_is_busy() -> bool:
    """Whether other jobs load this machine (see :data:`BUSY_LOAD`)."""
    return os.getloadavg()[0] >= BUSY_LOAD


#: this test process's fork template (started for the session by conftest.py):
#: the suite's ranks are forked from it, not each paying ``import torch``
TEMPLATE: ForkTemplate | None = None


def start_template() -> ForkTemplate:
    """The fork template for the suite's jobs (their start-up environment)."""
    global TEMPLATE
    TEMPLATE = ForkTemplate(local_job.base_env(REPO))
    return TEMPLATE


class Job(local_job.Job):
    """A job of ``script``: a name in ``tests/workers`` or a path; its ranks are
    forked from the session's :data:`TEMPLATE` where there is one."""

    def __init__(self, script: str | Path, *args: Any, **kwargs: Any) -> None:
        path = Path(script) if Path(script).is_absolute() else WORKERS / script
        kwargs.setdefault("template", TEMPLATE)
        super().__init__(path, *args, pythonpath=REPO, **kwargs)


def run_job(
    script: str,
    nprocs: int,
    workdir: Path,
    spec: dict[str, Any] | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> JobResult:
    with Job(script, nprocs, workdir, spec, env) as job:
        return job.wait(timeout)
