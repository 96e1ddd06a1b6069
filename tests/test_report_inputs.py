"""``inprocess-run report`` on what it cannot trust: records with fields of any type,
lines nested too deeply, paths that are not what they should be, and text from workers
carrying terminal escape sequences. Never a traceback: a malformed record is skipped
and counted, a bad path ends in one line and a non-zero exit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from inprocess import records as R
from inprocess import report

#: one record of every type the report reads, each field set
GOOD: list[dict] = [
    R.event("job_start", 1000.0, target=2, world_size=2, generation=0),
    {"type": "iteration", "time": 1001.0, "state": "start", "iteration": 0, "rank": 0,
     "world_size": 2, "active": True, "job": "j", "call": 0, "initial_rank": 0, "pid": 10,
     "node": 0},
    {"type": "iteration", "time": 1001.0, "state": "start", "iteration": 0, "rank": 1,
     "world_size": 2, "active": True, "job": "j", "call": 0, "initial_rank": 1, "pid": 11,
     "node": 0},
    {"type": "iteration", "time": 1011.0, "state": "end", "iteration": 0, "outcome": "fault",
     "rank": 0, "job": "j", "call": 0, "initial_rank": 0, "pid": 10, "node": 0},
    {"type": "restarter", "time": 1011.1, "state": "handling", "stage": "starting",
     "iteration": 0, "rank": 0},
    {"type": "restart", "time": 1011.0, "iteration": 0, "world_size": 2,
     "active_world_size": 2, "previous_world_size": 2,
     "faults": [{"rank": 1, "initial_rank": 1, "cause": "signal", "detail": "process died"}],
     "terminated": [1], "activated": [], "joined": [], "phases": {"detect": 0.1, "abort": 0.2},
     "latency": 0.5, "back_at": 1011.5, "job": "j", "call": 0, "node": 0},
    R.event("worker_exit", 1011.0, rank=1, node=0, signal=9, expected=False, pid=11),
    R.event("worker_relaunch", 1011.2, rank=1, node=0),
    R.event("node_relaunch", 1011.3, node=0, slot=1, detail="node 0 moved"),
    R.event("cold_restart", 1011.4, generation=1, target=2),
    R.event("limit", 1011.45, detail="max restarts"),
    R.event("state_save_failed", 1011.46, detail="state.json: ENOSPC"),
    {"type": "restore", "time": 1011.6, "iteration": 1, "step": 5, "redone_steps": 2,
     "seconds": 0.1, "bytes": 1000, "sources": {"memory": 1, "peer": 1}, "step_seconds": 0.2,
     "verified": False, "mismatch": [{"rank": 1, "key": "w"}], "world_size": 2},
    {"type": "iteration", "time": 1011.5, "state": "start", "iteration": 1, "rank": 0,
     "world_size": 2, "active": True, "job": "j", "call": 0, "initial_rank": 0, "pid": 10,
     "node": 0},
    {"type": "completed", "time": 1020.0, "iteration": 1, "world_size": 2, "job": "j",
     "call": 0},
    R.event("job_end", 1020.5, returncode=0, detail="completed"),
]  # fmt: skip

#: values of the wrong type, or out of range, for any field
CONFUSED = (5, -1, 10**400, 1e308, -1e308, "x", "", None, True, [], [5], {}, {"a": [1]}, 2.5)


def _write(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _variants():
    """Each record of GOOD with one field (or a fault's, a mismatch's field) replaced."""
    for i, record in enumerate(GOOD):
        for field in record:
            for value in CONFUSED:
                bad = copy.deepcopy(GOOD)
                bad[i][field] = value
                yield f"{record.get('type')}[{i}].{field}={value!r:.20}", bad
        for nested in ("faults", "mismatch"):
            if nested in record:
                for field in record[nested][0]:
                    for value in CONFUSED:
                        bad = copy.deepcopy(GOOD)
                        bad[i][nested][0][field] = value
                        yield f"{record['type']}[{i}].{nested}[0].{field}={value!r:.20}", bad
                for value in CONFUSED:
                    bad = copy.deepcopy(GOOD)
                    bad[i][nested] = [value]
                    yield f"{record['type']}[{i}].{nested}=[{value!r:.20}]", bad


@pytest.mark.timeout(300)
def test_type_confused_records_are_skipped_never_a_traceback(tmp_path, capsys) -> None:
    """Every field of every record type, set to each of a dozen wrong values: the report
    ends with 0 (a good record set) or 1 (none left), prints its summary in both text and
    JSON, and says how many records it skipped."""
    path = tmp_path / "restarts.jsonl"
    _write(path, GOOD)
    assert report.main([str(path)]) == 0
    assert "skipped" not in capsys.readouterr().err
    failures = []
    for n, (name, records) in enumerate(_variants()):
        _write(path, records)
        # (the JSON output is the same summary: checked for a part of the variants)
        for flags in ([], ["--json"]) if n % 5 == 0 else ([],):
            try:
                code = report.main([str(path), *flags])
            except Exception as ex:  # (what the test looks for)
                failures.append(f"{name} {flags}: {type(ex).__name__}: {ex}"[:200])
                continue
            out, err = capsys.readouterr()
            if code not in (0, 1) or (code == 0 and not out):
                failures.append(f"{name} {flags}: exit {code}: {err[:200]}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


@pytest.mark.timeout(60)
def test_malformed_records_are_counted(tmp_path, capsys) -> None:
    path = tmp_path / "restarts.jsonl"
    bad = copy.deepcopy(GOOD)
    bad[5]["faults"] = 5
    bad[6]["rank"] = {"a": 1}
    _write(path, bad)
    with open(path, "a") as f:
        f.write("[" * 100_000 + "\n")  # nested beyond json's recursion limit: skipped
        f.write('{"type": "restart", "time": 1, "faults": ' + "[" * 5000 + "\n")
    assert report.main([str(path)]) == 0
    out, err = capsys.readouterr()
    assert "skipped 2 malformed record(s)" in err and "'restart' record: bad faults '5'" in err
    assert "wall time" in out
    assert R.read_jsonl(path)[-1]["event"] == "job_end"  # the deep lines: skipped


@pytest.mark.timeout(60)
def test_bad_paths_end_in_one_line(tmp_path, capsys) -> None:
    state = tmp_path / "state"
    (state / R.RESTARTS_FILE).mkdir(parents=True)
    _write(state / R.EVENTS_FILE, GOOD[:1])
    cases = [
        ([str(state)], "restarts.jsonl: cannot read it (Is a directory)"),
        ([str(tmp_path / "missing")], "no such state directory or records file"),
        ([str(tmp_path / "missing" / "restarts.jsonl")], "no such state directory"),
    ]
    for argv, says in cases:
        assert report.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def matplotlib_fonts():
    """matplotlib keeps the font files it loaded open for the process's life: load them
    before the test's leak check (a function fixture: after this one) takes its count."""
    pytest.importorskip("matplotlib")
    import io

    report.plot(sorted(GOOD, key=lambda r: r["time"]), io.BytesIO(), "warm")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["/dev/full", "missing-dir/timeline.png"])
def test_a_plot_that_cannot_be_written_is_one_line(
    where, tmp_path, capsys, monkeypatch, matplotlib_fonts
):
    if where == "/dev/full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "restarts.jsonl"
    _write(path, GOOD)
    assert report.main([str(path), "--plot", where]) == 2
    err = capsys.readouterr().err
    assert f"--plot {where}: cannot write it" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(60)
def test_escape_sequences_from_a_worker_are_shown_escaped(tmp_path, capsys) -> None:
    records = copy.deepcopy(GOOD)
    hostile = "RuntimeError: \x1b]0;pwned\x07\x1b[2J\x1b[1A\rgone\x9b2J"
    records[5]["faults"][0] = {"rank": 0, "initial_rank": 0, "cause": "exception",
                               "detail": hostile}  # fmt: skip
    records[10]["detail"] = "max restarts\x1b[31m"
    path = tmp_path / "restarts.jsonl"
    _write(path, records)
    assert report.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\r\x9b"), repr(out)
    assert r"max restarts\x1b[31m" in out, out
    assert r"RuntimeError: \x1b]0;pwned\x07\x1b[2J\x1b[1A\x0dgone\x9b2J" in out, out
