"""Detection latency of every fault kind: from the fault to the survivors' next iteration.

Four ranks train under the Wrapper (gloo, CPU); rank 2 fails while the others
are inside all_reduce. For each kind of fault the figure is the time from the
fault to the moment the last survivor is back in the function with a new
process group and one all_reduce done, next to the bound it must stay under.

    python benchmarks/detection_latency.py [--repeat 3]

Runs the test suite's configurable worker (tests/workers/scenario.py) with
:mod:`inprocess.tools.local_job`; ``tests/test_hangs.py`` uses the settings below.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from inprocess.tools.local_job import Job

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "tests" / "workers" / "scenario.py"

# The Wrapper's settings here and in the hang tests (tests/test_hangs.py), so
# the figures measure what the tests check.
SOFT, HARD, GRACE, HEARTBEAT = 3.0, 6.0, 1.0, 4.0
TIMED = {
    "monitor_thread_interval": 0.05,
    "monitor_process_interval": 0.05,
    "progress_watchdog_interval": 0.05,
    "soft_timeout": SOFT,
    "hard_timeout": HARD,
    "heartbeat_timeout": HEARTBEAT,
    "barrier_timeout": 60,
    "completion_timeout": 60,
    "last_call_wait": 0.05,
    "termination_grace_time": GRACE,
}
WRAPPER = TIMED
VICTIM, WORLD = 2, 4

# label -> (how it is injected, the bound it must stay under)
KINDS = {
    "exception": ("raise", 1.5),
    "hang, GIL released (time.sleep)": ("sleep", SOFT + 1.5),
    "hang, GIL released (socket read)": ("socket", SOFT + 1.5),
    "hang, GIL held": ("gil", HARD + GRACE + 1.5),
    "busy loop, manual ping timeout": ("busy", SOFT + 1.5),
    "SIGKILL (self)": ("kill", 1.5),
    "segfault": ("segfault", 1.5),
    "SIGKILL from outside": ("external-kill", 1.5),
    "SIGSTOP from outside": ("external-stop", HARD + GRACE + 1.5),
    # seen by the node's leader (another rank's monitor process) through pidfds
    "process and monitor lost": ("external-both", 1.5),
    # two simulated nodes of two ranks, the second lost whole: the first's leader
    # beats and checks every quarter of the timeout (the default heartbeat_interval)
    "node lost (ranks 2, 3 and their monitors)": ("external-node", HEARTBEAT * 1.5 + 1.5),
}
#: the ranks each kind loses for good (the victim by default)
LOST = {"external-node": (2, 3)}
#: faults after which the victim is brought back in-process rather than lost
RECOVERED_IN_PROCESS = {"raise", "sleep", "socket", "busy"}


def ready_times(job: Job, iteration: int) -> list[float]:
    times = []
    for rank in range(WORLD):
        path = job.workdir / f"report{rank}.json"
        if not path.exists():
            continue
        events = json.loads(path.read_text())["events"]
        times += [e["time"] for e in events if e["kind"] == "ready" and e["iteration"] == iteration]
    return times


def inject_from_outside(job: Job, how: str) -> float:
    deadline = time.monotonic() + 60
    while not all((job.workdir / f"started{r}_0").exists() for r in range(WORLD)):
        if time.monotonic() > deadline:
            raise RuntimeError("ranks did not start")
        time.sleep(0.01)
    time.sleep(0.3)  # everyone is inside all_reduce steps now
    procs = [psutil.Process(job.pid(r)) for r in LOST.get(how, (VICTIM,))]
    proc = procs[0]
    fault_time = time.monotonic()
    if how == "external-kill":
        proc.kill()
    elif how == "external-stop":
        proc.send_signal(signal.SIGSTOP)
    else:  # the ranks and their monitor processes at once: nobody reports
        victims = [v for p in procs for v in (p, *p.children(recursive=True))]
        for p in victims:
            p.send_signal(signal.SIGSTOP)
        for p in victims:
            p.kill()
    return fault_time


def measure(how: str, workdir: Path) -> float:
    spec: dict = {"wrapper": WRAPPER, "steps": 8, "steps_after_restart": 4}
    if how.startswith("external"):
        spec["steps"] = 100000
        if how == "external-node":
            spec["ranks_per_node"] = 2  # simulated nodes (INPROCESS_NODE) of two ranks
    else:
        spec["faults"] = [
            {"iteration": 0, "rank": VICTIM, "step": 3, "kind": how, "others": "allreduce"}
        ]
        spec["ping"] = how == "busy"
    with Job(SCENARIO, WORLD, workdir, spec, pythonpath=REPO) as job:
        fault_time = inject_from_outside(job, how) if how.startswith("external") else None
        result = job.wait(120)
    if fault_time is None:
        fault_time = json.loads((workdir / f"fault{VICTIM}.json").read_text())["time"]
    ready = ready_times(job, 1)
    survivors = WORLD if how in RECOVERED_IN_PROCESS else WORLD - len(LOST.get(how, (VICTIM,)))
    if len(ready) != survivors or result.leftovers:
        raise RuntimeError(f"{how}: {len(ready)} ranks ready, leftovers {result.leftovers}")
    return max(ready) - fault_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--only", default="", help="run the fault kinds whose label contains this text"
    )
    args = parser.parse_args()
    kinds = {label: v for label, v in KINDS.items() if args.only in label}
    if not kinds:
        parser.error(f"--only {args.only!r} matches none of: {', '.join(KINDS)}")
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    print(
        f"4 ranks, intervals 50 ms, soft {SOFT:g} s, hard {HARD:g} s, grace {GRACE:g} s, "
        f"heartbeat {HEARTBEAT:g} s; median of {args.repeat}"
    )
    print(f"{'fault':<36} {'median s':>9} {'max s':>7} {'bound s':>8}")
    for label, (how, bound) in kinds.items():
        samples = []
        for i in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                samples.append(measure(how, Path(tmp) / f"run{i}"))
        print(
            f"{label:<36} {statistics.median(samples):>9.2f} {max(samples):>7.2f} {bound:>8.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
