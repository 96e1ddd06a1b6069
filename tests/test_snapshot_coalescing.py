"""Commits that arrive while the previous device copy is in flight are coalesced
(issue 37, item 1): the policy of ``Snapshots.commit``, with a stand-in for the
device copier (a copy "in flight" for as long as the test says; no GPU here).
The copies themselves are measured on a GPU by ``benchmarks/gpu_state.py``."""

from __future__ import annotations

import torch

from inprocess.snapshot import Snapshots, persist


class InFlight:
    """A device copier whose last copy has not landed while ``busy`` is set."""

    def __init__(self) -> None:
        self.busy_now = False
        self.coalesced = 0
        self.closed = False

    def busy(self) -> bool:
        return self.busy_now

    def close(self) -> None:
        self.closed = True


def _held(snaps: Snapshots) -> list[int]:
    for slot in snaps.own.slots:
        slot.wait()  # (host copies run on the copier's thread)
    return [s.step for s in snaps.own.held()]


def test_a_commit_during_a_copy_in_flight_is_skipped_and_the_next_takes_the_newer_state():
    state = {"w": torch.zeros(4)}
    snaps = Snapshots()
    device = snaps._device = InFlight()
    for step in (1, 2):
        state["w"] = state["w"] + 1  # (in place, it would tear the copy in flight)
        snaps.commit(state, step, 0)
    assert _held(snaps) == [2, 1]
    device.busy_now = True
    state["w"] = state["w"] + 1
    snaps.commit(state, 3, 0)  # coalesced: nothing copied, nothing waited for
    assert _held(snaps) == [2, 1] and device.coalesced == 1
    assert snaps.newest == 3  # the step the rank reached: a restore to 2 redoes 1 step
    device.busy_now = False
    state["w"] = state["w"] + 1
    snaps.commit(state, 4, 0)
    assert _held(snaps) == [4, 2]
    assert snaps.own.at(4).unpickled()  # a whole snapshot
    restored = {"w": torch.zeros(4)}
    assert snaps.restore(restored, True, 0) == 4
    assert torch.equal(restored["w"], torch.full((4,), 4.0))
    snaps.close()
    assert device.closed


def test_a_due_step_that_was_coalesced_is_persisted_with_the_next_commit(tmp_path):
    state = {"w": torch.zeros(4)}
    snaps = Snapshots(str(tmp_path), persist_every=2)
    device = snaps._device = InFlight()
    device.busy_now = True
    snaps.commit(state, 2, 0)  # due, coalesced
    device.busy_now = False
    snaps.commit(state, 3, 0)  # not due, but owed
    snaps.flush(30)
    assert persist.complete(str(tmp_path)) == {(0, 3)}
    snaps.commit(state, 5, 0)  # neither due nor owed
    snaps.flush(30)
    assert persist.complete(str(tmp_path)) == {(0, 3)}
    snaps.close()


def test_a_due_last_commit_that_was_coalesced_leaves_the_newest_snapshot_on_disk(tmp_path):
    """No next commit to write it with: the call's end writes the newest complete one."""
    state = {"w": torch.zeros(4)}
    snaps = Snapshots(str(tmp_path), persist_every=2)
    device = snaps._device = InFlight()
    for step in (1, 2, 3):
        state["w"] = state["w"] + 1
        snaps.commit(state, step, 0)  # 2: due, written
    assert snaps.flush(30)
    device.busy_now = True
    state["w"] = state["w"] + 1
    snaps.commit(state, 4, 0)  # due, coalesced: the call ends before another commit
    snaps.close()
    assert persist.complete(str(tmp_path)) == {(0, 2), (0, 3)}


def test_the_ring_exchange_never_coalesces(monkeypatch):
    """replicated=False: every rank must take part in every commit's exchange."""
    from inprocess.snapshot import transfer

    sent: list[int] = []
    monkeypatch.setattr(transfer, "ring_exchange", lambda slot, *a: sent.append(slot.step))
    snaps = Snapshots()
    device = snaps._device = InFlight()
    snaps.replicated, snaps._rank, snaps._world = False, 0, 2
    snaps._group, snaps._group_iteration = object(), 0
    device.busy_now = True
    snaps.commit({"w": torch.zeros(2)}, 1, 0)
    assert sent == [1] and device.coalesced == 0
    snaps.close()


def test_a_call_that_ends_on_a_due_step_leaves_that_step_on_disk(
    single_rank, tmp_path, monkeypatch
):
    """Steps far shorter than the disk writer's start (its thread not yet running
    when the next due steps come): the slot it was handed waits, unread, and each
    due commit takes its place rather than being coalesced, so the call's last
    commit (due) is the step on disk, not an older one."""
    import threading

    import torch.distributed as dist
    from test_call_lifecycle import fast_wrapper

    import inprocess

    real = persist.Persister._run
    steps_done = threading.Event()

    def late(self):
        steps_done.wait(60)  # the writer's thread runs only once the steps are done
        real(self)

    monkeypatch.setattr(persist.Persister, "_run", late)
    snap = tmp_path / "snap"

    @fast_wrapper(snapshot_dir=str(snap), persist_every=5)
    def train(call_wrapper: inprocess.CallWrapper = None):
        dist.init_process_group("gloo")
        try:
            state = {"w": torch.zeros(4), "data": {"step": 0}}
            start = call_wrapper.restore(state)
            for step in range(start, 20):
                state["w"] = state["w"] + 1
                state["data"]["step"] = step + 1
                call_wrapper.commit(state, step + 1)
            return start
        finally:
            steps_done.set()
            dist.destroy_process_group()

    assert train() == 0
    steps = {step for _shard, step in persist.complete(str(snap))}
    assert max(steps) == 20, steps
    # what is read back is the last commit's state
    restored = {"w": torch.zeros(4), "data": {"step": 0}}

    @fast_wrapper(snapshot_dir=str(snap), persist_every=5)
    def again(call_wrapper: inprocess.CallWrapper = None):
        dist.init_process_group("gloo")
        try:
            return call_wrapper.restore(restored)
        finally:
            dist.destroy_process_group()

    assert again() == 20 and torch.equal(restored["w"], torch.full((4,), 20.0))
