"""In-process restart across real rank processes (gloo on CPU)."""

from __future__ import annotations

import random

import pytest
from launcher import run_job

pytestmark = pytest.mark.slow

# Fast polling, generous deadlines: correctness on a noisy 2-core machine.
FAST = {
    "monitor_thread_interval": 0.05,
    "monitor_process_interval": 0.05,
    "progress_watchdog_interval": 0.05,
    "soft_timeout": 30,
    "hard_timeout": 45,
    "heartbeat_timeout": 20,
    "barrier_timeout": 90,
    "completion_timeout": 60,
    "last_call_wait": 0.05,
    "termination_grace_time": 1,
}


def spec(**kw):
    s = {"wrapper": dict(FAST), "steps": 6}
    s.update(kw)
    return s


def assert_completed(result, world, iterations, alive=None):
    """Every surviving rank returned the right value from the final iteration."""
    alive = range(world) if alive is None else alive
    for rank in alive:
        assert result.ranks[rank].returncode == 0, result.describe()
        returned = result.report(rank)["returned"]
        assert returned is not None, result.describe()
        assert returned["iteration"] == iterations, result.describe()
        size = len(list(alive))
        assert returned["world"] == size
        assert returned["sum"] == size * (size + 1) / 2  # all_reduce of rank+1
    assert sorted(result.report(r)["returned"]["rank"] for r in alive) == list(
        range(len(list(alive)))
    )
    assert not result.leftovers, f"processes left behind: {result.leftovers}"


def successive_faults(world, count, seed):
    """``count`` faults on different random ranks at random steps, cycling the modes."""
    rng = random.Random(seed)
    modes = ["allreduce", "barrier", "python"]
    faults = []
    for i in range(count):
        faults.append(
            {
                "iteration": i,
                "rank": rng.randrange(world),
                "step": rng.randrange(1, 5),
                "kind": "raise",
                "others": modes[i % 3],
            }
        )
    return faults


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world", "faults"), [(1, 3), (2, 3), (4, 4)])
def test_successive_exceptions_recovered_without_losing_a_rank(tmp_path, world, faults):
    result = run_job(
        "scenario.py",
        world,
        tmp_path,
        # 20 steps: in "python" mode the others are still in Python code (2 s
        # of steps) when the fault lands, even on a loaded machine
        spec(
            faults=successive_faults(world, faults, seed=world),
            python_step_seconds=0.1,
            steps=20,
            log_level="INFO",
        ),
        timeout=200,
    )
    assert_completed(result, world, iterations=faults)
    # The default rank assignment keeps the survivors' order: every restart's
    # membership was derived from the termination barrier (no iteration barrier).
    for rank in range(world):
        derived = result.ranks[rank].output.count("membership derived from the termination")
        assert derived == faults, result.describe()
    # Where the others were when interrupted: inside the collective or in Python code.
    for rank in range(world):
        interrupted = [e for e in result.report(rank)["events"] if e["kind"] == "interrupted"]
        assert len(interrupted) == faults, result.describe()


@pytest.mark.timeout(120)
def test_retry_controller_limit_ends_every_rank_with_restart_abort(tmp_path):
    faults = [
        {"iteration": i, "rank": 1, "step": 1, "kind": "raise", "others": "allreduce"}
        for i in range(10)
    ]
    result = run_job("scenario.py", 3, tmp_path, spec(faults=faults, max_iterations=3), timeout=100)
    for rank in range(3):
        report = result.report(rank)
        assert result.ranks[rank].returncode != 0
        assert report["exception"] == "RestartAbort", result.describe()
        assert "iteration=3" in report["message"] and "max_iterations=3" in report["message"]
        starts = [e for e in report["events"] if e["kind"] == "start"]
        assert len(starts) == 3  # iterations 0, 1, 2 ran; iteration 3 was refused
    assert not result.leftovers


@pytest.mark.timeout(120)
def test_initialize_exception_restarts_and_base_exception_ends_the_rank(tmp_path):
    result = run_job(
        "scenario.py",
        3,
        tmp_path,
        spec(
            initialize_fails={
                "1": {"iterations": [0], "kind": "exception"},
                "2": {"iterations": [1], "kind": "base"},
            }
        ),
        timeout=100,
    )
    # iteration 0: rank 1's initialize raised -> restart; iteration 1: rank 2 gave up
    assert result.report(2)["exception"] == "RestartAbort"
    assert result.ranks[2].returncode != 0
    assert_completed(result, 3, iterations=2, alive=[0, 1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("callback", ["finalize_fails", "unhealthy", "abort_fails"])
def test_failing_callback_excludes_the_rank(tmp_path, callback):
    # the unhealthy rank is the one that raised: its HealthCheckError is caused by that
    faulty = 2 if callback == "unhealthy" else 0
    faults = [{"iteration": 0, "rank": faulty, "step": 2, "kind": "raise", "others": "allreduce"}]
    result = run_job(
        "scenario.py", 4, tmp_path, spec(faults=faults, **{callback: [2]}), timeout=100
    )
    assert result.ranks[2].returncode != 0
    expected = {
        "finalize_fails": "RuntimeError",
        "unhealthy": "HealthCheckError",
        "abort_fails": "RuntimeError",
    }[callback]
    assert result.report(2)["exception"] == expected, result.describe()
    assert_completed(result, 4, iterations=1, alive=[0, 1, 3])
    if callback == "unhealthy":
        assert result.report(2)["cause"] == "RuntimeError: injected fault", result.describe()
        # the health check ran after the fault on every rank, before the restart
        for rank in (0, 1, 3):
            checks = [e for e in result.report(rank)["events"] if e["kind"] == "health_check"]
            assert any(c["after_fault"] for c in checks)


@pytest.mark.timeout(120)
def test_guide_callbacks_health_check_at_start_and_none_returns(tmp_path):
    """Two points of the guide's callback contract, in one job:

    * a health check failing at the start of an iteration (before the function
      runs) is a fault of that iteration: every rank restarts, nobody leaves;
    * Initialize, Finalize and HealthCheck returning None (guide-era callbacks)
      are fine: their return values are ignored.
    """
    result = run_job(
        "scenario.py",
        2,
        tmp_path,
        spec(unhealthy_at_start={"1": [0]}, callbacks_return_none=True),
        timeout=100,
    )
    assert_completed(result, 2, iterations=1)
    events = [[e for e in result.report(rank)["events"]] for rank in range(2)]
    # rank 1's function never ran in iteration 0
    assert [e["iteration"] for e in events[1] if e["kind"] == "start"] == [1]
    for rank in range(2):  # the None-returning callbacks ran after the fault
        assert {"initialize", "finalize", "health_check"} <= {e["kind"] for e in events[rank]}
        assert any(e["kind"] == "health_check" and e["after_fault"] for e in events[rank])


@pytest.mark.timeout(120)
def test_failing_rank_assignment_excludes_the_rank(tmp_path):
    faults = [{"iteration": 0, "rank": 3, "step": 2, "kind": "raise", "others": "allreduce"}]
    result = run_job(
        "scenario.py", 4, tmp_path, spec(faults=faults, assignment_fails=[1]), timeout=100
    )
    assert result.report(1)["exception"] == "RuntimeError"
    assert_completed(result, 4, iterations=1, alive=[0, 2, 3])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("kind", "exception"), [("keyboard", "KeyboardInterrupt"), ("exit", "SystemExit")]
)
def test_keyboard_interrupt_and_system_exit_end_the_wrapper(tmp_path, kind, exception):
    faults = [{"iteration": 0, "rank": 1, "step": 2, "kind": kind, "others": "allreduce"}]
    result = run_job("scenario.py", 3, tmp_path, spec(faults=faults), timeout=100)
    assert result.report(1)["exception"] == exception
    assert result.ranks[1].returncode != 0
    # the others go on without it
    assert_completed(result, 3, iterations=1, alive=[0, 2])


@pytest.mark.timeout(180)
def test_consecutive_calls_of_the_wrapped_function(tmp_path):
    """A job calling the wrapped function again and again (a fault in each call)."""
    faults = [{"iteration": 0, "rank": 1, "step": 2, "kind": "raise", "others": "allreduce"}]
    result = run_job("scenario.py", 3, tmp_path, spec(faults=faults, calls=3), timeout=150)
    for rank in range(3):
        assert result.ranks[rank].returncode == 0, result.describe()
        calls = result.report(rank)["calls"]
        assert [c["iteration"] for c in calls] == [1, 1, 1]
        assert all(c["world"] == 3 and c["sum"] == 6 for c in calls)
    assert not result.leftovers
