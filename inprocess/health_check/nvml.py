"""NVML health check: asks the NVIDIA driver whether the rank's GPU needs attention."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..exception import HealthCheckError
from ..state import State, shaped_result
from .base import HealthCheck, env_local_rank

log = logging.getLogger(__name__)


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
        local_rank = env_local_rank()
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
        return shaped_result(state, train_ex)

    def _missing(
        self, state: State, train_ex: BaseException | None, reason: str
    ) -> tuple[State, BaseException | None]:
        if self.on_missing == "fail":
            raise HealthCheckError(
                f"NVML is not available: {reason} (use on_missing='skip' to pass without NVML)"
            )
        log.info("NVML health check skipped: %s", reason)
        return shaped_result(state, train_ex)

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
