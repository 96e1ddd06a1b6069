"""A training script in the usage guide's shape, for launchers (torchrun) in the tests.

The Wrapper's store uses ``MASTER_PORT`` (the default) or, when
``TEST_STORE_PORT_OFFSET`` is set, ``MASTER_PORT + offset`` as in the guide.
Initial rank 1 raises once in the first iteration, so every rank restarts
once; each rank then writes ``report<initial rank>.json`` into
``TEST_REPORT_DIR``. ``TEST_CALLS`` consecutive calls (default 1).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import inprocess

INITIAL_RANK = int(os.environ["RANK"])
offset = os.environ.get("TEST_STORE_PORT_OFFSET")
store_kwargs = {} if offset is None else {"port": int(os.environ["MASTER_PORT"]) + int(offset)}
fast = datetime.timedelta(milliseconds=50)


@inprocess.Wrapper(
    store_kwargs=store_kwargs,
    initialize=inprocess.initialize.RetryController(max_iterations=3),
    monitor_thread_interval=fast,
    monitor_process_interval=fast,
    progress_watchdog_interval=fast,
    last_call_wait=fast,
)
def train(call_wrapper: inprocess.CallWrapper = None) -> dict[str, float]:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if call_wrapper.iteration == 0 and INITIAL_RANK == 1:
        raise RuntimeError("injected fault")
    dist.all_reduce(t)  # the others wait here until the restart interrupts them
    dist.destroy_process_group()
    return {"iteration": call_wrapper.iteration, "sum": t.item()}


if __name__ == "__main__":
    results = [train() for _ in range(int(os.environ.get("TEST_CALLS", "1")))]
    report = Path(os.environ["TEST_REPORT_DIR"]) / f"report{INITIAL_RANK}.json"
    report.write_text(json.dumps(results))
