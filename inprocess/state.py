"""Rank state: who this rank is in the current restart iteration.

:class:`State` is what the user callbacks (initialize, abort, finalize, health
check, rank assignment, rank filter) receive and return. It is a plain mutable
dataclass so callbacks written for the seed API (``state.rank = ...``) work.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any


class Mode(enum.Enum):
    """What a rank does in the current iteration."""

    #: calls the wrapped function
    ACTIVE = "active"
    #: a spare: waits, ready to be activated in a later iteration
    INACTIVE = "inactive"
    #: left the job (dead, unhealthy or discarded); never comes back
    TERMINATED = "terminated"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as ex:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from ex


@dataclasses.dataclass
class State:
    """State of one rank in one restart iteration.

    Constructed with no arguments it describes this process as launched:
    ``RANK`` and ``WORLD_SIZE`` from the environment (0 and 1 when unset).

    Attributes:
        rank: rank among all ranks (active and inactive) of this iteration.
        world_size: number of ranks (active and inactive) of this iteration.
        active_world_size: number of active ranks; ranks ``0 .. active_world_size-1``
            are active, the others are spares.
        initial_rank: rank this process was launched with (``RANK``).
        initial_world_size: world size the job was launched with (``WORLD_SIZE``).
        iteration: index of the restart iteration, 0 for the first call.
        mode: :class:`Mode` of this rank, derived by the rank filter.
        store: the iteration's distributed store (set by the Wrapper; used by
            rank assignments that exchange information, e.g. ``FilterGroupedByKey``).
        fn_exception: the exception that ended the previous iteration on this
            rank, if any. Copies of a state share it; it is never deep-copied.
    """

    rank: int | None = None
    world_size: int | None = None
    active_world_size: int | None = None
    initial_rank: int | None = None
    initial_world_size: int | None = None
    iteration: int = 0
    mode: Mode = Mode.ACTIVE
    store: Any = dataclasses.field(default=None, repr=False, compare=False)
    fn_exception: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rank is None:
            self.rank = _env_int("RANK", 0)
        if self.world_size is None:
            self.world_size = _env_int("WORLD_SIZE", 1)
        if self.initial_rank is None:
            self.initial_rank = self.rank
        if self.initial_world_size is None:
            self.initial_world_size = self.world_size
        if self.active_world_size is None:
            self.active_world_size = self.world_size
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def active_rank(self) -> int | None:
        """Rank among active ranks, ``None`` for an inactive rank."""
        return self.rank if self.mode == Mode.ACTIVE else None

    def activate_all(self) -> None:
        """Makes every rank active (the state before any rank filter runs)."""
        self.active_world_size = self.world_size
        self.mode = Mode.ACTIVE

    def apply_active_world_size(self) -> None:
        """Derives :attr:`mode` from :attr:`active_world_size`: the first ranks are active."""
        if not isinstance(self.active_world_size, int):
            raise ValueError(
                f"active_world_size must be an int in [0, {self.world_size}], "
                f"got {self.active_world_size!r}"
            )
        if not 0 <= self.active_world_size <= self.world_size:
            raise ValueError(
                f"active_world_size must be in [0, {self.world_size}], got {self.active_world_size}"
            )
        self.mode = Mode.ACTIVE if self.rank < self.active_world_size else Mode.INACTIVE

    def copy(self) -> State:
        """A shallow copy: the store and the exception are shared, not copied."""
        return dataclasses.replace(self)
