"""The faulty 4-rank application of issue 8, under the Wrapper.

Usage: ``faulty_app.py KIND OUT MAX_ITERATIONS``. Every iteration, one random
rank other than 0 (the same draw on every rank) faults at a random step while
the others wait in ``all_reduce``:

* ``exception``: raises (iterations 0-3; iteration 4 completes);
* ``exit``: ``sys.exit(0)``; ``kill``: SIGKILLs itself; ``term``: SIGTERMs itself;
* ``inject-kill``, ``inject-term``: ``inject_fault`` kills or terminates it from
  a background thread (rank 0, which hosts the Wrapper's store, is kept alive).

Every call builds the application's own ``TCPStore`` on ``MASTER_PORT + 1``
(hosted by rank 0, ``wait_for_workers``) and initializes gloo with it, as the
usage guide's examples do. The lethal kinds shrink the job by one rank per
iteration until rank 0 is alone and completes. ``MAX_ITERATIONS`` 0 means no
``RetryController``. Each rank appends JSON lines to
``OUT/rank<initial rank>.jsonl``: ``start`` (in the function, with the
iteration and world size), ``fault`` (just before a fault) and ``returned``.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import inprocess
from inprocess.tools.inject_fault import Fault, inject_fault

KIND, OUT, MAX_ITERATIONS = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
INITIAL_RANK = int(os.environ["RANK"])
STEPS = 5
ms = datetime.timedelta(milliseconds=1)
s = datetime.timedelta(seconds=1)


def record(event: str, **fields) -> None:
    with open(OUT / f"rank{INITIAL_RANK}.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def fault(iteration: int) -> None:
    record("fault", iteration=iteration, kind=KIND)
    if KIND == "exception":
        raise RuntimeError(f"injected fault in iteration {iteration}")
    if KIND == "exit":
        sys.exit(0)
    os.kill(os.getpid(), signal.SIGKILL if KIND == "kill" else signal.SIGTERM)
    time.sleep(60)  # the signal is delivered at once; never go on


@inprocess.Wrapper(
    initialize=inprocess.initialize.RetryController(max_iterations=MAX_ITERATIONS)
    if MAX_ITERATIONS
    else None,
    monitor_thread_interval=50 * ms,
    monitor_process_interval=50 * ms,
    progress_watchdog_interval=50 * ms,
    last_call_wait=50 * ms,
    soft_timeout=10 * s,
    hard_timeout=15 * s,
    heartbeat_timeout=5 * s,
    termination_grace_time=1 * s,
    barrier_timeout=60 * s,
    completion_timeout=60 * s,
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> int:
    iteration = call_wrapper.iteration
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    record("start", iteration=iteration, world=world)
    # The usage guide's pattern: the application's own store, built on every call.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]) + 1,
        world,
        is_master=(rank == 0),
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=10)
    )
    rng = random.Random(iteration)
    faulty, step_of_fault = rng.randrange(1, max(world, 2)), rng.randrange(STEPS)
    faults_left = iteration < 4 if KIND == "exception" else world > 1
    injector = None
    if faults_left and KIND.startswith("inject-"):
        kind = Fault.KILL if KIND == "inject-kill" else Fault.TERM
        injector = inject_fault(
            [kind], num_faults=1, keep_alive=1, delay=0.1 + 0.2 * rng.random(), seed=iteration,
            callback=lambda *_: record("fault", iteration=iteration, kind=KIND),
        )
    external = KIND.startswith("inject-")
    # With an external fault every rank trains on until it strikes (at most ~10 s).
    for step in range(1000 if injector is not None or (faults_left and external) else STEPS):
        if faults_left and not external and rank == faulty and step == step_of_fault:
            fault(iteration)
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.01)
    dist.destroy_process_group()
    return world


OUT.mkdir(parents=True, exist_ok=True)
result = train()
record("returned", value=result)
