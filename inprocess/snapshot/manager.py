"""The snapshots of one wrapped call on one rank: commit, restore, release.

:class:`Snapshots` ties the parts together (host slots, the plan, transfers,
disk, checksums); :class:`inprocess.CallWrapper` only delegates to it. It
lives as long as the call (a process that survives a fault keeps its
snapshots across iterations) and :meth:`close` releases everything at the end
of the call: buffers, the writer thread, the group reference.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import secrets
import time
from typing import Any

from .. import device_fault
from ..exception import RestartAbort
from . import layout, persist, policy, transfer
from .buffers import DeviceCopier, HostSnapshot, SlotPair
from .persist import SnapshotCorrupt, SnapshotTrustError

log = logging.getLogger(__name__)


class SnapshotMismatch(RuntimeError):
    """Replicas restored different state: a fault of the restart, never trained on."""


class SnapshotWorldSizeError(RestartAbort):
    """The newest snapshot was committed at another world size (``replicated=False``)
    or in the other mode: restoring it, or an older step, would drop a shard or
    make one up. Raised on every rank by ``restore``; it ends the Wrapper."""


#: steps whose origin a rank remembers beyond the ones it holds
_ORIGINS_KEPT = 8


class Snapshots:
    """This rank's snapshots for one call (see the module's docstring)."""

    def __init__(
        self,
        snapshot_dir: str | None = None,
        persist_every: int | None = None,
        staging: bool | None = None,
    ) -> None:
        self.snapshot_dir = snapshot_dir
        self.own = SlotPair()
        self.buddy = SlotPair()  # the ring predecessor's shard (replicated=False)
        self._device = DeviceCopier(staging)
        #: a due step's disk write that a coalesced commit skipped: the next commit's
        self._persist_owed = False
        #: the newest snapshot due for the disk, not handed to the writer yet (its copy
        #: was in flight, or the writer busy): ``(slot, step, due)`` (:meth:`_hand_over`)
        self._to_persist: tuple[HostSnapshot, int, bool] | None = None
        #: commits skipped because the disk writer still copied the slot they would write
        self.disk_coalesced = 0
        self.replicated = True
        self.newest: int | None = None  # newest step committed (or restored) here
        #: the lineage of this rank's commits: agreed by every rank at each restore
        #: (a new one each time: what is committed after a restore to step s is a
        #: new branch from s); ``None``: no restore yet
        self.lineage: str | None = None
        #: step -> (lineage, shards) of what this rank committed or restored at that step
        self._origins: dict[int, tuple[str | None, int | None]] = {}
        self._commit_times: collections.deque[float] = collections.deque(maxlen=11)
        self._group: Any = None
        self._group_iteration: int | None = None
        self._rank, self._world = 0, 1
        self._persister = (
            persist.Persister(snapshot_dir, persist_every)
            if snapshot_dir is not None and persist_every is not None
            else None
        )
        self.last_restore: dict[str, Any] | None = None
        self._closed = False
        #: the authentic markers and the rejected ones of the last scan of the disk
        self._markers: dict[tuple[int, int], dict[str, Any]] = {}
        self._rejected_markers: list[tuple[int, int, str]] = []
        self._root_ready = False  # snapshot_dir made (or found) ours and private

    # ---------------------------------------------------------------- what this rank holds

    def holdings(self, unusable: frozenset[tuple[int, int]] = frozenset()) -> policy.Holdings:
        """What this rank holds; ``unusable``: ``(shard, step)`` on disk that failed a read.

        Raises:
            SnapshotTrustError: see :func:`persist.scan`.
        """
        held = self._in_memory()
        found = persist.scan(self.snapshot_dir)
        self._markers = found.complete
        self._rejected_markers = found.rejected
        disk = set(found.complete) - unusable
        return policy.Holdings(
            frozenset(held), frozenset(disk), self.newest, self._origins_of(held, disk)
        )

    def _origins_of(
        self, held: set[tuple[int, int]], disk: set[tuple[int, int]]
    ) -> tuple[policy.Origin, ...]:
        """Where each snapshot this rank holds comes from (see :data:`policy.Origin`)."""
        out: list[policy.Origin] = []
        for shard, step in sorted(held):
            lineage, shards = self._origins.get(step, (None, None))
            out.append((policy.MEMORY, shard, step, lineage, shards))
        for shard, step in sorted(disk):
            out.append((policy.DISK, shard, step, *_origin(self._markers[(shard, step)])))
        return tuple(out)

    def _in_memory(self) -> set[tuple[int, int]]:
        held = set()
        for pair in (self.own, self.buddy):
            for s in pair.slots:
                s.wait()
            held |= {(s.shard, s.step) for s in pair.held()}
        return held

    def _describe(
        self, unusable: frozenset[tuple[int, int]]
    ) -> tuple[policy.Holdings, str | None, list[tuple[int, int, str]]]:
        """This rank's holdings, why its ``snapshot_dir`` is refused (``None``: it is
        not), and the markers it did not trust: what every rank shares."""
        try:
            return self.holdings(unusable), None, list(self._rejected_markers)
        except SnapshotTrustError as ex:
            held = self._in_memory()
            origins = self._origins_of(held, set())
            return policy.Holdings(frozenset(held), frozenset(), self.newest, origins), str(ex), []

    def _find(self, shard: int, step: int) -> HostSnapshot | None:
        for pair in (self.own, self.buddy):
            for s in pair.held():
                if s.shard == shard and s.step == step:
                    return s
        return None

    def step_seconds(self) -> float | None:
        """Mean wall time between the last commits (``None``: fewer than two)."""
        t = list(self._commit_times)
        if len(t) < 2:
            return None
        return (t[-1] - t[0]) / (len(t) - 1)

    # ---------------------------------------------------------------- restore

    def restore(self, state: dict[str, Any], replicated: bool, iteration: int) -> int:
        """Loads the newest snapshot every rank can get into ``state``; returns its step."""
        self._check_open()
        layout.check_state(state)
        if not isinstance(replicated, bool):
            raise TypeError(f"restore(replicated=...) must be a bool, got {replicated!r}")
        pg = transfer.group()
        if pg is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # alone, each rank would pick its own step
            raise RuntimeError(
                "restore() needs torch.distributed initialized (init_process_group) first: "
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} ranks must agree on the step"
            )
        # the snapshot kept back for the disk goes to the writer, if it is free,
        # before anything here may reuse its slot (a state every rank reached)
        self._hand_over(wait=True)
        self._group, self._group_iteration = pg, iteration
        rank, world = _rank_world(pg)
        self._rank, self._world = rank, world
        moved = 0
        slot: HostSnapshot | None = None
        started: float | None = None
        # One CRC pass per snapshot and restore: a rank that sends the snapshot it
        # restores itself from (a survivor healing a new rank) reads it once.
        # (Nothing writes into a sealed snapshot while this restore runs.)
        crcs: dict[int, dict[str, int]] = {}

        def sums_of(snap: HostSnapshot) -> dict[str, int]:
            if id(snap) not in crcs:
                crcs[id(snap)] = snap.checksums()
            return crcs[id(snap)]

        #: every rank's snapshots on disk that failed their checks: the same list on every rank
        rejected: list[dict[str, Any]] = []
        unusable: frozenset[tuple[int, int]] = frozenset()  # this rank's reads that failed
        # Invariant: every rank plans from the same gathered holdings, and a snapshot
        # read from disk is used only once every rank has said its own read passed
        # its checks; a read that failed anywhere is dropped from that rank's
        # holdings and every rank plans again (an older step, or the same step from
        # a peer that read it intact). Each round drops one (shard, step) at least.
        while True:
            mine, refusal, untrusted = self._describe(unusable)
            described = transfer.all_gather(
                (replicated, mine, self.step_seconds(), refusal, untrusted, secrets.token_hex(8)),
                pg,
            )
            if started is None:
                # Timed from here, where every rank has arrived: not the ranks' skew in
                # reaching restore (process start, init_process_group).
                started = time.monotonic()
                modes = {r: d[0] for r, d in enumerate(described)}
                if len(set(modes.values())) > 1:
                    raise ValueError(
                        f"restore(replicated=...) must be the same on every rank, got {modes}"
                    )
                for r, d in enumerate(described):
                    rejected += [
                        {"rank": r, "step": st, "shard": sh, "reason": why}
                        for sh, st, why in d[4]
                    ]
            _raise_refused([d[3] for d in described], rank)
            # Invariant: a step is planned only from snapshots of one lineage (the
            # same screened holdings on every rank), and only at its own layout
            holdings, mixed = policy.screen([d[1] for d in described])
            for r, sh, st, why in mixed:
                entry = {"rank": r, "step": st, "shard": sh, "reason": why}
                if entry not in rejected:
                    rejected.append(entry)
            try:
                plan = policy.plan(holdings, replicated)
            except policy.LayoutMismatch as ex:
                raise SnapshotWorldSizeError(_layout_text(ex, world, self.snapshot_dir)) from None
            step, shard, source = plan.step, plan.shards[rank], plan.sources[rank]
            if not any(s.kind == policy.DISK for s in plan.sources):
                break
            failure = refusal = None
            if source.kind == policy.DISK:
                assert self.snapshot_dir is not None
                slot = self.own.writable()
                try:
                    moved += persist.read(
                        self.snapshot_dir, step, shard, slot, self._markers[(shard, step)]
                    )
                    # held in memory from here (a next round plans with it)
                    self._origins[step] = _origin(self._markers[(shard, step)])
                except persist.Unusable as ex:
                    failure = str(ex)
                except SnapshotTrustError as ex:
                    refusal = str(ex)
                except Exception as ex:  # every rank must reach the exchange below
                    slot.invalidate()
                    failure = f"cannot load step {step} shard {shard}: {ex!r}"
            failures = transfer.all_gather((failure, refusal), pg)
            _raise_refused([f[1] for f in failures], rank)
            if not any(f[0] for f in failures):
                break
            for r, (why, _refused) in enumerate(failures):
                if why:
                    rejected.append(
                        {"rank": r, "step": step, "shard": plan.shards[r], "reason": why}
                    )
            if failure is not None:
                log.warning("snapshot of step %d not restored from disk: %s", step, failure)
                unusable = unusable | {(shard, step)}
            slot = None
        if rejected and rank == 0:
            log.warning(
                "snapshots on disk failed their checks and were not restored: %s",
                "; ".join(_describe_rejected(r) for r in rejected),
            )
        if step == 0 and rejected:
            raise SnapshotCorrupt(
                f"no intact snapshot to restore in snapshot_dir {self.snapshot_dir} (nor in "
                "memory): "
                + "; ".join(_describe_rejected(r) for r in rejected)
                + ". Nothing was restored; remove those step directories to start from step 0"
            )
        self.replicated = replicated
        if step == 0 and any(h.memory or h.disk for h in holdings) and rank == 0:
            log.warning(
                "no step of the state is available to every rank (held: %s): starting from "
                "step 0; with replicated=False, a rank and its ring buddy were lost together",
                sorted({x for h in holdings for x in (*h.memory, *h.disk)}),
            )
        transfers = plan.transfers()
        sent: dict[int, dict[str, int]] = {}
        if transfers:
            sending = sorted({sh for snd, _r, sh in transfers if snd == rank})
            headers = transfer.all_gather(
                {sh: transfer.header(self._find(sh, step)) for sh in sending},
                pg,  # type: ignore[arg-type]
            )
            receives = []
            if source.kind == policy.PEER:
                _step, _nbytes, blob = headers[source.peer][shard]
                skeleton, refs = pickle.loads(blob)
                slot = self.own.writable()
                slot.assign(step, shard, skeleton, refs)
                receives.append((source.peer, slot))
            sends = []
            for snd, receiver, sh in transfers:
                if snd == rank:
                    snap = self._find(sh, step)
                    assert snap is not None
                    sends.append((receiver, snap))
            moved += transfer.exchange(sends, receives, pg)
            if slot is not None:
                slot.seal()
            # After the exchange, not before: the receivers wait for the bytes, not
            # for the sender's checksums (they compare them only at the end)
            for _receiver, snap in sends:
                sent[snap.shard] = sums_of(snap)
        if source.kind == policy.MEMORY:
            slot = self._find(shard, step)
            assert slot is not None
            if slot not in self.own.slots:  # a buddy copy becomes this rank's own
                own = self.own.writable()
                own.copy_from(slot)
                slot = own
        # (policy.DISK: read and checked above)
        if step > 0:
            # Snapshots newer than the restored step belong to a future that is redone.
            self.own.drop_from(step + 1)
            self.buddy.drop_from(step + 1)
            assert slot is not None
            slot.load_into(state)
        self.newest = step if step > 0 else None
        self._commit_times.clear()
        self._branch(step, policy.lineage_at(holdings, step), len(set(plan.shards)))
        self.lineage = described[0][5]  # rank 0's: the same on every rank
        self._fence(step, replicated, rank)
        sums = sums_of(slot) if slot is not None and step > 0 else {}
        outcome = transfer.all_gather((sums, sent, time.monotonic() - started, moved), pg)
        mismatch = _mismatches(outcome, plan, replicated)
        record = {
            "type": "restore",
            "time": time.time(),
            "iteration": iteration,
            "step": step,
            "redone_steps": policy.redone_steps(holdings, step),
            "seconds": round(max(o[2] for o in outcome), 6),
            "bytes": sum(o[3] for o in outcome),
            "sources": plan.counts(),
            # rank 0's measure; a rank 0 without one (a new process): the next rank's
            "step_seconds": next((d[2] for d in described if d[2] is not None), None),
            "verified": step > 0 and not mismatch,
            "replicated": replicated,
            "world_size": world,
        }
        if mismatch:
            record["mismatch"] = [{"rank": r, "key": k} for r, k in mismatch]
        if rejected:
            record["rejected"] = rejected
        self.last_restore = record
        if mismatch:
            if any(r == rank for r, _k in mismatch) and slot is not None:
                slot.invalidate()  # the next restore heals this rank from a peer
            text = "; ".join(f"rank {r} differs in {k!r}" for r, k in mismatch)
            raise SnapshotMismatch(f"restore of step {step}: {text}")
        return step

    def _branch(self, step: int, lineage: str | None, shards: int) -> None:
        """What this rank remembers of the origins once restored to ``step``."""
        self._origins = {st: o for st, o in self._origins.items() if st < step}
        if step > 0:
            self._origins[step] = (lineage, shards)

    def _fence(self, step: int, replicated: bool, rank: int) -> None:
        """The restore went back to ``step``: nothing newer of an earlier lineage may
        reach the disk (a write of it in flight here), nor stay there (per-rank
        state: another run's shard of such a step would be taken for this one's).

        Every rank does it before the restore's last exchange, so before any rank
        commits (and persists) a step of the new lineage."""
        p = self._persister
        if p is None:
            return
        p.fence(step, self.lineage)
        if replicated:
            return  # one shard per step: never assembled from two runs
        try:
            fenced = persist.fence(self.snapshot_dir, step)
        except OSError as ex:
            log.warning("cannot remove the markers of steps after %d: %s", step, ex)
            return
        if fenced and rank == 0:
            log.warning(
                "snapshots of steps %s on disk are newer than the restored step %d: their "
                "markers were removed (an abandoned trajectory; rewritten when training "
                "gets there again)",
                fenced,
                step,
            )

    # ---------------------------------------------------------------- commit

    def commit(self, state: dict[str, Any], step: int, iteration: int) -> None:
        """Snapshots ``state`` as the state after ``step`` steps."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"commit(step=...) must be an int >= 0, got {step!r}")
        layout.check_state(state)
        if self._group_iteration != iteration:
            # no restore in this iteration: the group of an earlier one is gone (the
            # default group's ranks still say which shard this is)
            self._group, self._group_iteration = transfer.group_if_default(), iteration
            self._rank, self._world = _default_rank_world()
        shard = 0 if self.replicated else self._rank
        ring = not self.replicated and self._world > 1 and self._group is not None
        p = self._persister
        due = p is not None and (not self.replicated or self._rank == 0) and p.due(step)
        if due and not self._root_ready:
            assert p is not None
            try:
                persist.prepare(p.root)  # refused here, before anything is written: one clear error
            except OSError as ex:  # (the writer reports its own failures: never a fault)
                log.warning("cannot create snapshot_dir %s: %s", p.root, ex)
            self._root_ready = True
        self.newest = step
        self._note_commit(step)
        self._commit_times.append(time.monotonic())
        if not ring and self._device.busy():
            # The previous CUDA copy is still in flight: this commit is coalesced
            # into the next one (training never waits for PCIe). Not with the ring
            # exchange, a collective every rank must make at every commit.
            self._device.coalesced += 1
            self._persist_owed = self._persist_owed or due
            return
        self.own.drop_from(step)
        slot = self.own.writable()  # (every copy into either slot has landed)
        self._hand_over(wait=False)  # the snapshot kept back for the disk, if the writer is free
        if not ring and slot.held and (due or self._persist_owed) and p is not None:
            # A due (or owed) commit is not coalesced for a slot that only waits for
            # the writer (its thread not yet started on it): this newer snapshot
            # takes its place, as it would in the writer's queue.
            p.withdraw(slot)
        if not ring and slot.held:
            # The disk writer still copies this slot (its copy takes longer than the
            # steps since it was handed over): coalesced as well, never waited for.
            self.disk_coalesced += 1
            self._persist_owed = self._persist_owed or due
            return
        # the ring exchange sends the snapshot at once: no copy to overlap with
        slot.fill(step, shard, state, device=None if ring else self._device)
        if slot.pinned:
            # Both host buffers pinned by the first commit, not inside a later step;
            # never a buffer that holds a snapshot (reserving may reallocate it).
            for other in self.own.slots:
                if other is not slot and other.step is None and not other.in_flight:
                    other.reserve(slot.nbytes, pin=True)
        if ring:
            self.buddy.drop_from(step)
            transfer.ring_exchange(
                slot,
                policy.buddy_of(self._rank, self._world),
                (self._rank - 1) % self._world,
                self.buddy.writable(),
                self._group,
            )
        kept_back = self._to_persist
        if due or self._persist_owed or kept_back is not None:
            # Never waits here: a copy in flight (on the GPU's side
            # stream) is handed to the disk writer at the next commit, once it landed
            if kept_back is not None and kept_back[2]:
                assert p is not None
                p.skipped += 1
                log.info(
                    "snapshot of step %d not persisted: the disk is behind (a newer one will be)",
                    kept_back[1],
                )
            self._to_persist = (slot, step, due)
            self._persist_owed = False
            if slot.complete:
                self._hand_over(wait=False)

    def _note_commit(self, step: int) -> None:
        """Remembers the origin of the step committed (its lineage and layout)."""
        self._origins[step] = (self.lineage, 1 if self.replicated else self._world)
        if len(self._origins) > _ORIGINS_KEPT:
            held = {s.step for pair in (self.own, self.buddy) for s in pair.slots}
            for st in sorted(self._origins)[:-2]:
                if st not in held:
                    del self._origins[st]

    def _hand_over(self, wait: bool, when_busy: bool = False) -> None:
        """Gives the disk writer the newest snapshot due for the disk, once its copy
        landed (``wait``: waits for that).

        While the writer is still busy with an earlier one (the disk is behind)
        it is kept back, unheld: the next commit's newer snapshot takes its
        place, and the writer gets the newest once it is free (``when_busy``:
        handed over all the same, at the call's end and at a flush). A snapshot
        discarded as torn, or overwritten meanwhile, owes its write to the next
        commit.
        """
        if self._to_persist is None:
            return
        slot, step, _due = self._to_persist
        if wait:
            slot.wait()
        elif slot.in_flight and not slot.complete:
            return
        p = self._persister
        assert p is not None
        if slot.step != step:
            self._to_persist = None
            self._persist_owed = True
        elif when_busy or not p.busy():
            self._to_persist = None
            # the lineage and world size the step was committed with
            lineage, shards = self._origins.get(step, (None, None))
            world = shards if not self.replicated and shards else self._world
            p.submit(slot, world, self.replicated, lineage)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every due snapshot committed so far is on disk (``False`` on
        timeout); a call's end does this by itself."""
        self._hand_over(wait=True, when_busy=True)
        return self._persister is None or self._persister.flush(timeout)

    # ---------------------------------------------------------------- end of the call

    def _hand_over_at_close(self) -> None:
        """The call ends: what is due for the disk is handed over, whatever the writer
        is busy with; a write owed to a next commit (the last due one was coalesced
        or torn) takes the newest complete snapshot, if the disk has none as new."""
        if device_fault.broken() is not None:
            self._to_persist = None  # its bytes may be the broken device's last words
            return
        p = self._persister
        for s in self.own.slots:
            s.wait()  # the newest complete snapshot is one whose copy landed meanwhile
        if self._to_persist is not None and self._to_persist[0].step != self._to_persist[1]:
            self._to_persist = None  # torn since: the write it owes takes the newest below
            self._persist_owed = True
        if self._to_persist is None and self._persist_owed and p is not None:
            self._persist_owed = False
            newest = self.own.held()[:1]
            if newest and (not p.written or newest[0].step > p.written[-1]):  # type: ignore[operator]
                self._to_persist = (newest[0], newest[0].step, False)  # type: ignore[arg-type]
        self._hand_over(wait=True, when_busy=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the call's snapshots were released (the call ended)")

    def close(self, timeout: float = 120.0) -> None:
        """Releases everything: waits for a disk write in flight, frees the buffers."""
        # Invariant: every part is released even when one fails, and nothing here
        # raises over the error that ended the call (a CUDA context that broke is
        # recorded by the parts themselves: inprocess.device_fault).
        steps = (
            ("the device copier", self._device.close),
            ("the last due snapshot", self._hand_over_at_close),
            ("the disk writer", lambda: self._persister and self._persister.close(timeout)),
            ("the host buffers", self.own.release),
            ("the peer's host buffers", self.buddy.release),
        )
        for what, step in steps:
            try:
                step()
            except Exception as ex:
                log.warning("releasing %s of the call's snapshots failed: %r", what, ex)
        self._group = None
        self._closed = True


def _origin(marker: dict[str, Any]) -> tuple[str | None, int | None]:
    """The lineage and layout a marker names (see :data:`policy.Origin`)."""
    lineage = marker.get("lineage")
    return (lineage if isinstance(lineage, str) else None), persist.layout_of(marker)


def _layout_text(ex: policy.LayoutMismatch, world: int, root: str | None) -> str:
    def has(n: int) -> str:
        return "one shard" if n == 1 else f"{n} shards (per-rank state of world size {n})"

    needed = "one shard" if ex.replicated else f"{ex.needed} shard(s), one per rank"
    n = ex.found[-1]
    if n > 1:
        advice = f"restore it with replicated=False at world size {n} (spares keep the count)"
    else:
        advice = "restore it with replicated=True, or at world size 1"
    return (
        f"restore(replicated={ex.replicated}) at world size {world} needs {needed}, but the "
        f"newest snapshot, step {ex.step}, has {' and '.join(has(k) for k in ex.found)}: "
        "nothing was restored (per-rank state is restored only at the world size it was "
        f"committed at, never a shard dropped or made up); {advice}, or start over in "
        "another snapshot_dir" + (f" than {root}" if root else "")
    )


def _describe_rejected(r: dict[str, Any]) -> str:
    return f"step {r['step']} shard {r['shard']} (rank {r['rank']}): {r['reason']}"


def _raise_refused(refusals: list[str | None], rank: int) -> None:
    """Raises the first rank's refusal of its ``snapshot_dir`` on every rank."""
    for r, text in enumerate(refusals):
        if text:
            raise SnapshotTrustError(text if r == rank else f"rank {r}: {text}")


def _default_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _rank_world(pg: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if pg is None:
        return 0, 1
    return dist.get_rank(pg), dist.get_world_size(pg)


def _mismatches(
    outcome: list[tuple[dict[str, int], dict[int, dict[str, int]], float, int]],
    plan: policy.Plan,
    replicated: bool,
) -> list[tuple[int, str]]:
    """Ranks whose restored state is not what it should be: ``(rank, key)``."""
    if plan.step == 0:
        return []
    if replicated:
        return policy.disagreement([o[0] for o in outcome])[1]
    bad = []
    for receiver, source in enumerate(plan.sources):
        if source.kind != policy.PEER:
            continue
        expected = outcome[source.peer][1].get(plan.shards[receiver], {})
        got = outcome[receiver][0]
        for key in sorted(set(expected) | set(got)):
            if expected.get(key) != got.get(key):
                bad.append((receiver, key))
                break
    return bad
