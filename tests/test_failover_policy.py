"""Unit tests of the pure failover policy (no processes, no clocks)."""

from __future__ import annotations

import dataclasses
import os
import signal
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inprocess.failover import policy as P
from inprocess.failover.spec import JobSpec
from inprocess.failover.state import (
    MAX_EVENTS,
    JobState,
    Stage,
    WorkerStatus,
    dumps_state,
    failure_key,
    load_state,
    loads_state,
    save_state,
)

S = WorkerStatus


def make_spec(**kw) -> JobSpec:
    base = dict(
        job_id="job",
        entrypoint=["train.py"],
        nnodes=2,
        nproc_per_node=2,
        state_dir="/tmp/inprocess-test-state",
    )
    base.update(kw)
    return JobSpec(**base)


class Crash(Exception):
    """The simulated controller died."""


class Sim:
    """A minimal in-memory controller: feeds events, executes actions at once.

    Every state it adopts is checked against the policy's invariants and
    compared with the previous one (stage transitions, monotonic counters).
    """

    def __init__(self, spec: JobSpec, managed: bool | None = None) -> None:
        self.now = 0.0
        self.pid = 1000
        self.crash_countdown: int | None = None
        self.actions: list[P.Action] = []  # every action, for assertions
        self.state = P.new_job_state(spec, now=self.tick())
        check_invariants(None, self.state)
        if managed is not None:
            self.adopt(P.set_wrapper_managed(self.state, managed, now=self.tick()))

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def adopt(self, new: JobState) -> None:
        check_invariants(self.state, new)
        self.state = new
        if self.crash_countdown is not None:
            self.crash_countdown -= 1
            if self.crash_countdown <= 0:
                self.crash_countdown = None
                raise Crash

    def decide(self, fn, *args, **kw) -> list[P.Action]:
        before = dumps_state(self.state)
        new, actions = fn(self.state, *args, now=self.tick(), **kw)
        assert dumps_state(self.state) == before, f"{fn.__name__} modified its input"
        if len(actions) == 1 and isinstance(actions[0], P.Ignore):
            assert new is self.state
        self.actions.extend(actions)
        self.adopt(new)
        return actions

    # controller side
    def run(self) -> None:
        self.execute(self.decide(P.start_job))

    def event(self, event: P.Event) -> list[P.Action]:
        actions = self.decide(P.handle_event, event)
        self.execute(actions)
        return actions

    def start(self, w: int, warm: bool = False) -> None:
        self.pid += 1
        before = dumps_state(self.state)
        new = P.worker_started(
            self.state, w, pid=self.pid, start_time=self.now, now=self.tick(), warm=warm
        )
        assert dumps_state(self.state) == before
        self.adopt(new)

    def kill(self, workers) -> None:
        """The controller stops live processes: their exits are observed."""
        for w in workers:
            r = self.state.workers[w]
            if r.status in (S.RUNNING, S.STOPPING, S.FAILED) and r.incarnation >= 0:
                self.decide(P.handle_event, P.WorkerExited(w, r.incarnation, None, signal.SIGTERM))

    def execute(self, actions: list[P.Action]) -> None:
        for a in actions:
            if isinstance(a, P.StartJob):
                for w in sorted(self.state.workers):
                    self.start(w)
            elif isinstance(a, P.RestartJob):
                assert self.state.stage is Stage.READY
                self.kill(sorted(self.state.workers))
                for w in sorted(self.state.workers):
                    self.start(w)
            elif isinstance(a, P.RelaunchWorker):
                self.kill([a.worker])
                self.start(a.worker, warm=not a.fresh)  # a standby takes it unless fresh
                assert self.state.workers[a.worker].slot == a.slot
            elif isinstance(a, P.RelaunchNode):
                self.kill(a.workers)
                for w in a.workers:
                    self.start(w)
                    assert self.state.workers[w].slot == a.to_slot
            elif isinstance(a, P.StopJob):
                self.kill(sorted(self.state.workers))
                before = dumps_state(self.state)
                new = P.stopped(self.state, now=self.tick())
                assert dumps_state(self.state) == before
                self.adopt(new)
            else:
                assert isinstance(a, P.Resume | P.Ignore)

    def fail(self, w: int, code: int = 1) -> list[P.Action]:
        return self.event(P.WorkerExited(w, self.state.workers[w].incarnation, code))

    def succeed_all(self) -> None:
        for w in sorted(self.state.workers):
            if self.state.workers[w].status is S.RUNNING:
                self.event(P.WorkerExited(w, self.state.workers[w].incarnation, 0))

    def restart_controller(self) -> list[P.Action]:
        """Reload the state from its file form and recover, as after a crash."""
        self.state = loads_state(dumps_state(self.state))
        actions = self.decide(P.recover)
        self.execute(actions)
        return actions


def check_invariants(old: JobState | None, new: JobState) -> None:
    assert P.check_state(new) == []
    assert loads_state(dumps_state(new)) == new
    stopping = new.stage in (Stage.STOPPING, Stage.STOPPED)
    assert (new.exit_code is not None) == stopping
    assert all(v >= 0 for v in (new.generation, new.job_restarts, new.node_relaunches))
    assert all(v >= 0 for v in (*new.node_failures.values(), *new.worker_restarts.values()))
    if old is None:
        assert new.stage is Stage.INIT
        return
    assert old.stage == new.stage or new.stage in P.STAGE_TRANSITIONS[old.stage]
    assert new.handled_failures >= old.handled_failures
    assert len(new.handled_failures - old.handled_failures) <= 1
    assert new.generation >= old.generation
    assert new.job_restarts >= old.job_restarts
    assert new.node_relaunches >= old.node_relaunches
    for w, n in old.worker_restarts.items():
        assert new.worker_restarts[w] >= n
    if old.exit_code is not None:
        assert new.exit_code is not None


def running_sim(managed: bool | None = None, **kw) -> Sim:
    sim = Sim(make_spec(**kw), managed)
    sim.run()
    assert sim.state.stage is Stage.RUNNING
    return sim


def only(actions: list[P.Action], cls: type) -> P.Action:
    assert len(actions) == 1 and isinstance(actions[0], cls), actions
    return actions[0]


# -- rule 1: stage ------------------------------------------------------------


def test_failure_report_in_running_is_handled():
    sim = running_sim(managed=True)
    actions = sim.decide(P.handle_event, P.WorkerReported(1, 0, "RankShouldRestart"))
    assert only(actions, P.RelaunchWorker) == P.RelaunchWorker(1, 0)
    assert sim.state.workers[1].status is S.FAILED
    assert sim.state.worker_restarts[1] == 1
    assert sim.state.node_failures[0] == 1
    assert sim.state.handled_failures == {"1:0"}


@pytest.mark.parametrize("stage", [Stage.INIT, Stage.READY, Stage.STOPPING, Stage.STOPPED])
def test_events_outside_running_are_ignored(stage):
    sim = Sim(make_spec(), managed=True)
    if stage is not Stage.INIT:
        sim.decide(P.start_job)  # READY, no worker started
        sim.start(0)
    if stage in (Stage.STOPPING, Stage.STOPPED):
        sim.decide(P.request_stop, 1, "interrupted")
    if stage is Stage.STOPPED:
        sim.adopt(P.stopped(sim.state, now=sim.tick()))
    assert sim.state.stage is stage
    for event in (P.WorkerReported(0, 0, "boom"), P.WorkerExited(0, 0, 1)):
        new, actions = P.handle_event(sim.state, event, now=99.0)
        assert new is sim.state
        assert only(actions, P.Ignore).reason.endswith("ignored")
        assert stage.value in actions[0].reason


# -- rule 2/3: dedupe and stale incarnations -----------------------------------


@pytest.mark.parametrize("report_first", [True, False])
def test_exit_and_self_report_of_one_failure_are_handled_once(report_first):
    sim = running_sim(managed=False)
    report = P.WorkerReported(3, 0, "exception in train()")
    exited = P.WorkerExited(3, 0, 1)
    first, second = (report, exited) if report_first else (exited, report)
    restart = only(sim.decide(P.handle_event, first), P.RestartJob)
    # the duplicate arrives while the job restart is being set up: stage guard
    new, actions = P.handle_event(sim.state, second, now=50.0)
    assert new is sim.state and isinstance(actions[0], P.Ignore)
    sim.execute([restart])
    # and again once the job runs: stale incarnation now
    new, actions = P.handle_event(sim.state, second, now=51.0)
    assert new is sim.state and "stale" in only(actions, P.Ignore).reason
    assert sim.state.worker_restarts[3] == 1
    assert sim.state.job_restarts == 1


@pytest.mark.parametrize("report_first", [True, False])
def test_duplicate_reports_in_running_are_handled_once_by_failure_key(report_first):
    sim = running_sim(managed=True)
    report = P.WorkerReported(2, 0, "boom")
    exited = P.WorkerExited(2, 0, None, signal.SIGKILL)
    first, second = (report, exited) if report_first else (exited, report)
    only(sim.decide(P.handle_event, first), P.RelaunchWorker)
    new, actions = P.handle_event(sim.state, second, now=50.0)
    assert new is sim.state
    assert "already handled" in only(actions, P.Ignore).reason
    assert sim.state.worker_restarts[2] == 1 and sim.state.node_failures[1] == 1


def test_stale_and_future_incarnations_are_ignored():
    sim = running_sim(managed=True)
    sim.fail(0)  # relaunched: incarnation 1
    assert sim.state.workers[0].incarnation == 1
    for event in (P.WorkerExited(0, 0, 1), P.WorkerReported(0, 0, "late")):
        new, actions = P.handle_event(sim.state, event, now=50.0)
        assert new is sim.state and "stale" in only(actions, P.Ignore).reason
    new, actions = P.handle_event(sim.state, P.WorkerExited(0, 7, 1), now=50.0)
    assert new is sim.state and "never started" in only(actions, P.Ignore).reason
    new, actions = P.handle_event(sim.state, P.WorkerExited(99, 0, 1), now=50.0)
    assert new is sim.state and "no such worker" in only(actions, P.Ignore).reason
    assert sim.state.worker_restarts[0] == 1


def test_exit_after_success_is_a_duplicate():
    sim = running_sim(managed=True)
    sim.event(P.WorkerExited(1, 0, 0))
    new, actions = P.handle_event(sim.state, P.WorkerReported(1, 0, "late"), now=9.0)
    assert new is sim.state and "already ended" in only(actions, P.Ignore).reason


# -- rule 4: node relaunch ------------------------------------------------------


def test_node_relaunch_exits_are_not_failures_and_reset_the_node_count():
    sim = running_sim(managed=True, nproc_per_node=3, per_node_max_failures=1, spare_nodes=1)
    sim.fail(0)
    assert sim.state.node_failures[0] == 1
    relaunch = only(sim.decide(P.handle_event, P.WorkerExited(1, 0, 1)), P.RelaunchNode)
    assert relaunch == P.RelaunchNode(node=0, from_slot=0, to_slot=2, workers=(0, 1, 2))
    assert sim.state.node_failures[0] == 0
    assert sim.state.relaunching_nodes == {0}
    assert sim.state.workers[1].status is S.FAILED
    assert sim.state.workers[0].status is S.STOPPING  # incarnation 1 was running
    assert sim.state.workers[2].status is S.STOPPING
    restarts = dict(sim.state.worker_restarts)
    # the controller stops the node: exits with any code are not failures nor successes
    for w, code, sig in ((0, None, signal.SIGTERM), (2, 0, None)):
        inc = sim.state.workers[w].incarnation
        actions = sim.decide(P.handle_event, P.WorkerExited(w, inc, code, sig))
        assert actions == []
        assert sim.state.workers[w].status is S.PENDING
    assert sim.state.worker_restarts == restarts
    assert sim.state.node_failures[0] == 0
    for w in relaunch.workers:
        sim.start(w)
    assert sim.state.relaunching_nodes == set()
    assert {sim.state.workers[w].slot for w in range(3)} == {2}
    assert sim.state.node_slots == {0: 2, 1: 1}


def test_node_relaunch_marks_running_workers_of_the_node_stopping():
    sim = running_sim(managed=True, per_node_max_failures=1, spare_nodes=1)
    sim.fail(2)
    actions = sim.decide(P.handle_event, P.WorkerExited(3, 0, 1))
    relaunch = only(actions, P.RelaunchNode)
    assert relaunch.workers == (2, 3)
    assert sim.state.workers[2].status is S.STOPPING  # incarnation 1 was running
    assert sim.state.workers[3].status is S.FAILED
    assert sim.state.workers[0].status is S.RUNNING  # other node untouched
    # a self-report from a worker being stopped is ignored too
    new, ign = P.handle_event(sim.state, P.WorkerReported(2, 1, "SIGTERM"), now=50.0)
    assert new is sim.state and isinstance(ign[0], P.Ignore)


def test_per_node_limit_relaunches_node_onto_spare_slot():
    sim = running_sim(managed=True, per_node_max_failures=2, spare_nodes=2)
    sim.fail(2)
    sim.fail(3)
    actions = sim.fail(2)
    relaunch = only(actions, P.RelaunchNode)
    assert (relaunch.node, relaunch.from_slot, relaunch.to_slot) == (1, 1, 2)
    assert sim.state.removed_slots == [1]
    assert sim.state.node_relaunches == 1
    assert sim.state.node_slots == {0: 0, 1: 2}
    assert sim.state.relaunching_nodes == set()  # the Sim started its workers
    assert [sim.state.workers[w].slot for w in range(4)] == [0, 0, 2, 2]


def test_per_node_limit_relaunches_node_in_place_without_spare():
    sim = running_sim(managed=True, per_node_max_failures=1, spare_nodes=0)
    sim.fail(0)
    relaunch = only(sim.fail(1), P.RelaunchNode)
    assert (relaunch.node, relaunch.from_slot, relaunch.to_slot) == (0, 0, 0)
    assert sim.state.removed_slots == []
    assert sim.state.node_slots == {0: 0, 1: 1}
    assert sim.state.node_relaunches == 1


def test_second_relaunch_uses_the_next_spare_and_then_in_place():
    sim = running_sim(
        managed=True, per_node_max_failures=1, spare_nodes=1, node_max_relaunches=3, max_restarts=9
    )
    sim.fail(0)
    assert only(sim.fail(0), P.RelaunchNode).to_slot == 2
    sim.fail(2)
    relaunch = only(sim.fail(2), P.RelaunchNode)
    assert (relaunch.from_slot, relaunch.to_slot) == (1, 1)  # no spare left, slot 0 removed
    assert sim.state.removed_slots == [0]


def test_job_level_node_relaunch_is_carried_out_by_the_cold_restart():
    sim = running_sim(managed=False, per_node_max_failures=1, spare_nodes=1)
    sim.fail(3)
    actions = sim.fail(3)
    restart = only(actions, P.RestartJob)
    assert "node 1" in restart.reason and "slot 2" in restart.reason
    assert sim.state.node_slots == {0: 0, 1: 2}
    assert sim.state.removed_slots == [1]
    assert sim.state.relaunching_nodes == set()
    assert sim.state.stage is Stage.RUNNING
    assert [sim.state.workers[w].slot for w in range(4)] == [0, 0, 2, 2]
    assert sim.state.job_restarts == 2 and sim.state.node_relaunches == 1


# -- role level vs job level ----------------------------------------------------


def test_role_level_failover_relaunches_only_the_failed_worker():
    sim = running_sim(managed=True)
    actions = sim.fail(1)
    assert only(actions, P.RelaunchWorker) == P.RelaunchWorker(worker=1, slot=0)
    assert sim.state.stage is Stage.RUNNING
    assert sim.state.generation == 0 and sim.state.job_restarts == 0
    assert [sim.state.workers[w].incarnation for w in range(4)] == [0, 1, 0, 0]


@pytest.mark.parametrize("managed", [None, False])
def test_job_level_failover_restarts_every_worker(managed):
    sim = Sim(make_spec(), managed)
    sim.run()
    sim.event(P.WorkerExited(0, 0, 0))  # a succeeded worker is restarted too (cold restart)
    actions = sim.decide(P.handle_event, P.WorkerExited(1, 0, None, signal.SIGSEGV))
    restart = only(actions, P.RestartJob)
    assert restart.generation == 1
    assert "worker 1" in restart.reason and "SIGSEGV" in restart.reason
    assert sim.state.stage is Stage.READY
    assert sim.state.generation == 1 and sim.state.job_restarts == 1
    assert [sim.state.workers[w].status for w in range(4)] == [
        S.SUCCEEDED,
        S.FAILED,
        S.STOPPING,
        S.STOPPING,
    ]
    sim.execute(actions)
    assert sim.state.stage is Stage.RUNNING
    assert all(r.generation == 1 and r.status is S.RUNNING for r in sim.state.workers.values())
    assert [sim.state.workers[w].incarnation for w in range(4)] == [1, 1, 1, 1]


def test_ready_becomes_running_only_when_all_workers_started():
    sim = Sim(make_spec(), managed=True)
    sim.decide(P.start_job)
    for w in range(3):
        sim.start(w)
        assert sim.state.stage is Stage.READY
    sim.start(3)
    assert sim.state.stage is Stage.RUNNING


# -- limits -----------------------------------------------------------------------


def test_max_restarts_stops_the_job():
    sim = running_sim(managed=True, max_restarts=1, per_node_max_failures=10)
    sim.fail(2)
    actions = sim.fail(2)
    stop = actions[0]
    assert isinstance(stop, P.StopJob) and stop.exit_code == P.FAILURE_EXIT_CODE
    assert "worker 2" in stop.reason and "max_restarts=1" in stop.reason
    assert sim.state.stage is Stage.STOPPED
    assert (sim.state.exit_code, sim.state.reason) == (stop.exit_code, stop.reason)


def test_job_max_restarts_stops_the_job():
    sim = running_sim(managed=False, job_max_restarts=1, per_node_max_failures=10)
    only(sim.fail(0), P.RestartJob)
    stop = sim.fail(1)[0]
    assert isinstance(stop, P.StopJob) and stop.exit_code != 0
    assert "job_max_restarts=1" in stop.reason
    assert sim.state.exit_code == stop.exit_code and sim.state.reason == stop.reason


def test_job_max_restarts_zero_stops_at_first_failure():
    sim = running_sim(managed=None, job_max_restarts=0)
    stop = sim.fail(0)[0]
    assert isinstance(stop, P.StopJob) and stop.exit_code != 0
    assert sim.state.generation == 0


def test_node_max_relaunches_stops_the_job():
    sim = running_sim(managed=True, per_node_max_failures=1, node_max_relaunches=1, spare_nodes=1)
    sim.fail(0)
    only(sim.fail(0), P.RelaunchNode)
    sim.fail(1)
    stop = sim.fail(1)[0]
    assert isinstance(stop, P.StopJob) and stop.exit_code != 0
    assert "node 0" in stop.reason and "node_max_relaunches=1" in stop.reason
    assert sim.state.reason == stop.reason and sim.state.stage is Stage.STOPPED


def test_worker_that_always_crashes_stops_after_max_restarts_plus_one():
    sim = running_sim(managed=True, max_restarts=2, per_node_max_failures=10)
    for _ in range(2):
        only(sim.fail(0, code=7), P.RelaunchWorker)
    stop = sim.fail(0, code=7)[0]
    assert isinstance(stop, P.StopJob) and stop.exit_code == P.FAILURE_EXIT_CODE
    assert "failed 3 times" in stop.reason
    assert sim.state.worker_restarts[0] == 3
    assert sim.state.stage is Stage.STOPPED


@pytest.mark.parametrize("managed", [True, False])
def test_three_crashes_relaunch_the_node_to_the_spare_and_the_job_completes(managed):
    sim = running_sim(managed=managed, per_node_max_failures=2, spare_nodes=1)
    sim.fail(3)
    sim.fail(3)
    sim.fail(3)
    assert sim.state.node_relaunches == 1
    assert sim.state.node_slots == {0: 0, 1: 2}
    assert sim.state.removed_slots == [1]
    assert sim.state.stage is Stage.RUNNING
    kinds = [type(a) for a in sim.actions if not isinstance(a, P.Ignore)]
    if managed:
        assert P.RelaunchNode in kinds and P.RestartJob not in kinds
    else:
        assert P.RelaunchNode not in kinds and kinds.count(P.RestartJob) == 3
    sim.succeed_all()
    assert sim.state.stage is Stage.STOPPED
    assert sim.state.exit_code == 0 and sim.state.reason.startswith("completed")


# -- completion -------------------------------------------------------------------


def test_all_workers_succeeded_stops_with_zero():
    sim = running_sim(managed=True)
    for w in range(3):
        assert sim.event(P.WorkerExited(w, 0, 0)) == []
        assert sim.state.workers[w].status is S.SUCCEEDED
    actions = sim.decide(P.handle_event, P.WorkerExited(3, 0, 0))
    assert only(actions, P.StopJob) == P.StopJob(0, "completed: all 4 workers succeeded")
    assert sim.state.stage is Stage.STOPPING and sim.state.exit_code == 0
    sim.execute(actions)
    assert sim.state.stage is Stage.STOPPED and sim.state.exit_code == 0


def test_request_stop_and_stopped():
    sim = running_sim()
    stop = only(sim.decide(P.request_stop, 130, "interrupted by SIGINT"), P.StopJob)
    assert stop == P.StopJob(130, "interrupted by SIGINT")
    assert all(r.status is S.STOPPING for r in sim.state.workers.values())
    new, actions = P.request_stop(sim.state, 1, "again", now=1.0)
    assert new is sim.state and isinstance(actions[0], P.Ignore)
    done = P.stopped(sim.state, now=2.0)
    assert done.stage is Stage.STOPPED and done.exit_code == 130
    assert P.stopped(done, now=3.0) is done
    with pytest.raises(P.PolicyError, match="STOPPING"):
        P.stopped(running_sim().state, now=1.0)


# -- self-recovery ------------------------------------------------------------------


@pytest.mark.parametrize("stage", [Stage.INIT, Stage.READY])
def test_recover_during_start_stops_with_failure(stage):
    sim = Sim(make_spec())
    if stage is Stage.READY:
        sim.decide(P.start_job)
        sim.start(0)
    actions = sim.restart_controller()
    stop = actions[0]
    assert isinstance(stop, P.StopJob) and stop.exit_code == P.FAILURE_EXIT_CODE
    assert stop.reason == f"controller crashed during {stage.value}; stopped safely"
    assert sim.state.stage is Stage.STOPPED and sim.state.exit_code == 1


def test_recover_during_cold_restart_stops_with_failure():
    sim = running_sim(managed=False)
    sim.decide(P.handle_event, P.WorkerExited(0, 0, 1))  # RestartJob not executed yet
    assert sim.state.stage is Stage.READY
    stop = sim.restart_controller()[0]
    assert isinstance(stop, P.StopJob) and stop.exit_code != 0
    assert "READY" in stop.reason


def test_recover_running_resumes():
    sim = running_sim(managed=True)
    actions = sim.restart_controller()
    assert actions == [P.Resume()]
    assert sim.state.stage is Stage.RUNNING and sim.state.exit_code is None


def test_recover_running_finishes_pending_relaunches():
    sim = running_sim(managed=True, per_node_max_failures=1, spare_nodes=1)
    sim.fail(0)
    relaunch = only(sim.decide(P.handle_event, P.WorkerExited(0, 1, 1)), P.RelaunchNode)
    assert sim.state.relaunching_nodes == {0}
    # crash before any worker of the node was stopped or started
    actions = sim.restart_controller()
    assert actions == [P.Resume(), P.RelaunchWorker(0, 2), P.RelaunchWorker(1, 2)]
    assert relaunch.workers == (0, 1)
    assert sim.state.relaunching_nodes == set()
    assert sim.state.workers[1].slot == 2 and sim.state.workers[1].status is S.RUNNING


def test_recover_worker_lost_while_controller_down_counts_as_failure():
    sim = running_sim(managed=True)
    assert sim.restart_controller() == [P.Resume()]
    # the controller finds worker 2's pid gone: unknown exit status
    actions = sim.event(P.WorkerExited(2, 0))
    assert only(actions, P.RelaunchWorker).worker == 2
    assert sim.state.worker_restarts[2] == 1


def test_recover_stopping_keeps_failure_code_and_reason():
    sim = running_sim(managed=True, max_restarts=0)
    sim.decide(P.handle_event, P.WorkerExited(1, 0, 1))
    assert sim.state.stage is Stage.STOPPING
    reason = sim.state.reason
    stop = sim.restart_controller()[0]
    assert isinstance(stop, P.StopJob) and stop.exit_code == 1
    assert stop.reason.startswith(reason) and "STOPPING" in stop.reason
    assert sim.state.stage is Stage.STOPPED


def test_recover_stopping_after_completion_keeps_zero():
    sim = running_sim(managed=True)
    for w in range(4):
        sim.decide(P.handle_event, P.WorkerExited(w, 0, 0))
    assert sim.state.stage is Stage.STOPPING and sim.state.exit_code == 0
    stop = sim.restart_controller()[0]
    assert stop.exit_code == 0
    assert sim.state.stage is Stage.STOPPED and sim.state.exit_code == 0


def test_recover_stopping_with_zero_but_unfinished_workers_fails():
    sim = running_sim()
    sim.decide(P.request_stop, 0, "asked to stop")
    stop = sim.restart_controller()[0]
    assert stop.exit_code == P.FAILURE_EXIT_CODE


@pytest.mark.parametrize("code", [0, 1])
def test_recover_stopped_keeps_recorded_exit_code(code):
    sim = running_sim(managed=True, max_restarts=0)
    if code == 0:
        sim.succeed_all()
    else:
        sim.fail(0)
    assert sim.state.stage is Stage.STOPPED
    state = sim.state
    new, actions = P.recover(state, now=1e9)
    assert new is state
    assert only(actions, P.StopJob) == P.StopJob(code, state.reason)


def test_recover_inconsistent_state_stops_with_failure():
    sim = running_sim(managed=True)
    bad = sim.state.copy()
    bad.workers[17] = dataclasses.replace(bad.workers[0])
    assert any("workers are" in p for p in P.check_state(bad))
    new, actions = P.recover(bad, now=5.0)
    stop = only(actions, P.StopJob)
    assert stop.exit_code == P.FAILURE_EXIT_CODE and "inconsistent" in stop.reason
    assert new.stage is Stage.STOPPING and new.exit_code == P.FAILURE_EXIT_CODE


def test_recover_stopped_without_exit_code_fails():
    sim = running_sim()
    bad = sim.state.copy()
    bad.stage = Stage.STOPPED
    _, actions = P.recover(bad, now=5.0)
    assert only(actions, P.StopJob).exit_code == P.FAILURE_EXIT_CODE


# -- helpers and argument errors ----------------------------------------------------


def test_new_job_state_layout():
    state = P.new_job_state(make_spec(nnodes=3, nproc_per_node=2, spare_nodes=1), now=5.0)
    assert state.stage is Stage.INIT and state.updated_at == 5.0
    assert state.node_slots == {0: 0, 1: 1, 2: 2}
    assert [state.workers[w].node for w in range(6)] == [0, 0, 1, 1, 2, 2]
    assert all(r.incarnation == -1 and r.status is S.PENDING for r in state.workers.values())
    assert P.check_state(state) == []


def test_worker_started_records_the_incarnation():
    sim = running_sim(managed=True)
    r = sim.state.workers[1]
    assert (r.incarnation, r.status, r.generation, r.slot) == (0, S.RUNNING, 0, 0)
    assert r.pid is not None and r.pid_start_time is not None


def test_worker_started_rejects_bad_calls():
    sim = running_sim(managed=True)
    with pytest.raises(P.PolicyError, match="recorded as running"):
        P.worker_started(sim.state, 0, pid=5, start_time=1.0, now=1.0)
    with pytest.raises(P.PolicyError, match="worker must be"):
        P.worker_started(sim.state, 4, pid=5, start_time=1.0, now=1.0)
    sim.decide(P.handle_event, P.WorkerReported(0, 0, "x"))
    with pytest.raises(P.PolicyError, match="pid"):
        P.worker_started(sim.state, 0, pid=0, start_time=1.0, now=1.0)
    with pytest.raises(P.PolicyError, match="start_time"):
        P.worker_started(sim.state, 0, pid=5, start_time=float("nan"), now=1.0)
    with pytest.raises(P.PolicyError, match="now"):
        P.worker_started(sim.state, 0, pid=5, start_time=1.0, now=None)
    init = P.new_job_state(make_spec(), now=1.0)
    with pytest.raises(P.PolicyError, match="READY or RUNNING"):
        P.worker_started(init, 0, pid=5, start_time=1.0, now=1.0)
    with pytest.raises(P.PolicyError, match="INIT"):
        P.start_job(sim.state, now=1.0)


def test_event_and_argument_validation():
    with pytest.raises(P.PolicyError, match="worker"):
        P.WorkerExited(-1, 0, 1)
    with pytest.raises(P.PolicyError, match="incarnation"):
        P.WorkerReported(0, -1, "x")
    with pytest.raises(P.PolicyError, match="exit_code"):
        P.WorkerExited(0, 0, "1")
    with pytest.raises(P.PolicyError, match="signal"):
        P.WorkerExited(0, 0, None, 0)
    with pytest.raises(P.PolicyError, match="reason"):
        P.WorkerReported(0, 0, None)
    state = P.new_job_state(make_spec(), now=1.0)
    with pytest.raises(P.PolicyError, match="event"):
        P.handle_event(state, "exit", now=1.0)
    with pytest.raises(P.PolicyError, match="managed"):
        P.set_wrapper_managed(state, None, now=1.0)
    with pytest.raises(P.PolicyError, match="exit_code"):
        P.request_stop(state, "1", "x", now=1.0)
    with pytest.raises(P.PolicyError, match="spec"):
        P.new_job_state({"job_id": "x"}, now=1.0)


def test_describe_names_signals_and_codes():
    assert "SIGKILL" in P.WorkerExited(0, 0, None, signal.SIGKILL).describe()
    assert "code 3" in P.WorkerExited(0, 0, 3).describe()
    assert "unknown" in P.WorkerExited(0, 0).describe()


def test_set_wrapper_managed_is_recorded_once():
    state = P.new_job_state(make_spec(), now=1.0)
    managed = P.set_wrapper_managed(state, True, now=2.0)
    assert managed.wrapper_managed is True and state.wrapper_managed is None
    assert P.set_wrapper_managed(managed, True, now=3.0) is managed


def test_event_log_is_bounded():
    state = running_sim(managed=True, max_restarts=10_000, per_node_max_failures=10_000).state
    for inc in range(MAX_EVENTS // 2):
        state, _ = P.handle_event(state, P.WorkerExited(0, inc, 1), now=float(inc))
        state = P.worker_started(state, 0, pid=7, start_time=1.0, now=float(inc))
    assert len(state.events) == MAX_EVENTS
    assert state.events[-1]["kind"] == "worker_start"
    assert P.check_state(state) == []


# -- property: random event sequences -------------------------------------------

specs = st.builds(
    make_spec,
    nnodes=st.integers(1, 3),
    nproc_per_node=st.integers(1, 2),
    spare_nodes=st.integers(0, 2),
    max_restarts=st.integers(0, 3),
    per_node_max_failures=st.integers(1, 3),
    job_max_restarts=st.integers(0, 3),
    node_max_relaunches=st.integers(0, 2),
)


OPS = ["exit"] * 6 + ["report"] * 3 + ["crash", "stop", "lost", "abort"]
EXITS = [(0, None), (1, None), (1, None), (None, 9), (None, 9), (None, None)]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(spec=specs, managed=st.sampled_from([None, False, True]), data=st.data())
def test_random_event_sequences_keep_the_invariants(spec, managed, data):
    sim = Sim(spec, managed)
    n = spec.world_size
    sim.run()
    for _ in range(data.draw(st.integers(0, 30), label="steps")):
        if sim.state.stage is Stage.STOPPED:
            break
        # at rest: the job runs and every worker is alive or done (nothing silently lost)
        assert sim.state.stage is Stage.RUNNING
        assert all(
            r.status in (S.RUNNING, S.SUCCEEDED, S.ABORTED) for r in sim.state.workers.values()
        )
        assert sim.state.relaunching_nodes == set()
        op = data.draw(st.sampled_from(OPS), label="op")
        if data.draw(st.integers(0, 9), label="crash soon") == 0:
            sim.crash_countdown = data.draw(st.integers(1, 6), label="countdown")
        try:
            if op in ("exit", "report"):
                w = data.draw(st.integers(0, n), label="worker")  # n: unknown worker
                current = sim.state.workers[w].incarnation if w < n else 0
                inc = max(0, current + data.draw(st.sampled_from([0, 0, 0, -1, 1]), label="d"))
                if op == "exit":
                    code, sig = data.draw(
                        st.sampled_from(EXITS),
                        label="status",
                    )
                    sim.event(P.WorkerExited(w, inc, code, sig))
                else:
                    sim.event(P.WorkerReported(w, inc, "boom"))
            elif op == "crash":
                raise Crash
            elif op == "lost":
                cls = data.draw(st.sampled_from([P.StoreLost, P.NoLiveMember]), label="lost")
                gen = max(0, sim.state.generation - data.draw(st.integers(0, 1), label="old"))
                sim.event(cls(gen, "generation lost"))
            elif op == "abort":
                w = data.draw(st.integers(0, n - 1), label="aborted worker")
                inc = sim.state.workers[w].incarnation
                sim.event(P.WorkerReported(w, inc, "RestartAbort: x", restartable=False))
            elif data.draw(st.integers(0, 4), label="really stop") == 0:
                sim.execute(sim.decide(P.request_stop, 143, "SIGTERM"))
        except Crash:
            sim.crash_countdown = None
            actions = sim.restart_controller()
            if sim.state.stage is Stage.RUNNING:
                # Resume: some workers died while the controller was down
                for w in sorted(sim.state.workers):
                    r = sim.state.workers[w]
                    if r.status is S.RUNNING and data.draw(st.booleans(), label="lost"):
                        sim.event(P.WorkerExited(w, r.incarnation))
            else:
                assert isinstance(actions[0], P.StopJob)
    # drain: whatever happened, a running job can still complete
    sim.crash_countdown = None
    if sim.state.stage is Stage.RUNNING:
        aborted = any(r.status is S.ABORTED for r in sim.state.workers.values())
        sim.succeed_all()
        assert sim.state.stage is Stage.STOPPED
        assert sim.state.exit_code == (P.FAILURE_EXIT_CODE if aborted else 0)
    assert sim.state.stage is Stage.STOPPED
    assert sim.state.exit_code is not None and sim.state.reason
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "state.json")
        save_state(path, sim.state)
        assert load_state(path) == sim.state


def test_handled_failures_match_worker_restarts():
    sim = running_sim(managed=True, per_node_max_failures=10)
    sim.fail(0)
    sim.event(P.WorkerReported(1, 0, "x"))
    assert sim.state.handled_failures == {failure_key(0, 0), failure_key(1, 0)}
    assert sum(sim.state.worker_restarts.values()) == 2


# -- dead ends: a worker that left on purpose, a lost store, no live member (issue 9) ---


def test_restart_abort_is_never_relaunched_and_ends_the_job_with_its_reason():
    sim = running_sim(managed=True)
    abort = "RestartAbort: iteration 3 would exceed max_iterations=3"
    for w in range(3):
        actions = sim.event(P.WorkerReported(w, 0, abort, restartable=False))
        assert actions == [] and sim.state.workers[w].status is S.ABORTED
    # its exit afterwards is the same departure, not a failure
    only(sim.fail(0), P.Ignore)
    assert sim.state.worker_restarts[0] == 0
    actions = sim.event(P.WorkerReported(3, 0, abort, restartable=False))
    stop = only(actions, P.StopJob)
    assert stop.exit_code == P.FAILURE_EXIT_CODE and "max_iterations=3" in stop.reason
    assert sim.state.stage is Stage.STOPPED and sim.state.reason == stop.reason


def test_one_abort_among_successes_fails_the_job():
    sim = running_sim(managed=True)
    sim.event(P.WorkerReported(2, 0, "RestartAbort: gave up", restartable=False))
    sim.succeed_all()
    assert sim.state.stage is Stage.STOPPED and sim.state.exit_code == P.FAILURE_EXIT_CODE
    assert "gave up" in sim.state.reason


@pytest.mark.parametrize("event_cls", [P.StoreLost, P.NoLiveMember])
def test_lost_generation_gets_a_cold_restart_within_the_limit(event_cls):
    sim = running_sim(managed=True, job_max_restarts=1)
    restart = only(sim.event(event_cls(0, "gone")), P.RestartJob)
    assert restart.generation == 1 and "gone" in restart.reason
    assert sim.state.stage is Stage.RUNNING and sim.state.generation == 1
    assert all(r.incarnation == 1 for r in sim.state.workers.values())
    only(sim.event(event_cls(0, "stale")), P.Ignore)  # an older generation's loss
    stop = only(sim.event(event_cls(1, "gone again")), P.StopJob)
    assert stop.exit_code == P.FAILURE_EXIT_CODE
    assert "gone again" in stop.reason and "job_max_restarts=1" in stop.reason


def test_no_live_member_after_an_abort_stops_instead_of_restarting():
    sim = running_sim(managed=True)
    sim.event(P.WorkerReported(0, 0, "RestartAbort: min_world_size", restartable=False))
    only(sim.fail(1), P.RelaunchWorker)  # a crash is relaunched: it waits to rejoin
    stop = only(sim.event(P.NoLiveMember(0, "no live member")), P.StopJob)
    assert "min_world_size" in stop.reason and sim.state.generation == 0


def test_node_relaunch_leaves_aborted_workers_alone():
    sim = running_sim(managed=True, per_node_max_failures=1, spare_nodes=1)
    sim.event(P.WorkerReported(1, 0, "RestartAbort: x", restartable=False))
    sim.fail(0)
    relaunch = only(sim.fail(0), P.RelaunchNode)
    assert relaunch.workers == (0,)
    assert sim.state.workers[1].status is S.ABORTED


# -- joining: a started worker must join the Wrapper job in time ----------------


def joined_sim(**kw) -> Sim:
    """A Wrapper job whose four workers were all seen in it."""
    sim = running_sim(managed=True, join_timeout=100, standby_join_timeout=10, **kw)
    for w in sorted(sim.state.workers):
        sim.adopt(P.worker_joined(sim.state, w, 0, now=sim.tick()))
    return sim


def test_a_worker_that_does_not_join_in_time_is_replaced_by_a_fresh_process():
    sim = joined_sim()
    assert P.overdue_joins(sim.state, now=sim.now + 10_000) == []  # all joined
    only(sim.fail(1), P.RelaunchWorker)  # a warm standby takes its place: the shorter deadline
    started = sim.state.workers[1].started_at
    assert sim.state.workers[1].join_timeout == 10 and not sim.state.workers[1].joined
    assert P.overdue_joins(sim.state, now=started + 10) == []
    late = P.overdue_joins(sim.state, now=started + 10.5)
    assert late == [P.JoinOverdue(1, 1, 10.5)]
    actions = sim.event(late[0])
    assert only(actions, P.RelaunchWorker) == P.RelaunchWorker(1, 0, fresh=True)
    record = sim.state.workers[1]
    assert record.incarnation == 2 and record.status is S.RUNNING and record.join_misses == 1
    assert sim.state.worker_restarts[1] == 1  # the stopped standby is no failure of the worker
    overdue = [e for e in sim.state.events if e["kind"] == "worker_join_overdue"]
    assert len(overdue) == 1 and "did not join the job 10s after its start" in overdue[0]["message"]
    # the fresh process gets the generous deadline, and joins
    assert record.join_timeout == 100
    assert P.overdue_joins(sim.state, now=record.started_at + 99) == []
    sim.adopt(P.worker_joined(sim.state, 1, 2, now=sim.tick()))
    assert sim.state.workers[1].joined and sim.state.workers[1].join_misses == 0
    same = sim.state
    assert P.worker_joined(same, 1, 2, now=sim.tick()) is same  # once
    assert P.worker_joined(same, 1, 1, now=sim.tick()) is same  # an older incarnation
    assert P.overdue_joins(sim.state, now=sim.now + 10_000) == []
    only(sim.event(late[0]), P.Ignore)  # stale: incarnation 2 is gone


def test_a_controller_that_crashed_replacing_an_overdue_worker_spawns_a_fresh_one():
    sim = joined_sim()
    sim.fail(2)
    (late,) = P.overdue_joins(sim.state, now=sim.now + 1000)
    new, _actions = P.handle_event(sim.state, late, now=sim.tick())  # decided and saved, not done
    sim.state = new
    relaunch = [a for a in sim.restart_controller() if isinstance(a, P.RelaunchWorker)]
    assert relaunch == [P.RelaunchWorker(2, 1, fresh=True)]
    assert sim.state.workers[2].join_timeout == 100


def test_a_replacement_that_never_joins_ends_the_job_with_one_clear_reason():
    sim = joined_sim()
    sim.fail(0)
    now = sim.now + 1000
    (late,) = P.overdue_joins(sim.state, now=now)
    assert late.worker == 0
    only(sim.event(late), P.RelaunchWorker)
    (again,) = P.overdue_joins(sim.state, now=sim.now + 1000)
    assert again.worker == 0 and again.incarnation == late.incarnation + 1
    assert sim.state.workers[0].join_timeout == 100  # the fresh one: the longer deadline
    stop = only(sim.event(again), P.StopJob)
    assert stop.exit_code == P.FAILURE_EXIT_CODE
    assert f"worker 0 incarnation {again.incarnation} did not join the job" in stop.reason
    assert "join deadline 100s" in stop.reason and "did not join either" in stop.reason
    assert sim.state.stage is Stage.STOPPED


def test_joining_applies_to_wrapper_jobs_only_and_0_means_no_deadline():
    for managed in (None, False):
        sim = running_sim(managed=managed, join_timeout=5)
        assert P.overdue_joins(sim.state, now=sim.now + 1000) == []
        only(sim.event(P.JoinOverdue(1, 0, 1000.0)), P.Ignore)
    sim = running_sim(managed=True, join_timeout=0)
    assert P.overdue_joins(sim.state, now=sim.now + 10**6) == []
    # a job starting (READY) has no verdict yet; a worker that succeeded needs none
    sim = running_sim(managed=True, join_timeout=5)
    sim.event(P.WorkerExited(2, 0, 0))
    assert [e.worker for e in P.overdue_joins(sim.state, now=sim.now + 1000)] == [0, 1, 3]


def test_join_overdue_and_join_timeouts_are_checked():
    with pytest.raises(P.PolicyError, match=r"JoinOverdue\.waited"):
        P.JoinOverdue(0, 0, float("nan"))
    with pytest.raises(P.PolicyError, match="warm must be True or False"):
        sim = Sim(make_spec())
        sim.decide(P.start_job)
        P.worker_started(sim.state, 0, pid=5, start_time=1.0, now=2.0, warm=1)
    with pytest.raises(P.PolicyError, match="now must be a finite number"):
        P.overdue_joins(running_sim(managed=True).state, now=float("inf"))
