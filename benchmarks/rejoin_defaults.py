"""A SIGKILLed worker back in the job with the Wrapper's default settings.

Runs ``benchmarks/workers/default_train.py`` (``@inprocess.Wrapper()``, no
settings: 1 s intervals, 1 s ``last_call_wait``) under a default
``inprocess-run --nproc-per-node 4`` (one node, one warm standby), SIGKILLs a
random worker ``--faults`` times, each once the job has run at full size for
``--settle`` seconds, and measures kill -> all 4 ranks training at world size 4
again (the first kill after ``--warmup`` more seconds, each next one after
``--settle``). Only ``--max-restarts`` and ``--per-node-max-failures`` are raised to
``--faults`` (the defaults, 3, would stop a job that loses workers that often;
they bound how many faults are tolerated, not how fast one is). Two columns:

* ``defaults``: the script as it is: its monitor processes are forked;
* ``defaults-fork-unsafe``: the script starts a thread before calling the
  wrapped function (a stand-in for a GPU script that initialized CUDA):
  ``fork_is_safe()`` is false and every monitor process is a fresh interpreter.

The fault loop, the clean-up and the checks are ``failover_vs_torchrun.py``'s.

    PYTHONWARNINGS='ignore:Failed to initialize NumPy' PYTHONPATH=. \\
        .venv/bin/python benchmarks/rejoin_defaults.py --faults 8
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import failover_vs_torchrun as fvt

SYSTEMS = ("inprocess-defaults", "inprocess-defaults-fork-unsafe")
fvt.LABELS.update(
    {
        "inprocess-defaults": "Wrapper() defaults",
        "inprocess-defaults-fork-unsafe": "Wrapper() defaults, fork unsafe",
    }
)
#: the bar: kill -> full size with default settings (issue 37)
GOAL_MEDIAN, GOAL_MAX = 1.0, 2.0


def command(system: str, args: argparse.Namespace, work: Path) -> tuple[list[str], dict[str, str]]:
    """A default ``inprocess-run`` of the default-settings script."""
    cmd = [
        *fvt.launcher("inprocess-run", "inprocess.failover.cli"),
        "--nproc-per-node",
        str(fvt.WORLD),
        "--max-restarts",
        str(args.faults),
        "--per-node-max-failures",
        str(args.faults),
        "--state-dir",
        str(work / "state"),
        "--job-id",
        f"bench-{uuid.uuid4().hex[:8]}",
        str(fvt.REPO / "benchmarks" / "workers" / "default_train.py"),
        "--steps",
        str(args.steps),
        "--step-time",
        str(args.step_time),
        "--result-dir",
        str(work / "out"),
        *(["--fork-unsafe"] if system.endswith("fork-unsafe") else []),
    ]
    return cmd, {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=8, help="SIGKILLs per column")
    parser.add_argument("--seed", type=int, default=0, help="seed of the ranks to kill")
    parser.add_argument("--only", choices=SYSTEMS, action="append", help="run only this column")
    parser.add_argument(
        "--out",
        type=Path,
        default=fvt.REPO / "benchmarks" / "results" / "rejoin_defaults.txt",
        help="where to write the results",
    )
    parser.add_argument("--steps", type=int, default=None, help="job length (default: computed)")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds per step")
    parser.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds at full size before the next kill (long enough for a replacement's "
        "monitor process, a fresh interpreter in the fork-unsafe column, to be up: a GPU "
        "job's monitors are up long before a fault)",
    )
    parser.add_argument(
        "--warmup", type=float, default=15.0, help="more seconds before the first kill"
    )
    parser.add_argument(
        "--deadline", type=float, default=60.0, help="seconds for a fault to count as recovered"
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs and events")
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    if args.faults < 1:
        parser.error(f"--faults must be >= 1, got {args.faults}")
    if args.steps is None:
        args.steps = math.ceil(
            (args.faults * (args.settle + 4.0) + args.warmup + 20.0) / args.step_time
        )
    fvt.command = command  # run_system builds its launch with this module's command
    wait_full = fvt.wait_full

    def wait_full_then_warm(*a: object, **k: object) -> bool:
        """The first wait of a run (nothing killed yet) also waits ``--warmup``."""
        full = wait_full(*a, **k)  # type: ignore[arg-type]
        if full and a[3] == 0.0:  # since: 0.0 before the first kill
            time.sleep(args.warmup)
        return full

    fvt.wait_full = wait_full_then_warm

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    root = Path(tempfile.mkdtemp(prefix="rejoin_defaults_"))
    results: list[fvt.RunResult] = []
    try:
        for system in [s for s in SYSTEMS if s in (args.only or SYSTEMS)]:
            results.append(fvt.run_system(system, args, root))
    finally:
        if args.keep:
            print(f"\nlogs and events kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    text = fvt.report(results, args, argv).replace(
        "benchmarks/failover_vs_torchrun.py", "benchmarks/rejoin_defaults.py", 1
    )
    lines = [text]
    ok = True
    for r in results:
        rec = r.recovered
        met = (
            len(rec) == r.planned
            and r.exit_code == 0
            and r.final_step == args.steps
            and statistics.median(rec) <= GOAL_MEDIAN
            and max(rec) <= GOAL_MAX
        )
        ok = ok and met
        lines.append(
            f"{fvt.LABELS[r.system]}: kill -> full size median "
            f"{fvt.seconds(statistics.median(rec) if rec else None)} s, max "
            f"{fvt.seconds(max(rec) if rec else None)} s over {len(rec)}/{r.planned} kills "
            f"(goal: median <= {GOAL_MEDIAN} s, max <= {GOAL_MAX} s): {'met' if met else 'MISSED'}"
        )
    text = "\n".join(lines) + "\n"
    print("\n" + text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
