"""A small data-parallel job under the Wrapper for the dead-end and chaos tests.

Like ``examples/train.py`` (one parameter ``w``; every step all-reduces a
gradient of 1 per rank and applies the mean, so after N committed steps
``w == N``; rank 0 checkpoints after every step inside ``atomic()``; every
start resumes from the checkpoint), with short Wrapper timeouts so that a
hung or stopped rank costs seconds, and faults that a test triggers:

* ``<result dir>/raise<RANK>`` appears: that rank raises at its next step (an
  in-process restart), and removes the file;
* ``--stop-all-at STEP``: in the first generation, every first incarnation
  stops itself (SIGSTOP) at STEP, so every member ends at its hard timeout;
* ``--max-iterations N``: ``RetryController(max_iterations=N)``, and
  ``--fault-every K`` raises on one rank every K steps, so the job's own
  restart policy gives up (``RestartAbort`` on every rank).

Each process appends JSON lines (start, fault, finish) to ``events.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import inprocess

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--step-time", type=float, default=0.02)
parser.add_argument("--result-dir", type=Path, required=True)
parser.add_argument("--stop-all-at", type=int, default=-1)
parser.add_argument("--max-iterations", type=int, default=None)
parser.add_argument("--fault-every", type=int, default=0)
args = parser.parse_args()

RANK = int(os.environ["RANK"])
INCARNATION = int(os.environ.get("INPROCESS_WORKER_INCARNATION", "0"))
GENERATION = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
args.result_dir.mkdir(parents=True, exist_ok=True)
CHECKPOINT = args.result_dir / "checkpoint.json"
TRIGGER = args.result_dir / f"raise{RANK}"
logging.basicConfig(
    level=os.environ.get("TRAIN_LOG_LEVEL", "WARNING"),
    format=f"%(asctime)s worker{RANK} %(name)s %(levelname)s %(message)s",
)


def record(kind: str, **data: object) -> None:
    line = json.dumps(
        {
            "kind": kind,
            "rank": RANK,
            "incarnation": INCARNATION,
            "generation": GENERATION,
            "time": time.time(),
            **data,
        }
    )
    with open(args.result_dir / "events.jsonl", "a") as f:
        f.write(line + "\n")


def load_checkpoint() -> tuple[int, float]:
    try:
        data = json.loads(CHECKPOINT.read_text())
        return data["step"], data["w"]
    except FileNotFoundError:
        return 0, 0.0


def save_checkpoint(step: int, w: float) -> None:
    tmp = CHECKPOINT.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "w": w}))
    os.replace(tmp, CHECKPOINT)


# CHAOS_TIME_SCALE stretches the detection timeouts below (the test suite's
# runs share 2 cores with other tests: a starved rank must not read as hung)
s = datetime.timedelta(seconds=1) * float(os.environ.get("CHAOS_TIME_SCALE", "1"))
ms = datetime.timedelta(milliseconds=1)


@inprocess.Wrapper(
    monitor_thread_interval=50 * ms,
    monitor_process_interval=50 * ms,
    progress_watchdog_interval=50 * ms,
    last_call_wait=50 * ms,
    soft_timeout=3 * s,
    hard_timeout=6 * s,
    heartbeat_timeout=4 * s,
    barrier_timeout=30 * s,
    termination_grace_time=1 * s,
    initialize=inprocess.initialize.RetryController(max_iterations=args.max_iterations),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> dict[str, object]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    step, w = load_checkpoint()
    grad = torch.ones(1)
    dist.all_reduce(grad)  # the group works: training (re)starts now
    record("start", iteration=call_wrapper.iteration, active_rank=rank, world=world, step=step)
    started_at = step
    while step < args.steps:
        if TRIGGER.exists():
            TRIGGER.unlink(missing_ok=True)
            record("fault", fault="exception", step=step)
            raise RuntimeError(f"injected exception at step {step}")
        if args.fault_every and step != started_at and step % args.fault_every == 0:
            if rank == random.Random(step).randrange(world):
                raise RuntimeError(f"injected fault at step {step}")
        if step == args.stop_all_at and GENERATION == 0 and INCARNATION == 0:
            record("fault", fault="sigstop", step=step)
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(args.step_time)
        grad = torch.ones(1)
        dist.all_reduce(grad)
        w += grad.item() / world
        step += 1
        with call_wrapper.atomic():
            if rank == 0:
                save_checkpoint(step, w)
        call_wrapper.ping()
    dist.destroy_process_group()
    return {"step": step, "w": w, "world": world}


if __name__ == "__main__":
    result = train()
    record("finish", result=result)
