"""Worker of benchmarks/restart_latency.py.

Mode "restarts": under the Wrapper with 5 ms intervals, rank ``i % world`` raises
in iteration ``i`` while the others wait inside all_reduce; every rank records
(time.monotonic, same host) when it is back in the function with a new process
group and one all_reduce done. The Wrapper's callbacks are written in the usage
guide's style or in the newer generation's (``style``): the same no-op finalize
and health check, in either shape. Mode "overhead": the same training loop,
wrapped or not, timed.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import inprocess

MODE, OUT = sys.argv[1], Path(sys.argv[2])
RANK = int(os.environ["RANK"])
ms = datetime.timedelta(milliseconds=1)
s = datetime.timedelta(seconds=1)


class GuideFinalize(inprocess.finalize.Finalize):
    def __call__(self, state, train_ex):
        return state, train_ex


class GuideHealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state, train_ex):
        return state, train_ex


class NewerFinalize(inprocess.finalize.Finalize):
    def __call__(self, state: inprocess.state.FrozenState) -> inprocess.state.FrozenState:
        return state


class NewerHealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state: inprocess.state.FrozenState) -> inprocess.state.FrozenState:
        return state


class NewerCompletion(inprocess.completion.Completion):
    def __call__(self, state: inprocess.state.FrozenState) -> inprocess.state.FrozenState:
        return state


def callbacks(style: str) -> dict:
    if style == "guide":
        return dict(finalize=GuideFinalize(), health_check=GuideHealthCheck())
    ra = inprocess.rank_assignment
    return dict(
        finalize=NewerFinalize(),
        health_check=NewerHealthCheck(),
        rank_assignment=inprocess.Compose(ra.ActivateAllRanks(), ra.ShiftRanks()),
        completion=NewerCompletion(),
    )


def restarts(count: int, interval_ms: float, style: str = "guide") -> None:
    fast = interval_ms * ms
    times: dict[str, list] = {"fault": [], "ready": []}

    @inprocess.Wrapper(
        **callbacks(style),
        monitor_thread_interval=fast,
        monitor_process_interval=fast,
        progress_watchdog_interval=fast,
        last_call_wait=fast,
        soft_timeout=30 * s,
        hard_timeout=60 * s,
        heartbeat_timeout=30 * s,
        barrier_timeout=90 * s,
        completion_timeout=90 * s,
    )
    def train(call_wrapper: inprocess.CallWrapper = None):
        iteration = call_wrapper.iteration
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.ones(1)
        dist.all_reduce(t)
        times["ready"].append([iteration, time.monotonic()])
        for step in range(5):
            if iteration < count and step == 2 and rank == iteration % world:
                times["fault"].append([iteration, time.monotonic()])
                raise RuntimeError("benchmark fault")
            t = torch.ones(1)
            dist.all_reduce(t)
        dist.destroy_process_group()

    train()
    (OUT / f"restarts{RANK}.json").write_text(json.dumps(times))


def training_loop(steps: int) -> float:
    """A small data-parallel step: compute, then all_reduce the gradient."""
    x = torch.randn(256, 256)
    w = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(steps):
        g = torch.tanh(x @ w) @ w.T
        dist.all_reduce(g)
        w -= 1e-4 * g
    return time.perf_counter() - start


def overhead(rounds: int, steps: int, interval_ms: float | None) -> None:
    """Alternates unwrapped and wrapped blocks of the same loop in these processes."""
    kwargs = {}
    if interval_ms is not None:
        fast = interval_ms * ms
        kwargs = dict(
            monitor_thread_interval=fast,
            monitor_process_interval=fast,
            progress_watchdog_interval=fast,
        )

    world = int(os.environ["WORLD_SIZE"])
    # The unwrapped blocks rendezvous in a store of their own, a fresh prefix each
    # time (what a plain script that initializes repeatedly must do).
    plain_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, RANK == 0
    )
    blocks = iter(range(10**6))

    def block(store: dist.Store | None = None) -> float:
        if store is None:
            dist.init_process_group("gloo")  # the Wrapper makes env:// fresh per call
        else:
            dist.init_process_group("gloo", store=store, rank=RANK, world_size=world)
        training_loop(10)  # warm-up: first collectives, allocator
        elapsed = training_loop(steps)
        dist.destroy_process_group()
        return elapsed

    wrapped_block = inprocess.Wrapper(**kwargs)(block)
    times: dict[str, list[float]] = {"plain": [], "wrapped": []}
    for i in range(rounds):
        order = ("plain", "wrapped") if i % 2 == 0 else ("wrapped", "plain")  # ABBA
        for mode in order:
            if mode == "wrapped":
                times[mode].append(wrapped_block())
            else:
                times[mode].append(block(dist.PrefixStore(f"plain/{next(blocks)}", plain_store)))
    (OUT / f"overhead{RANK}.json").write_text(json.dumps(times))


if __name__ == "__main__":
    # The library logs through `logging`; a benchmark wants its warnings only.
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    if MODE == "restarts":
        restarts(int(sys.argv[3]), float(sys.argv[4]), *sys.argv[5:6])
    else:
        interval = None if sys.argv[5] == "default" else float(sys.argv[5])
        overhead(int(sys.argv[3]), int(sys.argv[4]), interval)
