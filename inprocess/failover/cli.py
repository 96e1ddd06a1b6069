"""``inprocess-run``: launch a job under the failover controller, torchrun style.

    inprocess-run --nnodes 2 --nproc-per-node 2 train.py --epochs 3

Workers get ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (plus torchrun's
``TORCHELASTIC_*`` variables), so a script written for torchrun runs
unchanged. The exit code is 0 only when every worker finished successfully.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import math
import os
import re
import resource
import secrets
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .. import persist_signal
from ..node import NODE_ENV
from ..ownership import distrust_chain
from ..proctitle import set_title
from ..records import EVENTS_FILE, RECORDS_ENV, RESTARTS_FILE, records_distrust
from ..security import JOB_SECRET_ENV, check_job_secret
from ..userdir import user_dir
from . import etcd_member, multinode, policy
from .cluster_env import nnodes_range
from .console import LOG_DIR_MODE, Console, StatusLine
from .spec import (
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_STANDBY_JOIN_TIMEOUT,
    JOB_ID_PATTERN,
    JOIN_TIMEOUT_RANGE,
    MAX_COUNT,
    MAX_JOB_ID,
    MAX_NODES,
    MAX_NPROC_PER_NODE,
    MAX_STANDBY,
    MONITOR_INTERVAL_RANGE,
    JobSpec,
    SpecError,
)
from .state import StateError, StateStore
from .supervisor import (
    CONTROLLER_STABLE_SECONDS,
    MAX_CONTROLLER_RESTARTS,
    RUN_TOKEN_ENV,
    Supervisor,
    check_private_dir,
)

log = logging.getLogger(__name__)

#: where the job-id locks are kept (per user, below it): one place for every launch
LOCK_BASE = "/tmp"


def _default_job_id() -> str:
    return time.strftime("job-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="inprocess-run",
        description="Run a distributed PyTorch job with in-process restart and job failover.",
    )
    p.add_argument(
        "--nnodes",
        type=_nnodes,
        default=None,
        help="number of nodes, or MIN:MAX: MIN nodes train, MAX-MIN more are hot spares "
        "(like --spare-nodes; default 1)",
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=_nproc_per_node,
        default=1,
        help="workers per node: a number, or gpu / cpu / auto as with torchrun (default 1)",
    )
    p.add_argument(
        "--spare-nodes",
        type=_integer(0, MAX_NODES),
        default=0,
        help=f"spare node slots for relaunching failing nodes (0..{MAX_NODES}, default 0)",
    )
    p.add_argument(
        "--max-restarts",
        type=_integer(0, MAX_COUNT),
        default=3,
        help="process restarts allowed per worker (default 3)",
    )
    p.add_argument(
        "--per-node-max-failures",
        type=_integer(1, MAX_COUNT),
        default=3,
        help="failures of one node before it is relaunched (default 3)",
    )
    p.add_argument(
        "--job-max-restarts",
        type=_integer(0, MAX_COUNT),
        default=3,
        help="cold restarts of the whole job (default 3)",
    )
    p.add_argument(
        "--node-max-relaunches",
        type=_integer(0, MAX_COUNT),
        default=1,
        help="node relaunches allowed (default 1)",
    )
    p.add_argument(
        "--max-controller-restarts",
        type=_integer(0, MAX_COUNT),
        default=MAX_CONTROLLER_RESTARTS,
        help="crashes of the controller in a row (each within "
        f"{CONTROLLER_STABLE_SECONDS:g}s of its start) before the job is given up "
        f"(default {MAX_CONTROLLER_RESTARTS})",
    )
    p.add_argument(
        "--state-dir", type=_directory, help="where the controller keeps its state"
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run SCRIPT as a Python module, like python -m (SCRIPT is the module's name)",
    )
    p.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="execute SCRIPT directly (a program on PATH or a path), not with Python",
    )
    p.add_argument(
        "--log-dir",
        "--log_dir",
        type=_directory,
        default=None,
        help="where per-worker log files go (<log-dir>/<job-id>_<random>/attempt_<generation>/"
        "<rank>/stdout.log, stderr.log; default with --redirects / --tee: <state-dir>/logs)",
    )
    p.add_argument(
        "-r",
        "--redirects",
        default="0",
        help="worker streams written to the log files only: 0 none, 1 stdout, 2 stderr, "
        "3 both, or per local rank, e.g. 0:1,1:2 (default 0)",
    )
    p.add_argument(
        "-t",
        "--tee",
        default="0",
        help="worker streams written to the log files and to the console (lines prefixed "
        "[default<rank>]:), same values as --redirects (default 0)",
    )
    p.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default=None,
        help="local ranks whose output reaches the console, e.g. 0 or 0,1 (default: all); "
        "the others' output goes to their log files only, or nowhere",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="a job on this machine only: the store on 127.0.0.1, on a free port "
        "(what inprocess-run does by default)",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no status line and no log lines of inprocess-run's own, only errors "
        "(workers' output is unchanged)",
    )
    p.add_argument("--job-id", default=None, help="the job's id (default: generated)")
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        help="address the job's store binds to and workers connect to (default: 127.0.0.1; "
        "with --backend ray, the IP address of the driver's Ray node)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=_integer(1, 65535),
        default=None,
        help="port of the job's store (MASTER_PORT; default: a free port, a new one for "
        "each cold restart)",
    )
    for flags, advice in _TORCHRUN_ONLY:
        p.add_argument(
            *flags, nargs="?", action=_Unsupported, advice=advice, help=argparse.SUPPRESS
        )
    multinode.add_flags(p)
    p.add_argument(
        "--backend",
        default="local",
        choices=["local", "ray"],
        help="where workers run: this machine (local) or the nodes of a Ray cluster (ray)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to run on (default: RAY_ADDRESS, else a local cluster, "
        "started if none runs)",
    )
    p.add_argument(
        "--ray-bundle",
        default=None,
        help='Ray resources reserved on each node, as JSON (default {"CPU": 1}); '
        'e.g. \'{"CPU": 8, "GPU": 8}\'',
    )
    p.add_argument(
        "--monitor-interval",
        type=_seconds(*MONITOR_INTERVAL_RANGE),
        default=0.1,
        help=f"controller polling interval (s; {MONITOR_INTERVAL_RANGE[0]:g}.."
        f"{MONITOR_INTERVAL_RANGE[1]:g}, default 0.1)",
    )
    p.add_argument("--log-level", default="INFO", help="controller log level (default INFO)")
    p.add_argument(
        "--standby",
        type=_integer(0, MAX_STANDBY),
        default=1,
        help="warm standby processes per node slot (torch imported, waiting to replace a "
        f"worker at once); 0 turns them off (0..{MAX_STANDBY}, default 1)",
    )
    p.add_argument(
        "--join-timeout",
        type=_seconds(*JOIN_TIMEOUT_RANGE),
        default=DEFAULT_JOIN_TIMEOUT,
        help="seconds a freshly spawned worker of a Wrapper job has to join it before it "
        "is replaced by a new process (a replacement that does not join either ends the "
        f"job); 0: no deadline (default {DEFAULT_JOIN_TIMEOUT:g})",
    )
    p.add_argument(
        "--standby-join-timeout",
        type=_seconds(*JOIN_TIMEOUT_RANGE),
        default=DEFAULT_STANDBY_JOIN_TIMEOUT,
        help="the same for a warm standby that takes a worker's place (torch imported "
        f"already); 0: no deadline (default {DEFAULT_STANDBY_JOIN_TIMEOUT:g})",
    )
    p.add_argument(
        "script", help="the training script (with -m: a module; with --no-python: a program)"
    )
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["report"]:  # `inprocess-run report STATE_DIR`; a script: ./report
        from ..report import main as report_main

        return report_main(given[1:], prog="inprocess-run report")
    args = parser().parse_args(argv)
    # Slurm's warning before the end (--signal=USR1@N) reaches every process of the
    # job: the launcher (coordinator or node agent) outlives it, the ranks persist.
    persist_signal.survive()
    if args.quiet:
        args.log_level = "ERROR"
    level = logging.getLevelName(str(args.log_level).upper())
    if not isinstance(level, int):
        return _error(
            f"--log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
            f"got {args.log_level!r}"
        )
    args.log_level = logging.getLevelName(level)
    problem = _node_counts(args)
    if problem:
        return _error(problem)
    mn, listener, agent, handoff = None, None, False, None
    if args.backend == "local":
        try:
            multinode.read_secret(args.secret_file)
            mn = multinode.resolve(args, os.environ)
        except ValueError as ex:
            return _error(str(ex))
    elif args.node_rank is not None or args.rdzv_endpoint or args.coordinator_only:
        return _error("--node-rank, --rdzv-endpoint and --coordinator-only need --backend local")
    if mn is not None:
        if not os.environ.get(JOB_SECRET_ENV):
            return _error(
                "a job of several machines needs the same secret on every machine: set "
                f"{JOB_SECRET_ENV} (e.g. to the output of: python -c 'import secrets; "
                "print(secrets.token_hex(32))') or give --secret-file"
            )
        args.nnodes, args.spare_nodes = mn.nnodes, mn.spare_nodes
        args.job_id = args.job_id or mn.job_id
        args.master_port = None  # (the store's port is chosen by the coordinator)
        if mn.rdzv_backend == "etcd":
            if args.coordinator_only:
                return _error(
                    "--coordinator-only does not go with --rdzv-backend etcd: every machine's "
                    "inprocess-run is a candidate coordinator, elected through etcd"
                )
            try:
                handoff = etcd_member.Handoff.from_env()
            except ValueError as ex:
                return _error(str(ex))
            if handoff is not None:  # the elected launcher's coordinator process
                listener = socket.socket(fileno=handoff.listen_fd)
                args.coordinator_only = True
        elif multinode.is_coordinator(mn, args.coordinator_only) or mn.node_rank is None:
            try:
                listener = multinode.open_coordinator(mn)
            except multinode.StartError as ex:
                if mn.node_rank == 0 or args.coordinator_only:
                    return _error(str(ex))
        agent = listener is None
        # this machine's name for its workers (Slurm's nodes may share a host name)
        os.environ.setdefault(NODE_ENV, mn.node_name or multinode.machine_name())
        if not agent and args.master_addr is None:
            args.master_addr = mn.coordinator_host
    if args.max_controller_restarts < 0:
        return _error(f"--max-controller-restarts must be >= 0, got {args.max_controller_restarts}")
    ray_node = bundle = None
    if args.backend != "ray" and (args.ray_address or args.ray_bundle):
        return _error("--ray-address and --ray-bundle need --backend ray")
    if args.backend == "ray":
        try:
            from .ray_driver import connect, parse_bundle
        except ImportError as ex:
            return _error(
                f"--backend ray needs Ray: pip install 'inprocess[ray]' ({ex})"
            )
        try:
            bundle = parse_bundle(args.ray_bundle)
        except ValueError as ex:
            return _error(str(ex))
    problem = _check_launch_flags(args) or _check_machine(args, one_node=mn is not None)
    if problem:
        return _error(problem)
    if agent:
        assert mn is not None
        if mn.rdzv_backend == "etcd":
            return etcd_member.run(args, mn, given)
        return multinode.run_agent(args, mn, args.log_level)
    if args.backend == "ray":
        ray_node = connect(args.ray_address)  # before our variables enter the environment
    if args.master_addr is None:
        args.master_addr = ray_node["ip"] if ray_node else "127.0.0.1"
    job_id = args.job_id or _default_job_id()
    try:
        state_dir = _trusted_path(
            (args.state_dir or Path("inprocess-runs") / job_id).absolute(), "--state-dir"
        )
    except StateError as ex:
        return _error(str(ex))
    if state_dir == Path(state_dir.anchor):
        return _error(
            f"--state-dir {args.state_dir} is the root directory: give a directory of its own "
            "(the job's state and records are written into it)"
        )
    run_as = "module" if args.module else "program" if args.no_python else "script"
    entry = str(Path(args.script).absolute()) if run_as == "script" else args.script
    log_dir = None
    if args.log_dir is not None or args.redirects.strip() != "0" or args.tee.strip() != "0":
        base = (args.log_dir or state_dir / "logs").absolute()
        log_dir = base / f"{job_id}_{secrets.token_hex(4)}"
    try:
        spec = JobSpec(
            job_id=job_id,
            entrypoint=(entry, *args.script_args),
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            spare_nodes=args.spare_nodes,
            max_restarts=args.max_restarts,
            per_node_max_failures=args.per_node_max_failures,
            job_max_restarts=args.job_max_restarts,
            node_max_relaunches=args.node_max_relaunches,
            state_dir=str(state_dir),
            master_addr=args.master_addr,
            monitor_interval=args.monitor_interval,
            run_as=run_as,
            master_port=args.master_port or 0,
            log_dir=str(log_dir) if log_dir is not None else None,
            redirects=args.redirects,
            tee=args.tee,
            local_ranks_filter=args.local_ranks_filter,
            standby=args.standby,
            join_timeout=args.join_timeout,
            standby_join_timeout=args.standby_join_timeout,
        )
    except SpecError as ex:
        return _error(_flag_names(str(ex)))
    # ps/pgrep: the script's name is for its workers alone (see inprocess.proctitle)
    set_title(f"inprocess-run launcher of job {job_id}")
    controller_args = ["--log-level", args.log_level]
    # a coordinator elected for a job that runs already: no rendezvous, the job's
    # state and machines come from etcd (see etcd_member)
    taking_over = False
    if handoff is not None:
        try:
            taking_over = etcd_member.job_started(handoff)
        except etcd_member.EtcdError as ex:
            return _error(f"etcd: {ex}")
    if listener is not None and not taking_over:
        assert mn is not None
        logging.basicConfig(
            level=args.log_level, format="%(asctime)s inprocess-run %(levelname)s %(message)s"
        )
        try:
            config = multinode.rendezvous_for(listener, args, mn, job_id)
        except multinode.StartError as ex:
            listener.close()
            return _error(str(ex))
    lock = None
    # Invariant: a refused start leaves the state dir as it found it (the
    # corrected rerun with the same --state-dir starts): every flag is checked
    # before anything is written, and what was written is removed on a refusal.
    made_dir = not os.path.lexists(state_dir)
    store: StateStore | etcd_member.EtcdStateStore = StateStore(state_dir)
    created = False
    try:
        if handoff is not None:  # the job's state lives in etcd (see etcd_member)
            store = etcd_member.state_store_for(handoff, state_dir)
        else:  # (with etcd, the lease is the job's lock)
            lock = lock_job_id(job_id)  # held (open) as long as this process lives
        if log_dir is not None:
            _check_log_dir(log_dir.parent, "--log-dir" if args.log_dir is not None else None)
        _prepare_state_dir(state_dir)
        if taking_over:
            assert isinstance(store, etcd_member.EtcdStateStore)
            store.load()  # (mirrored into the state dir)
            config = etcd_member.load_nodes(store, state_dir)
        else:
            store.create(policy.new_job_state(spec, now=time.time()))
            created = True
        if isinstance(store, etcd_member.EtcdStateStore) and not taking_over:
            etcd_member.save_nodes(store, config)
        if listener is not None:
            controller_args += multinode.coordinate(listener, config, state_dir)
        if log_dir is not None:
            flag = "--log-dir" if args.log_dir is not None else "--state-dir"
            try:
                log_dir.mkdir(mode=LOG_DIR_MODE, parents=True)  # (nobody else writes)
            except OSError as ex:
                raise StateError(f"{flag} {log_dir.parent}: {ex.strerror or ex}") from None
            _check_chain(log_dir, flag)  # (the parents it made: mode by the umask)
    except (StateError, OSError, etcd_member.EtcdError, etcd_member.NotLeader) as ex:
        if lock is not None:
            lock.release()
        in_file = created and isinstance(store, StateStore)
        _undo_start(state_dir, store.path if in_file else None, made_dir)
        if isinstance(ex, etcd_member.EtcdError | etcd_member.NotLeader):
            return _error(f"the job's state in etcd: {ex}")
        if isinstance(ex, StateError):
            return _error(str(ex))
        return _error(f"--state-dir {state_dir}: {ex.strerror or ex}")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s inprocess-run %(levelname)s %(message)s"
    )
    log.info("job %s: state in %s", job_id, state_dir)
    if log_dir is not None:
        log.info("job %s: worker logs in %s", job_id, log_dir)
    # Every process of the job inherits these: the job id (what the user sees),
    # this run's token (what cleanup goes by: a reused job id never matches it)
    # and the job's store secret (a user-given INPROCESS_JOB_SECRET is kept).
    run_token = secrets.token_hex(16)
    os.environ["INPROCESS_JOB_ID"] = job_id
    os.environ[RUN_TOKEN_ENV] = run_token
    if not os.environ.get(JOB_SECRET_ENV):
        os.environ[JOB_SECRET_ENV] = secrets.token_hex(32)
    # This user's private directory (node groups), found once here for every
    # process of the job: user_dir() puts it in the environment they inherit.
    with contextlib.suppress(OSError):  # (then each rank says why it has none)
        user_dir()
    # the console view (status line, tee'd logs) runs as long as the job
    console = Console(state_dir, spec, None if args.quiet else StatusLine.usable(2))
    console.start()
    try:
        if ray_node is not None:
            from .ray_driver import RayDriver

            return RayDriver(
                state_dir,
                ray_node,
                bundle or {},
                args.log_level,
                args.max_controller_restarts,
                run_token,
            ).run()
        return Supervisor(
            state_dir,
            controller_args,
            run_token,
            max_controller_restarts=args.max_controller_restarts,
            pass_fds=(listener.fileno(),) if listener is not None else (),
            recover_first=taking_over,
        ).run()
    finally:
        console.stop()
        if lock is not None:
            lock.release()


#: torchrun's flags that mean nothing here, and what to do instead
_TORCHRUN_ONLY: list[tuple[tuple[str, ...], str]] = [
    (
        ("--rdzv-conf", "--rdzv_conf"),
        "no rendezvous to configure; the job's limits are --max-restarts, "
        "--per-node-max-failures, --job-max-restarts and --node-max-relaunches",
    ),
    (("--role",), "every worker runs the same SCRIPT; there are no roles"),
    (
        ("--start-method", "--start_method"),
        "workers are always new processes (like spawn); drop it",
    ),
    (("--max_restarts",), "use --max-restarts (restarts per worker) or --job-max-restarts"),
    (("--local-addr", "--local_addr"), "use --master-addr"),
    (("--logs-specs", "--logs_specs"), "use --log-dir, --redirects and --tee"),
]


class _Unsupported(argparse.Action):
    """A torchrun flag we do not take: fails the parse, saying what to use instead."""

    def __init__(self, option_strings: list[str], dest: str, advice: str, **kwargs: object):
        self.advice = advice
        super().__init__(option_strings, dest, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        raise argparse.ArgumentError(self, f"not an inprocess-run flag: {self.advice}")


def _nnodes(text: str) -> str:
    """A number of nodes, or ``MIN:MAX`` (checked here, read by :func:`_node_counts`)."""
    try:
        value = int(text)
    except ValueError:
        pass
    else:
        _in_range(value, 1, MAX_NODES, text)
    try:
        nnodes_range(text)
    except ValueError as ex:
        raise argparse.ArgumentTypeError(str(ex).removeprefix(f"--nnodes={text!r}: ")) from None
    return text


def _node_counts(args: argparse.Namespace) -> str | None:
    """Sets ``args.nnodes`` and ``args.spare_nodes`` from ``--nnodes [MIN:MAX]`` and
    ``--spare-nodes``; the problem if they disagree."""
    args.nnodes_given = args.nnodes
    low, high = nnodes_range(args.nnodes or "1")
    if high > low:
        if args.spare_nodes not in (0, high - low):
            return (
                f"--nnodes {args.nnodes} means {high - low} spare node(s), but --spare-nodes "
                f"is {args.spare_nodes}: give one of them"
            )
        args.spare_nodes = high - low
    args.nnodes = low
    return None


def _nproc_per_node(text: str) -> int:
    """A number, or torchrun's ``gpu`` (GPUs here), ``cpu`` (CPUs) or ``auto`` (either)."""
    if text in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus or text == "auto":
            return gpus or (os.cpu_count() or 1)
        raise argparse.ArgumentTypeError("gpu: this machine has no GPU visible to torch")
    if text == "cpu":
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer, gpu, cpu or auto, got {text!r}"
        ) from None
    return _in_range(value, 1, MAX_NPROC_PER_NODE, text)


def _in_range(value: int, low: int, high: int, text: str) -> int:
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be an integer in {low}..{high}, got {text!r}")
    return value


def _integer(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (argparse names the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer in {low}..{high}, got {text!r}"
            ) from None
        return _in_range(value, low, high, text)

    return parse


def _seconds(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number of seconds in ``low..high`` (never inf or nan)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:  # (false for nan)
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds in {low:g}..{high:g}, got {text!r}"
            )
        return value

    return parse


def _directory(text: str) -> Path:
    """An argparse type: a directory's path, not empty (an empty one would mean the
    current directory, silently)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"must name a directory, got {text!r} (for the current directory, give '.')"
        )
    return Path(text)


def _check_launch_flags(args: argparse.Namespace) -> str | None:
    """The torchrun-style flags that do not go together, a job id, address or secret
    that cannot work, or a SCRIPT that cannot run."""
    if args.module and args.no_python:
        return "-m/--module and --no-python exclude each other (a module needs Python)"
    if args.job_id is not None:
        job_id = args.job_id
        shown = repr(job_id) if len(job_id) <= 40 else f"{job_id[:20]!r}... ({len(job_id)} chars)"
        if not JOB_ID_PATTERN.fullmatch(job_id) or job_id in (".", ".."):
            return (
                "--job-id must be letters, digits, '_', '.' or '-' (not '.' or '..'), "
                f"got {shown}"
            )
        if len(job_id) > MAX_JOB_ID:
            return f"--job-id must be at most {MAX_JOB_ID} characters, got {shown}"
    try:
        check_job_secret()
    except ValueError as ex:
        return str(ex)
    records = os.environ.get(RECORDS_ENV)
    if records and args.backend == "local":  # (a Ray node's path is that node's business)
        why = records_distrust(records)
        if why is not None:
            return (
                f"{RECORDS_ENV}={records}: {why}; unset it, or name a file of this user "
                "in a place that only this user (or root) can change"
            )
    local_only = [
        flag
        for flag, given in (
            ("--log-dir", args.log_dir is not None),
            ("--redirects", args.redirects.strip() != "0"),
            ("--tee", args.tee.strip() != "0"),
            ("--local-ranks-filter", args.local_ranks_filter is not None),
            ("--master-port", args.master_port is not None),
            ("--standalone", args.standalone),
        )
        if given
    ]
    if args.backend == "ray" and local_only:
        return (
            f"{', '.join(local_only)}: work with --backend local only (with --backend ray, "
            "workers' output reaches the console through Ray's logs and the store's port "
            "is chosen on its Ray node)"
        )
    if args.standalone and (args.master_addr is not None or args.master_port is not None):
        return (
            "--standalone picks the store's address and port itself: "
            "drop --master-addr/--master-port"
        )
    if args.local_ranks_filter is not None:
        try:
            args.local_ranks_filter = [int(r) for r in args.local_ranks_filter.split(",")]
            if any(r < 0 for r in args.local_ranks_filter):
                raise ValueError
        except ValueError:
            return (
                "--local-ranks-filter must be a comma-separated list of local ranks "
                f"(integers >= 0), e.g. 0 or 0,1, got {args.local_ranks_filter!r}"
            )
    if args.master_addr is not None:
        problem = _check_master_addr(args.master_addr, local=args.backend == "local")
        if problem:
            return problem
    if args.master_port is not None:
        if not 1 <= args.master_port <= 65535:
            return f"--master-port must be in 1..65535, got {args.master_port}"
        addr = args.master_addr or "127.0.0.1"
        try:
            with socket.create_server((addr, args.master_port)):
                pass
        except OSError as ex:
            return f"--master-port {args.master_port}: cannot listen on {addr}: {ex.strerror or ex}"
    if args.module:
        return None
    if args.no_python:
        if shutil.which(args.script) is None:
            return (
                f"--no-python: {args.script!r} is neither a command on PATH "
                "nor an executable file"
            )
        return None
    if not Path(args.script).is_file():
        return f"SCRIPT {args.script!r} is not a file"
    return None


#: most worker processes one machine runs per CPU (--backend local): far beyond
#: any useful oversubscription, far below what makes a launch take hours
LOCAL_WORKERS_PER_CPU = 64
#: file descriptors the controller holds per process it starts (a pidfd, a socket)
FDS_PER_PROCESS = 2
#: file descriptors kept for everything else (the store, state and log files)
FDS_RESERVED = 64
#: highest file descriptor number ``select()`` takes (``FD_SETSIZE``), used on a
#: zygote's and a store server's descriptors
FD_SETSIZE = 1024


def local_capacity() -> int:
    """Most processes (workers, standbys and their zygotes) a ``--backend local`` job
    may start on this machine: :data:`LOCAL_WORKERS_PER_CPU` per CPU, below this
    user's process limit, and few enough that the controller's descriptors for
    them stay within its open-file limit and ``FD_SETSIZE``."""
    limit = LOCAL_WORKERS_PER_CPU * (os.cpu_count() or 1)
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, max(1, soft // 2))  # room for the user's other processes
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = FD_SETSIZE if files == resource.RLIM_INFINITY else min(files, FD_SETSIZE)
    return min(limit, max(1, (files - FDS_RESERVED) // FDS_PER_PROCESS))


def _check_machine(args: argparse.Namespace, one_node: bool = False) -> str | None:
    """Refuses a local launch larger than the machine can hold, before anything starts:
    the workers, and the standbys (``--standby`` on every node slot, spares included)
    with one zygote per slot that forks them. ``one_node``: this machine runs one
    node of a job of several machines."""
    if one_node:
        args = argparse.Namespace(**{**vars(args), "nnodes": 1, "spare_nodes": 0})
    if args.backend != "local" or args.nnodes < 1 or args.nproc_per_node < 1:
        return None  # bad numbers are refused by name later
    workers = args.nnodes * args.nproc_per_node
    capacity = local_capacity()
    where = (
        f"--backend local runs at most {capacity} on this machine ({LOCAL_WORKERS_PER_CPU} "
        f"per CPU, {os.cpu_count()} CPUs, within the process and open-file limits)"
    )
    if workers > capacity:
        return (
            f"--nproc-per-node {args.nproc_per_node} with --nnodes {args.nnodes} is "
            f"{workers} worker processes; {where}: lower them, or use --backend ray for "
            "several machines"
        )
    slots = args.nnodes + args.spare_nodes
    standbys = slots * (args.standby + 1) if args.standby > 0 else 0
    if workers + standbys > capacity:
        return (
            f"--standby {args.standby} on {slots} node slot(s) (--nnodes {args.nnodes} + "
            f"--spare-nodes {args.spare_nodes}) is {standbys} standby and zygote processes, "
            f"{workers + standbys} with the {workers} workers; {where}: lower --standby or "
            "--spare-nodes"
        )
    return None


def _check_master_addr(addr: str, local: bool) -> str | None:
    """Refuses a ``--master-addr`` that does not resolve, or (``local``: the store is
    bound on this machine) that is not an address of this machine."""
    try:
        socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as ex:
        why = getattr(ex, "strerror", None) or str(ex)
        return f"--master-addr {addr!r}: cannot resolve it ({why})"
    if local:
        try:
            with socket.create_server((addr, 0)):
                pass
        except OSError as ex:
            return (
                f"--master-addr {addr!r}: the job's store cannot listen on it here "
                f"({ex.strerror or ex}); with --backend local it must be an address of "
                "this machine"
            )
    return None


def _trusted_path(path: Path, flag: str) -> Path:
    """``path`` (absolute) with its symlinks resolved, each checked on the way: a symlink
    another user owns (other than root) is refused, since that user could point it
    anywhere at any time (the job would then write where they chose). Components that
    do not exist yet are kept as given.

    Raises:
        StateError: naming ``flag``, the symlink and its owner.
    """
    resolved = Path(path.anchor)
    pending = list(path.parts[1:])
    hops = 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            resolved = resolved.parent
            continue
        candidate = resolved / name
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            return Path(os.path.normpath(candidate.joinpath(*pending)))
        except OSError as ex:
            raise StateError(f"{flag} {path}: {candidate}: {ex.strerror or ex}") from None
        if not stat.S_ISLNK(info.st_mode):
            resolved = candidate
            continue
        if info.st_uid not in (os.getuid(), 0):
            raise StateError(
                f"{flag} {path}: {candidate} is a symlink owned by uid {info.st_uid}, not by "
                f"this user ({os.getuid()}) or root: that user could point it anywhere; "
                "give the real path"
            )
        hops += 1
        if hops > 40:
            raise StateError(f"{flag} {path}: too many levels of symlinks")
        target = Path(os.readlink(candidate))
        if target.is_absolute():
            resolved = Path(target.anchor)
        pending[:0] = [p for p in target.parts if p != target.anchor]
    return resolved


def _error(message: str) -> int:
    print(f"inprocess-run: error: {message}", file=sys.stderr)
    return 2


def _prepare_state_dir(state_dir: Path) -> None:
    """Creates the state dir (mode 0700) or checks an existing one is ours and private,
    in a chain of directories only this user and root can change (:func:`_check_chain`)."""
    if state_dir.exists() and not state_dir.is_dir():
        raise StateError(f"--state-dir {state_dir} is not a directory")
    _check_chain(state_dir, "--state-dir")  # before anything is made there
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        state_dir.mkdir(mode=0o700)
    _check_chain(state_dir, "--state-dir")  # (the parents it made: mode by the umask)
    try:
        check_private_dir(state_dir, "--state-dir")
    except StateError as ex:
        raise StateError(f"{ex}; the job's state and pid files must be private") from None
    for name in (RESTARTS_FILE, EVENTS_FILE):
        if (state_dir / name).is_symlink():
            raise StateError(
                f"--state-dir {state_dir}: {name} is a symlink; remove it (the job's "
                "records are never written through one)"
            )


def _check_log_dir(base: Path, flag: str | None) -> None:
    """Refuses a log dir that cannot be made: below a file, not writable, or (the
    default, ``<state-dir>/logs``: ``flag`` None) a symlink planted in the state dir.

    Raises:
        StateError: naming the flag (``--log-dir`` or ``--state-dir``) and the path.
    """
    name = flag or "--state-dir"
    if flag is None and base.is_symlink():
        raise StateError(f"--state-dir {base.parent}: {base.name} is a symlink; remove it")
    _check_chain(base, name)
    probe = base
    while not os.path.lexists(probe):
        probe = probe.parent
    if not probe.is_dir():
        raise StateError(f"{name} {base}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise StateError(f"{name} {base}: {probe} is not writable")


def _check_chain(path: Path, flag: str) -> None:
    """Refuses a place the job writes while it runs (its state, its logs) that another
    user could swap for one of theirs (:func:`inprocess.ownership.distrust_chain`):
    the job's processes, and torch's ``error.json`` in the workers, would then write
    wherever that user chose.

    Raises:
        StateError: naming ``flag``, the path and the step another user controls.
    """
    why = distrust_chain(path)
    if why is not None:
        raise StateError(
            f"{flag} {path}: {why}; choose a place that only this user (or root) can change"
        )


def _undo_start(state_dir: Path, state_file: str | None, made_dir: bool) -> None:
    """Removes what a refused start wrote: its state file, and the state dir it made."""
    if state_file is not None:
        with contextlib.suppress(OSError):
            os.unlink(state_file)
    if made_dir:
        with contextlib.suppress(OSError):
            state_dir.rmdir()  # only if empty: never someone's files


def _lock_dir() -> Path:
    """This user's private directory for the job-id locks: in ``/tmp`` whatever
    ``$TMPDIR`` or ``$XDG_RUNTIME_DIR`` say, so two launches of one job id that
    differ in them still meet (see :func:`inprocess.userdir.user_dir`)."""
    try:
        return Path(user_dir(LOCK_BASE))
    except OSError as ex:
        raise StateError(f"no private directory for job-id locks in {LOCK_BASE}: {ex}") from None


class JobIdLock:
    """This process's claim on a job id: an exclusive ``flock`` on a per-user lock
    file, released by the kernel when the process ends, however it ends, and
    atomic (two launches cannot both win). :meth:`release` also removes the file."""

    def __init__(self, job_id: str) -> None:
        self.path = _lock_dir() / f"job-{job_id}.lock"
        # Invariant: the lock held is on the file that the path names. A launcher
        # that ends removes its file while it still holds the lock (release), so a
        # lock won on a file already removed guards nothing: open the path again.
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise StateError(
                    f"--job-id {job_id!r} is already used by a live job (inprocess-run pid "
                    f"{holder}); choose another id or wait for that job to end"
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd: int | None = fd

    def release(self) -> None:
        """Removes the lock file, then gives the lock up (idempotent)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        if _same_file(fd, self.path):
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, fst = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def lock_job_id(job_id: str) -> JobIdLock:
    """Claims ``job_id`` for this process (see :class:`JobIdLock`).

    Raises:
        StateError: a live job uses ``job_id`` (names its launcher's pid).
    """
    return JobIdLock(job_id)


def _flag_names(message: str) -> str:
    """Names spec fields the way they are spelled on the command line (the values
    quoted in the message stay as they are)."""
    return re.sub(r"JobSpec\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)


if __name__ == "__main__":
    sys.exit(main())
