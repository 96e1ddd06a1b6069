"""A healthy job with a spare, as an operator runs it (tests/test_operator_view.py).

Default Wrapper settings, ``MaxActiveWorldSize(2)``: with three workers one is a
spare, which waits in the completion barrier for the whole call. ``--slow-rank``
sleeps ``--slow-seconds`` before its call, so the others wait that long at the
call's first barrier. The active ranks then train for ``--seconds``. Each worker
writes ``pid<RANK>`` into ``--result-dir`` at its start and ``done<RANK>`` at
its end.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import inprocess

parser = argparse.ArgumentParser()
parser.add_argument("--result-dir", type=Path, required=True)
parser.add_argument("--seconds", type=float, default=15.0)
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-seconds", type=float, default=20.0)
args = parser.parse_args()
RANK = int(os.environ["RANK"])
logging.basicConfig(
    level=logging.WARNING, format=f"worker{RANK} %(levelname)s %(name)s: %(message)s"
)


def note(name: str) -> None:
    path = args.result_dir / f"{name}{RANK}"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)


@inprocess.Wrapper(rank_filter=inprocess.rank_filter.MaxActiveWorldSize(2))
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    deadline = time.monotonic() + args.seconds
    while True:
        # every active rank ends at the same step: rank 0's clock decides
        t = torch.tensor([float(dist.get_rank() == 0 and time.monotonic() > deadline)])
        dist.all_reduce(t)
        call_wrapper.ping()
        if t.item():
            break
        time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    args.result_dir.mkdir(parents=True, exist_ok=True)
    note("pid")
    if RANK == args.slow_rank:
        time.sleep(args.slow_seconds)
    train()
    note("done")
