"""Rank state: who this rank is in the current restart iteration.

:class:`State` is what the user callbacks (initialize, abort, finalize, health
check, rank assignment, rank filter) receive and return. It is a plain mutable
dataclass so callbacks written for the seed API (``state.rank = ...``) work.

Callbacks of the API's newer generation receive a read-only snapshot instead,
:class:`FrozenState` (:meth:`State.freeze`), with the exception that ended the
iteration in ``fn_exception``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any


class Mode(enum.Enum):
    """What a rank does in the current iteration."""

    #: the state was built, no rank assignment has run yet (newer generation)
    INITIALIZED = "initialized"
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
        active_rank: rank among active ranks, ``None`` for an inactive rank.
            Kept equal to ``rank`` for active ranks by the usage guide's filters
            (:meth:`apply_active_world_size`); a newer-generation rank assignment
            may set it on its own (it is the ``RANK`` the function sees).
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
    active_rank: int | None = dataclasses.field(default=None, compare=False)

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
        if self.active_rank is None and self.mode == Mode.ACTIVE:
            self.active_rank = self.rank

    def activate_all(self) -> None:
        """Makes every rank active (the state before any rank filter runs)."""
        self.active_world_size = self.world_size
        self.mode = Mode.ACTIVE
        self.active_rank = self.rank

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
        self.active_rank = self.rank if self.mode == Mode.ACTIVE else None

    def copy(self) -> State:
        """A shallow copy: the store and the exception are shared, not copied."""
        return dataclasses.replace(self)

    def freeze(self) -> FrozenState:
        """A read-only snapshot, what the newer generation's callbacks receive."""
        fields = dataclasses.fields(FrozenState)
        return FrozenState(**{f.name: getattr(self, f.name) for f in fields})


@dataclasses.dataclass(frozen=True)
class FrozenState:
    """A read-only :class:`State` (without the store): the argument of the API's
    newer generation of callbacks (``Initialize``, ``Abort``, ``Finalize``,
    ``HealthCheck``, ``Completion``, ``Terminate``: ``(frozen_state) ->
    frozen_state``). Assigning a field raises ``dataclasses.FrozenInstanceError``.

    ``fn_exception`` is the exception that ended the function in this
    iteration (what the usage guide's callbacks get as a second argument).
    """

    rank: int
    world_size: int
    active_rank: int | None
    active_world_size: int | None
    initial_rank: int
    initial_world_size: int
    iteration: int
    mode: Mode
    fn_exception: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)


def shaped_result(state: Any, train_ex: BaseException | None) -> Any:
    """What a built-in finalize or health check returns, in the shape it was called with:
    ``(state, train_ex)`` for the usage guide's, the frozen state for the newer generation's."""
    return state if isinstance(state, FrozenState) else (state, train_ex)


def exception_of(state: Any, train_ex: BaseException | None) -> BaseException | None:
    """The exception a finalize or health check is about, in either generation's shape."""
    if train_ex is None and isinstance(state, FrozenState):
        return state.fn_exception
    return train_ex
