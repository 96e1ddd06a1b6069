"""restore/commit across real rank processes (gloo, CPU): what a fault costs (issue 20).

Every job trains :mod:`snapshot_model` (exact gradient sums), so a run whose
faults were each restored correctly ends bitwise equal to the fault-free
:func:`snapshot_model.reference`, whatever the world size did meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from launcher import WORKERS, run_job
from test_restart import FAST

from inprocess.failover.supervisor import job_processes
from inprocess.records import read_jsonl

sys.path.insert(0, str(WORKERS))
import snapshot_model as sm

pytestmark = pytest.mark.slow

#: the fields of a restore record (the records file and CallWrapper.last_restore)
RESTORE_FIELDS = {
    "type", "time", "iteration", "step", "redone_steps", "seconds", "bytes", "sources",
    "step_seconds", "verified",
}  # fmt: skip


def spec(tmp_path, **kw):
    s = {"wrapper": dict(FAST), "records": str(tmp_path / "records.jsonl")}
    s.update(kw)
    return s


def restores(tmp_path):
    """The restore records of the job, one per restore (by the iteration's rank 0)."""
    out = [r for r in read_jsonl(tmp_path / "records.jsonl") if r["type"] == "restore"]
    for r in out:
        assert RESTORE_FIELDS <= set(r), r
        assert set(r["sources"]) == {"memory", "peer", "disk", "none"}
        assert 0 <= r["redone_steps"] <= 1, r
    by_iteration = {r["iteration"]: r for r in out}
    assert len(by_iteration) == len(out), "one record per restore"
    return by_iteration


def ran(result, rank):
    return {r["iteration"]: r for r in result.report(rank)["ran"]}


def check_final(result, survivors, steps, local=None):
    """Every surviving rank ends at the fault-free run's parameters, bit for bit."""
    expected = sm.reference(steps)
    for rank in survivors:
        report = result.report(rank)
        assert result.ranks[rank].returncode == 0, result.describe()
        returned = report["returned"]
        if returned is None:
            continue  # a spare that stayed one
        assert returned["params"] == expected, f"rank {rank}"
        want = (local or (lambda r: 1))(returned["rank"]) * steps * (steps + 1) / 2
        assert returned["local"] == [want] * 3, (rank, returned)
        # nothing of the call's snapshots outlives it
        assert report["released"] == {"buffers": 0, "writer_threads": []}
    assert not result.leftovers, result.leftovers


# Iteration by iteration, on 4 active ranks and a spare (the world size never changes):
FAULTS = [
    {"iteration": 0, "rank": 1, "step": 2, "kind": "raise"},
    {"iteration": 1, "rank": 2, "step": 4, "kind": "skew"},  # rank 2 one step behind
    {"iteration": 2, "rank": 3, "step": 6, "kind": "hang"},
    {"iteration": 3, "rank": 0, "step": 8, "kind": "corrupt"},  # caught at iteration 4
    {"iteration": 5, "rank": 1, "step": 10, "kind": "torn"},
    {"iteration": 6, "rank": 2, "step": 12, "kind": "kill"},  # the spare takes over
]


@pytest.mark.timeout(420)
def test_each_fault_costs_at_most_one_step_and_the_end_is_bitwise_a_fault_free_runs(tmp_path):
    wrapper = dict(FAST, soft_timeout=3)
    result = run_job(
        "snapshot_train.py",
        5,
        tmp_path,
        spec(tmp_path, steps=16, max_active=4, faults=FAULTS, wrapper=wrapper),
        timeout=360,
    )
    assert result.ranks[2].returncode == -signal.SIGKILL, result.describe()
    check_final(result, [0, 1, 3, 4], 16)
    records = restores(tmp_path)
    assert sorted(records) == [0, 1, 2, 3, 4, 5, 6, 7], records
    assert records[0]["step"] == 0 and records[0]["sources"]["none"] == 4
    # an exception: every rank from its own memory, at the step of the fault
    assert records[1]["step"] == 2 and records[1]["sources"]["memory"] == 4
    # ranks one step apart: all agree on the newer step; the one behind gets it from a peer
    assert records[2]["step"] == 5 and records[2]["sources"] == {
        "memory": 3, "peer": 1, "disk": 0, "none": 0
    }  # fmt: skip
    assert {ran(result, r)[2]["from"] for r in (0, 1, 3)} == {5}
    # a hang (the soft timeout): own memory
    assert records[3]["step"] == 6 and records[3]["sources"]["memory"] == 4
    # a corrupted snapshot is caught by the checksums: a fault naming the rank and the key
    assert records[4]["verified"] is False
    assert records[4]["mismatch"] == [{"rank": 0, "key": "model"}]
    assert 4 not in ran(result, 0)  # never trained on
    assert records[5]["step"] == 8 and records[5]["sources"]["peer"] == 1  # rank 0 healed
    assert records[5]["verified"] is True
    # a commit torn mid-copy on rank 1: never restored; the step comes from a peer
    assert records[6]["step"] == 11 and records[6]["sources"]["peer"] == 1
    # a SIGKILL: the activated spare (never active before) heals from a peer
    assert records[7]["step"] == 12 and records[7]["sources"]["peer"] == 1
    assert ran(result, 4) == {7: {**ran(result, 4)[7], "from": 12, "world": 4}}
    # what each fault cost: at most the one step it interrupted
    for rank in (0, 1, 3):
        begun = sum(r["begun"] for r in result.report(rank)["ran"])
        assert begun - 16 <= len(FAULTS), result.report(rank)["ran"]
    assert all(r["redone_steps"] == 0 for r in records.values())
    assert all(r["seconds"] >= 0 and r["bytes"] >= 0 for r in records.values())


@pytest.mark.timeout(420)
def test_sharded_state_agrees_on_a_step_and_heals_a_lost_rank_from_its_buddy(tmp_path):
    faults = [
        {"iteration": 0, "rank": 1, "step": 3, "kind": "skew"},
        {"iteration": 1, "rank": 2, "step": 6, "kind": "kill"},
    ]
    result = run_job(
        "snapshot_train.py",
        5,
        tmp_path,
        spec(tmp_path, steps=10, max_active=4, replicated=False, faults=faults),
        timeout=360,
    )
    # each rank's own state (its shard) is (rank + 1) * the sum of the steps
    check_final(result, [0, 1, 3, 4], 10, local=lambda rank: rank + 1)
    records = restores(tmp_path)
    # rank 1 had not committed step 4: its shard exists only at step 3, so all go back
    # to 3 (the others from their older slot): one step redone
    assert records[1]["step"] == 3 and records[1]["redone_steps"] == 1
    assert records[1]["sources"]["memory"] == 4
    # rank 2 lost: its shard comes from its ring buddy (initial rank 3, now rank 2); the
    # spare, now rank 3, gets shard 3 from that same process
    assert records[2]["step"] == 6 and records[2]["sources"] == {
        "memory": 3, "peer": 1, "disk": 0, "none": 0
    }  # fmt: skip
    assert result.report(3)["returned"]["rank"] == 2 and result.report(4)["returned"]["rank"] == 3


@pytest.mark.timeout(660)
@pytest.mark.parametrize("replicated", [True, False])
def test_a_cold_restart_restores_from_disk_never_from_a_torn_snapshot(tmp_path, replicated):
    snap = tmp_path / "snap"
    local = None if replicated else (lambda rank: rank + 1)
    first = run_job(
        "snapshot_train.py",
        2,
        tmp_path / "first",
        spec(
            tmp_path / "first",
            steps=6,
            snapshot_dir=str(snap),
            persist_every=2,
            replicated=replicated,
        ),
        timeout=300,
    )
    check_final(first, [0, 1], 6, local)
    shards = {"shard-0.done.json"} if replicated else {"shard-0.done.json", "shard-1.done.json"}
    assert {p.name for p in (snap / "step-00000006").glob("*.json")} == shards
    # the call ended with its last due snapshot on disk; at most two steps are kept (a
    # due step may be left out when the disk is behind: the newest one is written next)
    names = {p.name for p in snap.glob("step-*")}
    assert "step-00000006" in names and len(names) <= 2, names
    # a newer snapshot whose write was torn (no completion marker)
    torn = snap / "step-00000007"
    torn.mkdir()
    (torn / "shard-0").mkdir()
    (torn / "shard-0" / ".metadata").write_bytes(b"partial")
    (tmp_path / "second").mkdir()
    second = run_job(
        "snapshot_train.py",
        2,
        tmp_path / "second",
        spec(
            tmp_path / "second",
            steps=10,
            snapshot_dir=str(snap),
            persist_every=2,
            replicated=replicated,
        ),
        timeout=300,
    )
    check_final(second, [0, 1], 10, local)
    record = restores(tmp_path / "second")[0]
    assert record["step"] == 6 and record["sources"]["disk"] == 2 and record["verified"]
    assert record["bytes"] > 0


@pytest.mark.timeout(300)
def test_a_relaunched_worker_heals_from_a_peer(tmp_path):
    """Under inprocess-run: a killed worker's new process joins and gets the state from a peer
    (its standby's: the default, and what keeps this job to one ``import torch`` per role)."""
    state_dir, out = tmp_path / "state", tmp_path / "out"
    out.mkdir()
    job_id = f"test-{os.getpid()}-{time.monotonic_ns()}"
    s = {
        "wrapper": dict(FAST),
        "report_dir": str(out),
        "steps": 14,
        "faults": [{"iteration": 0, "rank": 1, "step": 4, "kind": "kill"}],
        # the survivors wait at step 8 for the relaunched worker
        "hold_below_world": 3,
        "hold_step": 8,
    }
    env = dict(
        os.environ,
        INPROCESS_TEST_SPEC=json.dumps(s),
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
        RES_OPTIONS="timeout:1 attempts:1",
    )
    with open(tmp_path / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inprocess.failover.cli",
                "--nproc-per-node",
                "3",
                "--state-dir",
                str(state_dir),
                "--job-id",
                job_id,
                "--monitor-interval",
                "0.05",
                str(WORKERS / "snapshot_train.py"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(240)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for p in job_processes(job_id):
                with contextlib.suppress(psutil.Error):
                    p.kill()
    output = (tmp_path / "launcher.log").read_text(errors="replace")[-6000:]
    assert code == 0, output
    expected = sm.reference(14)
    reports = {p.name: json.loads(p.read_text()) for p in out.glob("report*.json")}
    assert set(reports) == {"report0.json", "report1.1.json", "report2.json"}, reports
    for report in reports.values():
        assert report["returned"]["params"] == expected
        assert report["returned"]["world"] == 3
    # the new process restored from a peer, at the step the survivors were at
    relaunched = reports["report1.1.json"]
    healed = relaunched["restores"][0]
    assert healed["sources"]["peer"] == 1 and healed["sources"]["memory"] == 2
    assert healed["step"] == 8 and relaunched["ran"][0]["from"] == 8
    restarts = [r for r in read_jsonl(state_dir / "restarts.jsonl") if r["type"] == "restore"]
    assert [r["step"] for r in restarts] == [0, 4, 8], restarts


@pytest.mark.timeout(420)
def test_a_sigkill_that_shrinks_the_world_costs_one_step(tmp_path):
    """No spare: the survivors go on at world size 2 from their own memory (and, the
    gradient sums being exact, still end bitwise equal to the fault-free run)."""
    faults = [{"iteration": 0, "rank": 1, "step": 3, "kind": "kill"}]
    result = run_job(
        "snapshot_train.py", 3, tmp_path, spec(tmp_path, steps=8, faults=faults), timeout=360
    )
    assert result.ranks[1].returncode == -signal.SIGKILL, result.describe()
    check_final(result, [0, 2], 8)
    record = restores(tmp_path)[1]
    assert record["step"] == 3 and record["sources"]["memory"] == 2
    assert record["world_size"] == 2 and record["redone_steps"] == 0
    assert sum(r["begun"] for r in result.report(0)["ran"]) == 9  # the killed step, once more
