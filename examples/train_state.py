"""``examples/train.py`` with its state kept by ``restore``/``commit``: no checkpoint file.

The same data-parallel job (gloo, CPU, under ``inprocess-run`` or any launcher
that sets the torch.distributed variables), the same faults and the same
check, but the training state (a small model, its optimizer and ``w``) lives
in the Wrapper's host-memory snapshots:

    step = call_wrapper.restore(state)        # at every (re)start
    ...one step...
    call_wrapper.commit(state, step)          # after every step

A process that survives a fault restores from its own memory, a relaunched
worker from a peer: a fault costs at most the step it interrupted, where
``train.py`` goes back to its checkpoint file. ``w`` gets the mean of a
gradient of 1 per rank every step, so after N steps ``w == N``.

    inprocess-run --nnodes 2 --nproc-per-node 2 examples/train_state.py --steps 600 \\
        --fault-every 150 --result-dir out

Each worker process appends a line of JSON to ``--result-dir/events.jsonl``
for every start (with the restore's record), fault and finish, and rank 0 one
``progress`` line every 10 steps (read by the demo; training never reads it).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import random
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
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--wrapper-defaults",
    action="store_true",
    help="the Wrapper's default settings (default: this example's short intervals)",
)
parser.add_argument(
    "--snapshot-dir", default=None, help="persist snapshots here too (with --persist-every)"
)
parser.add_argument(
    "--persist-every",
    type=int,
    default=None,
    help="steps between two snapshots on disk; SIGUSR1 (Slurm's warning before the "
    "end) persists the next one whatever the step",
)
args = parser.parse_args()

RANK = int(os.environ["RANK"])
INCARNATION = int(os.environ.get("INPROCESS_WORKER_INCARNATION", "0"))
JOB = JobState(args.result_dir, RANK, INCARNATION)
logging.basicConfig(
    level=os.environ.get("TRAIN_LOG_LEVEL", "WARNING"),
    format=f"%(asctime)s worker{RANK} %(name)s %(levelname)s %(message)s",
)
COMPLETED = [0]  # the most steps this process completed: what a restore sends it back from

ms = datetime.timedelta(milliseconds=1)


SHORT_INTERVALS = dict(
    monitor_thread_interval=50 * ms,
    monitor_process_interval=50 * ms,
    progress_watchdog_interval=50 * ms,
    last_call_wait=50 * ms,
    soft_timeout=datetime.timedelta(seconds=20),
    hard_timeout=datetime.timedelta(seconds=30),
    heartbeat_timeout=datetime.timedelta(seconds=10),
    barrier_timeout=datetime.timedelta(seconds=120),
    termination_grace_time=datetime.timedelta(seconds=1),
    initialize=inprocess.initialize.RetryController(max_iterations=100),
)


@inprocess.Wrapper(
    **({} if args.wrapper_defaults else SHORT_INTERVALS),
    snapshot_dir=args.snapshot_dir,
    persist_every=args.persist_every,
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> dict[str, object]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    w = torch.zeros(1, dtype=torch.float64)
    state = {"model": model, "optim": opt, "w": w}  # `w` is copied into in place
    step = call_wrapper.restore(state)  # 0 at the first start; the same step on every rank
    JOB.record(
        "start",
        iteration=call_wrapper.iteration,
        active_rank=rank,
        world=world,
        step=step,
        completed=COMPLETED[0],
        restore=call_wrapper.last_restore,
    )
    started_at = step
    while step < args.steps:
        if args.fault_every and step > 0 and step % args.fault_every == 0 and step != started_at:
            # every rank draws the same victim for this step
            if rank == random.Random(f"{args.seed}-{step}").randrange(world):
                JOB.record("fault", fault="exception", step=step)
                raise RuntimeError(f"injected fault at step {step}")
        time.sleep(args.step_time)  # the "forward and backward pass"
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 31 + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        grads = torch.cat([model.weight.grad.flatten(), model.bias.grad, torch.ones(1)])
        dist.all_reduce(grads)  # the mean gradient, and a gradient of 1 per rank for `w`
        model.weight.grad.copy_(grads[:16].view_as(model.weight) / world)
        model.bias.grad.copy_(grads[16:17] / world)
        opt.step()
        w += grads[17].item() / world
        step += 1
        call_wrapper.commit(state, step)  # a copy in host memory, no file
        COMPLETED[0] = max(COMPLETED[0], step)
        if rank == 0 and step % 10 == 0:
            JOB.record("progress", step=step)
        call_wrapper.ping()
    dist.destroy_process_group()
    return {"step": step, "w": w.item(), "world": world}


if __name__ == "__main__":
    result = train()
    JOB.record("finish", result=result)
