"""Fault counter: a rank that fails too often is declared unhealthy."""

from __future__ import annotations

import logging

from ..exception import HealthCheckError
from ..monitor_thread import RankShouldRestart
from ..state import State, exception_of, shaped_result
from .base import HealthCheck

log = logging.getLogger(__name__)


class FaultCounterExceeded(HealthCheckError):
    """This rank failed more often than ``FaultCounter.max_rank_faults`` allows."""


class FaultCounter(HealthCheck):
    """Counts the faults of this rank and declares it unhealthy past a limit.

    A fault of this rank is a call with ``train_ex`` set to an exception of the
    wrapped function. The restart signal
    (:class:`inprocess.monitor_thread.RankShouldRestart`), which interrupts
    every rank when any rank fails, is not this rank's fault and is not counted.
    With ``max_rank_faults=N``, the ``N+1``-th fault raises
    :class:`FaultCounterExceeded`; ``None`` counts without a limit. The count
    lasts for the life of the instance, across restart iterations.
    """

    def __init__(self, max_rank_faults: int | None = None) -> None:
        if max_rank_faults is not None and (
            not isinstance(max_rank_faults, int) or isinstance(max_rank_faults, bool)
        ):
            raise TypeError(f"max_rank_faults must be an int >= 0 or None, got {max_rank_faults!r}")
        if max_rank_faults is not None and max_rank_faults < 0:
            raise ValueError(f"max_rank_faults must be >= 0 or None, got {max_rank_faults}")
        self.max_rank_faults = max_rank_faults
        self.faults_count = 0

    def __repr__(self) -> str:
        return f"FaultCounter(max_rank_faults={self.max_rank_faults})"

    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        train_ex = exception_of(state, train_ex)
        if train_ex is None or isinstance(train_ex, RankShouldRestart):
            return shaped_result(state, train_ex)
        self.faults_count += 1
        log.debug("rank %s: fault %d (%r)", state.rank, self.faults_count, train_ex)
        if self.max_rank_faults is not None and self.faults_count > self.max_rank_faults:
            raise FaultCounterExceeded(
                f"rank {state.rank} (initial rank {state.initial_rank}) had "
                f"{self.faults_count} faults, more than max_rank_faults={self.max_rank_faults}"
            ) from train_ex
        return shaped_result(state, train_ex)
