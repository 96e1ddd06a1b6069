"""Per-rank state on disk across runs: every shard of a restored step comes from one
run, and a step is restored only at the world size it was committed at.

One scenario of three launches of a two-rank job (``replicated=False``,
``persist_every=5``) on one ``snapshot_dir``, each launch losing a rank right
after the commit of step 30 (its write of that step never lands), then a
one-rank call in this process on the same directory.
"""

from __future__ import annotations

import shutil
import signal
import sys

import pytest
import torch
from launcher import WORKERS, run_job
from test_snapshot_e2e import check_final, restores, spec

import inprocess
from inprocess.exception import RestartAbort
from inprocess.snapshot import persist

sys.path.insert(0, str(WORKERS))
import snapshot_model as sm

# 0.3 s steps: each due write lands before the next is due (the first imports
# torch.distributed.checkpoint, seconds on a loaded machine), else a step kept back
# while the writer is busy is skipped for a newer one and step 25 may miss a shard
SETTINGS = dict(steps=30, persist_every=5, replicated=False, step_sleep=0.3)


def killed_after_commit(rank: int) -> list[dict]:
    """``rank`` is SIGKILLed right after its commit of step 30 (due: its write never lands)."""
    return [{"iteration": 0, "rank": rank, "step": 29, "kind": "kill_after_commit"}]


def markers(snap, step: int) -> set[str]:
    return {p.name for p in (snap / f"step-{step:08d}").glob("*.done.json")}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_step_is_never_assembled_from_two_runs_nor_restored_at_another_world_size(
    tmp_path, single_rank
):
    snap = tmp_path / "snap"
    local = lambda rank: rank + 1  # noqa: E731

    # run 1: rank 1 dies right after its commit of step 30; rank 0 goes on alone
    # (an in-process shrink to one rank), which must not restore half of step 30
    work = tmp_path / "run1"
    first = run_job(
        "snapshot_train.py", 2, work,
        spec(work, snapshot_dir=str(snap), faults=killed_after_commit(1), **SETTINGS),
        timeout=300,
    )  # fmt: skip
    assert first.ranks[1].returncode == -signal.SIGKILL, first.describe()
    report = first.report(0)
    assert report["returned"] is None, report
    assert report["exception"].startswith("SnapshotWorldSizeError"), report["exception"]
    assert "world size 1" in report["exception"] and "2 shards" in report["exception"], report
    assert [r["step"] for r in report["restores"]] == [0], report["restores"]
    # rank 0's shard of step 30 reached the disk (handed to its writer), rank 1's never did
    assert markers(snap, 30) == {"shard-0.done.json"}
    assert markers(snap, 25) == {"shard-0.done.json", "shard-1.done.json"}
    straggler = tmp_path / "run1-step-30"
    shutil.copytree(snap / "step-00000030", straggler)

    # run 2: restores step 25 (30 is not whole), and fences what the restore went back
    # past; rank 0 dies right after its commit of step 30 this time
    work = tmp_path / "run2"
    second = run_job(
        "snapshot_train.py", 2, work,
        spec(work, snapshot_dir=str(snap), faults=killed_after_commit(0), **SETTINGS),
        timeout=300,
    )  # fmt: skip
    assert second.ranks[0].returncode == -signal.SIGKILL, second.describe()
    record = restores(work)[0]
    assert record["step"] == 25 and record["sources"]["disk"] == 2, record
    # run 1's shard 0 of step 30 is gone: only run 2's rank 1 wrote step 30 since
    assert markers(snap, 30) == {"shard-1.done.json"}

    # run 1's shard of step 30 lands late (a writer that outlived the restore):
    # step 30 now has both shards, of two runs: never restored as one state
    shutil.rmtree(snap / "step-00000030" / "shard-0", ignore_errors=True)  # (rank 0's torn write)
    shutil.copytree(straggler / "shard-0", snap / "step-00000030" / "shard-0")
    shutil.copy2(straggler / "shard-0.done.json", snap / "step-00000030")
    assert markers(snap, 30) == {"shard-0.done.json", "shard-1.done.json"}
    work = tmp_path / "run3"
    third = run_job(
        "snapshot_train.py", 2, work, spec(work, snapshot_dir=str(snap), **SETTINGS), timeout=300
    )
    check_final(third, [0, 1], 30, local)
    record = restores(work)[0]
    assert record["step"] == 25 and record["sources"]["disk"] == 2 and record["verified"]
    mixed = {(r["step"], r["shard"]) for r in record["rejected"]}
    assert mixed == {(30, 0), (30, 1)}, record
    assert all("different runs" in r["reason"] for r in record["rejected"]), record
    assert markers(snap, 30) == {"shard-0.done.json", "shard-1.done.json"}

    # one rank on this world-2 directory: a clear error, nothing restored, nothing pruned
    on_disk = {p.name: markers(snap, int(p.name[5:])) for p in snap.glob("step-*")}
    for replicated in (False, True):
        with pytest.raises(RestartAbort) as info:
            one_rank(snap)(replicated)
        assert type(info.value).__name__ == "SnapshotWorldSizeError", repr(info.value)
        text = str(info.value)
        assert "world size 1" in text and "step 30" in text and "2 shards" in text, text
        assert {p.name: markers(snap, int(p.name[5:])) for p in snap.glob("step-*")} == on_disk


def one_rank(snap):
    """A one-rank call of the job's training state on ``snap``: restores, trains nothing."""
    import torch.distributed as dist
    from test_call_lifecycle import fast_wrapper

    from inprocess.initialize import RetryController

    @fast_wrapper(
        snapshot_dir=str(snap), persist_every=5, initialize=RetryController(max_iterations=1)
    )
    def train(replicated: bool, call_wrapper: inprocess.CallWrapper = None):
        dist.init_process_group("gloo")
        try:
            model, opt = sm.build()
            state = {
                "model": model,
                "optim": opt,
                "local": torch.zeros(3, dtype=torch.float64),
                "data": {"next": 0},
                "guard": torch.zeros(4),
            }
            return call_wrapper.restore(state, replicated=replicated)
        finally:
            dist.destroy_process_group()

    return train


@pytest.mark.timeout(60)
def test_the_origin_of_each_step_decides_what_a_restore_may_assemble():
    """The decisions alone: a step whose shards name two lineages is left out (memory
    decides where ranks hold it), and a newer step of another layout raises."""
    from inprocess.snapshot.policy import DISK, MEMORY, Holdings, LayoutMismatch, plan, screen

    def h(origins, newest=None):
        mem = frozenset((sh, st) for k, sh, st, _l, _n in origins if k == MEMORY)
        disk = frozenset((sh, st) for k, sh, st, _l, _n in origins if k == DISK)
        return Holdings(mem, disk, newest, tuple(origins))

    # step 30 on disk: shard 0 of run A, shard 1 of run B; step 25 whole, of run A
    both = [(DISK, 0, 30, "A", 2), (DISK, 1, 30, "B", 2), (DISK, 0, 25, "A", 2)]
    both.append((DISK, 1, 25, "A", 2))
    screened, dropped = screen([h(both), h(both)])
    assert {(r, sh, st) for r, sh, st, _why in dropped} == {
        (r, sh, 30) for r in (0, 1) for sh in (0, 1)
    }
    assert plan(screened, replicated=False).step == 25
    # a rank holds step 30 in memory (lineage B): a disk copy of another lineage is dropped
    warm = [(MEMORY, 0, 30, "B", 2), (MEMORY, 1, 30, "B", 2), (DISK, 0, 30, "A", 2)]
    screened, dropped = screen([h(warm, 30), h([(DISK, 1, 30, "B", 2)])])
    assert [(r, sh, st) for r, sh, st, _why in dropped] == [(0, 0, 30)]
    assert plan(screened, replicated=False).step == 30
    # a world-2 step restored by one rank or by three, or as replicated state: raises
    two = [(DISK, 0, 30, "A", 2), (DISK, 1, 30, "A", 2), (DISK, 0, 25, "A", 1)]
    for world, replicated in ((1, False), (3, False), (2, True)):
        with pytest.raises(LayoutMismatch) as info:
            plan([h(two)] * world, replicated=replicated)
        assert (info.value.step, info.value.found) == (30, [2])
    # the same world size restores it
    assert plan([h(two)] * 2, replicated=False).step == 30
    # origins unknown (markers of an earlier version): planned as before
    assert plan([Holdings(frozenset(), frozenset({(0, 30)}))], replicated=True).step == 30


@pytest.mark.timeout(60)
def test_a_marker_of_a_step_the_restore_went_back_past_never_lands(tmp_path):
    """A write still in flight when a restore went back before its step ends
    without its marker; the new lineage's writes of that step land."""
    from inprocess.snapshot.buffers import HostSnapshot

    snap = HostSnapshot()
    snap.fill(30, 0, {"w": torch.ones(4)})
    writer = persist.Persister(str(tmp_path), 5)
    writer.fence(25, "B")
    writer._write(snap, 2, False, "A")
    assert persist.complete(str(tmp_path)) == set()
    writer._write(snap, 2, False, "B")
    assert persist.complete(str(tmp_path)) == {(0, 30)}
    assert persist.scan(str(tmp_path)).complete[(0, 30)]["lineage"] == "B"
    writer.close()
    snap.release()
