"""Every incident of a job, in words, from its records (for ``inprocess-run report``).

One incident per thing that went wrong: a worker process that ended badly (from
the controller's ``worker_exit`` events: "rank 2 on node 1 killed by SIGKILL"),
a lost node (``node_relaunch``: "node 1 lost"), and each rank's fault of an
in-process restart (the Wrapper's ``restart`` records: "rank 3 stuck in native
code, ended after 2.0 s", an exception, a hang). A restart fault that only
repeats a worker exit already named (the same rank's death within a few
seconds) is not named twice.

Each incident has its wall-clock ``time``, ``node``, ``ranks``, ``what``,
``recovery`` (seconds from the incident until the job was back in the function
at its full size, or, when it never was again (no launcher replaced the rank),
at the size the next restart brought it to; ``None``: never back) and
``work_lost`` (rank-seconds of training not done during that recovery: the
recovery times the ranks of the job before it; work redone from a checkpoint
is not known here and not counted), and the recorded ``detail`` (for a stuck
rank: where its thread waited). Pure functions of the records: no I/O.
"""

from __future__ import annotations

import re
import signal as signal_module
from collections.abc import Sequence
from typing import Any

#: a restart fault within this many seconds of the same rank's worker exit is that exit
SAME_DEATH = 10.0

_ENDED_AFTER = re.compile(r"ended after ([0-9.]+)s")


def _signal_name(number: Any) -> str:
    try:
        return signal_module.Signals(int(number)).name
    except (TypeError, ValueError):
        return f"signal {number}"


def _on(rank: Any, node: Any) -> str:
    return f"rank {rank}" + (f" on node {node}" if node is not None else "")


def describe_fault(fault: dict[str, Any], node: Any) -> str:
    """One restart fault in words."""
    who = _on(fault.get("initial_rank"), node)
    detail = str(fault.get("detail") or "")
    cause = fault.get("cause")
    if detail.startswith("stuck in native code"):
        m = _ENDED_AFTER.search(detail)
        ended = f", ended after {float(m.group(1)):.1f} s" if m else ""
        return f"{who} stuck in native code{ended}"
    if detail.startswith("process died"):
        return f"{who} died"
    if cause == "heartbeat":
        return f"{who} lost ({detail})"
    if cause == "hang":
        return f"{who} hung ({detail})"
    if cause == "exception":
        return f"{who} raised {detail}"
    return f"{who}: {detail}" if detail else f"{who}: {cause}"


def build(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The incidents of ``records`` (restart records and controller events), by time."""
    restarts = sorted(
        (r for r in records if r.get("type") == "restart" and r.get("time") is not None),
        key=lambda r: r["time"],
    )
    node_of = {
        r["initial_rank"]: r.get("node")
        for r in records
        if r.get("type") == "iteration" and r.get("node") is not None
    }

    def recovery(since: float, size: Any) -> tuple[float | None, float | None]:
        # back in the function at full size (``size`` ranks) after the incident,
        # else back at all (a job without a launcher goes on smaller)
        after = [
            r
            for r in restarts
            if r.get("back_at") is not None
            and r["back_at"] >= since
            and r["time"] >= since - SAME_DEATH
        ]
        full = [r for r in after if isinstance(size, int) and r.get("world_size", 0) >= size]
        chosen = (full or after or [None])[0]
        if chosen is None:
            return None, None
        seconds = round(chosen["back_at"] - since, 3)
        return seconds, round(seconds * size, 3) if isinstance(size, int) else None

    incidents: list[dict[str, Any]] = []
    #: (rank, time, how it ended, its incident) of each failed worker exit
    exits: list[tuple[Any, float, str, dict[str, Any]]] = []
    for e in records:
        if e.get("type") != "event":
            continue
        name = e.get("event")
        if name == "worker_exit":
            failed = e.get("returncode") != 0 or e.get("signal") is not None
            if e.get("expected") or not failed:
                continue
            how = (
                f"killed by {_signal_name(e['signal'])}"
                if e.get("signal") is not None
                else f"exited with code {e.get('returncode')}"
            )
            what = f"{_on(e.get('rank'), e.get('node'))} {how}"
            ranks = [e.get("rank")]
        elif name == "node_relaunch":
            what = f"node {e.get('node')} lost"
            if e.get("detail"):
                what += f" (relaunched: {e['detail']})"
            ranks = []
        else:
            continue
        seconds, lost = recovery(e["time"], e.get("target"))
        incident = {
            "time": e["time"],
            "node": e.get("node"),
            "ranks": ranks,
            "what": what,
            "recovery": seconds,
            "work_lost": lost,
        }
        incidents.append(incident)
        if name == "worker_exit":
            exits.append((e.get("rank"), e["time"], how, incident))
    for r in restarts:
        for fault in r.get("faults") or []:
            if fault.get("cause") == "connection":
                continue  # a consequence of another rank's fault, named there
            rank = fault.get("initial_rank")
            same = [
                (how, i) for x, t, how, i in exits if rank == x and abs(t - r["time"]) <= SAME_DEATH
            ]
            if same:
                # the same death; the restart may know why (its monitor ended it)
                if str(fault.get("detail") or "").startswith("stuck in native code"):
                    how, incident = same[0]
                    incident["what"] = f"{describe_fault(fault, incident['node'])} ({how})"
                    incident["detail"] = fault.get("detail")
                continue
            node = node_of.get(rank)
            seconds, lost = recovery(r["time"], r.get("previous_world_size"))
            incidents.append(
                {
                    "time": r["time"],
                    "node": node,
                    "ranks": [rank],
                    "what": describe_fault(fault, node),
                    "detail": fault.get("detail"),
                    "recovery": seconds,
                    "work_lost": lost,
                }
            )
    incidents.sort(key=lambda i: i["time"])
    return incidents


def format_incidents(incidents: Sequence[dict[str, Any]], t0: float | None = None) -> str:
    """The report's "incidents" section: one line each, times relative to ``t0``."""
    if not incidents:
        return "incidents: none"
    start = t0 if t0 is not None else incidents[0]["time"]
    lines = [f"incidents ({len(incidents)}):"]
    for i in incidents:
        rec = "never" if i["recovery"] is None else f"{i['recovery']:.2f} s"
        lost = "" if i["work_lost"] is None else f", work lost {i['work_lost']:.1f} rank-s"
        lines.append(f"  +{i['time'] - start:8.2f} s  {i['what']}; back after {rec}{lost}")
    return "\n".join(lines)
