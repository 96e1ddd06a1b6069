"""Rank filters: MaxActiveWorldSize, WorldSizeDivisibleBy and their composition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inprocess.compose import Compose
from inprocess.rank_filter import MaxActiveWorldSize, RankFilter, WorldSizeDivisibleBy
from inprocess.state import Mode, State

pytestmark = pytest.mark.timeout(30)


def filtered(rank_filter: RankFilter, world_size: int, rank: int = 0) -> State:
    state = State(rank=rank, world_size=world_size)
    state.active_world_size = state.world_size  # what the Wrapper does first
    result = rank_filter(state)
    assert result is state
    state.apply_active_world_size()
    return state


def test_max_active_world_size():
    assert filtered(MaxActiveWorldSize(4), 10).active_world_size == 4
    assert filtered(MaxActiveWorldSize(40), 10).active_world_size == 10
    assert filtered(MaxActiveWorldSize(10), 10).active_world_size == 10


def test_world_size_divisible_by():
    assert filtered(WorldSizeDivisibleBy(4), 10).active_world_size == 8
    assert filtered(WorldSizeDivisibleBy(), 7).active_world_size == 7
    assert filtered(WorldSizeDivisibleBy(8), 5).active_world_size == 0


def test_seed_composition():
    # largest multiple of M = 4 not above N = 14, with 20 ranks: 12 active, 8 spares
    rank_filter = Compose(WorldSizeDivisibleBy(4), MaxActiveWorldSize(14))
    assert isinstance(rank_filter, RankFilter)
    modes = [filtered(rank_filter, 20, rank).mode for rank in range(20)]
    assert modes == [Mode.ACTIVE] * 12 + [Mode.INACTIVE] * 8


def test_filter_respects_an_earlier_lower_active_world_size():
    state = State(rank=0, world_size=16)
    state.active_world_size = 6
    assert MaxActiveWorldSize(10)(state).active_world_size == 6
    assert WorldSizeDivisibleBy(4)(state).active_world_size == 4


def test_filter_never_exceeds_world_size():
    state = State(rank=0, world_size=5)
    state.active_world_size = 9  # stale value from a larger world
    assert MaxActiveWorldSize(100)(state).active_world_size == 5


@pytest.mark.parametrize("cls", [MaxActiveWorldSize, WorldSizeDivisibleBy])
@pytest.mark.parametrize("bad", [0, -3])
def test_bad_values(cls, bad):
    with pytest.raises(ValueError, match=r"must be >= 1"):
        cls(bad)


@pytest.mark.parametrize("cls", [MaxActiveWorldSize, WorldSizeDivisibleBy])
@pytest.mark.parametrize("bad", [2.0, "4", None, True])
def test_bad_types(cls, bad):
    with pytest.raises(TypeError, match=r"must be an int"):
        cls(bad)


def test_argument_names_in_messages():
    with pytest.raises(ValueError, match="max_active_world_size"):
        MaxActiveWorldSize(0)
    with pytest.raises(ValueError, match="divisor"):
        WorldSizeDivisibleBy(0)


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        RankFilter()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16384), st.integers(1, 512), st.integers(1, 20000))
def test_composition_property(world_size, divisor, max_active):
    state = filtered(
        Compose(WorldSizeDivisibleBy(divisor), MaxActiveWorldSize(max_active)), world_size
    )
    active = state.active_world_size
    bound = min(max_active, world_size)
    assert active % divisor == 0
    assert 0 <= active <= bound
    assert active + divisor > bound  # the largest such multiple


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16384), st.integers(1, 512), st.integers(1, 20000))
def test_reverse_composition_property(world_size, divisor, max_active):
    # Compose(MaxActiveWorldSize(N), WorldSizeDivisibleBy(M)): round first, then cap
    state = filtered(
        Compose(MaxActiveWorldSize(max_active), WorldSizeDivisibleBy(divisor)), world_size
    )
    assert state.active_world_size == min(max_active, world_size // divisor * divisor)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 16), st.integers(1, 400))
def test_active_ranks_come_first(world_size, divisor, max_active):
    rank_filter = Compose(WorldSizeDivisibleBy(divisor), MaxActiveWorldSize(max_active))
    states = [filtered(rank_filter, world_size, rank) for rank in range(world_size)]
    assert len({s.active_world_size for s in states}) == 1
    active = states[0].active_world_size
    assert [s.mode for s in states] == [Mode.ACTIVE] * active + [Mode.INACTIVE] * (
        world_size - active
    )
    assert [s.active_rank for s in states[:active]] == list(range(active))
    assert all(s.active_rank is None for s in states[active:])
