"""Latency of the store barriers with many concurrent clients on one TCPStore.

One ``inprocess.store.TCPStore`` server runs in this process. ``--procs`` worker
processes each run ``--threads`` threads; every thread is one client with its
own connection (``is_master=False``), standing for one rank. All clients pass
``--barriers`` consecutive ``StoreMixin.counted_barrier`` calls, then as many
``StoreMixin.rendezvous`` calls, each with a fresh name.

Per barrier it reports:

* release: from the last client's arrival to the last client's return, the
  barrier's own latency once everybody is there;
* round: from the previous barrier's last return to this one's, what a loop of
  back-to-back barriers costs.

and the store operations per second that the server answered during each
phase (counted on the clients). Prints median and 90th percentile over the barriers.
Starting the workers and connecting the clients is not measured.

    python benchmarks/store_barrier.py                       # 64 then 1024 clients
    python benchmarks/store_barrier.py --config 8x128 --poll-limit 0.05
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import multiprocessing
import os
import statistics
import threading
import time
from typing import Any

# Set before torch is imported here and in the spawned workers:
# torch's TCPStore clients warn on every connection where a socket's host name
# cannot be looked up, and look host names up: where DNS drops packets, each
# lost lookup stalls a connection for the resolver's 5 s timeout. Connections
# are not measured, but this keeps the run short.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

from inprocess._net import free_port
from inprocess.store import TCPStore

TIMEOUT = datetime.timedelta(seconds=60)
#: seconds for the workers to start and every client to connect
CONNECT_DEADLINE = 150


class CountingTCPStore(TCPStore):
    """A client that counts the store operations it sends."""

    ops = 0

    def _count(self) -> None:
        self.ops += 1

    def set(self, *args: Any) -> Any:
        self._count()
        return super().set(*args)

    def get(self, *args: Any) -> Any:
        self._count()
        return super().get(*args)

    def add(self, *args: Any) -> Any:
        self._count()
        return super().add(*args)

    def check(self, *args: Any) -> Any:
        self._count()
        return super().check(*args)

    def append(self, *args: Any) -> Any:
        self._count()
        return super().append(*args)

    def compare_set(self, *args: Any) -> Any:
        self._count()
        return super().compare_set(*args)

    def multi_get(self, *args: Any) -> Any:
        self._count()
        return super().multi_get(*args)


def decide(arrivals: dict[str, str], terminated: set[str], baseline: int) -> str:
    return f"{len(arrivals)}:{baseline}"


def client(
    port: int,
    identity: str,
    participants: list[str],
    barriers: int,
    poll_limit: float,
    records: list[tuple[str, int, float, float]],
    ops: dict[str, int],
    errors: list[str],
) -> None:
    try:
        store = CountingTCPStore(host_name="127.0.0.1", port=port, is_master=False, timeout=TIMEOUT)
        store.add("connected", 1)
        store.wait(["go"], datetime.timedelta(seconds=CONNECT_DEADLINE + 30))
        total = len(participants)
        store.ops = 0
        for k in range(barriers):
            start = time.monotonic()
            store.counted_barrier(f"cb/{k}", identity, total, TIMEOUT, poll_limit)
            records.append(("counted_barrier", k, start, time.monotonic()))
        ops["counted_barrier"] = ops.get("counted_barrier", 0) + store.ops
        store.ops = 0
        for k in range(barriers):
            start = time.monotonic()
            store.rendezvous(f"rv/{k}", identity, participants, "1", TIMEOUT, decide, poll_limit)
            records.append(("rendezvous", k, start, time.monotonic()))
        ops["rendezvous"] = ops.get("rendezvous", 0) + store.ops
        del store
    except BaseException as ex:
        errors.append(f"{identity}: {ex!r}")


def worker(
    port: int, proc: int, threads: int, total: int, barriers: int, poll_limit: float, out: Any
) -> None:
    participants = [f"{p}/{t}" for p in range(total // threads) for t in range(threads)]
    records: list[tuple[str, int, float, float]] = []
    ops: dict[str, int] = {}
    errors: list[str] = []
    per_thread_ops: list[dict[str, int]] = [{} for _ in range(threads)]
    pool = [
        threading.Thread(
            target=client,
            args=(
                port,
                f"{proc}/{t}",
                participants,
                barriers,
                poll_limit,
                records,
                per_thread_ops[t],
                errors,
            ),
            daemon=True,
        )
        for t in range(threads)
    ]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(TIMEOUT.total_seconds() * 2)
    for counts in per_thread_ops:
        for name, value in counts.items():
            ops[name] = ops.get(name, 0) + value
    if any(thread.is_alive() for thread in pool):
        errors.append(f"process {proc}: a client thread did not finish")
    out.put((proc, records, ops, errors))


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[round(0.9 * (len(ordered) - 1))]


def run(procs: int, threads: int, barriers: int, poll_limit: float) -> None:
    total = procs * threads
    port = free_port()
    server = TCPStore(host_name="127.0.0.1", port=port, is_master=True, timeout=TIMEOUT)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    workers = [
        ctx.Process(
            target=worker,
            args=(port, p, threads, total, barriers, poll_limit, out),
            daemon=True,
        )
        for p in range(procs)
    ]
    results = []
    try:
        for process in workers:
            process.start()
        started = time.monotonic()
        deadline = started + CONNECT_DEADLINE
        while int(server.add("connected", 0)) < total:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {int(server.add('connected', 0))} of {total} clients connected "
                    f"within {CONNECT_DEADLINE} s"
                )
            time.sleep(0.05)
        connect_time = time.monotonic() - started
        server.set("go", "1")
        for _ in range(procs):
            results.append(out.get(timeout=TIMEOUT.total_seconds() * 2))
    finally:
        for process in workers:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
        del server

    errors = [e for _, _, _, errs in results for e in errs]
    if errors:
        print(f"{len(errors)} errors, first: {errors[0]}")
    print(
        f"\n{total} clients ({procs} processes x {threads} threads), "
        f"{barriers} barriers of each kind, poll_limit {poll_limit * 1e3:g} ms "
        f"(start and connect: {connect_time:.1f} s, not measured)"
    )
    print(
        f"{'barrier':<16} {'release med ms':>14} {'release p90':>12} "
        f"{'round med ms':>13} {'round p90':>10} {'ops/s':>9} {'ops/client/barrier':>19}"
    )
    for kind in ("counted_barrier", "rendezvous"):
        spans: dict[int, list[tuple[float, float]]] = {}
        for _, records, _, _ in results:
            for name, k, start, end in records:
                if name == kind:
                    spans.setdefault(k, []).append((start, end))
        complete = [k for k in sorted(spans) if len(spans[k]) == total]
        release = [max(e for _, e in spans[k]) - max(s for s, _ in spans[k]) for k in complete]
        last_out = [max(e for _, e in spans[k]) for k in complete]
        rounds = [b - a for a, b in itertools.pairwise(last_out)]
        phase = max(last_out) - min(s for k in complete for s, _ in spans[k])
        ops = sum(o.get(kind, 0) for _, _, o, _ in results)
        rel_med, rel_p90 = percentiles(release)
        rnd_med, rnd_p90 = percentiles(rounds) if rounds else (float("nan"),) * 2
        print(
            f"{kind:<16} {rel_med * 1e3:>14.1f} {rel_p90 * 1e3:>12.1f} "
            f"{rnd_med * 1e3:>13.1f} {rnd_p90 * 1e3:>10.1f} {ops / phase:>9.0f} "
            f"{ops / total / len(complete):>19.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        action="append",
        help="PROCSxTHREADS, repeatable (default: 4x16 and 8x128)",
    )
    parser.add_argument("--barriers", type=int, default=10)
    parser.add_argument("--poll-limit", type=float, default=0.02, help="seconds")
    args = parser.parse_args()
    for config in args.config or ["4x16", "8x128"]:
        procs, threads = (int(x) for x in config.lower().split("x"))
        run(procs, threads, args.barriers, args.poll_limit)


if __name__ == "__main__":
    main()
