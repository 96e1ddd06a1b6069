"""A filter assignment: terminates whole groups of ranks (a node, a rack)."""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
from collections.abc import Callable

from ..exception import InternalError
from ..state import State
from ..store import StoreMixin
from .base import RankAssignment, RankAssignmentCtx, RankDiscarded, _checked, _in_ctx

log = logging.getLogger(__name__)


class FilterGroupedByKey(RankAssignment):
    """Terminates whole groups of ranks whose healthy member count fails ``condition``.

    Ranks are grouped by a key: ``key_or_fn`` is the key itself (a value that
    may differ between ranks, e.g. ``socket.gethostname()`` or ``rank // 8``)
    or a callable ``(rank, world_size) -> key`` evaluated on each rank for
    itself. Keys are exchanged through ``state.store``, so they may be
    rank-local facts that no other rank could compute. A key that is not a
    string, given or computed, is converted with ``str`` (as the API's other
    generations accept any key value, e.g. an ``int``).

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
        key_or_fn: object,
        condition: Callable[[int], bool],
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        *,
        name: str | None = None,
    ) -> None:
        if key_or_fn is None:
            raise TypeError(
                "key_or_fn must be this rank's key (a str, or a value such as an int, "
                "compared as its str) or a callable computing it, got None"
            )
        if not callable(key_or_fn) and not isinstance(key_or_fn, str):
            # A plain value is this rank's key, compared as its str; converted once here.
            key_or_fn = str(key_or_fn)
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
        count = state.world_size - len(terminated)
        # One "rank=key" line per rank; keys are single-line, and the rank has no "=".
        lines = store.all_gather_lines(
            prefix,
            str(state.rank),
            f"{state.rank}={key}",
            count,
            self.timeout,
            self.poll_limit(count),
        )
        keys = self._parse_keys(lines)
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
    def _parse_keys(lines: list[str]) -> dict[int, str]:
        keys: dict[int, str] = {}
        for line in lines:
            rank, sep, key = line.partition("=")
            if sep:
                keys[int(rank)] = key
        return keys


class FilterCountGroupedByKey(FilterGroupedByKey):
    """The newer generation's group filter: ``ctx -> ctx``; the key from the state.

    Like :class:`FilterGroupedByKey` (same store exchange, same condition on the
    count of surviving ranks of each group), but ``key_or_fn`` is the key (any
    value, compared as its ``str``) or a callable ``(state) -> key`` evaluated on
    each rank for itself, and it is called
    with one :class:`~inprocess.rank_assignment.RankAssignmentCtx`. Follow it with
    an assignment that discards the terminated ranks::

        Compose(ActivateAllRanks(), ShiftRanks(), FilterCountGroupedByKey(...))
    """

    def _key(self, state: State) -> str:
        if isinstance(self.key_or_fn, str):
            return self.key_or_fn
        key = self.key_or_fn(state)
        key = key if isinstance(key, str) else str(key)
        if "\n" in key:
            raise ValueError(
                f"FilterCountGroupedByKey: key of rank {state.rank} spans lines: {key!r}"
            )
        return key

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:  # type: ignore[override]
        return _in_ctx(super().__call__, ctx)

    def __repr__(self) -> str:
        return "Count" + super().__repr__().replace("FilterGroupedByKey", "GroupedByKey", 1)
