"""A rank stuck in native code after the abort, to full size (issue 21).

A 2x2 ``inprocess-run`` job of ``examples/train.py`` (one warm standby per
node): at step 5 rank 1 raises while rank 2 blocks every signal and waits in
``pause()``, a native call that ignores the abort. Its monitor process ends it
``unwind_timeout`` (2 s, the default) after the restart began, the launcher
relaunches it from the standby and it rejoins. Measured from the restart
records: the fault (rank 1's exception) to the job back in the function at 4
ranks. The worker's ``hard_timeout`` is 30 s: what the wait was bounded by
before. ``--runs`` jobs, one after the other; median and worst case.

    PYTHONPATH=. python benchmarks/stuck_rank.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from inprocess import incidents, report  # noqa: E402


def one_run(tmp: Path) -> tuple[float, list[str]]:
    state = tmp / "state"
    cmd = [
        *(sys.executable, "-m", "inprocess.failover.cli"),
        *("--nnodes", "2", "--nproc-per-node", "2", "--state-dir", str(state)),
        *("--monitor-interval", "0.05", "--standby", "1"),
        str(REPO / "examples" / "train.py"),
        *("--result-dir", str(tmp / "out"), "--steps", "150"),
        *("--stuck-rank", "2", "--raise-rank", "1", "--crash-step", "5"),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore:Failed to initialize NumPy")
    with open(tmp / "launcher.log", "wb") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300)
    if code.returncode != 0:
        raise RuntimeError(f"job failed ({code.returncode}); see {tmp / 'launcher.log'}")
    records = report.load([state])
    restarts = [r for r in records if r.get("type") == "restart"]
    fault = min(r["time"] for r in restarts if r.get("faults"))
    full = [r for r in restarts if r["world_size"] == 4 and r["joined"] and r["time"] >= fault - 1]
    return full[0]["back_at"] - fault, [i["what"] for i in incidents.build(records)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    times = []
    for n in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            seconds, whats = one_run(Path(tmp))
        times.append(seconds)
        print(f"run {n}: stuck rank to full size {seconds:.2f} s; incidents: {whats}", flush=True)
    print(
        f"stuck rank to full size over {len(times)} runs: median {statistics.median(times):.2f} s,"
        f" max {max(times):.2f} s (load: {os.getloadavg()[0]:.2f}, {time.strftime('%H:%M')})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
