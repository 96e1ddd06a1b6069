"""Two consecutive calls of wrapped functions in one worker, under ``inprocess-run``.

Call 0 runs a few steps; call 1 runs ``--steps`` steps. In call 1, ``--crash-rank``
SIGKILLs its own process (its first incarnation only) at step ``--crash-step``;
with ``--abort`` instead, initial rank 0 raises once and call 1's
``RetryController(max_iterations=1)`` gives up (``RestartAbort`` on every rank).
Each start and finish of a call is a line of ``--result-dir/events.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from job_state import JobState

import inprocess

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--step-time", type=float, default=0.03)
parser.add_argument("--result-dir", type=Path, default=Path("."))
parser.add_argument("--crash-rank", type=int, default=-1)
parser.add_argument("--crash-step", type=int, default=10)
parser.add_argument("--abort", action="store_true")
parser.add_argument(
    "--crash-trigger",
    type=Path,
    default=None,
    help="in call 1, every rank waits at --crash-step until this file exists",
)
args = parser.parse_args()

RANK = int(os.environ["RANK"])
FULL_WORLD = int(os.environ["WORLD_SIZE"])  # as launched (the Wrapper updates the variable)
INCARNATION = int(os.environ.get("INPROCESS_WORKER_INCARNATION", "0"))
JOB = JobState(args.result_dir, RANK, INCARNATION)
logging.basicConfig(format=f"%(asctime)s worker{RANK} %(name)s %(levelname)s %(message)s")
ms = datetime.timedelta(milliseconds=1)


def wrapper(max_iterations: int) -> inprocess.Wrapper:
    return inprocess.Wrapper(
        monitor_thread_interval=50 * ms,
        monitor_process_interval=50 * ms,
        progress_watchdog_interval=50 * ms,
        last_call_wait=50 * ms,
        heartbeat_timeout=datetime.timedelta(seconds=10),
        initialize=inprocess.initialize.RetryController(max_iterations=max_iterations),
    )


def train(call: int, steps: int, call_wrapper: inprocess.CallWrapper | None = None) -> dict:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    JOB.record("start", call=call, iteration=call_wrapper.iteration, world=world)
    # In call 1 the survivors of a crash train on until the relaunched worker
    # has rejoined (however slow its start), so that it rejoins this very call.
    full = world == FULL_WORLD
    for step in range(steps if call == 0 or full else 100 * steps):
        if call == 1 and step == args.crash_step:
            deadline = time.monotonic() + 120
            while args.crash_trigger and not args.crash_trigger.exists():
                assert time.monotonic() < deadline, "no crash trigger"
                time.sleep(0.01)
            if RANK == args.crash_rank and INCARNATION == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.abort and RANK == 0 and call_wrapper.iteration == 0:
                raise RuntimeError("injected fault")
        time.sleep(args.step_time)
        dist.all_reduce(torch.ones(1))
        call_wrapper.ping()
    dist.destroy_process_group()
    return {"call": call, "world": world}


first = wrapper(10)(train)
second = wrapper(1 if args.abort else 10)(train)

if __name__ == "__main__":
    for call, fn, steps in ((0, first, 5), (1, second, args.steps)):
        JOB.record("finish", call=call, result=fn(call, steps))
