"""A small data-parallel training job under the in-process Wrapper (gloo, CPU).

Written like a torchrun script: it reads RANK/WORLD_SIZE and initializes
torch.distributed with the default ``env://`` method. Run it with
``inprocess-run --nnodes 2 --nproc-per-node 2 examples/train.py`` (or any
launcher that sets the torch.distributed variables).

The "model" is one parameter ``w``; every step all-reduces a gradient of 1 per
rank and applies their mean, so after N committed steps ``w == N``. Rank 0
checkpoints (step, w) after every step inside ``call_wrapper.atomic()``, and
every (re)start resumes from the checkpoint: whatever faults happen, the job
ends with exactly N steps applied.

Each worker process appends a line of JSON to ``--result-dir/events.jsonl``
for every start, fault and finish (used by the demo and the tests).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import random
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from job_state import JobState  # examples/job_state.py, next to this script

import inprocess

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--step-time", type=float, default=0.02, help="seconds of work per step")
parser.add_argument("--result-dir", type=Path, default=Path("."))
parser.add_argument(
    "--fault-every", type=int, default=0, help="raise on a random rank every N steps"
)
parser.add_argument("--crash-rank", type=int, default=-1, help="this RANK crashes its process ...")
parser.add_argument("--crash-times", type=int, default=0, help="... this many times in all")
parser.add_argument(
    "--crash-step", type=int, default=3, help="steps after its start before it crashes"
)
parser.add_argument(
    "--stuck-rank",
    type=int,
    default=-1,
    help="at --crash-step, once, this RANK blocks every signal and waits in pause() (native"
    " code that ignores the abort) while --raise-rank raises",
)
parser.add_argument("--raise-rank", type=int, default=-1)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--stop-file",
    type=Path,
    default=None,
    help="end training early, every rank at the same step, once this file exists",
)
args = parser.parse_args()

RANK = int(os.environ["RANK"])
INCARNATION = int(os.environ.get("INPROCESS_WORKER_INCARNATION", "0"))
JOB = JobState(args.result_dir, RANK, INCARNATION)
logging.basicConfig(
    level=os.environ.get("TRAIN_LOG_LEVEL", "WARNING"),
    format=f"%(asctime)s worker{RANK} %(name)s %(levelname)s %(message)s",
)


def crashes_so_far() -> int:
    path = args.result_dir / f"crashes{RANK}"
    return int(path.read_text()) if path.exists() else 0


def stop_requested() -> bool:
    return args.stop_file is not None and args.stop_file.exists()


ms = datetime.timedelta(milliseconds=1)


@inprocess.Wrapper(
    monitor_thread_interval=50 * ms,
    monitor_process_interval=50 * ms,
    progress_watchdog_interval=50 * ms,
    last_call_wait=50 * ms,
    soft_timeout=datetime.timedelta(seconds=20),
    hard_timeout=datetime.timedelta(seconds=30),
    heartbeat_timeout=datetime.timedelta(seconds=10),
    barrier_timeout=datetime.timedelta(seconds=120),
    termination_grace_time=datetime.timedelta(seconds=1),
    # under a launcher every lost worker costs two iterations (going on without
    # it, admitting its replacement): room for a long run of kills
    initialize=inprocess.initialize.RetryController(max_iterations=1000),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> dict[str, object]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    step, w = JOB.load_checkpoint()
    grad = torch.ones(1)
    dist.all_reduce(grad)  # the group works: training (re)starts now
    JOB.record("start", iteration=call_wrapper.iteration, active_rank=rank, world=world, step=step)
    started_at = step
    while step < args.steps:
        if args.fault_every and step > 0 and step % args.fault_every == 0 and step != started_at:
            # every rank draws the same victim for this step
            if rank == random.Random(f"{args.seed}-{step}").randrange(world):
                JOB.record("fault", fault="exception", step=step)
                raise RuntimeError(f"injected fault at step {step}")
        if (
            RANK == args.crash_rank
            and step - started_at == args.crash_step
            and crashes_so_far() < args.crash_times
        ):
            (args.result_dir / f"crashes{RANK}").write_text(str(crashes_so_far() + 1))
            JOB.record("fault", fault="crash", step=step)
            os._exit(3)
        if (
            RANK in (args.stuck_rank, args.raise_rank)
            and step - started_at == args.crash_step
            and not (args.result_dir / f"stuck_done{RANK}").exists()
        ):
            (args.result_dir / f"stuck_done{RANK}").touch()
            JOB.record(
                "fault", fault="stuck" if RANK == args.stuck_rank else "exception", step=step
            )
            if RANK == args.raise_rank:
                raise RuntimeError(f"injected fault at step {step}")
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            signal.pause()
        time.sleep(args.step_time)  # the "forward and backward pass"
        # the gradient, and rank 0's "stop now" riding on the same all-reduce so
        # that every rank ends at the same step
        grad = torch.tensor([1.0, float(rank == 0 and stop_requested())])
        dist.all_reduce(grad)
        w += grad[0].item() / world
        step += 1
        with call_wrapper.atomic():
            if rank == 0:
                JOB.save_checkpoint(step, w)
        call_wrapper.ping()
        if grad[1].item():
            break
    dist.destroy_process_group()
    return {"step": step, "w": w, "world": world}


if __name__ == "__main__":
    result = train()
    JOB.record("finish", result=result)
