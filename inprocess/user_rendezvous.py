"""A fresh ``env://`` rendezvous for every restart iteration.

A training function typically calls ``torch.distributed.init_process_group()``
with the default ``env://`` method, on every restart iteration. Without help,
iteration 2 would rendezvous in the same store keys as iteration 1 and read
its predecessors' stale gloo addresses, and after a rank reassignment a new
rank 0 would try to host a second store on ``MASTER_PORT``.

While the wrapped function runs, this module therefore substitutes the
``env://`` handler: the store it yields is prefixed with the iteration, and
when the Wrapper's own store is the TCPStore at ``MASTER_ADDR:MASTER_PORT``
every rank connects to it as a client (torch's ``TORCHELASTIC_USE_AGENT_STORE``
convention) instead of rank 0 hosting another one.

Process group initialization blocks in store reads (in C++, not
interruptible) until every peer has published its address, and a peer that
failed before initializing never will. So the sockets this process has when
the function starts are recorded, and :func:`release_rendezvous_connections`
(run by ``AbortTorchDistributed``) shuts down the connections to the store at
``MASTER_PORT`` opened since: the rendezvous connections of this iteration and
gloo's clones of them; the Wrapper's own connection is older and untouched.
(A Python store wrapper that polls cannot be used instead: torch 2.13's gloo
clones its store, and a ``PrefixStore`` over a Python store cannot be cloned.)

Scripts that build their own store and pass ``store=`` to
``init_process_group`` are not affected; their initialization is bounded by the
timeout they pass.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from .sockets import shutdown_connections, socket_inodes, tcp_connections
from .store import AGENT_STORE_ENV, PrefixStore, TCPStore

log = logging.getLogger(__name__)


#: socket inodes of this process when the current call of the function began
_baseline: set[int] | None = None


def release_rendezvous_connections() -> int:
    """Shuts down the connections to the store at ``MASTER_PORT`` opened in this iteration."""
    baseline, port = _baseline, os.environ.get("MASTER_PORT")
    if baseline is None or port is None:
        return 0
    fresh = {inode: fd for inode, fd in socket_inodes().items() if inode not in baseline}
    released = shutdown_connections(
        [conn for conn in tcp_connections(fresh) if conn.remote[2] == int(port)]
    )
    log.debug("shut down %d rendezvous connections", released)
    return released


def _serves_master_address(raw: Any) -> bool:
    if not isinstance(raw, TCPStore):
        return False
    return raw.host_name == os.environ.get("MASTER_ADDR") and str(raw.port) == os.environ.get(
        "MASTER_PORT"
    )


@contextlib.contextmanager
def fresh_env_rendezvous(store: PrefixStore, iteration: int) -> Iterator[None]:
    """Makes ``env://`` rendezvous of this iteration use fresh keys.

    ``store`` is the Wrapper's namespaced store; its underlying store decides
    whether ranks connect to it as clients.
    """
    # The module, not the function of the same name that torch.distributed exports.
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers = rdzv._rendezvous_handlers
    original = handlers.get("env")
    if original is None:
        yield
        return
    prefix = f"{store.prefix}/iter/{iteration}/env"

    def handler(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[Any]:
        args = (url,) if timeout is None else (url, timeout)
        for user_store, rank, world_size in original(*args, **kwargs):
            yield PrefixStore(prefix, user_store), rank, world_size

    global _baseline
    saved_agent = os.environ.get(AGENT_STORE_ENV)
    if _serves_master_address(store.base_store):
        os.environ[AGENT_STORE_ENV] = str(True)
    handlers["env"] = handler
    _baseline = set(socket_inodes())
    try:
        yield
    finally:
        _baseline = None
        if handlers.get("env") is handler:
            handlers["env"] = original
        if saved_agent is None:
            os.environ.pop(AGENT_STORE_ENV, None)
        else:
            os.environ[AGENT_STORE_ENV] = saved_agent
