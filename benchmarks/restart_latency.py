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

    python benchmarks/restart_latency.py [--restarts 20] [--worlds 2 4 8] [--styles guide newer]
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

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers" / "latency_job.py"


def run_ranks(world: int, args: list[str], out: Path, timeout: float = 600) -> None:
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
    world: int, restarts: int, interval_ms: float, style: str = "guide"
) -> tuple[list[float], int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        run_ranks(world, ["restarts", str(restarts), str(interval_ms), style], out)
        reports = [json.loads((out / f"restarts{r}.json").read_text()) for r in range(world)]
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
    return latencies, len(faults)


def overhead(rounds: int, steps: int, interval: str) -> tuple[float, float]:
    """Median seconds per step, unwrapped and wrapped (alternating in the same processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(2, ["overhead", str(rounds), str(steps), interval], Path(tmp))
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
    args = parser.parse_args()

    print(
        f"restart latency, {args.interval_ms:g} ms intervals, {args.restarts} consecutive restarts"
    )
    print(
        f"{'ranks':>5} {'callbacks':>9} {'completed':>10} {'median s':>9} {'p90 s':>7} {'max s':>7}"
    )
    for world in args.worlds:
        for style in args.styles:
            latencies, faults = restart_latencies(world, args.restarts, args.interval_ms, style)
            done = f"{len(latencies)}/{faults}"
            print(
                f"{world:>5} {style:>9} {done:>10} {statistics.median(latencies):>9.3f} "
                f"{percentile(latencies, 0.9):>7.3f} {max(latencies):>7.3f}",
                flush=True,
            )
    if args.skip_overhead:
        return
    print(
        f"\nsteady-state overhead, 2 ranks, {args.overhead_steps} steps, "
        f"median of {args.overhead_rounds} alternating (ABBA) blocks in the same processes"
    )
    print(
        f"{'wrapper settings':>22} {'unwrapped ms/step':>18} {'wrapped ms/step':>16} "
        f"{'overhead':>9}"
    )
    for interval in ("default", str(args.interval_ms)):
        plain, wrapped = overhead(args.overhead_rounds, args.overhead_steps, interval)
        label = "defaults (1 s)" if interval == "default" else f"{args.interval_ms:g} ms intervals"
        print(
            f"{label:>22} {plain * 1e3:>18.3f} {wrapped * 1e3:>16.3f} "
            f"{(wrapped - plain) / plain * 100:>8.2f}%",
            flush=True,
        )


if __name__ == "__main__":
    main()
