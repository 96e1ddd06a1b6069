"""The report names every incident (issue 21): synthetic records rendered in words."""

from __future__ import annotations

import json

from inprocess import incidents, report
from inprocess.records import event

T0 = 1_700_000_000.0


def _restart(t, faults, joined=(), world=4, previous=4, latency=0.5):
    return {
        "type": "restart",
        "time": t,
        "iteration": 1,
        "world_size": world,
        "previous_world_size": previous,
        "faults": faults,
        "joined": list(joined),
        "latency": latency,
        "back_at": t + latency,
    }


def _records():
    return [
        event("job_start", T0, target=4),
        {"type": "iteration", "time": T0 + 1, "initial_rank": 3, "node": 1},
        # a worker SIGKILLed: the controller's exit event and the Wrapper's restart
        event("worker_exit", T0 + 10, rank=2, node=1, returncode=None, signal=9, target=4),
        _restart(
            T0 + 10.05,
            [{"initial_rank": 2, "cause": "signal", "detail": "process died"}],
            latency=0.4,
            world=3,
        ),
        _restart(T0 + 11, [], joined=[2], latency=0.1),
        # a rank stuck in native code, ended by its monitor process
        _restart(
            T0 + 20,
            [
                {
                    "initial_rank": 3,
                    "cause": "terminated",
                    "detail": "stuck in native code after the abort (in system call pause),"
                    " ended after 2.0s",
                },
                {"initial_rank": 0, "cause": "connection", "detail": "Connection closed by peer"},
            ],
            latency=2.3,
        ),
        # under a launcher: the stuck rank's exit, and the restart that says why
        event("worker_exit", T0 + 25, rank=1, node=0, returncode=None, signal=9, target=4),
        _restart(
            T0 + 25.01,
            [
                {
                    "initial_rank": 1,
                    "cause": "terminated",
                    "detail": "stuck in native code after the abort, ended after 2.1s",
                }
            ],
            latency=0.3,
        ),
        event("node_relaunch", T0 + 30, node=1, slot=2, detail="slot 1 -> 2, workers [2, 3]"),
        _restart(T0 + 31, [], joined=[2, 3], latency=0.2),
        event("job_end", T0 + 40, returncode=0),
    ]


def test_incidents_in_words():
    found = incidents.build(_records())
    whats = [i["what"] for i in found]
    assert whats == [
        "rank 2 on node 1 killed by SIGKILL",  # the restart's "process died" is the same death
        "rank 3 on node 1 stuck in native code, ended after 2.0 s",
        "rank 1 on node 0 stuck in native code, ended after 2.1 s (killed by SIGKILL)",
        "node 1 lost (relaunched: slot 1 -> 2, workers [2, 3])",
    ]
    kill, stuck, _, node = found
    assert kill["time"] == T0 + 10 and kill["node"] == 1 and kill["ranks"] == [2]
    # back at full size once the relaunched rank joined: 1.1 s x 4 ranks
    assert kill["recovery"] == 1.1 and kill["work_lost"] == 4.4
    assert stuck["recovery"] == 2.3 and stuck["work_lost"] == 9.2
    assert node["recovery"] == 1.2


def test_report_prints_incidents_and_json_has_them(tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert report.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "incidents (4):" in text
    assert "+   10.00 s  rank 2 on node 1 killed by SIGKILL; back after 1.10 s" in text
    assert "stuck in native code, ended after 2.0 s" in text and "node 1 lost" in text
    assert "restarts:" in text or "restarts" in text  # the totals stay
    assert report.main([str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [i["what"] for i in data["incidents"]] == [
        i["what"] for i in incidents.build(_records())
    ]
    assert data["restarts"] == 5
