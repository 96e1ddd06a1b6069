"""inprocess: keeps distributed PyTorch training alive through faults.

Two layers:

* :class:`Wrapper` restarts the training function in-process on every healthy
  rank when any rank raises, hangs or dies.
* :mod:`inprocess.failover` (and the ``inprocess-run`` launcher) starts and
  watches the worker processes of a job and replaces lost ones.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use (PEP 562), so that a process that needs only the job
# layer (a controller, a Ray node agent) does not pay for importing torch.
_LAZY_ATTRS = {
    "CallWrapper": ".wrap",
    "Compose": ".compose",
    "State": ".state",
    "Wrapper": ".wrap",
}
_LAZY_MODULES = {
    "abort",
    "completion",
    "exception",
    "finalize",
    "generation",
    "health_check",
    "initialize",
    "monitor_thread",
    "nested_restarter",
    "progress_watchdog",
    "rank_assignment",
    "rank_filter",
    "snapshot",
    "state",
    "store",
    "terminate",
    "tools",
}

if TYPE_CHECKING:
    from . import (
        abort,
        completion,
        exception,
        finalize,
        generation,
        health_check,
        initialize,
        monitor_thread,
        nested_restarter,
        progress_watchdog,
        rank_assignment,
        rank_filter,
        snapshot,
        state,
        store,
        terminate,
        tools,
    )
    from .compose import Compose
    from .state import State
    from .wrap import CallWrapper, Wrapper


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_ATTRS:
        value = getattr(importlib.import_module(_LAZY_ATTRS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY_MODULES | set(_LAZY_ATTRS))


__all__ = [
    "CallWrapper",
    "Compose",
    "State",
    "Wrapper",
    "abort",
    "completion",
    "exception",
    "finalize",
    "generation",
    "health_check",
    "initialize",
    "monitor_thread",
    "nested_restarter",
    "progress_watchdog",
    "rank_assignment",
    "rank_filter",
    "snapshot",
    "state",
    "store",
    "terminate",
    "tools",
]

__version__ = "0.1.0"
