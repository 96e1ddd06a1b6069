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
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

from ..security import JOB_SECRET_ENV
from . import policy
from .spec import JobSpec, SpecError
from .state import StateError, StateStore
from .supervisor import (
    CONTROLLER_STABLE_SECONDS,
    MAX_CONTROLLER_RESTARTS,
    RUN_TOKEN_ENV,
    Supervisor,
    check_private_dir,
)

log = logging.getLogger(__name__)


def _default_job_id() -> str:
    return time.strftime("job-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="inprocess-run",
        description="Run a distributed PyTorch job with in-process restart and job failover.",
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    p.add_argument(
        "--spare-nodes", type=int, default=0, help="spare node slots for relaunching failing nodes"
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="process restarts allowed per worker (default 3)",
    )
    p.add_argument(
        "--per-node-max-failures",
        type=int,
        default=3,
        help="failures of one node before it is relaunched (default 3)",
    )
    p.add_argument(
        "--job-max-restarts", type=int, default=3, help="cold restarts of the whole job (default 3)"
    )
    p.add_argument(
        "--node-max-relaunches", type=int, default=1, help="node relaunches allowed (default 1)"
    )
    p.add_argument(
        "--max-controller-restarts",
        type=int,
        default=MAX_CONTROLLER_RESTARTS,
        help="crashes of the controller in a row (each within "
        f"{CONTROLLER_STABLE_SECONDS:g}s of its start) before the job is given up "
        f"(default {MAX_CONTROLLER_RESTARTS})",
    )
    p.add_argument("--state-dir", type=Path, help="where the controller keeps its state")
    p.add_argument("--job-id", default=None, help="the job's id (default: generated)")
    p.add_argument(
        "--master-addr",
        default=None,
        help="address the job's store binds to and workers connect to (default: 127.0.0.1; "
        "with --backend ray, the IP address of the driver's Ray node)",
    )
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
        "--monitor-interval", type=float, default=0.1, help="controller polling interval (s)"
    )
    p.add_argument("--log-level", default="INFO", help="controller log level (default INFO)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["report"]:  # `inprocess-run report STATE_DIR`; a script: ./report
        from ..report import main as report_main

        return report_main(given[1:], prog="inprocess-run report")
    args = parser().parse_args(argv)
    level = logging.getLevelName(str(args.log_level).upper())
    if not isinstance(level, int):
        return _error(
            f"--log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
            f"got {args.log_level!r}"
        )
    args.log_level = logging.getLevelName(level)
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
    if not Path(args.script).is_file():
        return _error(f"SCRIPT {args.script!r} is not a file")
    if args.backend == "ray":
        ray_node = connect(args.ray_address)  # before our variables enter the environment
    if args.master_addr is None:
        args.master_addr = ray_node["ip"] if ray_node else "127.0.0.1"
    job_id = args.job_id or _default_job_id()
    state_dir = (args.state_dir or Path("inprocess-runs") / job_id).absolute()
    script = Path(args.script)
    if not script.is_file():
        return _error(f"SCRIPT {args.script!r} is not a file")
    try:
        spec = JobSpec(
            job_id=job_id,
            entrypoint=(str(script.absolute()), *args.script_args),
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
        )
    except SpecError as ex:
        return _error(_flag_names(str(ex)))
    lock = None
    try:
        lock = lock_job_id(job_id)  # held (open) as long as this process lives
        _prepare_state_dir(state_dir)
        StateStore(state_dir).create(policy.new_job_state(spec, now=time.time()))
    except (StateError, OSError) as ex:
        if lock is not None:
            os.close(lock)
        if isinstance(ex, StateError):
            return _error(str(ex))
        return _error(f"--state-dir {state_dir}: {ex.strerror or ex}")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s inprocess-run %(levelname)s %(message)s"
    )
    log.info("job %s: state in %s", job_id, state_dir)
    # Every process of the job inherits these: the job id (what the user sees),
    # this run's token (what cleanup goes by: a reused job id never matches it)
    # and the job's store secret (a user-given INPROCESS_JOB_SECRET is kept).
    run_token = secrets.token_hex(16)
    os.environ["INPROCESS_JOB_ID"] = job_id
    os.environ[RUN_TOKEN_ENV] = run_token
    if not os.environ.get(JOB_SECRET_ENV):
        os.environ[JOB_SECRET_ENV] = secrets.token_hex(32)
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
            ["--log-level", args.log_level],
            run_token,
            max_controller_restarts=args.max_controller_restarts,
        ).run()
    finally:
        os.close(lock)


def _error(message: str) -> int:
    print(f"inprocess-run: error: {message}", file=sys.stderr)
    return 2


def _prepare_state_dir(state_dir: Path) -> None:
    """Creates the state dir (mode 0700) or checks an existing one is ours and private."""
    if state_dir.exists() and not state_dir.is_dir():
        raise StateError(f"--state-dir {state_dir} is not a directory")
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        state_dir.mkdir(mode=0o700)
    try:
        check_private_dir(state_dir, "--state-dir")
    except StateError as ex:
        raise StateError(f"{ex}; the job's state and pid files must be private") from None


def _lock_dir() -> Path:
    """A private per-user directory for the job-id locks."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.path.isdir(runtime) else Path(tempfile.gettempdir())
    directory = base / f"inprocess-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    check_private_dir(directory, "lock directory")
    return directory


def lock_job_id(job_id: str) -> int:
    """Claims ``job_id`` for this process; returns the lock's fd (keep it open).

    An exclusive ``flock`` on a per-user lock file: released by the kernel when
    this process ends, however it ends, and atomic (two launches cannot both
    win).

    Raises:
        StateError: a live job uses ``job_id`` (names its launcher's pid).
    """
    path = _lock_dir() / f"job-{job_id}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StateError(
            f"--job-id {job_id!r} is already used by a live job (inprocess-run pid {holder}); "
            "choose another id or wait for that job to end"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _flag_names(message: str) -> str:
    """Names spec fields the way they are spelled on the command line."""
    return message.replace("JobSpec.", "--").replace("_", "-")


if __name__ == "__main__":
    sys.exit(main())
