"""The environment of a worker: torchrun's variables, the job's store and its
namespace, and what the Wrapper reads from the job layer."""

from __future__ import annotations

import os
from pathlib import Path

from .. import records as _records
from ..security import keyed_namespace
from .spec import JobSpec


def namespace(job_id: str, generation: int) -> str:
    """Store namespace of a generation's Wrapper keys (``INPROCESS_STORE_NAMESPACE``).

    Keyed with the job's secret: a store client without it cannot name them.
    """
    return keyed_namespace(f"{job_id}/g{generation}")


def worker_env(
    spec: JobSpec,
    generation: int,
    store: tuple[str, int] | None,
    state_dir: Path,
    worker: int,
    incarnation: int,
    slot: int,
) -> dict[str, str]:
    """A worker's environment. Before the store server is up (``store`` is None: a
    standby's environment, which :func:`.standby.common_env` trims) the store's
    variables are empty."""
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
        MASTER_ADDR=store[0] if store is not None else "",
        MASTER_PORT=str(store[1]) if store is not None else "",
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RUN_ID=spec.job_id,
        TORCHELASTIC_RESTART_COUNT=str(generation),
        TORCHELASTIC_MAX_RESTARTS=str(spec.job_max_restarts),
        INPROCESS_JOB_ID=spec.job_id,
        INPROCESS_STORE_NAMESPACE=namespace(spec.job_id, generation),
        INPROCESS_WORKER_INCARNATION=str(incarnation),
        INPROCESS_NODE_SLOT=str(slot),
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    # The Wrapper's restart records go to the state dir, unless the user chose a file.
    records = state_dir.absolute() / _records.RESTARTS_FILE
    env.setdefault(_records.RECORDS_ENV, str(records))
    return env
