"""Job spec: what the failover controller runs and the limits it enforces.

A :class:`JobSpec` is immutable and validated when it is built, so every other
part of the failover layer (state, policy, controller) can trust its fields.
It is stored inside the durable job state (:mod:`inprocess.failover.state`)
through :meth:`JobSpec.to_dict` / :meth:`JobSpec.from_dict`.

Placement model: the job has ``nnodes`` nodes of ``nproc_per_node`` workers.
Worker ``w`` (its global rank, ``0 .. world_size-1``) belongs to node
``w // nproc_per_node``. Nodes run on *slots*: slots ``0 .. nnodes-1`` host
nodes ``0 .. nnodes-1`` at first; slots ``nnodes .. nnodes+spare_nodes-1`` are
spares that a relaunched node can move to.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_STANDBY_JOIN_TIMEOUT",
    "JOB_ID_PATTERN",
    "JOIN_TIMEOUT_RANGE",
    "MAX_COUNT",
    "MAX_JOB_ID",
    "MAX_NODES",
    "MAX_NPROC_PER_NODE",
    "MAX_STANDBY",
    "MONITOR_INTERVAL_RANGE",
    "RUN_AS",
    "JobSpec",
    "SpecError",
    "parse_std",
]

#: allowed characters of a job id; it may name files, directories and store prefixes
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
#: longest job id: it names files (``job-<id>.lock``, ``<id>_<random>`` log dirs) that
#: must stay well under the 255 bytes a file name may have
MAX_JOB_ID = 128
#: most nodes, and most spare node slots, of a job (each slot is a loop of the policy
#: and, with standbys, processes: beyond this a typo, not a cluster)
MAX_NODES = 100_000
#: most workers per node
MAX_NPROC_PER_NODE = 1024
#: most warm standbys per node slot (more than a few never start a worker sooner)
MAX_STANDBY = 64
#: most restarts, failures or relaunches a limit may allow ("unlimited" in practice)
MAX_COUNT = 1_000_000
#: allowed seconds between two polls of the workers: from a busy loop's worth to a
#: minute (beyond that a worker's death goes unseen for longer than any timeout)
MONITOR_INTERVAL_RANGE = (0.001, 60.0)
#: allowed seconds a started worker has to join the job (0: no deadline): up to a day
JOIN_TIMEOUT_RANGE = (0.0, 86400.0)
#: default deadline of a freshly spawned worker: its ``import torch`` alone can take
#: 30 s and more on a loaded machine, then the script runs up to its wrapped call
DEFAULT_JOIN_TIMEOUT = 300.0
#: default deadline of a warm standby made a worker: its imports are done, only the
#: script's own code runs before it joins
DEFAULT_STANDBY_JOIN_TIMEOUT = 120.0
#: how ``entrypoint[0]`` is run: ``python SCRIPT``, ``python -m MODULE``, or as a program
RUN_AS = ("script", "module", "program")
#: torchrun's stream selectors (``--redirects`` / ``--tee``): none, stdout, stderr, both
STD_VALUES = (0, 1, 2, 3)


class SpecError(ValueError):
    """A job spec field has an invalid type or value; the message names the field."""


def parse_std(name: str, value: str, nproc: int | None = None) -> dict[int | None, int]:
    """torchrun's ``--redirects`` / ``--tee`` value: ``"3"`` for every local rank, or a
    per-local-rank mapping ``"0:1,1:2"`` (ranks not named: 0), each local rank named
    at most once and, with ``nproc`` (workers per node), below it.

    Returns ``{None: std}`` or ``{local_rank: std, ...}``; ``std`` is 0 (none),
    1 (stdout), 2 (stderr) or 3 (both).

    Raises:
        SpecError: naming ``name``, the value and the allowed forms or local ranks.
    """
    error = SpecError(
        f"JobSpec.{name} must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or a "
        f"per-local-rank mapping such as '0:1,1:2', got {value!r}"
    )
    if not isinstance(value, str):
        raise error
    text = value.strip()
    try:
        if ":" not in text:
            result: dict[int | None, int] = {None: int(text)}
        else:
            result = {}
            for item in text.split(","):
                rank, _, std = item.partition(":")
                if int(rank) < 0:
                    raise ValueError(rank)
                if int(rank) in result:
                    raise SpecError(
                        f"JobSpec.{name} names local rank {int(rank)} more than once in "
                        f"{value!r}: give each local rank at most once"
                    )
                result[int(rank)] = int(std)
    except ValueError as ex:
        if isinstance(ex, SpecError):
            raise
        raise error from None
    if any(std not in STD_VALUES for std in result.values()):
        raise error
    wrong = [r for r in result if r is not None and nproc is not None and r >= nproc]
    if wrong:
        raise SpecError(
            f"JobSpec.{name} names local rank {wrong[0]} in {value!r}, but a node has "
            f"{_workers(nproc)}: local ranks are 0..{nproc - 1}"
        )
    return result


def _workers(nproc: int) -> str:
    return f"{nproc} worker" + ("" if nproc == 1 else "s")


def _check_int(name: str, value: Any, minimum: int, maximum: int) -> int:
    # bool is an int subclass; `nnodes=True` is a mistake, not 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(
            f"JobSpec.{name} must be an integer in {minimum}..{maximum}, got {value!r} "
            f"({type(value).__name__})"
        )
    if not minimum <= value <= maximum:
        raise SpecError(f"JobSpec.{name} must be an integer in {minimum}..{maximum}, got {value}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Immutable description of one failover job.

    All fields are keyword-only. ``entrypoint`` may be given as any sequence of
    strings; it is stored as a tuple so the spec stays hashable and immutable.
    ``state_dir`` may be a path-like object; it is stored as ``str``.

    Attributes:
        job_id: name of the job, characters ``[A-Za-z0-9_.-]``, not ``.`` or ``..``,
            at most :data:`MAX_JOB_ID` characters.
        entrypoint: the worker command: script path followed by its arguments.
        nnodes: number of nodes (>= 1).
        nproc_per_node: workers per node (>= 1).
        spare_nodes: spare node slots a failing node can be moved to (>= 0).
        max_restarts: restarts allowed per worker, i.e. failures of one worker
            beyond which the job stops (>= 0).
        per_node_max_failures: failures of one node's workers tolerated before
            the node is relaunched (>= 1).
        job_max_restarts: cold restarts of the whole job allowed (>= 0).
        node_max_relaunches: node relaunches allowed in the whole job (>= 0).
        state_dir: absolute directory holding the durable controller state.
        master_addr: address workers use to reach rank 0 (``MASTER_ADDR``).
        monitor_interval: seconds between two polls of the workers (> 0).
        run_as: how ``entrypoint[0]`` runs (:data:`RUN_AS`): ``"script"``
            (``python SCRIPT``), ``"module"`` (``python -m MODULE``) or
            ``"program"`` (executed directly, no interpreter).
        master_port: port of the job's store server (``MASTER_PORT``); 0: a free one.
        log_dir: absolute directory of this run's per-worker log files, or
            ``None`` (no files: every worker writes to the launcher's console).
        redirects: streams written to the log files only (see :func:`parse_std`).
        tee: streams written to the log files and copied to the console.
        local_ranks_filter: local ranks whose output reaches the console
            (``None``: all); the others' output goes to their files or nowhere.
        standby: warm standby processes kept per node slot (>= 0; 0: none), see
            :mod:`inprocess.failover.standby`.
        join_timeout: seconds a freshly spawned worker of a Wrapper job has to join
            it (arrive at its initial barrier or ask to join the running job)
            before it is replaced by a fresh process; 0: no deadline.
        standby_join_timeout: the same for a warm standby that takes a worker's place.
    """

    job_id: str
    entrypoint: tuple[str, ...]
    nnodes: int
    nproc_per_node: int
    state_dir: str
    spare_nodes: int = 0
    max_restarts: int = 3
    per_node_max_failures: int = 3
    job_max_restarts: int = 3
    node_max_relaunches: int = 1
    master_addr: str = "127.0.0.1"
    monitor_interval: float = 0.1
    run_as: str = "script"
    master_port: int = 0
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: tuple[int, ...] | None = None
    standby: int = 1
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    standby_join_timeout: float = DEFAULT_STANDBY_JOIN_TIMEOUT

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raise :class:`SpecError` naming the first bad one.

        Normalizes ``entrypoint`` to a tuple, ``state_dir`` to ``str`` and
        ``monitor_interval`` to ``float`` (the dataclass is frozen, so this uses
        ``object.__setattr__``; it happens only while the spec is being built).
        """
        if not isinstance(self.job_id, str) or not JOB_ID_PATTERN.fullmatch(self.job_id):
            raise SpecError(
                f"JobSpec.job_id must be a non-empty string of letters, digits, '_', '.' "
                f"or '-', got {self.job_id!r}"
            )
        if self.job_id in (".", ".."):
            raise SpecError(f"JobSpec.job_id must not be '.' or '..', got {self.job_id!r}")
        if len(self.job_id) > MAX_JOB_ID:
            raise SpecError(
                f"JobSpec.job_id must be at most {MAX_JOB_ID} characters, got "
                f"{len(self.job_id)} ({self.job_id[:20]!r}...)"
            )

        entrypoint = self.entrypoint
        if isinstance(entrypoint, str | bytes) or not isinstance(entrypoint, Sequence):
            raise SpecError(
                "JobSpec.entrypoint must be a list of strings (script path, then its "
                f"arguments), got {entrypoint!r}"
            )
        if len(entrypoint) == 0:
            raise SpecError("JobSpec.entrypoint must not be empty: give the script path")
        for i, arg in enumerate(entrypoint):
            if not isinstance(arg, str):
                raise SpecError(
                    f"JobSpec.entrypoint[{i}] must be a string, got {arg!r} ({type(arg).__name__})"
                )
        if entrypoint[0] == "":
            raise SpecError("JobSpec.entrypoint[0] (the script path) must not be empty")
        object.__setattr__(self, "entrypoint", tuple(entrypoint))

        _check_int("nnodes", self.nnodes, 1, MAX_NODES)
        _check_int("nproc_per_node", self.nproc_per_node, 1, MAX_NPROC_PER_NODE)
        _check_int("spare_nodes", self.spare_nodes, 0, MAX_NODES)
        _check_int("max_restarts", self.max_restarts, 0, MAX_COUNT)
        _check_int("per_node_max_failures", self.per_node_max_failures, 1, MAX_COUNT)
        _check_int("job_max_restarts", self.job_max_restarts, 0, MAX_COUNT)
        _check_int("node_max_relaunches", self.node_max_relaunches, 0, MAX_COUNT)
        _check_int("standby", self.standby, 0, MAX_STANDBY)

        state_dir = self.state_dir
        if isinstance(state_dir, os.PathLike):
            state_dir = os.fspath(state_dir)
        if not isinstance(state_dir, str) or not os.path.isabs(state_dir):
            raise SpecError(f"JobSpec.state_dir must be an absolute path, got {state_dir!r}")
        object.__setattr__(self, "state_dir", state_dir)

        if (
            not isinstance(self.master_addr, str)
            or not self.master_addr
            or any(c.isspace() for c in self.master_addr)
        ):
            raise SpecError(
                "JobSpec.master_addr must be a non-empty host name or IP address "
                f"without spaces, got {self.master_addr!r}"
            )

        interval = self.monitor_interval
        low, high = MONITOR_INTERVAL_RANGE
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not math.isfinite(interval)
            or not low <= interval <= high
        ):
            raise SpecError(
                f"JobSpec.monitor_interval must be a number of seconds in {low:g}..{high:g}, "
                f"got {interval!r}"
            )
        object.__setattr__(self, "monitor_interval", float(interval))
        for name in ("join_timeout", "standby_join_timeout"):
            value = getattr(self, name)
            low, high = JOIN_TIMEOUT_RANGE
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or not low <= value <= high
            ):
                raise SpecError(
                    f"JobSpec.{name} must be a number of seconds in {low:g}..{high:g} "
                    f"(0: no deadline), got {value!r}"
                )
            object.__setattr__(self, name, float(value))

        if self.run_as not in RUN_AS:
            raise SpecError(
                f"JobSpec.run_as must be one of {', '.join(RUN_AS)}, got {self.run_as!r}"
            )
        port = self.master_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise SpecError(f"JobSpec.master_port must be an integer in 0..65535, got {port!r}")
        log_dir = self.log_dir
        if isinstance(log_dir, os.PathLike):
            log_dir = os.fspath(log_dir)
        if log_dir is not None and (not isinstance(log_dir, str) or not os.path.isabs(log_dir)):
            raise SpecError(f"JobSpec.log_dir must be an absolute path or None, got {log_dir!r}")
        object.__setattr__(self, "log_dir", log_dir)
        for name in ("redirects", "tee"):
            std = parse_std(name, getattr(self, name), self.nproc_per_node)
            if any(std.values()) and log_dir is None:
                raise SpecError(f"JobSpec.{name} writes log files: it needs JobSpec.log_dir")
        ranks = self.local_ranks_filter
        if ranks is not None:
            if (
                isinstance(ranks, str | bytes)
                or not isinstance(ranks, Sequence)
                or not ranks
                or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks)
            ):
                raise SpecError(
                    "JobSpec.local_ranks_filter must be None or a non-empty list of local "
                    f"ranks (integers >= 0), got {ranks!r}"
                )
            nproc = self.nproc_per_node
            wrong = [r for r in ranks if r >= nproc]
            if wrong or len(set(ranks)) != len(ranks):
                shown = ",".join(map(str, ranks))
                raise SpecError(
                    f"JobSpec.local_ranks_filter must name local ranks in 0..{nproc - 1} (a "
                    f"node has {_workers(nproc)}), each at most once, got {shown!r}"
                )
            object.__setattr__(self, "local_ranks_filter", tuple(sorted(ranks)))

    # -- worker command and output -----------------------------------------

    def command(self, python: str) -> tuple[str, ...]:
        """The worker's argv (``python``: the interpreter, unless run as a program)."""
        if self.run_as == "module":
            return (python, "-m", *self.entrypoint)
        if self.run_as == "program":
            return self.entrypoint
        return (python, *self.entrypoint)

    def streams_of(self, worker: int) -> tuple[int, int, bool]:
        """``(redirect, tee, shown)`` of ``worker``: torchrun's stream selectors for
        its local rank, and whether its output may reach the console."""
        local = self.local_rank_of(worker)
        redirects, tee = parse_std("redirects", self.redirects), parse_std("tee", self.tee)
        shown = self.local_ranks_filter is None or local in self.local_ranks_filter
        return (
            redirects.get(None, redirects.get(local, 0)),
            tee.get(None, tee.get(local, 0)),
            shown,
        )

    # -- placement helpers -------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of workers: ``nnodes * nproc_per_node``."""
        return self.nnodes * self.nproc_per_node

    @property
    def num_slots(self) -> int:
        """Number of node slots, spares included: ``nnodes + spare_nodes``."""
        return self.nnodes + self.spare_nodes

    def node_of(self, worker: int) -> int:
        """Node that worker (global rank) ``worker`` belongs to."""
        self._check_worker(worker)
        return worker // self.nproc_per_node

    def local_rank_of(self, worker: int) -> int:
        """Rank of ``worker`` within its node (``LOCAL_RANK``)."""
        self._check_worker(worker)
        return worker % self.nproc_per_node

    def workers_of(self, node: int) -> range:
        """Workers (global ranks) of node ``node``, in order."""
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nnodes:
            raise ValueError(f"node must be an integer in 0..{self.nnodes - 1}, got {node!r}")
        start = node * self.nproc_per_node
        return range(start, start + self.nproc_per_node)

    def _check_worker(self, worker: int) -> None:
        if (
            isinstance(worker, bool)
            or not isinstance(worker, int)
            or not 0 <= worker < self.world_size
        ):
            raise ValueError(
                f"worker must be an integer in 0..{self.world_size - 1}, got {worker!r}"
            )

    # -- serialization -----------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of every field (``entrypoint`` as a list)."""
        data = dataclasses.asdict(self)
        data["entrypoint"] = list(self.entrypoint)
        if self.local_ranks_filter is not None:
            data["local_ranks_filter"] = list(self.local_ranks_filter)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """Build a spec from :meth:`to_dict` output.

        Every field must be present: a stored spec is complete, and silently
        filling a missing limit with today's default would change the policy of
        a job being resumed. Unknown fields are rejected too.
        """
        if not isinstance(data, Mapping):
            raise SpecError(f"JobSpec data must be a mapping, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in data if k not in names)
        if unknown:
            raise SpecError(
                f"JobSpec: unknown field(s) {', '.join(unknown)}; allowed fields: "
                f"{', '.join(names)}"
            )
        missing = [n for n in names if n not in data]
        if missing:
            raise SpecError(f"JobSpec: missing field(s) {', '.join(missing)}")
        return cls(**{n: data[n] for n in names})
