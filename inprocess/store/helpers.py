"""What the store's protocol mixins and its store classes share: identities, the job's
key space, barrier errors, key names under prefix views, and a polling back-off.

The lowest module of :mod:`inprocess.store`: it imports nothing else of the package.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import torch.distributed as dist

from ..exception import StoreError
from ..exception import TimeoutError as RestartTimeoutError
from ..security import keyed_namespace

#: environment variable naming a store hosted outside the workers (torchrun's convention)
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
#: environment variable with the key namespace of this job (set by ``inprocess-run``)
NAMESPACE_ENV = "INPROCESS_STORE_NAMESPACE"
#: environment variable with the number of this process among the worker's starts
INCARNATION_ENV = "INPROCESS_WORKER_INCARNATION"


def new_identity(initial_rank: int, incarnation: int = 0) -> str:
    """A process-unique identity: ``"<initial rank>/<incarnation>.<random>"`` (see also
    :func:`inprocess.protocol.launch_identity`)."""
    return f"{initial_rank}/{incarnation}.{uuid.uuid4().hex[:10]}"


def job_namespace() -> str:
    """The store key space of this job (and generation): every process of it must agree.

    ``inprocess-run`` sets ``INPROCESS_STORE_NAMESPACE``; under torchrun each
    restart attempt gets its own (its run id and restart count), so a restarted
    attempt never reads the keys of the previous one. With a job secret
    (``INPROCESS_JOB_SECRET``) the namespace ends with a tag derived from it, so
    a store client without the secret cannot name any key of the job.
    """
    explicit = os.environ.get(NAMESPACE_ENV)
    if explicit:
        return explicit  # inprocess-run's, keyed with the job's secret already
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return keyed_namespace(f"torchelastic/{run_id}/{restart}")
    return keyed_namespace("default")


def incarnation_from_env() -> int:
    value = os.environ.get(INCARNATION_ENV)
    return int(value) if value else 0


class BarrierTimeout(RestartTimeoutError):
    """A rendezvous did not complete within its timeout."""


class BarrierRefused(StoreError):
    """A counted barrier's arrivals were refused by the rank that completed it."""


class BarrierOverflow(StoreError):
    """More ranks arrived at a rendezvous than it has participants."""


class PrefixView:
    """A view of ``base_store`` whose keys are all under ``prefix``: what
    :class:`~inprocess.store.PrefixStore` is to the functions below.

    A base class of it alone, so that these functions, which the protocol mixins
    use, need not know the store classes built on those mixins.
    """

    prefix: str
    base_store: Any


def key_path(store: Any, key: str) -> str:
    """The full name of ``key`` in the store under ``store``'s prefixes (the name records
    are sealed with). Prefixes of torch's own ``PrefixStore`` are not known: the
    name then starts below them."""
    parts = [key]
    while isinstance(store, PrefixView):
        parts.append(store.prefix)
        store = store.base_store
    return "/".join(reversed(parts))


def _served_name(store: Any, key: str) -> tuple[dist.TCPStore, str] | None:
    """(the ``TCPStore`` under ``store``, the key's full name on its server) where
    ``store`` is a view of a ``TCPStore`` whose prefixes are all known; ``None``
    otherwise."""
    parts = [key]
    while isinstance(store, PrefixView):
        parts.append(store.prefix)
        store = store.base_store
    if not isinstance(store, dist.TCPStore):
        return None
    # torch's TCPStore puts "/" before every key, and a PrefixStore "<prefix>/"
    return store, "/" + "/".join(reversed(parts))


def waits_in_server(store: Any) -> bool:
    """Whether ``store``'s ``wait`` blocks in a server (torch's ``TCPStore``) rather than
    polling in the client."""
    while isinstance(store, PrefixView):
        store = store.base_store
    return isinstance(store, dist.TCPStore)


class Poller:
    """Sleeps between polls, backing off from ``start`` to ``limit`` seconds."""

    def __init__(self, limit: float, start: float = 0.0005) -> None:
        self.limit = max(limit, start)
        self.delay = min(start, self.limit)

    def sleep(self, deadline: float | None = None) -> None:
        delay = self.delay
        if deadline is not None:
            delay = min(delay, max(0.0, deadline - time.monotonic()))
        time.sleep(delay)
        self.delay = min(self.delay * 1.5, self.limit)
