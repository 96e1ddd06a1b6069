"""Rank assignment: ShiftRanks, FillGaps, FilterGroupedByKey and their composition."""

from __future__ import annotations

import datetime
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from launcher import free_port

from inprocess import protocol as P
from inprocess.compose import Compose
from inprocess.exception import InternalError, RestartError
from inprocess.rank_assignment import (
    FillGaps,
    FilterCountGroupedByKey,
    FilterGroupedByKey,
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
    ShiftRanks,
)
from inprocess.rank_filter import MaxActiveWorldSize, WorldSizeDivisibleBy
from inprocess.state import Mode, State
from inprocess.store import BarrierTimeout, StoreMixin, TCPStore

pytestmark = pytest.mark.timeout(60)

SHORT = datetime.timedelta(seconds=20)


class HashStore(dist.HashStore, StoreMixin):
    """An in-memory store shared by the threads of one process."""


# ---------------------------------------------------------------------- helpers


def run_rank(
    assignment: RankAssignment, rank: int, world_size: int, terminated: set[int], store=None
) -> tuple[int, int] | BaseException:
    """One rank's call: its (new rank, new world size), or the exception it raised."""
    state = State(rank=rank, world_size=world_size, store=store)
    try:
        state, left = assignment(state, set(terminated))
    except RestartError as ex:
        return ex
    assert left == set()
    assert state.active_world_size == state.world_size
    return state.rank, state.world_size


def simulate(
    assignment: RankAssignment, world_size: int, terminated: set[int]
) -> dict[int, tuple[int, int] | BaseException]:
    """Every rank of the job calls ``assignment`` on its own state, one after the other."""
    return {r: run_rank(assignment, r, world_size, terminated) for r in range(world_size)}


def simulate_threads(
    make: Callable[[int], RankAssignment],
    world_size: int,
    terminated: set[int],
    timeout: float = 30.0,
) -> dict[int, tuple[int, int] | BaseException]:
    """Every rank in its own thread, sharing one store, as in a real job."""
    store = HashStore()
    results: dict[int, tuple[int, int] | BaseException] = {}

    def target(rank: int) -> None:
        try:
            results[rank] = run_rank(make(rank), rank, world_size, terminated, store)
        except BaseException as ex:
            results[rank] = ex

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    return results


def check_consistent(
    results: dict[int, tuple[int, int] | BaseException], dropped: set[int]
) -> dict[int, int]:
    """Invariants every final assignment satisfies; returns old rank -> new rank."""
    world_size = len(results)
    survivors = sorted(set(range(world_size)) - dropped)
    for rank in dropped:
        assert isinstance(results[rank], RankDiscarded), (rank, results[rank])
    outcomes = {r: results[r] for r in survivors}
    for rank, outcome in outcomes.items():
        assert isinstance(outcome, tuple), (rank, outcome)
    sizes = {size for _, size in outcomes.values()}
    assert sizes == {len(survivors)}
    new_ranks = sorted(new for new, _ in outcomes.values())
    assert new_ranks == list(range(len(survivors)))
    return {r: outcomes[r][0] for r in survivors}


# ---------------------------------------------------------------------- seed diagrams


def test_shift_ranks_diagram():
    results = simulate(ShiftRanks(), 8, {1, 4, 5})
    mapping = check_consistent(results, {1, 4, 5})
    assert mapping == {0: 0, 2: 1, 3: 2, 6: 3, 7: 4}


def test_fill_gaps_diagram():
    results = simulate(FillGaps(), 8, {1, 4, 5})
    mapping = check_consistent(results, {1, 4, 5})
    assert mapping == {0: 0, 2: 2, 3: 3, 6: 1, 7: 4}


def test_no_terminated_ranks_keeps_everything():
    for assignment in (ShiftRanks(), FillGaps()):
        mapping = check_consistent(simulate(assignment, 5, set()), set())
        assert mapping == {r: r for r in range(5)}


def test_fill_gaps_terminated_only_at_the_top():
    mapping = check_consistent(simulate(FillGaps(), 6, {4, 5}), {4, 5})
    assert mapping == {0: 0, 1: 1, 2: 2, 3: 3}


def test_mutates_and_returns_the_given_state():
    state = State(rank=3, world_size=4, iteration=2)
    returned, left = ShiftRanks()(state, {0})
    assert returned is state
    assert (state.rank, state.world_size, state.active_world_size) == (2, 3, 3)
    assert state.initial_rank == 3 and state.iteration == 2
    assert left == set()


def test_input_set_is_not_modified():
    terminated = {1}
    ShiftRanks()(State(rank=0, world_size=3), terminated)
    assert terminated == {1}


def test_discarded_rank_raises():
    with pytest.raises(RankDiscarded, match="rank 4"):
        ShiftRanks()(State(rank=4, world_size=8), {1, 4})
    with pytest.raises(RankDiscarded):
        FillGaps()(State(rank=0, world_size=1), {0})
    assert issubclass(RankDiscarded, RestartError)


@pytest.mark.parametrize("bad", [{-1}, {8}, {3, 100}])
def test_out_of_range_terminated_ranks_are_rejected(bad):
    with pytest.raises(ValueError, match="terminated_ranks"):
        ShiftRanks()(State(rank=0, world_size=8), bad)


def test_non_int_terminated_ranks_are_rejected():
    with pytest.raises(TypeError, match="terminated_ranks"):
        ShiftRanks()(State(rank=0, world_size=8), "12")
    with pytest.raises(TypeError, match="terminated_ranks"):
        ShiftRanks()(State(rank=0, world_size=8), 3)


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        RankAssignment()


# ---------------------------------------------------------------------- properties


# A strict subset of range(world_size): at least one rank survives.
@st.composite
def jobs(draw, max_world_size: int, max_terminated: int | None = None):
    world_size = draw(st.integers(1, max_world_size))
    limit = world_size - 1 if max_terminated is None else min(world_size - 1, max_terminated)
    count = draw(st.integers(0, limit))
    seed = draw(st.integers(0, 2**32 - 1))
    terminated = set(random.Random(seed).sample(range(world_size), count))
    return world_size, terminated


def check_assignment_properties(world_size: int, terminated: set[int]) -> None:
    shifted = check_consistent(simulate(ShiftRanks(), world_size, terminated), terminated)
    order = [shifted[r] for r in sorted(shifted)]
    assert order == sorted(order), "ShiftRanks must keep the survivors' relative order"

    filled = check_consistent(simulate(FillGaps(), world_size, terminated), terminated)
    new_size = world_size - len(terminated)
    for old, new in filled.items():
        if old < new_size:
            assert new == old, "FillGaps must not move a survivor below the new world size"
        else:
            assert new in terminated, "FillGaps must move high ranks into gaps only"
    moved = sorted(old for old in filled if old >= new_size)
    assert [filled[old] for old in moved] == sorted(filled[old] for old in moved)


@settings(max_examples=150, deadline=None)
@given(jobs(max_world_size=300))
def test_assignments_small_worlds_any_terminated_set(job):
    check_assignment_properties(*job)


@settings(max_examples=6, deadline=None)
@given(jobs(max_world_size=16384, max_terminated=24))
@example((16384, {0, 1, 8191, 16383}))
def test_assignments_large_worlds(job):
    check_assignment_properties(*job)


def test_assignments_largest_world_many_terminated():
    # The scale of the seed's latency table: 16384 ranks, 1024 of them lost.
    terminated = set(random.Random(7).sample(range(16384), 1024))
    check_assignment_properties(16384, terminated)


@settings(max_examples=120, deadline=None)
@given(
    jobs(max_world_size=200),
    st.integers(1, 16),
    st.integers(1, 256),
    st.sampled_from(["shift", "fill"]),
)
def test_assignment_then_rank_filter(job, divisor, max_active, kind):
    world_size, terminated = job
    assignment = ShiftRanks() if kind == "shift" else FillGaps()
    rank_filter = Compose(WorldSizeDivisibleBy(divisor), MaxActiveWorldSize(max_active))
    new_world_size = world_size - len(terminated)
    expected_active = min(max_active, new_world_size) // divisor * divisor
    modes: dict[int, Mode] = {}
    for rank in sorted(set(range(world_size)) - terminated):
        state = State(rank=rank, world_size=world_size)
        state, _ = assignment(state, set(terminated))
        state.active_world_size = state.world_size  # what the Wrapper does before the filter
        state = rank_filter(state)
        state.apply_active_world_size()
        assert state.active_world_size == expected_active
        modes[state.rank] = state.mode
    assert sorted(modes) == list(range(new_world_size))
    active = [r for r in sorted(modes) if modes[r] == Mode.ACTIVE]
    inactive = [r for r in sorted(modes) if modes[r] == Mode.INACTIVE]
    assert active == list(range(expected_active))
    assert inactive == list(range(expected_active, new_world_size))


# ---------------------------------------------------------------------- FilterGroupedByKey


def test_filter_arguments_are_validated():
    ok = lambda count: True  # noqa: E731
    with pytest.raises(TypeError, match="key_or_fn"):
        FilterGroupedByKey(None, ok)
    with pytest.raises(ValueError, match="key_or_fn"):
        FilterGroupedByKey("a\nb", ok)
    with pytest.raises(TypeError, match="condition"):
        FilterGroupedByKey("host", True)
    with pytest.raises(TypeError, match="timeout"):
        FilterGroupedByKey("host", ok, timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        FilterGroupedByKey("host", ok, timeout=datetime.timedelta(0))
    with pytest.raises(ValueError, match="name"):
        FilterGroupedByKey("host", ok, name="a/b")


def test_filter_instances_get_distinct_store_prefixes():
    a = FilterGroupedByKey("x", bool)
    b = FilterGroupedByKey("x", bool)
    assert a.name != b.name
    assert FilterGroupedByKey("x", bool, name="mine").name == "mine"


def test_filter_needs_a_store():
    fgk = FilterGroupedByKey("x", bool)
    with pytest.raises(ValueError, match=r"state\.store"):
        fgk(State(rank=0, world_size=2), set())
    with pytest.raises(TypeError, match="StoreMixin"):
        fgk(State(rank=0, world_size=2, store=dist.HashStore()), set())


def test_filter_alone_returns_enlarged_set_and_keeps_ranks():
    fgk = FilterGroupedByKey(lambda rank, ws: rank // 4, lambda count: count == 4)

    store = HashStore()
    out: dict[int, object] = {}

    def target(rank: int) -> None:
        state = State(rank=rank, world_size=8, store=store)
        try:
            out[rank] = fgk(state, {5})
            assert state.rank == rank and state.world_size == 8
        except BaseException as ex:
            out[rank] = ex

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    for rank in range(8):
        _, left = out[rank]
        # a terminated rank takes no part and passes its input through
        assert left == ({5} if rank == 5 else {4, 5, 6, 7}), rank


def test_terminated_rank_does_not_take_part():
    fgk = FilterGroupedByKey("k", lambda c: True)
    store = HashStore()
    _, left = fgk(State(rank=1, world_size=2, store=store), {1})
    assert left == {1}
    assert not store.check(["inprocess/filter_grouped_by_key/" + fgk.name + "/keys"])


def test_seed_example_drops_whole_group():
    chain = Compose(
        ShiftRanks(),
        FilterGroupedByKey(key_or_fn=lambda rank, ws: str(rank // 4), condition=lambda c: c == 4),
    )
    assert isinstance(chain, RankAssignment)
    results = simulate_threads(lambda rank: chain, 12, {6})
    mapping = check_consistent(results, {4, 5, 6, 7})
    assert mapping == {0: 0, 1: 1, 2: 2, 3: 3, 8: 4, 9: 5, 10: 6, 11: 7}


def test_seed_example_with_int_keys_and_fill_gaps():
    chain = Compose(
        FillGaps(),
        FilterGroupedByKey(key_or_fn=lambda rank, _: rank // 2, condition=lambda c: c == 2),
    )
    results = simulate_threads(lambda rank: chain, 8, {2})
    mapping = check_consistent(results, {2, 3})
    assert mapping == {0: 0, 1: 1, 4: 4, 5: 5, 6: 2, 7: 3}


def test_plain_value_keys_are_compared_as_str():
    # A key given as a value rather than a callable may be any value, e.g. an int
    # computed by the script (``key_or_fn=state.rank // 2``), in either generation.
    assert FilterGroupedByKey(3, bool).key_or_fn == "3"
    results = simulate_threads(
        lambda rank: Compose(
            ShiftRanks(),
            FilterGroupedByKey(key_or_fn=rank // 2, condition=lambda c: c == 2, name="plain"),
        ),
        8,
        {2},
    )
    mapping = check_consistent(results, {2, 3})
    assert mapping == {0: 0, 1: 1, 4: 2, 5: 3, 6: 4, 7: 5}

    store = HashStore()
    out: dict[int, object] = {}

    def target(rank: int) -> None:
        filt = FilterCountGroupedByKey(rank // 2, lambda c: c == 2, name="plain-count")
        try:
            ctx = filt(RankAssignmentCtx(State(rank=rank, world_size=8), store, {1, 4}))
            out[rank] = ctx.terminated_ranks
        except BaseException as ex:
            out[rank] = ex

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    for rank in (0, 2, 3, 5, 6, 7):
        assert out[rank] == {0, 1, 4, 5}, (rank, out[rank])


def test_rank_local_string_keys():
    # Each rank knows only its own host; ranks 0-2 on "a", 3-5 on "b", 6-7 on "c".
    hosts = ["node-a"] * 3 + ["node-b"] * 3 + ["node=c\twith 'odd' \"chars\" \r\u2028 ünï"] * 2

    def make(rank: int) -> RankAssignment:
        return Compose(
            ShiftRanks(),
            FilterGroupedByKey(hosts[rank], condition=lambda c: c >= 2, name="host"),
        )

    # node-a loses two ranks -> its last healthy rank is dropped as well
    results = simulate_threads(make, 8, {0, 1})
    mapping = check_consistent(results, {0, 1, 2})
    assert mapping == {3: 0, 4: 1, 5: 2, 6: 3, 7: 4}


def test_rank_local_callable_keys():
    local = threading.local()

    def make(rank: int) -> RankAssignment:
        local.host = f"host{rank % 3}"  # a fact only this "process" knows
        return chain

    chain = Compose(
        ShiftRanks(),
        FilterGroupedByKey(lambda rank, ws: local.host, condition=lambda c: c == 3, name="cb"),
    )
    # host0 = {0, 3, 6}, host1 = {1, 4, 7}, host2 = {2, 5, 8}; terminate 4 -> host1 dropped
    results = simulate_threads(make, 9, {4})
    mapping = check_consistent(results, {1, 4, 7})
    assert mapping == {0: 0, 2: 1, 3: 2, 5: 3, 6: 4, 8: 5}


def test_two_composed_filters_do_not_collide():
    chain = Compose(
        ShiftRanks(),
        FilterGroupedByKey(lambda rank, _: rank % 2, condition=lambda c: c >= 3),
        FilterGroupedByKey(lambda rank, _: rank // 4, condition=lambda c: c == 4),
    )
    # groups of 4: {0-3} loses 1 -> dropped; parity among the rest {4..11}: all >= 3
    results = simulate_threads(lambda rank: chain, 12, {1})
    mapping = check_consistent(results, {0, 1, 2, 3})
    assert mapping == {r: r - 4 for r in range(4, 12)}


def test_filter_times_out_when_a_survivor_never_arrives():
    fgk = FilterGroupedByKey("k", bool, timeout=datetime.timedelta(seconds=0.3))
    store = HashStore()
    with pytest.raises(BarrierTimeout):
        fgk(State(rank=0, world_size=2, store=store), set())


def test_filter_detects_inconsistent_terminated_sets():
    # Rank 0 believes rank 1 is terminated, but rank 1 published a key and
    # arrived: the ranks disagree on the input, which is a bug of the caller.
    fgk = FilterGroupedByKey("k", bool, timeout=datetime.timedelta(seconds=5))
    store = HashStore()
    prefix = f"inprocess/filter_grouped_by_key/{fgk.name}"
    # rank 1's line and arrival, as it writes them (sealed records)
    store.add_entry(f"{prefix}/lines", "1=1=k")
    store.add_entry(P.arrivals_key(f"{prefix}/barrier"), "1")
    store.add(P.count_key(f"{prefix}/barrier"), 1)
    with pytest.raises(InternalError, match="expected the 2 surviving ranks"):
        fgk(State(rank=0, world_size=3, store=store), {1})


@settings(max_examples=25, deadline=None)
@given(
    jobs(max_world_size=64),
    st.integers(1, 8),
    st.sampled_from(["shift", "fill"]),
)
@example((64, {5, 40}), 4, "shift")
@example((63, {0}), 8, "fill")
def test_filter_grouped_by_key_property(job, group_size, kind):
    world_size, terminated = job
    final = ShiftRanks() if kind == "shift" else FillGaps()
    chain = Compose(
        final,
        FilterGroupedByKey(
            lambda rank, _: f"g{rank // group_size}",
            condition=lambda c: c == group_size,
            timeout=SHORT,
        ),
    )
    broken = {r // group_size for r in terminated}
    # a trailing partial group can never satisfy the condition
    if world_size % group_size:
        broken.add(world_size // group_size)
    dropped = {r for r in range(world_size) if r // group_size in broken}
    results = simulate_threads(lambda rank: chain, world_size, terminated)
    if len(dropped) == world_size:
        assert all(isinstance(v, RankDiscarded) for v in results.values()), results
        return
    mapping = check_consistent(results, dropped)
    if kind == "shift":
        survivors = sorted(mapping)
        assert [mapping[r] for r in survivors] == list(range(len(survivors)))


# ---------------------------------------------------------------------- TCPStore, processes


def process_rank(port: int, rank: int, world_size: int, host: str) -> None:
    """One rank with its own store client; publishes its outcome in the store."""
    # the child processes' ranks import torch first: a minute or more on a loaded machine
    store = TCPStore(
        host_name="127.0.0.1", port=port, is_master=False, timeout=datetime.timedelta(seconds=240)
    )
    # Everyone is here before the filter's barrier (60 s) starts to count:
    # the threads' ranks would otherwise wait for the children's torch import.
    store.add("started", 1)
    deadline = time.monotonic() + 240
    while store.add("started", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    chain = Compose(ShiftRanks(), FilterGroupedByKey(host, condition=lambda c: c == 2, name="proc"))
    state = State(rank=rank, world_size=world_size, store=store)
    try:
        state, _ = chain(state, {1})
        outcome = f"{state.rank}/{state.world_size}"
    except RankDiscarded:
        outcome = "discarded"
    except BaseException as ex:
        outcome = f"error: {ex!r}"
    store.set(f"result/{rank}", outcome)


CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from test_rank_assignment import process_rank
process_rank(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
# torch's interpreter teardown can take half a minute on a loaded machine
import os
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.timeout(300)
def test_filter_over_tcp_store_across_processes():
    port = free_port()
    # libuv's server would keep a process-wide pipe open after it is gone
    server = TCPStore(
        host_name="127.0.0.1",
        port=port,
        is_master=True,
        timeout=datetime.timedelta(seconds=30),
        use_libuv=False,
    )
    hosts = ["h0", "h0", "h1", "h1"]
    here = os.path.dirname(os.path.abspath(__file__))
    # ranks 2 and 3 run in child processes, ranks 0 and 1 in threads of this one
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, here, str(port), str(r), "4", hosts[r]],
            # quiet torch; a lost DNS packet must not stall a connection for 5 s
            env={
                **os.environ,
                "PYTHONWARNINGS": "ignore",
                "TORCH_CPP_LOG_LEVEL": "ERROR",
                "RES_OPTIONS": "timeout:1 attempts:1",
            },
        )
        for r in (2, 3)
    ]
    threads = [
        threading.Thread(target=process_rank, args=(port, r, 4, hosts[r]), daemon=True)
        for r in (0, 1)
    ]
    try:
        for thread in threads:
            thread.start()
        results = {
            r: server.wait_for_key(f"result/{r}", datetime.timedelta(seconds=240), 0.05)
            for r in range(4)
        }
    finally:
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for thread in threads:
            thread.join(10)
        del server
    assert [proc.returncode for proc in procs] == [0, 0]
    # h0 lost rank 1 -> rank 0 is dropped too; h1's ranks shift down to 0 and 1
    assert results == {0: "discarded", 1: "discarded", 2: "0/2", 3: "1/2"}
