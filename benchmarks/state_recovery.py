"""Training state through faults: ``restore``/``commit`` against the guide's checkpoint file.

4 ranks under ``inprocess-run`` (1 node x 4 workers, gloo, CPU) train an MLP
of 3.5M parameters with Adam (``workers/state_train.py``): 42.6 MB of state
per rank (parameters and both moments). One step: 0.05 s of sleep (the
accelerator's forward and backward pass), a real forward/backward pass of the
MLP, one all-reduce of the 14 MB gradient and an Adam step (~0.1 s in all).
Two jobs, one after the other:

* ``snapshot``: ``call_wrapper.restore`` at every (re)start and
  ``call_wrapper.commit`` after every step. It first runs the timing phase:
  rounds of three 20-step blocks, one per way of keeping state, side by side
  in the same processes (``none``: nothing; ``commit``: commit every step;
  ``file``: rank 0 ``torch.save``-s every 100 of the file blocks' steps);
  rank 0 times every step. Then the fault phase.
* ``file``: the usage guide's pattern as the baseline: rank 0 saves model,
  optimizer and step with ``torch.save`` every 100 steps, every rank reloads
  the file at every restart. The same fault phase.

The fault phase injects the same faults at the same steps in both jobs, each in
the middle of its step (after the backward pass, before the all-reduce):
exceptions (the process survives, every rank restarts in-process) and SIGKILLs
(the survivors go on at world size 3 from their own memory, ``inprocess-run``
relaunches the worker, it joins and heals from a peer).

Per fault: *redone steps* (the steps rank 0 had completed before the fault, or
before the worker's admission, that it ran again: the step the fault
interrupted is not counted, it never completed), the restore's step, source,
bytes and time (from the restart records), and the *fault's cost*: from the
fault to the moment the job completed the interrupted step (recovery +
redone work + the step itself).

    .venv/bin/python benchmarks/state_recovery.py            # ~6 min on 2 cores
    .venv/bin/python benchmarks/state_recovery.py --quick    # smoke test, ~1.5 min

The exit status is 0 when every fault of the ``snapshot`` job cost at most
one redone step and both jobs completed.
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

from inprocess.failover.supervisor import processes_with_env

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "workers" / "state_train.py"

# kind:initial rank:steps after the timing phase (offsets spread over the 100-step
# interval of the baseline's checkpoint file)
FULL_FAULTS = "raise:2:37,kill:1:95,raise:3:162,kill:3:251,raise:1:318"
QUICK_FAULTS = "raise:2:23,kill:1:61"


def run_job(mode: str, out: Path, worker_args: list[str], deadline: float) -> dict:
    out.mkdir(parents=True)
    state_dir = out / "state"
    cmd = [
        sys.executable, "-m", "inprocess.failover.cli",
        "--nnodes", "1", "--nproc-per-node", "4",
        "--state-dir", str(state_dir), "--log-level", "WARNING",
        str(WORKER), "--mode", mode, "--out", str(out), *worker_args,
    ]  # fmt: skip
    marker = uuid.uuid4().hex
    env = dict(
        os.environ,
        STATE_RECOVERY_BENCHMARK=marker,
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
        RES_OPTIONS=os.environ.get("RES_OPTIONS", "timeout:1 attempts:1"),
    )
    start = time.monotonic()
    with open(out / "job.log", "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            # nothing outlives the run: every process of it carries the marker
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            for leftover in processes_with_env("STATE_RECOVERY_BENCHMARK", marker):
                try:
                    leftover.kill()
                except psutil.Error:
                    pass
    duration = time.monotonic() - start
    rank0 = json.loads((out / "rank0.json").read_text()) if (out / "rank0.json").exists() else {}
    faults = []
    if (out / "faults.jsonl").exists():
        faults = [json.loads(x) for x in (out / "faults.jsonl").read_text().splitlines() if x]
    restores = []
    restarts_file = state_dir / "restarts.jsonl"
    if restarts_file.exists():
        for line in restarts_file.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("type") == "restore":
                restores.append(r)
    report = subprocess.run(
        [sys.executable, "-m", "inprocess.failover.cli", "report", str(state_dir)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return {
        "mode": mode,
        "returncode": returncode,
        "duration": duration,
        "rank0": rank0,
        "faults": sorted(faults, key=lambda f: f["time"]),
        "restores": sorted(restores, key=lambda r: r["time"]),
        "report": report,
    }


def per_fault(job: dict) -> list[dict]:
    """Each fault: its redone steps, restores and cost (from rank 0's account and the records)."""
    starts = job["rank0"].get("starts", [])
    faults = job["faults"]
    rows = []
    for i, f in enumerate(faults):
        until = faults[i + 1]["time"] if i + 1 < len(faults) else float("inf")
        after = [s for s in starts if f["time"] < s["time"] < until]
        redone = sum(max(0, s["completed_before"] - s["step"]) for s in after)
        regained = job["rank0"].get("regained", {}).get(str(f["step"] + 1))
        restores = [r for r in job["restores"] if f["time"] < r["time"] < until]
        rows.append(
            {
                "kind": f["kind"],
                "step": f["step"],
                "restored": [s["step"] for s in after],
                "worlds": [s["world"] for s in after],
                "redone_steps": redone,
                "restore_seconds_rank0": [round(s["restore_seconds"], 4) for s in after],
                "records": [
                    {k: r.get(k) for k in ("step", "redone_steps", "seconds", "bytes", "sources")}
                    for r in restores
                ],
                "cost_seconds": None if regained is None else regained - f["time"],
            }
        )
    return rows


def stats(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    k = 0.9 * (len(ordered) - 1)
    lo = int(k)
    p90 = ordered[lo] + (ordered[min(lo + 1, len(ordered) - 1)] - ordered[lo]) * (k - lo)
    mean, median = statistics.fmean(values), statistics.median(values)
    return (
        f"mean {mean * 1000:.1f} ms, median {median * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms, "
        f"max {max(values) * 1000:.1f} ms (n={len(values)})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, 2 faults: a smoke test")
    parser.add_argument("--keep", help="keep the run folders under this path")
    parser.add_argument("--deadline", type=float, default=400.0, help="seconds per job")
    parser.add_argument(
        "--overhead-only",
        action="store_true",
        help="only the snapshot job's timing phase (step time per way of keeping state)",
    )
    parser.add_argument(
        "--step-time", type=float, default=0.05, help="seconds of sleep per step (the accelerator)"
    )
    args = parser.parse_args()
    if args.quick:
        common = ["--hidden", "256", "--steps", "100", "--save-every", "50"]
        timing, faults = ["--timing-blocks", "2", "--block", "10"], QUICK_FAULTS
    else:
        common = ["--steps", "360"]
        timing, faults = ["--timing-blocks", "5", "--block", "20"], FULL_FAULTS
    common += ["--step-time", str(args.step_time)]
    modes = [("snapshot", timing), ("file", [])]
    if args.overhead_only:
        common, faults, modes = [*common, "--steps", "0"], "", modes[:1]
    load_before = os.getloadavg()
    jobs = []
    with tempfile.TemporaryDirectory(prefix="state-recovery-") as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        for mode, extra in modes:
            job = run_job(mode, base / mode, [*common, *extra, "--faults", faults], args.deadline)
            jobs.append(job)
            print(
                f"{mode}: exit {job['returncode']} in {job['duration']:.1f} s, "
                f"{len(job['faults'])} faults",
                flush=True,
            )
    load_after = os.getloadavg()

    snap = jobs[0]
    times = snap["rank0"].get("times", {})
    print("\n## Step time, side by side in the snapshot job (rank 0, timing phase, no faults)\n")
    for name in ("none", "commit", "file"):
        print(f"{name:>7}: {stats(times.get(name, []))}")
    overhead = {}
    if times.get("none"):
        base_mean = statistics.fmean(times["none"])
        base_median = statistics.median(times["none"])
        for name in ("commit", "file"):
            if times.get(name):
                overhead[name] = {
                    "mean": statistics.fmean(times[name]) / base_mean - 1,
                    "median": statistics.median(times[name]) / base_median - 1,
                }
                o = overhead[name]
                print(
                    f"overhead of {name!r} against 'none': mean {o['mean'] * 100:+.1f} %, "
                    f"median {o['median'] * 100:+.1f} %"
                )

    commits = snap["rank0"].get("commit_seconds", {})
    parts = snap["rank0"].get("parts", {})
    print(f"call_wrapper.commit alone (rank 0): {stats(commits.get('commit', []))}")
    if parts:
        print(
            f"its parts, each timed alone on rank 0: state_dict() of model and optimizer "
            f"{parts['state_dicts'] * 1000:.1f} ms, copying their tensors "
            f"({parts['bytes'] / 1e6:.1f} MB) {parts['tensor_copy'] * 1000:.1f} ms"
        )

    if args.overhead_only:
        print(f"\nload average before {load_before}, after {load_after}")
        return 0 if snap["returncode"] == 0 else 1
    file = jobs[1]

    print("\n## Per fault\n")
    print(
        "| way | fault | at step | restored step(s) | world | redone steps | restore (rank 0) "
        "| restore record: seconds / bytes / sources | fault's cost |"
    )
    print("|---|---|---:|---|---|---:|---|---|---:|")
    summary = {}
    for job in jobs:
        rows = per_fault(job)
        summary[job["mode"]] = rows
        for r in rows:
            recs = "; ".join(
                f"{x['seconds']:.3f} s / {x['bytes'] / 1e6:.1f} MB / "
                + ", ".join(f"{k} {n}" for k, n in (x["sources"] or {}).items() if n)
                for x in r["records"]
            )
            cost = "-" if r["cost_seconds"] is None else f"{r['cost_seconds']:.2f} s"
            print(
                f"| {job['mode']} | {r['kind']} | {r['step']} | {r['restored']} | {r['worlds']} | "
                f"{r['redone_steps']} | {r['restore_seconds_rank0']} | {recs or '-'} | {cost} |"
            )

    print("\n## Summary\n")
    print("| way | faults | redone steps per fault: mean / max | fault's cost: median / max |")
    print("|---|---:|---:|---:|")
    for mode, rows in summary.items():
        for kind in ("raise", "kill"):
            chosen = [r for r in rows if r["kind"] == kind]
            redone = [r["redone_steps"] for r in chosen]
            costs = [r["cost_seconds"] for r in chosen if r["cost_seconds"] is not None]
            if chosen:
                cost = f"{statistics.median(costs):.2f} s / {max(costs):.2f} s" if costs else "-"
                print(
                    f"| {mode} | {len(chosen)} {kind} | {statistics.fmean(redone):.1f} / "
                    f"{max(redone)} | {cost} |"
                )
    memory = [
        r["seconds"]
        for r in snap["restores"]
        if r.get("step") and not (r["sources"].get("peer") or r["sources"].get("disk"))
    ]
    peer = [r for r in snap["restores"] if r.get("sources", {}).get("peer")]
    print(
        f"\nrestore from own memory (every rank): {stats(memory)}"
        f"\nrestore with a peer transfer (the relaunched worker's): "
        f"{stats([r['seconds'] for r in peer])}, "
        f"{statistics.fmean([r['bytes'] for r in peer]) / 1e6 if peer else 0:.1f} MB moved each"
    )
    if file["rank0"].get("starts"):
        loads = [s["restore_seconds"] for s in file["rank0"]["starts"] if s["step"]]
        print(f"baseline reload of the checkpoint file (rank 0): {stats(loads)}")
    print(f"\nload average before {load_before}, after {load_after}")
    print("\n## inprocess-run report of the snapshot job\n")
    print(snap["report"])
    ok = all(j["returncode"] == 0 for j in jobs) and all(
        r["redone_steps"] <= 1 for r in summary.get("snapshot", [])
    )
    ok = ok and len(summary.get("snapshot", [])) == len(faults.split(","))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
