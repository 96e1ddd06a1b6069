"""``python -m inprocess.report`` / ``inprocess-run report``: what happened in a job.

    inprocess-run report STATE_DIR [--plot timeline.png]
    python -m inprocess.report restarts.jsonl [--plot timeline.png]   # a Wrapper under torchrun

Reads the Wrapper's restart records (``restarts.jsonl``) and the controller's
events (``events.jsonl``) of a state directory, or records files given
directly, and prints a summary: faults by kind (the root cause of each
restart: a hang that stalls every rank is one fault), restarts, restart latency
(median, p90, max), time lost, goodput (training time / wall time) and
failures per node. ``--plot`` draws a timeline (matplotlib, the
``inprocess[plot]`` extra): one lane per rank, its training intervals, faults
marked by kind, restart windows, relaunches, node moves and cold restarts.

Definitions (all from the records' wall-clock times):

* *wall time*: from the job's start (the controller's ``job_start``, else the
  first record) to its end (``job_end``, else the last record);
* *training time*: the time in which every active rank of an iteration was in
  the function, summed over iterations: from the last active rank's start to
  the first end (its fault's time when the iteration ended in a restart);
* *time lost*: wall time minus training time (start-up included); *in
  recovery* is the sum of restart latencies (fault to back in the function).

Training state (``restore`` records of :meth:`inprocess.CallWrapper.restore`):
per restore the step restored, where the ranks' state came from (own memory,
a peer, disk), the bytes moved, the restore time and the redone steps (steps
committed before the fault that the job runs again). Redone steps are lost
time: their ``redone_steps x step_seconds`` is taken out of the training time
(and so out of the goodput) and counted in the time lost.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from . import incidents as _incidents
from .records import EVENTS_FILE, RESTARTS_FILE, printable, read_jsonl

PLOT_INSTALL_HINT = "pip install 'inprocess[plot]'   (or: pip install matplotlib)"


# --------------------------------------------------------------------------- loading


def load(
    paths: Iterable[str | os.PathLike[str]], skipped: list[str] | None = None
) -> list[dict[str, Any]]:
    """Every well-formed record of the given state directories and records files, by time.

    A record with a field of the wrong type or out of range (see :func:`malformed`)
    is left out; ``skipped`` (when given) gets one line per record left out, saying why.

    Raises:
        OSError: a path that is neither a state directory nor a records file, or a
            file that cannot be read (the message names it).
    """
    records: list[dict[str, Any]] = []
    for path in map(Path, paths):
        if path.is_dir():
            files = [path / RESTARTS_FILE, path / EVENTS_FILE]
            if not any(f.exists() for f in files):
                raise FileNotFoundError(
                    f"{path} holds neither {RESTARTS_FILE} nor {EVENTS_FILE}: not a state "
                    "directory of inprocess-run (or nothing was recorded yet)"
                )
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"{path}: no such state directory or records file")
        for f in files:
            try:
                records += read_jsonl(f)
            except OSError as ex:
                raise OSError(f"{f}: cannot read it ({ex.strerror or ex})") from None
    good = []
    for r in records:
        problem = malformed(r)
        if problem is None:
            good.append(r)
        elif skipped is not None:
            skipped.append(problem)
    good.sort(key=lambda r: r["time"])
    restarter_states(good)
    return good


# --------------------------------------------------------------------------- checking

#: the largest magnitude of a time or duration in a record (seconds: year 5138)
_MAX_SECONDS = 1e11
#: the largest count in a record (world sizes, ranks, steps, bytes)
_MAX_INT = 2**53


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_MAX_INT <= v <= _MAX_INT


def _count(v: Any) -> bool:
    return _int(v) and v >= 0


def _size(v: Any) -> bool:  # a world size: a loop runs over it
    return _int(v) and 0 <= v <= 1_000_000


def _num(v: Any) -> bool:
    # (false for inf and nan; no float conversion, which overflows for a huge int)
    return isinstance(v, int | float) and not isinstance(v, bool) and abs(v) <= _MAX_SECONDS


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _key(v: Any) -> bool:  # a job, a call, a node: a dictionary key, printed as text
    return v is None or isinstance(v, str) or _int(v)


def _opt(check: Any) -> Any:
    return lambda v: v is None or check(v)


def _list_of(check: Any) -> Any:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _dict_of(check: Any) -> Any:
    return lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and check(x) for k, x in v.items()
    )


def _fault(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and _int(v.get("initial_rank"))
        and _opt(_int)(v.get("rank"))
        and _opt(_str)(v.get("cause"))
        and _opt(_str)(v.get("detail"))
    )


def _mismatch(v: Any) -> bool:
    return isinstance(v, dict) and _opt(_int)(v.get("rank")) and _opt(_str)(v.get("key"))


#: per record type: its fields and their checks (``None`` is allowed unless required)
_REQUIRED = {"iteration": ("initial_rank",)}
_FIELDS: dict[str, dict[str, Any]] = {
    "iteration": {
        "initial_rank": _int,
        "iteration": _int,
        "state": _str,
        "outcome": _str,
        "active": _bool,
        "rank": _int,
        "world_size": _size,
        "pid": _int,
        "node": _key,
        "job": _key,
        "call": _key,
    },
    "restart": {
        "iteration": _int,
        "world_size": _size,
        "active_world_size": _size,
        "previous_world_size": _size,
        "faults": _list_of(_fault),
        "terminated": _list_of(_int),
        "activated": _list_of(_int),
        "joined": _list_of(_int),
        "phases": _dict_of(_num),
        "latency": _num,
        "back_at": _num,
        "node": _key,
        "job": _key,
        "call": _key,
    },
    "restore": {
        "iteration": _int,
        "step": _int,
        "redone_steps": _count,
        "seconds": _num,
        "bytes": _count,
        "sources": _dict_of(_count),
        "step_seconds": _num,
        "verified": _bool,
        "mismatch": _list_of(_mismatch),
        "world_size": _size,
        "job": _key,
        "call": _key,
    },
    "event": {
        "event": _str,
        "generation": _int,
        "node": _key,
        "slot": _int,
        "local_rank": _int,
        "rank": _int,
        "pid": _int,
        "returncode": _int,
        "signal": lambda v: _int(v) or _str(v),
        "detail": _str,
        "world_size": _size,
        "target": _size,
        "expected": _bool,
    },
    "restarter": {"iteration": _int, "state": _str, "stage": _str, "rank": _int},
    "completed": {"iteration": _int, "world_size": _size, "job": _key, "call": _key},
    "join": {
        "iteration": _int,
        "initial_rank": _int,
        "process_start": _num,
        "call_start": _num,
        "monitor_ready": _num,
        "join_request": _num,
        "admitted": _num,
        "monitor": _str,
        "job": _key,
        "call": _key,
    },
}


def malformed(record: dict[str, Any]) -> str | None:
    """Why ``record`` cannot be reported (a field of the wrong type or out of range), or
    ``None``. Records of a type not known here need only a ``time``."""
    kind = record.get("type")
    if not _num(record.get("time")):
        return f"{str(kind)[:20]!r} record: bad time {str(record.get('time'))[:40]!r}"
    fields = _FIELDS.get(kind) if isinstance(kind, str) else None
    for name, check in (fields or {}).items():
        value = record.get(name)
        if value is None and name not in _REQUIRED.get(kind, ()):
            continue
        if not check(value):
            return f"{kind!r} record: bad {name} {str(value)[:40]!r}"
    return None


def restarter_states(records: Sequence[dict[str, Any]]) -> None:
    """Gives each ``restart`` record a ``restarter`` key: the nested restarter's
    transitions of that restart (``"handling:starting"``, ``"handling:completed"``),
    from the ``restarter`` records (:mod:`inprocess.nested_restarter`).

    A restart ending iteration ``i`` owns the ``handling`` records of iteration
    ``i`` stage ``starting`` (the abort) and of iteration ``i + 1`` stage
    ``completed`` (the next initialize) written between its
    fault and its return to the function. Restarts without such records get none.
    """
    states = [r for r in records if r.get("type") == "restarter" and r.get("state") == "handling"]
    if not states:
        return
    for r in records:
        if r.get("type") != "restart" or not isinstance(r.get("iteration"), int):
            continue
        start = r["time"] if isinstance(r.get("time"), (int, float)) else None
        end = r.get("back_at") if isinstance(r.get("back_at"), (int, float)) else None
        owned = [
            s
            for s in states
            if (s.get("iteration"), s.get("stage"))
            in ((r["iteration"], "starting"), (r["iteration"] + 1, "completed"))
            and (start is None or s["time"] >= start - 1.0)
            and (end is None or s["time"] <= end + 1.0)
        ]
        r["restarter"] = [f"{s['state']}:{s['stage']}" for s in owned]


# --------------------------------------------------------------------------- numbers


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def rank_spans(
    records: Sequence[dict[str, Any]],
) -> list[tuple[int, tuple[Any, ...], float, float, bool]]:
    """Each rank's time in the function: ``(initial rank, iteration key, start, end, active)``.

    An iteration a rank never ended (its process died, or a cold restart stopped
    it) ends at the first of: its restart's fault, the rank's next record, its
    process's exit, the next cold restart, the job's end.
    """
    by_time = sorted(records, key=lambda r: r["time"])
    end_of_job = by_time[-1]["time"] if by_time else 0.0
    restart_at: dict[tuple[Any, ...], float] = {}
    for r in by_time:
        if r.get("type") == "restart":
            restart_at.setdefault((r.get("job"), r.get("call"), r.get("iteration")), r["time"])
    lane_times: dict[int, list[float]] = collections.defaultdict(list)
    exits: dict[int, list[float]] = collections.defaultdict(list)
    colds: list[float] = []
    for r in by_time:
        if r.get("type") == "iteration":
            lane_times[r["initial_rank"]].append(r["time"])
        elif r.get("type") == "event" and r.get("event") == "worker_exit":
            exits[r.get("rank")].append(r["time"])
        elif r.get("type") == "event" and r.get("event") == "cold_restart":
            colds.append(r["time"])

    def first_after(times: list[float], t: float) -> float:
        return next((x for x in times if x > t), end_of_job)

    open_: dict[tuple[Any, ...], tuple[float, bool]] = {}
    spans = []
    for r in by_time:
        if r.get("type") != "iteration":
            continue
        rank = r["initial_rank"]
        key = (r.get("job"), r.get("call"), r.get("iteration"))
        slot = (*key, rank, r.get("pid"))
        if r.get("state") == "start":
            open_[slot] = (r["time"], bool(r.get("active", True)))
        elif slot in open_:
            start, active = open_.pop(slot)
            spans.append((rank, key, start, r["time"], active))
    for slot, (start, active) in open_.items():
        key, rank = slot[:3], slot[3]
        end = min(
            restart_at.get(key, end_of_job),
            first_after(lane_times[rank], start),
            first_after(exits[rank], start),
            first_after(colds, start),
        )
        spans.append((rank, key, start, max(end, start), active))
    return spans


def training_intervals(records: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """When the whole job trained: per iteration, from the last active rank's start to the
    first end (its restart's fault time when it ended in a restart)."""
    starts: dict[tuple[Any, ...], list[float]] = collections.defaultdict(list)
    ends: dict[tuple[Any, ...], list[float]] = collections.defaultdict(list)
    for _, key, start, end, active in rank_spans(records):
        if active:
            starts[key].append(start)
            ends[key].append(end)
    for r in records:
        if r.get("type") == "restart":
            ends[(r.get("job"), r.get("call"), r.get("iteration"))].append(r["time"])
    intervals = []
    for key, times in starts.items():
        start, end = max(times), min(ends[key])
        if end > start:
            intervals.append((start, end))
    return intervals


#: controller events drawn as a line across every lane: line colour, style and
#: width, text colour, label (a format string over the event's fields)
_JOB_MARKERS = {
    "node_relaunch": ("#1f77b4", "--", 1.2, "#1f77b4", " node {node} moved"),
    "cold_restart": ("#9467bd", "-", 1.5, "#9467bd", " cold restart (gen {generation})"),
    "controller_recovery": ("#7f7f7f", ":", 1.5, "#555555", " controller recovered"),
}


#: where a restore found the ranks' state, in the order the report lists them
STATE_SOURCES = ("memory", "peer", "disk", "none")


def state_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The training-state figures of the ``restore`` records; ``None`` when there are none.

    A restore whose record lacks ``step_seconds`` (fewer than two commits before
    the fault) costs its redone steps at the median step time of the others.
    """
    restores = [r for r in records if r.get("type") == "restore"]
    if not restores:
        return None
    known = [float(r["step_seconds"]) for r in restores if r.get("step_seconds")]
    fallback = percentile(known, 50) or 0.0
    rows = []
    for r in restores:
        redone = int(r.get("redone_steps") or 0)
        step_seconds = float(r["step_seconds"]) if r.get("step_seconds") else fallback
        sources = {k: int(n) for k, n in (r.get("sources") or {}).items() if n}
        rows.append(
            {
                "time": r["time"],
                "iteration": r.get("iteration"),
                "step": r.get("step"),
                "sources": sources,
                "bytes": int(r.get("bytes") or 0),
                "seconds": float(r.get("seconds") or 0.0),
                "redone_steps": redone,
                "redone_seconds": redone * step_seconds,
                "verified": r.get("verified"),
                "mismatch": r.get("mismatch"),
            }
        )
    # the first start (step 0 from nothing) is no recovery: not in the figures
    recoveries = [x for x in rows if x["step"] or x["redone_steps"]]
    seconds = [x["seconds"] for x in recoveries]
    redone = [x["redone_steps"] for x in recoveries]
    totals: collections.Counter[str] = collections.Counter()
    for x in rows:
        totals.update(x["sources"])
    return {
        "restores": len(rows),
        "recoveries": len(recoveries),
        "sources": {
            k: totals[k]
            for k in (*STATE_SOURCES, *sorted(set(totals) - set(STATE_SOURCES)))
            if totals[k]
        },
        "bytes": sum(x["bytes"] for x in rows),
        "restore_seconds": {
            "median": percentile(seconds, 50),
            "max": max(seconds) if seconds else None,
        },
        "redone_steps": {
            "total": sum(redone),
            "per_fault_mean": sum(redone) / len(redone) if redone else None,
            "max": max(redone) if redone else None,
        },
        "redone_seconds": sum(x["redone_seconds"] for x in rows),
        "mismatches": sum(1 for x in rows if x["mismatch"]),
        "per_restore": rows,
    }


#: the steps of a rejoin, each from the one before: the worker's loss (the controller's
#: ``worker_exit``), its relaunch, its Wrapper call's start, its join request, its
#: admission, and its first iteration at the new size (the admitting restart's ``back_at``)
REJOIN_STEPS = ("relaunched", "call_started", "join_requested", "admitted", "training")


def rejoins(records: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Per ``join`` record, the seconds of each of :data:`REJOIN_STEPS` and ``total``
    (loss to training); a step whose records are missing (no controller: no
    ``worker_exit``) is left out, and ``total`` then starts at the first step known."""
    events = [r for r in records if r.get("type") == "event"]
    result = []
    for j in (r for r in records if r.get("type") == "join"):
        rank, call_start = j.get("initial_rank"), j.get("call_start")
        if call_start is None:
            continue
        # the loss: the rank's latest worker exit before the call; its relaunch: the
        # first relaunch after that (the event is written once the process runs, at
        # times after the script began: the step is then counted as 0)
        lost = max(
            (
                e["time"]
                for e in events
                if e.get("event") == "worker_exit"
                and e.get("rank") == rank
                and e["time"] <= call_start
            ),
            default=None,
        )
        relaunch = None
        if lost is not None:
            relaunch = min(
                (
                    e["time"]
                    for e in events
                    if e.get("event") == "worker_relaunch"
                    and e.get("rank") == rank
                    and e["time"] >= lost
                ),
                default=None,
            )
            if relaunch is not None:
                relaunch = min(relaunch, call_start)
        back = min(
            (
                r["back_at"]
                for r in records
                if r.get("type") == "restart"
                and r.get("iteration") == j.get("iteration")
                and rank in (r.get("joined") or ())
                and r.get("back_at") is not None
            ),
            default=None,
        )
        times = (lost, relaunch, call_start, j.get("join_request"), j.get("admitted"), back)
        steps = {
            name: times[i + 1] - times[i]
            for i, name in enumerate(REJOIN_STEPS)
            if times[i] is not None and times[i + 1] is not None
        }
        known = [t for t in times if t is not None]
        steps["total"] = known[-1] - known[0]
        result.append(steps)
    return result


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report's numbers (see the module docstring for their definitions)."""
    restarts = [r for r in records if r.get("type") == "restart"]
    events = [r for r in records if r.get("type") == "event"]
    by_event = collections.defaultdict(list)
    for e in events:
        by_event[e.get("event")].append(e)
    start_events, end_events = by_event["job_start"], by_event["job_end"]
    first = start_events[0]["time"] if start_events else (records[0]["time"] if records else 0.0)
    last = end_events[-1]["time"] if end_events else (records[-1]["time"] if records else 0.0)
    wall = max(0.0, last - first)
    state = state_summary(records)
    redone = state["redone_seconds"] if state else 0.0
    training = max(0.0, sum(end - start for start, end in training_intervals(records)) - redone)
    latencies = [float(r["latency"]) for r in restarts if r.get("latency") is not None]

    faults_by_kind: collections.Counter[str] = collections.Counter()
    admissions = 0
    for r in restarts:
        # a restart's root cause: the ranks that a hang stalls all time out, one fault
        if r.get("faults"):
            faults_by_kind[str(r["faults"][0].get("cause"))] += 1
        elif r.get("joined"):
            admissions += 1  # it let a relaunched worker in: not a fault

    # Where each initial rank ran, for the per-node counts of in-process faults.
    node_of: dict[int, Any] = {}
    for r in records:
        if r.get("type") == "iteration" and r.get("node") is not None:
            node_of[r["initial_rank"]] = r["node"]
    nodes: dict[Any, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in restarts:
        for f in r.get("faults") or []:
            if f.get("cause") != "terminated":
                nodes[node_of.get(f.get("initial_rank"))]["in_process"] += 1
    failed_exits = [
        e
        for e in by_event["worker_exit"]
        if not e.get("expected") and (e.get("returncode") != 0 or e.get("signal") is not None)
    ]
    for e in failed_exits:
        nodes[e.get("node")]["worker_exits"] += 1
    for e in by_event["node_relaunch"]:
        nodes[e.get("node")]["node_relaunches"] += 1

    restarter = [r["restarter"] for r in restarts if "restarter" in r]
    phases: dict[str, list[float]] = collections.defaultdict(list)
    for r in restarts:
        for name, value in (r.get("phases") or {}).items():
            phases[name].append(float(value))
    end = end_events[-1] if end_events else None
    return {
        "wall_time": wall,
        "training_time": training,
        "time_lost": max(0.0, wall - training),
        "in_recovery": sum(latencies),
        "redone_time": redone,
        "goodput": training / wall if wall > 0 else None,
        "restarts": len(restarts),
        "admissions": admissions,
        "rejoins": rejoins(records),
        "faults_by_kind": dict(faults_by_kind),
        "latency": {
            "median": percentile(latencies, 50),
            "p90": percentile(latencies, 90),
            "max": max(latencies) if latencies else None,
        },
        "phases_median": {k: percentile(v, 50) for k, v in phases.items()},
        # the nested restarter's states of each restart (when its callbacks ran)
        "restarter_states": restarter,
        "worker_exits": len(failed_exits),
        "worker_relaunches": len(by_event["worker_relaunch"]),
        "node_relaunches": len(by_event["node_relaunch"]),
        "cold_restarts": len(by_event["cold_restart"]),
        "controller_recoveries": len(by_event["controller_recovery"]),
        "limits": [e.get("detail") for e in by_event["limit"]],
        # the controller could not save the job's state (durability, not the job's result)
        "state_save_failures": [e.get("detail") for e in by_event["state_save_failed"]],
        "per_node": {str(k): dict(v) for k, v in sorted(nodes.items(), key=lambda kv: str(kv[0]))},
        "state": state,
        "result": None
        if end is None
        else {"exit_code": end.get("returncode"), "detail": end.get("detail")},
    }


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _time_lost(s: dict[str, Any]) -> str:
    parts = [f"in recovery: {_seconds(s['in_recovery'])}"]
    if s.get("state"):
        parts.append(f"redone steps: {_seconds(s.get('redone_time'))}")
    return f"{_seconds(s['time_lost'])} ({', '.join(parts)})"


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _sources(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in counts.items()) or "-"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _state_rows(state: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The summary's training-state rows (none without ``restore`` records)."""
    if not state:
        return []
    redone, seconds = state["redone_steps"], state["restore_seconds"]
    mean = "-" if redone["per_fault_mean"] is None else f"{redone['per_fault_mean']:.2f}"
    rows = [
        (
            "state restores",
            f"{state['restores']} (after a fault or restart: {state['recoveries']})",
        ),
        ("  ranks restored from", _sources(state["sources"])),
        ("  bytes moved", _bytes(state["bytes"])),
        ("  restore time", f"median {_seconds(seconds['median'])}, max {_seconds(seconds['max'])}"),
        (
            "  redone steps",
            f"{redone['total']} (per restore: mean {mean}, max {_or_dash(redone['max'])}; "
            f"{_seconds(state['redone_seconds'])} lost)",
        ),
    ]
    if state["mismatches"]:
        rows.append(("  checksum mismatches", str(state["mismatches"])))
    return rows


def _restore_lines(state: dict[str, Any] | None) -> list[str]:
    """One line per restore: iteration, step, sources, bytes, time, redone steps."""
    if not state:
        return []
    lines = ["", "restores   iteration    step  redone  restore time       bytes  sources"]
    for x in state["per_restore"]:
        flag = (
            "  MISMATCH "
            + ", ".join(f"rank {m.get('rank')} {m.get('key')!r}" for m in x["mismatch"])
            if x["mismatch"]
            else ""
        )
        lines.append(
            f"{'':<10} {_or_dash(x['iteration']):>9} {_or_dash(x['step']):>7} "
            f"{x['redone_steps']:>7} {_seconds(x['seconds']):>13} {_bytes(x['bytes']):>11}  "
            f"{_sources(x['sources'])}{flag}"
        )
    return lines


def _rejoin_rows(joins: list[dict[str, float]]) -> list[tuple[str, str]]:
    """Rows of the rejoins: how many, loss to training again, and each step (medians)."""
    if not joins:
        return []
    totals = [j["total"] for j in joins]
    steps = []
    for name in REJOIN_STEPS:
        values = [j[name] for j in joins if name in j]
        if values:
            steps.append(f"{name.replace('_', ' ')} {_seconds(percentile(values, 50))}")
    return [
        (
            "rejoins",
            f"{len(joins)}: lost to training again median {_seconds(percentile(totals, 50))}, "
            f"max {_seconds(max(totals))}",
        ),
        ("  median steps", ", ".join(steps)),
    ]


def format_summary(s: dict[str, Any]) -> str:
    """The summary as a table for the terminal."""
    rows: list[tuple[str, str]] = []
    if s["result"] is not None:
        rows.append(("result", f"exit code {s['result']['exit_code']}: {s['result']['detail']}"))
    goodput = "-" if s["goodput"] is None else f"{s['goodput'] * 100:.1f} %"
    rows += [
        ("wall time", _seconds(s["wall_time"])),
        ("training time", _seconds(s["training_time"])),
        ("goodput", goodput),
        ("time lost", _time_lost(s)),
        (
            "in-process restarts",
            f"{s['restarts']} (admitting a relaunched worker: {s['admissions']})"
            if s.get("admissions")
            else str(s["restarts"]),
        ),
    ]
    lat = s["latency"]
    rows.append(
        (
            "restart latency",
            f"median {_seconds(lat['median'])}, p90 {_seconds(lat['p90'])}, "
            f"max {_seconds(lat['max'])}",
        )
    )
    if s["phases_median"]:
        rows.append(
            (
                "  median phases",
                ", ".join(f"{k} {_seconds(v)}" for k, v in s["phases_median"].items()),
            )
        )
    # The nested restarter's states per restart: one row per distinct sequence.
    sequences: dict[str, list[int]] = {}
    for i, states in enumerate(s.get("restarter_states") or []):
        sequences.setdefault(" -> ".join(states) or "-", []).append(i + 1)
    total = len(s.get("restarter_states") or [])
    for text, which in sequences.items():
        where = (
            f"{len(which)} of {total} restarts"
            if len(which) > 3
            else "restart" + ("s " if len(which) > 1 else " ") + ", ".join(map(str, which))
        )
        rows.append(("  restarter states", f"{text} ({where})"))
    faults = s["faults_by_kind"]
    rows.append(
        (
            "faults by kind",
            ", ".join(f"{k} {n}" for k, n in sorted(faults.items(), key=lambda kv: -kv[1]))
            or "none",
        )
    )
    rows += [
        ("failed worker exits", str(s["worker_exits"])),
        *_rejoin_rows(s.get("rejoins") or []),
        ("worker relaunches", str(s["worker_relaunches"])),
        ("node relaunches", str(s["node_relaunches"])),
        ("cold restarts", str(s["cold_restarts"])),
        ("controller recoveries", str(s["controller_recoveries"])),
    ]
    for detail in s["limits"]:
        rows.append(("limit reached", str(detail)))
    rows += _state_rows(s.get("state"))
    for detail in s.get("state_save_failures", ()):
        rows.append(("state not saved", str(detail)))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += _restore_lines(s.get("state"))
    if s["per_node"]:
        lines += ["", "per node     in-process faults  failed worker exits  node relaunches"]
        for node, counts in s["per_node"].items():
            name = "?" if node == "None" else node
            lines.append(
                f"node {name:<7} {counts.get('in_process', 0):>17}  "
                f"{counts.get('worker_exits', 0):>19}  {counts.get('node_relaunches', 0):>15}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- the picture

#: how each cause is marked on the timeline: (marker, colour)
FAULT_STYLE = {
    "exception": ("X", "#d62728"),
    "signal": ("v", "#000000"),
    "hang": ("s", "#ff7f0e"),
    "heartbeat": ("D", "#9467bd"),
    "unhealthy": ("P", "#8c564b"),
    "terminated": ("o", "#7f7f7f"),
    "connection": ("*", "#17becf"),
}


def _lanes(records: Sequence[dict[str, Any]]) -> list[int]:
    lanes = {r["initial_rank"] for r in records if r.get("type") == "iteration"}
    lanes |= {r["rank"] for r in records if r.get("type") == "event" and r.get("rank") is not None}
    for r in records:
        if r.get("type") == "restart":
            lanes |= {f["initial_rank"] for f in r.get("faults") or []}
    return sorted(lanes)


def _process_intervals(
    records: Sequence[dict[str, Any]], end_of_job: float
) -> dict[int, list[tuple[float, float]]]:
    """Per worker: when its process ran, from the controller's events."""
    running: dict[int, float] = {}
    out: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    workers: set[int] = set()
    for r in records:
        if r.get("type") != "event":
            continue
        name, rank = r.get("event"), r.get("rank")
        if rank is not None:
            workers.add(rank)
        if name in ("job_start", "cold_restart"):
            target = r.get("target") or 0
            for w in range(target):
                running.setdefault(w, r["time"])
        elif name == "worker_relaunch" and rank is not None:
            running.setdefault(rank, r["time"])
        elif name == "worker_exit" and rank is not None and rank in running:
            out[rank].append((running.pop(rank), r["time"]))
    for w, start in running.items():
        out[w].append((start, end_of_job))
    return out


def plot(records: Sequence[dict[str, Any]], path: Any, title: str = "") -> None:
    """Draws the timeline to ``path`` (a PNG file name, or a binary file object); needs
    matplotlib (``inprocess[plot]``)."""
    try:
        import matplotlib
    except ImportError as ex:
        raise ImportError(f"--plot needs matplotlib: {PLOT_INSTALL_HINT}") from ex
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not records:
        raise ValueError("no records to plot")
    t0 = records[0]["time"]
    for r in records:
        if r.get("type") == "event" and r.get("event") == "job_start":
            t0 = r["time"]
            break
    t_end = records[-1]["time"]
    lanes = _lanes(records)
    index = {rank: i for i, rank in enumerate(lanes)}
    n = max(1, len(lanes))
    height = 2.2 + (0.3 * n if n <= 16 else 4.8 + 0.09 * (n - 16))
    fig, ax = plt.subplots(figsize=(12, height), dpi=100)
    bar = 0.7 if n <= 16 else 0.85

    for rank, spans in _process_intervals(records, t_end).items():
        if rank in index:
            ax.broken_barh(
                [(s - t0, e - s) for s, e in spans],
                (index[rank] - 0.45, 0.9),
                facecolors="#e8e8e8",
                edgecolors="none",
                zorder=1,
            )
    per_rank: dict[int, list[tuple[float, float, bool]]] = collections.defaultdict(list)
    for rank, _, start, end, active in rank_spans(records):
        per_rank[rank].append((start, end, active))
    for rank, spans in per_rank.items():
        if rank not in index:
            continue
        for active in (True, False):
            chosen = [(s - t0, e - s) for s, e, a in spans if a is active]
            if chosen:
                ax.broken_barh(
                    chosen,
                    (index[rank] - bar / 2, bar),
                    facecolors="#2ca02c" if active else "#aec7e8",
                    edgecolors="none",
                    zorder=2,
                )

    marker_size = 70 if n <= 16 else 40
    seen_causes: set[str] = set()
    for r in records:
        if r.get("type") != "restart":
            continue
        start, back = r["time"] - t0, (r.get("back_at") or r["time"]) - t0
        # at least 0.4 % of the axis wide, so that a fast restart stays visible
        width = max(back - start, 0.004 * max(t_end - t0, 1e-3))
        ax.axvspan(start, start + width, color="#d62728", alpha=0.35, lw=0, zorder=4)
        for f in r.get("faults") or []:
            cause = str(f.get("cause"))
            marker, colour = FAULT_STYLE.get(cause, ("*", "#17becf"))
            seen_causes.add(cause)
            if f.get("initial_rank") in index:
                ax.scatter(
                    [start],
                    [index[f["initial_rank"]]],
                    marker=marker,
                    s=marker_size,
                    color=colour,
                    edgecolors="white",
                    linewidths=0.6,
                    zorder=5,
                )

    # labels of job-wide events above the plot, where no lane is hidden by them
    top = ax.get_xaxis_transform()
    for r in records:
        if r.get("type") != "event":
            continue
        name, t = r.get("event"), r["time"] - t0
        if name == "worker_relaunch" and r.get("rank") in index:
            ax.scatter(
                [t],
                [index[r["rank"]] + 0.3],  # below its lane's fault marker
                marker="^",
                s=marker_size,
                color="#1f77b4",
                edgecolors="white",
                linewidths=0.6,
                zorder=6,
            )
        elif name in _JOB_MARKERS:
            color, style, width, text_color, label = _JOB_MARKERS[name]
            ax.axvline(t, color=color, ls=style, lw=width, zorder=3)
            ax.text(
                t,
                1.0,
                label.format_map(collections.defaultdict(lambda: "?", r)),
                color=text_color,
                fontsize=8,
                va="bottom",
                rotation=30,
                transform=top,
            )

    # lines between nodes (where records say which node a rank ran on)
    node_of = {r["initial_rank"]: r.get("node") for r in records if r.get("type") == "iteration"}
    node_of.update(
        {
            r["rank"]: r.get("node")
            for r in records
            if r.get("type") == "event" and r.get("rank") is not None
        }
    )
    for i in range(1, n):
        a, b = node_of.get(lanes[i - 1]), node_of.get(lanes[i])
        if a is not None and b is not None and a != b:
            ax.axhline(i - 0.5, color="#444444", lw=0.8, zorder=3)
    ax.set_ylim(n - 0.5, -0.5)
    step = 1 if n <= 16 else max(1, math.ceil(n / 32))
    ticks = list(range(0, n, step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([str(lanes[i]) for i in ticks], fontsize=8 if n > 16 else 10)
    ax.set_ylabel("rank (initial)")
    ax.set_xlabel("time since start (s)")
    ax.set_xlim(0, max(t_end - t0, 1e-3) * 1.02)
    ax.grid(axis="x", color="#dddddd", lw=0.6, zorder=0)
    ax.set_axisbelow(True)

    handles = [
        Patch(color="#2ca02c", label="training (active)"),
        Patch(color="#aec7e8", label="spare (inactive)"),
        Patch(color="#e8e8e8", label="process running"),
        Patch(color="#d62728", alpha=0.25, label="restart: fault to back in function"),
    ]
    for cause in CAUSE_ORDER:
        if cause in seen_causes:
            marker, colour = FAULT_STYLE[cause]
            handles.append(
                Line2D(
                    [],
                    [],
                    ls="",
                    marker=marker,
                    color=colour,
                    markersize=8,
                    label=f"fault: {cause}",
                )
            )
    handles.append(
        Line2D([], [], ls="", marker="^", color="#1f77b4", markersize=8, label="worker relaunched")
    )
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
    )
    if title:
        labelled = any(
            r.get("event") in ("node_relaunch", "cold_restart", "controller_recovery")
            for r in records
        )
        ax.set_title(title, fontsize=10, loc="left", pad=48 if labelled else 6)
    fig.tight_layout()
    fig.savefig(path if hasattr(path, "write") else os.fspath(path), format="png")
    plt.close(fig)


CAUSE_ORDER = tuple(FAULT_STYLE)


def title_of(s: dict[str, Any]) -> str:
    goodput = "-" if s["goodput"] is None else f"{s['goodput'] * 100:.1f}%"
    median = _seconds(s["latency"]["median"])
    return (
        f"{s['restarts']} in-process restarts (median latency {median}), "
        f"{s['worker_relaunches']} worker relaunches, {s['node_relaunches']} node moves, "
        f"{s['cold_restarts']} cold restarts; goodput {goodput}"
    )


# --------------------------------------------------------------------------- command


def _job_start(records: Sequence[dict[str, Any]]) -> float | None:
    starts = [r["time"] for r in records if r.get("event") == "job_start"]
    return starts[0] if starts else (records[0]["time"] if records else None)


def main(argv: list[str] | None = None, prog: str = "python -m inprocess.report") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Summarize a job's faults and restarts; optionally draw its timeline.",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="STATE_DIR_OR_RECORDS",
        help="an inprocess-run state directory, or records files (INPROCESS_RECORDS)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw the timeline to this PNG file")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = p.parse_args(argv)
    skipped: list[str] = []
    try:
        records = load(args.paths, skipped)
    except OSError as ex:
        print(f"{prog}: {printable(str(ex))}", file=sys.stderr)
        return 2
    if skipped:
        print(
            f"{prog}: warning: skipped {len(skipped)} malformed record(s); the first: "
            f"{printable(skipped[0])}",
            file=sys.stderr,
        )
    if not records:
        print(f"{prog}: no records in {printable(', '.join(args.paths))}", file=sys.stderr)
        return 1
    summary = summarize(records)
    # every incident in words (see inprocess.incidents), after the totals
    summary["incidents"] = _incidents.build(records)
    try:
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            # what came from workers (their exceptions' text) is escaped: no terminal
            # escape sequence of theirs reaches the reader's terminal
            print(printable(format_summary(summary), lines=True))
            text = _incidents.format_incidents(summary["incidents"], _job_start(records))
            print(printable(text, lines=True))
        if args.plot:
            try:
                plot(records, args.plot, title_of(summary))
            except ImportError as ex:
                print(f"{prog}: {ex}", file=sys.stderr)
                return 3
            except OSError as ex:
                print(
                    f"{prog}: --plot {printable(args.plot)}: cannot write it "
                    f"({ex.strerror or ex})",
                    file=sys.stderr,
                )
                return 2
            print(f"timeline: {args.plot}")
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`... | head`): not an error of ours; keep Python
        # from complaining about the unflushed stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
