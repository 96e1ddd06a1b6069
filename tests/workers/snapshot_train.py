"""A data-parallel job that keeps its state with CallWrapper.restore/commit, driven by a spec.

The spec (``INPROCESS_TEST_SPEC``): ``steps``, ``replicated``, Wrapper
settings, ``max_active`` (the others are spares), ``snapshot_dir`` and
``persist_every``, and ``faults``: ``{"iteration", "rank" (initial rank),
"step", "kind"}`` with kinds

* ``raise``: an exception before the step's all-reduce;
* ``hang``: sleeps (no progress) before the all-reduce: the soft timeout;
* ``kill``: SIGKILL before the all-reduce;
* ``kill_after_commit``: SIGKILL right after the step's commit returned (a due
  step's disk write never lands);
* ``skew``: an exception after the step was applied but before its commit,
  while the others commit it (ranks one step apart at the fault);
* ``torn``: the step's commit raises in the middle of copying the state;
* ``corrupt``: flips a byte of the newest snapshot in memory, then raises.

``hold_below_world`` and ``hold_step``: at that step, while the world is
smaller, a rank waits (for a relaunched worker to join and restart it).

Each process writes ``report<initial rank>.json``: the final parameters (bit
for bit), the restore records it saw, the steps it ran, and whether the
call's snapshots were released when it returned.
"""

from __future__ import annotations

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
import torch._dynamo
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import snapshot_model as sm

import inprocess

# (torch._dynamo above: the first optimizer would import it lazily, inside the
# function, tens of seconds on a loaded machine: a soft timeout the test did not inject)
SPEC: dict[str, Any] = json.loads(os.environ["INPROCESS_TEST_SPEC"])
INITIAL_RANK = int(os.environ["RANK"])
INCARNATION = int(os.environ.get("INPROCESS_WORKER_INCARNATION", "0"))
REPORT_DIR = Path(SPEC.get("report_dir") or os.environ["SNAPSHOT_REPORT_DIR"])
REPORT = REPORT_DIR / f"report{INITIAL_RANK}{'' if INCARNATION == 0 else f'.{INCARNATION}'}.json"
logging.basicConfig(
    level=SPEC.get("log_level", "WARNING"),
    format=f"%(asctime)s r{INITIAL_RANK} %(name)s %(levelname)s %(message)s",
)

RAN: list[dict[str, Any]] = []  # per iteration: first step, steps run
RESTORES: list[dict[str, Any]] = []
CALL: list[inprocess.CallWrapper] = []


class Torn(torch.Tensor):
    """A tensor whose copy into a snapshot raises (a commit torn mid-copy)."""

    armed = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.armed and func is torch.Tensor.copy_:
            cls.armed = False
            time.sleep(0.5)  # the others commit this step meanwhile
            raise RuntimeError("injected: commit torn mid-copy")
        return super().__torch_function__(func, types, args, kwargs or {})


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def fault_for(iteration: int, step: int) -> str | None:
    if INCARNATION != 0:
        return None
    for f in SPEC.get("faults", []):
        if f["iteration"] == iteration and f["rank"] == INITIAL_RANK and f["step"] == step:
            return f["kind"]
    return None


def build_wrapper() -> inprocess.Wrapper:
    kwargs: dict[str, Any] = {k: td(v) for k, v in SPEC.get("wrapper", {}).items()}
    if "max_active" in SPEC:
        kwargs["rank_filter"] = inprocess.rank_filter.MaxActiveWorldSize(SPEC["max_active"])
    for name in ("snapshot_dir", "persist_every", "records"):
        if SPEC.get(name) is not None:
            kwargs[name] = SPEC[name]
    return inprocess.Wrapper(**kwargs)


@build_wrapper()
def train(call_wrapper: inprocess.CallWrapper = None) -> dict[str, Any]:
    if not CALL:
        CALL.append(call_wrapper)
    iteration = call_wrapper.iteration
    dist.init_process_group("gloo", timeout=td(60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = sm.build()
    replicated = SPEC.get("replicated", True)
    # replicated: sum of steps; else differs per rank: (rank + 1) * sum of steps
    local = torch.zeros(3, dtype=torch.float64)
    guard = torch.zeros(4).as_subclass(Torn)
    state: dict[str, Any] = {"model": model, "optim": opt, "local": local, "data": {"next": 0}}
    state["guard"] = guard
    try:
        start = call_wrapper.restore(state, replicated=replicated)
    finally:
        if (
            call_wrapper.last_restore is not None
            and call_wrapper.last_restore["iteration"] == iteration
        ):
            RESTORES.append(dict(call_wrapper.last_restore))
    assert state["data"]["next"] == start, (state["data"], start)
    # steps: applied; begun: started (a fault may end one before it is applied)
    ran = {"iteration": iteration, "rank": rank, "world": world, "from": start, "steps": 0}
    ran["begun"] = 0
    RAN.append(ran)
    for step in range(start, SPEC["steps"]):
        ran["begun"] += 1
        kind = fault_for(iteration, step)
        grads = sm.local_grads(model, step, rank, world)
        if kind == "raise":
            raise RuntimeError("injected fault")
        if kind == "hang":
            time.sleep(600)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if world < SPEC.get("hold_below_world", 0) and step == SPEC["hold_step"]:
            # waits (making progress) for a relaunched worker to join: its join restarts us
            while True:
                call_wrapper.ping()
                time.sleep(0.05)
        if kind == "corrupt":
            # the last commit's copy may still be in flight on its thread: land it
            # first, so the byte flipped is in the snapshot a restore will pick
            for slot in call_wrapper._snapshots.own.slots:
                slot.wait()
            newest = call_wrapper._snapshots.own.held()[0]
            newest.data[0] ^= 0xFF
            raise RuntimeError("injected fault after corrupting the snapshot")
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        summed, offset = [], 0
        for g in grads:
            summed.append(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        sm.apply(model, opt, summed)
        local += (1 if replicated else rank + 1) * (step + 1)
        state["data"]["next"] = step + 1
        ran["steps"] += 1
        if kind == "skew":
            time.sleep(0.5)  # the others commit this step meanwhile
            raise RuntimeError("injected fault before the commit")
        if kind == "torn":
            Torn.armed = True
        if SPEC.get("step_sleep"):
            time.sleep(SPEC["step_sleep"])
        call_wrapper.commit(state, step + 1)
        if kind == "kill_after_commit":
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    result = {
        "rank": rank,
        "world": world,
        "params": sm.fingerprint(model),
        "local": local.tolist(),
        "iteration": iteration,
    }
    dist.destroy_process_group()
    return result


def released(cw: inprocess.CallWrapper) -> dict[str, Any]:
    snaps = cw._snapshots
    return {
        "buffers": sum(s.data.numel() for pair in (snaps.own, snaps.buddy) for s in pair.slots),
        "writer_threads": [t.name for t in threading.enumerate() if "snapshot" in t.name],
    }


if __name__ == "__main__":
    try:
        returned = train()
    except BaseException as ex:
        REPORT.write_text(
            json.dumps(
                {
                    "returned": None,
                    "exception": f"{type(ex).__name__}: {ex}",
                    "ran": RAN,
                    "restores": RESTORES,
                }
            )
        )
        raise
    REPORT.write_text(
        json.dumps(
            {
                "returned": returned,
                "exception": None,
                "ran": RAN,
                "restores": RESTORES,
                "released": released(CALL[0]) if CALL else None,
            }
        )
    )
