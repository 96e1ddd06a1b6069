"""A rank whose GPU faults, with stand-ins for a broken CUDA context (no GPU here).

Usage: ``gpu_fault.py OUT``. Two ranks keep a tensor with ``restore``/``commit``.
In the first iteration, rank 1 (after its commit of step 2):

* leaves a snapshot copy "in flight" whose wait raises CUDA's error, as an event
  of a broken context does (the call's cleanup then waits for it);
* plants what a broken context makes of the native teardown: an object whose
  finalizer, run only by the interpreter's teardown, aborts the process (as
  torch's allocators do when freeing memory a stream used fails:
  ``terminate called after throwing an instance of 'c10::AcceleratorError'``);
* raises CUDA's error (a device-side assert surfacing at a synchronization).

Its health check stands in for ``CudaHealthCheck`` (which would raise from
``torch.cuda.synchronize()``); with ``builtin`` as a second argument it has
none, and rank 1's ``torch.cuda`` says from the fault on that CUDA is
initialized and its synchronization fails (a broken context, which the
Wrapper's own GPU check asks after a CUDA error). Rank 0 goes on without it and completes. Each
rank writes ``OUT/rank<RANK>.json`` from an ``atexit`` function registered after
``inprocess`` was imported (the user's own exit code runs before the process
ends).
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import inprocess

OUT = Path(sys.argv[1])
BUILTIN = sys.argv[2:] == ["builtin"]
RANK = int(os.environ["RANK"])
ms = datetime.timedelta(milliseconds=1)
CUDA_ERROR = (
    "CUDA error: device-side assert triggered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call"
)
NOTES: dict[str, object] = {"iterations": [], "atexit": False}


@atexit.register
def _report() -> None:
    NOTES["atexit"] = True
    (OUT / f"rank{RANK}.json").write_text(json.dumps(NOTES))


class BrokenEvent:
    """A CUDA event of a context that broke: waiting for it raises CUDA's error."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise torch.AcceleratorError(CUDA_ERROR)


class AbortsAtTeardown:
    """What torch's allocators do at interpreter exit on a broken context."""

    def __del__(self) -> None:
        os.write(2, b"terminate called after throwing an instance of 'c10::AcceleratorError'\n")
        os.abort()


class StandInCudaHealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state, train_ex=None):
        if isinstance(train_ex, torch.AcceleratorError):
            raise inprocess.exception.HealthCheckError(
                f"CUDA device 0: torch.cuda.synchronize() failed: {train_ex}"
            ) from train_ex
        return state, train_ex


def break_cuda_context() -> None:
    """From here on this process's torch.cuda is that of a context that broke."""

    def synchronize(device: object = None) -> None:
        raise torch.AcceleratorError(CUDA_ERROR)

    torch.cuda.is_initialized = lambda: True
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = synchronize


@inprocess.Wrapper(
    health_check=None if BUILTIN else StandInCudaHealthCheck(),
    monitor_thread_interval=50 * ms,
    monitor_process_interval=50 * ms,
    progress_watchdog_interval=50 * ms,
    last_call_wait=50 * ms,
    soft_timeout=datetime.timedelta(seconds=30),
    hard_timeout=datetime.timedelta(seconds=60),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> float:
    dist.init_process_group("gloo")
    state = {"w": torch.zeros(4)}
    step = call_wrapper.restore(state)
    NOTES["iterations"].append({"iteration": call_wrapper.iteration, "restored": step})
    while step < 4:
        t = torch.ones(4)
        dist.all_reduce(t)
        state["w"] += t
        step += 1
        call_wrapper.commit(state, step)
        if RANK == 1 and step == 2 and call_wrapper.iteration == 0:
            slot = call_wrapper._snapshots.own.writable()
            slot._event = BrokenEvent()
            globals()["_teardown"] = AbortsAtTeardown()
            if BUILTIN:
                break_cuda_context()
            raise torch.AcceleratorError(CUDA_ERROR)
    dist.destroy_process_group()
    return float(state["w"][0])


if __name__ == "__main__":
    NOTES["result"] = train()
