"""How long one rank's ``Tree`` rank assignment takes at 16384 ranks.

A 3-level tree: the job (root), 16 racks of 128 hosts of 8 ranks. Two layer
configurations:

* ``spare-hosts``: racks run at most 960 active ranks (8 spare hosts each), a
  host keeps running with any number of healthy ranks; lost active ranks are
  replaced from the host, then the rack, then the job (RESERVE on every layer),
  then backfilled within the rack;
* ``whole-hosts``: the same, but a host with a lost rank is given up whole
  (``min_ranks=8``), so 1024 lost ranks take ~840 hosts with them.

Measured: one rank's ``Tree.__call__`` after an iteration in which
``--terminated`` random ranks were lost (the tree already built, as on every
call after the first): median and max of ``--repeat`` runs, each with another
random set; wall-clock and this process's CPU time (the latter less
disturbed by other load on a shared machine). Also one rank's first call (keys
exchange through an in-process store as the last rank to arrive, parsing every
rank's keys, building the tree).
Target: the call after a fault under 50 ms.

    python benchmarks/tree_assignment.py [--world-size 16384] [--terminated 1024]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch.distributed as dist

from inprocess import protocol as P
from inprocess.rank_assignment import Layer, LayerFlag, RankAssignmentCtx, Tree
from inprocess.state import State
from inprocess.store import StoreMixin


class HashStore(dist.HashStore, StoreMixin):
    pass


def layers(whole_hosts: bool) -> list[Layer]:
    reserve = LayerFlag.RESERVE
    return [
        Layer(min_ranks=1, key_or_fn="job", flag=reserve),
        Layer(
            min_ranks=64,
            max_ranks=960,
            key_or_fn=lambda s: f"rack{s.initial_rank // 1024}",
            flag=reserve | LayerFlag.BACKFILL,
        ),
        Layer(
            min_ranks=8 if whole_hosts else 1,
            max_ranks=8,
            key_or_fn=lambda s: f"host{s.initial_rank // 8}",
            flag=reserve,
        ),
    ]


def build(whole_hosts: bool, world_size: int) -> tuple[Tree, State, float]:
    """A Tree after its first call on the last rank; the call's duration."""
    tree = Tree(layers(whole_hosts))
    me = world_size - 1
    store = HashStore()
    # The other ranks' arrivals, as all_gather_lines records them: a line and an
    # arrival each, and the arrival count.
    lines = []
    for r in range(world_size - 1):
        keys = [layer.key(State(rank=r, world_size=world_size)) for layer in tree.layers]
        lines.append(f"{r}={json.dumps([r, r, keys])}")
    store.add_entries("inprocess/tree/lines", lines)
    barrier = "inprocess/tree/barrier"
    store.add_entries(P.arrivals_key(barrier), [str(r) for r in range(world_size - 1)])
    store.add(P.count_key(barrier), world_size - 1)
    state = State(rank=me, world_size=world_size)
    start = time.perf_counter()
    out = tree(RankAssignmentCtx(state, store, set())).state
    return tree, out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=16384)
    parser.add_argument("--terminated", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"world size {args.world_size}, {args.terminated} ranks lost, {args.repeat} runs")
    print(
        "| layers | first call | after a fault: median | max | CPU time: median | max "
        "| new world size | active |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, whole_hosts in (("spare-hosts", False), ("whole-hosts", True)):
        tree, first, build_s = build(whole_hosts, args.world_size)
        saved = (tree._assigned_iteration, tree._base, tree._result)
        samples, cpu = [], []
        sizes = set()
        for _ in range(args.repeat):
            tree._assigned_iteration, tree._base, tree._result = saved
            others = [r for r in range(first.world_size) if r != first.rank]
            lost = set(rng.sample(others, args.terminated))
            state = first.copy()
            state.iteration = 0
            ctx = RankAssignmentCtx(state, None, lost)
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                out = tree(ctx).state
                sizes.add((out.world_size, out.active_world_size))
            except Exception as ex:  # this rank's host was given up
                sizes.add(type(ex).__name__)
            cpu.append(time.process_time() - start_cpu)
            samples.append(time.perf_counter() - start)
        world, active = sorted(s for s in sizes if isinstance(s, tuple))[0]
        print(
            f"| {name} | {build_s * 1e3:.1f} ms | {statistics.median(samples) * 1e3:.1f} ms "
            f"| {max(samples) * 1e3:.1f} ms | {statistics.median(cpu) * 1e3:.1f} ms "
            f"| {max(cpu) * 1e3:.1f} ms | {world} | {active} |"
        )


if __name__ == "__main__":
    main()
