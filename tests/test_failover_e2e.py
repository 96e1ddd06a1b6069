"""inprocess-run end to end: real controller, supervisor, store server and workers (issue 5)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest

from inprocess.failover.cli import _lock_dir
from inprocess.failover.state import Stage, load_state
from inprocess.failover.supervisor import job_processes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
RUN = [sys.executable, "-m", "inprocess.failover.cli"]
ENV = dict(
    os.environ,
    PYTHONWARNINGS="ignore:Failed to initialize NumPy",
    RES_OPTIONS="timeout:1 attempts:1",
    # tests/workers/chaos_train.py's detection timeouts x3: these jobs share 2
    # cores with the suite's other jobs, and a starved rank must not read as hung
    CHAOS_TIME_SCALE="3",
)


class Launch:
    """One ``inprocess-run`` job in ``tmp``; everything of it is killed at the end.
    With the launcher's default of a warm standby per node: the node's zygote
    then imports torch once for its store server, workers and standbys."""

    def __init__(self, tmp: Path, *flags: str, script: Path = TRAIN, script_args=(), env=None):
        self.state_dir = tmp / "state"
        self.out = tmp / "out"
        # examples/train.py ends at the next step, on every rank, once this file exists
        self.stop_file = tmp / "stop"
        if script == TRAIN:
            script_args = ["--stop-file", str(self.stop_file), *script_args]
        self.job_id = f"test-{os.getpid()}-{time.monotonic_ns()}"
        self.log = open(tmp / "launcher.log", "wb")
        self.proc = subprocess.Popen(
            [
                *RUN,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--state-dir",
                str(self.state_dir),
                "--job-id",
                self.job_id,
                "--monitor-interval",
                "0.05",
                *flags,
                str(script),
                "--result-dir",
                str(self.out),
                *script_args,
            ],
            env=ENV if env is None else env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in job_processes(self.job_id):
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.log.close()

    def state(self) -> dict:
        return json.loads((self.state_dir / "state.json").read_text())

    def events(self) -> list[dict]:
        path = self.out / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def wait_until(self, predicate, timeout=90.0, what="condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended before {what}:\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n{self.output()}")

    def full_size_since(self, since: float) -> bool:
        starts = [e for e in self.events() if e["kind"] == "start" and e["time"] > since]
        return len({e["rank"] for e in starts if e["world"] == 4}) == 4

    def stop(self) -> None:
        """Asks the training to end (at the same step on every rank)."""
        self.stop_file.touch()

    def step(self) -> int:
        try:
            return json.loads((self.out / "checkpoint.json").read_text())["step"]
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    def faults(self) -> list[dict]:
        return [e for e in self.events() if e["kind"] == "fault"]

    def wrapper_known(self) -> bool:
        """The controller knows the workers run under the Wrapper (a worker lost
        before that gets a cold restart of the job, not an in-process one)."""
        try:
            return self.state()["wrapper_managed"] is True
        except (FileNotFoundError, json.JSONDecodeError):
            return False

    def training_under_the_wrapper(self, step: int) -> bool:
        """At ``step``, and :meth:`wrapper_known`."""
        return self.running_at_step(step) and self.wrapper_known()

    def running_at_step(self, step: int) -> bool:
        try:
            return json.loads((self.out / "checkpoint.json").read_text())["step"] >= step
        except (FileNotFoundError, json.JSONDecodeError):
            return False

    def finish(self, timeout=180.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.flush()

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-8000:]


def check_clean_success(launch: Launch, steps: int | None, timeout: float = 180.0) -> None:
    """Exit 0, every rank finished at full size with every step applied exactly once.

    ``steps=None``: the job was stopped early (:meth:`Launch.stop`); the ranks agree
    on the step they ended at.
    """
    code = launch.finish(timeout)
    assert code == 0, launch.output()
    finishes = [e for e in launch.events() if e["kind"] == "finish"]
    assert sorted(e["rank"] for e in finishes) == [0, 1, 2, 3], launch.output()
    if steps is None:
        steps = finishes[0]["result"]["step"]
    for e in finishes:
        assert e["result"] == {"step": steps, "w": float(steps), "world": 4}
    check_after_run(launch)


def train_at_full_size_then_stop(launch: Launch, since: float, steps: int = 10) -> None:
    """Waits for all four ranks back at full size after ``since``, a few steps there, then stops."""
    launch.wait_until(lambda: launch.full_size_since(since), what="full size again")
    at = launch.step()
    launch.wait_until(lambda: launch.running_at_step(at + steps), what="training at full size")
    launch.stop()
    check_clean_success(launch, None)


def check_after_run(launch: Launch) -> None:
    state = load_state(launch.state_dir / "state.json")  # readable, versioned
    assert state.stage is Stage.STOPPED
    deadline = time.monotonic() + 10
    while job_processes(launch.job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not job_processes(launch.job_id), "a process of the job outlived it"
    code = launch.proc.poll()
    if code is not None and code >= 0:  # (a launcher killed by a signal leaves its lock file)
        lock = _lock_dir() / f"job-{launch.job_id}.lock"
        assert not lock.exists(), f"the job id's lock file {lock} outlived the launcher"


@pytest.mark.timeout(300)
def test_worker_sigkill_relaunch_and_rejoin(tmp_path):
    """Rank 1, then rank 0 (the rank that speaks for the job) of one job: each
    killed worker's survivors go on in-process, at world size 3 until its
    relaunched process rejoins them at full size (or at full size at once, when
    the relaunched process asked to join before their termination barrier
    decided: a relaunch from the template can take under a second, seen with
    a termination barrier that took 2 s). Rank 0 dies with its monitor process (as
    on a lost node, or by a signal to its process group): the controller, which
    saw the worker's exit, or the node group's leader (another worker's monitor
    process, which saw both exit), declares it terminated, whichever comes first,
    so the survivors need not wait for its heartbeats to time out."""
    victims = (1, 0)
    with Launch(tmp_path, script_args=["--steps", "100000", "--step-time", "0.03"]) as launch:
        launch.wait_until(lambda: launch.training_under_the_wrapper(20), what="training")
        for victim in victims:
            pid = launch.state()["workers"][str(victim)]["pid"]
            monitors = psutil.Process(pid).children() if victim == 0 else []
            for monitor in monitors:  # stopped first: it must not report the death
                monitor.send_signal(signal.SIGSTOP)
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            for monitor in monitors:
                with contextlib.suppress(psutil.NoSuchProcess):
                    monitor.kill()
            launch.wait_until(
                lambda since=killed_at: launch.full_size_since(since),
                what=f"full size again after rank {victim} was killed",
            )
            at = launch.step()
            launch.wait_until(lambda at=at: launch.running_at_step(at + 10), what="training")
        launch.stop()
        check_clean_success(launch, None)
        events = launch.events()
        assert sum(e["kind"] == "start" and e["world"] == 3 and e["rank"] == 2 for e in events) >= 1
        survivors = {r for r in range(4) if r not in victims}
        # The survivors' processes were never restarted (incarnation 0 all along),
        # but for the known gloo limitation (docs/known-limitations.md): a survivor
        # left in a gloo send that the abort does not fail, ended by the bounded unwind
        # and relaunched. That one must say so in the log; it is reported, not hidden.
        restarted = {e["rank"] for e in events if e["rank"] in survivors and e["incarnation"]}
        stuck = stuck_after_the_abort(launch, restarted)
        assert restarted == stuck, (
            [e for e in events if e["rank"] in survivors and e["incarnation"] != 0],
            launch.state()["events"],
        )
        for victim in victims:
            assert {e["incarnation"] for e in events if e["rank"] == victim} == {0, 1}
        log_text = Path(launch.log.name).read_text(errors="replace")
        assert re.search(
            r"root cause: rank 0/0\.\S+: terminated: (its process was killed by SIGKILL "
            r"\(seen by the job controller\)|process died with its monitor process "
            r"\(seen by node \S+\))",
            log_text,
        ), log_text
        state = launch.state()
        restarts = {r: state["worker_restarts"].get(str(r), 0) for r in range(4)}
        expected = {r: int(r in victims or r in stuck) for r in range(4)}
        assert restarts == expected, state["worker_restarts"]
        assert state["wrapper_managed"] is True


@pytest.mark.timeout(240)
def test_controller_sigkill_is_recovered(tmp_path):
    with Launch(tmp_path, script_args=["--steps", "100000", "--step-time", "0.03"]) as launch:
        launch.wait_until(lambda: launch.training_under_the_wrapper(20), what="training")
        first = int((launch.state_dir / "controller.pid").read_text())
        os.kill(first, signal.SIGKILL)
        launch.wait_until(
            lambda: int((launch.state_dir / "controller.pid").read_text()) != first,
            what="a new controller",
        )
        # workers kept training while the controller was down; then a worker dies
        time.sleep(1)
        killed_at = time.time()
        os.kill(launch.state()["workers"]["3"]["pid"], signal.SIGKILL)
        train_at_full_size_then_stop(launch, killed_at)
        state = launch.state()
        assert any(e["kind"] == "recover" for e in state["events"])
        # the lost worker's exit status was known although another controller started it
        assert any("SIGKILL" in e["message"] for e in state["events"]), state["events"]


def stuck_after_the_abort(launch: Launch, ranks) -> set[int]:
    """Which of ``ranks`` the bounded unwind ended as stuck in native code after the
    abort, per the launcher's log: the known gloo limitation of
    docs/known-limitations.md (a send the abort does not fail), seen in about one
    test of a suite run. Such a rank is relaunched like a killed one; tests accept
    it only when the log says so, and report it as a warning."""
    text = Path(launch.log.name).read_text(errors="replace")
    pattern = r"rank {}/\d+\.\S+: stuck in native code after the abort"
    stuck = {r for r in ranks if re.search(pattern.format(r), text)}
    if stuck:
        warnings.warn(
            f"rank(s) {sorted(stuck)} stuck in native code after the abort were relaunched "
            "(the known gloo limitation, docs/known-limitations.md)",
            stacklevel=2,
        )
    return stuck


@pytest.mark.timeout(300)
def test_failing_node_is_relaunched_on_a_spare_slot(tmp_path):
    with Launch(
        tmp_path,
        "--per-node-max-failures",
        "2",
        "--spare-nodes",
        "1",
        script_args=[
            "--steps",
            "100000",
            "--step-time",
            "0.03",
            "--crash-rank",
            "2",
            "--crash-times",
            "3",
            "--crash-step",
            "5",
        ],
    ) as launch:
        launch.wait_until(lambda: len(launch.faults()) == 3, timeout=180, what="three crashes")
        train_at_full_size_then_stop(launch, launch.faults()[-1]["time"])
        state = launch.state()
        assert state["node_relaunches"] == 1
        assert state["node_slots"]["1"] == 2  # node 1 (workers 2, 3) moved to the spare slot
        assert state["removed_slots"] == [1]
        assert state["workers"]["3"]["slot"] == 2 and state["workers"]["3"]["incarnation"] >= 1
        # the healthy worker moved with its node: that stop was not counted as its
        # failure (unless the bounded unwind ended it first: see stuck_after_the_abort)
        assert state["worker_restarts"]["3"] == len(stuck_after_the_abort(launch, [3]))
        assert state["worker_restarts"]["2"] == 3


def always_crashing(crash_step: int) -> list[str]:
    """``examples/train.py`` arguments: worker 1 crashes at every start, training never ends."""
    return [
        "--steps",
        "100000",
        "--crash-rank",
        "1",
        "--crash-times",
        "1000",
        "--crash-step",
        str(crash_step),
    ]


@pytest.mark.timeout(240)
def test_worker_that_always_crashes_stops_the_job(tmp_path):
    start = time.monotonic()
    with Launch(
        tmp_path,
        "--max-restarts",
        "2",
        script_args=always_crashing(crash_step=2),
    ) as launch:
        code = launch.finish(timeout=200)
        assert code != 0
        assert time.monotonic() - start < 200
        state = launch.state()
        assert state["stage"] == "STOPPED" and state["exit_code"] == code
        assert "max_restarts" in state["reason"] or "max-restarts" in state["reason"]
        assert state["worker_restarts"]["1"] == 3
        check_after_run(launch)
        assert "max" in launch.output()  # the reason is printed too


PLAIN = REPO / "tests" / "workers" / "plain_job.py"


@pytest.mark.timeout(240)
def test_job_without_wrapper_gets_a_cold_restart(tmp_path):
    with Launch(tmp_path, script=PLAIN, script_args=["--crash-rank", "2"]) as launch:
        code = launch.finish()
        assert code == 0, launch.output()
        state = launch.state()
        assert state["wrapper_managed"] is None
        assert state["job_restarts"] == 1 and state["generation"] == 1
        finishes = [e for e in launch.events() if e["kind"] == "finish"]
        assert sorted(e["rank"] for e in finishes) == [0, 1, 2, 3]
        assert all(e["generation"] == 1 for e in finishes)
        check_after_run(launch)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "0"], "--nnodes"),
        (["--nproc-per-node", "-1"], "--nproc-per-node"),
        (["--max-restarts", "-1"], "--max-restarts"),
        (["--per-node-max-failures", "0"], "--per-node-max-failures"),
        (["--job-id", "bad id!"], "--job-id"),
    ],
)
def test_bad_flags_are_clear_errors(tmp_path, flags, message):
    result = subprocess.run(
        [*RUN, *flags, "--state-dir", str(tmp_path / "s"), str(TRAIN)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr, result.stderr


def test_missing_script_and_reused_state_dir(tmp_path):
    result = subprocess.run(
        [*RUN, "--state-dir", str(tmp_path / "s"), str(tmp_path / "nope.py")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "SCRIPT" in result.stderr
    # a state dir that already holds a job is never taken over by a new one
    (tmp_path / "s").mkdir()
    from inprocess.failover import policy
    from inprocess.failover.spec import JobSpec
    from inprocess.failover.state import StateStore

    spec = JobSpec(
        job_id="old",
        entrypoint=("x.py",),
        nnodes=1,
        nproc_per_node=1,
        state_dir=str(tmp_path / "s"),
    )
    StateStore(tmp_path / "s").create(policy.new_job_state(spec, now=time.time()))
    before = (tmp_path / "s" / "state.json").read_bytes()
    result = subprocess.run(
        [*RUN, "--state-dir", str(tmp_path / "s"), str(TRAIN)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "old" in result.stderr, result.stderr
    assert (tmp_path / "s" / "state.json").read_bytes() == before


@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_job_cleanly(tmp_path):
    """SIGINT to the launcher's process group (a terminal's Ctrl-C) stops everything."""
    with Launch(tmp_path, script_args=["--steps", "100000", "--step-time", "0.03"]) as launch:
        launch.wait_until(lambda: launch.running_at_step(10), what="training")
        os.killpg(launch.proc.pid, signal.SIGINT)
        code = launch.finish(timeout=60)
        assert code == 130, launch.output()
        state = launch.state()
        assert state["stage"] == "STOPPED" and "SIGINT" in state["reason"]
        check_after_run(launch)
