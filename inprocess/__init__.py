"""inprocess: keeps distributed PyTorch training alive through faults.

Two layers:

* :class:`Wrapper` restarts the training function in-process on every healthy
  rank when any rank raises, hangs or dies.
* :mod:`inprocess.failover` (and the ``inprocess-run`` launcher) starts and
  watches the worker processes of a job and replaces lost ones.
"""

import importlib
import logging as _logging
from typing import TYPE_CHECKING, Any

# At import (it imports no torch): its atexit function must be registered
# before the user's own, so that theirs run first (see its docstring).
from . import device_fault as _device_fault  # noqa: F401

# The library logs under "inprocess"; the API's newer generations log under
# "nvrx". "inprocess" is placed below "nvrx" in the logger hierarchy, so a
# record goes inprocess -> nvrx -> root and each logger's handlers see it once
# (a level set on "nvrx" applies to "inprocess" unless it has its own). No
# handler is added and the root logger is left alone.
_logging.getLogger("inprocess").parent = _logging.getLogger("nvrx")

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
