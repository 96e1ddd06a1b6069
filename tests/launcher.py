"""The suite's jobs of real rank processes: :mod:`inprocess.tools.local_job` with
the worker scripts of ``tests/workers`` and the repository importable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inprocess._net import free_port
from inprocess.tools import local_job
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
    "run_job",
]


class Job(local_job.Job):
    """A job of ``script``: a name in ``tests/workers`` or a path."""

    def __init__(self, script: str | Path, *args: Any, **kwargs: Any) -> None:
        path = Path(script) if Path(script).is_absolute() else WORKERS / script
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
