"""The API's newest generation (issue 22): nested restarter, top-level State,
the newest fault injector's names, and its example scripts under torchrun."""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import re
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from launcher import MARKER, REPO, WORKERS, free_port, job_processes, machine_is_busy

import inprocess
from inprocess.generation import Generation, generation_of, wrapper_generation
from inprocess.nested_restarter import (
    NestedRestarterAborted,
    NestedRestarterFinalized,
    NestedRestarterHandlingCompleted,
    NestedRestarterHandlingStarting,
)
from inprocess.state import FrozenState, State
from inprocess.tools.inject_fault import Fault

ms = datetime.timedelta(milliseconds=1)
FAST = dict(
    monitor_thread_interval=20 * ms,
    monitor_process_interval=20 * ms,
    progress_watchdog_interval=20 * ms,
    last_call_wait=10 * ms,
)
LINE = re.compile(
    r"^\[[^]]+\] \[INFO\] \[InprocessRestarter@[^]]+\] active_rank=(\S+) "
    r"\[NestedRestarter\] name=\[InProcess\] state=(\w+)(?: stage=(\w+))?$"
)


def transitions(text: str) -> list[tuple[str, ...]]:
    found = []
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if m:
            found.append((m.group(2), m.group(3)) if m.group(3) else (m.group(2),))
    return found


# ---------------------------------------------------------------------- units


def test_state_is_at_the_top_level():
    assert inprocess.State is State
    assert "State" in inprocess.__all__ and "nested_restarter" in inprocess.__all__


def test_each_callback_writes_its_transition_on_the_special_rank_only():
    out = io.StringIO()
    state = State(rank=1, world_size=2)
    completed = NestedRestarterHandlingCompleted(special_rank=1, stream=out)
    starting = NestedRestarterHandlingStarting(special_rank=1, stream=out)
    finalized = NestedRestarterFinalized(special_rank=1, stream=out)
    aborted = NestedRestarterAborted(special_rank=1, stream=out)
    assert completed(state) is state
    # The abort runs in the monitor thread and again on the restart path: one line.
    restarted = State(rank=1, world_size=2, iteration=1)
    assert starting(restarted) is restarted and starting(restarted) is restarted
    completed(restarted)
    frozen = restarted.freeze()
    assert finalized(frozen) is frozen
    aborted(frozen)
    assert transitions(out.getvalue()) == [
        ("initialize",),
        ("handling", "starting"),
        ("handling", "completed"),
        ("finalized",),
        ("aborted",),
    ]
    assert "active_rank=1 [NestedRestarter]" in out.getvalue()

    other = io.StringIO()
    for cb in (NestedRestarterHandlingCompleted, NestedRestarterHandlingStarting):
        cb(special_rank=1, stream=other)(State(rank=0, world_size=2))
    assert other.getvalue() == ""


def test_callbacks_are_instances_of_their_kind_and_check_their_argument():
    assert isinstance(NestedRestarterHandlingCompleted(), inprocess.initialize.Initialize)
    assert isinstance(NestedRestarterHandlingStarting(), inprocess.abort.Abort)
    assert isinstance(NestedRestarterFinalized(), inprocess.completion.Completion)
    assert isinstance(NestedRestarterAborted(), inprocess.terminate.Terminate)
    for bad in (-1, "0", True, 1.0):
        with pytest.raises(ValueError, match="special_rank"):
            NestedRestarterFinalized(special_rank=bad)


def test_callbacks_compose_in_both_generations():
    out = io.StringIO()
    starting = NestedRestarterHandlingStarting(stream=out)
    composed = inprocess.Compose(inprocess.abort.AbortTorchDistributed(), starting)
    assert isinstance(composed, inprocess.abort.Abort)
    assert generation_of("abort", composed) is None
    assert generation_of("initialize", NestedRestarterHandlingCompleted()) is None
    assert generation_of("completion", NestedRestarterFinalized()) is None

    # The guide's generation: rank_filter and finalize(state, ex) beside them.
    class GuideFinalize(inprocess.finalize.Finalize):
        def __call__(self, state, train_ex):
            return state, train_ex

    guide = {
        "initialize": NestedRestarterHandlingCompleted(),
        "abort": composed,
        "finalize": GuideFinalize(),
        "rank_filter": inprocess.rank_filter.WorldSizeDivisibleBy(1),
        "completion": NestedRestarterFinalized(),
        "terminate": NestedRestarterAborted(),
    }
    assert wrapper_generation(guide) is Generation.GUIDE

    class NewerInitialize(inprocess.initialize.Initialize):
        def __call__(self, state: FrozenState) -> FrozenState:
            return state

    newer = {
        "initialize": inprocess.Compose(NestedRestarterHandlingCompleted(), NewerInitialize()),
        "abort": composed,
        "completion": NestedRestarterFinalized(),
    }
    assert wrapper_generation(newer) is Generation.NEWER
    # Chained with either generation's state, the composition hands it on unchanged.
    state = State(rank=0, world_size=1)
    assert composed(state) is state
    frozen = state.freeze()
    assert composed(frozen) is frozen
    assert transitions(out.getvalue()) == [("handling", "starting")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("generation", ["guide", "newer"])
def test_wrapper_writes_the_sequence_of_a_restart(single_rank, capfd, generation):
    class GuideFinalize(inprocess.finalize.Finalize):
        def __call__(self, state, train_ex):
            return state, train_ex

    class NewerFinalize(inprocess.finalize.Finalize):
        def __call__(self, state: FrozenState) -> FrozenState:
            return state

    wrapper = inprocess.Wrapper(
        initialize=NestedRestarterHandlingCompleted(),
        abort=inprocess.Compose(
            inprocess.abort.AbortTorchDistributed(), NestedRestarterHandlingStarting()
        ),
        finalize=GuideFinalize() if generation == "guide" else NewerFinalize(),
        completion=NestedRestarterFinalized(),
        terminate=NestedRestarterAborted(),
        **FAST,
    )

    def train(call_wrapper: inprocess.CallWrapper = None):
        if call_wrapper.iteration < 2:
            raise ValueError("fault")
        return call_wrapper.iteration

    assert wrapper(train)() == 2
    err = capfd.readouterr().err
    assert transitions(err) == [
        ("initialize",),
        ("handling", "starting"),
        ("handling", "completed"),
        ("handling", "starting"),
        ("handling", "completed"),
        ("finalized",),
    ], err

    wrapper = inprocess.Wrapper(
        initialize=inprocess.initialize.RetryController(max_iterations=1),
        terminate=NestedRestarterAborted(),
        **FAST,
    )
    with pytest.raises(inprocess.exception.RestartAbort):
        wrapper(train)()
    assert transitions(capfd.readouterr().err) == [("aborted",)]


def test_fault_names_of_the_newest_injector():
    pairs = {
        "GPU_ERROR": Fault.GPU,
        "OS_ABORT": Fault.ABORT,
        "LOCK_GIL": Fault.GIL,
        "SIGINT": Fault.INT,
        "SIGKILL": Fault.KILL,
        "SIGTERM": Fault.TERM,
        "SIGSTOP": Fault.STOP,
    }
    for name, member in pairs.items():
        assert Fault[name] is member
    assert Fault.WORKLOAD_EXC not in pairs.values()


@pytest.mark.timeout(60)
def test_workload_exception_is_raised_where_the_workload_asks(monkeypatch):
    from inprocess.tools import inject_fault as fi

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fi.maybe_raise_workload_exception()  # nothing fired: no exception
    injector = fi.inject_fault([Fault.WORKLOAD_EXC], 1, 1, 0.0, 0)
    assert injector is not None
    injector.join(10)
    with pytest.raises(fi.InjectedFault):
        fi.maybe_raise_workload_exception()
    fi.maybe_raise_workload_exception()  # raised once only
    injector = fi.inject_fault([Fault.WORKLOAD_EXC], 1, 1, 0.0, 0)
    injector.join(10)
    fi.clear_workload_exception()
    fi.maybe_raise_workload_exception()


# --------------------------------------------------------------------- torchrun


def run_example(tmp_path: Path, name: str, args: list[str]) -> tuple[str, list[float]]:
    """Runs the example script with :data:`RANKS` ranks under torchrun; (log, restart latencies)."""
    work = tmp_path / name
    work.mkdir()
    marker = uuid.uuid4().hex
    env = dict(
        os.environ,
        RES_OPTIONS="timeout:1 attempts:1",
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    env[MARKER] = marker
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS)]
    cmd += ["--master-port", str(free_port()), str(WORKERS / "newest_example.py")]
    cmd += ["--path", str(work), "--total-iterations", "200", *args]
    log = work / "torchrun.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        returncode = proc.wait(330)  # 3 torch imports and exits: minutes on a loaded machine
    finally:
        proc.kill()
        proc.wait()
        leftovers = job_processes(marker)
        for p in leftovers:
            with contextlib.suppress(psutil.Error):
                p.kill()
    text = log.read_text(errors="replace")
    assert returncode == 0, text[-6000:]
    assert not leftovers
    latencies = [float(x) for x in re.findall(r"restart latency: ([0-9.]+)s", text)]
    return text, latencies


#: ranks of each torchrun job: 2 in the suite (each rank's ``import torch`` is
#: the slow part), 4 with ``INPROCESS_NEWEST_RANKS=4`` (the issue's shape, and
#: the figures in benchmarks/README.md)
RANKS = int(os.environ.get("INPROCESS_NEWEST_RANKS", "2"))
if RANKS not in (2, 4):
    raise ValueError(f"INPROCESS_NEWEST_RANKS must be 2 or 4, got {RANKS}")
#: one torchrun job per shape; faults drawn with a fixed seed, chosen per rank
#: count, so that every job restarts 3-4 times (the draws depend on the seed,
#: rank, world size, checkpointed iteration and restart count only); one test
#: each, so that they spread over the test workers
_SEEDS = {2: {"basic": "4", "advanced": "13"}, 4: {"basic": "5", "advanced": "3"}}[RANKS]
NEWEST_EXAMPLES = {
    "basic": ["--shape", "basic", "--seed", _SEEDS["basic"], "--fault-prob", "0.005"],
    "advanced": ["--shape", "advanced", "--seed", _SEEDS["advanced"], "--fault-prob", "0.005"],
    "nested": [
        *("--shape", "advanced", "--nested-restarter"),
        *("--seed", _SEEDS["advanced"], "--fault-prob", "0.005"),
    ],
}


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", list(NEWEST_EXAMPLES))
def test_newest_examples_under_torchrun(tmp_path, name):
    text, latencies = run_example(tmp_path, name, NEWEST_EXAMPLES[name])
    assert latencies, f"{name}: no fault was injected\n{text[-3000:]}"
    figures = (len(latencies), statistics.median(latencies), max(latencies))
    print(f"\n{name} (faults, median restart s, worst s): {figures}")
    seen = transitions(text)
    if name != "nested":
        assert not seen
    else:
        # Rank 0 speaks for the job: initialize, then starting/completed for
        # every restart (faults of one iteration on several ranks are one
        # restart), then finalized.
        assert seen[0] == ("initialize",) and seen[-1] == ("finalized",), seen
        middle = seen[1:-1]
        restarts = len(middle) // 2
        assert middle == [("handling", "starting"), ("handling", "completed")] * restarts, seen
        assert 1 <= restarts <= len(latencies), (seen, latencies)
    # The target is 0.5 s (benchmarks/README.md has the figures); on a 2-core
    # machine loaded by other jobs the bound only tells a restart that waited
    # out a timeout (gloo's, the example's smallest: 10 s) from one that did not.
    bound = 5.0 if machine_is_busy() else 0.5
    assert figures[1] <= bound, (name, figures)


@pytest.mark.timeout(120)
def test_records_and_report_show_the_restarter_states_of_each_restart(
    single_rank, tmp_path, monkeypatch, capfd
):
    from inprocess import report
    from inprocess.nested_restarter import parse_line
    from inprocess.records import RECORDS_ENV

    path = tmp_path / "restarts.jsonl"
    monkeypatch.setenv(RECORDS_ENV, str(path))
    wrapper = inprocess.Wrapper(
        initialize=NestedRestarterHandlingCompleted(),
        abort=inprocess.Compose(
            inprocess.abort.AbortTorchDistributed(), NestedRestarterHandlingStarting()
        ),
        completion=NestedRestarterFinalized(),
        **FAST,
    )

    def train(call_wrapper: inprocess.CallWrapper = None):
        if call_wrapper.iteration < 2:
            raise ValueError("fault")

    wrapper(train)()
    lines = [parse_line(x) for x in capfd.readouterr().err.splitlines()]
    assert [(x["state"], x["stage"]) for x in lines if x][-1] == ("finalized", None)

    records = report.load([path])
    restarts = [r for r in records if r["type"] == "restart"]
    assert len(restarts) == 2
    for r in restarts:
        assert r["restarter"] == ["handling:starting", "handling:completed"], r
    summary = report.summarize(records)
    assert summary["restarter_states"] == [["handling:starting", "handling:completed"]] * 2
    text = report.format_summary(summary)
    assert re.search(
        r"restarter states +handling:starting -> handling:completed \(restarts 1, 2\)", text
    ), text
    summary["restarter_states"] = [["handling:starting", "handling:completed"]] * 5 + [[]]
    text = report.format_summary(summary)
    assert "handling:starting -> handling:completed (5 of 6 restarts)" in text, text
    assert re.search(r"restarter states +- \(restart 6\)", text), text
    assert parse_line("x active_rank=None [NestedRestarter] name=[InProcess] state=aborted") == {
        "active_rank": "None",
        "state": "aborted",
        "stage": None,
    }


# ------------------------------------------------------------- the rest of its surface


class Collect:
    def __init__(self):
        self.tstamps = []

    def send_timestamp(self, timestamp):
        self.tstamps.append(timestamp)


def wait_for(predicate, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


@pytest.mark.timeout(60)
def test_progress_watchdog_with_a_connection_pauses_resumes_and_shuts_down():
    import time

    from inprocess.progress_watchdog import ProgressWatchdog, Timestamp

    collect = Collect()
    start = time.monotonic()
    watchdog = inprocess.progress_watchdog.ProgressWatchdog(0, collect, 2 * ms)
    assert isinstance(watchdog, inprocess.progress_watchdog.ConnectionProgressWatchdog)
    assert not isinstance(watchdog, ProgressWatchdog)  # the Wrapper's own stays apart
    watchdog.start()
    wait_for(lambda: len(collect.tstamps) > 5)
    assert all(isinstance(t, Timestamp) and t.manual is None for t in collect.tstamps)
    assert all(t.auto > start for t in collect.tstamps)
    autos = [t.auto for t in collect.tstamps]
    assert autos == sorted(autos)

    watchdog.pause_and_synchronize()
    paused = len(collect.tstamps)
    time.sleep(0.05)
    assert len(collect.tstamps) == paused  # nothing sent while paused
    watchdog.resume()
    watchdog.resume()  # a second resume is harmless
    watchdog.ping()
    wait_for(lambda: len(collect.tstamps) > paused + 2)
    assert collect.tstamps[-1].manual is not None

    watchdog.shutdown()
    assert not watchdog.is_alive()
    ended = len(collect.tstamps)
    watchdog.shutdown()  # idempotent: no second last heartbeat
    time.sleep(0.02)
    assert len(collect.tstamps) == ended
    with pytest.raises(RuntimeError, match="after shutdown"):
        watchdog.resume()
    with pytest.raises(TypeError, match="send_timestamp"):
        inprocess.progress_watchdog.ConnectionProgressWatchdog(0, object(), 2 * ms)


@pytest.mark.timeout(60)
def test_progress_watchdog_heartbeats_after_resume_show_the_pause():
    import itertools
    import time

    collect = Collect()
    watchdog = inprocess.progress_watchdog.ProgressWatchdog(0, collect, 1 * ms)
    watchdog.start()
    try:
        wait_for(lambda: len(collect.tstamps) > 5)
        watchdog.pause_and_synchronize()
        paused_at, paused = time.monotonic(), len(collect.tstamps)
        wait_for(lambda: time.monotonic() - paused_at > 0.03)  # the main thread runs code
        assert len(collect.tstamps) == paused  # nothing sent while paused
        resumed_at = time.monotonic()
        watchdog.resume()
        wait_for(lambda: len(collect.tstamps) > paused + 3)
        autos = [t.auto for t in collect.tstamps[paused:]]
        gaps = [b - a for a, b in itertools.pairwise(autos)]
        # The first heartbeat after resume() carries the time last seen before
        # the pause; a later one a time after resume(): the gap spans the pause.
        assert autos[0] <= paused_at < resumed_at <= autos[-1]
        assert max(gaps) >= resumed_at - paused_at, gaps

        # auto stands still while the main thread runs no Python code.
        before = len(collect.tstamps)
        time.sleep(0.2)
        during = collect.tstamps[before : len(collect.tstamps)]
        assert len(during) > 3 and len({t.auto for t in during}) <= 2, during
    finally:
        watchdog.shutdown()


def test_tree_layers_can_be_modified_after_construction():
    from inprocess.rank_assignment import Layer, LayerFlag, Tree

    layers = [Layer(min_ranks=1, max_ranks=4, flag=LayerFlag.RESERVE), Layer(key_or_fn="node")]
    tree = Tree(layers)
    tree.layers[0].max_ranks = 2
    tree.layers[1].key_or_fn = lambda state: str(state.rank // 2)
    assert tree.layers[0].max_ranks == 2 and layers[0] is tree.layers[0]
    with pytest.raises(ValueError, match="min_ranks must be >= 1"):
        tree.layers[0].min_ranks = 0
    assert tree.layers[0].min_ranks == 1  # a rejected value leaves the layer as it was
    with pytest.raises(TypeError, match="flag"):
        tree.layers[1].flag = "reserve"


@pytest.mark.timeout(120)
def test_restart_abort_from_a_frozen_state_initialize_ends_the_wrapper(single_rank):
    calls = []

    class Stop(inprocess.initialize.Initialize):
        def __call__(self, state: FrozenState) -> FrozenState:
            calls.append(state.iteration)
            if state.iteration == 1:
                raise inprocess.exception.RestartAbort("enough")
            return state

    @inprocess.Wrapper(initialize=Stop(), **FAST)
    def train():
        raise ValueError("fault")

    with pytest.raises(inprocess.exception.RestartAbort, match="enough"):
        train()
    assert calls == [0, 1]


@pytest.mark.timeout(120)
def test_an_unannotated_initialize_may_change_the_state_kept_as_the_guides(single_rank):
    # The one documented deviation: without a FrozenState annotation an
    # initialize is the usage guide's, so assigning state.rank is allowed (the
    # newest generation would end the call with RestartAbort).
    seen = []

    class Guide(inprocess.initialize.Initialize):
        def __call__(self, state):
            state.rank = state.rank
            seen.append(type(state))
            return state

    @inprocess.Wrapper(initialize=Guide(), **FAST)
    def train():
        return "done"

    assert train() == "done"
    assert seen == [State]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_disable_hang_protection_is_a_context_manager_that_does_not_hang(single_rank):
    import time

    s = datetime.timedelta(seconds=1)
    calls = []

    # 4 s between the soft timeout's restart and the hard timeout's kill (of
    # this pytest worker): a loaded machine can delay the restart by seconds
    @inprocess.Wrapper(soft_timeout=2 * s, hard_timeout=6 * s, **FAST)
    def train(call_wrapper: inprocess.CallWrapper | None = None):
        calls.append(call_wrapper.iteration)
        if call_wrapper.iteration == 0:
            with call_wrapper.disable_hang_protection():
                time.sleep(6.5)  # past both timeouts: neither restarts nor kills
            with call_wrapper.disable_hang_protection():
                raise ValueError("a fault inside still restarts")
        if call_wrapper.iteration == 1:
            with call_wrapper.disable_hang_protection():
                pass
            time.sleep(4.0)  # protection is back on: the soft timeout restarts it
        return call_wrapper.iteration

    start = time.monotonic()
    assert train() == 2
    assert calls == [0, 1, 2]
    assert time.monotonic() - start < 30


@pytest.mark.timeout(120)
def test_monitor_process_names_the_watched_pid_target_pid(single_rank, tmp_path):
    logfile = tmp_path / "monitor_{rank}.log"

    @inprocess.Wrapper(monitor_process_logfile=str(logfile), **FAST)
    def train():
        return os.getpid()

    pid = train()
    text = (tmp_path / "monitor_0.log").read_text()
    assert f"target_pid={pid}" in text, text


def test_lines_through_a_restarter_logger_as_the_newest_tests_capture_them():
    import logging

    from inprocess.nested_restarter import NestedRestarterCallback, NestedRestarterLogger

    state = State(
        rank=0,
        world_size=2,
        active_rank=0,
        active_world_size=2,
        initial_rank=0,
        initial_world_size=2,
    ).freeze()
    capture = io.StringIO()
    handler = logging.StreamHandler(capture)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = NestedRestarterLogger()
    logger.restarter_logger.handlers = [handler]
    logger.restarter_logger.setLevel(logging.DEBUG)
    try:
        NestedRestarterCallback(restarter_state="initialize", logger=logger, special_rank=0)(state)
        NestedRestarterCallback(
            restarter_state="handling", restarter_stage="starting", logger=logger
        )(state)
        completed = NestedRestarterHandlingCompleted(special_rank=0)
        completed.logger = logger
        completed(state)
        completed(state)  # the second call: the restart's initialize
    finally:
        logger.restarter_logger.handlers = []
        logger.restarter_logger.setLevel(logging.NOTSET)
    found = re.findall(
        r"^.*NestedRestarter.*state=(\w+)(?:\s+stage=(\w+))?.*$", capture.getvalue(), re.M
    )
    assert found == [
        ("initialize", ""),
        ("handling", "starting"),
        ("initialize", ""),
        ("handling", "completed"),
    ]


@pytest.mark.timeout(120)
def test_wrapper_logging_as_the_newest_logging_tests_expect(single_rank):
    import logging

    root = logging.getLogger()
    saved = root.level, root.handlers[:]
    for handler in saved[1]:
        root.removeHandler(handler)

    @inprocess.Wrapper(**FAST)
    def fn():
        return

    try:
        with pytest.warns(UserWarning):  # nothing configured: the logs are off
            fn()
        assert logging.getLogger("inprocess.wrap").handlers == []
        first = io.StringIO()
        logging.basicConfig(level=logging.INFO, stream=first, force=True)
        fn()
        second = io.StringIO()
        logging.basicConfig(level=logging.INFO, stream=second, force=True)
        fn()
        # Each call logs the same at INFO (no leftovers of an earlier call).
        assert len(first.getvalue()) == len(second.getvalue()) > 0
        debug = io.StringIO()
        logging.basicConfig(level=logging.DEBUG, stream=debug, force=True)
        fn()
        assert len(debug.getvalue()) > len(second.getvalue())
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        root.setLevel(saved[0])
        for handler in saved[1]:
            root.addHandler(handler)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inprocess_run_reports_the_restarter_states_of_each_restart(tmp_path):
    # The nested-restarter shape under inprocess-run: its report shows the
    # in-process restarter's states for every restart.
    state_dir = tmp_path / "state"
    marker = uuid.uuid4().hex
    env = dict(
        os.environ,
        RES_OPTIONS="timeout:1 attempts:1",
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    env[MARKER] = marker
    cmd = [sys.executable, "-m", "inprocess.failover.cli", "--nproc-per-node", "2"]
    cmd += ["--state-dir", str(state_dir), "--quiet"]
    cmd += [str(WORKERS / "newest_example.py"), "--shape", "advanced", "--nested-restarter"]
    cmd += ["--seed", "10", "--fault-prob", "0.01", "--total-iterations", "80"]  # 3 faults
    cmd += ["--path", str(tmp_path)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    finally:
        for p in job_processes(marker):
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    from inprocess import report

    records = report.load([state_dir])
    restarts = [r for r in records if r["type"] == "restart"]
    assert restarts, "no fault was injected"
    for r in restarts:
        assert r["restarter"] == ["handling:starting", "handling:completed"], r
    shown = subprocess.run(
        [sys.executable, "-m", "inprocess.failover.cli", "report", str(state_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    n = len(restarts)
    assert f"handling:starting -> handling:completed ({n} of {n} restarts)" in shown.stdout or (
        n <= 3 and "handling:starting -> handling:completed (restart" in shown.stdout
    ), shown.stdout


class Count(logging.Handler):
    """Counts the records it receives."""

    def __init__(self) -> None:
        super().__init__(level=0)
        self.records: list = []

    def emit(self, record) -> None:
        self.records.append(record)


@pytest.mark.timeout(120)
def test_nvrx_logger_sees_the_wrappers_records_and_the_pidfile_outlives_the_call(
    single_rank, tmp_path
):
    import logging

    nvrx, root = logging.getLogger("nvrx"), logging.getLogger()
    ours = logging.getLogger("inprocess")
    saved = nvrx.level, root.level, root.handlers[:]
    for handler in saved[2]:
        root.removeHandler(handler)
    pidfile = tmp_path / "monitor.pid"  # no {rank}
    pids: list[int] = []

    @inprocess.Wrapper(monitor_process_pidfile=str(pidfile), **FAST)
    def fn():
        pids.append(int(pidfile.read_text()))

    on_nvrx, on_root, on_ours, second = Count(), Count(), Count(), Count()
    try:
        nvrx.setLevel(logging.DEBUG)
        nvrx.addHandler(on_nvrx)
        fn()
        assert on_nvrx.records, "a handler on nvrx got none of the Wrapper's records"
        assert any(r.levelno == logging.DEBUG for r in on_nvrx.records)
        assert all(r.name.startswith("inprocess") for r in on_nvrx.records)
        # The pidfile outlives the call, holding the call's monitor process's pid.
        assert pidfile.read_text().strip() == str(pids[-1])
        nvrx.removeHandler(on_nvrx)

        # A new handler for a second call gets as many (nothing duplicated), and
        # with handlers on inprocess, nvrx and root each sees every record once.
        nvrx.addHandler(second)
        ours.addHandler(on_ours)
        root.addHandler(on_root)
        fn()
        assert len(second.records) == len(on_nvrx.records)
        assert len(on_ours.records) == len(on_root.records) == len(second.records)
        assert len({id(r) for r in on_root.records}) == len(on_root.records)
        assert pidfile.read_text().strip() == str(pids[-1])
        assert not root.handlers[1:]  # the library added no handler to root
    finally:
        for logger, handler in ((nvrx, on_nvrx), (nvrx, second), (ours, on_ours), (root, on_root)):
            logger.removeHandler(handler)
        nvrx.setLevel(saved[0])
        root.setLevel(saved[1])
        for handler in saved[2]:
            root.addHandler(handler)
