"""Initialize: runs at the start of every restart iteration, the first one included.

A standard ``Exception`` raised by an initializer makes the iteration fail and
be restarted; a ``BaseException`` (such as :class:`inprocess.exception.RestartAbort`)
ends the Wrapper.
"""

from __future__ import annotations

import abc
import logging

from .exception import RestartAbort
from .state import State

log = logging.getLogger(__name__)


class Initialize(abc.ABC):
    """Base class of the ``initialize`` argument of :class:`inprocess.Wrapper`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        raise NotImplementedError


class RetryController(Initialize):
    """Ends the Wrapper (``RestartAbort``) when restarting is no longer worth it.

    Args:
        max_iterations: how many iterations may run (``None``: unlimited);
            ``max_iterations=3`` lets the function run at most 3 times, i.e. restart
            at most twice.
        min_world_size: fewest ranks (active and spare) to go on with.
        min_active_world_size: fewest active ranks to go on with.

    Every rank sees the same iteration and world sizes, so every rank raises at
    the same iteration and the whole job stops together.
    """

    def __init__(
        self,
        max_iterations: int | None = None,
        min_world_size: int = 1,
        min_active_world_size: int = 1,
    ) -> None:
        if max_iterations is not None and (
            not isinstance(max_iterations, int) or isinstance(max_iterations, bool)
        ):
            raise TypeError(f"max_iterations must be an int or None, got {max_iterations!r}")
        if max_iterations is not None and max_iterations < 1:
            raise ValueError(f"max_iterations must be >= 1 or None, got {max_iterations}")
        for name, value in (
            ("min_world_size", min_world_size),
            ("min_active_world_size", min_active_world_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_iterations = max_iterations
        self.min_world_size = min_world_size
        self.min_active_world_size = min_active_world_size

    def __call__(self, state: State) -> State:
        if self.max_iterations is not None and state.iteration >= self.max_iterations:
            raise RestartAbort(
                f"RetryController: iteration={state.iteration} reached the limit "
                f"max_iterations={self.max_iterations}"
            )
        if state.world_size < self.min_world_size:
            raise RestartAbort(
                f"world size {state.world_size} is below min_world_size={self.min_world_size}"
            )
        if state.active_world_size < self.min_active_world_size:
            raise RestartAbort(
                f"active world size {state.active_world_size} is below "
                f"min_active_world_size={self.min_active_world_size}"
            )
        return state
