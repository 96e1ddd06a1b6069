"""Waits that block on the store rather than poll it (issue 24, item 2): the
completion barrier's wait for the iteration's outcome, and a rendezvous that
learns of deaths from the one counter read it makes before it arrives.

Over a real ``TCPStore`` (server in this process); store operations are counted
on the waiter's own client (see ``test_fault_watch.CountingStore``).
"""

from __future__ import annotations

import datetime
import threading
import time
import types

import pytest
import torch.distributed as dist
from test_fault_watch import NS, TD, CountingStore, server  # noqa: F401 (a fixture)

from inprocess import protocol as P
from inprocess.membership import OutcomeWait
from inprocess.store import PrefixStore


def client(port: int) -> CountingStore:
    return CountingStore(NS, dist.TCPStore("127.0.0.1", port, None, False, timeout=TD))


def config(
    interval: float = 0.2, completion_timeout: float = 120.0, soft_timeout: float = 60.0
) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        monitor_thread_interval=interval,
        completion_timeout=completion_timeout,
        soft_timeout=soft_timeout,
    )


def test_a_completion_waiter_is_woken_by_the_decision_and_polls_nothing(server):  # noqa: F811
    port, store, _ = server
    waiter_store = client(port)
    wait = OutcomeWait(waiter_store, 0, config())
    ops = waiter_store.ops
    deciding = threading.Timer(0.5, store.decide_outcome, args=(0, P.COMPLETED))
    deciding.start()
    try:
        start = time.monotonic()
        wait.wait(None)  # a spare's wait: no deadline, a chunk (2 s) at most
        waited = time.monotonic() - start
    finally:
        deciding.join()
    assert wait.idle, "woken by the decision, not by the end of the chunk"
    assert waiter_store.ops - ops == 1, "one blocking wait, no read meanwhile"
    assert waiter_store.outcome(0) == P.COMPLETED
    assert waited < 30  # generous: only says it did not wait out a timeout


def test_a_strangers_garbage_in_the_outcome_key_costs_a_pause_not_a_spin(server):  # noqa: F811
    port, _, stranger = server
    waiter_store = client(port)
    stranger.set(f"{NS}/{P.iteration_key(0, P.OUTCOME)}", "garbage")
    wait = OutcomeWait(waiter_store, 0, config(interval=0.2))
    ops = waiter_store.ops
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        assert waiter_store.outcome(0) == "", "garbage decides nothing"
        wait.wait(None)
    # one read and one wait per pause (0.2 s) at most, over 1 s
    assert waiter_store.ops - ops <= 2 * 7, waiter_store.ops - ops


def test_an_active_ranks_wait_ends_at_its_deadline(server):  # noqa: F811
    port, _, _ = server
    waiter_store = client(port)
    wait = OutcomeWait(waiter_store, 0, config())
    deadline = time.monotonic() + 0.3
    wait.wait(deadline)
    assert not wait.idle
    assert time.monotonic() >= deadline - 0.05


def test_a_chunk_stays_under_a_quarter_of_the_soft_and_completion_timeouts(server):  # noqa: F811
    """The main thread runs no bytecode in a wait: the iteration's soft clock runs on,
    so a spare blocked for longer would be restarted for a hang."""
    port, _, _ = server
    store = client(port)
    assert OutcomeWait(store, 0, config(completion_timeout=2.0)).chunk_max == 0.5
    assert OutcomeWait(store, 0, config(soft_timeout=3.0)).chunk_max == 0.75
    assert OutcomeWait(store, 0, config()).chunk_max == 15.0  # 60 s / 4


def test_a_rendezvous_counts_a_death_from_the_counter_read_before_it_arrives(server):  # noqa: F811
    """A member dead before the others arrive: the waiters learn it from the wake-up
    counter they read anyway (deaths in its high bits), count it on its behalf and
    complete, with no read of a separate death counter."""
    port, store, _ = server
    members = ["0/0.aaaaaaaaaa", "1/0.bbbbbbbbbb", "2/0.cccccccccc"]
    store.mark_terminated(members[2], "process died")
    assert store.terminated_epoch() == 1
    decided: list[str] = []
    clients = [client(port), client(port)]

    def arrive(rank: int) -> None:
        decided.append(
            clients[rank].rendezvous(
                "r",
                members[rank],
                members,
                "x",
                datetime.timedelta(seconds=60),
                lambda arrivals, dead, _base: ",".join(sorted(dead)) or "none",
                poll_limit=0.05,
            )
        )

    threads = [threading.Thread(target=arrive, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert decided == [members[2], members[2]]


def test_the_wake_counter_holds_wake_ups_and_deaths():
    assert P.wake_state(0) == (0, 0)
    assert P.wake_state(3) == (3, 0)
    assert P.wake_state(3 + 2 * P.DEATH_WAKE) == (5, 2)
    assert P.wake_state(-7)[1] == 0  # a stranger's negative add counts no death


@pytest.mark.parametrize("deaths", [0, 2])
def test_a_death_raises_both_counts_and_sets_its_wake_up_key(server, deaths):  # noqa: F811
    _, store, _ = server
    assert isinstance(store, PrefixStore)
    for i in range(deaths):
        store.mark_terminated(f"{i}/0.aaaaaaaaaa", "died")
    store.wake_waiters()
    wakes, counted = store.wake_state()
    assert (wakes, counted) == (deaths + 1, deaths)
    assert store.check([P.wake_key(wakes)])


def test_a_joiner_waits_for_admission_in_the_store_not_by_polling(server):  # noqa: F811
    """A relaunched worker waiting to be admitted blocks on the call's wake-ups; the
    outcome's decision (the job completing) wakes it, and it leaves without joining."""
    from inprocess import Wrapper, records
    from inprocess.progress_watchdog import ProgressBoard
    from inprocess.state import State
    from inprocess.store import new_identity
    from inprocess.wrap import CallWrapper

    port, store, stranger = server
    joiner = CallWrapper(Wrapper(abort=None, barrier_timeout=datetime.timedelta(seconds=300)))
    joiner.state = State(rank=3, world_size=4)
    joiner.identity = new_identity(3)
    joiner._records = records.Recorder(None, joiner.identity, "", 0)
    joiner._board = ProgressBoard()
    joiner.store = client(port)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(joiner._join()))
    try:
        thread.start()
        time.sleep(1.0)
        ops = joiner.store.ops
        time.sleep(2.0)
        # at most a chunk's end (2 s, then 4 s) and one look; polling made about 200
        assert joiner.store.ops - ops <= 2 * 3, joiner.store.ops - ops
        # a stranger's wake-up keys, far ahead: each costs a pause (20 ms), not a spin
        seq, _ = store.wake_state()
        for k in range(seq + 1, seq + 400):
            stranger.set(f"{NS}/{P.wake_key(k)}", "1")
        ops = joiner.store.ops
        time.sleep(1.0)
        assert joiner.store.ops - ops <= 3 * (50 + 5), joiner.store.ops - ops
        store.decide_outcome(0, P.COMPLETED)
        thread.join(3)  # woken, not at the end of its 4 s chunk
        assert not thread.is_alive()
        assert result == [None]
    finally:
        joiner._board.close()
        joiner.store = None  # the suite checks that no store object outlives a test


def test_after_a_chunk_runs_out_the_count_of_deaths_is_not_read_twice(server):  # noqa: F811
    """A wait that ran out its chunk reads the counter (before the caller's next look):
    that read's count of deaths serves, with no second read; after a wake-up it is
    read again."""
    from inprocess.store import WakeWait

    port, store, _ = server
    waiter_store = client(port)
    waiter = WakeWait(waiter_store, datetime.timedelta(seconds=30), 0.01)
    waiter.chunk = 0.2  # a short first chunk: nothing wakes it
    waiter.wait()
    ops = waiter_store.ops
    assert waiter.read_deaths() == 0 and waiter_store.ops == ops
    store.mark_terminated("2/0.cccccccccc", "died")  # a death wakes it
    waiter.wait()
    # one read: the wait's request stands from the first chunk (inprocess.quiet_wait)
    assert waiter.read_deaths() == 1 and waiter_store.ops == ops + 1
