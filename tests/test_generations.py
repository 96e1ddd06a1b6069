"""Both generations of the callback API in one Wrapper (issue 12, items 1, 2 and 4).

Which shape a callback expects is read per callback; mixing is an error; the
newer generation's FrozenState, ctx rank assignments and filters, completion,
terminate, pidfile and hang protection; one training job written in each
style, with the same faults, ends the same way.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import threading
import time

import pytest
import torch.distributed as dist
from launcher import Job

import inprocess
from inprocess.generation import Generation, generation_of
from inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FilterCountGroupedByKey,
    FilterGroupedByKey,
    MaxActiveWorldSize,
    RankAssignmentCtx,
    RankDiscarded,
    ShiftRanks,
)
from inprocess.state import FrozenState, Mode, State
from inprocess.store import StoreMixin

ms = datetime.timedelta(milliseconds=1)
s = datetime.timedelta(seconds=1)


class GuideFinalize(inprocess.finalize.Finalize):
    def __call__(self, state, train_ex):
        return state, train_ex


class NewerFinalize(inprocess.finalize.Finalize):
    def __call__(self, state: FrozenState) -> FrozenState:
        return state


class NewerHealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state):
        return state


class NewerInitialize(inprocess.initialize.Initialize):
    def __call__(self, state: FrozenState) -> FrozenState:
        return state


class Seen(inprocess.completion.Completion, inprocess.terminate.Terminate):
    def __init__(self):
        self.states: list[FrozenState] = []

    def __call__(self, state: FrozenState) -> FrozenState:
        self.states.append(state)
        return state


# ---------------------------------------------------------------------- state


def test_frozen_state_is_a_read_only_snapshot():
    ex = RuntimeError("x")
    state = State(rank=2, world_size=4, fn_exception=ex)
    frozen = state.freeze()
    assert (frozen.rank, frozen.world_size, frozen.active_rank, frozen.mode) == (
        2,
        4,
        2,
        Mode.ACTIVE,
    )
    assert frozen.initial_rank == 2 and frozen.iteration == 0 and frozen.fn_exception is ex
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.rank = 1
    state.rank = 1
    assert frozen.rank == 2
    assert Mode.INITIALIZED in Mode


# ---------------------------------------------------------------------- shapes, per callback


@pytest.mark.parametrize(
    ("name", "callback", "expected"),
    [
        ("finalize", GuideFinalize(), Generation.GUIDE),
        ("finalize", NewerFinalize(), Generation.NEWER),
        ("health_check", NewerHealthCheck(), Generation.NEWER),
        ("health_check", inprocess.health_check.FaultCounter(), None),  # built-in: both
        ("initialize", NewerInitialize(), Generation.NEWER),
        ("initialize", inprocess.initialize.RetryController(), None),
        ("rank_assignment", ShiftRanks(), None),
        ("rank_assignment", FilterGroupedByKey("k", bool), Generation.GUIDE),
        ("rank_assignment", FilterCountGroupedByKey("k", bool), Generation.NEWER),
        (
            "rank_assignment",
            inprocess.Compose(MaxActiveWorldSize(2), ShiftRanks()),
            Generation.NEWER,
        ),
        ("rank_filter", inprocess.rank_filter.MaxActiveWorldSize(2), Generation.GUIDE),
        ("completion", Seen(), Generation.NEWER),
    ],
)
def test_each_callback_says_its_generation(name, callback, expected):
    assert generation_of(name, callback) is expected


def test_defaults_follow_the_generation():
    assert isinstance(inprocess.Wrapper().rank_assignment, ShiftRanks)
    assert inprocess.Wrapper().generation is Generation.GUIDE
    newer = inprocess.Wrapper(finalize=NewerFinalize())
    assert newer.generation is Generation.NEWER
    assert repr(newer.rank_assignment) == "Compose(ActivateAllRanks(), ShiftRanks())"
    guide = inprocess.Wrapper(rank_filter=inprocess.rank_filter.MaxActiveWorldSize(2))
    assert guide.generation is Generation.GUIDE and isinstance(guide.rank_assignment, ShiftRanks)


def test_mixing_generations_is_an_error_naming_the_arguments():
    with pytest.raises(ValueError, match=r"finalize=.*health_check=.*newer"):
        inprocess.Wrapper(finalize=GuideFinalize(), health_check=NewerHealthCheck())
    with pytest.raises(ValueError, match=r"rank_filter=.*completion="):
        inprocess.Wrapper(
            rank_filter=inprocess.rank_filter.MaxActiveWorldSize(2), completion=Seen()
        )
    with pytest.raises(ValueError, match=r"Wrapper\(rank_assignment=...\).*both generations"):
        inprocess.Wrapper(
            rank_assignment=inprocess.Compose(
                ShiftRanks(), FilterGroupedByKey("k", bool), FilterCountGroupedByKey("k", bool)
            )
        )


def test_new_arguments_are_checked():
    with pytest.raises(TypeError, match="completion"):
        inprocess.Wrapper(completion=print)
    with pytest.raises(TypeError, match="terminate"):
        inprocess.Wrapper(terminate=5)
    with pytest.raises(ValueError, match="monitor_process_pidfile"):
        inprocess.Wrapper(monitor_process_pidfile="relative.pid")
    with pytest.raises(ValueError, match="heartbeat_interval"):
        inprocess.Wrapper(heartbeat_interval=40 * s)  # not shorter than heartbeat_timeout


# ---------------------------------------------------------------------- ctx assignments


def ctx_of(rank: int, world_size: int, terminated: set[int], mode=Mode.INITIALIZED):
    state = State(rank=rank, world_size=world_size, mode=mode)
    return RankAssignmentCtx(state, None, set(terminated))


def test_default_newer_assignment_and_filters_take_and_return_a_ctx():
    default = inprocess.Wrapper(finalize=NewerFinalize()).rank_assignment
    out = default(ctx_of(5, 8, {1, 4}))
    assert isinstance(out, RankAssignmentCtx) and out.terminated_ranks == set()
    assert (out.state.rank, out.state.world_size, out.state.mode) == (3, 6, Mode.ACTIVE)
    assert out.state.active_rank == 3 and out.state.active_world_size == 6

    capped = inprocess.Compose(ActiveWorldSizeDivisibleBy(2), MaxActiveWorldSize(5), ShiftRanks())
    modes = [capped(ctx_of(r, 8, {0})).state for r in range(1, 8)]
    assert [m.mode for m in modes] == [Mode.ACTIVE] * 4 + [Mode.INACTIVE] * 3
    assert [m.active_rank for m in modes] == [0, 1, 2, 3, None, None, None]
    assert {m.active_world_size for m in modes} == {4}
    assert MaxActiveWorldSize()(ctx_of(3, 4, set())).state.mode == Mode.ACTIVE  # None: no cap
    assert ActivateAllRanks()(ctx_of(1, 2, set())).state.mode == Mode.ACTIVE
    with pytest.raises(RankDiscarded):
        ShiftRanks()(ctx_of(4, 8, {4}))


class HashStore(dist.HashStore, StoreMixin):
    pass


def test_filter_count_grouped_by_key_keys_come_from_the_state():
    store = HashStore()
    assignment = inprocess.Compose(
        ShiftRanks(),
        FilterCountGroupedByKey(lambda state: state.rank // 2, lambda n: n == 2, name="t"),
    )
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        state = State(rank=r, world_size=6, store=store)
        try:
            results[r] = assignment(RankAssignmentCtx(state, store, {3})).state.rank
        except RankDiscarded as ex:
            results[r] = ex

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(6) if r != 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert {r: v for r, v in results.items() if isinstance(v, int)} == {0: 0, 1: 1, 4: 2, 5: 3}
    assert isinstance(results[2], RankDiscarded)


# ---------------------------------------------------------------------- in this process


FAST = dict(
    monitor_thread_interval=20 * ms,
    monitor_process_interval=20 * ms,
    progress_watchdog_interval=20 * ms,
    last_call_wait=10 * ms,
)


@pytest.mark.timeout(90)
def test_hang_protection_off_outlives_the_hard_timeout_but_faults_still_restart(single_rank):
    calls = []

    # timeouts a starved main thread cannot reach by accident on a loaded machine
    @inprocess.Wrapper(soft_timeout=2 * s, hard_timeout=4 * s, **FAST)
    def train(call_wrapper: inprocess.CallWrapper = None):
        calls.append(call_wrapper.iteration)
        with call_wrapper.hang_protection_disabled():
            time.sleep(5.5)  # longer than the hard timeout, the GIL released
            if call_wrapper.iteration == 0:
                raise RuntimeError("a fault inside still restarts")
        return "done"

    assert train() == "done"
    assert calls == [0, 1]


@pytest.mark.timeout(90)
def test_newer_callbacks_completion_terminate_and_pidfile(single_rank, tmp_path):
    pidfile = tmp_path / "monitor_{rank}.pid"
    seen = Seen()
    finalized: list[FrozenState] = []

    class Record(inprocess.finalize.Finalize):
        def __call__(self, state: FrozenState) -> FrozenState:
            finalized.append(state)
            return state

    wrapper = inprocess.Wrapper(
        initialize=inprocess.initialize.RetryController(max_iterations=2),
        finalize=Record(),
        completion=seen,
        terminate=seen,
        monitor_process_pidfile=str(pidfile),
        **FAST,
    )

    def train(fail: bool, call_wrapper: inprocess.CallWrapper = None):
        with open(str(pidfile).format(rank=0)) as f:
            pid = int(f.read())
        os.kill(pid, 0)  # the monitor process is alive
        pids.append(pid)
        assert os.environ["RANK"] == "0"
        if fail or call_wrapper.iteration == 0:
            raise ValueError("fault")
        return call_wrapper.iteration

    pids: list[int] = []
    wrapped = wrapper(train)
    assert wrapped(False) == 1
    assert [type(f.fn_exception) for f in finalized] == [ValueError]
    assert [(f.iteration, f.mode) for f in seen.states] == [(1, Mode.ACTIVE)]
    # As in the newer generations, the file outlives the call and names the
    # call's monitor process.
    with open(str(pidfile).format(rank=0)) as f:
        assert f.read().strip() == str(pids[-1])

    with pytest.raises(inprocess.exception.RestartAbort):
        wrapped(True)
    assert type(seen.states[-1].fn_exception) is inprocess.exception.RestartAbort


# ---------------------------------------------------------------------- item 4: one job, two styles


def run_style(style: str, tmp_path) -> tuple[list[int], dict[int, dict]]:
    out = tmp_path / style
    out.mkdir()
    with Job("two_generations.py", 4, tmp_path, args=["--style", style, "--out", str(out)]) as job:
        result = job.wait(150)
    assert not result.leftovers
    reports = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1, 3)}
    return result.returncodes, reports


def _faults(names: list[str]) -> list[str]:
    """Exception type names, a peer's fault as one: it reaches a rank as gloo's
    error or as the monitor thread's interrupt, whichever comes first."""
    return ["fault" if n in ("RuntimeError", "RankShouldRestart") else n for n in names]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_one_training_job_in_each_generation_ends_the_same(tmp_path):
    outcomes = {}
    for style in ("guide", "newer", "tree"):
        codes, reports = run_style(style, tmp_path)
        assert codes[2] == -9 and [codes[r] for r in (0, 1, 3)] == [0, 0, 0], (style, codes)
        results = [reports[r]["result"] for r in (0, 1, 3)]
        # exactly STEPS steps applied once each, after 2 restarts, by 3 active ranks
        assert results == [{"step": 8, "weight": 8.0, "world": 3, "iteration": 2}] * 3, results
        outcomes[style] = {
            r: (rep["result"], _faults(rep["finalize"]), _faults(rep["health_check"]))
            for r, rep in reports.items()
        }
        generation = "GUIDE" if style == "guide" else "NEWER"
        assert {rep["generation"] for rep in reports.values()} == {generation}
        if style != "guide":
            assert all(rep["completion"] == [[2, "active"]] for rep in reports.values())
    assert outcomes["guide"] == outcomes["newer"] == outcomes["tree"]


def test_callbacks_are_called_in_their_generations_shape():
    from inprocess.generation import as_state_callback, invoke, settle

    ex = ValueError("x")
    state = State(rank=1, world_size=2)
    got = []
    invoke(lambda f: got.append(f), Generation.NEWER, state, ex)
    invoke(lambda st, e: got.append((st, e)), Generation.GUIDE, state, ex)
    assert isinstance(got[0], FrozenState) and got[0].fn_exception is ex
    assert got[1] == (state, ex)
    as_state_callback(lambda f: got.append(f), Generation.NEWER)(state)
    assert isinstance(got[2], FrozenState) and got[2].fn_exception is None

    # after the barrier: what the newer assignment decided, a joiner a spare
    planned = State(rank=1, world_size=3, active_world_size=2)
    planned.apply_active_world_size()
    agreed = State(rank=1, world_size=4)
    settle(agreed, planned, joined=False)
    assert (agreed.mode, agreed.active_rank, agreed.active_world_size) == (Mode.ACTIVE, 1, 2)
    joiner = State(rank=3, world_size=4)
    settle(joiner, joiner.copy(), joined=True)
    assert (joiner.mode, joiner.active_rank) == (Mode.INACTIVE, None)
    undecided = State(rank=0, world_size=2, mode=Mode.INITIALIZED)
    settle(undecided, undecided.copy(), joined=False)
    assert (undecided.mode, undecided.active_world_size) == (Mode.ACTIVE, 2)
    bad = State(rank=1, world_size=3, active_world_size=2)
    bad.active_rank = 5
    with pytest.raises(ValueError, match="active_rank"):
        settle(State(rank=1, world_size=3), bad, joined=False)
