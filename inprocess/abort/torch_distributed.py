"""The default abort: releases and destroys every ``torch.distributed`` group."""

from __future__ import annotations

import logging
import threading

from ..state import State
from .base import Abort
from .gloo import release_blocked_collectives
from .rendezvous import (
    close_stranded_connections,
    hold_iteration_servers,
    release_iteration_connections,
)

log = logging.getLogger(__name__)


class AbortTorchDistributed(Abort):
    """Aborts every ``torch.distributed`` process group, then destroys them.

    * gloo: the group's own pair connections are shut down (see
      :mod:`inprocess.abort.gloo`), which releases blocked collectives at once.
    * NCCL: the backend's ``abort()`` (``_shutdown()`` on older torch) stops
      pending kernels and communicators.
    * Anything else of this iteration blocked on the network (a group still
      initializing, reading a peer's address from the store; a ``TCPStore``
      the function built, waiting for its workers or for a key): the
      client-side connections the function opened in this iteration are shut
      down (see :mod:`inprocess.abort.rendezvous`).

    Then ``destroy_process_group()`` frees the groups so that the next iteration
    can initialize new ones, and the group counter that names default groups is
    reset: torch resets it only when destroying an initialized world, so a rank
    whose initialization was cut short would otherwise name its next group
    differently from its peers and never meet them.
    """

    def __init__(self, store_read_timeout: float = 2.0) -> None:
        self.store_read_timeout = store_read_timeout
        self._lock = threading.Lock()

    def __call__(self, state: State) -> State:
        import torch.distributed as dist

        # Order matters: the gloo release reads the peers' addresses from the
        # group's store (through the group's connection where it cannot open one of
        # its own), whose connections the rendezvous release then breaks.
        with self._lock:
            initialized = dist.is_available() and dist.is_initialized()
            if initialized:
                try:
                    release_blocked_collectives(self.store_read_timeout)
                except Exception:
                    log.exception("releasing gloo collectives failed")
                _abort_nccl()
            try:
                # First keep the function's store servers up: releasing a
                # TCPStore master blocked in its constructor takes its server down.
                hold_iteration_servers()
            except Exception:
                log.exception("holding the store servers of the iteration failed")
            try:
                release_iteration_connections()
            except Exception:
                log.exception("releasing the connections of the iteration failed")
            if initialized:
                try:
                    dist.destroy_process_group()
                except (ValueError, AssertionError, RuntimeError) as ex:
                    # Another thread destroyed it between our check and this call.
                    log.debug("destroy_process_group: %s", ex)
            _reset_group_count()
            close_stranded_connections()
        return state


def _reset_group_count() -> None:
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        c10d._world.group_count = 0


def _abort_nccl() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return
    for pg in list(c10d._world.pg_map):
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except RuntimeError:
            continue
        if not isinstance(backend, dist.ProcessGroupNCCL):
            continue
        try:
            if hasattr(backend, "abort"):
                backend.abort()
            else:  # torch < 2.5
                backend._shutdown()
        except Exception:
            log.exception("aborting NCCL group %s failed", pg.group_name)
