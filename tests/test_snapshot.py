"""Training-state snapshots without processes: the decisions, the buffers, the disk (issue 20)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

import inprocess
from inprocess.snapshot import Snapshots, persist, policy
from inprocess.snapshot.buffers import HostSnapshot, SlotPair
from inprocess.snapshot.policy import DISK, MEMORY, NONE, PEER, Holdings, Source

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
import snapshot_model as sm

pytestmark = pytest.mark.timeout(60)


def H(memory=(), disk=(), newest=None):
    return Holdings(frozenset(memory), frozenset(disk), newest)


# ------------------------------------------------------------------ the decisions


def test_nothing_anywhere_restores_step_zero():
    plan = policy.plan([H(), H()], replicated=True)
    assert plan.step == 0 and plan.sources == (Source(NONE), Source(NONE))
    assert plan.counts() == {MEMORY: 0, PEER: 0, DISK: 0, NONE: 2}


def test_every_rank_restores_its_own_newest_snapshot():
    held = {(0, 4), (0, 5)}
    plan = policy.plan([H(held, newest=5)] * 3, replicated=True)
    assert plan.step == 5 and all(s.kind == MEMORY for s in plan.sources)
    assert policy.redone_steps([H(held, newest=5)] * 3, 5) == 0


def test_replicas_one_step_apart_take_the_newer_step_from_a_peer():
    # rank 1 faulted before committing step 6: a peer has it, nothing is redone
    hs = [
        H({(0, 5), (0, 6)}, newest=6),
        H({(0, 4), (0, 5)}, newest=5),
        H({(0, 5), (0, 6)}, newest=6),
    ]
    plan = policy.plan(hs, replicated=True)
    assert plan.step == 6
    assert plan.sources == (Source(MEMORY), Source(PEER, 0), Source(MEMORY))
    assert plan.transfers() == [(0, 1, 0)]


def test_sharded_ranks_one_step_apart_agree_on_the_older_step():
    # rank 1's shard at step 6 exists nowhere: every rank goes back to 5 (its other slot)
    hs = [
        H({(0, 5), (0, 6), (3, 5), (3, 6)}, newest=6),
        H({(1, 4), (1, 5), (0, 5)}, newest=5),
        H({(2, 5), (2, 6), (1, 5)}, newest=6),
        H({(3, 5), (3, 6), (2, 5), (2, 6)}, newest=6),
    ]
    plan = policy.plan(hs, replicated=False)
    assert plan.step == 5 and all(s.kind == MEMORY for s in plan.sources)
    assert policy.redone_steps(hs, plan.step) == 1


def test_new_processes_heal_from_peers_spread_over_the_holders():
    hs = [H({(0, 9)}, newest=9), H({(0, 9)}, newest=9), H(), H()]
    plan = policy.plan(hs, replicated=True)
    assert plan.step == 9
    assert plan.sources[2] == Source(PEER, 0) and plan.sources[3] == Source(PEER, 1)


def test_a_lost_shard_comes_from_its_ring_buddy():
    # the rank holding shard 1 was lost; ranks shifted: rank 1 now holds shard 2 and
    # the buddy copy of shard 1; a spare (rank 3) holds nothing
    assert policy.buddy_of(1, 4) == 2 and policy.buddy_of(3, 4) == 0
    hs = [
        H({(0, 7), (3, 7)}, newest=7),
        H({(2, 7), (1, 7)}, newest=7),
        H({(3, 7), (2, 7)}, newest=7),
        H(),
    ]
    plan = policy.plan(hs, replicated=False)
    assert plan.step == 7
    assert plan.sources == (Source(MEMORY), Source(MEMORY), Source(MEMORY), Source(PEER, 0))


def test_a_shard_lost_with_its_buddy_falls_back_to_an_older_step_on_disk():
    hs = [H({(0, 7)}, {(0, 4), (1, 4)}), H(set(), {(0, 4), (1, 4)})]
    plan = policy.plan(hs, replicated=False)
    assert plan.step == 4
    assert plan.sources == (Source(DISK), Source(DISK))


def test_memory_and_peers_beat_disk():
    hs = [H({(0, 8)}, {(0, 8)}), H(set(), {(0, 8)})]
    assert policy.plan(hs, replicated=True).sources == (Source(MEMORY), Source(PEER, 0))
    hs = [H({(0, 6)}, {(0, 8)}), H(set(), {(0, 8)})]
    plan = policy.plan(hs, replicated=True)  # the newer step on disk wins
    assert plan.step == 8 and plan.sources == (Source(DISK), Source(DISK))


def test_disagreement_names_the_minority_rank_and_key():
    good = {"model": 1, "optim": 2}
    assert policy.disagreement([good, good, good]) == (0, [])
    bad = {"model": 1, "optim": 3}
    assert policy.disagreement([good, bad, good]) == (0, [(1, "optim")])
    assert policy.disagreement([bad, good, good]) == (1, [(0, "optim")])
    # no majority: the lowest rank is the reference, the other is still reported
    assert policy.disagreement([good, bad]) == (0, [(1, "optim")])


# ------------------------------------------------------------------ the buffers


class Torn(torch.Tensor):
    armed = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.armed and func is torch.Tensor.copy_:
            cls.armed = False
            raise RuntimeError("torn")
        return super().__torch_function__(func, types, args, kwargs or {})


def _state():
    model, opt = sm.build()
    sm.apply(model, opt, sm.local_grads(model, 0, 0, 1))
    return {"model": model, "optim": opt, "data": {"next": 1}, "n": 1}


def test_a_snapshot_torn_mid_copy_is_never_restored():
    state = _state()
    state["z"] = torch.zeros(3).as_subclass(Torn)  # copied after the model
    pair = SlotPair()
    for step in (1, 2):
        pair.writable().fill(step, 0, state)
    assert [s.step for s in pair.held()] == [2, 1]
    Torn.armed = True
    with pytest.raises(RuntimeError, match="torn"):
        pair.writable().fill(3, 0, state)
    assert [s.step for s in pair.held()] == [2]  # step 1's slot was being overwritten
    assert pair.at(3) is None


def test_a_host_copy_has_landed_when_commit_returns():
    """The snapshot is taken inside ``commit``: no copy thread, no optimizer hook, and
    what the training does next cannot reach it."""
    from torch.optim import optimizer

    state = _state()
    model, opt = state["model"], state["optim"]
    snaps = Snapshots()
    snaps.commit(state, 1, 0)
    expected = sm.fingerprint(model)
    assert [s.step for s in snaps.own.slots] == [1, None]
    assert not any(s.in_flight for s in snaps.own.slots)
    assert not optimizer._global_optimizer_pre_hooks
    with torch.no_grad():
        next(model.parameters()).data.add_(1.0)  # moves no version counter
    sm.apply(model, opt, sm.local_grads(model, 1, 0, 1))
    assert snaps.restore(state, True, 1) == 1
    assert sm.fingerprint(model) == expected
    snaps.close()
    assert not any(t.name.startswith("inprocess-snapshot") for t in threading.enumerate())


def test_a_copy_that_fails_raises_from_its_commit_and_is_never_restored(monkeypatch):
    from inprocess.snapshot import buffers

    real, calls = buffers.copy_host, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("injected: copy failed")
        return real(*args)

    monkeypatch.setattr(buffers, "copy_host", failing)
    state = _state()
    snaps = Snapshots()
    snaps.commit(state, 1, 0)
    with pytest.raises(MemoryError, match="copy failed"):
        snaps.commit(state, 2, 0)
    assert [s.step for s in snaps.own.held()] == [1]
    snaps.commit(state, 2, 0)
    assert [s.step for s in snaps.own.held()] == [2, 1]
    snaps.close()


def test_buffers_are_reused_and_restores_do_not_alias_them():
    state = _state()
    snaps = Snapshots()
    snaps.commit(state, 1, 0)
    snaps.commit(state, 2, 0)
    pointers = {s.data.data_ptr() for s in snaps.own.slots}
    model, opt = state["model"], state["optim"]
    before = sm.fingerprint(model)
    sm.apply(model, opt, sm.local_grads(model, 1, 0, 1))
    state["data"]["next"], state["n"] = 9, 9
    assert snaps.restore(state, True, 1) == 2
    assert sm.fingerprint(model) == before and state["data"] == {"next": 1} and state["n"] == 1
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    for step in (3, 4, 5):  # overwrites both slots
        snaps.commit({**state, "n": step}, step, 1)
    assert {s.data.data_ptr() for s in snaps.own.slots} == pointers
    assert all(
        torch.equal(m, opt.state[p]["momentum_buffer"])
        for m, p in zip(momentum, model.parameters(), strict=True)
    )
    record = snaps.last_restore
    assert record["type"] == "restore" and record["step"] == 2 and record["sources"][MEMORY] == 1
    snaps.close()
    assert all(s.data.numel() == 0 for s in snaps.own.slots)
    with pytest.raises(RuntimeError, match="released"):
        snaps.commit(state, 6, 1)


def test_checksums_see_a_flipped_byte_and_ignore_padding():
    state = {"a": torch.arange(3, dtype=torch.int8), "b": torch.ones(5)}
    x, y = HostSnapshot(), HostSnapshot()
    y.data = torch.full((256,), 0xAB, dtype=torch.uint8)  # garbage in the reused buffer
    x.fill(1, 0, state)
    y.fill(1, 0, state)
    assert x.checksums() == y.checksums()
    y.data[x.ranges["b"][0]] ^= 1
    assert x.checksums()["a"] == y.checksums()["a"] and x.checksums()["b"] != y.checksums()["b"]


def test_commit_and_restore_reject_bad_arguments(monkeypatch):
    snaps = Snapshots()
    with pytest.raises(ValueError, match=r"commit\(step=...\) must be an int >= 0, got -1"):
        snaps.commit({}, -1, 0)
    with pytest.raises(TypeError, match="must be a dict"):
        snaps.commit([1], 1, 0)
    with pytest.raises(TypeError, match="str keys"):
        snaps.commit({1: 2}, 1, 0)
    with pytest.raises(TypeError, match=r"replicated=...\) must be a bool"):
        snaps.restore({}, "yes", 0)
    snaps.commit({"a": 1}, 1, 0)
    with pytest.raises(KeyError, match="differ from the state's"):
        snaps.restore({"b": 1}, True, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed initialized"):
        snaps.restore({"a": 1}, True, 1)
    snaps.close()


def test_rng_state_is_restored():
    import random

    rng = inprocess.snapshot.RNGState()
    snaps = Snapshots()
    snaps.commit({"rng": rng}, 1, 0)
    expected = (torch.rand(2), random.random())
    snaps.restore({"rng": rng}, True, 1)
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    snaps.close()


# ------------------------------------------------------------------ the disk


def test_persisted_snapshots_are_complete_or_ignored_and_loadable_without_us(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = _state()
    snaps = Snapshots(str(tmp_path), persist_every=2)
    for step in range(1, 8):
        state["data"]["next"] = step
        snaps.commit(state, step, 0)
        snaps.flush(30)
    snaps.close()
    # the two newest complete steps are kept
    assert persist.complete(str(tmp_path)) == {(0, 4), (0, 6)}
    # a step directory without its marker (a write torn by a crash) is never offered
    os.unlink(persist.marker_path(str(tmp_path), 6, 0))
    assert persist.complete(str(tmp_path)) == {(0, 4)}
    fresh = _state()
    fresh_snaps = Snapshots(str(tmp_path))
    assert fresh_snaps.restore(fresh, True, 0) == 4
    assert fresh["data"]["next"] == 4 and fresh_snaps.last_restore["sources"][DISK] == 1
    fresh_snaps.close()
    # the user's own code loads it with torch.distributed.checkpoint alone
    model, _opt = sm.build()
    target = {"model": model.state_dict()}
    dcp.load(target, checkpoint_id=persist.shard_dir(str(tmp_path), 4, 0), no_dist=True)
    model.load_state_dict(target["model"])
    assert sm.fingerprint(model) == sm.fingerprint(fresh["model"])
    marker = json.loads(Path(persist.marker_path(str(tmp_path), 4, 0)).read_text())
    assert marker["step"] == 4 and set(marker["checksums"]) == {"model", "optim", "data", "n"}


def _on_disk(root: Path, step: int) -> str:
    """The model of ``step`` as written to disk, loaded without us: its fingerprint."""
    import torch.distributed.checkpoint as dcp

    model, _opt = sm.build()
    target = {"model": model.state_dict()}
    dcp.load(target, checkpoint_id=persist.shard_dir(str(root), step, 0), no_dist=True)
    model.load_state_dict(target["model"])
    return sm.fingerprint(model)


def test_a_due_commit_leaves_the_disk_writers_copy_to_its_thread(tmp_path, monkeypatch):
    """persist_every costs the training thread no second copy: the disk writer's
    thread makes its private copy of the snapshot."""
    copied_on: list[str] = []
    real = HostSnapshot.copy_from

    def recording(self, other):
        copied_on.append(threading.current_thread().name)
        return real(self, other)

    monkeypatch.setattr(HostSnapshot, "copy_from", recording)
    state = _state()
    model, opt = state["model"], state["optim"]
    snaps = Snapshots(str(tmp_path), persist_every=1)
    snaps.commit(state, 1, 0)  # due
    expected = sm.fingerprint(model)
    sm.apply(model, opt, sm.local_grads(model, 1, 0, 1))
    snaps.commit(state, 2, 0)  # hands step 1 to the writer
    assert snaps.flush(30)
    assert copied_on == ["inprocess-snapshot-writer"] * 2
    assert persist.complete(str(tmp_path)) == {(0, 1), (0, 2)}
    assert _on_disk(tmp_path, 1) == expected
    assert _on_disk(tmp_path, 2) == sm.fingerprint(model)
    snaps.close()
    assert not any(t.name == "inprocess-snapshot-writer" for t in threading.enumerate())


def test_a_commit_that_finds_its_slot_held_by_the_disk_writer_is_coalesced(tmp_path, monkeypatch):
    """The writer's copy of a slot outlasts two steps: the commit that would
    rewrite that slot is skipped (never waits), the snapshot on disk is the held
    step's, and a due step skipped so is written with the next commit."""
    copying, go_on = threading.Event(), threading.Event()
    real = HostSnapshot.copy_from

    def slow(self, other):
        if threading.current_thread().name == "inprocess-snapshot-writer" and other.step == 2:
            copying.set()
            go_on.wait(30)
        return real(self, other)

    monkeypatch.setattr(HostSnapshot, "copy_from", slow)
    state = _state()
    model, opt = state["model"], state["optim"]
    snaps = Snapshots(str(tmp_path), persist_every=2)
    fingerprints = {}
    for step in (1, 2, 3, 4):
        sm.apply(model, opt, sm.local_grads(model, step, 0, 1))
        snaps.commit(state, step, 0)  # 2: due, landed, handed over at once
        fingerprints[step] = sm.fingerprint(model)
        if step == 2:
            assert copying.wait(10)
    # 3 went to the other slot; 4 (due) would rewrite step 2's: skipped
    assert snaps.disk_coalesced == 1 and snaps.newest == 4
    assert [s.step for s in snaps.own.held()] == [3, 2]
    go_on.set()
    assert snaps.flush(30)  # step 2's copy and write
    sm.apply(model, opt, sm.local_grads(model, 5, 0, 1))
    snaps.commit(state, 5, 0)  # not due, but owed (4 was skipped)
    fingerprints[5] = sm.fingerprint(model)
    assert snaps.flush(30)
    assert [s.step for s in snaps.own.held()] == [5, 3]
    assert persist.complete(str(tmp_path)) == {(0, 2), (0, 5)}
    assert _on_disk(tmp_path, 2) == fingerprints[2]
    assert _on_disk(tmp_path, 5) == fingerprints[5]
    snaps.close()


def test_while_the_disk_is_behind_nothing_is_held_and_the_newest_snapshot_is_written(
    tmp_path, monkeypatch
):
    """A write slower than many steps: the due snapshots meanwhile are kept back
    unheld (no commit skipped), each replaced by the next commit's, and the
    newest is written once the writer is free (here: at the call's end)."""
    writing, go_on = threading.Event(), threading.Event()
    real = persist.Persister._write

    def slow(self, snap, *args):
        writing.set()
        go_on.wait(30)
        return real(self, snap, *args)

    monkeypatch.setattr(persist.Persister, "_write", slow)
    state = _state()
    model, opt = state["model"], state["optim"]
    snaps = Snapshots(str(tmp_path), persist_every=2)
    for step in range(1, 8):
        sm.apply(model, opt, sm.local_grads(model, step, 0, 1))
        snaps.commit(state, step, 0)
        if step == 2:
            assert writing.wait(10)  # the writer copied step 2 and writes it, slowly
        assert not any(s.held for s in snaps.own.slots)
    assert snaps.disk_coalesced == 0 and [s.step for s in snaps.own.held()] == [7, 6]
    assert snaps._persister.skipped == 2  # steps 4 and 6: a newer one came before the disk
    go_on.set()
    snaps.close()
    assert persist.complete(str(tmp_path)) == {(0, 2), (0, 7)}
    assert _on_disk(tmp_path, 7) == sm.fingerprint(model)


def test_a_full_disk_costs_its_writes_never_the_training(tmp_path, monkeypatch, caplog):
    """Each write fails (ENOSPC); the writer logs it, lets go of every slot and
    goes on; once the disk has room again the next due snapshot lands."""
    import errno

    import torch.distributed.checkpoint as dcp

    real, full = dcp.save, [True]

    def save(*args, **kwargs):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", save)
    caplog.set_level(logging.WARNING, "inprocess.snapshot")
    state = _state()
    model, opt = state["model"], state["optim"]
    snaps = Snapshots(str(tmp_path), persist_every=1)
    for step in range(1, 5):
        sm.apply(model, opt, sm.local_grads(model, step, 0, 1))
        snaps.commit(state, step, 0)
        assert snaps.flush(30)
    assert persist.complete(str(tmp_path)) == set()
    assert "No space left on device" in caplog.text
    assert not any(s.held for s in snaps.own.slots) and snaps.disk_coalesced == 0
    full[0] = False
    sm.apply(model, opt, sm.local_grads(model, 5, 0, 1))
    snaps.commit(state, 5, 0)
    snaps.close()
    assert persist.complete(str(tmp_path)) == {(0, 5)}
    assert _on_disk(tmp_path, 5) == sm.fingerprint(model)


def test_a_restart_gets_into_a_wait_for_the_disk_writer():
    """An asynchronous exception (the restart's) ends the wait; the held snapshot
    is left as it was."""
    from inprocess.monitor_thread import async_raise

    class Restart(Exception):
        pass

    slot = HostSnapshot()
    slot.fill(1, 0, {"w": torch.ones(4)})
    slot.hold()
    timer = threading.Timer(0.2, async_raise, (threading.get_ident(), Restart))
    timer.start()
    try:
        with pytest.raises(Restart):
            slot.invalidate()
    finally:
        timer.join()
    assert slot.step == 1 and slot.held
    slot.unhold()
    slot.invalidate()
    assert slot.step is None


# ------------------------------------------------------------------ the Wrapper


def test_wrapper_checks_the_snapshot_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"persist_every=...\) needs Wrapper\(snapshot_dir"):
        inprocess.Wrapper(persist_every=3)
    with pytest.raises(ValueError, match=r"persist_every=...\) must be an int >= 1"):
        inprocess.Wrapper(snapshot_dir=str(tmp_path), persist_every=0)
    with pytest.raises(TypeError, match=r"persist_every=...\) must be an int >= 1"):
        inprocess.Wrapper(snapshot_dir=str(tmp_path), persist_every="2")
    with pytest.raises(TypeError, match=r"snapshot_dir=...\) must be a path or None"):
        inprocess.Wrapper(snapshot_dir=3)
    w = inprocess.Wrapper(snapshot_dir="rel/dir", persist_every=5)
    assert w.snapshot_dir == os.path.abspath("rel/dir") and w.persist_every == 5


@pytest.mark.timeout(120)
def test_restore_commit_in_this_process_leave_nothing_behind(single_rank, tmp_path):
    """An exception restores from memory; the writer thread and buffers go with the call."""
    import torch.distributed as dist
    from test_call_lifecycle import fast_wrapper

    seen = []

    @fast_wrapper(snapshot_dir=str(tmp_path / "snap"), persist_every=2)
    def train(call_wrapper: inprocess.CallWrapper = None):
        dist.init_process_group("gloo")
        model, opt = sm.build()
        state = {"model": model, "optim": opt}
        start = call_wrapper.restore(state)
        seen.append((call_wrapper.iteration, start, dict(call_wrapper.last_restore)))
        for step in range(start, 5):
            if call_wrapper.iteration == 0 and step == 3:
                raise RuntimeError("fault")
            sm.apply(model, opt, sm.local_grads(model, step, 0, 1))
            call_wrapper.commit(state, step + 1)
        dist.destroy_process_group()
        return sm.fingerprint(model), call_wrapper

    before = {t.name for t in threading.enumerate()}
    params, cw = train()
    assert params == sm.reference(5)
    assert [(i, s) for i, s, _ in seen] == [(0, 0), (1, 3)]
    assert seen[1][2]["sources"] == {MEMORY: 1, PEER: 0, DISK: 0, NONE: 0}
    assert not any("snapshot" in t.name for t in threading.enumerate() if t.name not in before)
    assert all(s.data.numel() == 0 for s in cw._snapshots.own.slots)
    # step 4 is written, or step 5 in its place when the writer was still busy with
    # step 2 (its first write imports torch.distributed.checkpoint) when 4 came
    assert persist.complete(str(tmp_path / "snap")) in ({(0, 2), (0, 4)}, {(0, 2), (0, 5)})
    with pytest.raises(RuntimeError, match="only available while the wrapped function runs"):
        inprocess.CallWrapper(inprocess.Wrapper()).commit({}, 1)


def _step_with(idiom: str, state: dict, opt) -> None:
    """One step of +1 on every element of ``state``'s tensor, through ``idiom``."""
    if idiom == "data":
        state["w"].data.add_(1)
    elif idiom == "numpy":
        state["w"].detach().numpy()[:] += 1  # the tensor's memory, behind torch's back
    elif idiom == "no_grad":
        with torch.no_grad():
            state["w"].add_(1)
    else:
        opt.zero_grad()
        state["w"].grad = torch.full_like(state["w"], -1.0)
        opt.step()  # lr 1: +1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("idiom", ["data", "numpy", "no_grad", "foreach", "for_loop"])
def test_no_commit_is_restored_torn_whatever_changes_the_state(single_rank, idiom):
    """Each step adds 1 to a 64 MB tensor right after the previous commit, by one
    idiom; a fault in every 6th step, before its commit. What every restart
    restores is exactly the committed step before it, in every element, and
    verified."""
    import torch.distributed as dist
    from test_call_lifecycle import fast_wrapper

    restored: list[tuple[int, float, float, bool]] = []

    @fast_wrapper()
    def train(call_wrapper: inprocess.CallWrapper = None):
        dist.init_process_group("gloo")
        w = torch.nn.Parameter(torch.zeros(16 * 2**20))  # 64 MB of float32
        foreach = idiom == "foreach"
        opt = torch.optim.SGD([w], lr=1.0, foreach=foreach) if idiom in ("foreach", "for_loop") \
            else None
        state = {"w": w}
        start = call_wrapper.restore(state)
        if call_wrapper.iteration > 0:
            record = call_wrapper.last_restore
            restored.append((start, w.min().item(), w.max().item(), record["verified"]))
        for step in range(start, 14):
            _step_with(idiom, state, opt)  # while step's own copy may still run
            if step + 1 == 6 * (call_wrapper.iteration + 1) and call_wrapper.iteration < 2:
                raise RuntimeError(f"fault in step {step + 1}")
            call_wrapper.commit(state, step + 1)
        dist.destroy_process_group()
        return w.min().item(), w.max().item()

    assert train() == (14.0, 14.0)
    assert restored == [(5, 5.0, 5.0, True), (11, 11.0, 11.0, True)]
