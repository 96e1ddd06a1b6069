"""The store classes of the Wrapper and their hosting: :class:`StoreMixin`, the protocol
combined from its parts, and :class:`TCPStore`, :class:`FileStore` and
:class:`PrefixStore`, torch's stores with it; how another process reaches one
(:class:`ClientSpec`, :func:`describe`); where a ``TCPStore``'s server runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable
from errno import EADDRINUSE
from typing import Any

import torch.distributed as dist

from ..exception import StoreError
from ..security import bound_port, listen_fd
from ..waiting import WAIT_CHUNK_MAX
from .exchange import ExchangeMixin
from .helpers import AGENT_STORE_ENV, PrefixView
from .ledger import LedgerMixin
from .records import RecordsMixin
from .rendezvous import RendezvousMixin
from .wakeups import WakeMixin


class StoreMixin(RecordsMixin, WakeMixin, LedgerMixin, RendezvousMixin, ExchangeMixin):
    """Adds the Wrapper's protocol to a ``torch.distributed.Store`` subclass.

    Combined from one mixin per concern: sealed records (:mod:`.records`), wake-ups
    and waits (:mod:`.wakeups`), the call's ledger (:mod:`.ledger`), rendezvous and
    barriers (:mod:`.rendezvous`), state and key exchange (:mod:`.exchange`).

    Subclasses must also derive from a ``torch.distributed.Store`` (see
    :class:`TCPStore`, :class:`FileStore`, :class:`PrefixStore`). Only the store
    primitives ``set``, ``get``, ``add``, ``compare_set``, ``append``, ``check``
    and ``multi_get`` are used.

    Every value the protocol acts on is a sealed record
    (:func:`inprocess.security.seal`, under the job's secret and the key's full
    name): :meth:`put` and :meth:`add_entry` write them, :meth:`read`,
    :meth:`entries` and :meth:`set_once` read the authentic ones only. A
    "once" key (a decision, an outcome, a death) is an appended list whose
    first authentic record wins, so a stranger who writes it first, or appends
    to it, decides nothing. Counters only wake readers of records.
    """

    # ------------------------------------------------------------------ construction

    @classmethod
    def client(cls, **kwargs: Any) -> StoreMixin:
        """A store connected to the same data that never hosts it.

        Used by the monitor process, which must not start a second server. The
        default constructs the store with the same arguments.
        """
        return cls(**kwargs)

    def client_spec(self) -> ClientSpec | None:
        """How another process (the monitor process) reaches this store's data.

        Describes the store by what it is, not by the class that built it, so
        any subclass works, even one defined inside a function (not picklable):
        a store over torch's ``TCPStore`` is reached by a plain
        :class:`TCPStore` client at the same host and port, one over
        ``FileStore`` by a :class:`FileStore` on the same file, a
        :class:`PrefixStore` by the same prefix over its base's description.
        ``None`` when unknown; override it for other stores.
        """
        return describe(self)


@dataclasses.dataclass(frozen=True)
class ClientSpec:
    """A picklable recipe for a client of a store: ``factory(**kwargs)``.

    The monitor process connects with it; a spawned monitor receives it
    pickled, so ``factory`` must then be importable by name.
    """

    factory: Callable[..., StoreMixin]
    kwargs: dict[str, Any]

    def connect(self) -> StoreMixin:
        return self.factory(**self.kwargs)


def _prefixed(prefix: str, base: ClientSpec) -> StoreMixin:
    return PrefixStore(prefix, base.connect())


def describe(store: Any) -> ClientSpec | None:
    """A :class:`ClientSpec` of ``store`` from torch's store type, or ``None`` when unknown."""
    if isinstance(store, dist.TCPStore):
        # A plain client: never hosts, whatever the original's is_master was.
        kwargs = {"host_name": store.host, "port": store.port, "timeout": store.timeout}
        return ClientSpec(TCPStore.client, kwargs)
    if isinstance(store, dist.FileStore):
        # world_size -1: a client never takes part in deleting the file.
        return ClientSpec(FileStore, {"file_name": store.path, "world_size": -1})
    if isinstance(store, PrefixStore) and isinstance(store.base_store, dist.Store):
        base = describe(store.base_store)
        if base is not None:
            return ClientSpec(_prefixed, {"prefix": store.prefix, "base": base})
    return None


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def externally_hosted(host_name: str, port: int) -> bool:
    """Whether a launcher hosts the store at ``host_name:port`` (outside the workers).

    torchrun and ``inprocess-run`` set ``TORCHELASTIC_USE_AGENT_STORE=True``, but
    their agent hosts only the store at ``MASTER_ADDR:MASTER_PORT``: a store on any
    other address or port (the usage guide puts the Wrapper's at ``MASTER_PORT + 2``)
    must still be hosted by a worker.
    """
    if os.environ.get(AGENT_STORE_ENV) != str(True):
        return False
    return host_name == _env("MASTER_ADDR") and str(port) == _env("MASTER_PORT")


def _bound_listener(host_name: str, port: int) -> dict[str, int]:
    """The server's listening socket, bound to ``host_name`` only (issue 9).

    torch's own server listens on every interface whatever ``host_name`` says;
    handing it a socket we bound (``master_listen_fd``, which it owns from
    then on) keeps it on the configured address.
    """
    if port and _listening_here(port):
        return {}  # torch's multi-tenant server of this process: it is reused as it is
    fd = listen_fd(host_name, port)
    return {"port": bound_port(fd), "master_listen_fd": fd}


def _listening_here(port: int) -> bool:
    """Whether this process already listens on ``port`` (a store server we host)."""
    import psutil

    return any(
        c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
        for c in psutil.Process().net_connections(kind="tcp")
    )


class TCPStore(dist.TCPStore, StoreMixin):
    """``torch.distributed.TCPStore`` with the Wrapper protocol.

    Defaults come from the environment: ``MASTER_ADDR``, ``MASTER_PORT``. The
    server is hosted by initial rank 0 unless a launcher hosts it: torchrun's and
    ``inprocess-run``'s agent store (``TORCHELASTIC_USE_AGENT_STORE=True``) at
    exactly ``MASTER_ADDR:MASTER_PORT``; ``is_master`` overrides the choice. A port that is
    already taken by another process is an error, never a silent fallback to a
    client of whatever listens there.
    """

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = False,
        multi_tenant: bool = True,
        use_libuv: bool = True,
        is_master: bool | None = None,
    ) -> None:
        host_name = host_name if host_name is not None else _env("MASTER_ADDR")
        if host_name is None:
            raise StoreError("TCPStore needs host_name or the MASTER_ADDR environment variable")
        if port is None:
            env_port = _env("MASTER_PORT")
            if env_port is None:
                raise StoreError("TCPStore needs port or the MASTER_PORT environment variable")
            port = int(env_port)
        if not 0 <= int(port) < 65536:
            raise ValueError(f"port must be in [0, 65535] (0: any free port), got {port}")
        if is_master is None:
            is_master = (
                not externally_hosted(host_name, int(port))
                and int(os.environ.get("RANK", "0")) == 0
            )
        try:
            listen = _bound_listener(host_name, int(port)) if is_master else {}
            super().__init__(
                host_name=host_name,
                port=int(listen.get("port", port)),
                world_size=world_size,
                is_master=is_master,
                timeout=timeout,
                wait_for_workers=wait_for_workers,
                multi_tenant=multi_tenant,
                use_libuv=use_libuv,
                **{k: v for k, v in listen.items() if k != "port"},
            )
        except (RuntimeError, OSError) as ex:
            if is_master and ("EADDRINUSE" in str(ex) or getattr(ex, "errno", 0) == EADDRINUSE):
                raise StoreError(
                    f"cannot host the store on port {port}: the port is already in use by "
                    "another process; choose a free MASTER_PORT (or store_kwargs['port'])"
                ) from ex
            role = "host" if is_master else "connect to"
            raise StoreError(f"cannot {role} the store at {host_name}:{port}: {ex}") from ex
        self.host_name = host_name
        self.is_master = is_master

    @classmethod
    def client(cls, **kwargs: Any) -> TCPStore:
        kwargs = dict(kwargs)
        kwargs["is_master"] = False
        return cls(**kwargs)


class FileStore(dist.FileStore, StoreMixin):
    """``torch.distributed.FileStore`` with the Wrapper protocol (single host jobs)."""

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        self.file_name = file_name
        super().__init__(file_name, world_size)


class PrefixStore(dist.PrefixStore, StoreMixin, PrefixView):
    """``torch.distributed.PrefixStore`` with the Wrapper protocol."""

    def __init__(self, prefix: str | int, store: dist.Store) -> None:
        self.prefix = str(prefix)
        self.base_store = store
        # a view of a store waits like it (see WAIT_CHUNK)
        self.wait_chunk_max = getattr(store, "wait_chunk_max", WAIT_CHUNK_MAX)
        super().__init__(str(prefix), store)
