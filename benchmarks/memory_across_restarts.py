"""Memory across in-process restarts: does a failed iteration's state outlive it?

One rank (gloo, CPU), a function that builds a model with Adam (``--mb`` MB of
state: parameters, gradients and both moments), takes one step, commits it
(``call_wrapper.commit``) and raises, ``--restarts`` times; then it completes.
Nothing in the function helps (no ``gc.collect``, no ``del``). Per tree: the
process's resident memory at the top of each call of the function (after 5
restarts and after the last), their ratio, and the restart latency (from the
``raise`` to the next call of the function: median and worst).

With several ``--tree``s (source trees, each put first on ``PYTHONPATH``) the
trees run one after the other in separate processes.

    .venv/bin/python benchmarks/memory_across_restarts.py                      # 400 MB, 50 restarts
    .venv/bin/python benchmarks/memory_across_restarts.py --tree OLD --tree . --restarts 12
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path


def one_run(mb: int, restarts: int) -> dict[str, object]:
    import logging
    import time

    import psutil
    import torch
    import torch.distributed as dist

    import inprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logging.basicConfig(level=logging.ERROR)
    rss: list[float] = []
    latency: list[float] = []
    raised: list[float] = []
    # parameters + gradients + Adam's two moments: 4 floats per parameter
    width = max(1, mb * 1_000_000 // 16 // 1024)

    @inprocess.Wrapper(initialize=inprocess.initialize.RetryController(max_iterations=restarts + 1))
    def train(call_wrapper: inprocess.CallWrapper = None) -> int:
        if raised:
            latency.append(time.monotonic() - raised[-1])
        rss.append(psutil.Process().memory_info().rss / 1e6)
        dist.init_process_group("gloo")
        model = torch.nn.Linear(1024, width)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.ones(1, 1024)).sum().backward()
        opt.step()
        state = {"model": model, "optim": opt}
        call_wrapper.restore(state)
        call_wrapper.commit(state, call_wrapper.iteration + 1)
        if call_wrapper.iteration < restarts:
            raised.append(time.monotonic())
            raise RuntimeError("a fault")
        dist.destroy_process_group()
        return call_wrapper.iteration

    train()
    fifth = rss[min(5, len(rss) - 1)]
    return {
        "mb": mb,
        "restarts": restarts,
        "rss_mb_after_5": round(fifth),
        "rss_mb_after_last": round(rss[-1]),
        "rss_mb_peak": round(max(rss)),
        "last_over_fifth": round(rss[-1] / fifth, 3),
        "restart_s_median": round(statistics.median(latency), 4),
        "restart_s_max": round(max(latency), 4),
        "rss_mb": [round(r) for r in rss],
    }


def in_tree(tree: str, argv: list[str]) -> dict[str, object]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--one", *argv], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"tree {tree} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400, help="state per iteration, MB (default 400)")
    parser.add_argument("--restarts", type=int, default=50, help="in-process restarts (default 50)")
    parser.add_argument(
        "--tree", action="append", default=None, help="a source tree (repeatable; default .)"
    )
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mb < 1:
        parser.error(f"--mb must be >= 1, got {args.mb}")
    if args.restarts < 6:
        parser.error(f"--restarts must be >= 6 (the 5th is the anchor), got {args.restarts}")
    argv = ["--mb", str(args.mb), "--restarts", str(args.restarts)]
    if args.one:
        print(json.dumps(one_run(args.mb, args.restarts)), flush=True)
        return
    for tree in [str(Path(t).resolve()) for t in (args.tree or ["."])]:
        result = in_tree(tree, argv)
        print(json.dumps({"tree": tree, **result}), flush=True)


if __name__ == "__main__":
    main()
