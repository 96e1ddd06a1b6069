"""Rank filter: decides how many ranks are active; the others wait as spares.

Before the filter chain runs, the Wrapper sets ``state.active_world_size`` to
``state.world_size``; each :class:`RankFilter` may only lower it. Afterwards the
Wrapper derives every rank's mode with :meth:`inprocess.state.State.apply_active_world_size`:
ranks ``0 .. active_world_size-1`` are active and call the wrapped function,
the ranks after them are spares, activated when active ranks drop out.

Filters chain with :class:`inprocess.Compose` (the last listed runs first)::

    Compose(WorldSizeDivisibleBy(M), MaxActiveWorldSize(N))

gives the largest multiple of ``M`` that is at most ``N`` and at most the world size.

In the API's newer generation the same filters are steps of the rank
assignment (called with a ``RankAssignmentCtx``), and they set each rank's mode
and ``active_rank`` themselves: ``Compose(MaxActiveWorldSize(N), ShiftRanks())``.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

from ..state import State
from .base import RankAssignment, RankAssignmentCtx

log = logging.getLogger(__name__)


class RankFilter(RankAssignment):
    """Base class of rank filters, in both generations of the API.

    * The usage guide's: the ``rank_filter`` argument of :class:`inprocess.Wrapper`,
      ``__call__(state) -> state``, sets ``state.active_world_size``.
    * The newer generation's: a step of ``rank_assignment`` (hence a
      :class:`RankAssignment`), ``__call__(ctx) -> ctx``, sets the active world
      size and each rank's mode and ``active_rank``; compose it after the
      assignment that renumbers, e.g. ``Compose(MaxActiveWorldSize(8), ShiftRanks())``.

    One class serves both: the built-in filters answer in the shape they were
    called with (a :class:`RankAssignmentCtx` or a state), so
    ``inprocess.rank_filter.MaxActiveWorldSize`` and
    ``inprocess.rank_assignment.MaxActiveWorldSize`` are the same class. A
    filter runs on every rank with the same inputs and must reach the same result.
    """

    @abc.abstractmethod
    def __call__(self, state: Any) -> Any:
        raise NotImplementedError


class _Limit(RankFilter):
    """A filter that lowers the active world size: the first ranks stay active."""

    def _limit(self, active: int) -> int:
        raise NotImplementedError

    def __call__(self, state: Any) -> Any:
        if isinstance(state, RankAssignmentCtx):  # the newer generation: decides modes too
            state.state.active_world_size = self._limit(_active_world_size(state.state))
            state.state.apply_active_world_size()
            return state
        state.active_world_size = self._limit(_active_world_size(state))
        return state


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _active_world_size(state: State) -> int:
    active = state.active_world_size
    return state.world_size if active is None else min(active, state.world_size)


class ActivateAllRanks(RankFilter):
    """Makes every rank active (the newer generation's default filter).

    ``Compose(ActivateAllRanks(), ShiftRanks())`` is the newer generation's
    default ``rank_assignment``; the usage guide's Wrapper activates every
    rank before its ``rank_filter`` runs, which is the same.
    """

    def __call__(self, state: Any) -> Any:
        target = state.state if isinstance(state, RankAssignmentCtx) else state
        target.activate_all()
        return state

    def __repr__(self) -> str:
        return "ActivateAllRanks()"


class MaxActiveWorldSize(_Limit):
    """Caps the number of active ranks at ``max_active_world_size``.

    Ranks beyond the cap are kept as a pool of warm spares.
    """

    def __init__(self, max_active_world_size: int) -> None:
        self.max_active_world_size = _positive_int("max_active_world_size", max_active_world_size)

    def _limit(self, active: int) -> int:
        if self.max_active_world_size is None:
            return active
        return min(active, self.max_active_world_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.max_active_world_size})"


class MaxActiveWorldSizeOrNone(MaxActiveWorldSize):
    """The newer generation's :class:`MaxActiveWorldSize` (``inprocess.rank_assignment``'s).

    The same filter, except that ``None``, its default, sets no cap (the usage
    guide's class rejects ``None``, and keeps doing so).
    """

    def __init__(self, max_active_world_size: int | None = None) -> None:
        if max_active_world_size is None:
            self.max_active_world_size = None
        else:
            super().__init__(max_active_world_size)

    def __repr__(self) -> str:
        return f"MaxActiveWorldSize({self.max_active_world_size})"


class WorldSizeDivisibleBy(_Limit):
    """Rounds the number of active ranks down to a multiple of ``divisor``.

    Useful when the model needs whole groups of ranks (tensor or pipeline
    parallelism of size ``divisor``). Fewer ranks than ``divisor`` leaves none active.
    """

    def __init__(self, divisor: int = 1) -> None:
        self.divisor = _positive_int("divisor", divisor)

    def _limit(self, active: int) -> int:
        limited = active // self.divisor * self.divisor
        if limited == 0:
            log.warning("%r: only %d ranks, no rank is active", self, active)
        return limited

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.divisor})"


class ActiveWorldSizeDivisibleBy(WorldSizeDivisibleBy):
    """The newer generation's name of :class:`WorldSizeDivisibleBy` (same behaviour)."""
