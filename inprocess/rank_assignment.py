"""Rank assignment: gives the surviving ranks a gap-free numbering after a fault.

After a restart iteration ends, some ranks of that iteration may be dead,
unhealthy or otherwise unable to continue (``terminated_ranks``, numbered as in
the iteration that just ended). A :class:`RankAssignment` runs on every rank and
computes, from the same inputs, the same new world size and a new rank for each
survivor, so that the next iteration again sees ranks ``0 .. world_size-1``.

Two kinds of assignment exist and are chained with :class:`inprocess.Compose`
(the last listed runs first):

* filters (:class:`FilterGroupedByKey`) add ranks to the terminated set and
  leave the numbering alone;
* final assignments (:class:`ShiftRanks`, :class:`FillGaps`) renumber the
  survivors and return an empty set: nothing is left to handle.

A rank that finds itself among the terminated ranks raises
:class:`RankDiscarded`; the Wrapper then removes it from the job.
"""

from __future__ import annotations

import abc
import bisect
import collections
import datetime
import itertools
import logging
from collections.abc import Callable, Iterable

from .exception import InternalError, RestartError
from .state import State
from .store import StoreMixin

log = logging.getLogger(__name__)


class RankDiscarded(RestartError):
    """This rank is among the terminated ranks and takes no part in the next iteration."""


class RankAssignment(abc.ABC):
    """Base class of the ``rank_assignment`` argument of :class:`inprocess.Wrapper`.

    ``__call__(state, terminated_ranks)`` receives the state of the iteration
    that just ended (``state.rank`` and ``state.world_size`` in that iteration's
    numbering) and the ranks of that iteration that must not continue. It returns
    the (possibly updated) state and the terminated ranks that are still
    unhandled: a final assignment returns an empty set, a filter returns the set
    it received, possibly enlarged.

    Every rank must reach the same decision from the same inputs; an assignment
    may exchange rank-local facts through ``state.store``.
    """

    @abc.abstractmethod
    def __call__(self, state: State, terminated_ranks: set[int]) -> tuple[State, set[int]]:
        raise NotImplementedError


def _checked(state: State, terminated_ranks: Iterable[int]) -> list[int]:
    """``terminated_ranks`` sorted, checked against ``state.world_size``.

    Raises :class:`RankDiscarded` when ``state.rank`` is among them.
    """
    if isinstance(terminated_ranks, (str, bytes)) or not isinstance(terminated_ranks, Iterable):
        raise TypeError(
            f"terminated_ranks must be a set of ints, got {type(terminated_ranks).__name__}"
        )
    if not isinstance(terminated_ranks, (set, frozenset)):
        terminated_ranks = set(terminated_ranks)
    try:
        ordered = sorted(terminated_ranks)
    except TypeError as ex:
        raise TypeError(f"terminated_ranks must hold ints: {ex}") from None
    if ordered:
        low, high = ordered[0], ordered[-1]
        if not isinstance(low, int) or not isinstance(high, int):
            raise TypeError(f"terminated_ranks must hold ints, got {ordered[:8]}")
        if low < 0 or high >= state.world_size:
            raise ValueError(
                f"terminated_ranks must be in [0, {state.world_size}) (the world size of the "
                f"iteration that ended), got {low if low < 0 else high}"
            )
        position = bisect.bisect_left(ordered, state.rank)
        if position < len(ordered) and ordered[position] == state.rank:
            raise RankDiscarded(f"rank {state.rank} of world size {state.world_size} is terminated")
    return ordered


def _assign(state: State, new_rank: int, new_world_size: int) -> None:
    log.debug("rank %s/%s -> %s/%s", state.rank, state.world_size, new_rank, new_world_size)
    state.rank = new_rank
    state.world_size = new_world_size
    # Everybody is active until a rank filter says otherwise; keeps the state
    # consistent (active_world_size <= world_size) between assignment and filter.
    state.active_world_size = new_world_size


class ShiftRanks(RankAssignment):
    """Closes the gaps left by terminated ranks by shifting survivors down.

    Survivors keep their relative order; the new world size is the old one less
    the number of terminated ranks. Example, 8 ranks with ``{1, 4, 5}`` terminated::

        old rank   0  1  2  3  4  5  6  7
        new rank   0  x  1  2  x  x  3  4

    Simple and order-preserving, but every rank above the first gap changes its
    rank (and so, often, its data shard or pipeline stage).
    """

    def __call__(self, state: State, terminated_ranks: set[int]) -> tuple[State, set[int]]:
        terminated = _checked(state, terminated_ranks)
        below = bisect.bisect_left(terminated, state.rank)
        _assign(state, state.rank - below, state.world_size - len(terminated))
        return state, set()

    def __repr__(self) -> str:
        return "ShiftRanks()"


class FillGaps(RankAssignment):
    """Moves the highest survivors into the gaps; every other rank keeps its number.

    With ``n`` the new world size, survivors below ``n`` keep their rank, and the
    survivors at ``n`` or above fill, in ascending order, the gaps below ``n``
    (lowest gap gets the lowest moved rank). Example, 8 ranks with ``{1, 4, 5}``
    terminated (``n = 5``)::

        old rank   0  1  2  3  4  5  6  7
        new rank   0  x  2  3  x  x  1  4

    Fewer ranks change than with :class:`ShiftRanks`, at the cost of order.
    """

    def __call__(self, state: State, terminated_ranks: set[int]) -> tuple[State, set[int]]:
        terminated = _checked(state, terminated_ranks)
        new_world_size = state.world_size - len(terminated)
        rank = state.rank
        if rank < new_world_size:
            new_rank = rank
        else:
            # The survivors at or above new_world_size are exactly as many as the
            # gaps below it: both equal the number of terminated ranks below it.
            split = bisect.bisect_left(terminated, new_world_size)
            high_below = bisect.bisect_left(terminated, rank) - split
            new_rank = terminated[rank - new_world_size - high_below]
        _assign(state, new_rank, new_world_size)
        return state, set()

    def __repr__(self) -> str:
        return "FillGaps()"


class FilterGroupedByKey(RankAssignment):
    """Terminates whole groups of ranks whose healthy member count fails ``condition``.

    Ranks are grouped by a key: ``key_or_fn`` is the key itself (a string that
    may differ between ranks, e.g. ``socket.gethostname()``) or a callable
    ``(rank, world_size) -> key`` evaluated on each rank for itself. Keys are
    exchanged through ``state.store``, so they may be rank-local facts that no
    other rank could compute. A key that is not a string is converted with ``str``.

    ``condition(count)`` receives the number of surviving ranks of a group; when
    it is false every rank of that group is added to the terminated set. For
    example ``FilterGroupedByKey(lambda rank, _: rank // 8, lambda n: n == 8)``
    drops a group of 8 consecutive ranks as soon as one of them is lost. Combine
    with a final assignment, which runs after the filter::

        Compose(ShiftRanks(), FilterGroupedByKey(...))

    Every surviving rank takes part in a store barrier of ``timeout``; a rank
    already terminated does not and passes its input through.

    Args:
        key_or_fn: the key of this rank, or a callable computing it.
        condition: ``(count) -> bool``; false terminates the group.
        timeout: how long to wait for the other survivors' keys.
        name: store sub-prefix of this instance. By default instances are
            numbered in construction order, which matches across ranks when every
            rank builds the same callbacks in the same order; pass a name when
            that does not hold.
    """

    _counter = itertools.count()

    def __init__(
        self,
        key_or_fn: str | Callable[[int, int], object],
        condition: Callable[[int], bool],
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        *,
        name: str | None = None,
    ) -> None:
        if not isinstance(key_or_fn, str) and not callable(key_or_fn):
            raise TypeError(
                "key_or_fn must be a str (this rank's key) or a callable "
                f"(rank, world_size) -> key, got {key_or_fn!r}"
            )
        if isinstance(key_or_fn, str) and "\n" in key_or_fn:
            raise ValueError(f"key_or_fn must be a single-line key, got {key_or_fn!r}")
        if not callable(condition):
            raise TypeError(f"condition must be a callable (count) -> bool, got {condition!r}")
        if not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ValueError(f"name must be a non-empty str without '/' or None, got {name!r}")
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout
        self.name = name if name is not None else str(next(FilterGroupedByKey._counter))

    def __repr__(self) -> str:
        return (
            f"FilterGroupedByKey(key_or_fn={self.key_or_fn!r}, condition={self.condition!r}, "
            f"timeout={self.timeout!r}, name={self.name!r})"
        )

    @staticmethod
    def poll_limit(count: int) -> float:
        """Longest sleep between barrier polls for ``count`` ranks.

        Grows with the number of ranks so that the store's request rate stays
        bounded (about ``count / poll_limit`` polls per second at worst).
        """
        return min(0.05, max(0.005, count * 5e-6))

    def _key(self, state: State) -> str:
        if isinstance(self.key_or_fn, str):
            return self.key_or_fn
        key = self.key_or_fn(state.rank, state.world_size)
        key = key if isinstance(key, str) else str(key)
        if "\n" in key:
            raise ValueError(f"FilterGroupedByKey: key of rank {state.rank} spans lines: {key!r}")
        return key

    def __call__(self, state: State, terminated_ranks: set[int]) -> tuple[State, set[int]]:
        store = state.store
        if store is None:
            raise ValueError(
                "FilterGroupedByKey needs state.store (the Wrapper sets it); it exchanges "
                "the ranks' keys through the store"
            )
        if not isinstance(store, StoreMixin):
            raise TypeError(
                f"FilterGroupedByKey needs an inprocess.store.StoreMixin store, got "
                f"{type(store).__name__}"
            )
        try:
            terminated = set(_checked(state, terminated_ranks))
        except RankDiscarded:
            # A terminated rank takes no part; the final assignment discards it.
            return state, set(terminated_ranks)

        key = self._key(state)
        prefix = f"inprocess/filter_grouped_by_key/{self.name}"
        # One "rank=key" line per rank; keys are single-line, and the rank has no "=".
        store.append(f"{prefix}/keys", f"{state.rank}={key}\n")
        count = state.world_size - len(terminated)
        store.counted_barrier(
            f"{prefix}/barrier",
            str(state.rank),
            count,
            self.timeout,
            self.poll_limit(count),
        )
        keys = self._read_keys(store, f"{prefix}/keys")
        if len(keys) != count or not terminated.isdisjoint(keys):
            raise InternalError(
                f"FilterGroupedByKey {self.name}: got keys of {len(keys)} ranks, expected the "
                f"{count} surviving ranks"
            )

        sizes = collections.Counter(keys.values())
        failed = {group for group, size in sizes.items() if not self.condition(size)}
        dropped = {rank for rank, group in keys.items() if group in failed}
        if dropped:
            log.info(
                "FilterGroupedByKey %s: terminating %d ranks of %d groups that fail the condition",
                self.name,
                len(dropped),
                len(failed),
            )
        return state, terminated | dropped

    @staticmethod
    def _read_keys(store: StoreMixin, list_key: str) -> dict[int, str]:
        raw = store.get(list_key)
        text = raw.decode() if isinstance(raw, bytes) else raw
        keys: dict[int, str] = {}
        for line in text.split("\n"):
            rank, sep, key = line.partition("=")
            if sep:
                keys[int(rank)] = key
        return keys
