"""Health check: decides, locally, whether this rank may take part in the next iteration.

A :class:`HealthCheck` runs on each rank after a fault (after abort and
finalize) and before the first iteration. It looks only at this rank: other
ranks may be dead or still running. It reports an unhealthy rank by raising,
preferably :class:`inprocess.exception.HealthCheckError`; the Wrapper then
removes the rank from the job. Health checks chain with :class:`inprocess.Compose`.
"""

from __future__ import annotations

import abc
import datetime
import logging
import os
from typing import Any

import torch

from .exception import HealthCheckError
from .exception import TimeoutError as RestartTimeoutError
from .monitor_thread import RankShouldRestart
from .state import State
from .timeouts import call_with_timeout

log = logging.getLogger(__name__)


class HealthCheck(abc.ABC):
    """Base class of the ``health_check`` argument of :class:`inprocess.Wrapper`.

    ``__call__(state, train_ex=None)`` returns ``(state, train_ex)`` when the
    rank is healthy and raises when it is not. ``train_ex`` is the exception that
    ended the wrapped function on this rank, if any. The Wrapper uses a returned
    ``State`` (alone or first in a tuple) and ignores any other return value.

    Run at the start of an iteration (``train_ex=None``), a failing check is a
    fault of that iteration and every rank restarts; run after a fault, it ends
    this rank with a :class:`~inprocess.exception.HealthCheckError` whose
    ``__cause__`` is ``train_ex``.
    """

    @abc.abstractmethod
    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        raise NotImplementedError


def _check_timeout(timeout: object) -> datetime.timedelta:
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def _local_rank() -> int | None:
    value = os.environ.get("LOCAL_RANK")
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("ignoring LOCAL_RANK=%r: not an integer", value)
        return None


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
        local_rank = _local_rank()
        if local_rank is not None and 0 <= local_rank < torch.cuda.device_count():
            return local_rank
        return torch.cuda.current_device()

    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        if not torch.cuda.is_initialized() or not torch.cuda.is_available():
            log.debug("CUDA is not initialized in this process: nothing to check")
            return state, train_ex
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
        return state, train_ex


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
        if train_ex is None or isinstance(train_ex, RankShouldRestart):
            return state, train_ex
        self.faults_count += 1
        log.debug("rank %s: fault %d (%r)", state.rank, self.faults_count, train_ex)
        if self.max_rank_faults is not None and self.faults_count > self.max_rank_faults:
            raise FaultCounterExceeded(
                f"rank {state.rank} (initial rank {state.initial_rank}) had "
                f"{self.faults_count} faults, more than max_rank_faults={self.max_rank_faults}"
            ) from train_ex
        return state, train_ex


# NVML return codes that mean "this query cannot be answered here" rather than
# "the GPU is in trouble" (names as pynvml defines them).
_UNANSWERABLE = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_INVALID_ARGUMENT",
)

# c_nvmlFieldValue_t.valueType -> member of the value union
_VALUE_MEMBERS = {
    "NVML_VALUE_TYPE_DOUBLE": "dVal",
    "NVML_VALUE_TYPE_UNSIGNED_INT": "uiVal",
    "NVML_VALUE_TYPE_UNSIGNED_LONG": "ulVal",
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": "ullVal",
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": "sllVal",
    "NVML_VALUE_TYPE_SIGNED_INT": "siVal",
    "NVML_VALUE_TYPE_UNSIGNED_SHORT": "usVal",
}


class _NvmlMissing(Exception):
    """NVML, or the device to check, is not there (as opposed to: the device is unwell)."""


class NVMLHealthCheck(HealthCheck):
    """Asks the NVIDIA driver (NVML) whether this rank's GPU needs attention.

    Reports the rank unhealthy when NVML says that, for this GPU:

    * retired memory pages are pending (older GPUs: a reset is needed to retire them),
    * a DRAM row remapping is pending or has failed (newer GPUs),
    * a recovery action is required (GPU reset, drain, node reboot, ...), where
      the installed ``pynvml`` and the driver support the query,
    * or the GPU cannot be queried at all (lost, reset required).

    Queries that the GPU or driver does not support are skipped.

    Args:
        device_index: CUDA index of the GPU as this process sees it (after
            ``CUDA_VISIBLE_DEVICES``); default ``LOCAL_RANK``, else 0. It is mapped
            to the NVML device through ``CUDA_VISIBLE_DEVICES`` when that is set.
        on_missing: what to do when NVML or the device is not available (no
            driver, no GPU, ``pynvml`` not installed): ``"fail"`` raises
            :class:`inprocess.exception.HealthCheckError`, ``"skip"`` passes.
    """

    ON_MISSING = ("fail", "skip")

    def __init__(self, device_index: int | None = None, on_missing: str = "fail") -> None:
        if device_index is not None and (
            not isinstance(device_index, int) or isinstance(device_index, bool)
        ):
            raise TypeError(f"device_index must be an int >= 0 or None, got {device_index!r}")
        if device_index is not None and device_index < 0:
            raise ValueError(f"device_index must be >= 0 or None, got {device_index}")
        if on_missing not in self.ON_MISSING:
            raise ValueError(f"on_missing must be one of {self.ON_MISSING}, got {on_missing!r}")
        self.device_index = device_index
        self.on_missing = on_missing

    def __repr__(self) -> str:
        return f"NVMLHealthCheck(device_index={self.device_index}, on_missing={self.on_missing!r})"

    def _cuda_index(self) -> int:
        if self.device_index is not None:
            return self.device_index
        local_rank = _local_rank()
        return local_rank if local_rank is not None else 0

    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        try:
            import pynvml
        except ImportError as ex:
            return self._missing(state, train_ex, f"pynvml cannot be imported ({ex})")
        try:
            pynvml.nvmlInit()
        except Exception as ex:
            return self._missing(state, train_ex, f"nvmlInit failed: {_describe(ex)}")
        cuda_index = self._cuda_index()
        try:
            handle, label = self._handle(pynvml, cuda_index)
            findings = self._findings(pynvml, handle)
        except _NvmlMissing as ex:
            return self._missing(state, train_ex, str(ex))
        except HealthCheckError:
            raise
        except Exception as ex:
            raise HealthCheckError(
                f"NVML health check of CUDA device {cuda_index} failed: {_describe(ex)}"
            ) from ex
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception as ex:
                log.debug("nvmlShutdown failed: %s", _describe(ex))
        if findings:
            raise HealthCheckError(f"GPU {label} is unhealthy: {'; '.join(findings)}")
        log.debug("NVML health check of GPU %s passed", label)
        return state, train_ex

    def _missing(
        self, state: State, train_ex: BaseException | None, reason: str
    ) -> tuple[State, BaseException | None]:
        if self.on_missing == "fail":
            raise HealthCheckError(
                f"NVML is not available: {reason} (use on_missing='skip' to pass without NVML)"
            )
        log.info("NVML health check skipped: %s", reason)
        return state, train_ex

    @staticmethod
    def _handle(pynvml: Any, cuda_index: int) -> tuple[Any, str]:
        """NVML handle of CUDA device ``cuda_index`` and a label for messages."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        entry: str | None = None
        if visible is not None and visible.strip():
            entries = [item.strip() for item in visible.split(",") if item.strip()]
            if cuda_index >= len(entries):
                raise _NvmlMissing(
                    f"CUDA device {cuda_index} is not among CUDA_VISIBLE_DEVICES={visible!r}"
                )
            entry = entries[cuda_index]
        if entry is None or entry.isdigit():
            index = cuda_index if entry is None else int(entry)
            count = _call(pynvml, "nvmlDeviceGetCount")
            if index >= count:
                raise _NvmlMissing(f"GPU {index} does not exist (NVML sees {count} GPUs)")
            return _call(pynvml, "nvmlDeviceGetHandleByIndex", index), str(index)
        handle = _call(pynvml, "nvmlDeviceGetHandleByUUID", entry)
        if entry.startswith("MIG-"):
            # Memory health belongs to the physical GPU that holds the MIG instance.
            handle = _call(pynvml, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        return handle, entry

    @staticmethod
    def _findings(pynvml: Any, handle: Any) -> list[str]:
        findings: list[str] = []

        pending = _query(pynvml, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if pending is not None and pending == getattr(pynvml, "NVML_FEATURE_ENABLED", 1):
            findings.append("retired memory pages are pending (the GPU needs a reset)")

        rows = _query(pynvml, "nvmlDeviceGetRemappedRows", handle)
        if rows is not None:
            _corrected, _uncorrected, remap_pending, remap_failed = rows
            if remap_pending:
                findings.append("a DRAM row remapping is pending (the GPU needs a reset)")
            if remap_failed:
                findings.append("a DRAM row remapping failed")

        field = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is not None:
            action = _field_value(pynvml, handle, field)
            if action is not None and action != getattr(pynvml, "NVML_GPU_RECOVERY_ACTION_NONE", 0):
                findings.append(
                    f"the driver requires a recovery action: {_action_name(pynvml, action)}"
                )
        return findings


def _describe(ex: BaseException) -> str:
    return f"{type(ex).__name__}: {ex}"


def _error_code(pynvml: Any, name: str) -> int | None:
    return getattr(pynvml, name, None)


def _is_unanswerable(pynvml: Any, ex: BaseException) -> bool:
    code = getattr(ex, "value", None)
    return code is not None and code in {_error_code(pynvml, name) for name in _UNANSWERABLE}


def _call(pynvml: Any, name: str, *args: Any) -> Any:
    """Calls ``pynvml.<name>``; a function that the module lacks means NVML is too old."""
    fn = getattr(pynvml, name, None)
    if fn is None:
        raise _NvmlMissing(f"the installed pynvml has no {name}")
    return fn(*args)


def _query(pynvml: Any, name: str, handle: Any) -> Any:
    """Result of ``pynvml.<name>(handle)``, or ``None`` where the query is not supported."""
    fn = getattr(pynvml, name, None)
    if fn is None:
        log.debug("pynvml has no %s: check skipped", name)
        return None
    try:
        return fn(handle)
    except pynvml.NVMLError as ex:
        if _is_unanswerable(pynvml, ex):
            log.debug("%s not answered (%s): check skipped", name, ex)
            return None
        raise


def _field_value(pynvml: Any, handle: Any, field: int) -> float | int | None:
    """Value of one NVML field, or ``None`` where it is not supported."""
    fn = getattr(pynvml, "nvmlDeviceGetFieldValues", None)
    if fn is None:
        log.debug("pynvml has no nvmlDeviceGetFieldValues: check skipped")
        return None
    try:
        values = fn(handle, [field])
    except pynvml.NVMLError as ex:
        if _is_unanswerable(pynvml, ex):
            log.debug("field %d not answered (%s): check skipped", field, ex)
            return None
        raise
    value = values[0]
    status = getattr(value, "nvmlReturn", 0)
    if status != getattr(pynvml, "NVML_SUCCESS", 0):
        if status in {_error_code(pynvml, name) for name in _UNANSWERABLE}:
            log.debug("field %d not supported (return code %d): check skipped", field, status)
            return None
        raise pynvml.NVMLError(status)
    member = "uiVal"
    for type_name, candidate in _VALUE_MEMBERS.items():
        if getattr(pynvml, type_name, None) == value.valueType:
            member = candidate
            break
    return getattr(value.value, member)


def _action_name(pynvml: Any, action: float | int) -> str:
    prefix = "NVML_GPU_RECOVERY_ACTION_"
    for name in dir(pynvml):
        if name.startswith(prefix) and getattr(pynvml, name) == action:
            return f"{name[len(prefix) :].lower().replace('_', ' ')} ({name}={action})"
    return f"unknown action {action}"
