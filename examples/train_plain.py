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
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--step-time", type=float, default=0.02, help="seconds of work per step")
parser.add_argument("--result-dir", type=Path, default=Path("."))
args = parser.parse_args()

RANK = int(os.environ["RANK"])
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
args.result_dir.mkdir(parents=True, exist_ok=True)
CHECKPOINT = args.result_dir / "checkpoint.json"
EVENTS = args.result_dir / "events.jsonl"


def record(kind: str, **data: object) -> None:
    """Appends one event line, in the format of ``train.py``."""
    line = json.dumps(
        {"kind": kind, "rank": RANK, "incarnation": RESTART, "time": time.time(), **data}
    )
    with open(EVENTS, "a") as f:  # short appends of whole lines: safe across processes
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


def train() -> dict[str, object]:
    """Same steps as ``train.py``'s ``train``, without ``call_wrapper``."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    step, w = load_checkpoint()
    grad = torch.ones(1)
    dist.all_reduce(grad)  # the group works: training (re)starts now
    record("start", iteration=RESTART, active_rank=rank, world=world, step=step)
    while step < args.steps:
        time.sleep(args.step_time)  # the "forward and backward pass"
        grad = torch.ones(1)
        dist.all_reduce(grad)
        w += grad.item() / world
        step += 1
        if rank == 0:
            save_checkpoint(step, w)
    dist.destroy_process_group()
    return {"step": step, "w": w, "world": world}


if __name__ == "__main__":
    result = train()
    record("finish", result=result)
