"""How long one rank's rank assignment takes at 16384 ranks, and a whole job's.

Measures, for a job of ``--world-size`` ranks of which ``--terminated`` are lost:

* one rank's ``ShiftRanks`` and ``FillGaps`` call (the highest surviving rank,
  the worst case of ``FillGaps``);
* one rank's ``Compose(ShiftRanks(), FilterGroupedByKey(...))`` call, as the
  last survivor to arrive: the store already holds every other survivor's key
  and barrier arrival, so the figure is this rank's own work (its store
  round trips, reading and parsing every survivor's key, grouping). Measured on
  an in-process ``HashStore`` and on a ``TCPStore`` over loopback;
* every rank of the job calling ``ShiftRanks`` / ``FillGaps`` one after the other
  in this process (the CPU cost of the whole job, as if on one core).

The target is under 0.1 s per rank's assignment. Prints the median and the
90th percentile of ``--repeat`` runs.

    python benchmarks/rank_assignment_scale.py [--world-size 16384] [--terminated 1024]
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import time
from collections.abc import Callable

import torch.distributed as dist

from inprocess._net import free_port
from inprocess.compose import Compose
from inprocess.rank_assignment import FillGaps, FilterGroupedByKey, RankAssignment, ShiftRanks
from inprocess.state import State
from inprocess.store import StoreMixin, TCPStore


class HashStore(dist.HashStore, StoreMixin):
    pass


def tcp_store(port: int, is_master: bool) -> StoreMixin:
    timeout = datetime.timedelta(seconds=60)
    return TCPStore(host_name="127.0.0.1", port=port, is_master=is_master, timeout=timeout)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return statistics.median(ordered), p90


def time_one_rank(
    assignment: RankAssignment, rank: int, world_size: int, terminated: set[int], repeat: int
) -> list[float]:
    samples = []
    for _ in range(repeat):
        state = State(rank=rank, world_size=world_size)
        start = time.perf_counter()
        assignment(state, terminated)
        samples.append(time.perf_counter() - start)
    return samples


def time_whole_job(
    assignment: RankAssignment, world_size: int, terminated: set[int], repeat: int
) -> list[float]:
    survivors = [r for r in range(world_size) if r not in terminated]
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for rank in survivors:
            assignment(State(rank=rank, world_size=world_size), terminated)
        samples.append(time.perf_counter() - start)
    return samples


def prefill(
    store: StoreMixin, fgk: FilterGroupedByKey, others: list[int], key: Callable[[int], str]
) -> None:
    """Writes what every survivor but one would have written, in three store calls."""
    prefix = f"inprocess/filter_grouped_by_key/{fgk.name}"
    store.set(f"{prefix}/keys", "".join(f"{r}={key(r)}\n" for r in others))
    store.set(f"{prefix}/barrier/arrivals", "".join(f"{r}," for r in others))
    store.add(f"{prefix}/barrier/count", len(others))


def time_filter_chain(
    make_store: Callable[[], StoreMixin],
    world_size: int,
    terminated: set[int],
    group: int,
    repeat: int,
) -> list[float]:
    survivors = [r for r in range(world_size) if r not in terminated]
    rank, others = survivors[-1], survivors[:-1]
    samples = []
    for _ in range(repeat):
        fgk = FilterGroupedByKey(
            key_or_fn=lambda r, _: f"group{r // group}", condition=lambda c: c == group
        )
        chain = Compose(ShiftRanks(), fgk)
        store = make_store()
        try:
            prefill(store, fgk, others, lambda r: f"group{r // group}")
            state = State(rank=rank, world_size=world_size, store=store)
            start = time.perf_counter()
            chain(state, terminated)
            samples.append(time.perf_counter() - start)
        finally:
            del store
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=16384)
    parser.add_argument("--terminated", type=int, default=1024)
    parser.add_argument("--group", type=int, default=8, help="FilterGroupedByKey group size")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--job-repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    world_size = args.world_size
    terminated = set(random.Random(args.seed).sample(range(world_size), args.terminated))
    highest = max(r for r in range(world_size) if r not in terminated)

    port = free_port()
    server = tcp_store(port, is_master=True)
    client_stores: list[StoreMixin] = []

    def tcp_client() -> StoreMixin:
        # One connection is reused; each run gets fresh keys from a new instance name.
        if not client_stores:
            client_stores.append(tcp_store(port, is_master=False))
        return client_stores[0]

    rows: list[tuple[str, list[float]]] = [
        (
            "one rank: ShiftRanks",
            time_one_rank(ShiftRanks(), highest, world_size, terminated, args.repeat),
        ),
        (
            "one rank: FillGaps",
            time_one_rank(FillGaps(), highest, world_size, terminated, args.repeat),
        ),
        (
            f"one rank: Compose(ShiftRanks, FilterGroupedByKey/{args.group}), HashStore",
            time_filter_chain(HashStore, world_size, terminated, args.group, args.repeat),
        ),
        (
            f"one rank: Compose(ShiftRanks, FilterGroupedByKey/{args.group}), TCPStore",
            time_filter_chain(tcp_client, world_size, terminated, args.group, args.repeat),
        ),
        (
            "whole job, sequential: ShiftRanks",
            time_whole_job(ShiftRanks(), world_size, terminated, args.job_repeat),
        ),
        (
            "whole job, sequential: FillGaps",
            time_whole_job(FillGaps(), world_size, terminated, args.job_repeat),
        ),
    ]
    del client_stores[:], server

    print(f"world size {world_size}, {len(terminated)} terminated ranks")
    print(f"{'operation':<66} {'median ms':>10} {'p90 ms':>10} {'runs':>5}")
    for name, samples in rows:
        median, p90 = percentiles(samples)
        print(f"{name:<66} {median * 1e3:>10.3f} {p90 * 1e3:>10.3f} {len(samples):>5}")


if __name__ == "__main__":
    main()
