"""A job of 3 machines and a hot spare under a real Slurm (tests/slurm_cluster.py),
started with ``sbatch examples/slurm/train.sbatch`` exactly as the docs tell users
(one ``inprocess-run`` per node through ``srun``; the launchers read the job's
shape from Slurm), surviving a worker's SIGKILL, a machine's loss (its launcher
and workers killed together: the spare takes over) and the controller's SIGKILL:
the job ends with exit code 0, exactly the requested steps, 0 steps redone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from inprocess.failover.node_workers import split_worker_pid

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SBATCH_EXAMPLE = REPO / "examples" / "slurm" / "train.sbatch"
STEPS = 900


def _events(path: Path) -> list[dict]:
    found = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


class SlurmJob:
    def __init__(self, cluster, tmp: Path) -> None:
        self.cluster = cluster
        self.tmp = tmp
        self.results = tmp / "results"
        self.state_dir = tmp / "state"
        self.output = tmp / "job.out"
        self.job_id: str | None = None

    def submit(self) -> None:
        env = dict(
            self.cluster.env,
            PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            PYTHONPATH=str(REPO),
            RES_OPTIONS="timeout:1 attempts:1",
            RESULTS=str(self.results),
            NPROC_PER_NODE="1",
            LAUNCH_ARGS=f"--nnodes 3:4 --state-dir {self.state_dir} --rdzv-timeout 300",
        )
        out = self.cluster.run(
            ["sbatch", "--parsable", "--nodes=4", f"--output={self.output}", f"--chdir={REPO}",
             str(SBATCH_EXAMPLE), "--steps", str(STEPS), "--step-time", "0.05"],
            env=env, cwd=REPO,
        )  # fmt: skip
        self.job_id = out.stdout.strip().split(";")[0]

    def state(self) -> dict:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.state_dir / "state.json").read_text())
        return {}

    def progress(self) -> int:
        steps = [
            e["step"] for e in _events(self.results / "events.jsonl") if e["kind"] == "progress"
        ]
        return max(steps, default=-1)

    def running(self) -> bool:
        return self.job_id in self.cluster.jobs()

    def wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            assert self.running() or condition(), self.describe(f"the job ended before {what}")
            time.sleep(0.2)
        raise AssertionError(self.describe(f"no {what} within {timeout}s"))

    def describe(self, what: str) -> str:
        output = self.output.read_text(errors="replace") if self.output.exists() else ""
        events = self.state_dir / "events.jsonl"
        tail = events.read_text()[-3000:] if events.exists() else ""
        return f"{what}\n--- job output\n{output[-6000:]}\n--- controller events\n{tail}"

    def worker_pid(self, worker: int) -> int:
        return split_worker_pid(self.state()["workers"][str(worker)]["pid"])[1]

    def full_size_since(self, since: float) -> bool:
        """Every rank started training at full size after ``since``."""
        starts = [
            e for e in _events(self.results / "events.jsonl")
            if e["kind"] == "start" and e["time"] > since and e["world"] == 3
        ]  # fmt: skip
        return len({e["rank"] for e in starts}) == 3


def _agent_of(pid: int) -> psutil.Process:
    """The node agent (``inprocess-run`` of that machine) above worker ``pid``."""
    process = psutil.Process(pid)
    while process is not None:
        if "node agent" in " ".join(process.cmdline()):
            return process
        process = process.parent()
    raise AssertionError(f"no node agent above process {pid}")


@pytest.mark.timeout(900)
def test_a_3_plus_1_machine_srun_job_survives_worker_kill_machine_loss_and_controller_kill(
    slurm_cluster, tmp_path
):
    job = SlurmJob(slurm_cluster, tmp_path)
    job.submit()
    try:
        job.wait(lambda: job.progress() >= 30, 400, "training")
        state = job.state()
        assert state["spec"]["nnodes"] == 3 and state["spec"]["spare_nodes"] == 1
        # 1. a worker's SIGKILL (node 1's): relaunched on its machine
        killed_at = time.time()
        os.kill(job.worker_pid(1), signal.SIGKILL)
        job.wait(lambda: job.state()["worker_restarts"]["1"] == 1, 60, "the worker's relaunch")
        job.wait(lambda: job.full_size_since(killed_at), 120, "full size after the kill")
        # 2. a machine's loss: node 2's launcher and its workers, killed together
        agent = _agent_of(job.worker_pid(2))
        machine = [agent, *agent.children(recursive=True)]  # workers, standby, zygote
        lost_at = time.time()
        for process in machine:  # every process of the machine at once
            with contextlib.suppress(psutil.Error):
                process.kill()
        job.wait(lambda: job.state()["node_relaunches"] == 1, 60, "the node's relaunch")
        job.wait(lambda: job.full_size_since(lost_at), 120, "full size on the spare")
        assert job.state()["node_slots"]["2"] == 3  # on the spare machine's slot
        # 3. the controller's SIGKILL: a new one recovers the job from its state
        first = int((job.state_dir / "controller.pid").read_text())
        os.kill(first, signal.SIGKILL)
        job.wait(
            lambda: any(e["kind"] == "recover" for e in job.state().get("events", [])),
            60,
            "the controller's recovery",
        )
        step = job.progress()
        job.wait(lambda: job.progress() >= step + 20, 120, "training after the recovery")
        job.wait(lambda: not job.running(), 400, "the job's end")
    finally:
        if job.job_id and job.running():
            slurm_cluster.run(["scancel", job.job_id], check=False)
    state = job.state()
    assert state["stage"] == "STOPPED" and state["exit_code"] == 0, job.describe("not a success")
    assert state["worker_restarts"] == {"0": 0, "1": 1, "2": 0}, state["worker_restarts"]
    events = _events(job.results / "events.jsonl")
    finishes = [e for e in events if e["kind"] == "finish"]
    assert sorted(e["rank"] for e in finishes) == [0, 1, 2], job.describe("ranks missing")
    for finish in finishes:
        assert finish["result"]["step"] == STEPS and finish["result"]["w"] == STEPS, finish
    restores = [e["restore"] for e in events if e["kind"] == "start" and e.get("restore")]
    assert len(restores) > 3  # (the first start, and one per fault and survivor)
    assert all(r["redone_steps"] == 0 for r in restores), restores
    # every launcher is done: nothing of the job is left on any machine
    assert not [p for p in slurm_cluster.processes() if "train_state" in " ".join(p.cmdline())]


@pytest.mark.timeout(600)
def test_a_wrapper_script_started_by_srun_directly_takes_its_ranks_from_slurm(slurm_cluster):
    """No launcher: ``srun -N2 --ntasks-per-node=2 python script``; the Wrapper fills
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from Slurm, and restarts
    in-process after a rank's exception."""
    env = dict(
        slurm_cluster.env,
        PYTHONPATH=str(REPO),
        RES_OPTIONS="timeout:1 attempts:1",
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
    )
    script = REPO / "tests" / "workers" / "srun_direct.py"
    result = slurm_cluster.run(
        ["srun", "-N2", "--ntasks-per-node=2", sys.executable, str(script)],
        env=env, cwd=REPO, timeout=540, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    lines = sorted(x for x in result.stdout.splitlines() if x.startswith("task "))
    assert len(lines) == 4, result.stdout + result.stderr[-3000:]
    for task, line in enumerate(lines):
        words = line.split()
        assert words[1] == str(task) and words[3] == str(task) and words[5] == "4", line
        assert words[7] == str(task % 2), line  # local rank: 2 tasks per node
        assert words[9].startswith("n1:"), line  # the step's first node hosts the store
        assert words[11] == "4" and words[13] == "1", line  # all 4 back after one restart
