"""Shared fixtures: every test must leave no thread, child process, fd or log handler behind."""

from __future__ import annotations

import datetime
import functools
import gc
import inspect
import logging
import os
import threading
import time
import weakref

import psutil
import pytest


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _handlers() -> dict[str, int]:
    """Handlers of the root logger and of ours (torch configures its own lazily)."""
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith("inprocess")]
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in names)]
    return {lg.name: len(lg.handlers) for lg in loggers}


def pytest_configure(config: pytest.Config) -> None:
    """Imports once, outside every test's timeout, what torch imports lazily on
    first use: the first optimizer built imports ``torch._dynamo`` (sympy and
    all), which took over 60 s on a loaded 2-core machine and failed whichever
    test happened to build the first optimizer. Not in the controller of a
    distributed run (``-n``): it runs no test."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import torch._dynamo  # noqa: F401

    _patient_unwind_in_this_process()

    # The suite's ranks are forked from one preloaded process, started here: outside
    # every test's timeout, and before any test, so no test counts it as its own
    # child. INPROCESS_TEST_FORK=0: every rank is spawned.
    if os.environ.get("INPROCESS_TEST_FORK", "1") != "0":
        import launcher

        launcher.start_template()


#: the bounded unwind's deadline for Wrappers run by the tests themselves
TEST_PROCESS_UNWIND = datetime.timedelta(seconds=120)


def _patient_unwind_in_this_process() -> None:
    """A Wrapper run in this process (the in-process tests) gets a long unwind
    deadline unless the test sets one: its monitor process SIGKILLs a rank whose
    main thread is not back in the Wrapper by then (2 s by default), and here the
    rank is the pytest worker, which a loaded machine can stall that long: the
    whole run would lose the worker. The unwind itself is tested with ranks that
    are processes of their own (tests/test_bounded_unwind.py)."""
    from inprocess.wrap import Wrapper

    init = Wrapper.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)
    def patient_init(self, *args, **kwargs):
        if "unwind_timeout" not in signature.bind_partial(self, *args, **kwargs).arguments:
            kwargs["unwind_timeout"] = TEST_PROCESS_UNWIND
        init(self, *args, **kwargs)

    Wrapper.__init__ = patient_init  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    import launcher

    if launcher.TEMPLATE is not None:
        launcher.TEMPLATE.close()
        launcher.TEMPLATE = None


@pytest.fixture(scope="session", autouse=True)
def _warm_up_one_time_resources():
    """Process-wide resources created once (libuv's signal pipes of the TCPStore
    server) must not be blamed on the first test that happens to create them."""
    import launcher
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", launcher.free_port(), None, True, use_libuv=True)
    del server
    yield


#: every live store object of ours (a Wrapper store, anything with its protocol),
#: registered when built: a heap scan after each test would cost a noticeable
#: part of the suite's time
_LIVE_STORES: weakref.WeakSet = weakref.WeakSet()


def _register_on_init(cls: type) -> None:
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_registers_store", False):
        return

    @functools.wraps(init)
    def registering_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _LIVE_STORES.add(self)

    registering_init._registers_store = True  # type: ignore[attr-defined]
    cls.__init__ = registering_init  # type: ignore[misc]


def _track_stores() -> None:
    """Registers the instances of every store class: those defined now and later."""
    from inprocess.store import StoreMixin

    def subclasses(cls: type) -> list[type]:
        return [c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))]

    for cls in subclasses(StoreMixin):
        _register_on_init(cls)
    original = StoreMixin.__dict__.get("__init_subclass__")

    @classmethod  # type: ignore[misc]
    def init_subclass(cls, **kwargs):
        if original is not None:
            original.__func__(cls, **kwargs)
        else:
            super(StoreMixin, cls).__init_subclass__(**kwargs)
        _register_on_init(cls)

    StoreMixin.__init_subclass__ = init_subclass  # type: ignore[assignment]


_track_stores()


def _stores() -> list[str]:
    """Live store objects of ours."""
    return [repr(o) for o in list(_LIVE_STORES)]


@pytest.fixture(autouse=True)
def no_leaks():
    """Fails a test that leaves threads, child processes, open fds, log handlers or
    store objects behind."""
    threads = set(threading.enumerate())
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    fds = _fds()
    handlers = _handlers()
    yield
    deadline = time.monotonic() + 10
    while True:
        new_threads = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
        new_children = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in children and p.status() != psutil.STATUS_ZOMBIE
        ]
        new_fds = _fds() - fds
        stores = _stores()
        if not (new_threads or new_children or new_fds or stores) or time.monotonic() > deadline:
            break
        gc.collect()  # what only a reference cycle keeps (a store, a socket) goes now
        time.sleep(0.05)
    assert not new_threads, f"leaked threads: {new_threads}"
    assert not new_children, f"leaked processes: {new_children}"
    assert not stores, f"leaked store objects: {stores}"
    # fds opened during the test and still open (e.g. sockets of a store)
    leaked = {fd: _describe(fd) for fd in new_fds}
    leaked = {fd: d for fd, d in leaked.items() if d is not None}
    assert not leaked, f"leaked file descriptors: {leaked}"
    new_handlers = {k: v for k, v in _handlers().items() if v > handlers.get(k, 0)}
    assert not new_handlers, f"leaked log handlers: {new_handlers}"


def _describe(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


@pytest.fixture
def single_rank(monkeypatch):
    """This process as rank 0 of a one-rank job on a free port (returned)."""
    from launcher import free_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    return port


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster on this machine (tests/slurm_cluster.py): 5 nodes, n1..n5,
    4 CPUs each as Slurm counts them; started by the first test that asks for it,
    stopped at the session's end. Skips where it cannot be had (not root, no
    packages), fails instead with ``INPROCESS_REQUIRE_SLURM=1``."""
    import slurm_cluster as harness

    with harness.cluster_or_skip() as cluster:
        yield cluster


@pytest.fixture
def etcd_cluster(tmp_path):
    """A fresh real 3-member etcd cluster (tests/etcd_cluster.py) for one test, which
    may kill, stop and restart members; closed at the test's end. Skips where etcd
    is missing, fails instead with ``INPROCESS_REQUIRE_ETCD=1``."""
    import etcd_cluster as harness

    with harness.cluster_or_skip(tmp_path / "etcd") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shared_etcd_cluster(tmp_path_factory):
    """One real 3-member etcd cluster for every test of a module that asks for it:
    the tests must leave every member running (a member restarted in a test is a
    new process, which the leak check would blame on that test)."""
    import etcd_cluster as harness

    with harness.cluster_or_skip(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster
