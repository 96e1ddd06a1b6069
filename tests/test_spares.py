"""Spare ranks, rank filters and rank assignment across real processes (issue 4)."""

from __future__ import annotations

import pytest
from launcher import run_job
from test_restart import FAST

pytestmark = pytest.mark.slow


def spec(**kw):
    s = {"wrapper": dict(FAST), "steps": 6}
    s.update(kw)
    return s


def kill(rank, iteration=0, step=2):
    return {
        "iteration": iteration,
        "rank": rank,
        "step": step,
        "kind": "kill",
        "others": "allreduce",
    }


def outcome(result, ranks):
    """{initial rank: returned value} for ranks that must have exited cleanly."""
    values = {}
    for rank in ranks:
        assert result.ranks[rank].returncode == 0, result.describe()
        values[rank] = result.report(rank)["returned"]
    assert not result.leftovers
    return values


def check_active(values, world):
    active = {r: v for r, v in values.items() if v is not None}
    assert sorted(v["rank"] for v in active.values()) == list(range(world))
    for v in active.values():
        assert v["world"] == world and v["sum"] == world * (world + 1) / 2
    return active


@pytest.mark.timeout(180)
def test_spare_replaces_a_lost_active_rank(tmp_path):
    result = run_job("scenario.py", 6, tmp_path, spec(max_active=4, faults=[kill(1)]), timeout=150)
    assert result.ranks[1].returncode != 0
    values = outcome(result, [0, 2, 3, 4, 5])
    active = check_active(values, 4)
    spares = [r for r, v in values.items() if v is None]
    assert spares == [5]  # rank 4 was activated, rank 5 is still a spare
    assert 4 in active
    # the spare never ran the function in iteration 0, the new active one did in iteration 1
    starts = {e["iteration"] for e in result.report(4)["events"] if e["kind"] == "start"}
    assert starts == {1}
    assert not any(e["kind"] == "start" for e in result.report(5)["events"])


@pytest.mark.timeout(180)
def test_two_successive_losses(tmp_path):
    result = run_job(
        "scenario.py",
        6,
        tmp_path,
        spec(max_active=4, faults=[kill(1), kill(3, iteration=1)]),
        timeout=150,
    )
    assert result.ranks[1].returncode != 0 and result.ranks[3].returncode != 0
    values = outcome(result, [0, 2, 4, 5])
    check_active(values, 4)
    assert all(v is not None and v["iteration"] == 2 for v in values.values())


@pytest.mark.timeout(180)
def test_world_size_divisible_by_leaves_a_spare_when_odd(tmp_path):
    result = run_job(
        "scenario.py", 6, tmp_path, spec(divisible_by=2, faults=[kill(2)]), timeout=150
    )
    values = outcome(result, [0, 1, 3, 4, 5])
    check_active(values, 4)
    assert [r for r, v in values.items() if v is None] == [5]


@pytest.mark.timeout(180)
def test_filter_grouped_by_key_drops_the_whole_group(tmp_path):
    result = run_job("scenario.py", 8, tmp_path, spec(group_size=4, faults=[kill(5)]), timeout=150)
    for rank in (4, 6, 7):  # healthy members of the broken group leave the job
        assert result.report(rank)["exception"] == "RankDiscarded", result.describe()
        assert result.ranks[rank].returncode != 0
    values = outcome(result, [0, 1, 2, 3])
    check_active(values, 4)


@pytest.mark.timeout(180)
def test_unhealthy_active_rank_is_replaced_by_a_spare(tmp_path):
    faults = [{"iteration": 0, "rank": 0, "step": 2, "kind": "raise", "others": "allreduce"}]
    result = run_job(
        "scenario.py", 5, tmp_path, spec(max_active=4, unhealthy=[2], faults=faults), timeout=150
    )
    assert result.report(2)["exception"] == "HealthCheckError"
    values = outcome(result, [0, 1, 3, 4])
    check_active(values, 4)
