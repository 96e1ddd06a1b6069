"""A configurable training job under the Wrapper, driven by a JSON spec.

The spec (environment variable INPROCESS_TEST_SPEC) says how to configure the
Wrapper and which faults to inject: a fault names the initial rank that fails,
the iteration and step at which it fails, how it fails, and what the other
ranks are doing meanwhile ("allreduce", "barrier" or "python"). Every rank
writes a JSON report (report<initial rank>.json) with its return value and
what it saw, which the tests check.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import inprocess

SPEC: dict[str, Any] = json.loads(os.environ["INPROCESS_TEST_SPEC"])
INITIAL_RANK = int(os.environ["RANK"])
REPORT = Path(SPEC["report_dir"]) / f"report{INITIAL_RANK}.json"
if SPEC.get("ranks_per_node"):
    # simulated nodes on one host: each has its own node group and heartbeat
    os.environ["INPROCESS_NODE"] = f"node{INITIAL_RANK // SPEC['ranks_per_node']}"
EVENTS: list[dict[str, Any]] = []
if SPEC.get("fork_unsafe"):
    # a thread of the script's own before the call (a stand-in for CUDA initialized):
    # each monitor process is then a fresh interpreter, started beside its rank
    threading.Thread(target=threading.Event().wait, daemon=True).start()

logging.basicConfig(
    level=SPEC.get("log_level", "WARNING"),
    format=f"%(asctime)s r{INITIAL_RANK} %(name)s %(levelname)s %(message)s",
)


def event(kind: str, **data: Any) -> None:
    EVENTS.append({"kind": kind, "time": time.monotonic(), **data})


def write_report(**data: Any) -> None:
    REPORT.write_text(json.dumps({"initial_rank": INITIAL_RANK, "events": EVENTS, **data}))


# Guide-era callbacks return None: the Wrapper must ignore what they return.
RETURN_NONE = SPEC.get("callbacks_return_none", False)


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# ---------------------------------------------------------------- callbacks


class RecordingInitialize(inprocess.initialize.Initialize):
    def __call__(self, state: inprocess.state.State) -> inprocess.state.State:
        event("initialize", iteration=state.iteration, rank=state.rank)
        bad = SPEC.get("initialize_fails", {})
        spec = bad.get(str(INITIAL_RANK))
        if spec and state.iteration in spec["iterations"]:
            if spec["kind"] == "exception":
                raise RuntimeError("initialize failed")
            raise inprocess.exception.RestartAbort("initialize gave up")
        return None if RETURN_NONE else state


class RecordingFinalize(inprocess.finalize.Finalize):
    def __call__(self, state, train_ex=None):
        event("finalize", iteration=state.iteration)
        if INITIAL_RANK in SPEC.get("finalize_fails", []):
            raise RuntimeError("finalize failed")
        return None if RETURN_NONE else (state, train_ex)


class RecordingHealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state, train_ex=None):
        event("health_check", iteration=state.iteration, after_fault=train_ex is not None)
        if INITIAL_RANK in SPEC.get("unhealthy", []) and train_ex is not None:
            raise inprocess.exception.HealthCheckError("unhealthy by request")
        at_start = SPEC.get("unhealthy_at_start", {}).get(str(INITIAL_RANK), [])
        if train_ex is None and state.iteration in at_start:
            raise RuntimeError("unhealthy at the start of the iteration")
        return None if RETURN_NONE else (state, train_ex)


class FailingAbort(inprocess.abort.Abort):
    def __call__(self, state):
        if INITIAL_RANK in SPEC.get("abort_fails", []):
            raise RuntimeError("abort failed")
        return state


class FailingAssignment(inprocess.rank_assignment.RankAssignment):
    def __call__(self, state, terminated_ranks):
        if INITIAL_RANK in SPEC.get("assignment_fails", []):
            raise RuntimeError("rank assignment failed")
        return state, terminated_ranks


def build_wrapper() -> inprocess.Wrapper:
    w = dict(SPEC.get("wrapper", {}))
    paths = ("monitor_process_logfile", "monitor_process_pidfile")
    kwargs: dict[str, Any] = {k: td(v) for k, v in w.items() if k not in paths}
    for name in paths:
        if name in w:
            kwargs[name] = w[name]
    initializers: list[Any] = [RecordingInitialize()]
    if "max_iterations" in SPEC:
        initializers.insert(
            0,
            inprocess.initialize.RetryController(
                max_iterations=SPEC["max_iterations"],
                min_world_size=SPEC.get("min_world_size", 1),
            ),
        )
    kwargs["initialize"] = inprocess.Compose(*initializers)
    kwargs["finalize"] = RecordingFinalize()
    kwargs["health_check"] = RecordingHealthCheck()
    aborts: list[Any] = [inprocess.abort.AbortTorchDistributed()]
    if SPEC.get("abort_fails"):
        aborts.insert(0, FailingAbort())
    kwargs["abort"] = inprocess.Compose(*aborts)
    assignment: Any = inprocess.rank_assignment.ShiftRanks()
    if SPEC.get("fill_gaps"):
        assignment = inprocess.rank_assignment.FillGaps()
    if "group_size" in SPEC:
        size = SPEC["group_size"]
        assignment = inprocess.Compose(
            assignment,
            inprocess.rank_assignment.FilterGroupedByKey(
                key_or_fn=lambda rank, _: str(rank // size),
                condition=lambda count: count == size,
            ),
        )
    if SPEC.get("assignment_fails"):
        assignment = inprocess.Compose(assignment, FailingAssignment())
    kwargs["rank_assignment"] = assignment
    filters = []
    if "divisible_by" in SPEC:
        filters.append(inprocess.rank_filter.WorldSizeDivisibleBy(SPEC["divisible_by"]))
    if "max_active" in SPEC:
        filters.append(inprocess.rank_filter.MaxActiveWorldSize(SPEC["max_active"]))
    if filters:
        kwargs["rank_filter"] = inprocess.Compose(*filters)
    return inprocess.Wrapper(**kwargs)


# ---------------------------------------------------------------- faults


def fault_for(iteration: int) -> dict[str, Any] | None:
    """This iteration's fault of this rank, else its first fault (several ranks may fault)."""
    faults = [f for f in SPEC.get("faults", []) if f["iteration"] == iteration]
    mine = [f for f in faults if f["rank"] == INITIAL_RANK]
    return (mine or faults or [None])[0]


def inject(kind: str) -> None:
    event("fault", fault=kind)
    # Written now: the process may not live to write its report.
    marker = Path(SPEC["report_dir"]) / f"fault{INITIAL_RANK}.json"
    marker.write_text(json.dumps({"kind": kind, "time": time.monotonic()}))
    if kind == "raise":
        raise RuntimeError("injected fault")
    if kind == "boom":
        raise ValueError("boom")
    if kind == "keyboard":
        raise KeyboardInterrupt
    if kind == "exit":
        sys.exit(3)
    if kind == "sleep":  # a hang with the GIL released
        time.sleep(1000)
    if kind == "socket":  # a hang in a socket read
        import socket

        a, _b = socket.socketpair()
        a.recv(1)
    if kind == "gil":  # a hang holding the GIL
        ctypes.PyDLL(None).sleep(1000)
    if kind == "busy":  # runs bytecode, never pings: only the manual timeout sees it
        while True:
            pass
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "pause":  # stuck in native code, deaf to every signal
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        signal.pause()
    if kind == "atomic_native":  # a long native call (idle, GIL released) inside atomic()
        with CALL_WRAPPER.atomic():
            ctypes.CDLL(None).sleep(SPEC.get("native_seconds", 5))
        return
    if kind == "segfault":
        ctypes.string_at(0)
    if kind == "stuck_when_freed":
        # A fault whose traceback holds, in torch.distributed's own frames, an
        # object whose destructor never returns (what a gloo group does when one
        # of its worker threads is left in a send the abort did not fail).
        dist.broadcast_object_list([StuckWhenFreed()], src=dist.get_world_size() + 5)
    raise ValueError(f"unknown fault kind {kind}")


class StuckWhenFreed:
    """Its destructor blocks in native code, deaf to every signal."""

    def __del__(self) -> None:
        event("freed")
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        signal.pause()


def busy_python(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


# ---------------------------------------------------------------- the job

wrapper = build_wrapper()
CALL_WRAPPER: Any = None


@wrapper
def train(call_wrapper: inprocess.CallWrapper = None) -> dict[str, Any]:
    global CALL_WRAPPER
    CALL_WRAPPER = call_wrapper
    iteration = call_wrapper.iteration
    dist.init_process_group("gloo", timeout=td(SPEC.get("gloo_timeout", 60)))
    rank, world = dist.get_rank(), dist.get_world_size()
    event("start", iteration=iteration, rank=rank, world=world)
    # One collective right away: proves the new group works.
    t = torch.ones(1)
    dist.all_reduce(t)
    event("ready", iteration=iteration, rank=rank, world=world)
    fault = fault_for(iteration)
    mode = fault["others"] if fault else SPEC.get("mode", "allreduce")
    steps = (
        SPEC.get("steps", 5)
        if iteration == 0
        else SPEC.get("steps_after_restart", SPEC.get("steps", 5))
    )
    (Path(SPEC["report_dir"]) / f"started{INITIAL_RANK}_{iteration}").touch()
    ping = SPEC.get("ping", False)
    total = 0.0
    step = 0
    try:
        for step in range(steps):
            if ping:
                call_wrapper.ping()
            if fault and fault["rank"] == INITIAL_RANK and step == fault["step"]:
                inject(fault["kind"])
            if mode == "allreduce":
                t = torch.full((1024,), float(rank + 1))
                dist.all_reduce(t)
                total = t[0].item()
                if SPEC.get("step_sleep"):
                    time.sleep(SPEC["step_sleep"])
            elif mode == "barrier":
                dist.barrier()
            else:  # python
                busy_python(SPEC.get("python_step_seconds", 0.05))
    except BaseException as ex:
        event(
            "interrupted",
            iteration=iteration,
            step=step,
            exception=type(ex).__name__,
            message=str(ex)[:300],
        )
        raise
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    total = t.item()
    dist.destroy_process_group()
    event("done", iteration=iteration)
    return {"rank": rank, "world": world, "sum": total, "iteration": iteration}


if __name__ == "__main__":
    results = []
    try:
        for _ in range(SPEC.get("calls", 1)):  # consecutive calls of the wrapped function
            results.append(train())
    except BaseException as ex:
        cause = ex.__cause__
        write_report(
            returned=None,
            exception=type(ex).__name__,
            message=str(ex),
            cause=None if cause is None else f"{type(cause).__name__}: {cause}",
            calls=results,
        )
        raise
    write_report(returned=results[-1], exception=None, calls=results)
