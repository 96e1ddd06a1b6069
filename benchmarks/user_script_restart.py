"""Restarts of a user-style script under torchrun: the Wrapper against ``torchrun --max-restarts``.

The script (``workers/user_script.py``) has the usage guide's shape: every call
of the training function builds its own ``torch.distributed.TCPStore`` on
``MASTER_PORT + 1`` (hosted by rank 0, ``multi_tenant``, ``wait_for_workers``,
``use_libuv``), initializes gloo with ``store=``, wraps a small model in
``DistributedDataParallel``, reloads the ``torch.save`` checkpoint and trains;
a random rank other than 0 raises at random steps, ``--faults`` times.

Two systems, one after the other in the same run, 4 ranks each under real
``torchrun --nproc-per-node 4`` on free ports:

* ``wrapper``: the script under ``inprocess.Wrapper`` (50 ms intervals); every
  rank restarts in-process;
* ``torchrun``: the same script without the Wrapper, ``torchrun
  --max-restarts <faults>``: the fault ends the process, the agent stops the
  others and starts all 4 again.

Restart latency of one fault: from the faulty rank's ``raise`` to the moment the
last of the 4 ranks is back in training in the next attempt (its store, process
group, DDP model and checkpoint done); all times are ``time.time()`` of this one
host. A fault is recovered when all 4 ranks are back (in the first attempt after
it where all 4 are; an unplanned extra restart on the way counts in its
latency). The exit status is 0 when the Wrapper recovered every fault with
median <= 0.3 s and max <= 1.5 s.

    .venv/bin/python benchmarks/user_script_restart.py              # 20 faults each
    .venv/bin/python benchmarks/user_script_restart.py --faults 5 --only wrapper
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
import uuid
from pathlib import Path

import psutil

from inprocess._net import free_port
from inprocess.failover.supervisor import processes_with_env

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "workers" / "user_script.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
RANKS = 4


def run(system: str, faults: int, steps: int, out: Path, deadline: float) -> dict:
    out.mkdir(parents=True)
    port = free_port(following=2)  # the script's own store is on MASTER_PORT + 1
    cmd = [str(TORCHRUN), "--nproc-per-node", str(RANKS), "--master-port", str(port)]
    if system == "torchrun":
        cmd += ["--max-restarts", str(faults)]
    cmd += [str(SCRIPT), "--out", str(out), "--faults", str(faults), "--steps", str(steps)]
    if system == "wrapper":
        cmd.append("--wrapped")
    env = dict(os.environ, RES_OPTIONS=os.environ.get("RES_OPTIONS", "timeout:1 attempts:1"))
    env.setdefault("USER_SCRIPT_LOG", "WARNING")  # the Wrapper's warnings, in torchrun.log
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
    marker = uuid.uuid4().hex
    env["USER_SCRIPT_BENCHMARK"] = marker  # inherited by every process of the run
    start = time.monotonic()
    with open(out / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            # Nothing outlives the run: torchrun's workers (and the Wrapper's
            # monitor processes) have sessions of their own; find them by marker.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            for leftover in processes_with_env("USER_SCRIPT_BENCHMARK", marker):
                try:
                    leftover.kill()
                except psutil.Error:
                    pass
    duration = time.monotonic() - start

    events = []
    for path in out.glob("rank*.jsonl"):
        rank = int(path.stem[4:])
        for line in path.read_text().splitlines():
            events.append(dict(json.loads(line), rank=rank))
    fault_times = {e["iteration"]: e["time"] for e in events if e["event"] == "fault"}
    ready: dict[int, dict[int, float]] = {}
    for e in events:
        if e["event"] == "ready":
            ready.setdefault(e["iteration"], {})[e["rank"]] = e["time"]
    latencies, per_rank = [], []
    for iteration, t in sorted(fault_times.items()):
        # The first later attempt in which all ranks are back in training (an
        # unplanned extra restart on the way counts in the latency).
        later = [i for i in sorted(ready) if i > iteration and len(ready[i]) == RANKS]
        if later:
            back = ready[later[0]]
            latencies.append(max(back.values()) - t)
            per_rank += [v - t for v in back.values()]
    done = sum(1 for e in events if e["event"] == "done")
    return {
        "system": system,
        "faults": len(fault_times),
        "recovered": len(latencies),
        "latencies": latencies,
        "per_rank": per_rank,
        "finished_ranks": done,
        "returncode": returncode,
        "duration": duration,
    }


def row(r: dict) -> str:
    lat = r["latencies"]
    med = f"{statistics.median(lat):.3f} s" if lat else "-"
    p90 = f"{sorted(lat)[int(0.9 * (len(lat) - 1))]:.3f} s" if lat else "-"
    mx = f"{max(lat):.3f} s" if lat else "-"
    return (
        f"| {r['system']} | {r['recovered']}/{r['faults']} | {med} | {p90} | {mx} | "
        f"{r['finished_ranks']}/{RANKS} (exit {r['returncode']}) | {r['duration']:.1f} s |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30, help="steps after the last fault")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds per system")
    parser.add_argument("--only", action="append", choices=["wrapper", "torchrun"])
    parser.add_argument("--keep", help="keep the run folders under this path")
    args = parser.parse_args()

    systems = args.only or ["wrapper", "torchrun"]
    results = []
    with tempfile.TemporaryDirectory(prefix="user-script-") as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        for system in systems:
            r = run(system, args.faults, args.steps, base / system, args.deadline)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "per_rank"}), flush=True)

    print()
    print("| system | recovered / faults | median | p90 | max | ranks finished | run time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(row(r))
    ok = True
    for r in results:
        if r["system"] == "wrapper":
            lat = r["latencies"]
            ok = bool(
                lat
                and r["recovered"] == r["faults"] == args.faults
                and statistics.median(lat) <= 0.3
                and max(lat) <= 1.5
            )
            if r["per_rank"]:
                print(
                    f"\nwrapper, per rank (fault -> that rank back in training): "
                    f"median {statistics.median(r['per_rank']):.3f} s, "
                    f"max {max(r['per_rank']):.3f} s over {len(r['per_rank'])} rank restarts"
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
