"""``inprocess-run``: launch a job under the failover controller, torchrun style.

    inprocess-run --nnodes 2 --nproc-per-node 2 train.py --epochs 3

Workers get ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (plus torchrun's
``TORCHELASTIC_*`` variables), so a script written for torchrun runs
unchanged. The exit code is 0 only when every worker finished successfully.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import time
from pathlib import Path

from . import policy
from .spec import JobSpec, SpecError
from .state import StateError, StateStore
from .supervisor import Supervisor

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
    p.add_argument("--state-dir", type=Path, help="where the controller keeps its state")
    p.add_argument("--job-id", default=None, help="the job's id (default: generated)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of the job's store")
    p.add_argument(
        "--monitor-interval", type=float, default=0.1, help="controller polling interval (s)"
    )
    p.add_argument("--log-level", default="INFO", help="controller log level (default INFO)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s inprocess-run %(levelname)s %(message)s"
    )
    job_id = args.job_id or _default_job_id()
    state_dir = (args.state_dir or Path("inprocess-runs") / job_id).absolute()
    script = Path(args.script)
    if not script.is_file():
        print(f"inprocess-run: error: SCRIPT {args.script!r} is not a file", file=sys.stderr)
        return 2
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
        print(f"inprocess-run: error: {_flag_names(str(ex))}", file=sys.stderr)
        return 2
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        StateStore(state_dir).create(policy.new_job_state(spec, now=time.time()))
    except StateError as ex:
        print(f"inprocess-run: error: {ex}", file=sys.stderr)
        return 2
    log.info("job %s: state in %s", job_id, state_dir)
    # Every process of the job inherits this: nothing of it is left behind at the end.
    os.environ["INPROCESS_JOB_ID"] = job_id
    return Supervisor(state_dir, ["--log-level", args.log_level]).run()


def _flag_names(message: str) -> str:
    """Names spec fields the way they are spelled on the command line."""
    return message.replace("JobSpec.", "--").replace("_", "-")


if __name__ == "__main__":
    sys.exit(main())
