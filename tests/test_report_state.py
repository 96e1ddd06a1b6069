"""The report's training-state figures, from synthetic ``restore`` records."""

from __future__ import annotations

import json

import pytest

from inprocess import records as R
from inprocess import report


def _job(restores: list[dict]) -> list[dict]:
    """One rank trains 0..10 s and 10.5..20 s around a restart at 10 s; ``restores`` added."""
    out: list[dict] = [R.event("job_start", 0.0, target=1)]
    for i, (start, end) in enumerate([(0.0, 10.0), (10.5, 20.0)]):
        common = {"type": "iteration", "iteration": i, "rank": 0, "initial_rank": 0, "pid": 1}
        out.append({**common, "time": start, "state": "start", "job": "j", "call": 0})
        out.append({**common, "time": end, "state": "end", "job": "j", "call": 0})
    out.append(
        {
            "type": "restart",
            "time": 10.0,
            "iteration": 0,
            "faults": [{"rank": 0, "initial_rank": 0, "cause": "exception"}],
            "latency": 0.5,
            "back_at": 10.5,
            "job": "j",
            "call": 0,
        }
    )
    out.append(R.event("job_end", 20.0, returncode=0, detail="completed"))
    return sorted(out + restores, key=lambda r: r["time"])


def _restore(time: float, iteration: int, step: int, redone: int, **fields) -> dict:
    record = {
        "type": "restore",
        "time": time,
        "iteration": iteration,
        "step": step,
        "redone_steps": redone,
        "seconds": 0.0,
        "bytes": 0,
        "sources": {"memory": 0, "peer": 0, "disk": 0, "none": 0},
        "step_seconds": None,
        "verified": step > 0,
        "job": "j",
        "call": 0,
    }
    return {**record, **fields}


def test_without_restore_records_nothing_changes():
    s = report.summarize(_job([]))
    assert s["state"] is None and s["redone_time"] == 0.0
    assert s["training_time"] == pytest.approx(19.5)
    assert "state restores" not in report.format_summary(s)


def test_state_figures_and_redone_steps_counted_as_lost():
    restores = [
        # the first start: nothing to restore, no recovery
        _restore(0.1, 0, 0, 0, sources={"memory": 0, "peer": 0, "disk": 0, "none": 4}),
        # after the fault: 3 ranks from their own memory, 1 (relaunched) from a peer
        _restore(
            10.6,
            1,
            100,
            1,
            seconds=0.25,
            bytes=42_000_000,
            sources={"memory": 3, "peer": 1, "disk": 0, "none": 0},
            step_seconds=0.1,
        ),
        # a cold restart from disk, no step time known: the median of the others (0.1 s)
        _restore(
            15.0,
            2,
            80,
            20,
            seconds=1.5,
            bytes=168_000_000,
            sources={"memory": 0, "peer": 0, "disk": 4, "none": 0},
        ),
    ]
    s = report.summarize(_job(restores))
    state = s["state"]
    assert state["restores"] == 3 and state["recoveries"] == 2
    assert state["sources"] == {"memory": 3, "peer": 1, "disk": 4, "none": 4}
    assert state["bytes"] == 210_000_000
    assert state["restore_seconds"] == {"median": pytest.approx(0.875), "max": 1.5}
    assert state["redone_steps"] == {"total": 21, "per_fault_mean": 10.5, "max": 20}
    assert state["redone_seconds"] == pytest.approx(2.1)
    assert [x["step"] for x in state["per_restore"]] == [0, 100, 80]
    # goodput: the redone steps' time is lost, not training
    assert s["redone_time"] == pytest.approx(2.1)
    assert s["training_time"] == pytest.approx(19.5 - 2.1)
    assert s["goodput"] == pytest.approx((19.5 - 2.1) / 20.0)
    assert s["time_lost"] == pytest.approx(20.0 - 19.5 + 2.1)
    text = report.format_summary(s)
    for expected in (
        "redone steps: 2.10 s",
        "state restores",
        "memory 3, peer 1, disk 4, none 4",
        "210.0 MB",
        "median 875 ms, max 1.50 s",
        "21 (per restore: mean 10.50, max 20; 2.10 s lost)",
    ):
        assert expected in text, text
    # one line per restore
    assert "42.0 MB  memory 3, peer 1" in text


def test_mismatch_is_shown(tmp_path, capsys):
    bad = _restore(
        10.6,
        1,
        7,
        0,
        verified=False,
        sources={"memory": 2, "peer": 0, "disk": 0, "none": 0},
        mismatch=[{"rank": 1, "key": "model"}],
    )
    path = tmp_path / R.RESTARTS_FILE
    for r in _job([bad]):
        R.append_jsonl(path, r)
    assert report.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "checksum mismatches" in out and "MISMATCH rank 1 'model'" in out
    assert report.main([str(path), "--json"]) == 0
    state = json.loads(capsys.readouterr().out)["state"]
    assert state["mismatches"] == 1 and state["per_restore"][0]["mismatch"][0]["rank"] == 1
