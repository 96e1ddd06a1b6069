"""The launch parameters of a job of several machines, from ``inprocess-run``'s flags
and the environment that Slurm, Kubernetes (PyTorchJob, JobSet) or torchrun's
conventions give every machine. Pure: it reads only the mapping it is given.

Precedence, for each parameter (docs/multi-node.md has the table):

1. the flag (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ...);
2. its ``PET_<FLAG>`` variable, as torchrun reads them;
3. ``MASTER_ADDR`` / ``MASTER_PORT``, and ``RANK`` as the node rank where
   ``PET_NNODES`` says several machines (a PyTorchJob pod's index);
4. Slurm's variables, under Slurm (``SLURM_JOB_ID`` set) inside an srun step.

``resolve`` returns None for a job of one machine (as before any of this).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from typing import Any

from ..slurm_env import coordinator_port, first_host, parse_tasks_per_node, whole_number
from .spec import JOB_ID_PATTERN, MAX_JOB_ID, MAX_NODES

#: (key of ``resolve``'s ``flags``, the flag, the variable torchrun reads it from)
FLAGS: tuple[tuple[str, str, str], ...] = (
    ("nnodes", "--nnodes", "PET_NNODES"),
    ("node_rank", "--node-rank", "PET_NODE_RANK"),
    ("rdzv_endpoint", "--rdzv-endpoint", "PET_RDZV_ENDPOINT"),
    ("rdzv_id", "--rdzv-id", "PET_RDZV_ID"),
    ("rdzv_backend", "--rdzv-backend", "PET_RDZV_BACKEND"),
    ("master_addr", "--master-addr", "PET_MASTER_ADDR"),
    ("master_port", "--master-port", "PET_MASTER_PORT"),
    ("nproc_per_node", "--nproc-per-node", "PET_NPROC_PER_NODE"),
    ("max_restarts", "--max-restarts", "PET_MAX_RESTARTS"),
)

#: the keys of ``FLAGS`` that place this machine in a job of several
_MULTI_NODE_KEYS = frozenset(key for key, _, _ in FLAGS) - {"nproc_per_node", "max_restarts"}
#: rendezvous backends: ``c10d`` ranks machines by arrival unless a node rank is
#: given; ``static`` needs every machine's node rank; ``etcd``: the coordinator is
#: elected through etcd (``--rdzv-endpoint`` names etcd's client endpoints)
RDZV_BACKENDS = ("c10d", "static", "etcd")
#: the coordinator's port where nothing names one and no Slurm job id derives one
#: (torchrun's default rendezvous port)
DEFAULT_PORT = 29400
#: where a value came from (``MultiNodeArgs.source``)
SOURCES = ("flags", "torchrun-env", "slurm")


@dataclasses.dataclass(frozen=True)
class MultiNodeArgs:
    """Where this machine stands in a job of several machines.

    Attributes:
        nnodes: machines that train (``MIN`` of ``--nnodes MIN:MAX``).
        spare_nodes: hot spare machines (``MAX - MIN``), waiting for a failure.
        node_rank: this machine's index, ``0 .. nnodes + spare_nodes - 1``; None:
            given by arrival order.
        coordinator_host: the host of the job's coordinator (its store); with
            ``etcd``, this machine's own address, where it listens should it be
            elected coordinator (``--master-addr``, else its host name; never a
            variable: a pod's ``MASTER_ADDR`` names another machine).
        coordinator_port: its port (``etcd``: ``--master-port``, else 0: a free one).
        job_id: the job's id, the same on every machine (None: not given).
        source: ``flags`` where any flag was given, else ``torchrun-env`` where any
            ``PET_*`` variable was, else ``slurm``.
        node_name: this machine's name where the scheduler gives one
            (``SLURMD_NODENAME``: several nodes may share a host name).
        rdzv_backend: ``c10d``, ``static`` or ``etcd``.
        etcd_endpoints: with ``etcd``, the etcd cluster's client URLs.
    """

    nnodes: int
    spare_nodes: int
    node_rank: int | None
    coordinator_host: str
    coordinator_port: int
    job_id: str | None
    source: str
    node_name: str | None = None
    rdzv_backend: str = "c10d"
    etcd_endpoints: tuple[str, ...] = ()


def torchrun_env(env: Mapping[str, str]) -> dict[str, str]:
    """The flags given by ``PET_<FLAG>`` variables, keyed like ``FLAGS`` (``nnodes``,
    ``nproc_per_node``, ...): for the launcher to use as defaults of its flags, on one
    machine too. An empty variable counts as unset."""
    return {key: env[var] for key, _, var in FLAGS if env.get(var)}


def nnodes_range(text: str | int, name: str = "--nnodes") -> tuple[int, int]:
    """``"4"`` -> (4, 4); ``"4:5"`` -> (4, 5): ``MIN:MAX`` as torchrun takes it; here
    ``MIN`` machines train and the other ``MAX - MIN`` are hot spares."""
    low_text, colon, high_text = str(text).partition(":")
    low = whole_number(low_text)
    high = whole_number(high_text) if colon else low
    if low is None or high is None or not 1 <= low <= high <= MAX_NODES:
        raise ValueError(
            f"{name}={text!r}: want N or MIN:MAX (MIN machines train, MAX - MIN are "
            f"hot spares), whole numbers with 1 <= MIN <= MAX <= {MAX_NODES}"
        )
    return low, high


def _int(text: str | int, name: str, low: int, high: int, what: str = "") -> int:
    value = whole_number(text)
    if value is None or not low <= value <= high:
        raise ValueError(f"{name}={text!r}: want a whole number in {low}..{high}{what}")
    return value


def _endpoint(text: str, name: str) -> tuple[str, int | None]:
    """``HOST``, ``HOST:PORT``, ``[IPV6]:PORT`` -> (host, port or None)."""
    host, port = text.strip(), None
    if host.startswith("["):  # [::1]:29400
        host, bracket, rest = host[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            host = ""
        port = rest[1:] if rest else None
    elif host.count(":") == 1:
        host, port = host.split(":")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"{name}={text!r}: want HOST, HOST:PORT or [IPV6]:PORT")
    return host, None if port is None else _int(port, f"the port of {name}", 1, 65535)


def _coordinator(given: dict[str, tuple[str, str]], prefix: str) -> tuple[str | None, int | None]:
    """The coordinator's host and port that one level names: the flags (``prefix``
    ``--``) or the ``PET_*`` variables. Its endpoint and its master address, both
    given, must name the same coordinator."""

    def at_level(key: str) -> tuple[str | None, str]:
        text, name = given.get(key, (None, ""))
        return (text, name) if name.startswith(prefix) else (None, name)

    endpoint, endpoint_name = at_level("rdzv_endpoint")
    host, port = _endpoint(endpoint, endpoint_name) if endpoint is not None else (None, None)

    def conflict(name: str, text: str) -> ValueError:
        return ValueError(
            f"{endpoint_name}={endpoint!r} and {name}={text!r} name different "
            "coordinators: give one of them"
        )

    addr, addr_name = at_level("master_addr")
    if addr is not None:
        if not addr.strip():
            raise ValueError(f"{addr_name}={addr!r}: want a host name or address")
        if host is not None and host != addr.strip():
            raise conflict(addr_name, addr)
        host = addr.strip()
    master_port, port_name = at_level("master_port")
    if master_port is not None:
        value = _int(master_port, port_name, 1, 65535)
        if port is not None and port != value:
            raise conflict(port_name, master_port)
        port = value
    return host, port


def _first(*candidates: tuple[Any, str] | None) -> tuple[Any, str | None]:
    """The first (value, name) whose value is not None; (None, None) if none."""
    for candidate in candidates:
        if candidate is not None and candidate[0] is not None:
            return candidate
    return None, None


def resolve(flags: Mapping[str, Any], env: Mapping[str, str]) -> MultiNodeArgs | None:
    """This machine's :class:`MultiNodeArgs`, or None for a job of one machine.

    ``flags``: the flags given, keyed like ``FLAGS`` (``nnodes``, ``node_rank``,
    ``rdzv_endpoint``, ...); None or a missing key means not given, other keys are
    ignored. ``env``: the environment. A bad or contradictory value raises
    ValueError naming its flag or variable and what is allowed.
    """
    given: dict[str, tuple[str, str]] = {}  # key -> (text, the flag or variable)
    pet = torchrun_env(env)
    for key, flag, var in FLAGS:
        if flags.get(key) is not None:
            given[key] = (str(flags[key]), flag)
        elif key in pet:
            given[key] = (pet[key], var)
    slurm = bool(env.get("SLURM_JOB_ID"))
    # a batch script or an salloc shell has the job's variables (SLURM_NODEID=0
    # among them) but is no task of a step: Slurm knows nothing of its machine
    in_step = slurm and bool(env.get("SLURM_STEP_ID"))

    # --- how many machines
    slurm_nnodes = next((v for v in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES") if env.get(v)), None)
    if "nnodes" in given:
        nnodes_name = given["nnodes"][1]
        low, high = nnodes_range(*given["nnodes"])
    elif slurm and slurm_nnodes is not None:
        nnodes_name = slurm_nnodes
        low, high = nnodes_range(env[slurm_nnodes], slurm_nnodes)
    else:
        nnodes_name, (low, high) = "--nnodes", (1, 1)
    machines = f" ({low} training + {high - low} spare machines)" if high > low else ""

    # --- this machine's node rank; RANK is a PyTorchJob pod's index only where
    # PET_NNODES says several machines (elsewhere it is a process's rank)
    pet_nnodes = nnodes_range(pet["nnodes"], "PET_NNODES") if "nnodes" in pet else (1, 1)
    node_rank, rank_name = _first(
        given.get("node_rank"),
        (env.get("RANK"), "RANK") if pet_nnodes[1] > 1 else None,
        (env.get("SLURM_NODEID"), "SLURM_NODEID") if in_step else None,
        (env.get("SLURM_PROCID"), "SLURM_PROCID") if in_step else None,
    )
    if high == 1:  # one machine: only a node rank asked for explicitly must fit
        if "node_rank" in given:
            _int(*given["node_rank"], 0, 0, " (a job of one machine)")
        return None
    if node_rank is not None:
        node_rank = _int(node_rank, str(rank_name), 0, high - 1, machines)
    if nnodes_name == slurm_nnodes and not in_step:
        raise ValueError(
            f"{nnodes_name}={env[nnodes_name]} but this process is no task of an srun step "
            "(no SLURM_STEP_ID: a batch script or an salloc shell): start inprocess-run "
            "once per machine with `srun --ntasks-per-node=1 inprocess-run ...`, or pass "
            "--nnodes 1 to run on this machine only"
        )
    if rank_name in ("SLURM_NODEID", "SLURM_PROCID"):
        per_node = next(
            (v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(v)), None
        )
        if per_node is not None and max(parse_tasks_per_node(env[per_node], per_node)) > 1:
            raise ValueError(
                f"{per_node}={env[per_node]!r}: inprocess-run runs once per machine "
                "(srun --ntasks-per-node=1); its workers are its own processes"
            )

    backend, backend_name = given.get("rdzv_backend", ("c10d", "--rdzv-backend"))
    if backend.strip() not in RDZV_BACKENDS:
        raise ValueError(f"{backend_name}={backend!r}: want one of {list(RDZV_BACKENDS)}")
    backend = backend.strip()
    if backend == "static" and node_rank is None:
        raise ValueError(
            f"{backend_name}=static needs this machine's node rank (0..{high - 1}): "
            "--node-rank, PET_NODE_RANK, or SLURM_NODEID inside an srun step"
        )

    etcd_endpoints: tuple[str, ...] = ()
    if backend == "etcd":
        # --rdzv-endpoint names etcd; the coordinator is whoever etcd elects
        etcd_endpoints, given = _etcd_endpoints(given), dict(given)
        given.pop("rdzv_endpoint", None)

    # --- the coordinator
    flag_host, flag_port = _coordinator(given, "--")
    pet_host, pet_port = _coordinator(given, "PET_")
    # each later source is read only where the earlier ones name nothing
    host = flag_host or pet_host
    if backend == "etcd":
        # this machine's own address, published in etcd should it lead: only the
        # flags name it (a pod's MASTER_ADDR, PET_MASTER_* name another machine)
        host, pet_port = flag_host or socket.gethostname(), None
    from_master_env = host is None and bool(env.get("MASTER_ADDR", "").strip())
    if from_master_env:
        host = env["MASTER_ADDR"].strip()
    if host is None and slurm:
        nodelist = next(
            (
                v
                for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                if env.get(v)
            ),
            None,
        )
        host = first_host(env[nodelist], nodelist) if nodelist else None
    if host is None:
        raise ValueError(
            f"a job of {high} machines needs its coordinator's host: --rdzv-endpoint "
            "HOST[:PORT] or --master-addr (or PET_RDZV_ENDPOINT, PET_MASTER_ADDR, MASTER_ADDR)"
        )
    port = flag_port or pet_port
    if port is None and backend == "etcd":
        port = 0  # a free one: its number travels in etcd
    if port is None and env.get("MASTER_PORT"):  # (not with etcd: port is 0 by then)
        port = _int(env["MASTER_PORT"], "MASTER_PORT", 1, 65535)
    if port is None:
        port = coordinator_port(env["SLURM_JOB_ID"]) if slurm else DEFAULT_PORT

    # --- the job's id, the same on every machine
    job_id = given["rdzv_id"][0].strip() if "rdzv_id" in given else None
    if job_id is not None:
        if (
            not JOB_ID_PATTERN.fullmatch(job_id)
            or job_id in (".", "..")
            or len(job_id) > MAX_JOB_ID
        ):
            raise ValueError(
                f"{given['rdzv_id'][1]}={job_id!r}: want letters, digits, '_', '.' or '-' "
                f"(not '.' or '..'), at most {MAX_JOB_ID} characters"
            )
    elif slurm:
        job_id = f"slurm-{_int(env['SLURM_JOB_ID'], 'SLURM_JOB_ID', 0, 2**63)}"
    if backend == "etcd" and job_id is None:
        raise ValueError(
            f"{backend_name}=etcd needs the job's id, its key in etcd, the same on every "
            "machine: --rdzv-id ID (or PET_RDZV_ID; under Slurm it is slurm-<job id>)"
        )

    # nproc_per_node and max_restarts say nothing of where the job's machines are
    names = [name for key, (_, name) in given.items() if key in _MULTI_NODE_KEYS]
    if any(name.startswith("--") for name in names):
        source = "flags"
    elif names or from_master_env or rank_name == "RANK":
        source = "torchrun-env"
    else:
        source = "slurm"
    return MultiNodeArgs(
        nnodes=low,
        spare_nodes=high - low,
        node_rank=node_rank,
        coordinator_host=host,
        coordinator_port=port,
        job_id=job_id,
        source=source,
        node_name=(env.get("SLURMD_NODENAME") or None) if slurm else None,
        rdzv_backend=backend,
        etcd_endpoints=etcd_endpoints,
    )


def _etcd_endpoints(given: Mapping[str, tuple[str, str]]) -> tuple[str, ...]:
    """etcd's client URLs from ``--rdzv-endpoint`` (``--rdzv-backend etcd``)."""
    from .etcd import parse_endpoints

    if "rdzv_endpoint" not in given:
        raise ValueError(
            "--rdzv-backend=etcd needs the etcd cluster's client endpoints: "
            "--rdzv-endpoint HOST:PORT[,HOST:PORT...] (or PET_RDZV_ENDPOINT)"
        )
    text, name = given["rdzv_endpoint"]
    return tuple(parse_endpoints(text, name))
