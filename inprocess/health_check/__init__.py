"""Health check: decides, locally, whether this rank may take part in the next iteration.

A :class:`HealthCheck` runs on each rank after a fault (after abort and
finalize) and before the first iteration. It looks only at this rank: other
ranks may be dead or still running. It reports an unhealthy rank by raising,
preferably :class:`inprocess.exception.HealthCheckError`; the Wrapper then
removes the rank from the job. Health checks chain with :class:`inprocess.Compose`.

One module a check: :mod:`.base` (the base class), :mod:`.cuda`,
:mod:`.nvml`, :mod:`.fault_counter`, :mod:`.restart` (GPU, NVLink, NIC).
"""

from .base import HealthCheck
from .cuda import CudaHealthCheck
from .fault_counter import FaultCounter, FaultCounterExceeded
from .nvml import NVMLHealthCheck
from .restart import (
    ChainedGPUHealthCheck,
    ChainedNicHealthCheck,
    ChainedNVLHealthCheck,
    restart_health_checks,
)

__all__ = [
    "ChainedGPUHealthCheck",
    "ChainedNVLHealthCheck",
    "ChainedNicHealthCheck",
    "CudaHealthCheck",
    "FaultCounter",
    "FaultCounterExceeded",
    "HealthCheck",
    "NVMLHealthCheck",
    "restart_health_checks",
]
