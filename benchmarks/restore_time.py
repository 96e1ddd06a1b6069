"""How long ``restore`` takes by itself: from own memory, and with a peer transfer.

Two ranks over gloo on this machine, each with ``--mb`` of replicated state
(``float32`` tensors) committed once. Each restore is timed on rank 0 between
two barriers:

* ``memory``: every rank restores its own snapshot (after an exception);
* ``peer``: rank 1 starts over with no snapshot each time (a relaunched
  worker) and rank 0 sends it its own (rank 0 waits for rank 1's checksums).

With several ``--tree``s (source trees: each is put first on ``PYTHONPATH``)
the trees take turns, round after round, so that a slower or busier moment
of the machine falls on every tree alike; one JSON line per tree and round,
then the median of each tree's rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/restore_time.py
    .venv/bin/python benchmarks/restore_time.py --tree OLD_CHECKOUT --tree . --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from inprocess._net import free_port


def rank_main(mb: float, repeats: int) -> None:
    """One rank: commit once, then ``repeats`` restores of each kind."""
    import torch
    import torch.distributed as dist

    from inprocess.snapshot import Snapshots

    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}", rank=rank, world_size=2
    )
    torch.manual_seed(0)
    n = max(1, int(mb * 1e6 / 4 / 10))
    state = {"model": {f"w{i}": torch.randn(n) for i in range(10)}, "step": 1}

    def committed() -> Snapshots:
        snaps = Snapshots()
        snaps.commit(state, 1, 0)
        for slot in snaps.own.slots:
            slot.wait()
        return snaps

    snaps = committed()
    times: dict[str, list[float]] = {"memory": [], "peer": []}
    for kind in times:
        for _ in range(repeats):
            if kind == "peer" and rank == 1:
                snaps = Snapshots()  # a relaunched worker: nothing in memory
            dist.barrier()
            t0 = time.perf_counter()
            snaps.restore(state, True, 0)
            times[kind].append(time.perf_counter() - t0)
            dist.barrier()
    if rank == 0:
        print(json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)
    dist.destroy_process_group()


def one_round(tree: str, mb: float, repeats: int) -> dict[str, float]:
    env = dict(os.environ, BENCH_PORT=str(free_port()), PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))
    argv = [sys.executable, __file__, "--rank-main", "--mb", str(mb), "--repeats", str(repeats)]
    procs = [
        subprocess.Popen(argv, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        codes = [p.returncode for p in procs]
        raise SystemExit(f"a rank of tree {tree} failed: exit codes {codes}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=42.5, help="state per rank, MB (default 42.5)")
    parser.add_argument("--repeats", type=int, default=12, help="restores of each kind per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each tree once per round)")
    parser.add_argument(
        "--tree", action="append", default=None, help="a source tree (repeatable; default .)"
    )
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("mb", "repeats", "rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.rank_main:
        rank_main(args.mb, args.repeats)
        return 0
    trees = [str(Path(t).resolve()) for t in (args.tree or ["."])]
    results: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for round_ in range(args.rounds):
        for tree in trees:
            r = one_round(tree, args.mb, args.repeats)
            results[tree].append(r)
            ms = {k: round(v * 1e3, 1) for k, v in r.items()}
            print(json.dumps({"round": round_, "tree": tree, "median_ms": ms}), flush=True)
    for tree, rounds in results.items():
        summary = {
            k: round(statistics.median(r[k] for r in rounds) * 1e3, 1) for k in ("memory", "peer")
        }
        print(json.dumps({"tree": tree, "mb": args.mb, "median_of_rounds_ms": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
