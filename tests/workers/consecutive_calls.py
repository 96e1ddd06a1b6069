"""Consecutive calls of a wrapped function in the same processes, ending every way.

The calls, in order: ``return``; ``restart`` (initial rank 1 raises once);
``interrupt`` (initial rank 1 raises ``KeyboardInterrupt``: it leaves, the
others finish without it, and it starts its next call while they still run
this one); ``abort`` (a fault, then ``RestartAbort`` from ``RetryController``
on every rank); ``return``. After each call the rank records what of ours is
still alive: store objects (counted with ``gc`` before any collection),
threads, child processes, listening sockets. Writes ``report<initial rank>.json``
into ``TEST_REPORT_DIR``.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

import inprocess
from inprocess.store import StoreMixin

INITIAL_RANK = int(os.environ["RANK"])
CALLS = ["return", "restart", "interrupt", "abort", "return"]
fast = datetime.timedelta(milliseconds=50)
logging.basicConfig(
    level=os.environ.get("TEST_LOG_LEVEL", "WARNING"),
    format=f"%(asctime)s r{INITIAL_RANK} %(name)s %(levelname)s %(message)s",
)


def wrapper(max_iterations: int | None) -> inprocess.Wrapper:
    return inprocess.Wrapper(
        initialize=inprocess.initialize.RetryController(max_iterations=max_iterations),
        monitor_thread_interval=fast,
        monitor_process_interval=fast,
        progress_watchdog_interval=fast,
        last_call_wait=fast,
    )


def train(kind: str, call_wrapper: inprocess.CallWrapper = None) -> dict[str, Any]:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if call_wrapper.iteration == 0 and INITIAL_RANK == 1:
        if kind in ("restart", "abort"):
            raise RuntimeError("injected fault")
        if kind == "interrupt":
            raise KeyboardInterrupt
    if kind == "interrupt" and INITIAL_RANK == 0:
        time.sleep(1)  # rank 1 starts its next call meanwhile: it reaches this call's server
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"iteration": call_wrapper.iteration, "sum": t.item()}


wrapped = {kind: wrapper(1 if kind == "abort" else 3)(train) for kind in set(CALLS)}


def leftovers() -> dict[str, Any]:
    stores = [type(o).__name__ for o in gc.get_objects() if issubclass(type(o), StoreMixin)]
    me = psutil.Process()
    return {
        "stores": stores,
        "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
        "children": [p.pid for p in me.children(recursive=True)],
        "listening": [c.laddr.port for c in me.net_connections("tcp") if c.status == "LISTEN"],
    }


if __name__ == "__main__":
    report = []
    for kind in CALLS:
        try:
            outcome: Any = wrapped[kind](kind)
        except BaseException as ex:
            outcome = type(ex).__name__
        if dist.is_initialized():  # the function's own group, left behind by its exception
            dist.destroy_process_group()
        report.append({"kind": kind, "outcome": outcome, **leftovers()})
    path = Path(os.environ["TEST_REPORT_DIR"]) / f"report{INITIAL_RANK}.json"
    path.write_text(json.dumps(report))
