"""Topology-aware rank assignment (Tree): the pure algorithm's properties, worked
examples, argument errors, and the callback across ranks (threads, one store)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inprocess import protocol as P
from inprocess.exception import InternalError
from inprocess.rank_assignment import (
    Layer,
    LayerFlag,
    RankAssignmentCtx,
    RankDiscarded,
    Tree,
)
from inprocess.rank_assignment.tree import (
    Topology,
    TreeAssignment,
    initial_assignment,
    next_assignment,
)
from inprocess.state import Mode, State
from inprocess.store import PrefixStore, StoreMixin

pytestmark = pytest.mark.timeout(120)

R, B = LayerFlag.RESERVE, LayerFlag.BACKFILL


class HashStore(dist.HashStore, StoreMixin):
    """An in-memory store shared by the threads of one process."""


# ---------------------------------------------------------------------- oracles


def leaves_of(t: Topology, node: int) -> range:
    return range(t.node_lo[node], t.node_hi[node])


def limit(t: Topology, node: int) -> int | None:
    return t.max_ranks[t.node_depth[node]]


def check_invariants(t: Topology, a: TreeAssignment, first: bool = True) -> None:
    """Gap-free unique numbering, active first, min_ranks hold; max_ranks too at
    the first assignment (a later reserve fill from another group may pass it)."""
    ranks = [r for r in a.ranks if r is not None]
    assert sorted(ranks) == list(range(a.world_size))
    assert 0 <= a.active_world_size <= a.world_size
    size = a.active_world_size
    inactive = [leaf for leaf, r in enumerate(a.ranks) if r is not None and r >= size]
    order = a.reserve_order if a.reserve_order is not None else inactive
    assert sorted(order) == inactive, "reserve_order holds the inactive leaves, once each"
    for node in range(len(t.node_depth)):
        alive = [a.ranks[x] for x in leaves_of(t, node) if a.ranks[x] is not None]
        assert not alive or len(alive) >= t.min_ranks[t.node_depth[node]], node
        active = sum(1 for r in alive if r < a.active_world_size)
        assert not first or limit(t, node) is None or active <= limit(t, node), node


def model_step(
    t: Topology,
    prev: TreeAssignment,
    terminated: set[int],
    ws_filter: Callable[[int], int] | None,
) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
    """The documented rule, written plainly (whole scans, no counters): every
    leaf's rank after the step and the reserve order, to compare with
    next_assignment."""
    n = t.size
    size = prev.active_world_size
    active = {leaf: r for leaf, r in enumerate(prev.ranks) if r is not None and r < size}
    inactive = [leaf for leaf, r in enumerate(prev.ranks) if r is not None and r >= size]
    order = list(prev.reserve_order) if prev.reserve_order is not None else inactive
    dead = {leaf for leaf, r in enumerate(prev.ranks) if r is None or r in terminated}
    # (1) groups under min_ranks go whole, children first
    for node in sorted(range(len(t.node_depth)), key=lambda x: -t.node_depth[x]):
        alive = [x for x in leaves_of(t, node) if x not in dead]
        if 0 < len(alive) < t.min_ranks[t.node_depth[node]]:
            dead.update(alive)
    holes = sorted(leaf for leaf in active if leaf in dead)  # tree order
    order = [leaf for leaf in order if leaf not in dead]
    gaps: list[tuple[int, int]] = []
    for hole in holes:
        rank = active.pop(hole)
        # (2) the nearest group on the RESERVE path with a reserve rank gives its latest one
        for group in t.ancestors[t.bottom_of_leaf[hole]][: t.reserve_levels]:
            mine = [x for x in order if x in leaves_of(t, group)]
            if mine:
                order.remove(mine[-1])
                active[mine[-1]] = rank
                break
        else:
            gaps.append((hole, rank))
    # (3) backfill: per domain, its highest active ranks (ascending) fill its gaps
    # in tree order; (4) the gaps left are closed by the shift (by sorting below)
    if t.backfill_levels:
        domains: dict[int, list[tuple[int, int]]] = {}
        for hole, rank in gaps:
            domain = t.ancestors[t.bottom_of_leaf[hole]][t.backfill_levels - 1]
            domains.setdefault(domain, []).append((hole, rank))
        for domain, mine in domains.items():
            inside = sorted((r, x) for x, r in active.items() if x in leaves_of(t, domain))
            movers = inside[max(0, len(inside) - len(mine)) :]
            for (_, rank), (_, mover) in zip(mine, movers, strict=False):
                active[mover] = rank
    # (5) filter: the ranks past it become the latest reserve ranks, in tree order
    by_rank = sorted(active, key=active.__getitem__)
    keep = len(by_rank) if ws_filter is None else ws_filter(len(by_rank))
    order += sorted(by_rank[keep:])
    ranks: list[int | None] = [None] * n
    for r, leaf in enumerate(by_rank[:keep]):
        ranks[leaf] = r
    rest = sorted(x for x in range(n) if x not in dead and ranks[x] is None)
    for i, leaf in enumerate(rest):
        ranks[leaf] = keep + i
    return tuple(ranks), tuple(order)


def check_step(
    t: Topology,
    prev: TreeAssignment,
    terminated: set[int],
    new: TreeAssignment,
    filtered: bool,
    oracle: bool = True,
    ws_filter: Callable[[int], int] | None = None,
) -> None:
    check_invariants(t, new, first=False)
    leaf_of = {r: leaf for leaf, r in enumerate(prev.ranks) if r is not None}
    lost = {leaf_of[r] for r in terminated}
    for leaf in range(t.size):
        if prev.ranks[leaf] is None or leaf in lost:
            assert new.ranks[leaf] is None, "a terminated rank came back"
    assert new.active_world_size <= prev.active_world_size
    # Active leaves lost (directly or with their group).
    holes = {
        leaf: prev.ranks[leaf]
        for leaf in range(t.size)
        if prev.ranks[leaf] is not None
        and prev.ranks[leaf] < prev.active_world_size
        and new.ranks[leaf] is None
    }
    filled = dict(new.reserve_fills)
    assert set(filled) <= set(holes)
    for hole, reserve in filled.items():
        assert prev.ranks[reserve] >= prev.active_world_size, "reserve was not inactive"
        reach = t.ancestors[t.bottom_of_leaf[hole]][: t.reserve_levels]
        assert any(reserve in leaves_of(t, n) for n in reach)
        if not filtered:
            assert new.ranks[reserve] < new.active_world_size
    pairs: dict[int, list[tuple[int, int]]] = {}
    for hole, mover in new.backfills:
        assert hole in holes and hole not in filled
        # The mover was active, or took another lost rank's place from the reserve.
        was = prev.ranks[mover] if mover not in filled.values() else holes[
            next(h for h, r in filled.items() if r == mover)
        ]
        assert mover in filled.values() or was < prev.active_world_size
        top = t.depth - t.backfill_levels
        domain = t.ancestors[t.bottom_of_leaf[hole]][-1 - top]
        assert mover in leaves_of(t, domain)
        pairs.setdefault(domain, []).append((hole, was))
    for moves in pairs.values():
        # The lowest mover fills the first hole in tree order, and so on (the newer
        # generation's pairing).
        assert [w for _, w in sorted(moves)] == sorted(w for _, w in moves)
    if not filtered:
        assert new.active_world_size == prev.active_world_size - len(holes) + len(filled)
        # Reserve before backfill and shift: a hole left unfilled had no reserve
        # rank in reach (reserve counts only fall during the step).
        for hole in holes:
            if hole not in filled:
                for n in t.ancestors[t.bottom_of_leaf[hole]][: t.reserve_levels]:
                    assert all(
                        new.ranks[x] is None or new.ranks[x] < new.active_world_size
                        for x in leaves_of(t, n)
                    ), hole
    if oracle:
        assert (new.ranks, new.reserve_order) == model_step(t, prev, terminated, ws_filter)
    if t.reserve_levels == 0 and t.backfill_levels == 0 and not filtered:
        # Plain shift: the surviving active ranks keep their order.
        kept = sorted(
            (prev.ranks[x], new.ranks[x])
            for x in range(t.size)
            if new.ranks[x] is not None and new.ranks[x] < new.active_world_size
        )
        assert [n for _, n in kept] == list(range(len(kept)))


# ---------------------------------------------------------------------- strategies

FLAGS = st.sampled_from([None, R, B, R | B])


@st.composite
def trees(draw: st.DrawFn, max_ranks: int = 96) -> tuple[list[Layer], list[tuple[str, ...]]]:
    """Layers (1 to 3) and every rank's keys: groups of random sizes, launch order shuffled."""
    n = draw(st.integers(1, max_ranks))
    depth = draw(st.integers(1, 3))
    sizes = sorted((draw(st.integers(1, 12)) for _ in range(depth - 1)), reverse=True)
    order = draw(st.permutations(range(n)))
    layers = [
        Layer(
            min_ranks=draw(st.integers(1, 3)),
            max_ranks=draw(st.one_of(st.none(), st.integers(1, n))),
            key_or_fn="job",
            flag=draw(FLAGS),
        )
    ]
    for size in sizes:
        layers.append(
            Layer(
                min_ranks=draw(st.integers(1, max(1, size // 2 + 1))),
                max_ranks=draw(st.one_of(st.none(), st.integers(1, size))),
                flag=draw(FLAGS),
            )
        )
    paths = [("job", *(str(order[r] // s) for s in sizes)) for r in range(n)]
    return layers, paths


def divisible_by(d: int, calls: list[int]) -> Callable[[int], int]:
    def world_size_filter(n: int) -> int:
        calls.append(n)
        return n // d * d

    return world_size_filter


# ---------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), st.data())
def test_properties_small_trees(tree, data) -> None:
    layers, paths = tree
    t = Topology(layers, paths)
    use_filter = data.draw(st.booleans())
    calls: list[int] = []
    divisor = data.draw(st.integers(1, 4))
    ws_filter = divisible_by(divisor, calls) if use_filter else None
    a = initial_assignment(t, ws_filter)
    check_invariants(t, a)
    if use_filter:
        assert a.active_world_size == calls[-1] // divisor * divisor
    for _ in range(data.draw(st.integers(1, 4))):
        if a.world_size == 0:
            break
        terminated = data.draw(st.sets(st.integers(0, a.world_size - 1), max_size=a.world_size))
        new = next_assignment(t, a, terminated, ws_filter)
        # Same inputs, given differently (another rank's view): the same decision.
        again = next_assignment(t, a, sorted(terminated, reverse=True), ws_filter)
        assert again == new
        check_step(t, a, terminated, new, filtered=use_filter, ws_filter=ws_filter)
        if use_filter:
            assert new.active_world_size == calls[-1] // divisor * divisor
        a = new


def big_tree(rank_flag, host_flag, rack_max: int | None) -> tuple[list[Layer], list[tuple]]:
    """16384 ranks: 16 racks of 128 hosts of 8 ranks."""
    layers = [
        Layer(min_ranks=1, key_or_fn="job", flag=R),
        Layer(min_ranks=64, max_ranks=rack_max, flag=rank_flag),
        Layer(min_ranks=8, max_ranks=8, flag=host_flag),
    ]
    paths = [("job", str(r // 1024), str(r // 8)) for r in range(16384)]
    return layers, paths


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([(R, R, 960), (R | B, None, 960), (B, B, None), (None, None, None)]),
    st.data(),
)
def test_properties_16384_ranks(config, data) -> None:
    t = Topology(*big_tree(*config))
    a = initial_assignment(t)
    check_invariants(t, a)
    count = data.draw(st.integers(1, 1024))
    seeds = data.draw(st.randoms(use_true_random=False))
    terminated = set(seeds.sample(range(a.world_size), count))
    new = next_assignment(t, a, terminated)
    assert next_assignment(t, a, list(terminated)) == new
    # The plain model is quadratic: compared on the small trees.
    check_step(t, a, terminated, new, filtered=False, oracle=False)


# ---------------------------------------------------------------------- worked examples


def assign(layers: list[Layer], paths: list[tuple], *steps: set[int], ws_filter=None):
    t = Topology(layers, paths)
    a = initial_assignment(t, ws_filter)
    results = [a]
    for terminated in steps:
        a = next_assignment(t, a, terminated, ws_filter)
        results.append(a)
    return results


def hosts(n: int, size: int) -> list[tuple[str, str]]:
    return [("job", f"h{r // size}") for r in range(n)]


def test_reserve_rank_of_the_same_host_takes_the_lost_place() -> None:
    # Two hosts of 4, 3 active each: [0 1 2 r] [3 4 5 r]; rank 1 is lost.
    layers = [Layer(key_or_fn="job"), Layer(max_ranks=3, flag=R)]
    first, second = assign(layers, hosts(8, 4), {1})
    assert first.ranks == (0, 1, 2, 6, 3, 4, 5, 7)
    assert (first.world_size, first.active_world_size) == (8, 6)
    assert second.ranks == (0, None, 2, 1, 3, 4, 5, 6)
    assert (second.world_size, second.active_world_size) == (7, 6)
    assert second.reserve_fills == ((1, 3),)


def test_without_reserve_the_gap_is_shifted() -> None:
    layers = [Layer(key_or_fn="job"), Layer(max_ranks=3)]
    _, second = assign(layers, hosts(8, 4), {1})
    assert second.ranks == (0, None, 1, 5, 2, 3, 4, 6)
    assert (second.world_size, second.active_world_size) == (7, 5)


def test_backfill_moves_the_hosts_highest_rank_into_the_gap() -> None:
    layers = [Layer(key_or_fn="job"), Layer(flag=B)]
    _, second = assign(layers, hosts(8, 4), {1})
    # Host 0's rank 3 fills gap 1; the gap it leaves (3) is shifted over.
    assert second.ranks == (0, None, 2, 1, 3, 4, 5, 6)
    assert second.backfills == ((1, 3),)


def test_losses_climb_the_tree() -> None:
    # Racks of 2 hosts of 2 ranks; a host needs 2 healthy ranks, a rack 4.
    layers = [Layer(key_or_fn="job"), Layer(min_ranks=4), Layer(min_ranks=2)]
    paths = [("job", f"rack{r // 4}", f"h{r // 2}") for r in range(8)]
    _, second = assign(layers, paths, {0})
    # Rank 0 takes host 0 with it, host 0 takes rack 0 with it.
    assert second.ranks == (None, None, None, None, 0, 1, 2, 3)
    assert (second.world_size, second.active_world_size) == (4, 4)


def test_reserve_search_takes_another_hosts_reserve_past_its_max_ranks() -> None:
    # Hosts of 3 with 2 active: [0 1 r] [2 3 r]. Host 0 loses rank 0 and its
    # reserve; through the reserve root, host 1's reserve takes rank 0's place
    # (host 1 then has 3 active: max_ranks caps the first assignment only).
    layers = [Layer(key_or_fn="job", flag=R), Layer(max_ranks=2, flag=R)]
    first, second = assign(layers, hosts(6, 3), {0, 4})
    assert first.ranks == (0, 1, 4, 2, 3, 5)
    assert second.ranks == (None, 1, None, 2, 3, 0)
    assert second.reserve_fills == ((0, 5),)
    assert (second.world_size, second.active_world_size) == (4, 4)
    # Without RESERVE on the root the search stays on host 0: the gap is shifted.
    layers = [Layer(key_or_fn="job"), Layer(max_ranks=2, flag=R)]
    _, second = assign(layers, hosts(6, 3), {0, 4})
    assert second.ranks == (None, 0, None, 1, 2, 3)
    assert (second.world_size, second.active_world_size) == (4, 3)


def test_reserve_from_another_host_through_a_reserve_root() -> None:
    # Root allows 6 active of 8: [0 1 2 3] [4 5 r r]; rank 2 is lost. The most
    # recently deactivated reserve rank (the last in tree order) takes its place.
    layers = [Layer(max_ranks=6, key_or_fn="job", flag=R), Layer(flag=R)]
    first, second, third = assign(layers, hosts(8, 4), {2}, {4})
    assert first.ranks == (0, 1, 2, 3, 4, 5, 6, 7)
    assert first.reserve_order == (6, 7)
    assert second.ranks == (0, 1, None, 3, 4, 5, 6, 2)
    assert second.reserve_fills == ((2, 7),)
    # Host 1 loses active rank 4 (leaf 4): its own reserve, leaf 6, takes it.
    assert third.ranks == (0, 1, None, 3, None, 5, 4, 2)
    assert third.reserve_fills == ((4, 6),)
    assert third.reserve_order == ()


def test_a_whole_lost_group_is_replaced_from_the_other_groups_reserves() -> None:
    # 12 ranks, hosts of 4 with 3 active (min 2), RESERVE | BACKFILL on both
    # layers: [0 1 2 r] [3 4 5 r] [6 7 8 r]. Ranks 0-2 are lost, so host 0
    # (with its reserve) goes whole: the latest reserve (leaf 11) takes active
    # rank 0, leaf 7 rank 1, and rank 2 (no reserve left) is backfilled by the
    # highest active rank (leaf 10, rank 8): the world keeps 8 active ranks.
    layers = [
        Layer(key_or_fn="job", flag=R | B),
        Layer(min_ranks=2, max_ranks=3, flag=R | B),
    ]
    first, second = assign(layers, hosts(12, 4), {0, 1, 2})
    assert first.active_world_size == 9
    active = [r if r is not None and r < second.active_world_size else None for r in second.ranks]
    assert active == [None] * 4 + [3, 4, 5, 1, 6, 7, 2, 0]
    assert second.reserve_fills == ((0, 11), (1, 7))
    assert second.backfills == ((2, 10),)
    assert (second.world_size, second.active_world_size) == (8, 8)


def test_world_size_filter_trims_the_active_ranks() -> None:
    calls: list[int] = []
    layers = [Layer(key_or_fn="job")]
    first, second = assign(layers, [("job",)] * 8, {1}, ws_filter=divisible_by(4, calls))
    assert calls == [8, 7]
    assert first.active_world_size == 8
    assert second.ranks == (0, None, 1, 2, 3, 4, 5, 6)
    assert (second.world_size, second.active_world_size) == (7, 4)


def test_group_under_min_ranks_at_start_is_dropped() -> None:
    layers = [Layer(key_or_fn="job"), Layer(min_ranks=3)]
    (first,) = assign(layers, [("job", "a")] * 2 + [("job", "b")] * 3)
    assert first.ranks == (None, None, 0, 1, 2)


def test_topology_order_differs_from_launch_order() -> None:
    # Ranks 0, 2 on host a, ranks 1, 3 on host b: the tree groups them.
    t = Topology([Layer(key_or_fn="job"), Layer()], [("job", "a"), ("job", "b")] * 2)
    a = initial_assignment(t)
    assert t.origin == [0, 2, 1, 3]
    assert a.ranks == (0, 1, 2, 3)  # by leaf: launch ranks 0, 2, 1, 3


# ---------------------------------------------------------------------- errors


BAD_LAYERS = [
    ({"min_ranks": 0}, ValueError, "min_ranks must be >= 1"),
    ({"min_ranks": 1.5}, TypeError, "min_ranks must be an int"),
    ({"max_ranks": 0}, ValueError, "max_ranks must be None or >= 1"),
    ({"max_ranks": True}, TypeError, "max_ranks must be None or an int"),
    ({"key_or_fn": 3}, TypeError, "key_or_fn must be a str"),
    ({"flag": "RESERVE"}, TypeError, "flag must be None or LayerFlag"),
]


def test_bad_arguments() -> None:
    for kwargs, error, text in BAD_LAYERS:
        with pytest.raises(error, match=text):
            Layer(**kwargs)
    with pytest.raises(ValueError, match="at least one Layer"):
        Tree([])
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        Tree([Layer(), "host"])
    with pytest.raises(TypeError, match="list of Layer"):
        Tree(Layer())
    with pytest.raises(TypeError, match="world_size_filter"):
        Tree([Layer()], world_size_filter=8)
    with pytest.raises(ValueError, match="root"):
        Topology([Layer(), Layer()], [("a", "x"), ("b", "x")])
    t = Topology([Layer()], [("",)] * 4)
    with pytest.raises(ValueError, match=r"world_size_filter\(4\) must return an int in \[0, 4\]"):
        initial_assignment(t, lambda n: n + 1)
    with pytest.raises(ValueError, match="terminated_ranks must be in"):
        next_assignment(t, initial_assignment(t), {4})
    with pytest.raises(TypeError, match="RankAssignmentCtx"):
        Tree([Layer()])(State(rank=0, world_size=1))


# ---------------------------------------------------------------------- the callback


def run_ranks(trees: dict[int, Tree], ctxs: dict[int, RankAssignmentCtx]) -> dict[int, object]:
    """Every rank's call in its own thread (the first call meets at a store barrier)."""
    results: dict[int, object] = {}

    def one(rank: int) -> None:
        try:
            results[rank] = trees[rank](ctxs[rank]).state
        except Exception as ex:
            results[rank] = ex.with_traceback(None)  # its frames hold the store

    threads = [threading.Thread(target=one, args=(r,)) for r in ctxs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def make_layers() -> list[Layer]:
    # Hosts of 4 ranks (host = initial rank // 4), 3 active per host.
    return [
        Layer(key_or_fn="job", flag=R),
        Layer(min_ranks=2, max_ranks=3, key_or_fn=lambda s: f"h{s.initial_rank // 4}", flag=R),
    ]


def test_every_rank_reaches_the_same_assignment_and_retries_from_the_same_base() -> None:
    n = 12
    trees = {r: Tree(make_layers()) for r in range(n)}
    raw = HashStore()

    def ctxs(states: dict[int, State], iteration: int, attempt: int, terminated: set[int]):
        store = PrefixStore(f"{P.barrier_name(iteration, attempt)}/assignment", raw)
        return {
            s.rank: RankAssignmentCtx(s.copy(), store, set(terminated))
            for s in states.values()
        }

    launch = {r: State(rank=r, world_size=n) for r in range(n)}
    first = run_ranks(trees, ctxs(launch, 0, 0, set()))
    expected = initial_assignment(
        Topology(make_layers(), [("job", f"h{r // 4}") for r in range(n)])
    )
    for r, state in first.items():
        assert isinstance(state, State), state
        assert state.rank == expected.ranks[r]
        assert (state.world_size, state.active_world_size) == (12, 9)
        assert state.mode == (Mode.ACTIVE if state.rank < 9 else Mode.INACTIVE)
    # The iteration ran with the new numbering; its state has iteration 0.
    by_initial = {s.initial_rank: s for s in first.values()}
    for s in by_initial.values():
        s.iteration = 0
    running = {s.rank: s for s in by_initial.values()}
    lost = by_initial[1].rank  # initial rank 1, active: host 0's reserve replaces it
    second = run_ranks(trees, ctxs(running, 1, 0, {lost}))
    assert isinstance(second[lost], RankDiscarded)
    survivors = [s for r, s in second.items() if r != lost]
    assert sorted(s.rank for s in survivors) == list(range(11))
    assert {(s.world_size, s.active_world_size) for s in survivors} == {(11, 9)}
    reserve = next(s for s in survivors if s.initial_rank == 3)
    assert reserve.rank == 1 and reserve.mode == Mode.ACTIVE
    # A rank died before the barrier: the same iteration again, one more lost;
    # everybody starts again from the same numbering (not from the first try's).
    died = by_initial[5].rank
    third = run_ranks(trees, ctxs(running, 1, 1, {lost, died}))
    again = [s for r, s in third.items() if r not in (lost, died)]
    assert sorted(s.rank for s in again) == list(range(10))
    assert {(s.world_size, s.active_world_size) for s in again} == {(10, 9)}
    assert next(s for s in again if s.initial_rank == 7).mode == Mode.ACTIVE


def test_wrong_numbering_is_an_internal_error() -> None:
    tree = Tree([Layer()])
    state = State(rank=0, world_size=1)
    store = PrefixStore(f"{P.barrier_name(0, 0)}/assignment", HashStore())
    tree(RankAssignmentCtx(state, store, set()))
    later = PrefixStore(f"{P.barrier_name(1, 0)}/assignment", HashStore())
    with pytest.raises(InternalError, match="only rank assignment"):
        tree(RankAssignmentCtx(State(rank=0, world_size=2), later, set()))


# ---------------------------------------------------------------------- any store


class StandInStore:
    """Only the four exchange methods, answering for every rank (as callers' stand-ins do)."""

    def __init__(self, states: dict[int, State], keys: dict[int, list]) -> None:
        self.states, self.keys = states, keys
        self.sent: list[tuple[str, int]] = []

    def send_state(self, state, rank):
        self.sent.append(("state", rank))

    def get_states(self, ranks):
        return [self.states[r] for r in ranks]

    def send_key(self, key, rank):
        self.sent.append(("key", rank))

    def get_keys(self, ranks):
        return [self.keys[r] for r in ranks]


def stand_in(n: int, layers: list[Layer]) -> tuple[Tree, dict[int, State], StandInStore]:
    states = {r: State(rank=r, world_size=n) for r in range(n)}
    keys = {
        r: [f(s) if callable(f) else f for f in (layer.key_or_fn for layer in layers)]
        for r, s in states.items()
    }
    return Tree(layers), states, StandInStore(states, keys)


def active_ranks(tree: Tree, n: int) -> list[int | None]:
    """Each initial rank's active rank (None: reserve or terminated), all agreeing on the size."""
    nodes = [tree.init_rank_map[i] for i in range(n)]
    assert len({node.state.active_world_size for node in nodes}) == 1
    assert len({node.state.world_size for node in nodes}) == 1
    return [node.state.active_rank for node in nodes]


def test_tree_with_a_stand_in_store_builds_over_every_rank_and_shows_each_ones_state() -> None:
    layers = [Layer(flag=B), Layer(key_or_fn=lambda s: s.rank // 4, flag=B)]  # int keys
    tree, states, store = stand_in(8, layers)
    assert tree.init_rank_map == {}
    ctx = tree(RankAssignmentCtx(states[0], store, {1}))
    # Built over all 8 ranks (rank 1 lost at the first call included), then rank
    # 1's place goes to the backfill domain's highest active rank.
    assert store.sent == [("state", 0), ("key", 0)]
    assert active_ranks(tree, 8) == [0, None, 2, 3, 4, 5, 6, 1]
    lost = tree.init_rank_map[1].state
    assert (lost.mode, lost.rank, lost.active_rank) == (Mode.TERMINATED, None, None)
    moved = tree.init_rank_map[7]
    assert (moved.initial_rank, moved.state.rank, moved.state.mode) == (7, 6, Mode.ACTIVE)
    assert (ctx.state.rank, ctx.state.active_rank, ctx.state.world_size) == (0, 0, 7)
    assert ctx.terminated_ranks == set()
    assert sorted(tree.init_rank_map) == list(range(8)) and 8 not in tree.init_rank_map


def test_tree_with_a_stand_in_store_pairs_backfills_in_order() -> None:
    layers = [Layer(flag=B), Layer(key_or_fn=lambda s: s.rank // 2, flag=B)]
    tree, states, store = stand_in(8, layers)
    tree(RankAssignmentCtx(states[0], store, {2, 3}))
    # The two highest active ranks fill the two gaps, the lower one the lower gap.
    assert active_ranks(tree, 8) == [0, 1, None, None, 4, 5, 2, 3]


def test_tree_with_a_stand_in_store_numbers_the_survivors_in_tree_order() -> None:
    # Hosts of 4, 3 active each; terminated_ranks of a later call are numbered as
    # the states the previous call gave out: survivors in tree order.
    layers = [Layer(flag=R), Layer(max_ranks=3, key_or_fn=lambda s: s.rank // 4, flag=R)]
    tree, states, store = stand_in(8, layers)
    ctx = tree(RankAssignmentCtx(states[0], store, {1}))
    assert active_ranks(tree, 8) == [0, None, 2, 1, 3, 4, 5, None]
    assert [tree.init_rank_map[i].state.rank for i in range(8)] == [0, None, 1, 2, 3, 4, 5, 6]
    ctx.terminated_ranks = {3}  # initial rank 4
    ctx = tree(ctx)
    assert active_ranks(tree, 8) == [0, None, 2, 1, None, 4, 5, 3]
    ctx.terminated_ranks = {1}  # initial rank 2: no reserve left, the gap is shifted
    ctx = tree(ctx)
    assert active_ranks(tree, 8) == [0, None, None, 1, None, 3, 4, 2]
    assert (ctx.state.world_size, ctx.state.active_world_size) == (5, 5)


def test_tree_with_a_stand_in_store_still_assigns_everyone_when_the_caller_is_lost() -> None:
    layers = [Layer(), Layer(min_ranks=3, key_or_fn=lambda s: s.rank // 4)]
    tree, states, store = stand_in(8, layers)
    with pytest.raises(RankDiscarded):
        tree(RankAssignmentCtx(states[0], store, {0, 2}))
    assert active_ranks(tree, 8) == [None] * 4 + [0, 1, 2, 3]  # host 0 went whole
    tree, states, store = stand_in(8, [Layer(min_ranks=7), Layer(key_or_fn=lambda s: s.rank // 4)])
    with pytest.raises(RankDiscarded):
        tree(RankAssignmentCtx(states[0], store, {0, 5}))
    assert active_ranks(tree, 8) == [None] * 8
    assert tree.init_rank_map[3].state.active_world_size == 0


def test_tree_with_a_stand_in_store_errors_and_warnings() -> None:
    tree, states, store = stand_in(8, [Layer(key_or_fn=lambda s: s.rank % 2)])
    with pytest.raises(RuntimeError, match="root"):
        tree(RankAssignmentCtx(states[0], store, set()))
    tree, states, store = stand_in(8, [Layer(), Layer(key_or_fn=lambda s: s.rank % 2)])
    with pytest.warns(UserWarning, match="launch order"):
        tree(RankAssignmentCtx(states[0], store, set()))
    assert [tree.init_rank_map[i].leaf for i in range(4)] == [0, 4, 1, 5]

    class HalfStore:
        def send_state(self, state, rank):
            pass

    with pytest.raises(TypeError, match="get_states, send_key, get_keys"):
        Tree([Layer()])(RankAssignmentCtx(State(rank=0, world_size=1), HalfStore(), set()))


def test_our_store_has_the_exchange_methods_and_tree_runs_over_them_on_every_rank() -> None:
    n = 8
    raw = HashStore()

    class FourMethods:
        """Our store behind only the four methods (the generic path, on every rank)."""

        def __init__(self, store):
            self.store = store

        def send_state(self, state, rank):
            self.store.send_state(state, rank)

        def get_states(self, ranks):
            return self.store.get_states(ranks)

        def send_key(self, key, rank):
            self.store.send_key(key, rank)

        def get_keys(self, ranks):
            return self.store.get_keys(ranks)

    store = PrefixStore("exchange", raw)
    store.set_timeout(datetime.timedelta(seconds=60))

    def layers() -> list[Layer]:
        host = Layer(max_ranks=3, key_or_fn=lambda s: f"h{s.rank // 4}", flag=R)
        return [Layer(key_or_fn="job", flag=R), host]

    trees = {r: Tree(layers()) for r in range(n)}
    ctxs = {
        r: RankAssignmentCtx(State(rank=r, world_size=n, iteration=2), FourMethods(store), set())
        for r in range(n)
    }
    results = run_ranks(trees, ctxs)
    for r, state in results.items():
        assert isinstance(state, State), state
        node = trees[0].init_rank_map[r]
        assert (state.rank, state.active_rank, state.mode) == (
            node.state.rank, node.state.active_rank, node.state.mode
        )
        assert node.state.iteration == 2
    assert [results[r].active_rank for r in range(n)] == [0, 1, 2, None, 3, 4, 5, None]
    # What the store gives back is what was sent, in the order asked for.
    got = store.get_states([5, 1])
    assert [(s.rank, s.world_size, s.iteration, s.mode) for s in got] == [
        (5, n, 2, Mode.ACTIVE),
        (1, n, 2, Mode.ACTIVE),
    ]
    assert store.get_keys([3]) == [["job", "h0"]]
    assert store.get_states([]) == []


def test_init_rank_map_with_the_wrappers_store() -> None:
    n = 6
    trees = {r: Tree(make_layers()) for r in range(n)}
    store = PrefixStore(f"{P.barrier_name(0, 0)}/assignment", HashStore())
    ctxs = {r: RankAssignmentCtx(State(rank=r, world_size=n), store, set()) for r in range(n)}
    results = run_ranks(trees, ctxs)
    for r, state in results.items():
        node = trees[r].init_rank_map[r]
        assert (node.state.rank, node.state.active_rank, node.state.mode) == (
            state.rank, state.active_rank, state.mode
        )
        assert state.active_rank == (state.rank if state.mode == Mode.ACTIVE else None)


def test_a_lost_group_is_replaced_from_other_groups_reserves_with_either_store() -> None:
    """12 ranks, hosts of 4 with 3 active, RESERVE | BACKFILL on both layers; ranks
    0-2 are lost and host 0 goes whole. Both stores give the newer generations'
    world: two other hosts' reserves come in past their max_ranks (latest first),
    and the last gap is backfilled."""
    expected = [None] * 4 + [3, 4, 5, 1, 6, 7, 2, 0]

    def layers(key: Callable[[State], object]) -> list[Layer]:
        return [
            Layer(flag=R | B),
            Layer(min_ranks=2, max_ranks=3, key_or_fn=key, flag=R | B),
        ]

    # A stand-in store (every rank's state and keys at hand).
    tree, states, store = stand_in(12, layers(lambda s: s.rank // 4))
    ctx = tree(RankAssignmentCtx(states[0], store, set()))
    assert active_ranks(tree, 12) == [0, 1, 2, None, 3, 4, 5, None, 6, 7, 8, None]
    ctx.terminated_ranks = {0, 1, 2}
    with pytest.raises(RankDiscarded):
        tree(ctx)
    assert active_ranks(tree, 12) == expected
    assert tree.init_rank_map[0].state.mode == Mode.TERMINATED

    # The Wrapper's store: every rank calls its own tree, in its own thread.
    n = 12
    trees = {r: Tree(layers(lambda s: f"h{s.initial_rank // 4}")) for r in range(n)}
    raw = HashStore()

    def ctxs(states: dict[int, State], iteration: int, terminated: set[int]):
        prefixed = PrefixStore(f"{P.barrier_name(iteration, 0)}/assignment", raw)
        return {
            s.rank: RankAssignmentCtx(s.copy(), prefixed, set(terminated))
            for s in states.values()
        }

    first = run_ranks(trees, ctxs({r: State(rank=r, world_size=n) for r in range(n)}, 0, set()))
    running = {}
    for state in first.values():
        assert isinstance(state, State), state
        state.iteration = 0
        running[state.rank] = state
    lost = {s.rank for s in running.values() if s.initial_rank in (0, 1, 2)}
    second = run_ranks(trees, ctxs(running, 1, lost))
    by_initial: dict[int, object] = {running[r].initial_rank: s for r, s in second.items()}
    for initial in range(4):
        assert isinstance(by_initial[initial], RankDiscarded), by_initial[initial]
    got = [None] * 4 + [by_initial[i].active_rank for i in range(4, n)]  # type: ignore[union-attr]
    assert got == expected
    assert {(by_initial[i].world_size, by_initial[i].active_world_size) for i in range(4, n)} == {
        (8, 8)
    }
