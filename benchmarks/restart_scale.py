"""What one restart's protocol costs at many ranks, beside torch's own store barrier.

One ``inprocess.store.TCPStore`` server (torch's libuv server) runs in a process
of its own. ``--procs`` worker processes each run N/procs threads; every thread
is one simulated rank with its own client connection. Each rank runs the
Wrapper's own code for a call and for one restart after an exception (the
methods of :class:`inprocess.wrap.CallWrapper` that ``_run`` calls, on a real
``CallWrapper`` with the default rank assignment ``ShiftRanks``):

* once, not measured: ``_initial_barrier`` then ``_iteration_barrier(0)``;
* per restart: one rank's function raised (``_classify_fault`` records the fault
  and decides the outcome), every other rank was interrupted in its function (its
  monitor thread needs no proposal of the outcome there; its ``_classify_fault``
  sees ``RankShouldRestart``),
  then ``_abort``, ``_finalize``, ``_health_check`` (no callbacks: no work),
  ``_termination_barrier``, ``publish_phases``, ``_iteration_barrier(k + 1)``
  (the rank hands its monitor process the new peers through shared memory:
  no store operation). With the default rank assignment every rank derives
  the new membership from the termination barrier's decision, as ``_run``
  does: one rendezvous per restart; ``--membership barrier`` agrees on it at
  the iteration barrier instead (two), as a rank assignment that may reorder
  the survivors does;
* in the same run, at the same N, torch's
  ``torch.distributed.elastic.utils.store.barrier`` twice on each rank's client.

With ``--ranks-per-node K`` (default 8) every K consecutive ranks are a node
whose arrivals at the two rendezvous go through its relay
(:mod:`inprocess.relay`, what the node's leader runs), hosted in processes of
their own as node leaders are; ``--ranks-per-node 1``: every rank arrives on
its own.

All ranks start a restart at once (released by one key): the time for the
monitor threads to notice a fault is not part of the protocol's cost.
``restart_s`` runs from that release to the last rank's return from the
iteration barrier; ``torch_barrier_x2_s`` from its release to the last rank's
return from the second barrier. ``server_bytes`` is the growth of ``rchar +
wchar`` in ``/proc/<server pid>/io`` (bytes the server read from and wrote to
its sockets) over one restart, and ``server_ops`` the growth of ``syscr`` (read
system calls: one per request of a client that waits for each answer, as every
client here does); ``server_cpu_s`` the CPU time of the server's threads
(``/proc/<pid>/task/*/schedstat``): the one part of a restart that does not
run in parallel across a real job's hosts. All three are less the harness's
own release/finish keys, measured by an empty round. ``timeline_s``: when the
ranks of the first restart had classified the fault, left the termination
barrier and left the iteration barrier (first, median, last, from the release).
``server_connections`` and ``server_fds``: the most client connections the
server held at once (established TCP connections to its port, sampled every
0.5 s from before the first rank connects to after the last round) and the
most descriptors it had open; ``connections_per_rank`` the first over N
(``server_cpu_us_per_rank``: the CPU over N). Each simulated rank holds its
own client and, once it waited at a rendezvous, the connection its thread
waits on (:mod:`inprocess.quiet_wait`); each node's relay two more, each
relay host one it appends with; the harness two (its control client and the
server's own). With ``--steady``, ``connections_per_rank`` is the library's
alone: less the harness's two and the client each rank's function opens.

``--steady SECONDS`` also runs a few real ``Wrapper`` ranks (processes with
monitor thread and monitor process) in a function that only sleeps, and
counts the server's operations per rank per second with no fault
(``--steady-spares K``: K of them are spares, which wait in the completion
barrier meanwhile; ``--steady-nodes K``: the ranks run as K simulated nodes,
``INPROCESS_NODE`` set per rank, each node with its own node group).

    python benchmarks/restart_scale.py --ranks 1024,4096 --json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
import types
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

#: the initial rank whose function raises
FAULTY = 1
#: the Python switch interval of the processes that host simulated ranks and relays.
#: Hundreds of threads share one interpreter there (a real rank has its own): at
#: the default 5 ms every thread waiting for the GIL wakes each 5 ms to ask for
#: it, a cost that grows with the threads per process, not with the protocol.
SWITCH_INTERVAL = 0.05
HOST = "127.0.0.1"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# ----------------------------------------------------------------------------- server


def serve(queue: Any, stop: Any) -> None:
    """The store server's process: hosts the store until ``stop`` is set."""
    from inprocess._net import free_port
    from inprocess.store import TCPStore

    store = TCPStore(host_name=HOST, port=free_port(), is_master=True, timeout=_td(900))
    queue.put((os.getpid(), store.port))
    stop.wait()
    del store


def server_io(pid: int) -> tuple[int, int, int]:
    """(bytes read + written, read system calls, CPU nanoseconds of all its threads)
    of the server so far."""
    with open(f"/proc/{pid}/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    cpu = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
            cpu += int(f.read().split()[0])
    return int(fields["rchar"]) + int(fields["wchar"]), int(fields["syscr"]), cpu


def server_connections(pid: int, port: int) -> int:
    """Established TCP connections whose server end is the store's listening ``port``
    (one per client connection: a loopback pair's other end is not counted)."""
    suffix = f":{port:04X}"
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f, None)
            for line in f:
                fields = line.split(None, 4)
                if len(fields) > 3 and fields[3] == "01" and fields[1].endswith(suffix):
                    count += 1
    return count


def open_fds(pid: int) -> int:
    """The open file descriptors of process ``pid``."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class ServerWatch:
    """Samples the store server's established connections and open descriptors on a
    thread of its own (every ``interval`` seconds) and keeps the peaks: what the one
    server holds for the job, the part that does not spread over hosts."""

    def __init__(self, pid: int, port: int, interval: float = 0.5) -> None:
        self.pid, self.port, self.interval = pid, port, interval
        self.peak_connections = self.peak_fds = 0
        self._lock = threading.Lock()  # the sampling thread and the run's phases both sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-watch", daemon=True)

    def sample(self) -> None:
        connections, fds = server_connections(self.pid, self.port), open_fds(self.pid)
        with self._lock:
            self.peak_connections = max(self.peak_connections, connections)
            self.peak_fds = max(self.peak_fds, fds)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> ServerWatch:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the sampling thread (after a last sample)."""
        self._stop.set()
        self._thread.join()
        self.sample()

    def report(self, result: dict[str, Any], ranks: int, prefix: str = "") -> None:
        """Adds the peaks, in all and per rank, to ``result``."""
        result[f"{prefix}server_connections"] = self.peak_connections
        result[f"{prefix}server_fds"] = self.peak_fds
        result[f"{prefix}connections_per_rank"] = round(self.peak_connections / ranks, 2)


# ----------------------------------------------------------------------------- ranks


def _finish(raw: Any, phase: str, n: int) -> None:
    if int(raw.add(f"bench/{phase}/n", 1)) == n:
        raw.set(f"bench/{phase}/done", "1")


def call_namespace() -> str:
    """The call namespace of a real job (a torchrun run's, keyed with a secret)."""
    from inprocess import protocol
    from inprocess.security import keyed_namespace

    role = protocol.role_namespace(keyed_namespace("torchelastic/bench-run/0", "secret"))
    return protocol.call_namespace(role, 0)


def node_group(port: int, node: int) -> str:
    """The node group's directory of simulated node ``node`` (as its ranks find it)."""
    from inprocess.node import group_dir

    return group_dir(call_namespace(), f"node{node}", f"tcp://{HOST}:{port}")


def relay_host(
    port: int,
    nodes: list[int],
    per_node: int,
    n: int,
    timeout: float,
    switch_interval: float,
    ready: Any,
    stop: Any,
) -> None:
    """A process hosting the relays of simulated ``nodes``, as their leaders run them
    (inprocess.relay): in a process of its own, as a node leader's monitor process
    is. Each relay has its own waiting client; the relays of this process share the
    client they append batches with (one server connection, not one per node: at
    16k ranks the server's descriptors run out otherwise)."""
    from inprocess.node import _private_dir
    from inprocess.relay import NodeRelay
    from inprocess.store import PrefixStore, TCPStore

    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("inprocess").setLevel(logging.ERROR)
    sys.setswitchinterval(switch_interval)

    def connect() -> Any:
        raw = TCPStore(host_name=HOST, port=port, is_master=False, timeout=_td(timeout))
        return PrefixStore(call_namespace(), raw)

    shared = connect()
    relays = []
    for node in nodes:
        directory = node_group(port, node)
        _private_dir(directory)
        local = min(per_node, n - node * per_node)
        relay = NodeRelay(
            directory, connect, expected=lambda local=local: local, append_store=shared
        )
        relay.start()
        relays.append(relay)
    ready.put(len(relays))
    stop.wait()
    for relay in relays:
        relay.stop()
        with contextlib.suppress(OSError):
            os.rmdir(relay.directory)


def rank_main(
    port: int,
    rank: int,
    n: int,
    rounds: int,
    timeout: float,
    per_node: int,
    ends: dict[str, float],
    marks: list[tuple[int, float, float, float]],
    errors: list,
    derive: bool = True,
) -> None:
    """One simulated rank: the Wrapper's code for the setup and for ``rounds`` restarts
    (``derive=False``: the membership agreed at the iteration barrier)."""
    import torch.distributed.elastic.utils.store as elastic_store

    from inprocess import Wrapper, records
    from inprocess.monitor_thread import RankShouldRestart
    from inprocess.progress_watchdog import ProgressBoard
    from inprocess.relay import RelayClient
    from inprocess.state import State
    from inprocess.store import PrefixStore, TCPStore
    from inprocess.wrap import CallWrapper, _Result

    try:
        raw = TCPStore(host_name=HOST, port=port, is_master=False, timeout=_td(timeout))
        raw.add("bench/connected", 1)
        raw.wait(["bench/start"], _td(timeout))
        wrapper = Wrapper(abort=None, barrier_timeout=_td(timeout))
        cw = CallWrapper(wrapper)
        cw.state = State(rank=rank, world_size=n)
        cw.namespace = call_namespace()
        cw.identity = cw._call_identity()  # a launch identity, as a started job's ranks have
        cw._records = records.Recorder(None, cw.identity, "", 0)
        # where the rank hands its monitor process the peers to watch (local memory;
        # before, a store record its monitor process read)
        cw._board = ProgressBoard()
        cw.store = PrefixStore(cw.namespace, raw)
        if per_node > 1:
            cw._relay = RelayClient(node_group(port, rank // per_node), cw.identity)
        members = cw._initial_barrier()
        current = cw._iteration_barrier(0, cw._copy_state(), members, set(), [])
        _finish(raw, "setup", n)
        for k in range(rounds):
            # an empty round: the harness's own cost, subtracted from the others
            raw.wait([f"bench/null{k}/go"], _td(timeout))
            _finish(raw, f"null{k}", n)

            raw.wait([f"bench/restart{k}/go"], _td(timeout))
            # The faulty rank's own exception; the others' monitor threads raise the
            # restart exception in their function (where no proposal of the
            # outcome is needed: the iteration cannot complete without them).
            ex = RuntimeError("injected fault") if rank == FAULTY else RankShouldRestart()
            cw._classify_fault(_Result(exception=ex), types.SimpleNamespace(cause="fault"))
            classified = time.monotonic()
            previous = cw._copy_state()
            cw._abort()
            cw._finalize(ex)
            cw._health_check(ex)
            termination = cw._termination_barrier(current)
            left_termination = time.monotonic()
            terminated = set(termination.terminated)
            cw._records.publish_phases(cw.store, terminated)
            cw._log_root_cause(ex)
            current = cw._iteration_barrier(
                current.index + 1,
                previous,
                current.members,
                terminated,
                list(termination.joiners),
                termination if derive else None,
            )
            left_iteration = time.monotonic()
            ends[f"restart{k}"] = max(ends.get(f"restart{k}", 0.0), left_iteration)
            marks.append((k, classified, left_termination, left_iteration))
            _finish(raw, f"restart{k}", n)

            raw.wait([f"bench/torch{k}/go"], _td(timeout))
            for attempt in ("a", "b"):
                elastic_store.barrier(raw, n, f"torchbarrier/{k}/{attempt}", timeout, rank=rank)
            ends[f"torch{k}"] = max(ends.get(f"torch{k}", 0.0), time.monotonic())
            _finish(raw, f"torch{k}", n)
        if cw._relay is not None:
            cw._relay.close()
        del cw
    except BaseException as ex:  # reported by the main process
        errors.append(f"rank {rank}: {type(ex).__name__}: {ex}")
        if len(errors) == 1:  # at once: a run that fails may otherwise wait to its timeout
            print(f"first error in this process: {errors[0]}", file=sys.stderr, flush=True)


def worker(
    port: int,
    ranks: list[int],
    n: int,
    rounds: int,
    timeout: float,
    per_node: int,
    switch_interval: float,
    out: Any,
    derive: bool = True,
) -> None:
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("inprocess").setLevel(logging.ERROR)
    threading.stack_size(512 * 1024)
    sys.setswitchinterval(switch_interval)
    ends: dict[str, float] = {}
    marks: list[tuple[int, float, float, float]] = []
    errors: list[str] = []
    threads = [
        threading.Thread(
            target=rank_main,
            args=(port, r, n, rounds, timeout, per_node, ends, marks, errors, derive),
            daemon=True,
        )
        for r in ranks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put((ends, marks, errors))


# ----------------------------------------------------------------------------- one N


def timeline(marks: list[tuple[int, float, float, float]], release: float) -> dict[str, list]:
    """When the ranks of the first restart had classified the fault, left the
    termination barrier and left the iteration barrier: [first, median, last] in
    seconds from the restart's release. Shows whether a restart waits for its
    decisions or for the ranks' own work."""
    found: dict[str, list] = {}
    for column, name in enumerate(("classified", "termination", "iteration"), start=1):
        times = sorted(m[column] - release for m in marks if m[0] == 0)
        if times:
            found[name] = [round(times[k], 3) for k in (0, len(times) // 2, -1)]
    return found


def run(
    n: int,
    procs: int,
    rounds: int,
    timeout: float,
    per_node: int = 1,
    switch_interval: float = SWITCH_INTERVAL,
    derive: bool = True,
) -> dict[str, Any]:
    from inprocess.store import TCPStore

    ctx = multiprocessing.get_context("spawn")
    queue, stop, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=serve, args=(queue, stop), daemon=True)
    server.start()
    pid, port = queue.get(timeout=120)
    procs = max(1, min(procs, n))
    workers = [
        ctx.Process(
            target=worker,
            args=(
                port,
                list(range(p, n, procs)),
                n,
                rounds,
                timeout,
                per_node,
                switch_interval,
                out,
                derive,
            ),
            daemon=True,
        )
        for p in range(procs)
    ]
    # the nodes' relays, in processes of their own, up before the first rank arrives
    nodes = -(-n // per_node) if per_node > 1 else 0
    ready, relays_stop = ctx.Queue(), ctx.Event()
    hosts = [
        ctx.Process(
            target=relay_host,
            args=(
                port,
                list(range(h, nodes, procs)),
                per_node,
                n,
                timeout,
                switch_interval,
                ready,
                relays_stop,
            ),
            daemon=True,
        )
        for h in range(min(procs, nodes))
    ]
    for host in hosts:
        host.start()
    for _ in hosts:
        ready.get(timeout=120)
    result: dict[str, Any] = {"ranks": n, "ranks_per_node": per_node, "procs": procs}
    result["switch_interval"] = switch_interval
    result["membership"] = "derived" if derive else "barrier"
    result["rounds"] = rounds
    control = TCPStore(host_name=HOST, port=port, is_master=False, timeout=_td(timeout))
    deadline = time.monotonic() + timeout

    def phase(name: str) -> tuple[float, int, int, int]:
        """Releases phase ``name``; returns when it started, its server bytes, ops and
        CPU nanoseconds."""
        bytes0, ops0, cpu0 = server_io(pid)
        start = time.monotonic()
        control.set(f"bench/{name}/go", "1")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(name)
        try:
            control.wait([f"bench/{name}/done"], _td(left))
        except Exception as ex:
            raise TimeoutError(name) from ex
        bytes1, ops1, cpu1 = server_io(pid)
        watch.sample()  # every rank done with the phase and still connected
        return start, bytes1 - bytes0, ops1 - ops0, cpu1 - cpu0

    samples: dict[str, list[float]] = {"null": [], "restart": [], "torch": []}
    volume: dict[str, list[tuple[int, int, int]]] = {"null": [], "restart": [], "torch": []}
    starts: dict[str, float] = {}
    # Invariant: the watch runs from before the first worker connects to after the last
    # round, while every connection of the run is open (stopped in the finally).
    watch = ServerWatch(pid, port).start()
    try:
        for process in workers:
            process.start()
        while int(control.add("bench/connected", 0)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError("connect")
            time.sleep(0.1)
        result["connect_s"] = round(time.monotonic() - (deadline - timeout), 2)
        start = time.monotonic()
        control.set("bench/start", "1")
        try:
            control.wait(["bench/setup/done"], _td(max(1.0, deadline - time.monotonic())))
        except Exception as ex:
            raise TimeoutError("setup (initial and first iteration barrier)") from ex
        result["setup_s"] = round(time.monotonic() - start, 3)
        for k in range(rounds):
            for kind in ("null", "restart", "torch"):
                begun, nbytes, ops, cpu = phase(f"{kind}{k}")
                starts[f"{kind}{k}"] = begun
                volume[kind].append((nbytes, ops, cpu))
                if kind == "null":
                    samples[kind].append(time.monotonic() - begun)
        stop_workers = True
    except TimeoutError as ex:
        result["incomplete"] = f"timed out in phase {ex} after {timeout:.0f} s"
        stop_workers = False
    finally:
        watch.stop()
    watch.report(result, n)
    ends: dict[str, float] = {}
    marks: list[tuple[int, float, float, float]] = []
    errors: list[str] = []
    if stop_workers:
        for _ in workers:
            got_ends, got_marks, got_errors = out.get(timeout=120)
            errors += got_errors
            marks += got_marks
            for key, value in got_ends.items():
                ends[key] = max(ends.get(key, 0.0), value)
    for process in workers:
        process.join(1 if not stop_workers else 30)
        if process.is_alive():
            process.kill()
            process.join(5)
    relays_stop.set()
    for host in hosts:
        host.join(30)
        if host.is_alive():
            host.kill()
    stop.set()
    server.join(30)
    if server.is_alive():
        server.kill()
    for key, begun in starts.items():
        kind = key.rstrip("0123456789")
        if kind != "null" and key in ends:
            samples[kind].append(ends[key] - begun)
    if errors:
        result["errors"] = len(errors)
        result["first_error"] = errors[0]
    null_bytes = statistics.median(v[0] for v in volume["null"]) if volume["null"] else 0
    null_ops = statistics.median(v[1] for v in volume["null"]) if volume["null"] else 0
    null_cpu = statistics.median(v[2] for v in volume["null"]) if volume["null"] else 0
    for kind, label in (("restart", "restart"), ("torch", "torch_barrier_x2")):
        if samples[kind]:
            result[f"{label}_s"] = round(statistics.median(samples[kind]), 4)
            result[f"{label}_max_s"] = round(max(samples[kind]), 4)
        if volume[kind]:
            nbytes = statistics.median(v[0] for v in volume[kind]) - null_bytes
            ops = statistics.median(v[1] for v in volume[kind]) - null_ops
            cpu = statistics.median(v[2] for v in volume[kind]) - null_cpu
            prefix = "" if kind == "restart" else "torch_"
            result[f"{prefix}server_cpu_s"] = round(cpu / 1e9, 4)
            result[f"{prefix}server_cpu_us_per_rank"] = round(cpu / 1e3 / n, 1)
            result[f"{prefix}server_bytes"] = int(nbytes)
            result[f"{prefix}server_ops"] = int(ops)
            result[f"{prefix}bytes_per_rank"] = round(nbytes / n, 1)
            result[f"{prefix}ops_per_rank"] = round(ops / n, 2)
    if "restart0" in starts and marks:
        result["timeline_s"] = timeline(marks, starts["restart0"])
    if samples["null"]:
        result["harness_s"] = round(statistics.median(samples["null"]), 4)
    return result


# ----------------------------------------------------------------------------- steady state

STEADY_RANK = """
import os, sys, time, datetime, logging
logging.basicConfig(level=logging.WARNING)
from inprocess import Wrapper
from inprocess.rank_filter import MaxActiveWorldSize
from inprocess.store import TCPStore
seconds, spares = float(sys.argv[1]), int(sys.argv[2])
active = int(os.environ["WORLD_SIZE"]) - spares
@Wrapper(
    abort=None,
    store_kwargs={"host_name": "127.0.0.1", "is_master": False},
    rank_filter=MaxActiveWorldSize(active) if spares else None,
)
def train():
    store = TCPStore(host_name="127.0.0.1", is_master=False)
    store.add("steady/ready", 1)
    store.wait(["steady/stop"], datetime.timedelta(seconds=seconds + 120))
train()
"""


def steady(ranks: int, seconds: float, spares: int = 0, nodes: int = 1) -> dict[str, Any]:
    """Store operations per rank per second of a real job's ranks with no fault.

    With ``spares``, that many ranks are spares (they wait in the completion
    barrier for the whole call); the others wait in their function. The ranks
    run as ``nodes`` simulated nodes (``INPROCESS_NODE``), consecutive ranks
    together, each with its node group (:mod:`inprocess.node`).
    """
    from inprocess.store import TCPStore

    ctx = multiprocessing.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(queue, stop), daemon=True)
    server.start()
    pid, port = queue.get(timeout=120)
    env = dict(
        os.environ,
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
        WORLD_SIZE=str(ranks),
        PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p),
    )
    control = TCPStore(host_name=HOST, port=port, is_master=False, timeout=_td(300))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STEADY_RANK, str(seconds), str(spares)],
            env=dict(env, RANK=str(r), INPROCESS_NODE=f"node{r * nodes // ranks}"),
        )
        for r in range(ranks)
    ]
    try:
        control.wait(["steady/ready"], _td(1))
    except Exception:
        pass
    deadline = time.monotonic() + 300
    while int(control.add("steady/ready", 0)) < ranks - spares and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # past the start of every rank's monitor thread and process
    watch = ServerWatch(pid, port).start()
    bytes0, ops0, _ = server_io(pid)
    time.sleep(seconds)
    bytes1, ops1, _ = server_io(pid)
    watch.stop()
    control.set("steady/stop", "1")
    for proc in procs:
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    stop.set()
    server.join(30)
    return {
        "steady_ranks": ranks,
        "nodes": nodes,
        "spares": spares,
        "window_s": seconds,
        "ops_per_rank_per_s": round((ops1 - ops0) / ranks / seconds, 3),
        "bytes_per_rank_per_s": round((bytes1 - bytes0) / ranks / seconds, 1),
        "server_connections": watch.peak_connections,
        "server_fds": watch.peak_fds,
        # the library's alone: less the harness's control client, the server's own
        # client and the one each rank's function opens
        "connections_per_rank": round((watch.peak_connections - 2 - ranks) / ranks, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="256,1024", help="comma-separated simulated ranks")
    parser.add_argument("--procs", type=int, default=8, help="worker processes (threads split)")
    parser.add_argument("--rounds", type=int, default=3, help="restarts per N (median)")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=8,
        help="simulated ranks per node, each node with its arrival relay (1: no relay)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per N, in all")
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=SWITCH_INTERVAL,
        help="sys.setswitchinterval of the processes hosting simulated ranks and relays",
    )
    parser.add_argument(
        "--membership",
        choices=("derived", "barrier"),
        default="derived",
        help="derived: as the default rank assignment restarts (no iteration barrier); "
        "barrier: agreed at the iteration barrier, as a reordering assignment's",
    )
    parser.add_argument("--steady", type=float, default=0, help="seconds of steady state (0: no)")
    parser.add_argument("--steady-ranks", type=int, default=4)
    parser.add_argument(
        "--steady-spares", type=int, default=0, help="of the steady ranks, how many are spares"
    )
    parser.add_argument(
        "--steady-nodes", type=int, default=1, help="simulated nodes the steady ranks run on"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    try:
        sizes = [int(x) for x in args.ranks.split(",") if x]
    except ValueError:
        parser.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if any(n < 2 for n in sizes):
        parser.error("--ranks: every size must be at least 2")
    if args.switch_interval <= 0:
        parser.error(f"--switch-interval must be positive, got {args.switch_interval}")
    if args.ranks_per_node < 1:
        parser.error(f"--ranks-per-node must be at least 1, got {args.ranks_per_node}")
    if not 1 <= args.steady_nodes <= args.steady_ranks:
        parser.error(
            f"--steady-nodes must be at least 1 and at most --steady-ranks "
            f"({args.steady_ranks}), got {args.steady_nodes}"
        )
    if not 0 <= args.steady_spares < args.steady_ranks:
        parser.error(
            f"--steady-spares must be at least 0 and less than --steady-ranks "
            f"({args.steady_ranks}), got {args.steady_spares}"
        )

    def show(output: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(output), flush=True)
        else:
            print(", ".join(f"{k}={v}" for k, v in output.items()), flush=True)

    for n in sizes:
        show(
            run(
                n,
                args.procs,
                args.rounds,
                args.timeout,
                args.ranks_per_node,
                args.switch_interval,
                args.membership == "derived",
            )
        )
    if args.steady > 0:
        show(steady(args.steady_ranks, args.steady, args.steady_spares, args.steady_nodes))


if __name__ == "__main__":
    main()
