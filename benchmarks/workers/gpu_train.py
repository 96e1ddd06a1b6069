"""The job of ``benchmarks/gpu_state.py``: data-parallel training that keeps its
state with ``restore``/``commit``, as a GPU script is written.

The script sets its CUDA device at import (``torch.cuda.set_device``, before the
wrapped function: the monitor process's start must not pay for it), builds an
MLP with Adam, and trains ``--steps`` steps; ranks on one GPU all-reduce CUDA
tensors over gloo. Every step's batch is drawn from a generator seeded by the
step and the rank, so a redone step is the same step: the final parameters of a
run with faults equal a fault-free run's bit for bit when no step is lost.

The Wrapper has its default settings (``CudaHealthCheck`` as the usage guide
adds it). While the world is smaller than ``--world`` (a worker was lost) the
ranks hold at their step, pinging, until the relaunched worker joins: the job
trains only at full size, and the hold is the kill-to-full-size time.

``--faults kind:rank:step,...`` (each once; ``--out`` keeps markers; every rank
first holds at that step until the job has run ``--settle`` seconds at full size,
so that each kill finds the launcher's standby ready, as in a real job): ``raise``
(an exception), ``kill`` (SIGKILL of itself), ``assert`` (a device-side
assert: an out-of-bounds index in a CUDA kernel, seen at the next
synchronization). Every rank appends JSON lines to ``<out>/events.jsonl``:
``script`` (the script reached its main: after its imports and CUDA's start, with
the seconds CUDA's start took),
``start`` (iteration, world size, step restored, restore record),
``first_step`` (how long the iteration's first step took), ``fault``,
``done`` (the parameters' CRC-32, rank 0's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import zlib
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

import inprocess

p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
p.add_argument("--hidden", type=int, default=2048)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--steps", type=int, default=120)
p.add_argument("--world", type=int, default=2)
p.add_argument("--faults", default="")
p.add_argument(
    "--settle",
    type=float,
    default=0.0,
    help="seconds at full size before each fault (the launcher's standby is ready again)",
)
args = p.parse_args()

RANK = int(os.environ["RANK"])
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
#: seconds the script's start spent making CUDA ready: the driver (``device_count``),
#: then the device's context (``set_device`` and a first allocation)
CUDA_START: dict[str, float] = {}
if args.device == "cuda":
    # as GPU scripts do, before the wrapped function (ranks share GPU 0 on a 1-GPU machine)
    t0 = time.monotonic()
    count = torch.cuda.device_count()
    t1 = time.monotonic()
    torch.cuda.set_device(LOCAL_RANK % count)
    torch.empty(1, device="cuda")
    CUDA_START = {"driver_s": round(t1 - t0, 4), "context_s": round(time.monotonic() - t1, 4)}
    DEVICE = torch.device("cuda", torch.cuda.current_device())
else:
    DEVICE = torch.device("cpu")
    torch.set_num_threads(1)
FAULTS = {}
for i, item in enumerate(filter(None, args.faults.split(","))):
    kind, rank, step = item.split(":")
    FAULTS[int(step)] = (i, kind, int(rank))


def event(name: str, **fields) -> None:
    line = json.dumps({"event": name, "rank": RANK, "pid": os.getpid(), "time": time.time(),
                       **fields})  # fmt: skip
    with open(args.out / "events.jsonl", "a") as f:
        f.write(line + "\n")


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(args.batch, args.hidden, generator=g).to(DEVICE)


def crc(model: torch.nn.Module) -> int:
    value = 0
    for q in model.parameters():
        value = zlib.crc32(q.detach().cpu().contiguous().view(torch.uint8).numpy(), value)
    return value


def inject(step: int, full_since: float, call_wrapper: inprocess.CallWrapper) -> None:
    if step not in FAULTS:
        return
    index, kind, rank = FAULTS[step]
    marker = args.out / f"fault{index}"
    if marker.exists():
        return
    # every rank holds here until the job has run at full size for --settle seconds
    while time.monotonic() - full_since < args.settle:
        call_wrapper.ping()
        time.sleep(0.01)
    if RANK != rank:
        return
    marker.touch()
    event("fault", kind=kind, step=step)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "assert":
        x = torch.zeros(2, device=DEVICE)
        x[torch.tensor([1 << 20], device=DEVICE)] = 1.0  # out of bounds: a device-side assert
        torch.cuda.synchronize()
    raise RuntimeError(f"injected fault at step {step}")


@inprocess.Wrapper(health_check=inprocess.health_check.CudaHealthCheck())
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build()
    state = {"model": model, "optim": opt}
    step = call_wrapper.restore(state)
    event("start", iteration=call_wrapper.iteration, world=world, step=step,
          restore=call_wrapper.last_restore)  # fmt: skip
    while world < args.world:
        # hold at full-size-only training: the relaunched worker's join restarts us
        call_wrapper.ping()
        time.sleep(0.01)
    full_since = time.monotonic()
    first = True
    while step < args.steps:
        inject(step, full_since, call_wrapper)
        began = time.monotonic()
        loss = model(batch(step, rank)).square().mean()
        loss.backward()
        for q in model.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        call_wrapper.commit(state, step)
        loss.item()  # one synchronization a step, as a training loop's logging makes
        if first:
            # the iteration's first step: its commit pins a new rank's host buffers,
            # and every rank waits for the slowest in its all-reduce
            event("first_step", iteration=call_wrapper.iteration, world=world,
                  seconds=round(time.monotonic() - began, 4))  # fmt: skip
            first = False
    if rank == 0:
        event("done", crc=crc(model), steps=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    args.out.mkdir(parents=True, exist_ok=True)
    # when this process began, and when the script got here (the replacement's timeline)
    event("script", created=psutil.Process().create_time(), cuda=CUDA_START)
    train()
