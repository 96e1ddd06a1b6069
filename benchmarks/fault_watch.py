"""A quiet job's store traffic, and how fast a computing rank hears of a peer's fault.

Real ``Wrapper`` ranks (default settings: 1 s intervals, 30 s heartbeat
timeout) on one ``TCPStore`` server in a process of its own. Two figures:

* steady state: store operations (read system calls of the server, as in
  ``restart_scale.py``) per rank per second while every rank waits in its
  function (a Python sleep loop: progress, no store use of its own);
* fault notice: rank 0 raises while the others compute (a Python loop, no
  collective that a peer's abort could break): the time from the raise to the
  last other rank's restart exception.

``--baseline-commit REV`` measures an earlier commit the same way in the same
run (a temporary ``git worktree``), alternating, for a side-by-side figure.

    PYTHONPATH=. python benchmarks/fault_watch.py --ranks 4 --window 40 --faults 8 \\
        --baseline-commit a4de051
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restart_scale import HOST, serve, server_io

REPO = Path(__file__).resolve().parent.parent

RANK = r"""
import os, sys, time, logging
logging.basicConfig(level=logging.ERROR)
from inprocess import CallWrapper, Wrapper
rank, faults, flags = int(os.environ["RANK"]), int(sys.argv[1]), sys.argv[2]

def until(name):
    while not os.path.exists(os.path.join(flags, name)):
        time.sleep(0.05)

def note(name, text=""):
    path = os.path.join(flags, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)

@Wrapper(abort=None, store_kwargs={"host_name": "127.0.0.1", "is_master": False})
def train(call_wrapper: CallWrapper | None = None):
    i = call_wrapper.iteration
    note(f"ready-{rank}-{i}")
    if i == faults:
        until("stop")
        return
    until(f"go-{i}")
    if rank == 0:
        note(f"raised-{i}", repr(time.time()))
        raise RuntimeError(f"fault {i}")
    try:
        while True:
            pass
    except BaseException:
        note(f"heard-{rank}-{i}", repr(time.time()))
        raise

train()
"""


def measure(tree: Path, ranks: int, window: float, faults: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(queue, stop), daemon=True)
    server.start()
    pid, port = queue.get(timeout=120)
    flags = Path(tempfile.mkdtemp(prefix="fault-watch-"))
    env = dict(
        os.environ,
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
        WORLD_SIZE=str(ranks),
        PYTHONPATH=str(tree),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(faults), str(flags)],
            env=dict(env, RANK=str(r)),
            cwd=flags,
        )
        for r in range(ranks)
    ]

    def wait_for(names: list[str], timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not all((flags / n).exists() for n in names):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                codes = [p.poll() for p in procs]
                raise RuntimeError(f"ranks did not get to {names[0]} (exit codes {codes})")
            time.sleep(0.05)

    try:
        wait_for([f"ready-{r}-0" for r in range(ranks)])
        time.sleep(3.0)  # past the start of every monitor process and fault watch
        io0 = server_io(pid)
        time.sleep(window)
        io1 = server_io(pid)
        notice = []
        for i in range(faults):
            (flags / f"go-{i}").touch()
            wait_for([f"heard-{r}-{i}" for r in range(1, ranks)])
            raised = float((flags / f"raised-{i}").read_text())
            heard = max(float((flags / f"heard-{r}-{i}").read_text()) for r in range(1, ranks))
            notice.append(heard - raised)
            wait_for([f"ready-{r}-{i + 1}" for r in range(ranks)])
        (flags / "stop").touch()
        for proc in procs:
            proc.wait(120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stop.set()
        server.join(30)
    return {
        "ops_per_rank_per_s": round((io1[1] - io0[1]) / ranks / window, 3),
        "bytes_per_rank_per_s": round((io1[0] - io0[0]) / ranks / window, 1),
        "notice_median_s": round(statistics.median(notice), 3),
        "notice_max_s": round(max(notice), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--window", type=float, default=40.0, help="seconds of steady state")
    parser.add_argument("--faults", type=int, default=8, help="faults to time, one at a time")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per tree")
    parser.add_argument("--baseline-commit", help="also measure this commit, side by side")
    args = parser.parse_args()
    if args.ranks < 2 or args.faults < 1 or args.window <= 0 or args.rounds < 1:
        parser.error("--ranks >= 2, --faults >= 1, --window > 0 and --rounds >= 1, please")
    trees = [("this tree", REPO)]
    worktree = None
    if args.baseline_commit:
        worktree = Path(tempfile.mkdtemp(prefix="fault-watch-base-"))
        subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "worktree",
                "add",
                "--detach",
                str(worktree),
                args.baseline_commit,
            ],
            check=True,
            capture_output=True,
        )
        trees.insert(0, (args.baseline_commit, worktree))
    try:
        for round_ in range(args.rounds):
            for name, tree in trees:
                result = {
                    "tree": name,
                    "round": round_,
                    "ranks": args.ranks,
                    "window_s": args.window,
                    "faults": args.faults,
                }
                result.update(measure(tree, args.ranks, args.window, args.faults))
                print(json.dumps(result), flush=True)
    finally:
        if worktree is not None:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
                check=False,
            )


if __name__ == "__main__":
    main()
