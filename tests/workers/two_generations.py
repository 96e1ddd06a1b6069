"""One training job written in either generation of the API (``--style guide|newer``).

The same data-parallel loop, the same faults, the same spare: 4 ranks, 3
active (rank filter), each step adds 1 to a replicated weight through an
all-reduce and rank 0 checkpoints ``(step, weight)``; every iteration
reloads it. Faults: initial rank 1 raises at step 3 of iteration 0; initial
rank 2 is SIGKILLed at step 5 of iteration 1 (the spare takes its place).
Only the callbacks' shapes differ between the styles:

* ``guide``: ``finalize(state, ex)``, ``health_check(state, ex)``, ``rank_filter=``;
* ``tree``: as ``newer``, with a topology-aware ``Tree`` assignment (two
  "hosts" of two ranks, three active ranks in all) instead of the filter;
* ``newer``: ``finalize(frozen)``, ``health_check(frozen)`` (the exception in
  ``fn_exception``), the filter as a step of ``rank_assignment`` (a
  ``RankAssignmentCtx``), ``completion`` / ``terminate``, and the checkpoint
  written with hang protection off.

Each rank writes ``<out>/rank<initial rank>.json``: what its callbacks saw and
what the call returned.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

import inprocess
from inprocess.state import FrozenState

STEPS = 8
INITIAL_RANK = int(os.environ["RANK"])
fast = datetime.timedelta(milliseconds=50)

parser = argparse.ArgumentParser()
parser.add_argument("--style", choices=["guide", "newer", "tree"], required=True)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()
CHECKPOINT = args.out / "checkpoint.pt"
seen: dict[str, list] = {"finalize": [], "health_check": [], "completion": [], "terminate": []}


def save(step: int, weight: torch.Tensor) -> None:
    tmp = CHECKPOINT.with_suffix(".tmp")
    torch.save({"step": step, "weight": weight}, tmp)
    os.replace(tmp, CHECKPOINT)


def load() -> tuple[int, torch.Tensor]:
    if CHECKPOINT.exists():
        saved = torch.load(CHECKPOINT)
        return saved["step"], saved["weight"]
    return 0, torch.zeros(1)


def train(call_wrapper: inprocess.CallWrapper | None = None) -> dict:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step, weight = load()
    while step < STEPS:
        if call_wrapper.iteration == 0 and step == 3 and INITIAL_RANK == 1:
            raise RuntimeError("injected fault")
        if call_wrapper.iteration == 1 and step == 5 and INITIAL_RANK == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        update = torch.ones(1)
        dist.all_reduce(update)
        weight += update / world
        step += 1
        if rank == 0:
            with call_wrapper.atomic():
                if args.style == "newer":
                    with call_wrapper.hang_protection_disabled():
                        save(step, weight)
                else:
                    save(step, weight)
    dist.barrier()
    dist.destroy_process_group()
    return {
        "step": step,
        "weight": weight.item(),
        "world": world,
        "iteration": call_wrapper.iteration,
    }


# ------------------------------------------------------------ the usage guide's shapes


class GuideFinalize(inprocess.finalize.Finalize):
    def __call__(self, state, train_ex):
        seen["finalize"].append(type(train_ex).__name__)
        return state, train_ex


class GuideHealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state, train_ex):
        seen["health_check"].append(type(train_ex).__name__)
        return state, train_ex


# ------------------------------------------------------------ the newer generation's shapes


class NewerFinalize(inprocess.finalize.Finalize):
    def __call__(self, state: FrozenState) -> FrozenState:
        assert isinstance(state, FrozenState)
        seen["finalize"].append(type(state.fn_exception).__name__)
        return state


class NewerHealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state: FrozenState) -> FrozenState:
        seen["health_check"].append(type(state.fn_exception).__name__)
        return state


class Completed(inprocess.completion.Completion):
    def __call__(self, state: FrozenState) -> FrozenState:
        seen["completion"].append([state.iteration, state.mode.value])
        return state


class Terminated(inprocess.terminate.Terminate):
    def __call__(self, state: FrozenState) -> FrozenState:
        seen["terminate"].append(type(state.fn_exception).__name__)
        return state


common = dict(
    initialize=inprocess.initialize.RetryController(max_iterations=5),
    monitor_thread_interval=fast,
    monitor_process_interval=fast,
    progress_watchdog_interval=fast,
    last_call_wait=fast,
)
if args.style == "guide":
    wrapper = inprocess.Wrapper(
        finalize=GuideFinalize(),
        health_check=GuideHealthCheck(),
        rank_filter=inprocess.rank_filter.MaxActiveWorldSize(3),
        **common,
    )
else:
    ra = inprocess.rank_assignment
    if args.style == "tree":
        # The job at most 3 active, each host's reserve first: the spare (initial
        # rank 3) replaces a lost rank of its own host.
        assignment = ra.Tree(
            [
                ra.Layer(max_ranks=3, key_or_fn="job", flag=ra.LayerFlag.RESERVE),
                ra.Layer(
                    key_or_fn=lambda state: f"host{state.initial_rank // 2}",
                    flag=ra.LayerFlag.RESERVE,
                ),
            ]
        )
    else:
        assignment = inprocess.Compose(ra.MaxActiveWorldSize(3), ra.ShiftRanks())
    wrapper = inprocess.Wrapper(
        finalize=NewerFinalize(),
        health_check=NewerHealthCheck(),
        rank_assignment=assignment,
        completion=Completed(),
        terminate=Terminated(),
        **common,
    )

if __name__ == "__main__":
    result = wrapper(train)()
    report = {"result": result, "generation": wrapper.generation.name, **seen}
    (args.out / f"rank{INITIAL_RANK}.json").write_text(json.dumps(report))
