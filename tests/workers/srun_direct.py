"""A Wrapper script started by ``srun`` directly, one task per rank, no launcher:
the Wrapper takes rank, world size, local rank and the store's host from Slurm.
Rank 1 raises once; every rank prints one line with what it saw."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import inprocess

FAILED = [False]


@inprocess.Wrapper(
    store_kwargs={"timeout": datetime.timedelta(seconds=60)},
    heartbeat_timeout=datetime.timedelta(seconds=30),
    barrier_timeout=datetime.timedelta(seconds=120),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if dist.get_rank() == 1 and not FAILED[0]:
        FAILED[0] = True
        raise RuntimeError("one fault")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(
        f"task {os.environ['SLURM_PROCID']} rank {os.environ['RANK']} of "
        f"{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
        f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
        f"sum {int(total.item())} iteration {call_wrapper.iteration}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
