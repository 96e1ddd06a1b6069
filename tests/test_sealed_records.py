"""Sealed store records (issue 24, item 4): a store client without the job's secret
writes nothing the protocol acts on; garbage is ignored and logged once per key.

Unit tests on the store mixin over a real ``TCPStore`` (server in this process)
and on ``HashStore``; the job-level test is in ``tests/test_job_security.py``.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import pytest
import torch.distributed as dist

from inprocess import protocol as P
from inprocess import security
from inprocess.store import PrefixStore, StoreMixin
from inprocess.store import TCPStore as WrapperTCPStore

SECRET = "sealed-records-test-secret"
TD = datetime.timedelta(seconds=20)
A, B, C = "0/0.aaaaaaaaaa", "1/0.bbbbbbbbbb", "2/0.cccccccccc"


class HashStore(dist.HashStore, StoreMixin):
    """An in-memory store with the Wrapper protocol."""


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(security.JOB_SECRET_ENV, SECRET)
    security._REJECTED.clear()
    yield
    security._REJECTED.clear()


@pytest.fixture
def tcp():
    """A real TCPStore server (this process) and a stranger's plain client of it."""
    server = WrapperTCPStore("127.0.0.1", 0, is_master=True, timeout=TD)
    stranger = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=TD)
    pair = [PrefixStore("inprocess/job/g0/call0", server), stranger]
    del server, stranger
    yield pair
    pair.clear()  # the fixture's value outlives this teardown: it must hold no store


def _rejections(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "inprocess.security"]


# --------------------------------------------------------------------------- the seal


def test_seal_round_trips_and_binds_key_and_secret():
    record = security.seal("k", "value ~ with = separators")
    assert security.open_records("k", record) == ["value ~ with = separators"]
    assert security.open_records("other", record) == []  # replayed under another key
    assert security.open_records("k", record, secret="another") == []
    assert security.open_records("k", record.encode()) == ["value ~ with = separators"]
    with pytest.raises(ValueError, match="one line"):
        security.seal("k", "two\nlines")


def test_bad_records_are_skipped_and_good_ones_kept(caplog):
    good = [security.seal("k", t) for t in ("a", "b", "a")]  # "a" replayed: counts once
    value = (
        "notanumber/x,"  # unterminated garbage: the next record still reads
        + good[0]
        + "\nb~AAAAAAAAAAAAAAAA\n"  # forged MAC
        + good[1]
        + "\xff\xfe garbage"
        + good[2]
        + "~"
    )
    with caplog.at_level(logging.WARNING, "inprocess.security"):
        for _ in range(5):
            assert security.open_records("k", value) == ["a", "b"]
            assert security.open_records("k", b"\xff\x00" + value.encode()) == ["a", "b"]
    assert len(_rejections(caplog)) == 1 and "'k'" in _rejections(caplog)[0]


def test_without_a_secret_the_mac_is_public(monkeypatch):
    monkeypatch.delenv(security.JOB_SECRET_ENV)
    record = security.seal("k", "v")
    assert security.open_records("k", record) == ["v"]
    assert security.open_records("k", "v") == []  # form is still checked
    monkeypatch.setenv(security.JOB_SECRET_ENV, SECRET)
    assert security.open_records("k", record) == []


def test_records_are_sealed_with_the_full_key_name(tcp):
    store, stranger = tcp
    store.put(P.MEMBERSHIP, P.Membership(0, (A,)).encode())
    # torch's ``set`` does not wait for the server: a reply on the writer's own
    # connection orders the write before the stranger's read on another one
    assert store.check([P.MEMBERSHIP])
    full = "inprocess/job/g0/call0/" + P.MEMBERSHIP
    assert P.membership(stranger, "inprocess/job/g0/call0") == P.Membership(0, (A,))
    # the same record copied into another call's key is not authentic there
    stranger.set("inprocess/job/g0/call1/" + P.MEMBERSHIP, stranger.get(full))
    assert P.membership(stranger, "inprocess/job/g0/call1") is None


# --------------------------------------------------------------------------- every key


GARBAGE = [
    "notanumber/x,",
    "9/9.forged,",
    '{"rank": "1/0.bbbbbbbbbb", "reason": "forged", "time": 0}\n',
    "\n1/0.bbbbbbbbbb~AAAAAAAAAAAAAAAA\n",
    '{"iteration": 7, "members": ["x"]}',
    "completed",
    "fault",
    "\xff",
]


def _attack(stranger: dist.Store, keys: list[str]) -> None:
    """What a stranger who lists the keys does: garbage appended to each, counters raised."""
    for key in keys:
        for text in GARBAGE:
            stranger.append(key, text)
    for key in stranger.list_keys():
        value = stranger.get(key)
        if value.strip().lstrip(b"-").isdigit():
            stranger.add(key, 5)


def test_garbage_in_every_protocol_key_is_ignored_and_logged_once(tcp, caplog):
    store, stranger = tcp
    ns = "inprocess/job/g0/call0"
    role = "inprocess/job/g0"
    # a job's records: a death, a fault, a join request, a membership, an outcome, ...
    store.base_store.announce_call(role, 0)
    store.publish_membership(2, [A, B])
    store.record_fault(A, "RuntimeError: boom")
    store.mark_terminated(C, "process died")
    store.mark_left(B)
    store.request_join("3/1.dddddddddd")
    store.decide_outcome(1, P.COMPLETED)
    store.mark_completed(A, 1)
    store.send_node_heartbeat("n0", [A, B])
    store.place(A, "n0")
    keys = [k for k in stranger.list_keys() if not k.endswith("/faults")]
    names = {k.rsplit("/", 1)[-1] for k in keys}
    assert {"membership", "fault_log", "terminated", "left", "join_requests", P.OUTCOME} <= names
    assert {"latest_call", "wrapped"} <= names
    before = (
        store.membership(),
        store.fault_log(),
        store.fault_count(),
        store.terminated(),
        store.left(),
        store.join_requests(),
        store.outcome(1),
        store.has_completed(A),
        store.is_terminated(C),
        store.node_heartbeat("n0"),
        store.node_of(A),
        P.latest_call(stranger, role),
        P.wrapper_present(stranger, role),
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, "inprocess.security"):
        _attack(stranger, keys)
        for _ in range(3):  # read as often as a poll would: one line per key all the same
            after = (
                store.membership(),
                store.fault_log(),
                store.fault_count(),
                store.terminated(),
                store.left(),
                store.join_requests(),
                store.outcome(1),
                store.has_completed(A),
                store.is_terminated(C),
                store.node_heartbeat("n0"),
                store.node_of(A),
                P.latest_call(stranger, role),
                P.wrapper_present(stranger, role),
            )
            assert after == before
            assert P.terminated(stranger, ns) == [C]
            assert [e["reason"] for e in P.fault_log(stranger, ns)] == [
                "RuntimeError: boom",
                "terminated: process died",
                "join request",
            ]
    lines = _rejections(caplog)
    assert len(lines) == len(set(lines)), lines  # once per key
    for name in ("membership", "fault_log", "terminated", "join_requests", P.OUTCOME, "wrapped"):
        assert sum(f"/{name}'" in line for line in lines) == 1, (name, lines)
    # the counters were raised; the counts read did not move
    assert store.fault_signal() > 3 and store.fault_count() == 3


def test_forged_records_of_absent_keys_decide_nothing(tcp):
    store, stranger = tcp
    ns = "inprocess/job/g0/call0"
    # a stranger who guesses names writes first: a death, an outcome, a decision, a join
    stranger.set(f"{ns}/terminated/{A}", "forged")
    stranger.set(f"{ns}/{P.iteration_key(0, P.OUTCOME)}", "fault")
    stranger.set(P.done_key(f"{ns}/initial"), f"{A},")
    stranger.set(f"{ns}/completed/{B}", "0")
    stranger.set(f"{ns}/{P.node_key(P.NODE_BEAT, 'n1')}", f"99999 {B}")
    stranger.set(f"{ns}/{P.PLACED}/{B}", "n1")
    stranger.set(f"inprocess/job/g0/{P.LATEST_CALL}", "notanumber")
    stranger.append(f"{ns}/join_requests", "notanumber/x,")
    assert not store.is_terminated(A) and store.outcome(0) == ""
    assert store.read(P.done_key(P.INITIAL)) is None and not P.initial_done(stranger, ns)
    assert not store.has_completed(B) and store.node_heartbeat("n1") == (0, [])
    assert store.node_of(B) is None
    assert store.join_requests() == []  # used to crash the decider (int("notanumber"))
    # the protocol still writes over them: the first authentic record stands
    assert store.mark_terminated(A, "died") and store.is_terminated(A)
    assert store.decide_outcome(0, P.COMPLETED) == P.COMPLETED
    assert store.decide_outcome(0, P.FAULT) == P.COMPLETED
    store.base_store.announce_call("inprocess/job/g0", 2)
    assert P.latest_call(stranger, "inprocess/job/g0") == 2


# --------------------------------------------------------------------------- counters wake only


def _rendezvous(store_of, members, values, decide) -> dict[str, str]:
    results: dict[str, str] = {}

    def arrive(identity: str) -> None:
        results[identity] = store_of(identity).rendezvous(
            "rdzv", identity, members, values[identity], TD, decide, 0.01
        )

    threads = [threading.Thread(target=arrive, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_a_rendezvous_decides_on_authentic_arrivals_only(tcp):
    store, stranger = tcp
    ns = "inprocess/job/g0/call0"
    # The arrival counter is inflated and forged arrivals and decisions are in place
    # before anyone arrives: the rendezvous still waits for A, B and C, then decides once.
    stranger.add(P.count_key(f"{ns}/rdzv"), 10)
    stranger.append(P.arrivals_key(f"{ns}/rdzv"), f"{A}=9\n{B}=9\nnotanumber/x=1\n")
    stranger.set(P.done_key(f"{ns}/rdzv"), "forged decision")
    decided = []

    def decide(arrivals, terminated, baseline):
        decided.append(dict(arrivals))
        return ",".join(f"{i}:{v}" for i, v in sorted(arrivals.items()))

    port = store.base_store.port
    clients = []

    def client(_identity):
        raw = WrapperTCPStore.client(host_name="127.0.0.1", port=port, timeout=TD)
        clients.append(raw)
        return PrefixStore(ns, raw)

    results = _rendezvous(client, [A, B, C], {A: "0", B: "1", C: "2"}, decide)
    expected = f"{A}:0,{B}:1,{C}:2"
    assert results == {A: expected, B: expected, C: expected}
    assert all(d == {A: "0", B: "1", C: "2"} for d in decided)
    clients.clear()


def test_a_counted_barrier_and_gather_ignore_inflated_counts_and_forged_lines():
    store = HashStore()
    store.add(P.count_key("g/barrier"), 7)  # a stranger's add: would complete the barrier at once
    store.append("g/lines", "forged line\n")
    store.append(P.arrivals_key("g/barrier"), "9/9.forged,")
    results: dict[str, list[str]] = {}

    def gather(identity: str, line: str) -> None:
        results[identity] = store.all_gather_lines("g", identity, line, 3, TD, 0.01)

    threads = [threading.Thread(target=gather, args=(i, f"line of {i}")) for i in (A, B, C)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 3
    for lines in results.values():
        assert sorted(lines) == sorted(f"line of {i}" for i in (A, B, C))


def test_the_monitor_thread_is_not_woken_into_a_restart_by_the_counter():
    from test_monitor_thread import make_monitor, spin

    store = HashStore()
    monitor, _lock, aborted = make_monitor(store)
    try:
        monitor.arm(0, store.fault_count(), state=None)
        for _ in range(20):  # a stranger adding to the fault counter, forging entries
            store.add(P.FAULTS, 3)
            store.append(P.FAULT_LOG, '{"rank": "1/0.x", "reason": "forged", "time": 0}\n')
            spin(0.03)
        assert not aborted and store.outcome(0) == ""
    finally:
        monitor.disarm()
        monitor.shutdown()


# --------------------------------------------------------------------------- denial of service


def test_deleted_arrivals_end_a_rendezvous_at_its_timeout():
    """Deleting records is out of a MAC's reach: the rendezvous that needed them ends at
    its timeout (a recorded BarrierTimeout), never hangs."""
    from inprocess.store import BarrierTimeout

    store = HashStore()
    short = datetime.timedelta(seconds=1)
    errors: dict[str, BaseException] = {}

    def arrive(identity: str) -> None:
        try:
            store.rendezvous("r", identity, [A, B], "0", short, lambda *a: "x", 0.01)
        except BaseException as ex:  # recorded for the assertion
            errors[identity] = ex

    first = threading.Thread(target=arrive, args=(A,))
    first.start()
    while not store.check([P.arrivals_key("r")]):
        pass
    store.delete_key(P.arrivals_key("r"))  # the stranger's delete, before B arrives
    arrive(B)
    first.join(30)
    assert set(errors) == {A, B}
    assert all(isinstance(e, BarrierTimeout) for e in errors.values()), errors


def test_forged_wake_ups_neither_decide_nor_make_waiters_spin(tcp):
    """A stranger sets the call's next 500 wake-up keys and raises the wake-up counter:
    every wait then returns at once, but a waiter that finds nothing new pauses before
    the next, so it stays a few store operations per poll interval, not a busy loop; the
    rendezvous still waits for its last member and decides once."""
    store, stranger = tcp
    ns = "inprocess/job/g0/call0"
    for k in range(1, 501):
        stranger.set(f"{ns}/{P.wake_key(k)}", "forged")
    stranger.add(f"{ns}/{P.WAKE_SEQ}", 3)
    port = store.base_store.port
    waits: list[float] = []
    clients = []

    class Counting(PrefixStore):
        def wait_for(self, key: str, seconds: float) -> bool:
            waits.append(time.monotonic())
            return super().wait_for(key, seconds)

    def client(identity):
        raw = WrapperTCPStore.client(host_name="127.0.0.1", port=port, timeout=TD)
        clients.append(raw)
        return (Counting if identity == A else PrefixStore)(ns, raw)

    results: dict[str, str] = {}

    def arrive(identity: str, after: float) -> None:
        time.sleep(after)
        results[identity] = client(identity).rendezvous(
            "rdzv", identity, [A, B], "v", TD, lambda a, t, b: ",".join(sorted(a)), 0.02
        )

    threads = [
        threading.Thread(target=arrive, args=(A, 0.0)),
        threading.Thread(target=arrive, args=(B, 1.0)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {A: f"{A},{B}", B: f"{A},{B}"}
    # about 1 s of waiting for B at a 0.02 s pause: at most ~50 waits, never thousands
    assert 2 <= len(waits) <= 80, len(waits)
    clients.clear()


def test_a_non_number_in_a_counter_is_a_store_error_not_a_hang(tcp):
    store, stranger = tcp
    store.fault_signal()
    stranger.set("inprocess/job/g0/call0/faults", "not a number")
    # the stranger's set and our add travel on two connections: a read on the
    # stranger's (answered after its set) makes sure the server holds the value
    # before we add (without it the add came first once, under load)
    assert stranger.get("inprocess/job/g0/call0/faults") == b"not a number"
    with pytest.raises(Exception, match=r"(?i)recv|connection|closed|reset"):
        store.fault_signal()  # torch's server drops this client's connection
