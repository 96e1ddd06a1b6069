"""Pure decisions of a restore: which step, and where each rank gets its state.

Every rank describes what it holds (:class:`Holdings`); every rank runs
:func:`plan` on the same list and so reaches the same :class:`Plan` without
another exchange. No I/O here: unit-tested without processes.

A *shard* is what one rank's state is: with replicated state (data-parallel
replicas, the default) there is one shard, ``0``, that every rank needs; with
state that differs per rank, rank ``r`` needs shard ``r`` (its rank when it
committed), and keeps its ring buddy's shard ``r - 1`` as well.

Each snapshot also has an *origin* (:data:`Origin`): the lineage it was
committed in (an id the ranks agree on at every restore) and how many shards
its step has (1: replicated; else the world size it was committed at). A
step is one state only when its shards share a lineage (:func:`screen`),
and is restored only at its own layout (:func:`plan` raises
:class:`LayoutMismatch` otherwise: a shard is never dropped, nor one missing
made up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

#: ``(kind, shard, step, lineage, shards)``: where one snapshot a rank holds comes
#: from; ``kind`` is MEMORY or DISK; ``lineage``/``shards`` are ``None`` when unknown
Origin = tuple[str, int, int, "str | None", "int | None"]

MEMORY, PEER, DISK, NONE = "memory", "peer", "disk", "none"
SOURCES = (MEMORY, PEER, DISK, NONE)


@dataclasses.dataclass(frozen=True)
class Holdings:
    """What one rank can offer a restore.

    ``memory``: ``(shard, step)`` of each complete snapshot in its host memory
    (its own and its buddy copies); ``disk``: ``(shard, step)`` of each complete
    persisted snapshot it can read; ``newest``: the newest step it committed
    (``None``: none, e.g. a new process).
    """

    memory: frozenset[tuple[int, int]] = frozenset()
    disk: frozenset[tuple[int, int]] = frozenset()
    newest: int | None = None
    #: the :data:`Origin` of what it holds (those it knows)
    origins: tuple[Origin, ...] = ()


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # one of SOURCES
    peer: int | None = None  # the rank that sends it (PEER)


@dataclasses.dataclass(frozen=True)
class Plan:
    step: int  # 0: nothing to restore
    shards: tuple[int, ...]  # the shard each rank needs
    sources: tuple[Source, ...]  # per rank

    def transfers(self) -> list[tuple[int, int, int]]:
        """``(sender, receiver, shard)`` of every peer transfer, in a fixed order."""
        return [
            (s.peer, r, self.shards[r])  # type: ignore[misc]
            for r, s in enumerate(self.sources)
            if s.kind == PEER
        ]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(SOURCES, 0)
        for s in self.sources:
            out[s.kind] += 1
        return out


def needed_shards(world_size: int, replicated: bool) -> tuple[int, ...]:
    return tuple(0 if replicated else r for r in range(world_size))


def buddy_of(rank: int, world_size: int) -> int:
    """The rank that keeps a copy of ``rank``'s shard: the next one on the ring."""
    return (rank + 1) % world_size


class LayoutMismatch(ValueError):
    """The newest step the ranks hold was committed with another number of shards
    than this restore needs (another world size with ``replicated=False``, or
    the other mode)."""

    def __init__(self, step: int, found: Sequence[int], needed: int, replicated: bool) -> None:
        self.step, self.found, self.needed = step, sorted(found), needed
        self.replicated = replicated
        super().__init__(step, self.found, needed, replicated)


def _layouts_at(step: int, holdings: Sequence[Holdings]) -> set[int]:
    return {n for h in holdings for (_k, _sh, st, _l, n) in h.origins if st == step and n}


def plan(holdings: Sequence[Holdings], replicated: bool) -> Plan:
    """The newest step every rank can get, and each rank's source for it.

    A step qualifies when every rank's shard at that step is in its own memory,
    in a peer's memory or on disk it can read. Own memory beats a peer, a peer
    beats disk; among peers holding it, senders are spread (the one with the
    fewest transfers so far, then the lowest rank), so a replicated restore of
    several new ranks does not queue on one sender. No step qualifies: step 0,
    every source ``none``, nothing restored.

    Raises:
        LayoutMismatch: a step newer than any that qualifies was committed with
            another number of shards (its origins say so): restoring an older
            step, or part of this one, would silently drop or invent a shard.
    """
    world = len(holdings)
    shards = needed_shards(world, replicated)
    candidates = sorted(
        {step for h in holdings for (_shard, step) in (*h.memory, *h.disk)}, reverse=True
    )
    for step in candidates:
        found = _layouts_at(step, holdings)
        if found - {len(set(shards))}:
            raise LayoutMismatch(step, found, len(set(shards)), replicated)
        sources = _sources_at(step, holdings, shards)
        if sources is not None:
            return Plan(step, shards, tuple(sources))
    return Plan(0, shards, tuple(Source(NONE) for _ in range(world)))


def _sources_at(
    step: int, holdings: Sequence[Holdings], shards: Sequence[int]
) -> list[Source] | None:
    load = [0] * len(holdings)
    sources = []
    for rank, shard in enumerate(shards):
        if (shard, step) in holdings[rank].memory:
            sources.append(Source(MEMORY))
            continue
        peers = [p for p, h in enumerate(holdings) if p != rank and (shard, step) in h.memory]
        if peers:
            peer = min(peers, key=lambda p: (load[p], p))
            load[peer] += 1
            sources.append(Source(PEER, peer))
            continue
        if (shard, step) in holdings[rank].disk:
            sources.append(Source(DISK))
            continue
        return None
    return sources


def screen(holdings: Sequence[Holdings]) -> tuple[list[Holdings], list[tuple[int, int, int, str]]]:
    """The holdings without the snapshots of a step that come from different lineages.

    Memory is this run's own (ranks that agreed on every lineage): where ranks
    hold a step in memory, its lineage is theirs (the most ranks', ties: the
    lowest rank's) and any other snapshot of that step (on disk, a stale copy)
    is left out. A step only on disk whose shards name different lineages (two
    runs wrote it) is left out whole. Returns the screened holdings and
    ``(rank, shard, step, reason)`` of what was left out.
    """
    memory: dict[int, dict[str | None, set[int]]] = {}
    disk: dict[int, set[str | None]] = {}
    for rank, h in enumerate(holdings):
        for kind, _shard, step, lineage, _n in h.origins:
            if kind == MEMORY:
                memory.setdefault(step, {}).setdefault(lineage, set()).add(rank)
            else:
                disk.setdefault(step, set()).add(lineage)
    chosen: dict[int, str | None] = {}
    for step, by_lineage in memory.items():
        chosen[step] = max(
            by_lineage, key=lambda lin: (len(by_lineage[lin]), -min(by_lineage[lin]))
        )
    mixed = {step for step, lineages in disk.items() if step not in chosen and len(lineages) > 1}
    out, dropped = [], []
    for rank, h in enumerate(holdings):
        lineage_of = {(k, sh, st): lin for k, sh, st, lin, _n in h.origins}
        keep: dict[str, set[tuple[int, int]]] = {MEMORY: set(h.memory), DISK: set(h.disk)}
        for kind, entries in keep.items():
            for shard, step in sorted(entries):
                lineage = lineage_of.get((kind, shard, step))
                if step in chosen and lineage != chosen[step]:
                    why = (
                        f"of another run (lineage {lineage}) than step {step} held in memory "
                        f"(lineage {chosen[step]})"
                    )
                elif step in mixed:
                    why = (
                        f"its shards come from different runs (lineages "
                        f"{sorted(disk[step], key=str)}): not one state"
                    )
                else:
                    continue
                entries.discard((shard, step))
                dropped.append((rank, shard, step, why))
        out.append(
            dataclasses.replace(
                h,
                memory=frozenset(keep[MEMORY]),
                disk=frozenset(keep[DISK]),
                origins=tuple(o for o in h.origins if (o[1], o[2]) in keep[o[0]]),
            )
        )
    return out, dropped


def lineage_at(holdings: Sequence[Holdings], step: int) -> str | None:
    """The lineage of ``step`` in (screened) holdings: the one its snapshots share."""
    for h in holdings:
        for _k, _sh, st, lineage, _n in h.origins:
            if st == step and ((_sh, st) in h.memory or (_sh, st) in h.disk):
                return lineage
    return None


def redone_steps(holdings: Sequence[Holdings], step: int) -> int:
    """Steps committed before the restore that the job will run again."""
    newest = [h.newest for h in holdings if h.newest is not None]
    return max(0, max(newest) - step) if newest else 0


def disagreement(checksums: Sequence[dict[str, int]]) -> tuple[int, list[tuple[int, str]]]:
    """Ranks whose restored state differs from the majority's.

    Returns the reference rank (lowest rank of the largest group of identical
    checksums) and ``(rank, first differing key)`` for every other rank; an
    empty list when all agree. With no majority (say, two ranks), the lowest
    rank's group is the reference: a mismatch is still reported.
    """
    groups: dict[tuple[tuple[str, int], ...], list[int]] = {}
    for rank, sums in enumerate(checksums):
        groups.setdefault(tuple(sorted(sums.items())), []).append(rank)
    reference_group = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    reference = reference_group[0]
    ref = checksums[reference]
    out = []
    for rank, sums in enumerate(checksums):
        if rank in reference_group:
            continue
        keys = sorted(set(ref) | set(sums))
        key = next(k for k in keys if ref.get(k) != sums.get(k))
        out.append((rank, key))
    return reference, out
