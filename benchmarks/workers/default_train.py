"""``examples/train.py``'s job under ``@inprocess.Wrapper()`` with no settings at all.

The same data-parallel loop (gloo, CPU; one parameter ``w``, rank 0 keeps
``(step, w)`` in ``--result-dir/checkpoint.json`` inside ``atomic()``; one JSON
line per start and finish in ``--result-dir/events.jsonl``), but the Wrapper
has its defaults: 1 s intervals, 1 s ``last_call_wait``, 60/90 s timeouts.

``--fork-unsafe``: the script starts a thread of its own at import, before the
wrapped function is called, as a GPU script that initialized CUDA does in
effect: :func:`inprocess.monitor_process.fork_is_safe` is then false, and each
rank's monitor process is started as a fresh interpreter (the path a GPU job
takes).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from job_state import JobState  # examples/job_state.py

import inprocess

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--step-time", type=float, default=0.02, help="seconds of work per step")
parser.add_argument("--result-dir", type=Path, default=Path("."))
parser.add_argument(
    "--stop-file",
    type=Path,
    default=None,
    help="end training early, every rank at the same step, once this file exists",
)
parser.add_argument(
    "--fork-unsafe",
    action="store_true",
    help="start a thread at import (a stand-in for CUDA initialized before the call)",
)
args = parser.parse_args()

RANK = int(os.environ["RANK"])
INCARNATION = int(os.environ.get("INPROCESS_WORKER_INCARNATION", "0"))
JOB = JobState(args.result_dir, RANK, INCARNATION)

if os.environ.get("TRAIN_LOG_LEVEL"):  # (a look at the library's logs; off by default)
    logging.basicConfig(
        level=os.environ["TRAIN_LOG_LEVEL"],
        format=f"%(asctime)s worker{RANK} %(name)s %(levelname)s %(message)s",
    )

if args.fork_unsafe:
    # Lives as long as the process (a daemon thread asleep on an event nobody sets).
    threading.Thread(target=threading.Event().wait, name="cuda-stand-in", daemon=True).start()


@inprocess.Wrapper()
def train(call_wrapper: inprocess.CallWrapper | None = None) -> dict[str, object]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    step, w = JOB.load_checkpoint()
    grad = torch.ones(1)
    dist.all_reduce(grad)  # the group works: training (re)starts now
    JOB.record("start", iteration=call_wrapper.iteration, active_rank=rank, world=world, step=step)
    while step < args.steps:
        time.sleep(args.step_time)
        # the gradient, and rank 0's "stop now" riding on the same all-reduce
        stop = rank == 0 and args.stop_file is not None and args.stop_file.exists()
        grad = torch.tensor([1.0, float(stop)])
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
