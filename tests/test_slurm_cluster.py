"""The tests' Slurm cluster (tests/slurm_cluster.py) does what multi-machine launches
rely on: ``srun`` runs one task per node with Slurm's variables, ``scancel``
delivers SIGTERM to every task; and the Slurm and Kubernetes examples parse."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import slurm_cluster as harness

REPO = Path(__file__).resolve().parent.parent
SBATCH_EXAMPLE = REPO / "examples" / "slurm" / "train.sbatch"
K8S_EXAMPLE = REPO / "examples" / "kubernetes" / "pytorchjob.yaml"

pytestmark = pytest.mark.timeout(180)

#: a task that reports its node, then waits for SIGTERM and records it
TERM_TASK = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
node = os.environ["SLURMD_NODENAME"]
def on_term(signum, frame):
    (out / f"term-{node}").write_text(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
(out / f"ready-{node}").write_text(os.environ["SLURM_JOB_ID"])
while True:
    signal.pause()
"""


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s"
        time.sleep(0.1)


def name(process: psutil.Process) -> str | None:
    try:
        return process.name()
    except psutil.Error:  # gone since it was listed
        return None


def test_nodes_are_idle_with_their_cpus(slurm_cluster):
    out = slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %t %c"])
    rows = sorted(line.split() for line in out.stdout.splitlines())
    assert rows == [[f"n{i}", "idle", str(harness.DEFAULT_CPUS)] for i in range(1, 6)]


def test_srun_runs_one_task_per_node(slurm_cluster):
    script = "echo $SLURM_NODEID $SLURMD_NODENAME $SLURM_NNODES $SLURM_PROCID $SLURM_JOB_NODELIST"
    out = slurm_cluster.run(["srun", "-N4", "--ntasks-per-node=1", "bash", "-c", script])
    rows = sorted(line.split() for line in out.stdout.splitlines())
    assert [r[0] for r in rows] == ["0", "1", "2", "3"], out.stdout
    names = [r[1] for r in rows]
    assert len(set(names)) == 4 and set(names) <= set(slurm_cluster.node_names), out.stdout
    assert {r[2] for r in rows} == {"4"}
    assert sorted(r[3] for r in rows) == ["0", "1", "2", "3"]
    # a node list Slurm's way, e.g. n[1-4]: what the launcher parses for its coordinator
    assert len({r[4] for r in rows}) == 1 and rows[0][4].startswith("n"), out.stdout


def test_scancel_sends_sigterm_to_every_task(slurm_cluster, tmp_path):
    (tmp_path / "task.py").write_text(TERM_TASK)
    batch = tmp_path / "job.sbatch"
    batch.write_text(
        "#!/bin/bash\n"
        f"#SBATCH -N2 --ntasks-per-node=1 -o {tmp_path}/slurm-%j.out\n"
        f"srun {sys.executable} {tmp_path}/task.py {tmp_path}\n"
    )
    job = slurm_cluster.run(["sbatch", "--parsable", str(batch)]).stdout.strip().split(";")[0]
    try:
        wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 2, 60, "2 running tasks")
        assert {p.read_text() for p in tmp_path.glob("ready-*")} == {job}
        cancelled = time.time()
        slurm_cluster.run(["scancel", job])
        # SIGTERM, not the SIGKILL that follows KillWait (30 s) later: the task
        # records it and exits
        wait_until(lambda: len(list(tmp_path.glob("term-*"))) == 2, 25, "SIGTERM on both nodes")
        assert all(float(p.read_text()) >= cancelled for p in tmp_path.glob("term-*"))
        wait_until(lambda: job not in slurm_cluster.jobs(), 60, f"end of job {job}")
    finally:
        slurm_cluster.run(["scancel", job], check=False)


def test_stop_ends_jobs_daemons_and_tasks(tmp_path):
    """A cluster of its own, stopped with a job still running: nothing of it is
    left (its stop raises on a process it had to kill)."""
    reason = harness.unavailable()
    if reason is not None:
        pytest.skip(reason)
    cluster = harness.SlurmCluster(nodes=2, cpus=2)
    with cluster:
        daemons = cluster.daemon_pids
        job = cluster.run(
            [
                "sbatch",
                "--parsable",
                "-N2",
                f"--output={tmp_path}/%j.out",
                "--wrap",
                "srun sleep 600",
            ]
        ).stdout.strip()
        wait_until(
            lambda: "R" in cluster.run(["squeue", "-h", "-j", job, "-o", "%t"]).stdout,
            60,
            "a running job",
        )
        # the tasks (2 sleeps) carry the cluster's marker: they are its processes too
        wait_until(
            lambda: sum(name(p) == "sleep" for p in cluster.processes()) == 2, 30, "both tasks"
        )
    assert not cluster.processes()
    assert not any(psutil.pid_exists(pid) for pid in daemons)
    assert not cluster.dir.exists()


def test_sbatch_example_is_accepted(slurm_cluster):
    """The example's directives parse (``--test-only``: nothing runs) with the
    cluster's 4 nodes, and its shell is valid."""
    subprocess.run(["bash", "-n", str(SBATCH_EXAMPLE)], check=True)
    text = SBATCH_EXAMPLE.read_text()
    assert "#SBATCH --signal=USR1@60" in text
    assert "export INPROCESS_JOB_SECRET" in text
    assert "srun " in text and "inprocess-run --nproc-per-node" in text
    out = slurm_cluster.run(["sbatch", "--test-only", str(SBATCH_EXAMPLE)], cwd=REPO)
    assert "to start at" in out.stderr, out.stderr


def test_kubernetes_example_parses():
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all(K8S_EXAMPLE.read_text()) if d is not None]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Service", "PyTorchJob"}
    assert kinds["Service"]["spec"]["clusterIP"] == "None"
    replicas = kinds["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]
    for spec in replicas.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["command"][:3] == ["inprocess-run", "--nproc-per-node", "2"]
        env = {e["name"]: e for e in container["env"]}
        assert "secretKeyRef" in env["INPROCESS_JOB_SECRET"]["valueFrom"]
