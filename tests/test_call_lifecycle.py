"""A call of the wrapped function owns what it creates and releases it before returning.

Store objects, the store server, threads, processes: nothing outlives the call,
however it ends, and consecutive calls in the same processes never meet the
server of an earlier call. ``store_factory`` may be any store class, even one
defined inside a function (not picklable).
"""

from __future__ import annotations

import datetime
import gc
import pickle
import threading

import psutil
import pytest
from launcher import run_job

import inprocess
from inprocess.store import StoreMixin

ms = datetime.timedelta(milliseconds=1)
s = datetime.timedelta(seconds=1)


def live_stores() -> list[str]:
    """Store objects of ours that are alive, before any garbage collection."""
    return [type(o).__name__ for o in gc.get_objects() if issubclass(type(o), StoreMixin)]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_consecutive_calls_end_every_way_and_leave_nothing(tmp_path, nprocs):
    env = {"TEST_REPORT_DIR": str(tmp_path), "TEST_LOG_LEVEL": "DEBUG"}
    result = run_job("consecutive_calls.py", nprocs, tmp_path, env=env, timeout=200)
    assert result.returncodes == [0] * nprocs, result.describe()
    # rank 1 started the call after "interrupt" while the others still ran it
    assert "store server of an earlier call" in result.ranks[1].output
    for rank in range(nprocs):
        calls = {i: c for i, c in enumerate(result.report(rank))}
        outcomes = [c["outcome"] for c in calls.values()]
        assert outcomes[0] == outcomes[4] == {"iteration": 0, "sum": nprocs * nprocs}
        assert outcomes[1] == {"iteration": 1, "sum": nprocs * nprocs}
        if rank == 1:
            assert outcomes[2] == "KeyboardInterrupt"
        else:  # the others go on without initial rank 1
            assert outcomes[2] == {"iteration": 1, "sum": (nprocs - 1) ** 2}
        if rank == 0:
            assert outcomes[3] == "RestartAbort"
        else:  # the host left first; a peer may notice that before its own RestartAbort
            assert isinstance(outcomes[3], str), result.describe()
        for call in calls.values():
            leftovers = {k: call[k] for k in ("stores", "threads", "children", "listening")}
            assert not any(leftovers.values()), (rank, call["kind"], leftovers)
    assert not result.leftovers, result.leftovers


def fast_wrapper(**kwargs):
    """A Wrapper with short intervals, for tests that restart in a few milliseconds."""
    return inprocess.Wrapper(
        monitor_thread_interval=20 * ms,
        monitor_process_interval=20 * ms,
        progress_watchdog_interval=20 * ms,
        last_call_wait=10 * ms,
        soft_timeout=30 * s,
        hard_timeout=60 * s,
        **kwargs,
    )


def _restarts_once(wrapper: inprocess.Wrapper) -> bool:
    """Whether a function under ``wrapper`` that raises in its first iteration
    completes in its second."""

    @wrapper
    def train(call_wrapper: inprocess.CallWrapper = None):
        if call_wrapper.iteration == 0:
            raise RuntimeError("restart once")
        return call_wrapper.iteration

    return train() == 1


def _listening(port: int) -> bool:
    return any(
        c.laddr.port == port and c.status == "LISTEN"
        for c in psutil.Process().net_connections("tcp")
    )


@pytest.fixture(params=["forked", "spawned"])
def monitor(request):
    """Which way the monitor process starts: forked, or (another thread runs) spawned."""
    from inprocess.monitor_process import fork_is_safe

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    if request.param == "spawned":
        other.start()
    assert fork_is_safe() == (request.param == "forked")
    yield request.param
    stop.set()
    if other.is_alive():
        other.join()


@pytest.mark.timeout(120)
def test_every_way_out_of_a_call_releases_the_store(single_rank):
    """Return, exception, RestartAbort, KeyboardInterrupt: no store object (not even
    garbage awaiting collection), no server, no thread is left once the call ends."""
    import torch.distributed as dist

    threads = threading.active_count()

    def run(ending, **kwargs):
        @fast_wrapper(**kwargs)
        def train(call_wrapper: inprocess.CallWrapper = None):
            dist.init_process_group("gloo")
            dist.destroy_process_group()
            if ending == "raise" and call_wrapper.iteration == 0:
                raise RuntimeError("restart once")
            if ending == "interrupt":
                raise KeyboardInterrupt
            return call_wrapper.iteration

        return train()

    assert run("return") == 0
    assert live_stores() == []
    assert run("raise") == 1
    assert live_stores() == []
    with pytest.raises(inprocess.exception.RestartAbort) as aborted:
        run("raise", initialize=inprocess.initialize.RetryController(max_iterations=1))
    assert live_stores() == [], "the traceback held by the caller keeps no store alive"
    with pytest.raises(KeyboardInterrupt) as interrupted:
        run("interrupt")
    assert live_stores() == []
    assert not _listening(single_rank)
    assert threading.active_count() == threads
    del aborted, interrupted


@pytest.mark.timeout(120)
def test_store_factory_defined_in_a_function(single_rank, monitor):
    """The monitor process reaches the store through its description, not by
    pickling the factory: any subclass works, forked or spawned."""

    class LocalStore(inprocess.store.TCPStore):
        pass

    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(LocalStore)

    assert _restarts_once(
        fast_wrapper(store_factory=LocalStore, store_kwargs={"port": single_rank})
    )
    assert live_stores() == []


@pytest.mark.timeout(120)
def test_store_without_description_needs_fork_or_pickle(single_rank, monitor):
    """A store that cannot describe itself: the forked monitor inherits its
    factory; a spawned one cannot get it, which is a clear error."""

    class Opaque(inprocess.store.TCPStore):
        def client_spec(self):
            return None

    @fast_wrapper(store_factory=Opaque)
    def train():
        return 7

    if monitor == "forked":
        assert train() == 7
    else:
        with pytest.raises(TypeError, match=r"client_spec\(\)"):
            train()
    assert live_stores() == []
    assert not _listening(single_rank)


def test_stores_describe_how_to_reach_them(tmp_path):
    server = inprocess.store.TCPStore("127.0.0.1", 0, is_master=True)
    file_store = inprocess.store.FileStore(str(tmp_path / "store"), 1)
    prefixed = inprocess.store.PrefixStore("job", server)
    try:
        for store in (server, file_store, prefixed):
            spec = pickle.loads(pickle.dumps(store.client_spec()))
            client = spec.connect()
            client.set("from_client", repr(store))
            assert store.get("from_client").decode() == repr(store)
            if isinstance(client, inprocess.store.TCPStore):
                assert not client.is_master
            del client
        assert prefixed.client_spec().kwargs["prefix"] == "job"
    finally:
        del server, file_store, prefixed


@pytest.mark.timeout(120)
def test_a_file_store_job_restarts_and_completes(single_rank, tmp_path):
    """``store_factory=FileStore`` (a single-host job): sealed records, the monitor
    process's fault watch and a restart all work over the file."""
    from inprocess.store import FileStore

    assert _restarts_once(
        fast_wrapper(store_factory=FileStore, store_kwargs={"file_name": str(tmp_path / "store")})
    )
    assert live_stores() == []
