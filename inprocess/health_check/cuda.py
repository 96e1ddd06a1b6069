"""CUDA health check: the rank's GPU drains its queued work in time."""

from __future__ import annotations

import datetime
import logging

import torch

from ..exception import HealthCheckError
from ..exception import TimeoutError as RestartTimeoutError
from ..state import State, shaped_result
from ..timeouts import call_with_timeout
from .base import HealthCheck, env_local_rank

log = logging.getLogger(__name__)


def _check_timeout(timeout: object) -> datetime.timedelta:
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


class CudaHealthCheck(HealthCheck):
    """Waits for this rank's GPU to drain its work, under a timeout.

    ``torch.cuda.synchronize()`` returns once every kernel queued by the failed
    iteration has finished, and raises if the CUDA context is corrupted (a
    sticky error such as an illegal memory access). A GPU that does not drain
    within ``timeout`` (a kernel stuck forever) makes the rank unhealthy.

    The device is the one of ``LOCAL_RANK`` when set and visible, else the
    current device. A process that never initialized CUDA has nothing queued:
    the check passes without touching (and initializing) CUDA.
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=30)) -> None:
        self.timeout = _check_timeout(timeout)

    def __repr__(self) -> str:
        return f"CudaHealthCheck(timeout={self.timeout!r})"

    @staticmethod
    def _device() -> int:
        local_rank = env_local_rank()
        if local_rank is not None and 0 <= local_rank < torch.cuda.device_count():
            return local_rank
        return torch.cuda.current_device()

    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        if not torch.cuda.is_initialized() or not torch.cuda.is_available():
            log.debug("CUDA is not initialized in this process: nothing to check")
            return shaped_result(state, train_ex)
        try:
            device = self._device()
        except Exception as ex:
            raise HealthCheckError(f"cannot select the CUDA device to check: {ex}") from ex
        try:
            call_with_timeout(
                lambda: torch.cuda.synchronize(device),
                self.timeout.total_seconds(),
                "inprocess-cuda-health",
            )
        except RestartTimeoutError as ex:
            raise HealthCheckError(
                f"CUDA device {device}: torch.cuda.synchronize() did not finish within "
                f"{self.timeout.total_seconds():.3g}s (the GPU is hung or overloaded)"
            ) from ex
        except Exception as ex:
            raise HealthCheckError(
                f"CUDA device {device}: torch.cuda.synchronize() failed: {ex}"
            ) from ex
        log.debug("CUDA device %d synchronized", device)
        return shaped_result(state, train_ex)
