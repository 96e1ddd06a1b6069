"""Final assignments: renumber the survivors without gaps."""

from __future__ import annotations

import bisect
from typing import Any

from .base import RankAssignment, _assign, _checked, _in_ctx


class ShiftRanks(RankAssignment):
    """Closes the gaps left by terminated ranks by shifting survivors down.

    Survivors keep their relative order; the new world size is the old one less
    the number of terminated ranks. Example, 8 ranks with ``{1, 4, 5}`` terminated::

        old rank   0  1  2  3  4  5  6  7
        new rank   0  x  1  2  x  x  3  4

    Simple and order-preserving, but every rank above the first gap changes its
    rank (and so, often, its data shard or pipeline stage).
    """

    def __call__(self, state: Any, terminated_ranks: set[int] | None = None) -> Any:
        if terminated_ranks is None:  # the newer generation's shape: ctx -> ctx
            return _in_ctx(self, state)
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

    def __call__(self, state: Any, terminated_ranks: set[int] | None = None) -> Any:
        if terminated_ranks is None:  # the newer generation's shape: ctx -> ctx
            return _in_ctx(self, state)
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
