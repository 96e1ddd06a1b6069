"""The policy for a lost machine (``NodeLost``, issue 11): a node relaunch, not failures."""

from __future__ import annotations

import pytest
from test_failover_policy import P, only, running_sim

from inprocess.failover.state import Stage


def test_lost_node_is_relaunched_on_the_spare_without_counting_failures():
    sim = running_sim(managed=True, spare_nodes=1)
    relaunch = only(sim.event(P.NodeLost(1, 1, "Ray node x is dead")), P.RelaunchNode)
    assert (relaunch.node, relaunch.from_slot, relaunch.to_slot) == (1, 1, 2)
    assert relaunch.workers == (2, 3)
    state = sim.state
    assert state.node_slots == {0: 0, 1: 2} and state.removed_slots == [1]
    assert state.node_relaunches == 1
    assert all(n == 0 for n in state.worker_restarts.values())
    assert all(n == 0 for n in state.node_failures.values())
    assert [state.workers[w].slot for w in range(4)] == [0, 0, 2, 2]
    assert any(e["kind"] == "node_lost" and "Ray node x" in e["message"] for e in state.events)
    sim.succeed_all()
    assert sim.state.exit_code == 0


def test_lost_node_without_spare_is_relaunched_in_place():
    sim = running_sim(managed=True, spare_nodes=0)
    relaunch = only(sim.event(P.NodeLost(0, 0, "gone")), P.RelaunchNode)
    assert (relaunch.from_slot, relaunch.to_slot) == (0, 0)


def test_lost_node_with_no_relaunch_left_stops_the_job():
    sim = running_sim(managed=True, spare_nodes=1, node_max_relaunches=0)
    stop = only(sim.event(P.NodeLost(1, 1, "gone")), P.StopJob)
    assert stop.exit_code == P.FAILURE_EXIT_CODE
    assert "node 1 lost" in stop.reason and "node_max_relaunches=0" in stop.reason


def test_stale_or_late_node_loss_is_ignored():
    sim = running_sim(managed=True, spare_nodes=1)
    sim.event(P.NodeLost(1, 1, "gone"))
    # the same machine reported again: node 1 runs on slot 2 now
    only(sim.event(P.NodeLost(1, 1, "gone again")), P.Ignore)
    assert sim.state.node_relaunches == 1
    sim.succeed_all()
    assert sim.state.stage is Stage.STOPPED
    only(sim.decide(P.handle_event, P.NodeLost(0, 0, "after the end")), P.Ignore)


def test_job_level_node_loss_is_a_cold_restart_on_the_spare():
    sim = running_sim(managed=False, spare_nodes=1)
    restart = only(sim.event(P.NodeLost(1, 1, "gone")), P.RestartJob)
    assert "node 1 lost" in restart.reason
    assert sim.state.node_slots == {0: 0, 1: 2}
    assert sim.state.job_restarts == 1
    assert all(n == 0 for n in sim.state.worker_restarts.values())


@pytest.mark.parametrize(
    "args, message",
    [((-1, 0, "x"), "NodeLost.node"), ((0, -1, "x"), "NodeLost.slot"), ((0, 0, ""), "reason")],
)
def test_bad_node_lost_is_a_clear_error(args, message):
    with pytest.raises(P.PolicyError, match=message):
        P.NodeLost(*args)


def test_a_lost_slot_with_a_machine_again_is_a_spare_for_the_next_loss():
    sim = running_sim(managed=True, spare_nodes=1, node_max_relaunches=2)
    sim.event(P.NodeLost(1, 1, "gone"))
    assert sim.state.removed_slots == [1]
    # no free slot now: a second loss would relaunch in place
    assert sim.event(P.SlotBack(1, "machine n2 joined")) == []
    assert sim.state.removed_slots == []
    assert any(e["kind"] == "slot_back" for e in sim.state.events)
    relaunch = only(sim.event(P.NodeLost(1, 2, "gone again")), P.RelaunchNode)
    assert (relaunch.from_slot, relaunch.to_slot) == (2, 1)
    # a slot that was never given up, or that a node runs on: nothing to do
    only(sim.event(P.SlotBack(0, "joined")), P.Ignore)
    with pytest.raises(P.PolicyError, match=r"SlotBack\.how"):
        P.SlotBack(0, "")
