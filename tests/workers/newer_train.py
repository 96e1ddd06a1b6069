"""A script written for the API's newer generation, run by a real torchrun.

Newer-style callbacks (a ``finalize(frozen_state)``, rank assignment on a
``RankAssignmentCtx``), the Wrapper's store at ``MASTER_PORT + 2`` as the usage
guide places it, a fault in each of iterations 0-3 on a rank drawn alike by
every rank, and a final barrier with hang protection off. Each rank writes
``TEST_REPORT_DIR/report<rank>.json``: the iteration it finished in.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist

import inprocess
from inprocess.state import FrozenState

RANK = int(os.environ["RANK"])


class Finalize(inprocess.finalize.Finalize):
    def __call__(self, state: FrozenState) -> FrozenState:
        assert isinstance(state, FrozenState)
        return state


ra = inprocess.rank_assignment


@inprocess.Wrapper(
    store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 2},
    finalize=Finalize(),
    rank_assignment=inprocess.Compose(ra.ActivateAllRanks(), ra.ShiftRanks()),
    initialize=inprocess.initialize.RetryController(max_iterations=6),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> int:
    dist.init_process_group("gloo")
    iteration = call_wrapper.iteration
    faulty = random.Random(iteration).randrange(dist.get_world_size())
    for step in range(20):
        if iteration < 4 and step == 5 and dist.get_rank() == faulty:
            raise RuntimeError(f"injected fault in iteration {iteration}")
        dist.all_reduce(torch.ones(1))
    with call_wrapper.hang_protection_disabled():
        dist.barrier()
    dist.destroy_process_group()
    return iteration


if __name__ == "__main__":
    finished = train()
    Path(os.environ["TEST_REPORT_DIR"], f"report{RANK}.json").write_text(json.dumps(finished))
