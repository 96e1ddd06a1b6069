"""What ``persist_every`` costs the training thread: the step at a due commit
against the steps between.

One process, no group: a model of ``--mb`` MB of parameters with SGD and
momentum (the state: ``2 x --mb``), steps of ``--step-ms`` of "device time"
(a sleep: the training thread waits, as on a GPU, while the CPU is free)
followed by the optimizer step and ``commit``; ``Snapshots(snapshot_dir,
persist_every=--every)`` writing to a temporary directory. Each step is timed
from its start to the next one's; the steps are grouped by where they fall:
``due`` (the step whose commit is due for the disk), ``after`` (the two steps
after it: where a hand-over or a wait for the writer's copy would show) and
``other``; ``none`` is the same loop without a ``snapshot_dir``. One JSON line
per tree and round: the median of each group, ms, the longest step, and the
commits skipped because the disk writer still copied their slot
(``coalesced``).

With several ``--tree``s (source trees: each is put first on ``PYTHONPATH``)
the trees take turns, round after round.

    PYTHONPATH=. .venv/bin/python benchmarks/persist_stall.py
    .venv/bin/python benchmarks/persist_stall.py --tree OLD_CHECKOUT --tree . --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(mb: float, every: int, steps: int, step_ms: float, persist: bool) -> dict[str, float]:
    import torch

    from inprocess.snapshot import Snapshots

    torch.manual_seed(0)
    n = max(1, int(mb * 1e6 / 4 / 8))
    params = [torch.nn.Parameter(torch.randn(n)) for _ in range(8)]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    state = {"model": torch.nn.ParameterList(params), "optim": opt}
    with tempfile.TemporaryDirectory() as d:
        snaps = Snapshots(os.path.join(d, "snap"), every) if persist else Snapshots()
        times: list[float] = []
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            time.sleep(step_ms / 1e3)  # the forward and backward pass on the device
            for p in params:
                p.grad = torch.full_like(p, 1e-3) if p.grad is None else p.grad
            opt.step()
            snaps.commit(state, step, 0)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
        coalesced = getattr(snaps, "disk_coalesced", 0)  # (a tree before it had none)
        t_close = time.perf_counter()
        snaps.close()
        closing = time.perf_counter() - t_close
    groups: dict[str, list[float]] = {"due": [], "after": [], "other": []}
    for i, t in enumerate(times[every:], start=every + 1):  # the first steps: buffers allocated
        if i % every == 0:
            groups["due"].append(t)
        elif i % every in (1, 2):
            groups["after"].append(t)
        else:
            groups["other"].append(t)
    out = {k: round(statistics.median(v) * 1e3, 2) for k, v in groups.items() if v}
    out["max"] = round(max(times[every:]) * 1e3, 2)
    out["close_s"] = round(closing, 3)
    out["coalesced"] = coalesced
    return out


def in_tree(tree: str, argv: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--run", *argv], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"tree {tree} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="parameters, MB (default 100)")
    parser.add_argument("--every", type=int, default=5, help="persist_every (default 5)")
    parser.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    parser.add_argument("--step-ms", type=float, default=50.0, help="device time a step, ms")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each tree once per round)")
    parser.add_argument(
        "--tree", action="append", default=None, help="a source tree (repeatable; default .)"
    )
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-persist", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("mb", "every", "steps", "step_ms", "rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.steps < 3 * args.every:
        parser.error(f"--steps must be at least 3 x --every ({3 * args.every}), got {args.steps}")
    if args.run:
        out = one_run(args.mb, args.every, args.steps, args.step_ms, not args.no_persist)
        print(json.dumps(out), flush=True)
        return 0
    trees = [str(Path(t).resolve()) for t in (args.tree or ["."])]
    argv = ["--mb", str(args.mb), "--every", str(args.every), "--steps", str(args.steps),
            "--step-ms", str(args.step_ms)]  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for round_ in range(args.rounds):
        for tree in trees:
            r = in_tree(tree, argv)
            r["none"] = in_tree(tree, [*argv, "--no-persist"])["other"]
            results[tree].append(r)
            print(json.dumps({"round": round_, "tree": tree, "ms": r}), flush=True)
    for tree, rounds in results.items():
        keys = ("none", "other", "due", "after", "max", "coalesced")
        summary = {k: round(statistics.median(r[k] for r in rounds), 2) for k in keys}
        print(json.dumps({"tree": tree, "mb": args.mb, "every": args.every,
                          "median_of_rounds_ms": summary}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
