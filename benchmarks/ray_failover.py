"""Time back to full world size after a worker loss and a node loss: Ray backend vs local.

For each backend and trial, one ``inprocess-run`` job of 2 nodes x 2 workers
(+1 spare node) runs ``examples/train.py`` under the Wrapper, and two faults
are injected in turn once it trains:

* worker loss: SIGKILL of worker 1;
* node loss: on Ray, ``cluster.remove_node`` of the Ray node of job node 1
  (workers 2 and 3), relaunched on the spare node; on the local backend,
  which has no machines to lose, SIGKILL of both workers of node 1 at once.

Measured: from the fault to the moment every rank has (re)entered the
training function at world size 4 again (the ``start`` events the script
writes). Then Ctrl-C ends the job. The Ray cluster is a
``ray.cluster_utils.Cluster`` on this machine (a head node without CPUs and
three one-CPU nodes) at Ray's default health-check settings (the job sees a
node loss through its agents' heartbeat links, not Ray's); a removed node is
replaced before the next trial.

    .venv/bin/python benchmarks/ray_failover.py --trials 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inprocess.tools.ray_cluster import cluster_node

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
ENV = dict(
    os.environ,
    PYTHONWARNINGS="ignore:Failed to initialize NumPy",
    RES_OPTIONS="timeout:1 attempts:1",
)


class Job:
    def __init__(self, tmp: Path, backend_flags: list[str]) -> None:
        self.state_dir, self.out = tmp / "state", tmp / "out"
        self.log = open(tmp / "launcher.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inprocess.failover.cli",
                *backend_flags,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--spare-nodes",
                "1",
                "--state-dir",
                str(self.state_dir),
                "--monitor-interval",
                "0.05",
                str(TRAIN),
                "--result-dir",
                str(self.out),
                "--steps",
                "1000000",
                "--step-time",
                "0.02",
            ],
            env=ENV,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def state(self) -> dict:
        return json.loads((self.state_dir / "state.json").read_text())

    def starts(self, since: float) -> dict[int, float]:
        """rank -> time of its first start at world size 4 after ``since``."""
        path = self.out / "events.jsonl"
        first: dict[int, float] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                e = json.loads(line)
                if e["kind"] == "start" and e["world"] == 4 and e["time"] > since:
                    first.setdefault(e["rank"], e["time"])
        return first

    def step(self) -> int:
        try:
            return json.loads((self.out / "checkpoint.json").read_text())["step"]
        except (FileNotFoundError, json.JSONDecodeError):
            return -1

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended before {what} (see {self.log.name})")
            time.sleep(0.02)
        raise RuntimeError(f"timed out waiting for {what} (see {self.log.name})")

    def full_size_after(self, fault) -> float:
        """Injects ``fault`` and returns the seconds until all 4 ranks run at world size 4."""
        progress = self.step()
        self.wait(lambda: self.step() >= progress + 10, 120, "progress")
        t0 = self.faulted_at = time.time()
        fault()
        self.wait(lambda: len(self.starts(t0)) == 4, 180, "full world size")
        return max(self.starts(t0).values()) - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def trial(backend: str, cluster, tmp: Path) -> dict[str, float]:
    flags = ["--backend", backend]
    if backend == "ray":
        flags += ["--ray-address", cluster.address]
    job = Job(tmp, flags)
    try:
        job.wait(lambda: job.step() >= 10, 180, "training")

        def local_pid(pid: int) -> int:
            if backend == "ray":  # slot-qualified in state.json
                from inprocess.failover.backends.ray import split_worker_pid

                return split_worker_pid(pid)[1]
            return pid

        worker = job.full_size_after(
            lambda: os.kill(local_pid(job.state()["workers"]["1"]["pid"]), signal.SIGKILL)
        )

        def node_loss() -> None:
            if backend == "ray":
                nodes = json.loads((job.state_dir / "ray_nodes.json").read_text())
                victim = cluster_node(cluster, nodes[str(job.state()["node_slots"]["1"])])
                cluster.remove_node(victim)
            else:
                workers = job.state()["workers"]
                for w in ("2", "3"):
                    os.kill(local_pid(workers[w]["pid"]), signal.SIGKILL)

        node = job.full_size_after(node_loss)
        # when the controller declared the node lost (its clock is this machine's)
        lost = [e["time"] for e in job.state()["events"] if e["kind"] == "node_lost"]
        seen = lost[-1] - job.faulted_at if lost else float("nan")
        return {"worker_loss_s": worker, "node_loss_s": node, "node_lost_seen_s": seen}
    finally:
        job.stop()


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/ray_failover.json")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
        },
    )
    results: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1)
        for i in range(args.trials):
            for backend in ("local", "ray"):
                with tempfile.TemporaryDirectory() as tmp:
                    r = trial(backend, cluster, Path(tmp))
                print(f"trial {i} {backend}: {r}", flush=True)
                results[backend].append(r)
            while len(cluster.worker_nodes) < 3:  # replace the removed node
                cluster.add_node(num_cpus=1)
    finally:
        cluster.shutdown()
    print("\n| backend | worker loss -> full size | node loss -> full size | node loss -> seen |")
    print("|---|---:|---:|---:|")
    for backend, rows in results.items():
        w = summary([r["worker_loss_s"] for r in rows])
        n = summary([r["node_loss_s"] for r in rows])
        seen = [r["node_lost_seen_s"] for r in rows if not math.isnan(r["node_lost_seen_s"])]
        print(f"| {backend} | {w} | {n} | {summary(seen) if seen else '-'} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
