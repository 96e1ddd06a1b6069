"""inprocess: keeps distributed PyTorch training alive through faults.

Two layers:

* :class:`Wrapper` restarts the training function in-process on every healthy
  rank when any rank raises, hangs or dies.
* :mod:`inprocess.failover` (and the ``inprocess-run`` launcher) starts and
  watches the worker processes of a job and replaces lost ones.
"""

from . import (
    abort,
    completion,
    exception,
    finalize,
    generation,
    health_check,
    initialize,
    monitor_thread,
    rank_assignment,
    rank_filter,
    state,
    store,
    terminate,
    tools,
)
from .compose import Compose
from .wrap import CallWrapper, Wrapper

__all__ = [
    "CallWrapper",
    "Compose",
    "Wrapper",
    "abort",
    "completion",
    "exception",
    "finalize",
    "generation",
    "health_check",
    "initialize",
    "monitor_thread",
    "rank_assignment",
    "rank_filter",
    "state",
    "store",
    "terminate",
    "tools",
]

__version__ = "0.1.0"
