"""The job of ``examples/train.py`` without the in-process Wrapper (gloo, CPU).

What a torchrun user runs today: the same model, steps, step time, all_reduce
and checkpoint as ``train.py``, but any fault ends the process and recovery is
left to the launcher (``torchrun --max-restarts N`` stops every worker and
starts them all again). It exists so that ``benchmarks/failover_vs_torchrun.py``
compares the two launchers on equal work:

    torchrun --nnodes 1 --nproc-per-node 4 --max-restarts 20 \\
        examples/train_plain.py --steps 2000 --result-dir out

The "model" is one parameter ``w``; every step all-reduces a gradient of 1 per
rank and applies their mean, so after N committed steps ``w == N``. Rank 0
checkpoints (step, w) after every step, and every (re)start resumes from the
checkpoint. The restart count (``TORCHELASTIC_RESTART_COUNT``) stands for both
the "incarnation" and the "iteration" of ``train.py``'s event lines.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from job_state import JobState  # examples/job_state.py, next to this script

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--step-time", type=float, default=0.02, help="seconds of work per step")
parser.add_argument("--result-dir", type=Path, default=Path("."))
args = parser.parse_args()

RANK = int(os.environ["RANK"])
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
JOB = JobState(args.result_dir, RANK, RESTART)


def train() -> dict[str, object]:
    """Same steps as ``train.py``'s ``train``, without ``call_wrapper``."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    step, w = JOB.load_checkpoint()
    grad = torch.ones(1)
    dist.all_reduce(grad)  # the group works: training (re)starts now
    JOB.record("start", iteration=RESTART, active_rank=rank, world=world, step=step)
    while step < args.steps:
        time.sleep(args.step_time)  # the "forward and backward pass"
        grad = torch.ones(1)
        dist.all_reduce(grad)
        w += grad.item() / world
        step += 1
        if rank == 0:
            JOB.save_checkpoint(step, w)
    dist.destroy_process_group()
    return {"step": step, "w": w, "world": world}


if __name__ == "__main__":
    result = train()
    JOB.record("finish", result=result)
