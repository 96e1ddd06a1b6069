"""Machine and worker losses in a job of several machines: ``inprocess-run`` once per
machine against ``torchrun`` (and ``ft_launcher``), each machine one launcher here.

A "machine" is one launcher process tree on this host, started in a session of
its own, all on loopback. Each system runs one job and gets the same faults, in
this order, each once the job has trained at full size for ``--settle`` s:

1. ``--worker-kills`` SIGKILLs of one worker process (a random rank);
2. ``--losses`` machine losses: SIGKILL of the launcher and every process under
   it at once (a random training machine, never node rank 0, which hosts the
   coordinator, or torchrun's rendezvous store). Once the job is back at full
   size the lost machine is started again, with the same command: it rejoins as
   a spare; the next loss waits until it is in (``inprocess-run``: until the
   controller counts it as a spare slot again and its warm standby is up, at
   most ``--warm-timeout`` s; torchrun: until every worker was restarted to
   train with it, at world size 10).

Systems:

* ``inprocess``: ``inprocess-run --nnodes 4:5 --node-rank R --nproc-per-node 2``
  (4 training machines x 2 workers, 1 hot spare; default settings otherwise,
  ``--node-max-relaunches`` high enough for every loss) running
  ``examples/train_state.py`` (``restore``/``commit``, no file). Full size:
  8 ranks at world size 8; a machine loss resumes at world size 6 and comes
  back to 8 on the spare.
* ``torchrun``: 5 agents of ``torchrun --rdzv-backend c10d --nnodes 4:5
  --max-restarts 3 --nproc-per-node 2`` running ``examples/train_plain.py``
  (the same job without the Wrapper, a checkpoint file written every step).
  torchrun has no hot spare: all 5 machines train (world size 10) until one is
  lost, then 4 (world size 8). Full size: the training size of the
  ``inprocess`` job, 8 ranks at world size >= 8.
* ``torchrun-noshare``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (each restart's rank 0 hosts a fresh store: the setting that lets torchrun
  restart reliably on one machine, see ``failover_vs_torchrun.py``).
* ``ft_launcher``: ``ft_launcher`` (nvidia-resiliency-ext) with torchrun's
  flags (``--ft-launcher``, by default the one on ``PATH``; it runs the script
  with its own virtual environment's Python); skipped, with the reason, where
  it is missing.

Measured per fault, from the kill: *resumed* (the first "start" of any rank at
any world size: training goes on), *full size* (the first restart with the full
training size of ranks started), *redone steps* (``inprocess``: the largest
``redone_steps`` of the restores; the others: the checkpoint's step just before
the kill minus the step training resumed from). Per job: *start-up* (launch of
the first machine to every rank started at full size) and whether the job
survived (still training at the end). Peer runs are bounded by
``--peer-timeout`` s; a fault not back at full size within ``--deadline`` s
ends the faults of that system. Every process of a run is killed at its end
(found by an environment tag).

With the defaults a run takes about 10 minutes on 2 cores; a peer needs about
a minute per machine loss here, so ``--peer-timeout 240`` lets each get two in
(about 15 minutes in all).

    PYTHONWARNINGS='ignore:Failed to initialize NumPy' PYTHONPATH=. \\
        .venv/bin/python benchmarks/multinode.py --losses 5 --peer-timeout 240
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import failover_vs_torchrun as fvt
import psutil

from inprocess._net import free_port

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("inprocess", "torchrun", "torchrun-noshare", "ft_launcher")
MACHINES = 5  # node ranks 0..4: 4 train, 1 hot spare (torchrun: all 5 train)
PER_MACHINE = 2
TRAIN_WORLD = 8  # the inprocess job's full size, and the floor of the others'
POLL = 0.02
#: the targets of the inprocess job (seconds from a machine's loss)
TARGET_RESUMED, TARGET_FULL = 1.0, 5.0


@dataclasses.dataclass
class Fault:
    """One injected fault and what came of it (seconds from the kill)."""

    kind: str  # "worker" or "machine"
    index: int
    target: int  # the rank (worker) or node rank (machine) killed
    killed_at: float
    resumed: float | None = None
    full: float | None = None
    redone: int | None = None
    seen: float | None = None  # inprocess: the controller's node relaunch
    spare_warm: bool | None = None  # inprocess: the spare used had its standby up
    killed: list[str] = dataclasses.field(default_factory=list)  # the processes SIGKILLed


@dataclasses.dataclass
class RunResult:
    system: str
    command: str = ""
    startup: float | None = None
    start_world: int | None = None
    faults: list[Fault] = dataclasses.field(default_factory=list)
    survived: bool | None = None  # still training at the end
    cut: bool = False  # stopped by --peer-timeout before every fault was injected
    wall: float = 0.0
    leftovers: int = 0
    skipped: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


class StartLog(fvt.Events):
    """``events.jsonl`` with the groups of one restart: ``inprocess`` keys a restart
    by its iteration, the others by the checkpoint step it began from."""

    def __init__(self, path: Path, by_iteration: bool) -> None:
        super().__init__(path)
        self.by_iteration = by_iteration

    def full_at(self, since: float, world: int = TRAIN_WORLD) -> float | None:
        """When the first restart after ``since`` with ``world`` ranks at world size
        >= ``world`` had them all started."""
        groups: dict[tuple[int, int], dict[int, float]] = {}
        for e in self.starts:
            if e["time"] >= since and e["world"] >= world:
                key = (e["world"], e["iteration"] if self.by_iteration else e["step"])
                groups.setdefault(key, {})[e["rank"]] = e["time"]
        done = [max(g.values()) for (size, _), g in groups.items() if len(g) >= size]
        return min(done) if done else None

    def running_full(self, since: float) -> bool:
        """Every rank's latest start is after ``since`` and in one restart at full size."""
        latest: dict[int, dict[str, Any]] = {}
        for e in self.starts:
            if e["rank"] not in latest or e["time"] >= latest[e["rank"]]["time"]:
                latest[e["rank"]] = e
        current = [e for e in latest.values() if e["time"] >= since]
        if not current:
            return False
        world = max(e["world"] for e in current)
        if world < TRAIN_WORLD:
            return False
        group = [e for e in current if e["world"] == world]
        return len(group) >= world and self.full_at(since, world) is not None

    def redone(self, since: float) -> int | None:
        """inprocess: the most steps any restore after ``since`` redid."""
        found = [
            e["restore"]["redone_steps"]
            for e in self.starts
            if e["time"] >= since and isinstance(e.get("restore"), dict)
        ]
        return max(found) if found else None

    def first_step_after(self, since: float) -> int | None:
        steps = [e for e in self.starts if e["time"] >= since]
        return min(steps, key=lambda e: e["time"])["step"] if steps else None


class Job:
    """The machines of one system's job: start, kill and restart them, find workers."""

    def __init__(self, system: str, args: argparse.Namespace, work: Path) -> None:
        self.system, self.args, self.work = system, args, work
        self.tag = uuid.uuid4().hex
        self.port = free_port()
        self.out = work / "out"
        self.state_dir = work / "state"
        self.secret = secrets.token_hex(32)
        self.machines: dict[int, subprocess.Popen[bytes]] = {}
        self.events = StartLog(self.out / "events.jsonl", by_iteration=system == "inprocess")

    def command(self, node_rank: int) -> tuple[list[str], dict[str, str]]:
        job = ["--steps", str(self.args.steps), "--step-time", str(self.args.step_time)]
        job += ["--result-dir", str(self.out)]
        if self.system == "inprocess":
            cmd = [
                *fvt.launcher("inprocess-run", "inprocess.failover.cli"),
                "--nnodes",
                f"{MACHINES - 1}:{MACHINES}",
                "--node-rank",
                str(node_rank),
                "--rdzv-endpoint",
                f"127.0.0.1:{self.port}",
                "--nproc-per-node",
                str(PER_MACHINE),
                "--rdzv-timeout",
                "60",
                "--node-max-relaunches",
                str(self.args.losses + 5),
            ]
            if node_rank == 0:
                cmd += ["--state-dir", str(self.state_dir)]
            script = "train_state.py"
            if not self.args.tuned:
                job.append("--wrapper-defaults")  # what a user gets: the Wrapper's defaults
            env = {"INPROCESS_JOB_SECRET": self.secret}
        else:
            if self.system == "ft_launcher":
                cmd = [str(self.args.ft_launcher)]
            else:
                cmd = fvt.launcher("torchrun", "torch.distributed.run")
            cmd += [
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{self.port}",
                "--nnodes",
                f"{MACHINES - 1}:{MACHINES}",
                "--max-restarts",
                "3",
                "--nproc-per-node",
                str(PER_MACHINE),
            ]
            script = "train_plain.py"
            env = {}
            if self.system == "torchrun-noshare":
                env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return [*cmd, str(REPO / "examples" / script), *job], env

    def start_machine(self, node_rank: int) -> None:
        cmd, extra = self.command(node_rank)
        env = {
            **os.environ,
            **extra,
            fvt.TAG_VAR: self.tag,
            "PYTHONWARNINGS": "ignore:Failed to initialize NumPy",
            "RES_OPTIONS": "timeout:1 attempts:1",
        }
        with open(self.work / f"machine{node_rank}.log", "ab") as log:
            self.machines[node_rank] = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def shown_command(self) -> str:
        cmd, extra = self.command(0)
        words = [f"{k}={v}" for k, v in extra.items() if k != "INPROCESS_JOB_SECRET"]
        for arg in cmd:
            with contextlib.suppress(ValueError):
                arg = str(Path("WORK") / Path(arg).relative_to(self.work))
            with contextlib.suppress(ValueError):
                arg = str(Path(arg).relative_to(REPO))
            words.append(arg)
        return " ".join(words)

    def tree(self, node_rank: int) -> list[psutil.Process]:
        """The machine's launcher and every process under it."""
        try:
            root = psutil.Process(self.machines[node_rank].pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def kill_machine(self, node_rank: int, killed: list[str]) -> float:
        """SIGKILL of the machine's whole process tree at once; the time of the kill.
        ``killed`` gets the processes' pids and names."""
        procs = self.tree(node_rank)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                line = " ".join(p.cmdline()).replace(f"{REPO}/", "")
                killed.append(f"{p.pid} {line[:80]}")
        killed_at = time.time()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.machines[node_rank].wait()
        psutil.wait_procs(procs, timeout=10)
        return killed_at

    def worker_pid(self, rank: int) -> int | None:
        """The process running ``rank`` (the one with ``RANK`` set whose parent has not:
        a worker, not its monitor process)."""
        for node_rank in self.machines:
            for p in self.tree(node_rank):
                with contextlib.suppress(psutil.Error):
                    if p.environ().get("RANK") != str(rank) or p.status() == "zombie":
                        continue
                    if p.parent() is not None and p.parent().environ().get("RANK") == str(rank):
                        continue
                    return p.pid
        return None

    def training_machines(self) -> list[int]:
        """Node ranks that run workers now (inprocess: the controller's slot map)."""
        if self.system == "inprocess":
            try:
                slots = json.loads((self.state_dir / "state.json").read_text())["node_slots"]
            except (OSError, ValueError, KeyError):
                return []
            return sorted(int(s) for s in slots.values())
        return [r for r in self.machines if any(self.worker_in(r))]

    def worker_in(self, node_rank: int) -> list[psutil.Process]:
        found = []
        for p in self.tree(node_rank):
            with contextlib.suppress(psutil.Error):
                if "RANK" in p.environ():
                    found.append(p)
        return found

    def controller_events(self, since: float) -> list[dict[str, Any]]:
        try:
            lines = (self.state_dir / "events.jsonl").read_text().splitlines()
        except OSError:
            return []
        found = []
        for line in lines:
            with contextlib.suppress(ValueError):
                e = json.loads(line)
                if e.get("time", 0) >= since:
                    found.append(e)
        return found

    def spare_ready(self, node_rank: int, since: float) -> tuple[bool, bool]:
        """(back as a spare slot, its warm standby up) for a restarted machine."""
        try:
            logged = json.loads((self.state_dir / "state.json").read_text())["events"]
        except (OSError, ValueError, KeyError):
            logged = []
        back = any(
            e.get("kind") == "slot_back"
            and (e.get("time") or 0) >= since
            and f"node slot {node_rank} " in e.get("message", "")
            for e in logged
        )
        warm = False
        for p in self.tree(node_rank):
            with contextlib.suppress(psutil.Error):
                line = " ".join(p.cmdline())
                if "failover.standby" in line and "--zygote" not in line:
                    warm = True
        return back, warm

    def step(self) -> int | None:
        """The job's latest step: its checkpoint file, else rank 0's progress line."""
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.out / "checkpoint.json").read_text())["step"]
        self.events.poll()
        for raw in reversed(self.events.lines):
            e = json.loads(raw)
            if e["kind"] == "progress":
                return e["step"]
        return None

    def alive(self) -> bool:
        return self.machines[0].poll() is None

    def stop(self) -> int:
        """SIGTERM to node rank 0's launcher (it ends the job on every machine), then to
        the others, then SIGKILL to whatever of the job is left."""
        order = sorted(self.machines)  # 0 first: the others would look lost to it
        for waited in (order[:1], order[1:]):
            for r in waited:
                if self.machines[r].poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        self.machines[r].send_signal(signal.SIGTERM)
            limit = time.monotonic() + 15
            for r in waited:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.machines[r].wait(max(0.1, limit - time.monotonic()))
        left = fvt.tagged(self.tag)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=10)
        for proc in self.machines.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        still = fvt.tagged(self.tag)
        if still:
            raise RuntimeError(f"processes of the run survived SIGKILL: {[p.pid for p in still]}")
        return len(left)


class OutOfTime(Exception):
    """The system's run stopped training, or a fault did not recover in time."""


class OutOfBudget(OutOfTime):
    """A peer's run used up its time (``--peer-timeout``)."""


def run_system(system: str, args: argparse.Namespace, root: Path) -> RunResult:
    """Starts ``system``'s job on 5 machines, injects the faults, stops it, and
    returns what was measured (every process of the job gone)."""
    result = RunResult(system)
    if system == "ft_launcher":
        found = shutil.which(args.ft_launcher)
        if found is None:
            result.skipped = (
                f"{args.ft_launcher} not found (pip install nvidia-resiliency-ext, "
                "give --ft-launcher)"
            )
            print(f"\n== {system}: skipped: {result.skipped}", flush=True)
            return result
    work = root / system
    work.mkdir(parents=True)
    job = Job(system, args, work)
    result.command = job.shown_command()
    budget = None if system == "inprocess" else time.monotonic() + args.peer_timeout
    print(f"\n== {system}: {result.command}  (x{MACHINES}, --node-rank 0..4)", flush=True)
    started = time.time()
    try:
        job.start_machine(0)
        if system != "inprocess":
            time.sleep(1.0)  # machine 0 binds the rendezvous port: it hosts the store
        for r in range(1, MACHINES):
            job.start_machine(r)
        inject(job, args, result, started, budget)
    except OutOfTime as ex:
        result.cut = isinstance(ex, OutOfBudget)
        result.notes.append(str(ex))
        print(f"  {ex}", flush=True)
    finally:
        result.survived = survived(job)
        result.wall = time.time() - started
        stops = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            result.leftovers = job.stop()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        result.notes.append(log_summary(work))
    return result


def wait_until(predicate, timeout: float, budget: float | None) -> bool:
    """Polls ``predicate`` for ``timeout`` s; raises :class:`OutOfBudget` once the
    peer's ``budget`` (a ``time.monotonic()`` deadline) has passed."""
    limit = time.monotonic() + timeout
    if budget is not None:
        limit = min(limit, budget)
    while time.monotonic() < limit:
        if predicate():
            return True
        time.sleep(POLL)
    if budget is not None and time.monotonic() >= budget:
        raise OutOfBudget("out of time (--peer-timeout): the job was stopped")
    return False


def wait_stable(job: Job, args: argparse.Namespace, since: float, budget: float | None) -> bool:
    """The job runs at full size since ``since`` and has for ``--settle`` s."""
    while True:

        def full() -> bool:
            job.events.poll()
            return job.events.running_full(since)

        if not wait_until(full, args.deadline, budget):
            return False
        count = len(job.events.starts)
        time.sleep(args.settle)
        job.events.poll()
        if len(job.events.starts) == count:
            return True


def measure(job: Job, fault: Fault, args: argparse.Namespace, budget: float | None) -> None:
    """Waits for full size after ``fault`` and fills in its figures."""
    events = job.events

    def back() -> bool:
        events.poll()
        return events.full_at(fault.killed_at) is not None

    wait_until(back, args.deadline, budget)
    first = events.first_start(fault.killed_at)
    fault.resumed = None if first is None else first - fault.killed_at
    full = events.full_at(fault.killed_at)
    fault.full = None if full is None else full - fault.killed_at
    if job.system == "inprocess":
        fault.redone = events.redone(fault.killed_at)
        relaunch = [
            e["time"]
            for e in job.controller_events(fault.killed_at)
            if e.get("event") == "node_relaunch"
        ]
        if fault.kind == "machine" and relaunch:
            fault.seen = min(relaunch) - fault.killed_at


def inject(
    job: Job, args: argparse.Namespace, result: RunResult, started: float, budget: float | None
) -> None:
    rng = random.Random(args.seed)
    events = job.events

    def initial() -> bool:
        events.poll()
        return events.full_at(started) is not None

    if not wait_until(initial, args.deadline * 2, budget):
        raise OutOfTime("the job never trained at full size")
    result.startup = events.full_at(started) - started
    result.start_world = max(e["world"] for e in events.starts)
    print(f"  start-up: {result.startup:.2f} s (world size {result.start_world})", flush=True)
    since = started
    plan = [("worker", i) for i in range(args.worker_kills)]
    plan += [("machine", i) for i in range(args.losses)]
    for kind, index in plan:
        if not wait_stable(job, args, since, budget):
            raise OutOfTime(f"{kind} fault {index + 1}: the job is not running at full size")
        if kind == "worker":
            rank = rng.randrange(result.start_world)
            pid = job.worker_pid(rank)
            if pid is None:
                result.notes.append(f"worker kill {index + 1}: no process for rank {rank}")
                continue
            killed_at = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            fault = Fault(kind, index + 1, rank, killed_at)
        else:
            candidates = [r for r in job.training_machines() if r != 0]
            victim = rng.choice(candidates)
            fault = Fault(kind, index + 1, victim, 0.0)
            if job.system == "inprocess":
                spare = [r for r in range(MACHINES) if r not in job.training_machines()]
                fault.spare_warm = bool(spare) and job.spare_ready(spare[0], 0)[1]
            fault.killed_at = job.kill_machine(victim, fault.killed)
        step_before = job.step()  # the last step completed: nothing completes without the dead
        result.faults.append(fault)
        measure(job, fault, args, budget)
        if job.system != "inprocess" and fault.resumed is not None and step_before is not None:
            resumed_at = events.first_step_after(fault.killed_at)
            fault.redone = max(0, step_before - resumed_at) if resumed_at is not None else None
        print(f"  {describe(fault)}", flush=True)
        if fault.full is None:
            raise OutOfTime(
                f"{kind} fault {fault.index}: not back at full size within {args.deadline:.0f} s"
            )
        since = fault.killed_at
        if kind == "machine":
            restarted = time.time()
            job.start_machine(fault.target)
            if job.system == "inprocess":

                def ready(r: int = fault.target, t: float = restarted) -> bool:
                    return all(job.spare_ready(r, t))

                if not wait_until(ready, args.warm_timeout, budget):
                    back, warm = job.spare_ready(fault.target, restarted)
                    result.notes.append(
                        f"machine {fault.target} restarted after loss {fault.index}: "
                        f"{'joined' if back else 'NOT joined'}, warm standby "
                        f"{'up' if warm else 'NOT up'} after {args.warm_timeout:.0f} s"
                    )
            else:
                since = restarted  # torchrun restarts every worker when a machine joins


def survived(job: Job) -> bool:
    """Still training: a launcher of node rank 0 alive and the step moving on."""
    if not job.machines or not job.alive():
        return False
    before = job.step()
    time.sleep(2.0)
    after = job.step()
    return before is not None and after is not None and after > before


def describe(f: Fault) -> str:
    what = f"rank {f.target}" if f.kind == "worker" else f"machine {f.target}"
    extra = ""
    if f.seen is not None:
        extra += f", relaunch decided after {f.seen:.2f} s"
    if f.spare_warm is not None:
        extra += f", spare {'warm' if f.spare_warm else 'COLD'}"
    return (
        f"{f.kind} {f.index} ({what}): resumed {fvt.seconds(f.resumed)} s, full size "
        f"{fvt.seconds(f.full)} s, redone {f.redone if f.redone is not None else '-'}{extra}"
    )


def log_summary(work: Path) -> str:
    text = "".join(p.read_text(errors="replace") for p in sorted(work.glob("machine*.log")))
    counts = {
        "'connectFullMesh failed' lines": text.count("connectFullMesh failed"),
        "worker group failures": text.count("failed (exitcode"),
        "node relaunches": text.count("relaunching node"),
        "worker relaunches": text.count("relaunching worker"),
    }
    return "logs: " + ", ".join(f"{k}: {v}" for k, v in counts.items() if v)


def stats(values: list[float | int | None]) -> dict[str, float] | None:
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"n": len(got), "median": statistics.median(got), "max": max(got)}


def cell(values: list[float | int | None], planned: int, unit: str = "") -> str:
    s = stats(values)
    if s is None:
        return f"- (0/{planned})" if planned else "-"

    def fmt(v: float) -> str:
        return f"{v:.2f}" if unit else f"{v:g}"

    return f"{fmt(s['median'])} ({fmt(s['max'])}) {s['n']}/{planned}"


def table(results: list[RunResult], args: argparse.Namespace) -> str:
    cols = [
        "system",
        "start-up s",
        "worker kill: full size s",
        "machine loss: resumed s",
        "machine loss: full size s",
        "redone steps",
        "survived",
    ]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        if r.skipped:
            rows.append(f"| {r.system} | skipped: {r.skipped} |" + " |" * (len(cols) - 2))
            continue
        w = [f for f in r.faults if f.kind == "worker"]
        m = [f for f in r.faults if f.kind == "machine"]
        rows.append(
            "| "
            + " | ".join(
                [
                    r.system,
                    fvt.seconds(r.startup),
                    cell([f.full for f in w], args.worker_kills, "s"),
                    cell([f.resumed for f in m], args.losses, "s"),
                    cell([f.full for f in m], args.losses, "s"),
                    cell([f.redone for f in r.faults], args.worker_kills + args.losses),
                    f"cut off by --peer-timeout ({args.peer_timeout:.0f} s)"
                    if r.cut
                    else ("yes" if r.survived else "no"),
                ]
            )
            + " |"
        )
    return "\n".join(rows)


def shown(path: Path) -> str:
    """A path as the results show it: relative to the repository where inside it."""
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(REPO))
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", type=int, default=5, help="machine losses per system")
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="the example's short Wrapper intervals (default: the Wrapper's defaults)",
    )
    parser.add_argument("--worker-kills", type=int, default=2, help="worker SIGKILLs per system")
    parser.add_argument("--steps", type=int, default=1_000_000, help="job length (stopped early)")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--settle", type=float, default=2.0, help="s at full size before a fault")
    parser.add_argument("--deadline", type=float, default=60.0, help="s for a fault to recover")
    parser.add_argument(
        "--warm-timeout",
        type=float,
        default=30.0,
        help="s a restarted machine has to rejoin as a spare with its standby up",
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=150.0, help="s each peer system may run in all"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", choices=SYSTEMS, action="append", help="run only this system (repeatable)"
    )
    parser.add_argument(
        "--ft-launcher",
        default="ft_launcher",
        help="ft_launcher of nvidia-resiliency-ext (a path, or a name on PATH)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "multinode.json"
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs and events")
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    for name in ("losses", "worker_kills"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("step_time", "deadline", "warm_timeout", "peer_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    systems = [s for s in SYSTEMS if s in (args.only or SYSTEMS)]

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    root = Path(tempfile.mkdtemp(prefix="multinode_"))
    results: list[RunResult] = []
    try:
        for system in systems:
            results.append(run_system(system, args, root))
    finally:
        if args.keep:
            print(f"\nlogs and events kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    text = table(results, args)
    print(
        "\nmedian (worst) n/planned, seconds from the kill; start-up: launch -> every rank "
        f"training at full size; {os.cpu_count()} cores\n" + text
    )
    for r in results:
        for note in r.notes:
            print(f"  {r.system}: {note}")
    ours = next((r for r in results if r.system == "inprocess"), None)
    met = None
    if ours is not None and not ours.skipped:
        losses = [f for f in ours.faults if f.kind == "machine"]
        met = (
            len(losses) == args.losses
            and all(f.resumed is not None and f.resumed <= TARGET_RESUMED for f in losses)
            and all(f.full is not None and f.full <= TARGET_FULL for f in losses)
        )
        print(
            f"targets (every machine loss: resumed <= {TARGET_RESUMED} s, full size <= "
            f"{TARGET_FULL} s): {'met' if met else 'NOT met'}"
        )
    record = {
        "command": "benchmarks/multinode.py " + " ".join(argv),
        "date": str(datetime.date.today()),
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
        },
        "args": {k: shown(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "targets_met": met,
        "results": [dataclasses.asdict(r) for r in results],
        "table": text,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if met in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
