"""The restart protocol at a few hundred simulated ranks (issue 24): what a rank reads per
restart does not grow with N, a rank lost during a barrier ends it at once, a digest
mismatch is caught.

Simulated ranks are threads with a client connection each to one real ``TCPStore``
server, running the Wrapper's own code for a restart (as ``benchmarks/restart_scale.py``
does, which measures the same at thousands of ranks).
"""

from __future__ import annotations

import datetime
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import Any

import pytest

from inprocess import Wrapper, records
from inprocess import protocol as P
from inprocess.exception import InternalError
from inprocess.monitor_thread import RankShouldRestart
from inprocess.progress_watchdog import ProgressBoard
from inprocess.protocol import Peers, Roster, barrier_name
from inprocess.relay import RELAY_OWNER, NodeRelay, RelayClient
from inprocess.state import State
from inprocess.store import PrefixStore, TCPStore, new_identity
from inprocess.wrap import CallWrapper, _Result

TD = datetime.timedelta(seconds=120)
NS = "inprocess/scale/call0"


class CountingStore(PrefixStore):
    """A rank's store that counts the bytes its answers carry (what the rank reads),
    and its looks at a rendezvous' decision."""

    read_bytes = 0
    decision_looks = 0

    def entries(self, key: str) -> list[str]:
        if key.endswith("/d"):  # a rendezvous' published decision (protocol.done_key)
            self.decision_looks += 1
        return super().entries(key)

    def _count(self, value: Any) -> Any:
        self.read_bytes += len(value) if isinstance(value, bytes | str) else 0
        return value

    def get(self, key: str) -> Any:
        return self._count(super().get(key))

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        return self._count(super().compare_set(key, expected, desired))

    def multi_get(self, keys: list[str]) -> Any:
        values = super().multi_get(keys)
        for value in values:
            self._count(value)
        return values


class Ranks:
    """``n`` simulated ranks, set up (initial barrier, iteration 0) on one server.

    With ``per_node``, every ``per_node`` consecutive ranks are a node whose
    arrivals go through its relay (:mod:`inprocess.relay`), as under a node
    leader; ``remote_relay``: node 0's relay runs in a process of its own.
    """

    def __init__(self, n: int, per_node: int = 1, remote_relay: bool = False) -> None:
        self.n = n
        self.server = TCPStore(host_name="127.0.0.1", port=0, is_master=True, timeout=TD)
        self.wrappers: list[CallWrapper] = [None] * n  # type: ignore[list-item]
        self.current: list[Any] = [None] * n
        #: bytes each rank read in the initial barrier
        self.setup_reads: list[int] = [0] * n
        self.relays: list[NodeRelay] = []
        self.relay_process: subprocess.Popen | None = None
        self.root = tempfile.mkdtemp(prefix="relays")
        self.groups = [os.path.join(self.root, f"node{k}") for k in range(-(-n // per_node))]
        if per_node > 1:
            for k, group in enumerate(self.groups):
                os.mkdir(group, 0o700)
                if k == 0 and remote_relay:
                    argv = [group, str(self.server.port), NS, str(per_node)]
                    self.relay_process = subprocess.Popen(
                        [sys.executable, "-c", REMOTE_RELAY, *argv]
                    )
                    deadline = time.monotonic() + 60
                    while not os.path.exists(os.path.join(group, RELAY_OWNER)):
                        assert time.monotonic() < deadline, "the relay process did not start"
                        time.sleep(0.05)
                    continue
                relay = NodeRelay(group, self.connect, expected=lambda: per_node)
                relay.start()
                self.relays.append(relay)
        wrapper = Wrapper(abort=None, barrier_timeout=datetime.timedelta(seconds=600))

        def setup(rank: int) -> None:
            # connected on the ranks' threads: a connection may wait for a name lookup
            raw = TCPStore(host_name="127.0.0.1", port=self.server.port, is_master=False)
            cw = CallWrapper(wrapper)
            cw.state = State(rank=rank, world_size=n)
            cw.namespace = NS
            # launch identities (every rank derives them), but for the last rank: one
            # of its own, as a worker relaunched before the job started has
            cw.identity = new_identity(rank, 1) if rank == n - 1 else cw._call_identity()
            cw._records = records.Recorder(None, cw.identity, "", 0)
            cw._board = ProgressBoard()  # where it hands its peers to its monitor process
            cw.store = CountingStore(NS, raw)
            if per_node > 1:
                cw._relay = RelayClient(self.groups[rank // per_node], cw.identity)
            self.wrappers[rank] = cw
            members = cw._initial_barrier()
            self.setup_reads[rank] = cw.store.read_bytes
            self.current[rank] = cw._iteration_barrier(0, cw._copy_state(), members, set(), [])

        errors = self.each(setup)
        assert not errors, errors

    def each(self, fn: Any, ranks: Any = None) -> dict[int, BaseException]:
        """Runs ``fn(rank)`` on a thread per rank; returns what each raised."""
        errors: dict[int, BaseException] = {}

        def run(rank: int) -> None:
            try:
                fn(rank)
            except BaseException as ex:  # reported to the test
                errors[rank] = ex

        chosen = range(self.n) if ranks is None else ranks
        threads = [threading.Thread(target=run, args=(r,)) for r in chosen]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not any(t.is_alive() for t in threads)
        return errors

    def restart(self, rank: int, faulty: int = 1, derive: bool = True) -> None:
        """One restart after ``faulty``'s exception, as ``CallWrapper._run`` does it
        (``derive=False``: the membership agreed at the iteration barrier, as for a
        rank assignment that may reorder the survivors)."""
        cw, current = self.wrappers[rank], self.current[rank]
        # the others are interrupted in their function: their monitor threads
        # propose no outcome there (the iteration cannot complete without them)
        ex = RuntimeError("injected fault") if rank == faulty else RankShouldRestart()
        cw._classify_fault(_Result(exception=ex), types.SimpleNamespace(cause="fault"))
        previous = cw._copy_state()
        termination = cw._termination_barrier(current)
        self.current[rank] = cw._iteration_barrier(
            current.index + 1,
            previous,
            current.members,
            set(termination.terminated),
            list(termination.joiners),
            termination if derive else None,
        )
        assert Peers.parse(cw._board.read_text()).iteration == current.index + 1

    def barrier_arrivals(self, iteration: int) -> int:
        """How many arrived at the iteration barrier of ``iteration`` (0: it was derived)."""
        key = f"{NS}/{barrier_name(iteration, 0)}"
        return int(self.server.add(key, 0))

    def connect(self) -> PrefixStore:
        return PrefixStore(
            NS, TCPStore(host_name="127.0.0.1", port=self.server.port, is_master=False)
        )

    def close(self) -> None:
        for relay in self.relays:
            relay.stop()
        if self.relay_process is not None:
            self.relay_process.kill()
            self.relay_process.wait()
        for cw in self.wrappers:
            if cw is not None:
                if cw._relay is not None:
                    cw._relay.close()
                cw.store = None
                cw._board.close()
        self.wrappers.clear()
        self.server = None
        shutil.rmtree(self.root, ignore_errors=True)


#: node 0's relay in a process of its own (argv: its group's directory, the store's
#: port, the namespace, the ranks per node)
REMOTE_RELAY = """
import sys, time
from inprocess.relay import NodeRelay
from inprocess.store import PrefixStore, TCPStore
directory, port, namespace, per_node = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def connect():
    return PrefixStore(namespace, TCPStore(host_name="127.0.0.1", port=port, is_master=False))
NodeRelay(directory, connect, expected=lambda: per_node).start()
time.sleep(600)
"""


@pytest.fixture
def ranks():
    made: list[Ranks] = []

    def make(n: int, per_node: int = 1, remote_relay: bool = False) -> Ranks:
        made.append(Ranks(n, per_node, remote_relay))
        return made[-1]

    yield make
    for r in made:
        r.close()
    made.clear()


def _read_per_rank(group: Ranks, derive: bool = True) -> float:
    before = [cw.store.read_bytes for cw in group.wrappers]
    errors = group.each(functools.partial(group.restart, derive=derive))
    assert not errors, errors
    members = {tuple(c.members) for c in group.current}
    assert len(members) == 1 and len(next(iter(members))) == group.n
    reads = [cw.store.read_bytes - b for cw, b in zip(group.wrappers, before, strict=True)]
    return sorted(reads)[group.n // 2]  # the median rank (the deciders read more)


@pytest.mark.timeout(300)
def test_what_a_rank_reads_per_restart_does_not_grow_with_n(ranks):
    """At 40 and at 240 ranks the median rank reads the same number of bytes in a restart
    (before the protocol sent changes it grew with N: the whole membership)."""
    small_group, large_group = ranks(40), ranks(240)
    for derive in (True, False):  # the membership derived, and agreed at the barrier
        small = _read_per_rank(small_group, derive)
        large = _read_per_rank(large_group, derive)
        assert large < 1.2 * small, (derive, small, large)
        assert large < 4000, (derive, large)
    # nor in the initial barrier: the ranks derive each other's identities (only the
    # one rank with an identity of its own is listed), and all hold one roster
    setup = [sorted(g.setup_reads)[g.n // 2] for g in (small_group, large_group)]
    assert setup[1] < 1.2 * setup[0] and setup[1] < 2000, setup
    rosters = {id(c.members) for c in large_group.current}
    assert len(rosters) == 1, "every rank holds the same roster object"
    assert large_group.current[0].members[-1] == large_group.wrappers[-1].identity


@pytest.mark.timeout(300)
@pytest.mark.parametrize("per_node", [1, 8], ids=["own-arrivals", "node-relays"])
def test_a_rank_lost_during_the_barrier_is_counted_for_it_and_leaves_the_membership(
    ranks, per_node
):
    """Rank 5 never reaches the termination barrier; once it is marked terminated (as its
    monitor process does) the barrier completes without it, and the next membership has
    every other rank. Through node relays, its node's batch goes without it (after the
    batch window), and the relay has one of the node's ranks count it."""
    group = ranks(64, per_node)
    lost = group.wrappers[5].identity
    survivors = [r for r in range(group.n) if r != 5]
    marked = threading.Event()

    def mark_later() -> None:
        time.sleep(1.0)  # everyone else is waiting by then (or soon)
        # on a connection of its own, as a monitor process has: a rank's client is
        # held by the wait it blocks in (a chunk, up to 30 s)
        monitor = PrefixStore(NS, TCPStore(host_name="127.0.0.1", port=group.server.port))
        monitor.mark_terminated(lost, "process died")
        del monitor
        marked.set()

    marker = threading.Thread(target=mark_later)
    marker.start()
    started = time.monotonic()
    errors = group.each(group.restart, survivors)
    marker.join()
    assert not errors, errors
    # the death is heard at once (a wake-up), not at the end of a chunk
    assert marked.is_set() and time.monotonic() - started < 30
    members = {tuple(group.current[r].members) for r in survivors}
    assert len(members) == 1
    (only,) = members
    assert lost not in only and len(only) == group.n - 1


@pytest.mark.timeout(120)
def test_a_rank_whose_view_of_the_membership_differs_is_caught_by_the_digest(ranks):
    """Two ranks hold the previous membership in different orders: the decider publishes
    the change to its own view; the other rank's digest check refuses to train on it."""
    group = ranks(2)
    previous = [cw._copy_state() for cw in group.wrappers]
    members = list(group.current[0].members)
    views = {0: members, 1: list(reversed(members))}
    decided: dict[int, Any] = {}

    def iterate(rank: int) -> None:
        decided[rank] = group.wrappers[rank]._iteration_barrier(
            1, previous[rank], views[rank], set(), []
        )

    errors = group.each(iterate)
    assert len(errors) == 1, (errors, decided)
    (error,) = errors.values()
    assert isinstance(error, InternalError) and "participants differ" in str(error)


@pytest.mark.timeout(120)
def test_a_derived_membership_is_checked_against_the_termination_decision(ranks):
    """With the default assignment the ranks derive the next membership from the
    termination barrier's decision (no iteration barrier: nobody arrives at it). A
    rank that holds the previous membership in another order derives another one:
    the decision's digest refuses it."""
    group = ranks(4)
    errors = group.each(group.restart)
    assert not errors, errors
    assert group.barrier_arrivals(1) == 0, "the membership of iteration 1 was derived"
    assert {tuple(c.members) for c in group.current} == {tuple(group.current[0].members)}
    # rank 3 holds the members in another order (its state diverged); it arrives
    # first, so one of the others decides
    group.current[3].members = Roster(reversed(group.current[3].members))

    def restart(rank: int) -> None:
        if rank != 3:
            time.sleep(1.0)
        group.restart(rank)

    errors = group.each(restart)
    assert sorted(errors) == [3], errors
    assert isinstance(errors[3], InternalError)
    assert "not the termination barrier's" in str(errors[3])


@pytest.mark.timeout(120)
def test_a_rank_lost_after_a_derived_restart_faults_the_new_iteration(ranks):
    """The derived iteration starts from the fault count the termination barrier's
    decider read: a rank that dies after that barrier (its monitor process marks it
    terminated) faults the new iteration, and the next restart goes on without it.
    A join request after the decision faults it too: the next termination admits
    the joiner, and that restart goes through the iteration barrier."""
    group = ranks(6)
    errors = group.each(group.restart)
    assert not errors, errors
    baseline = group.current[0].baseline
    store = group.wrappers[0].store
    assert store.fault_count() == baseline, "the restart's own fault is behind it"
    lost = group.wrappers[4].identity
    store.mark_terminated(lost, "process died")
    assert P.completion_outcome(store.fault_count(), baseline) == P.FAULT
    survivors = [r for r in range(group.n) if r != 4]
    errors = group.each(group.restart, survivors)
    assert not errors, errors
    members = {tuple(group.current[r].members) for r in survivors}
    assert len(members) == 1 and lost not in next(iter(members))
    assert group.barrier_arrivals(2) == 0  # derived again: nobody joined
    # a join request after the termination decision: a fault of the new iteration
    baseline = group.current[0].baseline
    store.request_join("9/1.joiner")
    assert P.completion_outcome(store.fault_count(), baseline) == P.FAULT


def test_a_wait_for_peers_never_blocks_near_the_hard_timeout():
    """A rank blocked in the store's wait runs no bytecode, so its hard clock runs
    on: the Wrapper caps each wait at a quarter of ``hard_timeout``, and views
    of its store (a rank assignment's prefix) wait the same way."""
    from inprocess.store import WAIT_CHUNK_MAX, WakeWait

    server = TCPStore(host_name="127.0.0.1", port=0, is_master=True, timeout=TD)
    try:
        store = PrefixStore("call", server)
        assert WakeWait(store, TD, 0.01).chunk_max == WAIT_CHUNK_MAX
        store.wait_chunk_max = 0.2
        view = PrefixStore("assignment", store)
        for s in (store, view):
            asked: list[float] = []
            real_wait_for = s.wait_for

            def wait_for(key, seconds, asked=asked, real_wait_for=real_wait_for):
                asked.append(seconds)
                return real_wait_for(key, seconds)

            s.wait_for = wait_for
            waiter = WakeWait(s, datetime.timedelta(seconds=1.2), 0.01)
            while waiter.remaining() > 0:
                waiter.wait()
            # nobody wakes it: it waited chunk after chunk, none longer than the cap
            # (what it asked for: a loaded machine may return late)
            assert asked and max(asked) <= 0.2, asked
            del s.wait_for
    finally:
        del server


def test_initial_ranks_that_are_not_0_to_n_fail_every_rank_at_once():
    """The rank that completes the initial barrier checks the initial ranks once for
    all (the others check only their own place): a duplicate reaches every rank as
    an error naming the ranks, not a wait. With launch identities the two claimants
    of rank 0 even have the same identity: still refused."""
    server = TCPStore(host_name="127.0.0.1", port=0, is_master=True, timeout=TD)
    port = server.port
    wrapper = Wrapper(abort=None, barrier_timeout=datetime.timedelta(seconds=600))
    errors: dict[int, BaseException] = {}

    def rank_main(index: int, initial_rank: int) -> None:
        cw = CallWrapper(wrapper)
        cw.state = State(rank=initial_rank, world_size=3)
        cw.namespace = NS
        cw.identity = cw._call_identity()
        cw.store = PrefixStore(NS, TCPStore(host_name="127.0.0.1", port=port))
        try:
            cw._initial_barrier()
        except BaseException as ex:  # reported to the test
            errors[index] = ex
        finally:
            cw.store = None

    threads = [
        threading.Thread(target=rank_main, args=(i, r)) for i, r in enumerate((0, 0, 2))
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join(120)
    finally:
        del server
    assert sorted(errors) == [0, 1, 2], errors
    for ex in errors.values():
        assert isinstance(ex, InternalError) and "initial ranks [0, 0, 2] are not 0..2" in str(ex)


@pytest.mark.timeout(300)
def test_a_restart_through_node_relays_reaches_the_store_per_node(ranks):
    """240 ranks as 30 nodes of 8 (issue 24, item 3): a restart through the nodes' relays
    gives every rank the same membership; every arrival reached the store in a node's
    batch, and the median rank reads nothing from the store itself (its monitor thread
    proposes no outcome while it is in its function)."""
    group = ranks(240, per_node=8)
    # the membership derived (one rendezvous: the termination barrier's), then
    # agreed at the iteration barrier (two)
    for derive, rendezvous in ((True, 1), (False, 2)):
        relayed = sum(r.relayed for r in group.relays)
        batches = sum(r.batches for r in group.relays)
        read = _read_per_rank(group, derive)
        relayed = sum(r.relayed for r in group.relays) - relayed
        batches = sum(r.batches for r in group.relays) - batches
        assert relayed == rendezvous * 240, (derive, relayed)
        assert batches < relayed / 2, (derive, batches, relayed)
        assert read == 0, (derive, read)


@pytest.mark.timeout(300)
def test_a_relay_killed_mid_barrier_costs_a_chunk_not_a_hang(ranks):
    """Node 0's relay runs in a process of its own and is SIGKILLed once it took its ranks'
    arrivals, while rank 15 still holds the barrier back. Its ranks find the decision in
    the store at the end of their wait chunk, then arrive on their own at the next
    barrier: the restart completes with every rank."""
    group = ranks(16, per_node=8, remote_relay=True)
    assert group.relay_process is not None
    held = threading.Event()
    errors: dict[int, BaseException] = {}

    def restart(rank: int) -> None:
        if rank == 15:
            held.wait(60)
        group.restart(rank)

    runner = threading.Thread(target=lambda: errors.update(group.each(restart)))
    runner.start()
    time.sleep(2.0)  # node 0's arrivals are with its relay by then
    group.relay_process.kill()
    group.relay_process.wait()
    killed = time.monotonic()
    held.set()
    runner.join(120)
    assert not runner.is_alive() and not errors, errors
    assert time.monotonic() - killed < 30
    members = {tuple(c.members) for c in group.current}
    assert len(members) == 1 and len(next(iter(members))) == 16


@pytest.mark.timeout(60)
def test_a_rank_waiting_on_a_relay_hears_of_its_death_at_once(tmp_path):
    """The relay's process dies while a rank waits for its answer (a SIGKILLed rank that
    led its node): the wait ends at once, not at the end of its chunk (seconds per
    barrier), and the rank sees the relay gone; a relay that lives is still waited for,
    the successor of a dead one too."""
    import socket

    from inprocess.procfs import process_start_time

    relay = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "relay.sock"))  # the relay's socket: it takes arrivals, answers none
    client = RelayClient(str(tmp_path), "0/0.a")
    try:
        deadline = time.monotonic() + 30
        while process_start_time(relay.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / RELAY_OWNER).write_text(f"{relay.pid} {process_start_time(relay.pid)}")
        assert client.arrive("i0/t", "0/0.a", "", 2)
        started = time.monotonic()
        assert client.receive("i0/t", 0.3) is None  # alive, silent: the whole timeout
        assert time.monotonic() - started >= 0.25 and client.relay_alive()
        threading.Timer(0.5, relay.kill).start()
        started = time.monotonic()
        assert client.receive("i0/t", 30.0) is None
        waited = time.monotonic() - started
        relay.wait()
        assert not client.relay_alive()
        assert waited < 10, waited  # at once (0.5 s), not after the 30 s asked for
        # A successor leads: the next arrival goes to it and waits for its answer
        # (the dead one's pidfd must not send the rank off at every barrier).
        successor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            while process_start_time(successor.pid) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            start = process_start_time(successor.pid)
            (tmp_path / RELAY_OWNER).write_text(f"{successor.pid} {start}")
            assert client.arrive("i1/t", "0/0.a", "", 2)
            assert client.relay == (successor.pid, start)
            started = time.monotonic()
            assert client.receive("i1/t", 0.3) is None
            assert time.monotonic() - started >= 0.25 and client.relay_alive()
        finally:
            successor.kill()
            successor.wait()
    finally:
        client.close()
        sock.close()
        relay.kill()
        relay.wait()


@pytest.mark.timeout(120)
def test_a_rank_waiting_on_a_live_relay_leaves_the_store_alone(ranks):
    """Rank 15 holds the barrier back 7 s: the ranks waiting on their live relays look
    at the store themselves at no chunk's end (the relay brings the decision). A relay
    whose decisions are lost (dropped here) costs its ranks a look once their chunks
    reached the store's cap, not a hang."""
    group = ranks(16, per_node=8)
    looks = [cw.store.decision_looks for cw in group.wrappers]

    def restart(rank: int) -> None:
        if rank == 15:
            time.sleep(7.0)  # past the first two chunks (2 s, then 4 s) of the others
        group.restart(rank)

    errors = group.each(restart)
    assert not errors, errors
    waited = [cw.store.decision_looks - b for cw, b in zip(group.wrappers, looks, strict=True)]
    assert waited[:15] == [0] * 15, waited
    # node 1's relay drops every decision; its ranks' chunks are capped at 1 s
    dropping = group.relays[1]
    told = dropping._tell

    def drop_decisions(arrivals, kind, name, text=""):
        if kind != "decision":
            told(arrivals, kind, name, text)

    dropping._tell = drop_decisions
    for cw in group.wrappers[8:]:
        cw.store.wait_chunk_max = 1.0
    started = time.monotonic()
    errors = group.each(group.restart)
    assert not errors, errors
    assert time.monotonic() - started < 60
    assert len({tuple(c.members) for c in group.current}) == 1


@pytest.mark.timeout(60)
def test_a_relay_that_stops_sends_off_the_arrivals_still_queued(tmp_path):
    """An arrival queued on the relay's socket when it stops (its receiving thread has
    not taken it) is answered "arrive on your own", not dropped with the socket."""
    server = TCPStore(host_name="127.0.0.1", port=0, is_master=True, timeout=TD)

    def connect() -> PrefixStore:
        return PrefixStore(NS, TCPStore(host_name="127.0.0.1", port=server.port, is_master=False))

    relay = NodeRelay(str(tmp_path), connect, expected=lambda: 2)
    relay._receive = lambda: None  # a receiving thread that takes nothing
    relay.start()
    client = RelayClient(str(tmp_path), "0/0.a")
    try:
        assert client.arrive("i0/t", "0/0.a", "", 2)
        relay.stop()
        assert client.receive("i0/t", 10.0) == ("direct", "")
    finally:
        client.close()
        server = None  # the store's server, down with its last reference


@pytest.mark.timeout(60)
def test_a_relay_ignores_garbage_and_sends_its_waiters_off_when_it_stops(tmp_path):
    """What reaches the relay's socket malformed is dropped; a relay that stops tells the
    ranks waiting on it to arrive on their own."""
    import socket

    server = TCPStore(host_name="127.0.0.1", port=0, is_master=True, timeout=TD)

    def connect() -> PrefixStore:
        return PrefixStore(NS, TCPStore(host_name="127.0.0.1", port=server.port, is_master=False))

    relay = NodeRelay(str(tmp_path), connect, expected=lambda: 2)
    relay.start()
    client = RelayClient(str(tmp_path), "0/0.a")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as garbage:
            for data in (b"\xff\xfe", b"a\x1fb", b"n\x1fi\x1fv\x1fnotanumber\x1fr"):
                garbage.sendto(data, str(tmp_path / "relay.sock"))
        assert client.arrive("b/x", "0/0.a", "v", 3)
        # one of three participants: handed to the store after the batch window, undecided
        assert client.receive("b/x", 0.5) is None
        assert relay.relayed == 1 and relay.batches == 1
    finally:
        relay.stop()
    assert client.receive("b/x", 5) == ("direct", "")
    assert not (tmp_path / "relay.sock").exists() and not (tmp_path / RELAY_OWNER).exists()
    client.close()
    assert os.listdir(tmp_path) == []
