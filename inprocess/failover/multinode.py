"""One ``inprocess-run`` per machine: who coordinates, and the job's start-up.

Every machine runs the same command. The launcher of node rank 0 (or the one
started with ``--coordinator-only``, which runs no workers) is the
coordinator: it listens at the job's endpoint, waits for the machines of the
job (:func:`rendezvous`), then runs the supervisor and controller exactly as
a one-machine job, with the ``nodes`` backend (:mod:`.backends.nodes`). Every
other launcher is a node agent (:mod:`.node_agent`).

The start-up, on the coordinator's listening socket:

1. each agent connects and proves the job's secret; its arguments are
   compared with the coordinator's (:data:`~.backends.nodes.AGREED`): one that
   differs is refused with a line naming the difference;
2. it is given a node slot: its node rank where it has one (Slurm, Kubernetes,
   ``--node-rank``), else the first free one in order of arrival;
3. once the ``--nnodes`` training machines are in, or ``--rdzv-timeout``
   passed (then the job does not start: one clear error on every machine),
   each agent is told to go, and connects again, to the controller, on its slot.

Hot spares (``--spare-nodes``, or ``--nnodes MIN:MAX``) that are in by then
are part of the start; a later one joins the running job on a free slot.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

from ..node import NODE_ENV
from ..security import JOB_SECRET_ENV
from . import cluster_env
from .backends.nodes import SURPLUS, NodesConfig, difference
from .cluster_env import MultiNodeArgs
from .link import Handshake, LinkError

log = logging.getLogger(__name__)


class StartError(Exception):
    """The job cannot start on these machines (the message says why)."""


def machine_name(env: Mapping[str, str] | None = None) -> str:
    """This machine's name: Slurm's node name where set (nodes may share a host
    name), else the host name."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def hello(
    job_id: str | None, node_rank: int | None, agreed: dict[str, Any], name: str
) -> dict[str, Any]:
    """What an agent tells the coordinator when it joins."""
    return {
        "job": job_id,
        "agent": uuid.uuid4().hex,
        "node_rank": node_rank,
        "name": name,
        "args": agreed,
    }


def listen(host: str, port: int) -> socket.socket:
    """The coordinator's listening socket at ``host:port``, inheritable (the
    controllers of the job accept on it, one after the other).

    Raises:
        StartError: the address cannot be listened on here.
    """
    try:
        listener = socket.create_server((host, port), backlog=128)
    except OSError as ex:
        raise StartError(
            f"cannot listen at {host}:{port} for the job's machines: {ex.strerror or ex} "
            "(another job there? give another --rdzv-endpoint port)"
        ) from None
    listener.set_inheritable(True)
    return listener


def rendezvous(
    listener: socket.socket,
    job_id: str,
    secret: str,
    agreed: dict[str, Any],
    num_slots: int,
    nnodes: int,
    own_slot: int | None,
    timeout: float,
) -> NodesConfig:
    """Waits for the job's machines; returns who joined, on which slot.

    Every agent still connected when it returns is told to go (connect to the
    controller); on a :class:`StartError` each is told why the job did not start.

    Raises:
        StartError: the ``nnodes`` training machines were not all in within ``timeout``.
    """
    from .backends.nodes import Acceptor

    acceptor = Acceptor(listener, secret, job_id)
    joined: dict[int, tuple[str, str, Any]] = {}  # slot -> (agent id, name, link)
    wanted = {s for s in range(nnodes) if s != own_slot}
    deadline = time.monotonic() + timeout
    try:
        while not wanted <= set(joined) and time.monotonic() < deadline:
            try:
                shake, their_hello = acceptor.joins.get(timeout=0.2)
            except queue.Empty:
                continue
            _join(shake, their_hello, agreed, joined, num_slots, own_slot, job_id)
        missing = sorted(wanted - set(joined))
        if missing:
            why = (
                f"only {nnodes - len(missing)} of the {nnodes} machines of the job joined "
                f"within --rdzv-timeout {timeout:g}s (missing node rank(s) "
                f"{', '.join(map(str, missing))})"
            )
            for _, _, link in joined.values():
                _tell(link, {"t": "end", "code": 1, "reason": why})
            raise StartError(why)
        # late hot spares are welcome later (the controller gives them a free slot)
        while True:
            try:
                shake, their_hello = acceptor.joins.get_nowait()
            except queue.Empty:
                break
            _join(shake, their_hello, agreed, joined, num_slots, own_slot, job_id)
        for _, _, link in joined.values():
            _tell(link, {"t": "go"})
    finally:
        acceptor.close()
        for _, _, link in joined.values():
            link.close()
    log.info(
        "job %s: %d machine(s) joined: %s",
        job_id,
        len(joined) + (own_slot is not None),
        ", ".join(f"slot {s}: {name}" for s, (_, name, _) in sorted(joined.items())),
    )
    return NodesConfig(
        own_slot=own_slot,
        joined={slot: agent for slot, (agent, _, _) in joined.items()},
        agreed=agreed,
    )


def _tell(link: Any, frame: dict[str, Any]) -> None:
    try:
        link.send(frame)
    except LinkError as ex:
        log.debug("%s: %s", link.peer, ex)


def _join(
    shake: Handshake,
    their_hello: dict[str, Any],
    agreed: dict[str, Any],
    joined: dict[int, tuple[str, str, Any]],
    num_slots: int,
    own_slot: int | None,
    job_id: str,
) -> None:
    """Welcomes (on a slot) or refuses one machine at the start."""
    name = str(their_hello.get("name") or shake.peer)
    problem = difference(agreed, their_hello)
    if problem is None:
        agent = their_hello.get("agent")
        again = [s for s, (held_by, _, _) in joined.items() if agent and held_by == str(agent)]
        if again:  # the same machine again (it gave up waiting for our answer)
            slot: int | str = again[0]
            joined.pop(slot)[2].close()
        else:
            slot = _start_slot(their_hello.get("node_rank"), joined, num_slots, own_slot)
        if isinstance(slot, str):
            problem = slot
    if problem is not None:
        log.warning("refused the machine %s (%s): %s", name, shake.peer, problem)
        shake.refuse(problem, surplus=problem.endswith(SURPLUS))
        return
    assert isinstance(slot, int)
    try:
        link = shake.welcome({"slot": slot, "job": job_id, "reconnect": True})
    except LinkError as ex:
        log.warning("the machine %s left while joining: %s", name, ex)
        return
    joined[slot] = (str(their_hello.get("agent")), name, link)
    log.info("machine %s (%s) joined as node slot %d", name, shake.peer, slot)


def _start_slot(
    node_rank: Any, joined: Mapping[int, Any], num_slots: int, own_slot: int | None
) -> int | str:
    """A joining machine's slot: its node rank if it has one, else the first free."""
    if node_rank is not None:
        if not isinstance(node_rank, int) or not 0 <= node_rank < num_slots:
            return (
                f"node rank {node_rank!r} is not one of this job's 0..{num_slots - 1} "
                "(--nnodes plus --spare-nodes)"
            )
        if node_rank == own_slot or node_rank in joined:
            return f"node rank {node_rank} has joined already (two machines with one node rank?)"
        return node_rank
    for slot in range(num_slots):
        if slot != own_slot and slot not in joined:
            return slot
    return f"the job's {num_slots} node slot(s) are all taken: {SURPLUS}"


# -- the launcher's side ---------------------------------------------------------

#: default of --rdzv-timeout: seconds the machines of a job have to join at its start
DEFAULT_RDZV_TIMEOUT = 300.0


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a job of several machines (each also from ``PET_<FLAG>``)."""
    p.add_argument(
        "--node-rank",
        "--node_rank",
        default=None,
        help="this machine's index in the job, 0..nnodes+spares-1 (0 is the coordinator; "
        "default: PET_NODE_RANK, SLURM_NODEID, else the order of arrival)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        help="HOST[:PORT] of the job's coordinator, the same on every machine "
        "(default: PET_RDZV_ENDPOINT, MASTER_ADDR, or the first host of the Slurm job); "
        "with --rdzv-backend etcd, etcd's client endpoints",
    )
    p.add_argument(
        "--rdzv-id", "--rdzv_id", default=None, help="the job's id on every machine (= --job-id)"
    )
    p.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        default=None,
        help="c10d (machines ranked by arrival where no node rank is given), static "
        "(every machine gives --node-rank) or etcd (the coordinator elected through the "
        "etcd cluster that --rdzv-endpoint names: HOST:PORT[,HOST:PORT...])",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=DEFAULT_RDZV_TIMEOUT,
        help="seconds the job's machines have to join at its start, and an agent has to "
        f"reach the coordinator (default {DEFAULT_RDZV_TIMEOUT:g})",
    )
    p.add_argument(
        "--coordinator-only",
        action="store_true",
        help="run the job's coordinator (controller and store) here and no workers: a CPU "
        "host whose loss no GPU machine shares",
    )
    p.add_argument(
        "--secret-file",
        default=None,
        help="file with the job's secret (readable by its owner only), the same on every "
        "machine (default: INPROCESS_JOB_SECRET)",
    )


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> MultiNodeArgs | None:
    """Where this launcher stands in a job of several machines (None: one machine).

    Raises:
        ValueError: a bad or contradictory flag or variable (named).
    """
    flags = {
        "nnodes": args.nnodes_given,
        "node_rank": args.node_rank,
        "rdzv_endpoint": args.rdzv_endpoint,
        "rdzv_id": args.rdzv_id,
        "rdzv_backend": args.rdzv_backend,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
    }
    # Only these say "several machines": --nnodes N alone is N nodes on this machine,
    # as it always was (and --master-addr is then where the store listens).
    asked = (
        any(flags[k] is not None for k in ("node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_backend"))
        or args.coordinator_only
        or any(k.startswith("PET_") for k in env)
        or ("SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env)
    )
    mn = cluster_env.resolve(flags, env) if asked else None
    if mn is None and args.coordinator_only:
        raise ValueError(
            "--coordinator-only needs a job of several machines (--rdzv-endpoint and --nnodes, "
            "Slurm, or PET_* variables)"
        )
    if mn is not None and args.coordinator_only and mn.node_rank not in (None, 0):
        raise ValueError(
            f"--coordinator-only runs no workers: give it no node rank (got {mn.node_rank})"
        )
    if not 1 <= args.rdzv_timeout <= 86400:
        raise ValueError(f"--rdzv-timeout must be in 1..86400 seconds, got {args.rdzv_timeout:g}")
    return mn


def read_secret(path: str | None) -> None:
    """Puts the secret of ``--secret-file`` into the environment (every process of
    the job inherits it); refuses a file others may read.

    Raises:
        ValueError: the file cannot be read, or others can read or change it.
    """
    if path is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as ex:
        raise ValueError(f"--secret-file {path}: {ex.strerror or ex}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ValueError(
                f"--secret-file {path}: readable or writable by others (mode "
                f"{info.st_mode & 0o777:o}, owner uid {info.st_uid}): chmod 600 it"
            )
        secret = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if not secret:
        raise ValueError(f"--secret-file {path} is empty")
    os.environ[JOB_SECRET_ENV] = secret


def is_coordinator(mn: MultiNodeArgs, coordinator_only: bool) -> bool:
    """Whether this launcher is the job's coordinator: node rank 0 (or
    ``--coordinator-only``); without node ranks, the one that can listen at the
    endpoint on this machine (found out by :func:`listen`)."""
    return coordinator_only or mn.node_rank == 0


def agreed_args(args: argparse.Namespace, mn: MultiNodeArgs) -> dict[str, Any]:
    """The arguments every machine of the job must agree on."""
    return {
        "entrypoint": [args.script, *args.script_args],
        "run_as": "module" if args.module else "program" if args.no_python else "script",
        "nproc_per_node": args.nproc_per_node,
        "nnodes": mn.nnodes,
        "spare_nodes": mn.spare_nodes,
    }


def run_agent(args: argparse.Namespace, mn: MultiNodeArgs, log_level: str) -> int:
    """This machine's node agent, until the job ends; its exit code."""
    import secrets as _secrets

    from ..proctitle import set_title
    from ..userdir import user_dir
    from .node_agent import CoordinatorUnreachable, NodeAgent
    from .node_agent import resolve as resolve_address
    from .supervisor import RUN_TOKEN_ENV

    logging.basicConfig(
        level=log_level, format="%(asctime)s inprocess-run[agent] %(levelname)s %(message)s"
    )
    os.environ[RUN_TOKEN_ENV] = _secrets.token_hex(16)
    name = mn.node_name or machine_name()
    os.environ.setdefault(NODE_ENV, name)  # (machines may share a host name)
    with contextlib.suppress(OSError):
        user_dir()
    set_title(f"inprocess-run node agent of job {mn.job_id or '?'}")
    secret = os.environ[JOB_SECRET_ENV]
    try:
        endpoint = resolve_address(mn.coordinator_host, mn.coordinator_port)
        agent = NodeAgent(
            endpoint,
            secret,
            hello(mn.job_id, mn.node_rank, agreed_args(args, mn), name),
            connect_timeout=args.rdzv_timeout,
        )
        return agent.run()
    except CoordinatorUnreachable as ex:
        log.error("%s", ex)
        return 1


def open_coordinator(mn: MultiNodeArgs) -> socket.socket:
    """The coordinator's listening socket at the job's endpoint.

    Raises:
        StartError: the endpoint is not an address of this machine, or is taken.
    """
    return listen(mn.coordinator_host, mn.coordinator_port)


def rendezvous_for(
    listener: socket.socket, args: argparse.Namespace, mn: MultiNodeArgs, job_id: str
) -> NodesConfig:
    """The start-up of the job on the coordinator: waits for its machines.

    Raises:
        StartError: the job's machines did not join in time.
    """
    return rendezvous(
        listener,
        job_id,
        os.environ[JOB_SECRET_ENV],
        agreed_args(args, mn),
        mn.nnodes + mn.spare_nodes,
        mn.nnodes,
        None if args.coordinator_only else 0,
        args.rdzv_timeout,
    )


def coordinate(listener: socket.socket, config: NodesConfig, state_dir: Any) -> list[str]:
    """Saves who joined in the job's state directory; the controller's extra arguments
    (it accepts on ``listener``, inherited: :data:`~.backends.nodes.LISTEN_FD_ENV`)."""
    from .backends.nodes import LISTEN_FD_ENV

    config.save(state_dir)
    os.environ[LISTEN_FD_ENV] = str(listener.fileno())
    return ["--backend", "nodes"]
