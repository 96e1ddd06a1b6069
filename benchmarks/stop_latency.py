"""How long a stop request takes in the middle of a large launch (issue 25).

``inprocess-run --nnodes 1 --nproc-per-node N --standby 0`` starts N workers
(N: 60, or what the machine holds) of a script that marks its start and
sleeps. As soon as the first worker has marked its start, this sends SIGTERM to
the launcher and times it until the launcher has exited, then checks that no
process of the job is left. Several runs, one after the other; the load
average is printed beside each.

    .venv/bin/python benchmarks/stop_latency.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inprocess.failover import cli
from inprocess.failover.supervisor import job_processes

SLEEPER = """
import os, sys, time
marks = sys.argv[1]
open(os.path.join(marks, "rank" + os.environ["RANK"]), "w").close()
time.sleep(300)
"""


def one_run(work: Path, workers: int) -> dict:
    marks = work / "marks"
    marks.mkdir(parents=True)
    script = work / "sleeper.py"
    script.write_text(SLEEPER)
    job_id = f"stop-latency-{os.getpid()}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "inprocess.failover.cli", "--nnodes", "1"]
    argv += ["--nproc-per-node", str(workers), "--standby", "0", "--job-id", job_id]
    argv += ["--state-dir", str(work / "state"), str(script), str(marks)]
    with open(work / "launcher.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not any(marks.iterdir()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no worker started: {(work / 'launcher.log').read_text()}")
                time.sleep(0.02)
            load = os.getloadavg()[0]
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            code = proc.wait(60)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    left = job_processes(job_id)
    for p in left:
        p.kill()
    return {
        "stop_s": round(took, 3),
        "exit_code": code,
        "workers_started": sum(1 for _ in marks.iterdir()),
        "workers": workers,
        "left": len(left),
        "load": round(load, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=60)
    args = parser.parse_args()
    workers = min(args.workers, cli.local_capacity())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            result = one_run(Path(tmp) / str(run), workers)
            results.append(result)
            print(json.dumps(result), flush=True)
    stops = [r["stop_s"] for r in results]
    ok = all(r["exit_code"] == 128 + signal.SIGTERM and r["left"] == 0 for r in results)
    print(
        f"SIGTERM mid-launch of {workers} workers to the launcher's exit, {len(stops)} runs: "
        f"median {statistics.median(stops):.2f} s, max {max(stops):.2f} s; "
        f"every run exit 143 with nothing left: {ok}"
    )


if __name__ == "__main__":
    main()
