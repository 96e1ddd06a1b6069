"""Slurm's environment, read without ``scontrol``: host lists, tasks per node, the
ports derived from the job id, and the rank variables of a script that ``srun``
started directly (one task per rank, no launcher).

Containers often lack ``scontrol``; a launcher that shells out to it and falls back
to ``localhost`` when it is missing makes every node a world of one. Everything
here reads the variables Slurm sets in every task instead.

The core Wrapper uses :func:`apply_slurm_task_env`; the launcher's layer
(``inprocess.failover.cluster_env``) uses the parsers and :func:`coordinator_port`.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Callable, Mapping, MutableMapping

log = logging.getLogger(__name__)

#: Ports derived from the job id, both below Linux's default ephemeral range
#: (32768-60999), so no outgoing connection holds them by chance. Invariant: the
#: two ranges are disjoint, with room for the usage guide's ``MASTER_PORT + 1`` and
#: ``+ 2``, so a job's coordinator never collides with any job's worker store ports;
#: two jobs on one node collide only when their ids are equal modulo ``PORT_SPAN``.
COORDINATOR_PORT_BASE = 20000
MASTER_PORT_BASE = 26000
PORT_SPAN = 6000

#: most hosts a host list may expand to (beyond this a typo, not a cluster)
MAX_HOSTS = 1_000_000

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_EXAMPLES = "forms like n1, n[1-4], gpu-[01-03,07], a[1-2]-b[3-4], n[1-2],login1"


def parse_hostlist(text: str, name: str = "host list") -> list[str]:
    """The hosts of a Slurm host list (``SLURM_JOB_NODELIST``), in Slurm's order.

    ``n[1-4]`` is n1..n4; ``gpu-[01-03,07]`` keeps the zero padding of each range's
    lower bound; several bracket groups expand to their cartesian product, the first
    group varying slowest (``a[1-2]-b[3-4]``: a1-b3, a1-b4, a2-b3, a2-b4); commas
    outside brackets separate items. ``name`` (the variable the text came from)
    is named by the ValueError a bad list raises.
    """

    def bad(why: str) -> ValueError:
        return ValueError(f"{name}={text!r} is not a Slurm host list ({why}); expected {_EXAMPLES}")

    items: list[str] = []
    start, depth = 0, 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise bad("nested '['")
            depth = 1
        elif char == "]":
            if not depth:
                raise bad("']' without '['")
            depth = 0
        elif char == "," and not depth:
            items.append(text[start:i])
            start = i + 1
        elif char.isspace() or not char.isprintable():
            raise bad(f"character {char!r}")
    if depth:
        raise bad("'[' not closed")
    items.append(text[start:])

    hosts: list[str] = []
    for item in items:
        if not item:
            raise bad("an empty host name")
        # literal, bracket, literal, bracket, ..., literal
        parts = re.split(r"\[([^\]]*)\]", item)
        choices = [_expand_ranges(part, bad) if i % 2 else [part] for i, part in enumerate(parts)]
        count = 1
        for choice in choices:
            count *= len(choice)
        if len(hosts) + count > MAX_HOSTS:
            raise bad(f"more than {MAX_HOSTS} hosts")
        hosts.extend("".join(combination) for combination in itertools.product(*choices))
    return hosts


def _expand_ranges(text: str, bad: Callable[[str], ValueError]) -> list[str]:
    """``01-03,07`` -> 01, 02, 03, 07 (the width of each lower bound kept)."""
    values: list[str] = []
    for piece in text.split(","):
        m = _RANGE.fullmatch(piece)
        if not m:
            raise bad(f"range {piece!r}: want N or N-M")
        low, high = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(high) < int(low):
            raise bad(f"range {piece!r} runs backwards")
        if len(values) + int(high) - int(low) + 1 > MAX_HOSTS:
            raise bad(f"more than {MAX_HOSTS} hosts")
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return values


def first_host(text: str, name: str = "host list") -> str:
    """The first host of a Slurm host list (the node of task 0 and of node id 0)."""
    return parse_hostlist(text, name)[0]


def parse_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Tasks on each node, in node order: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for piece in text.split(","):
        m = _TASKS.fullmatch(piece.strip())
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(
                f"{name}={text!r} is not a tasks-per-node list: want counts like 4, 2(x3),1"
            )
        repeat = int(m.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise ValueError(f"{name}={text!r} names more than {MAX_HOSTS} nodes")
        counts += [int(m.group(1))] * repeat
    return counts


def whole_number(text: str | int) -> int | None:
    """``text`` as an integer, strictly (ASCII digits, an optional '-', blanks around);
    None if it is not one. ``int()`` would also take ``1_000``, ``+1`` and other
    scripts' digits."""
    m = re.fullmatch(r"\s*(-?[0-9]+)\s*", str(text))
    return int(m.group(1)) if m else None


def _job_number(job_id: str | int, name: str) -> int:
    number = whole_number(job_id)
    if number is None or number < 0:
        raise ValueError(f"{name}={job_id!r} is not a Slurm job id (a number >= 0)")
    return number


def coordinator_port(job_id: str | int, name: str = "SLURM_JOB_ID") -> int:
    """The port of a multi-machine job's coordinator: ``20000 + job_id % 6000``."""
    return COORDINATOR_PORT_BASE + _job_number(job_id, name) % PORT_SPAN


def master_port(job_id: str | int, name: str = "SLURM_JOB_ID") -> int:
    """``MASTER_PORT`` of a script started by srun directly: ``26000 + job_id % 6000``."""
    return MASTER_PORT_BASE + _job_number(job_id, name) % PORT_SPAN


def _env_int(env: Mapping[str, str], name: str, low: int = 0) -> int:
    value = env[name]
    number = whole_number(value)
    if number is None or number < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    return number


def slurm_task_env(env: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables of a task that ``srun`` started directly, from
    Slurm's (empty when ``RANK`` or ``WORLD_SIZE`` is set, or not inside an srun step).

    ``RANK`` = ``SLURM_PROCID``; ``WORLD_SIZE`` = the step's tasks; ``LOCAL_RANK`` =
    ``SLURM_LOCALID``; ``LOCAL_WORLD_SIZE`` = this node's entry of the step's tasks per
    node; ``MASTER_ADDR`` = the step's first node (task 0 runs there); ``MASTER_PORT``
    derived from the job id (:func:`master_port`). A variable already set is left out.
    A batch script (or an ``salloc`` shell) has ``SLURM_PROCID=0`` and the job's
    ``SLURM_NTASKS`` too, but no ``SLURM_STEP_ID``: it is no task of a step, and a
    rank 0 of a world whose other ranks nobody started would wait forever.
    """
    if "RANK" in env or "WORLD_SIZE" in env:
        return {}
    if not env.get("SLURM_STEP_ID") or "SLURM_PROCID" not in env:
        return {}
    tasks_var = next((v for v in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if v in env), None)
    if tasks_var is None:
        return {}
    rank = _env_int(env, "SLURM_PROCID")
    world_size = _env_int(env, tasks_var, low=1)
    if rank >= world_size:
        raise ValueError(
            f"SLURM_PROCID={rank} must be below {tasks_var}={world_size} "
            f"(ranks 0..{world_size - 1})"
        )
    found = {"RANK": str(rank), "WORLD_SIZE": str(world_size)}
    if "SLURM_LOCALID" in env:
        found["LOCAL_RANK"] = str(_env_int(env, "SLURM_LOCALID"))
    # the step's own counts first: a step inherits the batch script's
    # SLURM_NTASKS_PER_NODE even when it runs fewer tasks per node
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if env.get(var):
            counts = parse_tasks_per_node(env[var], var)
            node = _env_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
            found["LOCAL_WORLD_SIZE"] = str(counts[node] if node < len(counts) else counts[0])
            break
    for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(var):
            found["MASTER_ADDR"] = first_host(env[var], var)
            break
    if env.get("SLURM_JOB_ID"):
        found["MASTER_PORT"] = str(master_port(env["SLURM_JOB_ID"]))
    return {key: value for key, value in found.items() if key not in env}


def apply_slurm_task_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Fills ``RANK``, ``WORLD_SIZE``, ... of a task that ``srun`` started directly
    into ``environ`` (default ``os.environ``), never overriding a variable already
    set; returns what it set (see :func:`slurm_task_env`). Launchers (torchrun,
    inprocess-run) set ``RANK`` themselves: under them this does nothing."""
    env = os.environ if environ is None else environ
    found = slurm_task_env(env)
    if found:
        env.update(found)
        log.info(
            "started by srun without a launcher: %s from Slurm's environment",
            " ".join(f"{key}={value}" for key, value in found.items()),
        )
    return found
