"""A worker lost together with its monitor process, to the survivors training again.

A 2x2 ``inprocess-run`` job of ``examples/train.py``. Each round kills one
worker from outside, alternately

* alone (``SIGKILL``): its monitor process sees the death and reports it;
* with its monitor process (stopped first, then both ``SIGKILL``ed: what a lost
  node, a signal to the process group or the OOM killer does): nobody on its
  node is left to report it. The controller, which saw the worker's exit,
  declares it terminated in the job's store. Without that the survivors waited
  for its heartbeats to time out (``heartbeat_timeout``, 10 s in this script).

Measured per kill: from the kill to the survivors' first restart record after
it (its ``back_at``: back in the function; at 3 ranks, or at 4 when the
relaunched worker was admitted in the same restart). Median and worst case per
kind.

    PYTHONPATH=. python benchmarks/rank_and_monitor_lost.py --kills 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from inprocess import report  # noqa: E402


def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def _state(state_dir: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((state_dir / "state.json").read_text())
    return {}


def _restarts(state_dir: Path) -> list[dict]:
    return [r for r in report.load([state_dir]) if r.get("type") == "restart"]


def _kill(pid: int, with_monitor: bool) -> float:
    monitors = psutil.Process(pid).children() if with_monitor else []
    for monitor in monitors:  # stopped first: it must not report the death
        monitor.send_signal(signal.SIGSTOP)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    for monitor in monitors:
        with contextlib.suppress(psutil.NoSuchProcess):
            monitor.kill()
    return killed_at


def run(kills: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"worker alone": [], "worker with its monitor": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        state, stop = tmp / "state", tmp / "stop"
        cmd = [
            *(sys.executable, "-m", "inprocess.failover.cli"),
            *("--nnodes", "2", "--nproc-per-node", "2", "--state-dir", str(state)),
            *("--monitor-interval", "0.05", "--max-restarts", str(kills + 1)),
            str(REPO / "examples" / "train.py"),
            *("--result-dir", str(tmp / "out"), "--steps", "100000", "--step-time", "0.03"),
            *("--stop-file", str(stop)),
        ]
        env = dict(os.environ, PYTHONWARNINGS="ignore:Failed to initialize NumPy")
        with open(tmp / "launcher.log", "wb") as log:
            job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                for n in range(kills):
                    kind = list(times)[n % 2]
                    # the job at full size, training for a moment since the last kill
                    _until(
                        lambda: len(
                            [w for w in _state(state).get("workers", {}).values() if w["pid"]]
                        )
                        == 4,
                        120,
                        "four workers",
                    )
                    time.sleep(2.0)
                    pid = _state(state)["workers"][str(1 + n % 2)]["pid"]
                    killed_at = _kill(pid, with_monitor=kind != "worker alone")
                    back = _until(
                        lambda at=killed_at: [
                            (r["back_at"], r["world_size"])
                            for r in _restarts(state)
                            if r["time"] >= at
                        ],
                        120,
                        f"survivors after kill {n}",
                    )
                    seconds, world = back[0][0] - killed_at, back[0][1]
                    times[kind].append(seconds)
                    print(f"kill {n} ({kind}): survivors back in {seconds:.2f} s at {world} ranks")
                    _until(
                        lambda at=killed_at: [
                            r for r in _restarts(state) if r["time"] >= at and r["world_size"] == 4
                        ],
                        120,
                        "full size again",
                    )
            finally:
                stop.touch()
                try:
                    job.wait(120)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.wait()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=6)
    args = p.parse_args()
    times = run(args.kills)
    for kind, values in times.items():
        if values:
            print(
                f"{kind}: survivors back after {statistics.median(values):.2f} s median, "
                f"{max(values):.2f} s max over {len(values)} kills"
            )
    print(f"(load: {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
