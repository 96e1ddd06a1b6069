"""Restart latency of the in-process Wrapper, and its steady-state overhead.

Restart latency: from the moment a rank raises (the others wait inside
all_reduce) to the moment the last rank is back in the function with a new
process group and one all_reduce done. Measured over consecutive restarts at
several world sizes with 5 ms monitoring intervals, for the same script written
with the usage guide's callbacks and with the newer generation's (one run each,
alternating per world size).

Overhead: the same training loop (a 256x256 matmul step and an all_reduce of
the gradient) run wrapped and unwrapped, alternately (ABBA) in the same 2
rank processes; only the training loop is timed.

Restart records (``INPROCESS_RECORDS``, :mod:`inprocess.records`): ``--records
both`` runs every measurement with records off and on, side by side (the
latency's "records" column is the median latency the records themselves report).

    python benchmarks/restart_latency.py [--restarts 20] [--worlds 2 4 8] [--styles guide newer]
        [--records off|on|both]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from inprocess._net import free_port
from inprocess.records import read_jsonl

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers" / "latency_job.py"


def run_ranks(
    world: int, args: list[str], out: Path, timeout: float = 600, records: Path | None = None
) -> None:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore:Failed to initialize NumPy",
            RES_OPTIONS="timeout:1 attempts:1",
        )
        env.pop("INPROCESS_RECORDS", None)
        if records is not None:
            env["INPROCESS_RECORDS"] = str(records)
        procs.append(
            subprocess.Popen([sys.executable, str(WORKER), *args[:1], str(out), *args[1:]], env=env)
        )
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise RuntimeError(f"a rank failed: exit codes {codes}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def restart_latencies(
    world: int, restarts: int, interval_ms: float, style: str = "guide", records: bool = False
) -> tuple[list[float], int, list[float]]:
    """Measured latencies, faults injected, and the latencies the restart records report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        path = out / "restarts.jsonl" if records else None
        run_ranks(world, ["restarts", str(restarts), str(interval_ms), style], out, records=path)
        reports = [json.loads((out / f"restarts{r}.json").read_text()) for r in range(world)]
        recorded = [
            r["latency"]
            for r in (read_jsonl(path) if path else [])
            if r.get("type") == "restart" and r.get("latency") is not None
        ]
    faults = {i: t for report in reports for i, t in report["fault"]}
    ready: dict[int, list[float]] = {}
    for report in reports:
        for i, t in report["ready"]:
            ready.setdefault(i, []).append(t)
    latencies = []
    for i, fault_time in sorted(faults.items()):
        back = ready.get(i + 1, [])
        if len(back) == world:
            latencies.append(max(back) - fault_time)
    return latencies, len(faults), recorded


def overhead(rounds: int, steps: int, interval: str, records: bool = False) -> tuple[float, float]:
    """Median seconds per step, unwrapped and wrapped (alternating in the same processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "restarts.jsonl" if records else None
        run_ranks(2, ["overhead", str(rounds), str(steps), interval], Path(tmp), records=path)
        reports = [json.loads((Path(tmp) / f"overhead{r}.json").read_text()) for r in range(2)]
    # a step takes as long as the slower rank
    plain = [max(p) / steps for p in zip(*(r["plain"] for r in reports), strict=True)]
    wrapped = [max(w) / steps for w in zip(*(r["wrapped"] for r in reports), strict=True)]
    return statistics.median(plain), statistics.median(wrapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--overhead-rounds", type=int, default=10)
    parser.add_argument("--overhead-steps", type=int, default=500)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument(
        "--styles", nargs="+", choices=["guide", "newer"], default=["guide", "newer"]
    )
    parser.add_argument(
        "--records",
        choices=["off", "on", "both"],
        default="off",
        help="restart records (INPROCESS_RECORDS) off, on, or both side by side",
    )
    args = parser.parse_args()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.records]

    print(
        f"restart latency, {args.interval_ms:g} ms intervals, {args.restarts} consecutive restarts"
    )
    print(
        f"{'ranks':>5} {'callbacks':>9} {'records':>7} {'completed':>10} {'median s':>9} "
        f"{'p90 s':>7} {'max s':>7} {'records: median s':>17}"
    )
    for world in args.worlds:
        for style in args.styles:
            for records in modes:
                latencies, faults, recorded = restart_latencies(
                    world, args.restarts, args.interval_ms, style, records
                )
                done = f"{len(latencies)}/{faults}"
                own = f"{statistics.median(recorded):.3f} ({len(recorded)})" if recorded else "-"
                print(
                    f"{world:>5} {style:>9} {'on' if records else 'off':>7} {done:>10} "
                    f"{statistics.median(latencies):>9.3f} {percentile(latencies, 0.9):>7.3f} "
                    f"{max(latencies):>7.3f} {own:>17}",
                    flush=True,
                )
    if args.skip_overhead:
        return
    print(
        f"\nsteady-state overhead, 2 ranks, {args.overhead_steps} steps, "
        f"median of {args.overhead_rounds} alternating (ABBA) blocks in the same processes"
    )
    print(
        f"{'wrapper settings':>22} {'records':>7} {'unwrapped ms/step':>18} "
        f"{'wrapped ms/step':>16} {'overhead':>9}"
    )
    for interval in ("default", str(args.interval_ms)):
        for records in modes:
            plain, wrapped = overhead(args.overhead_rounds, args.overhead_steps, interval, records)
            label = (
                "defaults (1 s)" if interval == "default" else f"{args.interval_ms:g} ms intervals"
            )
            print(
                f"{label:>22} {'on' if records else 'off':>7} {plain * 1e3:>18.3f} "
                f"{wrapped * 1e3:>16.3f} {(wrapped - plain) / plain * 100:>8.2f}%",
                flush=True,
            )


if __name__ == "__main__":
    main()
