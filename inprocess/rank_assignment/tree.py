"""Topology-aware rank assignment: :class:`Tree`, configured by one :class:`Layer` per level.

The ranks are the leaves of a tree whose levels follow the machine (the whole
job, racks, hosts) or the workload (groups of a model-parallel size). Each
level has a :class:`Layer`: how ranks are grouped there (``key_or_fn``), how
few healthy ranks a group may keep before it is given up (``min_ranks``), how
many of its ranks may be active at once (``max_ranks``) and where lost active
ranks may be replaced from (``flag``).

The algorithm is a pure function on plain data (:func:`initial_assignment`,
:func:`next_assignment` over a :class:`Topology`), so every rank computes the
same result from the same inputs and tests need no processes. :class:`Tree`
is the thin callback around it: on its first call it exchanges the ranks'
keys through the store once, then it only computes.

Numbering of the result (the project's convention): the active ranks are
``0 .. active_world_size-1`` (an active rank's rank is its active rank), the
inactive (reserve) ranks follow in tree order, terminated ranks have none.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import enum
import functools
import heapq
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .. import protocol
from ..exception import InternalError
from ..state import Mode, State
from ..store import StoreMixin
from .base import RankAssignment, RankAssignmentCtx, RankDiscarded, _checked

log = logging.getLogger(__name__)

__all__ = [
    "Layer",
    "LayerFlag",
    "RootKeyError",
    "Topology",
    "Tree",
    "TreeAssignment",
    "TreeNode",
    "initial_assignment",
    "next_assignment",
]


class LayerFlag(enum.Flag):
    """Where a :class:`Tree` may look for a replacement of a lost active rank.

    Attributes:
        RESERVE: groups of this layer may be searched for an inactive (reserve)
            rank to take over a lost active rank. The search starts at the lost
            rank's own group of the lowest layer and climbs one layer at a time
            while the layer carries this flag; the first group that has a
            reserve rank gives its most recently deactivated one, whatever the
            ``max_ranks`` of the groups that rank belongs to.
        BACKFILL: groups of this layer may move one of their own active ranks
            (the one with the highest active rank) into a gap left by a lost
            active rank, when no reserve rank was found. The highest group in an
            unbroken run of BACKFILL layers, counted from the lowest layer up, is
            the backfill domain.
    """

    RESERVE = enum.auto()
    BACKFILL = enum.auto()


_MISSING = object()


class RootKeyError(ValueError, RuntimeError):
    """The ranks do not share the root layer's key.

    A ``ValueError`` (a bad input) that is also the ``RuntimeError`` the API's
    newer generation raises for it.
    """


@dataclasses.dataclass
class Layer:
    """One level of a :class:`Tree`: how ranks are grouped there and the group's limits.

    A layer may be modified after construction, also once a :class:`Tree`
    holds it (as the newest generation's scripts and tests do): every
    assignment is checked as the constructor checks it, and the tree reads the
    layer anew at its next rank assignment.

    Args:
        min_ranks: the fewest healthy (active or inactive) ranks a group of this
            layer may keep; a group with fewer is given up whole: all its
            ranks are terminated, and its parent group counts them as lost.
        max_ranks: the most ranks of a group of this layer that the first
            assignment activates; ``None`` for no limit. The others are reserve
            ranks. A reserve rank that a lost rank of another group takes over
            (:attr:`LayerFlag.RESERVE` above this layer) may bring a group past
            it, as in the API's newer generations.
        key_or_fn: the group of this rank at this layer: a string, or a
            callable ``(state) -> key`` evaluated on each rank for itself (for
            example ``lambda state: socket.gethostname()``). A key that is not a
            string is converted with ``str``. The first layer is the root: its
            key must be the same on every rank.
        flag: ``None``, or :class:`LayerFlag` values combined with ``|``.
    """

    min_ranks: int = 1
    max_ranks: int | None = None
    key_or_fn: str | Callable[[State], object] = ""
    flag: LayerFlag | None = None

    def __setattr__(self, name: str, value: object) -> None:
        old = self.__dict__.get(name, _MISSING)
        object.__setattr__(self, name, value)
        if "flag" in self.__dict__:  # constructed: check the whole layer again
            try:
                self.__post_init__()
            except Exception:
                if old is _MISSING:
                    object.__delattr__(self, name)
                else:
                    object.__setattr__(self, name, old)
                raise

    def __post_init__(self) -> None:
        if not isinstance(self.min_ranks, int) or isinstance(self.min_ranks, bool):
            raise TypeError(f"Layer: min_ranks must be an int >= 1, got {self.min_ranks!r}")
        if self.min_ranks < 1:
            raise ValueError(f"Layer: min_ranks must be >= 1, got {self.min_ranks}")
        if self.max_ranks is not None:
            if not isinstance(self.max_ranks, int) or isinstance(self.max_ranks, bool):
                raise TypeError(
                    f"Layer: max_ranks must be None or an int >= 1, got {self.max_ranks!r}"
                )
            if self.max_ranks < 1:
                raise ValueError(f"Layer: max_ranks must be None or >= 1, got {self.max_ranks}")
        if not isinstance(self.key_or_fn, str) and not callable(self.key_or_fn):
            raise TypeError(
                "Layer: key_or_fn must be a str (this rank's key) or a callable "
                f"(state) -> key, got {self.key_or_fn!r}"
            )
        if self.flag is not None and not isinstance(self.flag, LayerFlag):
            raise TypeError(
                "Layer: flag must be None or LayerFlag.RESERVE / LayerFlag.BACKFILL "
                f"(combined with |), got {self.flag!r}"
            )

    def key(self, state: State) -> str:
        """This rank's key at this layer."""
        key = self.key_or_fn(state) if callable(self.key_or_fn) else self.key_or_fn
        return key if isinstance(key, str) else str(key)

    def has(self, flag: LayerFlag) -> bool:
        """Whether this layer's flag includes ``flag``."""
        return self.flag is not None and bool(self.flag & flag)


# ---------------------------------------------------------------- the pure algorithm

_ACTIVE, _INACTIVE, _TERMINATED = 0, 1, 2


class Topology:
    """The tree of one job: built once from every rank's keys, immutable afterwards.

    Leaves are numbered in depth-first order; a group's leaves are then one
    contiguous range. Children keep the order in which their first rank appears
    in ``paths``, so a job launched in topology order keeps its order.

    Args:
        layers: one :class:`Layer` per level, the root first.
        paths: one tuple of keys per rank (one key per layer), in rank order.
    """

    def __init__(self, layers: Sequence[Layer], paths: Sequence[Sequence[str]]) -> None:
        layers = _checked_layers(layers)
        if not paths:
            raise ValueError("Topology: paths must hold at least one rank's keys")
        depth = len(layers)
        roots = {path[0] for path in paths}
        if len(roots) != 1:
            shown = sorted(roots)[:4]
            raise RootKeyError(
                "Tree: the first layer is the root, its key must be the same on every rank; "
                f"got {len(roots)} different keys, e.g. {shown}"
            )
        for i, path in enumerate(paths):
            if len(path) != depth:
                raise ValueError(
                    f"Topology: rank {i} has {len(path)} keys, expected one per layer ({depth})"
                )
        self.layers = layers
        self.depth = depth
        self.min_ranks = [layer.min_ranks for layer in layers]
        self.max_ranks = [layer.max_ranks for layer in layers]

        # Nested insertion-ordered dicts: key -> subtree; a bottom group maps to
        # the list of the input positions of its ranks.
        nested: dict = {}
        for position, path in enumerate(paths):
            group = nested
            for key in path[1:]:
                group = group.setdefault(key, {})
            group.setdefault(None, []).append(position)

        # Flatten depth-first: node arrays, leaf order.
        self.node_depth: list[int] = []
        self.node_parent: list[int] = []
        self.node_lo: list[int] = []
        self.node_hi: list[int] = []
        self.node_children: list[list[int]] = []
        self.node_key: list[str] = []
        #: input position (rank at build time) of each leaf
        self.origin: list[int] = []
        #: bottom group of each leaf
        self.bottom_of_leaf: list[int] = []

        def visit(group: dict, key: str, level: int, parent: int) -> int:
            node = len(self.node_depth)
            self.node_depth.append(level)
            self.node_parent.append(parent)
            self.node_lo.append(len(self.origin))
            self.node_hi.append(-1)
            self.node_children.append([])
            self.node_key.append(key)
            if level == depth - 1:
                for position in group[None]:
                    self.origin.append(position)
                    self.bottom_of_leaf.append(node)
            else:
                for child_key, child in group.items():
                    self.node_children[node].append(visit(child, child_key, level + 1, node))
            self.node_hi[node] = len(self.origin)
            return node

        visit(nested, paths[0][0], 0, -1)
        self.size = len(self.origin)
        #: the leaf of each input position
        self.leaf_of_origin = [0] * self.size
        for leaf, position in enumerate(self.origin):
            self.leaf_of_origin[position] = leaf
        self.bottoms = [n for n, d in enumerate(self.node_depth) if d == depth - 1]
        #: nodes children first (every node after all of its descendants)
        self.bottom_up = sorted(range(len(self.node_depth)), key=lambda n: -self.node_depth[n])
        #: ancestors of each bottom group, the group itself first, the root last
        self.ancestors: dict[int, list[int]] = {}
        for b in self.bottoms:
            chain, node = [], b
            while node >= 0:
                chain.append(node)
                node = self.node_parent[node]
            self.ancestors[b] = chain
        # The reserve search climbs while the layer has RESERVE; the backfill
        # domain is the top of the unbroken BACKFILL run from the bottom up.
        reserve_levels = 0
        while reserve_levels < depth and layers[depth - 1 - reserve_levels].has(LayerFlag.RESERVE):
            reserve_levels += 1
        backfill_levels = 0
        while backfill_levels < depth and layers[depth - 1 - backfill_levels].has(
            LayerFlag.BACKFILL
        ):
            backfill_levels += 1
        self.reserve_levels = reserve_levels
        self.backfill_levels = backfill_levels


@dataclasses.dataclass(frozen=True)
class TreeAssignment:
    """The result of one assignment, for every leaf of a :class:`Topology`.

    Stored compactly so that the next assignment copies it at C speed.

    Attributes:
        status: one byte per leaf (depth-first order): 0 active, 1 inactive
            (reserve), 2 terminated.
        active_leaves: the leaf of each active rank: active rank ``r`` (which
            is also its rank) is leaf ``active_leaves[r]``.
        world_size: the number of ranks (active and inactive).
        reserve_fills: ``(lost leaf, reserve leaf)`` for each lost active rank
            whose place a reserve rank took, in the order they were handled.
        backfills: ``(lost leaf, moved leaf)`` for each lost active rank whose
            place an active rank of its backfill domain took.
        reserve_order: the inactive leaves in the order they became inactive,
            the most recent last (the order the reserve search takes them in);
            ``None``: in tree order.

    Inactive ranks follow the active ones in tree order.
    """

    status: bytes
    active_leaves: tuple[int, ...]
    world_size: int
    reserve_fills: tuple[tuple[int, int], ...] = ()
    backfills: tuple[tuple[int, int], ...] = ()
    reserve_order: tuple[int, ...] | None = None

    @property
    def active_world_size(self) -> int:
        """The number of active ranks."""
        return len(self.active_leaves)

    def inactive_leaves(self) -> list[int]:
        """The leaf of each inactive rank ``active_world_size + i``, in rank order."""
        return _positions(self.status, _INACTIVE, 0, len(self.status))

    def rank_of(self, leaf: int) -> int | None:
        """The rank of ``leaf``, ``None`` when terminated."""
        status = self.status[leaf]
        if status == _ACTIVE:
            return self.active_leaves.index(leaf)
        if status == _INACTIVE:
            return self.active_world_size + self.status.count(_INACTIVE, 0, leaf)
        return None

    def leaf_of(self, rank: int) -> int:
        """The leaf that has ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        if rank < self.active_world_size:
            return self.active_leaves[rank]
        return self.inactive_leaves()[rank - self.active_world_size]

    @functools.cached_property
    def ranks(self) -> tuple[int | None, ...]:
        """The rank of every leaf, ``None`` when terminated (for tests and logs)."""
        ranks: list[int | None] = [None] * len(self.status)
        for rank, leaf in enumerate(self.active_leaves):
            ranks[leaf] = rank
        for i, leaf in enumerate(self.inactive_leaves()):
            ranks[leaf] = self.active_world_size + i
        return tuple(ranks)


def _positions(status: bytes | bytearray, value: int, start: int, end: int) -> list[int]:
    """The indexes of ``value`` in ``status[start:end]`` (ints only: nothing for the GC)."""
    found: list[int] = []
    i = status.find(value, start, end)
    while i >= 0:
        found.append(i)
        i = status.find(value, i + 1, end)
    return found


def initial_assignment(
    topology: Topology, world_size_filter: Callable[[int], int] | None = None
) -> TreeAssignment:
    """The first assignment: groups under ``min_ranks`` are given up, then ranks
    are activated in tree order while every group they belong to is under its
    ``max_ranks``; the active ranks are finally trimmed by ``world_size_filter``."""
    status = bytearray([_INACTIVE]) * topology.size
    _propagate_terminations(topology, status)
    active = [0] * len(topology.node_depth)
    limits = topology.max_ranks
    depth_of = topology.node_depth
    active_leaves: list[int] = []
    for leaf in range(topology.size):
        if status[leaf] == _TERMINATED:
            continue
        chain = topology.ancestors[topology.bottom_of_leaf[leaf]]
        if all(limits[depth_of[n]] is None or active[n] < limits[depth_of[n]] for n in chain):
            for n in chain:
                active[n] += 1
            status[leaf] = _ACTIVE
            active_leaves.append(leaf)
    reserves = _positions(status, _INACTIVE, 0, topology.size)  # deactivated in tree order
    return _finish(status, active_leaves, world_size_filter, (), (), reserves)


def next_assignment(
    topology: Topology,
    previous: TreeAssignment,
    terminated_ranks: Sequence[int] | set[int] | frozenset[int],
    world_size_filter: Callable[[int], int] | None = None,
) -> TreeAssignment:
    """The assignment after an iteration numbered by ``previous`` in which
    ``terminated_ranks`` (in that numbering) were lost.

    Steps, as the API's newer generations take them: (1) groups left under
    ``min_ranks`` are given up, children before parents; (2) the lost active
    ranks, in tree order, are each replaced by the most recently deactivated
    inactive rank of the nearest group on its RESERVE path that has one (no
    ``max_ranks`` is checked: a group whose reserve rank takes the place of
    another group's lost rank may end past its ``max_ranks``); (3) gaps still
    open are backfilled from the backfill domain's highest active ranks, the
    lowest of them into the first gap in tree order; (4) the remaining gaps
    are closed by shifting the active ranks down; (5) the active ranks are
    trimmed by ``world_size_filter`` (the ranks it deactivates become the most
    recent reserve ranks, in tree order).

    Costs O(n) only in C-level copies and scans, plus Python work in the number
    of lost ranks and of groups (and the backfill domains' sizes, and the
    reserve ranks of the groups searched, sorted once each), so that one
    rank's call stays fast at tens of thousands of ranks.
    """
    if len(previous.status) != topology.size:
        raise ValueError(
            f"previous assignment has {len(previous.status)} leaves, the topology {topology.size}"
        )
    status = bytearray(previous.status)
    # The leaf of each active rank; a gap is None until the shift closes it.
    active_leaves: list[int | None] = list(previous.active_leaves)
    old_active = len(active_leaves)
    inactive_leaves: list[int] | None = None
    lost: dict[int, int] = {}  # lost active leaf -> its active rank
    for rank in terminated_ranks:
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"terminated_ranks must hold ints, got {rank!r}")
        if not 0 <= rank < previous.world_size:
            raise ValueError(
                f"terminated_ranks must be in [0, {previous.world_size}) (the world size of "
                f"the iteration that ended), got {rank}"
            )
        if rank < old_active:
            leaf = previous.active_leaves[rank]
            lost[leaf] = rank
        else:
            if inactive_leaves is None:
                inactive_leaves = previous.inactive_leaves()
            leaf = inactive_leaves[rank - old_active]
        status[leaf] = _TERMINATED

    dropped = _propagate_terminations(topology, status)
    if dropped:
        # The inverse map of the active leaves, built at C speed.
        slot_of = dict(zip(previous.active_leaves, range(old_active), strict=True))
        lost.update(zip(dropped, map(slot_of.__getitem__, dropped), strict=True))
    # Holes are the lost active ranks; hole h was leaf was_at[h]. Kept as
    # plain ints (no tuples) so that a call allocates few objects the garbage
    # collector tracks. Handled in tree order, as the newer generations number
    # (and so handle) their ranks in tree order.
    was_at = previous.active_leaves
    holes = sorted(lost.values(), key=was_at.__getitem__)
    for hole in holes:
        active_leaves[hole] = None

    # (2) reserve: each hole climbs its RESERVE path to the first group with a
    # reserve rank and takes its most recently deactivated one.
    reserve_fills: list[tuple[int, int]] = []
    open_holes = holes
    if topology.reserve_levels and holes:
        inactive = _inactive_counts(topology, status)
        search = _ReserveSearch(topology, status, previous.reserve_order)
        ancestors, bottom_of_leaf = topology.ancestors, topology.bottom_of_leaf
        levels = topology.reserve_levels
        unfilled: list[int] = []
        for hole in holes:
            found = -1
            if inactive[0]:  # a reserve rank left anywhere (node 0 is the root)
                for group in ancestors[bottom_of_leaf[was_at[hole]]][:levels]:
                    if inactive[group]:
                        found = search.latest(group)
                        break
            if found < 0:
                unfilled.append(hole)
                continue
            status[found] = _ACTIVE
            active_leaves[hole] = found
            for n in ancestors[bottom_of_leaf[found]]:
                inactive[n] -= 1
            reserve_fills.append((was_at[hole], found))
        open_holes = unfilled

    # (3) backfill within each domain: its highest active ranks move into its
    # gaps, in tree order; the places they leave become gaps.
    backfills: list[tuple[int, int]] = []
    if topology.backfill_levels and open_holes:
        top = topology.depth - topology.backfill_levels
        by_domain: dict[int, list[int]] = {}
        for hole in open_holes:
            domain = topology.ancestors[topology.bottom_of_leaf[was_at[hole]]][-1 - top]
            by_domain.setdefault(domain, []).append(hole)
        slot_of = dict(zip(active_leaves, range(len(active_leaves)), strict=True))
        slot_of.pop(None, None)  # the gaps
        for domain, domain_holes in by_domain.items():
            lo, hi = topology.node_lo[domain], topology.node_hi[domain]
            movers = heapq.nlargest(
                len(domain_holes), map(slot_of.__getitem__, _positions(status, _ACTIVE, lo, hi))
            )
            # The domain's highest active ranks, in increasing order, fill its
            # holes in tree order (as the newer generation pairs them; a
            # mover below its hole moves up, and the shift then closes the gap
            # it left). Holes past the movers stay open for the shift.
            movers.reverse()
            for hole, mover_slot in zip(domain_holes, movers, strict=False):
                mover = active_leaves[mover_slot]
                active_leaves[hole] = mover
                active_leaves[mover_slot] = None
                backfills.append((was_at[hole], mover))

    # (4) shift: the gaps left close up.
    if None in active_leaves:
        active_leaves = [x for x in active_leaves if x is not None]
    if previous.reserve_order is None:
        reserves = _positions(status, _INACTIVE, 0, topology.size)
    else:  # those still inactive, in the order they became so
        reserves = [leaf for leaf in previous.reserve_order if status[leaf] == _INACTIVE]
    return _finish(
        status, active_leaves, world_size_filter, tuple(reserve_fills), tuple(backfills),
        reserves,
    )


def _checked_layers(layers: Sequence[Layer]) -> tuple[Layer, ...]:
    if isinstance(layers, Layer) or not isinstance(layers, Sequence) or isinstance(layers, str):
        raise TypeError(f"Tree: layers must be a list of Layer, got {layers!r}")
    if not layers:
        raise ValueError("Tree: layers must hold at least one Layer (the root)")
    for i, layer in enumerate(layers):
        if not isinstance(layer, Layer):
            raise TypeError(f"Tree: layers[{i}] must be a Layer, got {layer!r}")
    return tuple(layers)


def _inactive_counts(topology: Topology, status: bytearray) -> list[int]:
    """The inactive ranks of every group."""
    lo, hi, parent = topology.node_lo, topology.node_hi, topology.node_parent
    inactive = [0] * len(topology.node_depth)
    for b in topology.bottoms:
        inactive[b] = status.count(_INACTIVE, lo[b], hi[b])
    for n in topology.bottom_up:
        p = parent[n]
        if p >= 0:
            inactive[p] += inactive[n]
    return inactive


def _propagate_terminations(topology: Topology, status: bytearray) -> list[int]:
    """Gives up every group under its ``min_ranks``, children first.

    Returns the active leaves of the given-up groups (now terminated).
    """
    lo, hi, parent = topology.node_lo, topology.node_hi, topology.node_parent
    minimum, depth_of = topology.min_ranks, topology.node_depth
    alive = [0] * len(depth_of)
    dropped: list[int] = []
    for b in topology.bottoms:
        alive[b] = hi[b] - lo[b] - status.count(_TERMINATED, lo[b], hi[b])
    for n in topology.bottom_up:  # children are final before their parent is summed
        if 0 < alive[n] < minimum[depth_of[n]]:
            alive[n] = 0
            start, end = lo[n], hi[n]
            dropped.extend(_positions(status, _ACTIVE, start, end))
            status[start:end] = bytes([_TERMINATED]) * (end - start)
        p = parent[n]
        if p >= 0:
            alive[p] += alive[n]
    return dropped


class _ReserveSearch:
    """Finds a group's most recently deactivated reserve rank; see :func:`next_assignment`.

    Each group searched gets, once, the stack of its inactive leaves in the
    order they became inactive. Invariant: during the reserve step a leaf only
    goes from inactive to active, never back, so a group's stack holds all of
    its inactive leaves, the most recent on top, under leaves already taken
    (through another group's stack), which are skipped as they surface.
    """

    def __init__(
        self, topology: Topology, status: bytearray, order: tuple[int, ...] | None
    ) -> None:
        self.t = topology
        self.status = status
        # the place of each inactive leaf in the order they became inactive
        self.place = None if order is None else dict(zip(order, range(len(order)), strict=True))
        self.stacks: dict[int, list[int]] = {}

    def latest(self, group: int) -> int:
        """The most recently deactivated inactive leaf under ``group``, or -1."""
        stack = self.stacks.get(group)
        if stack is None:
            stack = _positions(self.status, _INACTIVE, self.t.node_lo[group], self.t.node_hi[group])
            if self.place is not None:
                stack.sort(key=self.place.__getitem__)
            self.stacks[group] = stack
        while stack:
            leaf = stack.pop()
            if self.status[leaf] == _INACTIVE:
                return leaf
        return -1


def _finish(
    status: bytearray,
    active_leaves: list[int],
    world_size_filter: Callable[[int], int] | None,
    reserve_fills: tuple[tuple[int, int], ...],
    backfills: tuple[tuple[int, int], ...],
    reserves: list[int],
) -> TreeAssignment:
    """Applies the world-size filter: the active ranks past it become reserve ranks,
    the most recent ones (``reserves``: the inactive leaves, oldest first), in tree order."""
    count = len(active_leaves)
    if world_size_filter is not None:
        wanted = world_size_filter(count)
        if not isinstance(wanted, int) or isinstance(wanted, bool) or not 0 <= wanted <= count:
            raise ValueError(
                f"Tree: world_size_filter({count}) must return an int in [0, {count}], "
                f"got {wanted!r}"
            )
        for leaf in active_leaves[wanted:]:
            status[leaf] = _INACTIVE
        reserves.extend(sorted(active_leaves[wanted:]))
        del active_leaves[wanted:]
    world_size = len(status) - status.count(_TERMINATED)
    return TreeAssignment(
        bytes(status), tuple(active_leaves), world_size, reserve_fills, backfills,
        tuple(reserves),
    )


# ---------------------------------------------------------------- the callback


class Tree(RankAssignment):
    """Topology-aware rank assignment of the API's newer generation: ``tree(ctx) -> ctx``.

    The ranks are the leaves of a tree with one level per :class:`Layer`
    (the first is the root). After an iteration in which some ranks were lost:

    1. every group left with fewer healthy ranks than its layer's ``min_ranks``
       is given up whole, children before parents, so losses climb the tree;
    2. each lost active rank, in tree order, is replaced by a reserve
       (inactive) rank, searched in the lost rank's own lowest group first,
       then one layer up at a time while the layer has
       :attr:`LayerFlag.RESERVE`: the first group with a reserve rank gives its
       most recently deactivated one, even when that brings the rank's own
       groups past their ``max_ranks`` (as in the API's newer generations:
       ``max_ranks`` caps the first assignment);
    3. a gap no reserve rank could fill is backfilled within its backfill
       domain (:attr:`LayerFlag.BACKFILL`) by the domain's highest active rank;
    4. the gaps still open are closed by shifting the active ranks down;
    5. ``world_size_filter``, when given, receives the number of active ranks
       and returns how many to keep (no more than it got); the active ranks
       past it become reserve ranks.

    On its first call (the first iteration) the ranks are activated in tree
    order while every group is under its ``max_ranks``; the rest are reserve.
    The result keeps the project's numbering: active ranks are
    ``0 .. active_world_size-1``, reserve ranks follow, and ``state.mode`` is
    ``ACTIVE`` or ``INACTIVE``; a lost rank raises :class:`RankDiscarded`.

    Tree does the whole job: compose it with no other rank assignment or rank
    filter. Ranks that join a running job are not part of the tree.

    The store in ``ctx.store`` on the first call: the Wrapper's own (an
    :class:`inprocess.store.StoreMixin`) exchanges the surviving ranks' keys in
    one gather. Any other store is used as the newer generation uses it,
    through ``send_state(state, rank)``, ``get_states(ranks)``,
    ``send_key(keys, rank)`` and ``get_keys(ranks)`` only (a caller or a test
    may pass a stand-in that answers for every rank): the tree holds all
    ``world_size`` ranks, ranks lost before the first call included, and ranks
    are numbered as that generation numbers them: ``state.rank`` is the rank's
    place among the surviving ranks in tree order (the numbering the next
    call's ``terminated_ranks`` use), ``state.active_rank`` its active rank,
    and every call is a new assignment. A topology whose order differs from
    the launch order then warns (``UserWarning``).

    :attr:`init_rank_map` shows every rank's assigned state after a call:
    ``tree.init_rank_map[initial_rank].state`` (``rank``, ``world_size``,
    ``active_rank``, ``active_world_size``, ``mode``; a terminated rank has
    ``rank`` and ``active_rank`` ``None`` and ``mode`` ``TERMINATED``).

    Example, hosts of 8 ranks, at most 256 active ranks, reserve ranks taken
    from any host, the job given up under 128 healthy ranks::

        Tree([
            Layer(min_ranks=128, max_ranks=256, key_or_fn="job", flag=LayerFlag.RESERVE),
            Layer(min_ranks=8, max_ranks=8, key_or_fn=lambda s: socket.gethostname(),
                  flag=LayerFlag.RESERVE),
        ])

    Args:
        layers: one :class:`Layer` per level, the root first.
        world_size_filter: optional ``(active_world_size) -> int``, at most its
            argument (e.g. ``lambda n: n // 8 * 8``).
        timeout: how long the first call waits for every rank's keys.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        world_size_filter: Callable[[int], int] | None = None,
        *,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
    ) -> None:
        self.layers = _checked_layers(layers)
        if world_size_filter is not None and not callable(world_size_filter):
            raise TypeError(
                "Tree: world_size_filter must be None or a callable (active_world_size) -> "
                f"int, got {world_size_filter!r}"
            )
        if not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"Tree: timeout must be a datetime.timedelta, got {timeout!r}")
        if timeout.total_seconds() <= 0:
            raise ValueError(f"Tree: timeout must be positive, got {timeout}")
        self.world_size_filter = world_size_filter
        self.timeout = timeout
        self.topology: Topology | None = None
        #: initial rank of each leaf (to check that ranks arrive as numbered)
        self._initial_ranks: list[int] = []
        # Retry bookkeeping: the iteration the last call assigned, the
        # assignment its input was numbered by (None: the launch numbering),
        # and its result. A retried call (same iteration: a rank died before
        # the barrier after the assignment) starts again from the same base.
        self._assigned_iteration: int | None = None
        self._base: TreeAssignment | None = None
        self._result: TreeAssignment | None = None
        #: the build-time ranks of the survivors, in rank order (the topology's input order)
        self._origins: list[int] = []
        #: True: the store of the first call was not the Wrapper's (see the class docs)
        self._generic = False
        self._initial_world_size = 0
        self._iteration = 0
        self._leaf_of_initial: dict[int, int] = {}
        self._rank_map: _RankMap | None = None

    @property
    def init_rank_map(self) -> Mapping[int, TreeNode]:
        """Initial rank -> the :class:`TreeNode` of that rank, whose ``state`` is what the
        last call assigned to it; empty before the first call."""
        if self.topology is None or self._result is None:
            return {}
        if self._rank_map is None or self._rank_map.result is not self._result:
            self._rank_map = _RankMap(self, self._result)
        return self._rank_map

    def __repr__(self) -> str:
        return f"Tree({list(self.layers)!r}, world_size_filter={self.world_size_filter!r})"

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:  # type: ignore[override]
        if not isinstance(ctx, RankAssignmentCtx):
            raise TypeError(
                "Tree is a rank assignment of the newer generation: call it with a "
                f"RankAssignmentCtx(state, store, terminated_ranks), got {type(ctx).__name__}"
            )
        if self.topology is None:
            self._generic = not isinstance(ctx.store, StoreMixin)
        if self._generic:
            return self._call_generic(ctx)
        state = ctx.state
        # Validates the ranks; a lost rank takes no part (it raises RankDiscarded).
        terminated = set(_checked(state, ctx.terminated_ranks))
        iteration = self._iteration_assigned(ctx)
        retry = iteration == self._assigned_iteration
        base = self._base if retry else self._result
        if self.topology is None or base is None:  # first call, or a retry of it
            self._build(ctx, terminated)
            assert self.topology is not None
            result = initial_assignment(self.topology, self.world_size_filter)
            leaf = self.topology.leaf_of_origin[self._origin_of(state.rank)]
            base = None
        else:
            if state.world_size != base.world_size:
                raise InternalError(
                    f"Tree: the iteration that ended had {state.world_size} ranks, but Tree "
                    f"numbered {base.world_size}; Tree must be the only rank assignment, and "
                    "ranks that join a running job are not supported"
                )
            leaf = base.leaf_of(state.rank)
            if self._initial_ranks[leaf] != state.initial_rank:
                raise InternalError(
                    f"Tree: rank {state.rank} has initial rank {state.initial_rank}, but Tree "
                    f"gave that rank to initial rank {self._initial_ranks[leaf]}"
                )
            result = next_assignment(self.topology, base, terminated, self.world_size_filter)
        self._assigned_iteration, self._base, self._result = iteration, base, result

        rank = result.rank_of(leaf)
        if rank is None:
            raise RankDiscarded(
                f"rank {state.rank} (initial rank {state.initial_rank}) is in a group of the "
                "Tree that fell under its min_ranks"
            )
        self._iteration = state.iteration
        new = state.copy()
        new.rank = rank
        new.world_size = result.world_size
        new.active_world_size = result.active_world_size
        new.mode = Mode.ACTIVE if rank < result.active_world_size else Mode.INACTIVE
        new.active_rank = rank if new.mode == Mode.ACTIVE else None
        ctx.state = new
        ctx.terminated_ranks = set()
        return ctx

    def _call_generic(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """A call with a store other than the Wrapper's: the newer generation's numbering."""
        state = ctx.state
        try:
            terminated = set(_checked(state, ctx.terminated_ranks))
        except RankDiscarded:  # computed for every rank all the same (init_rank_map)
            terminated = set(ctx.terminated_ranks)
        if self.topology is None or self._result is None:
            self._build_generic(ctx)
            assert self.topology is not None
            if terminated:
                # Terminations at the first call: the tree is built over every rank
                # first, then the losses are handled as after any iteration.
                initial = initial_assignment(self.topology)
                lost = [initial.ranks[self.topology.leaf_of_origin[r]] for r in terminated]
                result = next_assignment(
                    self.topology, initial,
                    [r for r in lost if r is not None], self.world_size_filter,
                )
            else:
                result = initial_assignment(self.topology, self.world_size_filter)
        else:
            base = self._result
            survivors = _positions_not(base.status, _TERMINATED)
            if state.world_size != len(survivors):
                raise InternalError(
                    f"Tree: the iteration that ended had {state.world_size} ranks, but Tree "
                    f"numbered {len(survivors)}; Tree must be the only rank assignment"
                )
            ours = base.ranks
            result = next_assignment(
                self.topology, base, [ours[survivors[r]] for r in terminated],
                self.world_size_filter,
            )
        self._base, self._result = None, result
        self._iteration = state.iteration
        leaf = self._leaf_of_initial.get(state.initial_rank)
        if leaf is None:
            raise InternalError(
                f"Tree: initial rank {state.initial_rank} is not one of the tree's ranks"
            )
        if result.status[leaf] == _TERMINATED:
            raise RankDiscarded(
                f"rank {state.rank} (initial rank {state.initial_rank}) is terminated, or in a "
                "group of the Tree that fell under its min_ranks"
            )
        new = state.copy()
        new.rank = leaf - result.status.count(_TERMINATED, 0, leaf)
        new.world_size = result.world_size
        new.active_world_size = result.active_world_size
        if result.status[leaf] == _ACTIVE:
            new.mode, new.active_rank = Mode.ACTIVE, result.active_leaves.index(leaf)
        else:
            new.mode, new.active_rank = Mode.INACTIVE, None
        ctx.state = new
        ctx.terminated_ranks = set()
        return ctx

    def _build_generic(self, ctx: RankAssignmentCtx) -> None:
        """Every rank's state and keys through the store's four exchange methods."""
        state, store = ctx.state, ctx.store
        missing = [name for name in _STORE_METHODS if not callable(getattr(store, name, None))]
        if missing:
            raise TypeError(
                "Tree needs a store in ctx.store on its first call, to exchange the ranks' "
                "keys: the Wrapper's (an inprocess.store.StoreMixin) or one with "
                "send_state(state, rank), get_states(ranks), send_key(key, rank) and "
                f"get_keys(ranks); got {type(store).__name__}, without {', '.join(missing)}"
            )
        keys = [layer.key(state) for layer in self.layers]
        ranks = range(state.world_size)
        store.send_state(state, state.rank)
        states = list(store.get_states(ranks))
        store.send_key(keys, state.rank)
        all_keys = list(store.get_keys(ranks))
        if len(states) != state.world_size or len(all_keys) != state.world_size:
            raise InternalError(
                f"Tree: the store returned {len(states)} states and {len(all_keys)} keys "
                f"for {state.world_size} ranks"
            )
        paths = [[k if isinstance(k, str) else str(k) for k in key] for key in all_keys]
        self.topology = Topology(self.layers, paths)
        initial_ranks = [
            s.initial_rank if getattr(s, "initial_rank", None) is not None else position
            for position, s in enumerate(states)
        ]
        self._initial_ranks = [initial_ranks[p] for p in self.topology.origin]
        self._origins = list(ranks)
        self._initial_world_size = state.initial_world_size or state.world_size
        if self.topology.origin != list(ranks):
            first = next(
                leaf for leaf, p in enumerate(self.topology.origin) if leaf != p
            )
            warnings.warn(
                "Tree: the topology orders the ranks differently from their launch order "
                f"(tree position {first} holds rank {self.topology.origin[first]})",
                UserWarning,
                stacklevel=4,
            )
        self._index_leaves()

    def _index_leaves(self) -> None:
        self._leaf_of_initial = {r: leaf for leaf, r in enumerate(self._initial_ranks)}

    def _origin_of(self, rank: int) -> int:
        return bisect.bisect_left(self._origins, rank)

    def _iteration_assigned(self, ctx: RankAssignmentCtx) -> int:
        """The index of the iteration this call assigns ranks for.

        The Wrapper's store for an assignment is prefixed with the iteration's
        barrier name (:func:`inprocess.protocol.barrier_name`); without it, the iteration
        after the one in ``state`` (the first call: iteration 0).
        """
        prefix = getattr(ctx.store, "prefix", None)
        if isinstance(prefix, str):
            iteration = protocol.iteration_of_barrier(prefix)
            if iteration is not None:
                return iteration
        # Without it a retried first call cannot be told from the second call.
        return ctx.state.iteration + (0 if self.topology is None else 1)

    def _build(self, ctx: RankAssignmentCtx, terminated: set[int]) -> None:
        """Exchanges every surviving rank's keys through the store; builds the topology."""
        state, store = ctx.state, ctx.store
        assert isinstance(store, StoreMixin)  # the fast path's store (see __call__)
        keys = [layer.key(state) for layer in self.layers]
        prefix = "inprocess/tree"
        record = json.dumps([state.rank, state.initial_rank, keys])  # one line
        count = state.world_size - len(terminated)
        lines = store.all_gather_lines(
            prefix, str(state.rank), record, count, self.timeout,
            min(0.05, max(0.005, count * 5e-6)),
        )
        records = sorted(json.loads(line) for line in lines)
        ranks = [r[0] for r in records]
        expected = sorted(set(range(state.world_size)) - terminated)
        if ranks != expected:
            raise InternalError(
                f"Tree: got the keys of {len(ranks)} ranks, expected the {len(expected)} "
                "surviving ranks"
            )
        self._origins = ranks
        self.topology = Topology(self.layers, [r[2] for r in records])
        self._initial_ranks = [records[p][1] for p in self.topology.origin]
        self._initial_world_size = state.initial_world_size or state.world_size
        self._index_leaves()
        if self.topology.origin != list(range(self.topology.size)):
            log.info("Tree: the topology orders the ranks differently from their launch order")


#: what a store other than the Wrapper's must offer a :class:`Tree`
_STORE_METHODS = ("send_state", "get_states", "send_key", "get_keys")


def _positions_not(status: bytes, value: int) -> list[int]:
    """The indexes of ``status`` that do not hold ``value``."""
    return [i for i, v in enumerate(status) if v != value]


@dataclasses.dataclass(frozen=True)
class TreeNode:
    """One rank (a leaf) of a :class:`Tree`, as :attr:`Tree.init_rank_map` shows it.

    Attributes:
        initial_rank: the rank it was launched with.
        leaf: its position in the tree (depth-first order).
        state: what the tree's last call assigned to it.
    """

    initial_rank: int
    leaf: int
    state: State


class _RankMap(Mapping):
    """``Tree.init_rank_map``: initial rank -> :class:`TreeNode`, for one assignment.

    Built when first read after a call (O(ranks)); each node's state is made
    when it is read.
    """

    def __init__(self, tree: Tree, result: TreeAssignment) -> None:
        self.result = result
        self._tree = tree
        status = result.status
        self._active: list[int | None] = [None] * len(status)
        for active_rank, leaf in enumerate(result.active_leaves):
            self._active[leaf] = active_rank
        if tree._generic:  # place among the survivors in tree order
            ranks: list[int | None] = [None] * len(status)
            for rank, leaf in enumerate(_positions_not(status, _TERMINATED)):
                ranks[leaf] = rank
            self._ranks: Sequence[int | None] = ranks
        else:
            self._ranks = result.ranks

    def __getitem__(self, initial_rank: int) -> TreeNode:
        leaf = self._tree._leaf_of_initial[initial_rank]
        status = self.result.status[leaf]
        state = State(rank=0, world_size=1)  # every field is set below, unchecked
        state.rank = self._ranks[leaf]
        state.world_size = self.result.world_size
        state.active_world_size = self.result.active_world_size
        state.active_rank = self._active[leaf]
        state.initial_rank = initial_rank
        state.initial_world_size = self._tree._initial_world_size
        state.iteration = self._tree._iteration
        state.mode = (Mode.ACTIVE, Mode.INACTIVE, Mode.TERMINATED)[status]
        return TreeNode(initial_rank, leaf, state)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._tree._leaf_of_initial))

    def __len__(self) -> int:
        return len(self._tree._leaf_of_initial)

    def __contains__(self, initial_rank: Any) -> bool:
        return initial_rank in self._tree._leaf_of_initial
