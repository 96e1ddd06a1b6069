"""Pure decisions of a restore: which step, and where each rank gets its state.

Every rank describes what it holds (:class:`Holdings`); every rank runs
:func:`plan` on the same list and so reaches the same :class:`Plan` without
another exchange. No I/O here: unit-tested without processes.

A *shard* is what one rank's state is: with replicated state (data-parallel
replicas, the default) there is one shard, ``0``, that every rank needs; with
state that differs per rank, rank ``r`` needs shard ``r`` (its rank when it
committed), and keeps its ring buddy's shard ``r - 1`` as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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


def plan(holdings: Sequence[Holdings], replicated: bool) -> Plan:
    """The newest step every rank can get, and each rank's source for it.

    A step qualifies when every rank's shard at that step is in its own memory,
    in a peer's memory or on disk it can read. Own memory beats a peer, a peer
    beats disk; among peers holding it, senders are spread (the one with the
    fewest transfers so far, then the lowest rank), so a replicated restore of
    several new ranks does not queue on one sender. No step qualifies: step 0,
    every source ``none``, nothing restored.
    """
    world = len(holdings)
    shards = needed_shards(world, replicated)
    candidates = sorted(
        {step for h in holdings for (_shard, step) in (*h.memory, *h.disk)}, reverse=True
    )
    for step in candidates:
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
