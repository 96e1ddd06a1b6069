"""The base class of rank assignments, and the checks and renumbering they share."""

from __future__ import annotations

import abc
import bisect
import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from ..exception import RestartError
from ..state import Mode, State

log = logging.getLogger(__name__)


class RankDiscarded(RestartError):
    """This rank is among the terminated ranks and takes no part in the next iteration."""


@dataclasses.dataclass
class RankAssignmentCtx:
    """What a rank assignment of the API's newer generation receives and returns.

    Newer-generation assignments are called as ``assignment(ctx) -> ctx``
    (the usage guide's generation: ``assignment(state, terminated_ranks) ->
    (state, terminated_ranks)``). The fields mean the same in both:

    Attributes:
        state: this rank's :class:`~inprocess.state.State` in the numbering of
            the iteration that just ended; an assignment updates it.
        store: the iteration's distributed store (for assignments that
            exchange rank-local facts).
        terminated_ranks: ranks of the ended iteration that must not continue
            and are not yet handled; a final assignment returns an empty set.
    """

    state: State
    store: Any
    terminated_ranks: set[int]


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


def _in_ctx(
    assignment: Any, ctx: RankAssignmentCtx
) -> RankAssignmentCtx:
    """Runs a guide-shaped ``assignment(state, terminated_ranks)`` on a newer-generation ctx.

    The built-in assignments serve both generations: called with one
    :class:`RankAssignmentCtx` they answer with one (``ctx -> ctx``), called with
    ``(state, terminated_ranks)`` with the tuple.
    """
    if not isinstance(ctx, RankAssignmentCtx):
        raise TypeError(
            f"{assignment!r} takes (state, terminated_ranks) or one RankAssignmentCtx, "
            f"got {type(ctx).__name__}"
        )
    if ctx.state.store is None:
        ctx.state.store = ctx.store
    state, unhandled = assignment(ctx.state, ctx.terminated_ranks)
    return RankAssignmentCtx(state, ctx.store, set(unhandled))


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
    state.active_rank = new_rank if state.mode == Mode.ACTIVE else None
