"""Rank filter: decides how many ranks are active; the others wait as spares.

Before the filter chain runs, the Wrapper sets ``state.active_world_size`` to
``state.world_size``; each :class:`RankFilter` may only lower it. Afterwards the
Wrapper derives every rank's mode with :meth:`inprocess.state.State.apply_active_world_size`:
ranks ``0 .. active_world_size-1`` are active and call the wrapped function,
the ranks after them are spares, activated when active ranks drop out.

Filters chain with :class:`inprocess.Compose` (the last listed runs first)::

    Compose(WorldSizeDivisibleBy(M), MaxActiveWorldSize(N))

gives the largest multiple of ``M`` that is at most ``N`` and at most the world size.
"""

from __future__ import annotations

import abc
import logging

from ..state import State

log = logging.getLogger(__name__)


class RankFilter(abc.ABC):
    """Base class of the ``rank_filter`` argument of :class:`inprocess.Wrapper`.

    ``__call__(state)`` sets ``state.active_world_size`` and returns the state.
    It runs on every rank with the same inputs and must reach the same result.
    """

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        raise NotImplementedError


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _active_world_size(state: State) -> int:
    active = state.active_world_size
    return state.world_size if active is None else min(active, state.world_size)


class MaxActiveWorldSize(RankFilter):
    """Caps the number of active ranks at ``max_active_world_size``.

    Ranks beyond the cap are kept as a pool of warm spares.
    """

    def __init__(self, max_active_world_size: int) -> None:
        self.max_active_world_size = _positive_int("max_active_world_size", max_active_world_size)

    def __call__(self, state: State) -> State:
        state.active_world_size = min(_active_world_size(state), self.max_active_world_size)
        return state

    def __repr__(self) -> str:
        return f"MaxActiveWorldSize({self.max_active_world_size})"


class WorldSizeDivisibleBy(RankFilter):
    """Rounds the number of active ranks down to a multiple of ``divisor``.

    Useful when the model needs whole groups of ranks (tensor or pipeline
    parallelism of size ``divisor``). Fewer ranks than ``divisor`` leaves none active.
    """

    def __init__(self, divisor: int = 1) -> None:
        self.divisor = _positive_int("divisor", divisor)

    def __call__(self, state: State) -> State:
        active = _active_world_size(state)
        state.active_world_size = active // self.divisor * self.divisor
        if state.active_world_size == 0:
            log.warning(
                "WorldSizeDivisibleBy(%d): only %d ranks, no rank is active",
                self.divisor,
                active,
            )
        return state

    def __repr__(self) -> str:
        return f"WorldSizeDivisibleBy({self.divisor})"
