"""A user-style training script in the shape of the usage guide's examples.

Every call of the training function builds its own ``torch.distributed.TCPStore``
on ``MASTER_PORT + 1`` (hosted by rank 0, ``wait_for_workers=True``), passes it
to ``init_process_group('gloo')``, wraps a small model in
``DistributedDataParallel``, reloads a ``torch.save`` checkpoint and trains; a
random rank raises at random steps until ``--faults`` faults were injected.

``--wrapped``: under ``inprocess.Wrapper`` (50 ms intervals). Without it the
script is a plain torchrun script: a fault ends the process and torchrun
restarts every worker (``--max-restarts``).

Each rank appends JSON lines to ``<out>/rank<initial rank>.jsonl``: ``start``
(the function was entered), ``fault`` (an injected fault), ``ready`` (the rank
is back in training: store, process group, DDP and checkpoint done) and
``done``, with ``time.time()`` (one host).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

# DDP imports this on its first use (seconds here): pay that once, at start.
import torch.distributed.fsdp
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--faults", type=int, default=20)
parser.add_argument("--steps", type=int, default=30, help="steps after the last fault")
parser.add_argument(
    "--early-faults",
    type=int,
    default=0,
    help="the first N of the faults strike before the faulty rank builds its store, "
    "while the others wait for it in the TCPStore constructor or init_process_group",
)
parser.add_argument("--wrapped", action="store_true")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
if os.environ.get("USER_SCRIPT_LOG"):
    logging.basicConfig(
        level=os.environ["USER_SCRIPT_LOG"],
        format=f"%(asctime)s r{os.environ['RANK']} %(name)s %(message)s",
    )

INITIAL_RANK = int(os.environ["RANK"])
OUT = Path(args.out)
OUT.mkdir(parents=True, exist_ok=True)
CHECKPOINT = OUT / "checkpoint.pt"


def record(event: str, **fields) -> None:
    with open(OUT / f"rank{INITIAL_RANK}.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        f.flush()


def train(iteration: int = 0) -> None:
    record("start", iteration=iteration)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if iteration < args.early_faults and rank == 1 + iteration % (world_size - 1):
        time.sleep(0.3)  # the others are blocked by now
        record("fault", iteration=iteration, step=-1)
        raise RuntimeError("injected fault before the store")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]) + 1,
        world_size,
        is_master=(rank == 0),
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=10),
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if CHECKPOINT.exists():
        checkpoint = torch.load(CHECKPOINT)
        model.load_state_dict(checkpoint["model"])
        step = checkpoint["step"]
    record("ready", iteration=iteration, step=step)
    rng = random.Random(args.seed * 1000 + step * 7 + iteration)
    # Every restart follows an injected fault, so ``iteration`` counts them.
    last = step + args.steps if iteration >= args.faults else None
    if iteration < args.early_faults:
        raise RuntimeError("unreachable: an early fault was expected")
    while last is None or step < last:
        # The same draw on every rank (same seed, step and iteration): one rank
        # other than 0 raises at a random step.
        if last is None and rng.random() < 0.3:
            faulty = rng.randrange(1, world_size)
            if rank == faulty:
                record("fault", iteration=iteration, step=step)
                raise RuntimeError(f"injected fault at step {step}")
        x = torch.randn(8, 32)
        loss = model(x).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:
            tmp = CHECKPOINT.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "step": step}, tmp)
            os.replace(tmp, CHECKPOINT)
        dist.barrier()
    dist.destroy_process_group()
    record("done", step=step)


if args.wrapped:
    import inprocess

    ms = datetime.timedelta(milliseconds=1)
    s = datetime.timedelta(seconds=1)

    @inprocess.Wrapper(
        monitor_thread_interval=50 * ms,
        monitor_process_interval=50 * ms,
        progress_watchdog_interval=50 * ms,
        last_call_wait=50 * ms,
        soft_timeout=20 * s,
        hard_timeout=30 * s,
        heartbeat_timeout=10 * s,
        barrier_timeout=60 * s,
        completion_timeout=60 * s,
        store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 2},
    )
    def wrapped(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        train(call_wrapper.iteration)

    wrapped()
else:
    train(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
