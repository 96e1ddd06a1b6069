"""The worker of ``benchmarks/state_recovery.py``: an MLP with Adam, data-parallel (gloo, CPU).

One step: ``--step-time`` of sleep (the accelerator's forward and backward
pass), a real forward and backward pass of the MLP on a small batch, one
all-reduce of the flattened gradient and an Adam step. ``--mode``:

* ``snapshot``: ``call_wrapper.restore`` at every (re)start and
  ``call_wrapper.commit`` after every step (except in ``none`` blocks of the
  timing phase);
* ``file``: the usage guide's pattern: rank 0 ``torch.save``-s model, optimizer
  and step every ``--save-every`` steps (atomically), every rank reloads the
  file at every (re)start.

``--timing-blocks N``: first N rounds of three ``--block``-step blocks, one per
way of keeping state (``none``: nothing, ``commit``: commit every step,
``file``: ``torch.save`` every ``--save-every`` of
the file blocks' steps), no
faults; rank 0 times every step. Then the fault phase: ``--faults`` is a list
of ``kind:rank:offset`` (``raise`` or ``kill``, initial rank, steps after the
timing phase), each injected once, in the middle of its step (after the
backward pass, before the all-reduce).

Rank 0 (never a victim) writes ``<out>/rank0.json``: step times per way,
every (re)start (step restored, restore time, steps completed before it) and
the fault steps regained; victims append their faults to ``<out>/faults.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import inprocess

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["snapshot", "file"], required=True)
p.add_argument("--out", type=Path, required=True)
p.add_argument("--hidden", type=int, default=1600)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--timing-blocks", type=int, default=0)
p.add_argument("--block", type=int, default=20)
p.add_argument("--save-every", type=int, default=100)
p.add_argument("--steps", type=int, default=400, help="steps of the fault phase")
p.add_argument("--faults", default="")
args = p.parse_args()

RANK = int(os.environ["RANK"])
args.out.mkdir(parents=True, exist_ok=True)
CHECKPOINT = args.out / "checkpoint.pt"
WAYS = ("none", "commit", "file")
TIMING = len(WAYS) * args.block * args.timing_blocks
FAULTS = {}
for i, spec in enumerate(filter(None, args.faults.split(","))):
    kind, rank, offset = spec.split(":")
    FAULTS[TIMING + int(offset)] = (i, kind, int(rank))
logging.basicConfig(level="WARNING", format=f"%(asctime)s r{RANK} %(name)s %(message)s")
torch.set_num_threads(1)

# rank 0's account, kept across in-process restarts (rank 0 is never killed)
LOG: dict = {
    "times": {w: [] for w in WAYS},
    "commit_seconds": {"commit": []},  # call_wrapper.commit alone, timing phase
    "parts": {},  # what a commit does, each part timed alone (rank 0, first start)
    "starts": [],
    "regained": {},
}
COMPLETED = [0]  # the highest step count rank 0 reached


def way(step: int) -> str:
    """How the state is kept after ``step`` (0-based) completes."""
    if step >= TIMING:
        return "commit" if args.mode == "snapshot" else "file"
    return WAYS[(step // args.block) % len(WAYS)]


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 256),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for q in model.parameters():  # the moments exist from the start: the state's full size
        q.grad = torch.zeros_like(q)
    opt.step()
    opt.zero_grad(set_to_none=False)
    return model, opt


def time_parts(state: dict) -> None:
    """The parts of a commit, each alone: the state_dicts, and copying their tensors."""
    runs = 5
    t0 = time.perf_counter()
    for _ in range(runs):
        dicts = {k: v.state_dict() for k, v in state.items()}
    t1 = time.perf_counter()
    tensors = []
    for d in dicts.values():
        stack = [d]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                tensors.append(x)
            elif isinstance(x, dict):
                stack += list(x.values())
            elif isinstance(x, (list, tuple)):
                stack += list(x)
    copies = [torch.empty_like(t) for t in tensors]
    t2 = time.perf_counter()
    for _ in range(runs):
        with torch.no_grad():
            for dst, src in zip(copies, tensors, strict=True):
                dst.copy_(src)
    t3 = time.perf_counter()
    LOG["parts"] = {
        "state_dicts": (t1 - t0) / runs,
        "tensor_copy": (t3 - t2) / runs,
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
    }


def save(model, opt, step: int) -> None:
    tmp = CHECKPOINT.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, CHECKPOINT)


def inject(step: int, iteration: int) -> None:
    if step not in FAULTS:
        return
    index, kind, rank = FAULTS[step]
    marker = args.out / f"fault{index}"
    if RANK != rank or marker.exists():
        return
    marker.touch()
    with open(args.out / "faults.jsonl", "a") as f:
        f.write(
            json.dumps({"index": index, "kind": kind, "step": step, "time": time.time()}) + "\n"
        )
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault at step {step}")


ms = datetime.timedelta(milliseconds=1)
s = datetime.timedelta(seconds=1)


@inprocess.Wrapper(
    monitor_thread_interval=50 * ms,
    monitor_process_interval=50 * ms,
    progress_watchdog_interval=50 * ms,
    last_call_wait=50 * ms,
    soft_timeout=30 * s,
    hard_timeout=45 * s,
    heartbeat_timeout=15 * s,
    barrier_timeout=120 * s,
    termination_grace_time=1 * s,
    initialize=inprocess.initialize.RetryController(max_iterations=100),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build()
    params = list(model.parameters())
    flat = torch.zeros(sum(q.numel() for q in params))
    state = {"model": model, "optim": opt}
    # every rank starts its restore together: its time is the restore's, not the wait
    # for a relaunched worker's start-up
    dist.barrier()
    started = time.perf_counter()
    if args.mode == "snapshot":
        step = call_wrapper.restore(state)
        record = dict(call_wrapper.last_restore or {})
    else:
        step, record = 0, {}
        if CHECKPOINT.exists():
            checkpoint = torch.load(CHECKPOINT, weights_only=False)
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optim"])
            step = checkpoint["step"]
    restore_seconds = time.perf_counter() - started
    dist.barrier()
    if RANK == 0 and not LOG["parts"]:
        time_parts(state)
    if RANK == 0:
        LOG["starts"].append(
            {
                "iteration": call_wrapper.iteration,
                "world": world,
                "time": time.time(),
                "step": step,
                "completed_before": COMPLETED[0],
                "restore_seconds": restore_seconds,
                "record": record,
            }
        )
    total = TIMING + args.steps
    while step < total:
        t0 = time.perf_counter()
        time.sleep(args.step_time)  # the accelerator's forward and backward pass
        x = torch.randn(args.batch, 1024, generator=torch.Generator().manual_seed(step * 97 + rank))
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        inject(step, call_wrapper.iteration)
        torch.cat([q.grad.reshape(-1) for q in params], out=flat)
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset : offset + q.numel()].view_as(q))
            offset += q.numel()
        opt.step()
        kept = way(step)
        step += 1
        if kept == "commit":
            c0 = time.perf_counter()
            call_wrapper.commit(state, step)
            if RANK == 0 and step <= TIMING:
                LOG["commit_seconds"][kept].append(time.perf_counter() - c0)
        elif kept == "file" and rank == 0:
            # the guide's pattern; in the timing phase counted in file blocks' steps only
            s0 = step - 1
            count = (
                step
                if step > TIMING
                else (s0 // (len(WAYS) * args.block)) * args.block + s0 % args.block + 1
            )
            if count % args.save_every == 0:
                save(model, opt, step)
        if RANK == 0:
            if step <= TIMING:
                LOG["times"][kept].append(time.perf_counter() - t0)
            if step - 1 in FAULTS and str(step) not in LOG["regained"]:
                LOG["regained"][str(step)] = time.time()
            COMPLETED[0] = max(COMPLETED[0], step)
        call_wrapper.ping()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
    if RANK == 0:
        (args.out / "rank0.json").write_text(json.dumps(LOG))
