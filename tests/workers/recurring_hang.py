"""Rank 1 hangs in ``time.sleep`` at the start of every iteration; rank 0 keeps making progress.

Without a RetryController only the hard timeout can end this job: rank 1 must be
SIGTERMed once its time in the function without progress, summed over restarts,
passes ``hard_timeout``; rank 0 then finishes alone. Each rank writes
report<rank>.json with the iterations it started.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import time
from pathlib import Path

import inprocess

RANK = int(os.environ["RANK"])
SPEC = json.loads(os.environ["INPROCESS_TEST_SPEC"])
OUT = Path(SPEC["report_dir"])
logging.basicConfig(level="WARNING", format=f"%(asctime)s r{RANK} %(name)s %(message)s")


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@inprocess.Wrapper(
    monitor_thread_interval=td(0.05),
    monitor_process_interval=td(0.05),
    progress_watchdog_interval=td(0.05),
    last_call_wait=td(0.05),
    soft_timeout=td(SPEC["soft"]),
    hard_timeout=td(SPEC["hard"]),
    heartbeat_timeout=td(10),
    barrier_timeout=td(60),
    completion_timeout=td(60),
    termination_grace_time=td(2),
)
def train(call: inprocess.CallWrapper = None) -> int:
    # Nothing of ours may turn the hard timeout's SIGTERM into another exit status.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    (OUT / f"started{RANK}_{call.iteration}").write_text(str(time.monotonic()))
    if RANK == 1:
        time.sleep(SPEC["sleep"])  # the hang, every iteration
        return call.iteration
    if int(os.environ["WORLD_SIZE"]) == 1:
        return call.iteration
    while True:  # progress (bytecode) until a restart interrupts it
        time.sleep(0.01)


if __name__ == "__main__":
    result = train()
    (OUT / f"report{RANK}.json").write_text(json.dumps({"returned": result}))
