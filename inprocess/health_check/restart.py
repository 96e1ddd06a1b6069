"""Restart health checks of the rank's own devices: GPU, NVLink, NIC (the newest generation's).

Each check looks at the devices of this rank only (``device_index``, default
``LOCAL_RANK``), runs after a fault, and chains with the others:

* :class:`ChainedGPUHealthCheck`: NVML's view of the GPU (pending page
  retirement or row remapping, a required recovery action, a GPU that cannot
  be queried) and, after a fault that was a CUDA error, whether this
  process's CUDA context still works; a failure is a fault of this rank
  (``HealthCheckError``);
* :class:`ChainedNVLHealthCheck`: NVLink links of the GPU that NVML reports
  inactive; a failure is logged and ignored (a degraded link slows the job,
  it does not corrupt it, and the peer GPU's own check decides for its rank);
* :class:`ChainedNicHealthCheck`: InfiniBand ports whose ``link_downed``
  counter grew since the check was built; a failure is a fault of this rank.

Where NVML, the GPU or the NIC counters are absent (a CPU machine), a check
passes and says once, at INFO, why it checked nothing.
:func:`restart_health_checks` chains them with the user's check: NIC, NVLink,
GPU, then the user's.

Each takes either generation's arguments (``(state, exception)`` or
``(frozen_state)``) and returns them unchanged.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any

from .. import device_fault
from ..compose import Compose
from ..exception import HealthCheckError
from .base import HealthCheck, env_local_rank
from .nvml import NVMLHealthCheck, _describe, _is_unanswerable

log = logging.getLogger(__name__)

#: ``sysfs`` directory of the InfiniBand devices
IB_SYSFS = "/sys/class/infiniband"


@functools.lru_cache(maxsize=1)
def _nvml_absent() -> str | None:
    """Why NVML cannot be used in this process, or None; asked once per process.

    NVML that is absent when a process starts does not appear later, and
    asking again costs a failed library load at every restart, so the answer
    is kept (a restart's latency is the figure that matters here).
    """
    try:
        import pynvml
    except ImportError as ex:
        return f"pynvml cannot be imported ({ex})"
    try:
        pynvml.nvmlInit()
    except Exception as ex:
        return f"nvmlInit failed: {_describe(ex)}"
    try:
        pynvml.nvmlShutdown()
    except Exception as ex:
        log.debug("nvmlShutdown failed: %s", _describe(ex))
    return None


def _index(device_index: int | None) -> int:
    if device_index is not None:
        return device_index
    local = env_local_rank()
    return 0 if local is None else local


def _check_index(device_index: Any) -> None:
    if device_index is not None and (
        not isinstance(device_index, int) or isinstance(device_index, bool) or device_index < 0
    ):
        raise ValueError(f"device_index must be an int >= 0 or None, got {device_index!r}")


class _Chained(HealthCheck):
    """A check that takes either generation's arguments and hands them on."""

    _takes_either_generation = True

    def __init__(self, device_index: int | None = None) -> None:
        _check_index(device_index)
        self.device_index = device_index
        self._said_skipped = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_index={self.device_index})"

    def _skipped(self, reason: str) -> None:
        if not self._said_skipped:
            self._said_skipped = True
            log.info("%s checked nothing: %s", type(self).__name__, reason)

    def check(self) -> None:
        """Raises ``HealthCheckError`` when the device is unhealthy."""
        raise NotImplementedError

    def __call__(self, state: Any, *rest: Any) -> Any:  # type: ignore[override]
        self.check()
        return (state, *rest) if rest else state


class ChainedGPUHealthCheck(_Chained):
    """NVML's view of this rank's GPU and, after a fault that was a CUDA error,
    whether this process's CUDA context still works; either failing is a fault
    of this rank.

    NVML does not see a sticky CUDA error (a device-side assert, an illegal
    memory access): the GPU is fine, this process's context is broken for good,
    and every later iteration would fail at its first CUDA call, restart after
    restart. So when the exception that ended the function is a CUDA error,
    the context is asked too (:class:`CudaHealthCheck`'s synchronization,
    which raises on a broken one): a job without ``CudaHealthCheck`` of its own
    loses that rank, which the launcher relaunches with a fresh context. Any
    other fault costs nothing here.
    """

    def __init__(self, device_index: int | None = None) -> None:
        super().__init__(device_index)
        self._nvml = NVMLHealthCheck(device_index=device_index, on_missing="skip")

    def __call__(self, state: Any, *rest: Any) -> Any:  # type: ignore[override]
        self.check()
        # the function's exception: the guide's second argument, or the newer
        # generation's ``fn_exception``
        self.check_context(rest[0] if rest else getattr(state, "fn_exception", None))
        return (state, *rest) if rest else state

    def check(self) -> None:
        absent = _nvml_absent()
        if absent is not None:
            return self._skipped(absent)
        self._nvml(None)
        return None

    @staticmethod
    def check_context(fault: BaseException | None) -> None:
        """Raises ``HealthCheckError`` when ``fault`` is a CUDA error and this
        process's CUDA context no longer works."""
        if device_fault.cause_of(fault) is None:
            return
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return
        from .cuda import CudaHealthCheck

        CudaHealthCheck()(None, fault)  # type: ignore[arg-type]


class ChainedNVLHealthCheck(_Chained):
    """NVLink links of this rank's GPU; an inactive link is logged, never a fault."""

    #: links asked about when ``pynvml`` does not say how many there are
    MAX_LINKS = 18

    def check(self) -> None:
        absent = _nvml_absent()
        if absent is not None:
            return self._skipped(absent)
        import pynvml

        try:
            pynvml.nvmlInit()
        except Exception as ex:
            return self._skipped(f"nvmlInit failed: {_describe(ex)}")
        try:
            index = _index(self.device_index)
            try:
                handle, label = NVMLHealthCheck._handle(pynvml, index)
            except Exception as ex:
                return self._skipped(f"no GPU {index}: {_describe(ex)}")
            down = []
            for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", self.MAX_LINKS))):
                try:
                    active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
                except Exception as ex:
                    if _is_unanswerable(pynvml, ex):
                        continue  # no such link, or no NVLink at all
                    down.append(f"link {link}: {_describe(ex)}")
                    continue
                if active != getattr(pynvml, "NVML_FEATURE_ENABLED", 1):
                    down.append(f"link {link} inactive")
            if down:
                # Invariant: never raises: an NVLink problem is not a fault of this rank.
                log.warning("NVLink of GPU %s degraded (ignored): %s", label, "; ".join(down))
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception as ex:
                log.debug("nvmlShutdown failed: %s", _describe(ex))
        return None


class ChainedNicHealthCheck(_Chained):
    """InfiniBand ports of this node whose ``link_downed`` counter grew since construction.

    Args:
        device_index: the rank's device (kept for the API; every port of the
            node is watched, as the rank's traffic may use any of them).
        sysfs_root: where the InfiniBand devices are listed.
    """

    def __init__(self, device_index: int | None = None, sysfs_root: str = IB_SYSFS) -> None:
        super().__init__(device_index)
        self.sysfs_root = sysfs_root
        self._baseline = self._counters()

    def _counters(self) -> dict[str, int]:
        found: dict[str, int] = {}
        root = Path(self.sysfs_root)
        for counter in sorted(root.glob("*/ports/*/counters/link_downed")):
            try:
                found[f"{counter.parts[-5]} port {counter.parts[-3]}"] = int(
                    counter.read_text().strip()
                )
            except (OSError, ValueError) as ex:
                log.debug("cannot read %s: %s", counter, ex)
        return found

    def has_ports(self) -> bool:
        """Whether the node had InfiniBand port counters when the check was built."""
        return bool(self._baseline)

    def check(self) -> None:
        if not self._baseline:
            # No port when the check was built: none appears during a job.
            return self._skipped(f"no InfiniBand port counters under {self.sysfs_root}")
        now = self._counters()
        grew = [
            f"{port}: link down {now[port] - self._baseline.get(port, 0)} time(s)"
            for port in sorted(now)
            if now[port] > self._baseline.get(port, 0)
        ]
        self._baseline.update(now)
        if grew:
            raise HealthCheckError(f"NIC health check failed: {'; '.join(grew)}")
        return None


def restart_health_checks(
    user: Any = None,
    device_index: int | None = None,
    nic: bool | None = None,
) -> Compose | None:
    """The restart health check of a rank: its device checks, then ``user``'s.

    ``Compose(user..., gpu, nvl, nic)``, as the API's newest generation builds
    it (a ``Compose`` of the user's is flattened): runs (``nic``)
    ``ChainedNicHealthCheck``, ``ChainedNVLHealthCheck``,
    ``ChainedGPUHealthCheck``, then the user's check(s), the last listed first:
    the device checks first, so that a user's check that uses the
    device meets a device already known to be usable. ``nic=None`` (as the
    Wrapper builds it) or ``True`` includes the NIC check, which passes where the
    node has no InfiniBand port counters; ``False`` leaves it out. ``device_index``
    defaults to ``LOCAL_RANK``; without either, ``None`` (no device to check).
    """
    _check_index(device_index)
    if device_index is None:
        device_index = env_local_rank()
        if device_index is None:
            return None
    checks: list[Any] = []
    if user is not None:
        checks += user.instances if isinstance(user, Compose) else [user]
    checks.append(ChainedGPUHealthCheck(device_index=device_index))
    checks.append(ChainedNVLHealthCheck(device_index=device_index))
    if nic is not False:
        checks.append(ChainedNicHealthCheck(device_index=device_index))
    # Compose runs the last listed first: NIC, NVLink, GPU, then the user's.
    return Compose(*checks)


__all__ = [
    "ChainedGPUHealthCheck",
    "ChainedNVLHealthCheck",
    "ChainedNicHealthCheck",
    "restart_health_checks",
]
