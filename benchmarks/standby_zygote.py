"""Warm standbys forked from a zygote against spawned ones, side by side.

A local backend keeps one standby on each of ``--slots`` node slots; then
``--replacements`` times a standby becomes a worker (a script that exits at
once) and the pool makes a new one. Measured per mode: seconds until every
slot has a ready standby, seconds from a standby's assignment until its
replacement is ready, and the CPU seconds all the pool's processes used
(``RUSAGE_CHILDREN`` once they are reaped: a forked standby's time counts
through its zygote; the workers' own exits are in both).

    .venv/bin/python benchmarks/standby_zygote.py --slots 2 --replacements 3
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from inprocess.failover.backends import WorkerLaunch
from inprocess.failover.backends.local import LocalBackend
from inprocess.failover.standby import common_env


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _ready(
    backend: LocalBackend, slots: int, ended: set[int] | None = None, timeout: float = 900.0
) -> None:
    """Waits until every slot has a ready standby; pids that end meanwhile go to ``ended``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for exit_ in backend.wait(0.01):
            if ended is not None:
                ended.add(exit_.pid)
        pools = [backend.standbys._standbys.get(s, []) for s in range(slots)]
        if all(pool and all(s.check_ready() for s in pool) for pool in pools):
            return
    raise RuntimeError("standbys did not get ready")


def run(fork: bool, slots: int, replacements: int, tmp: Path) -> dict[str, float | list[float]]:
    script = tmp / "exit.py"
    script.write_text("pass\n")
    backend = LocalBackend(tmp / f"state-{fork}")
    backend.standbys.fork = fork
    cpu0 = _cpu()
    start = time.monotonic()
    envs = [common_env(dict(os.environ, INPROCESS_NODE_SLOT=str(s))) for s in range(slots)]
    try:
        for slot, env in enumerate(envs):
            backend.keep_standbys(slot, 1, env)
        _ready(backend, slots)
        first = time.monotonic() - start
        again = []
        for i in range(replacements):
            launch = WorkerLaunch(
                worker=0,
                incarnation=i + 1,
                node=0,
                slot=0,
                argv=(sys.executable, str(script)),
                env=dict(envs[0], RANK="0"),
            )
            pid, _ = backend.start(launch)
            t0 = time.monotonic()
            ended: set[int] = set()
            _ready(backend, slots, ended)  # the used standby's replacement
            again.append(time.monotonic() - t0)
            while pid not in ended:  # the worker's own end (an interpreter exit with torch)
                ended.update(e.pid for e in backend.wait(0.01))
    finally:
        backend.close()
    return {"first": first, "again": again, "cpu": _cpu() - cpu0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--replacements", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            mode: run(mode == "forked", args.slots, args.replacements, Path(tmp))
            for mode in ("spawned", "forked")
        }
    print(f"{args.slots} slots x 1 standby, then {args.replacements} replacements on slot 0")
    print(f"{'mode':<8} {'all ready (s)':>14} {'replacement median (s)':>23} {'CPU (s)':>8}")
    for mode, r in results.items():
        again = r["again"]
        assert isinstance(again, list)
        median = statistics.median(again) if again else float("nan")
        print(f"{mode:<8} {r['first']:>14.2f} {median:>23.3f} {r['cpu']:>8.1f}")
    spawned, forked = results["spawned"], results["forked"]
    print(f"CPU forked/spawned: {float(forked['cpu']) / float(spawned['cpu']):.2f}")


if __name__ == "__main__":
    main()
