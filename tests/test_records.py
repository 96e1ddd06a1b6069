"""Restart records, controller events and the report (issue 14): the parts without processes."""

from __future__ import annotations

import json
import sys

import pytest

from inprocess import records as R
from inprocess import report


def test_read_jsonl_skips_a_torn_line_and_append_ends_it(tmp_path):
    path = tmp_path / "events.jsonl"
    R.append_jsonl(path, {"type": "event", "n": 1}, durable=True)
    with open(path, "ab") as f:
        f.write(b'{"type": "event", "n": 2, "tor')  # a writer died mid-line
    assert [r["n"] for r in R.read_jsonl(path)] == [1]
    R.end_torn_line(path)
    R.append_jsonl(path, {"type": "event", "n": 3})
    assert [r["n"] for r in R.read_jsonl(path)] == [1, 3]
    assert R.read_jsonl(tmp_path / "missing.jsonl") == []


def test_event_has_every_field_and_rejects_unknown_ones():
    e = R.event("worker_exit", 12.5, rank=3, signal=9)
    assert e["type"] == "event" and e["event"] == "worker_exit" and e["time"] == 12.5
    assert set(R.EVENT_FIELDS) <= set(e) and e["node"] is None and e["signal"] == 9
    with pytest.raises(ValueError, match="event must be one of"):
        R.event("exploded")
    with pytest.raises(ValueError, match="unknown event fields"):
        R.event("job_end", colour="red")


def test_records_path_argument_wins_over_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(R.RECORDS_ENV, str(tmp_path / "env.jsonl"))
    assert R.records_path(tmp_path / "arg.jsonl") == str(tmp_path / "arg.jsonl")
    assert R.records_path(None) == str(tmp_path / "env.jsonl")
    monkeypatch.delenv(R.RECORDS_ENV)
    assert R.records_path(None) is None


@pytest.mark.parametrize(
    ("reason", "cause"),
    [
        ("RuntimeError: injected fault", "exception"),
        ("terminated: process died", "signal"),
        # the job controller's report of the same death (whichever comes first stands)
        ("terminated: its process was killed by SIGKILL (seen by the job controller)", "signal"),
        ("terminated: its process exited with code 3 (seen by the job controller)", "signal"),
        ("soft timeout: no progress for 2.01s", "hang"),
        ("terminated: killed by the hard timeout (9s without progress)", "hang"),
        ("completion timeout (60s)", "hang"),
        ("terminated: no heartbeat for 3.20s", "heartbeat"),
        ("terminated: health check failed: HealthCheckError('x')", "unhealthy"),
        ("terminated: RestartAbort: iteration=3", "terminated"),
        ("terminated: finalize failed: RuntimeError()", "terminated"),
        ("RuntimeError: [pair.cc:537] Read error: Connection reset by peer", "connection"),
    ],
)
def test_causes(reason, cause):
    assert R.classify(reason) == cause


def test_faults_root_cause_first_derived_errors_dropped_joins_apart():
    members = ["0/0.a", "1/0.b", "2/0.c"]
    entries = [
        {"rank": "0/0.a", "reason": "RuntimeError: Connection closed by peer", "time": 9.0},
        {"rank": "2/0.c", "reason": "terminated: process died", "time": 10.0},
        {"rank": "2/1.d", "reason": "join request", "time": 11.0},
        {"rank": "2/0.c", "reason": "RuntimeError: later", "time": 12.0},
    ]
    faults, joined, fault_time = R.faults_of(entries, members)
    assert [(f["rank"], f["initial_rank"], f["cause"]) for f in faults] == [(2, 2, "signal")]
    assert joined == [2] and fault_time == 10.0
    # only derived errors: they are what is known
    faults, _, _ = R.faults_of(entries[:1], members)
    assert faults[0]["cause"] == "connection" and faults[0]["rank"] == 0


# --------------------------------------------------------------------------- synthetic jobs

CAUSES = ["exception", "signal", "hang", "heartbeat"]


@pytest.fixture(scope="module")
def matplotlib_warm():
    """matplotlib keeps the font files it has loaded open for the process's life: load
    them before the test's leak check starts counting fds."""
    pytest.importorskip("matplotlib")
    import io

    report.plot(sorted(synthetic(2, 1), key=lambda r: r["time"]), io.BytesIO(), "warm")


def synthetic(ranks: int, restarts: int, per_node: int = 8, t0: float = 1000.0):
    """A job of ``ranks`` ranks: 1 s start-up, iterations of 10 s of training, restart
    ``i`` with latency ``0.1 * (i + 1)`` s caused by rank ``i % ranks``, a worker
    relaunch after each signal, 0.5 s to end."""
    out = [R.event("job_start", t0, target=ranks, world_size=ranks, generation=0)]
    t = t0 + 1.0
    for i in range(restarts + 1):
        for r in range(ranks):
            out.append(
                {
                    "type": "iteration",
                    "time": t,
                    "state": "start",
                    "iteration": i,
                    "rank": r,
                    "world_size": ranks,
                    "active": True,
                    "job": "j",
                    "call": 0,
                    "initial_rank": r,
                    "pid": 100 + r,
                    "node": r // per_node,
                }
            )
        end = t + 10.0
        if i == restarts:
            for r in range(ranks):
                out.append(
                    {
                        "type": "iteration",
                        "time": end,
                        "state": "end",
                        "iteration": i,
                        "outcome": "completed",
                        "rank": r,
                        "job": "j",
                        "call": 0,
                        "initial_rank": r,
                        "pid": 100 + r,
                        "node": r // per_node,
                    }
                )
            out.append({"type": "completed", "time": end, "iteration": i, "world_size": ranks})
            out.append(R.event("job_end", end + 0.5, returncode=0, detail="completed"))
            break
        victim, cause, latency = i % ranks, CAUSES[i % len(CAUSES)], 0.1 * (i + 1)
        for r in range(ranks):
            if not (r == victim and cause == "signal"):  # a killed rank writes no end
                out.append(
                    {
                        "type": "iteration",
                        "time": end + 0.01,
                        "state": "end",
                        "iteration": i,
                        "outcome": "fault",
                        "rank": r,
                        "job": "j",
                        "call": 0,
                        "initial_rank": r,
                        "pid": 100 + r,
                        "node": r // per_node,
                    }
                )
        out.append(
            {
                "type": "restart",
                "time": end,
                "iteration": i,
                "world_size": ranks,
                "faults": [
                    {"rank": victim, "initial_rank": victim, "cause": cause, "detail": cause}
                ],
                "terminated": [victim] if cause == "signal" else [],
                "activated": [],
                "phases": {"detect": 0.01, "abort": 0.02, "termination_barrier": 0.03},
                "latency": latency,
                "back_at": end + latency,
                "job": "j",
                "call": 0,
            }
        )
        if cause == "signal":
            out.append(
                R.event(
                    "worker_exit",
                    end,
                    rank=victim,
                    node=victim // per_node,
                    signal=9,
                    expected=False,
                )
            )
            out.append(R.event("worker_relaunch", end + 0.05, rank=victim, node=victim // per_node))
        t = end + latency
    return out


def test_summary_numbers_match_the_records():
    recs = sorted(synthetic(ranks=16, restarts=4), key=lambda r: r["time"])
    s = report.summarize(recs)
    latencies = [0.1, 0.2, 0.3, 0.4]
    wall = 1.0 + 5 * 10.0 + sum(latencies) + 0.5
    assert s["restarts"] == 4
    assert s["faults_by_kind"] == {"exception": 1, "signal": 1, "hang": 1, "heartbeat": 1}
    assert s["wall_time"] == pytest.approx(wall)
    assert s["training_time"] == pytest.approx(50.0)
    assert s["goodput"] == pytest.approx(50.0 / wall)
    assert s["time_lost"] == pytest.approx(wall - 50.0)
    assert s["in_recovery"] == pytest.approx(sum(latencies))
    assert s["latency"]["median"] == pytest.approx(0.25)
    assert s["latency"]["p90"] == pytest.approx(0.37)
    assert s["latency"]["max"] == pytest.approx(0.4)
    assert s["phases_median"]["abort"] == pytest.approx(0.02)
    assert s["worker_exits"] == 1 and s["worker_relaunches"] == 1
    # ranks 0..3 faulted once each, all on node 0 (8 ranks per node)
    assert s["per_node"] == {"0": {"in_process": 4, "worker_exits": 1}}
    assert s["result"] == {"exit_code": 0, "detail": "completed"}
    text = report.format_summary(s)
    for expected in ("goodput", "median 250 ms, p90 370 ms, max 400 ms", "signal 1"):
        assert expected in text


def test_admission_restarts_are_counted_apart_from_faults():
    """The restart that lets a relaunched worker in has no fault of its own."""
    recs = synthetic(ranks=4, restarts=2)
    last = max(r["time"] for r in recs if r["type"] == "restart")
    recs.append(
        {
            "type": "restart",
            "time": last + 0.5,
            "iteration": 9,
            "world_size": 4,
            "faults": [],
            "terminated": [],
            "activated": [],
            "joined": [0],
            "phases": {},
            "latency": 0.05,
            "job": "j",
            "call": 0,
        }
    )
    s = report.summarize(sorted(recs, key=lambda r: r["time"]))
    assert s["restarts"] == 3 and s["admissions"] == 1
    assert sum(s["faults_by_kind"].values()) == 2
    assert "3 (admitting a relaunched worker: 1)" in report.format_summary(s)


def test_report_command_on_a_state_dir_prints_and_plots(tmp_path, capsys, matplotlib_warm):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    for r in synthetic(ranks=4, restarts=3):
        name = R.EVENTS_FILE if r["type"] == "event" else R.RESTARTS_FILE
        R.append_jsonl(state_dir / name, r)
    png = tmp_path / "timeline.png"
    from inprocess.failover.cli import main as run_main

    assert run_main(["report", str(state_dir), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "in-process restarts" in out and f"timeline: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --json: the same numbers, machine-readable; a records file alone works too
    assert report.main([str(state_dir / R.RESTARTS_FILE), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["restarts"] == 3


def test_timeline_of_64_ranks(tmp_path, matplotlib_warm):
    recs = sorted(synthetic(ranks=64, restarts=6), key=lambda r: r["time"])
    recs.append(R.event("node_relaunch", recs[-1]["time"] - 20, node=2, slot=9))
    recs.append(R.event("cold_restart", recs[-1]["time"] - 15, generation=1))
    recs.append(R.event("controller_recovery", recs[-1]["time"] - 10))
    recs.sort(key=lambda r: r["time"])
    png = tmp_path / "t64.png"
    report.plot(recs, png, report.title_of(report.summarize(recs)))
    assert png.stat().st_size > 10_000


def test_without_matplotlib_the_command_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    path = tmp_path / "restarts.jsonl"
    for r in synthetic(ranks=2, restarts=1):
        R.append_jsonl(path, r)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert report.main([str(path), "--plot", str(tmp_path / "x.png")]) == 3
    assert "pip install 'inprocess[plot]'" in capsys.readouterr().err


def test_report_of_nothing_is_a_clear_error(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 2
    assert "no such state directory" in capsys.readouterr().err
    assert report.main([str(tmp_path)]) == 2
    assert "not a state directory" in capsys.readouterr().err


def test_wrapper_records_argument(tmp_path, monkeypatch):
    import inprocess

    monkeypatch.chdir(tmp_path)
    assert inprocess.Wrapper(records="r.jsonl").records == str(tmp_path / "r.jsonl")
    assert inprocess.Wrapper().records is None
    with pytest.raises(TypeError, match=r"Wrapper\(records=...\) must be a path or None"):
        inprocess.Wrapper(records=3)


@pytest.mark.parametrize(
    ("reason", "limit"),
    [
        ("worker 1 failed 4 times, more than max_restarts=3 (last: ...)", True),
        ("node 0 failed 4 times, more than per_node_max_failures=3, and all ...", True),
        ("x; no cold restart left: job_max_restarts=3 used", True),
        ("node 1 lost; all node_max_relaunches=1 node relaunches are used", True),
        ("completed: all 4 workers succeeded", False),
        ("stopped by SIGTERM", False),
    ],
)
def test_stop_reasons_that_are_limits(reason, limit):
    from inprocess.failover.controller import _LIMIT

    assert bool(_LIMIT.search(reason)) is limit


def test_restart_that_admits_a_joiner_is_not_a_fault():
    """The survivors' broken collectives of an admission restart are not faults."""
    derived = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    entries = [
        {"rank": "1/1.b", "reason": R._JOIN_REQUEST, "time": 1.0},
        {"rank": "0/0.a", "reason": derived, "time": 1.1},
    ]
    faults, joined, fault_time = R.faults_of(entries, ["0/0.a", "2/0.c"])
    assert (faults, joined, fault_time) == ([], [1], None)
    # without a join request, a derived error is still reported (nothing better known)
    faults, joined, _ = R.faults_of(entries[1:], ["0/0.a", "2/0.c"])
    assert [f["cause"] for f in faults] == ["connection"] and joined == []


def test_report_puts_a_rejoin_together_from_join_records_and_controller_events():
    """A ``join`` record with the controller's exit and relaunch of its rank and the
    restart that admitted it: each step of the rejoin, and its row in the summary. A
    relaunch event written after the script began counts as a step of 0."""
    t = 1000.0
    event = {"type": "event", "rank": 2}
    records = [
        {**event, "time": t, "event": "worker_exit", "signal": 9},
        {**event, "time": t + 0.5, "event": "worker_relaunch"},  # recorded late
        {
            "type": "join",
            "time": t + 0.9,
            "iteration": 3,
            "initial_rank": 2,
            "process_start": t - 5,
            "call_start": t + 0.3,
            "monitor_ready": None,
            "join_request": t + 0.6,
            "admitted": t + 0.9,
            "monitor": "spawned",
        },
        {"type": "restart", "time": t + 0.8, "iteration": 3, "joined": [2], "back_at": t + 1.0},
    ]
    assert all(report.malformed(r) is None for r in records)
    (steps,) = report.rejoins(records)
    expected = {
        "relaunched": 0.3,
        "call_started": 0.0,
        "join_requested": 0.3,
        "admitted": 0.3,
        "training": 0.1,
        "total": 1.0,
    }
    assert steps == pytest.approx(expected)
    text = report.format_summary(report.summarize(records))
    assert "rejoins" in text and "lost to training again median 1.00 s" in text, text
