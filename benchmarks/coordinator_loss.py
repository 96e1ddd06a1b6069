"""The coordinator's machine lost in a job whose coordinator etcd elects
(``inprocess-run --rdzv-backend etcd``), each machine one launcher here;
torchrun with its etcd rendezvous beside it, losing the machine of rank 0.

Systems, each against a 3-member etcd this script starts on loopback
(``tests/etcd_cluster.py``; a fresh one per system), 5 "machines" (one
launcher and every process it started, found by an environment marker of its
own, each launcher in a session of its own) x 2 workers, 0.05 s steps:

* ``inprocess``: the job of ``multinode.py`` (4 training machines, 1 hot
  spare, ``examples/train_state.py`` with ``restore``/``commit`` and the
  Wrapper's default settings) under ``--rdzv-backend etcd --rdzv-id ID``, with
  snapshots persisted every ``--persist-every`` steps (``--snapshot-dir``).
  The machine lost is the one whose launcher leads (its sealed leader record
  in etcd). Its lease (3 s) ends, another launcher is elected and takes the
  job over from etcd, and the job restarts cold (a new generation: every
  worker a new process, the state from the persisted snapshots).
* ``torchrun``: ``torchrun --rdzv-backend etcd-v2 --nnodes 4:5 --max-restarts
  N`` (``python-etcd`` installed, the members started with ``--enable-v2``;
  its rendezvous takes one endpoint: the first member's) running
  ``examples/train_plain.py`` (a checkpoint file written every step). All 5
  machines train (world size 10) until one is lost; the machine lost is the
  one that runs rank 0 (it hosts the workers' store).
* ``torchrun-noshare``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.

The fault, ``--losses`` times, each once the job has trained at full size for
``--settle`` s: SIGKILL of every process of that machine, at once. Once the job
is back at full size a new machine (a fresh launcher, the same command) is
started, so that a spare exists for the next loss (``inprocess``: the next
loss waits until its warm standby is up, at most ``--warm-timeout`` s;
torchrun: until every worker was restarted with it, at world size 10).

Measured per loss, from the kill: *new leader* (``inprocess``: the first
authentic leader record of a newer term seen in etcd, polled every 20 ms),
*resumed* (the first "start" of any rank: training goes on), *full size* (the
first restart with 8 training ranks started at world size >= 8), *redone
steps* (the last step before the fault minus the step training resumed from).
torchrun's last step is its checkpoint's; ``inprocess``'s comes from rank 0's
``progress`` lines (every 10 steps): the newest one, plus the steps its pace
since then gives until the kill (at most 9), or a newer line written after the
kill, where the old generation still trained. ``inprocess`` also gets where
the time goes, from the new coordinator's state in etcd (its controller
recovering, the cold restart decided, its store server started, the lost slot
found, the first worker started). Per job: *start-up* (the first launch to
every rank started at full size) and whether it survived (still training at
the end). A torchrun run is bounded by ``--peer-timeout`` s; a loss not back at
full size within ``--deadline`` s ends that system's losses. Every process of a
run, the etcd members included, is ended at its end.

With the defaults (3 losses) a run takes about 10 minutes on 2 cores.

    PYTHONWARNINGS='ignore:Failed to initialize NumPy' PYTHONPATH=. \\
        .venv/bin/python benchmarks/coordinator_loss.py --losses 3
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
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
import multinode as mn
import psutil

from inprocess import security
from inprocess.failover.etcd import Etcd, EtcdError
from inprocess.failover.leadership import Election, Leader, job_prefix

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("inprocess", "torchrun", "torchrun-noshare")
LABELS = {
    "inprocess": "inprocess-run (etcd)",
    "torchrun": "torchrun (etcd-v2)",
    "torchrun-noshare": "torchrun (etcd-v2), TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
}
MACHINES = 5  # inprocess: 4 train, 1 hot spare; torchrun: all 5 train
PER_MACHINE = 2
TRAIN_WORLD = mn.TRAIN_WORLD  # 8
#: the environment variable naming the "machine" a process belongs to
MACHINE_VAR = "COORDINATOR_LOSS_MACHINE"
POLL = 0.02


def _load_etcd_cluster():
    """``tests/etcd_cluster.py`` (a real etcd cluster on loopback), imported by path."""
    path = REPO / "tests" / "etcd_cluster.py"
    spec = importlib.util.spec_from_file_location("etcd_cluster", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Loss:
    """One loss of the leading machine and what came of it (seconds from the kill)."""

    index: int
    machine: str  # the machine killed
    role: str  # "training" or "spare": what the leader's machine did besides leading
    term: int  # the lost leader's term (torchrun: 0)
    killed_at: float
    new_leader: float | None = None
    new_machine: str | None = None  # the machine whose launcher leads next
    resumed: float | None = None
    full: float | None = None
    step_before: int | None = None
    resumed_from: int | None = None
    redone: int | None = None
    resumed_world: int | None = None
    #: a training machine lost: a standby was up on a spare when it was lost
    spare_warm: bool | None = None
    #: where the time to resumed goes, from the new coordinator's state in etcd:
    #: its controller recovering the job, the cold restart decided, the new store
    #: server's process started, the lost machine's slot found empty (its workers
    #: then go to the spare), the first worker of the new generation started
    recovered: float | None = None
    restart_decided: float | None = None
    store_started: float | None = None
    slot_lost: float | None = None
    first_worker: float | None = None
    killed: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RunResult:
    system: str
    command: str = ""
    startup: float | None = None
    losses: list[Loss] = dataclasses.field(default_factory=list)
    survived: bool | None = None
    wall: float = 0.0
    leftovers: int = 0
    load: list[float] = dataclasses.field(default_factory=list)  # 1-min load average: start, end
    cut: bool = False  # stopped by --peer-timeout
    notes: list[str] = dataclasses.field(default_factory=list)


class Job:
    """The machines of one system's job: start and kill them, find the machine to lose
    (``inprocess``: its launcher leads; ``torchrun``: it runs rank 0)."""

    def __init__(
        self, system: str, args: argparse.Namespace, work: Path, endpoints: list[str]
    ) -> None:
        self.system, self.args, self.work = system, args, work
        self.endpoints = ",".join(endpoints)
        # torchrun's etcd-v2 rendezvous takes one endpoint
        self.endpoint = self.endpoints if system == "inprocess" else endpoints[0]
        self.tag = uuid.uuid4().hex
        self.job_id = f"bench-{self.tag[:8]}"
        self.out = work / "out"
        self.secret = secrets.token_hex(32)
        self.machines: dict[str, subprocess.Popen[bytes]] = {}
        self.events = mn.StartLog(self.out / "events.jsonl", by_iteration=system == "inprocess")
        self.etcd = Etcd(self.endpoints, timeout=5)
        # a reader only: it never campaigns (the identity and endpoint are not used)
        self.election = Election(
            self.etcd, self.job_id, "benchmark-reader", "127.0.0.1:1", self.secret
        )

    def command(self, name: str) -> list[str]:
        job = ["--steps", str(self.args.steps), "--step-time", str(self.args.step_time)]
        job += ["--result-dir", str(self.out)]
        if self.system != "inprocess":
            cmd = [
                *fvt.launcher("torchrun", "torch.distributed.run"),
                "--rdzv-backend",
                "etcd-v2",
                "--rdzv-endpoint",
                self.endpoint,
                "--rdzv-id",
                self.job_id,
                "--nnodes",
                f"{MACHINES - 1}:{MACHINES}",
                "--max-restarts",
                str(self.args.losses + 2),
                "--nproc-per-node",
                str(PER_MACHINE),
            ]
            return [*cmd, str(REPO / "examples" / "train_plain.py"), *job]
        cmd = [
            *fvt.launcher("inprocess-run", "inprocess.failover.cli"),
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            self.endpoints,
            "--rdzv-id",
            self.job_id,
            "--nnodes",
            f"{MACHINES - 1}:{MACHINES}",
            "--nproc-per-node",
            str(PER_MACHINE),
            "--master-addr",
            "127.0.0.1",
            "--rdzv-timeout",
            "60",
            # every loss is a cold restart and a node relaunch: room for all of them
            "--job-max-restarts",
            str(self.args.losses + 2),
            "--node-max-relaunches",
            str(self.args.losses + 5),
            "--state-dir",
            str(self.work / f"state-{name}"),
        ]
        job += ["--snapshot-dir", str(self.work / "snapshots")]
        job += ["--persist-every", str(self.args.persist_every)]
        if not self.args.tuned:
            job.append("--wrapper-defaults")
        return [*cmd, str(REPO / "examples" / "train_state.py"), *job]

    def shown_command(self) -> str:
        words = []
        for arg in self.command("NAME"):
            with contextlib.suppress(ValueError):
                arg = str(Path("WORK") / Path(arg).relative_to(self.work))
            with contextlib.suppress(ValueError):
                arg = str(Path(arg).relative_to(REPO))
            if arg == self.endpoints:
                arg = "E1,E2,E3"
            elif arg == self.endpoint:
                arg = "E1"
            words.append(arg)
        return " ".join(words)

    def start_machine(self, name: str) -> None:
        env = {
            **os.environ,
            **({"INPROCESS_JOB_SECRET": self.secret} if self.system == "inprocess" else {}),
            **(
                {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
                if self.system.endswith("noshare")
                else {}
            ),
            fvt.TAG_VAR: self.tag,
            MACHINE_VAR: f"{self.tag}-{name}",
            "PYTHONWARNINGS": "ignore:Failed to initialize NumPy",
            "RES_OPTIONS": "timeout:1 attempts:1",
        }
        with open(self.work / f"{name}.log", "ab") as log:
            self.machines[name] = subprocess.Popen(
                self.command(name),
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def processes(self, name: str) -> list[psutil.Process]:
        """Every process of one machine: its launcher's tree and whatever carries its marker."""
        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.machines[name].pid)
            for p in [root, *root.children(recursive=True)]:
                found[p.pid] = p
        marker = f"{self.tag}-{name}"
        for p in fvt.processes_with_env(MACHINE_VAR, marker):
            found.setdefault(p.pid, p)
        return list(found.values())

    def kill_machine(self, name: str, killed: list[str]) -> float:
        """SIGKILL of every process of the machine at once; the time of the kill."""
        procs = self.processes(name)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                line = " ".join(p.cmdline()).replace(f"{REPO}/", "")
                line = line.replace(str(self.work), "WORK")
                killed.append(f"{p.pid} {line[:80]}")
        killed_at = time.time()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.machines[name].wait()
        psutil.wait_procs(procs, timeout=10)
        return killed_at

    def leader(self) -> tuple[Leader | None, str | None]:
        """The authentic leader in etcd and the machine whose launcher it is
        (the identity is ``host/pid/nonce``, the pid the launcher's)."""
        try:
            leader = self.election.leader()
        except EtcdError:
            return None, None
        if leader is None:
            return None, None
        with contextlib.suppress(ValueError, IndexError):
            pid = int(leader.identity.split("/")[1])
            for name, proc in self.machines.items():
                if proc.pid == pid:
                    return leader, name
        return leader, None

    def rank0_machine(self) -> str | None:
        """torchrun: the machine whose worker runs rank 0."""
        for name, proc in self.machines.items():
            if proc.poll() is None:
                for p in self.processes(name):
                    with contextlib.suppress(psutil.Error):
                        if p.environ().get("RANK") == "0" and p.status() != psutil.STATUS_ZOMBIE:
                            return name
        return None

    def state(self) -> dict[str, Any] | None:
        """The controller's state, as kept (sealed) in etcd."""
        key = job_prefix(self.job_id) + "state"
        with contextlib.suppress(EtcdError, ValueError):
            kv = self.etcd.get(key)
            if kv is not None:
                text = security.open_first(key, kv.value, self.secret)
                if text is not None:
                    return json.loads(text)
        return None

    def has_workers(self, name: str) -> bool:
        for p in self.processes(name):
            with contextlib.suppress(psutil.Error):
                if "RANK" in p.environ() and "failover.standby" not in " ".join(p.cmdline()):
                    return True
        return False

    def standby_up(self, name: str) -> bool:
        for p in self.processes(name):
            with contextlib.suppress(psutil.Error):
                line = " ".join(p.cmdline())
                if "failover.standby" in line and "--zygote" not in line:
                    return True
        return False

    def progress(self) -> list[tuple[float, int]]:
        """Rank 0's ``progress`` lines: (time, step)."""
        self.events.poll()
        found = []
        for raw in self.events.lines:
            e = json.loads(raw)
            if e["kind"] == "progress":
                found.append((e["time"], e["step"]))
        return found

    def step(self) -> int | None:
        """The job's latest step: torchrun's checkpoint file, else rank 0's progress lines."""
        with contextlib.suppress(OSError, ValueError, KeyError):
            return json.loads((self.out / "checkpoint.json").read_text())["step"]
        lines = self.progress()
        return max(s for _, s in lines) if lines else None

    def stop(self) -> int:
        """SIGTERM to the leading launcher (it ends the job on every machine), then to
        the others, then SIGKILL to whatever of the job is left; how many were left."""
        leading = self.leader()[1] if self.system == "inprocess" else None
        order = ([leading] if leading else []) + [n for n in self.machines if n != leading]
        for waited in (order[:1], order[1:]):
            for name in waited:
                if self.machines[name].poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        self.machines[name].send_signal(signal.SIGTERM)
            limit = time.monotonic() + 15
            for name in waited:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.machines[name].wait(max(0.1, limit - time.monotonic()))
        left = fvt.tagged(self.tag)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=10)
        for proc in self.machines.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.etcd.close()
        still = fvt.tagged(self.tag)
        if still:
            raise RuntimeError(f"processes of the run survived SIGKILL: {[p.pid for p in still]}")
        return len(left)


def step_at(lines: list[tuple[float, int]], when: float) -> int | None:
    """The step reached at ``when``: the newest progress line before it, plus the
    steps its recent pace gives since (fewer than the 10 between two lines)."""
    before = [(t, s) for t, s in lines if t <= when]
    if not before:
        return None
    t, s = before[-1]
    if len(before) < 2:
        return s
    t0, s0 = before[max(0, len(before) - 4)]
    pace = (t - t0) / max(1, s - s0)  # seconds per step over the last few lines
    return s + min(9, int((when - t) / pace)) if pace > 0 else s


def measure(job: Job, loss: Loss, args: argparse.Namespace, budget: float | None) -> None:
    """Waits for a new leader (``inprocess``) and full size after ``loss``; fills in
    its figures."""
    events = job.events
    limit = time.monotonic() + args.deadline
    if budget is not None:
        limit = min(limit, budget)
    ours = job.system == "inprocess"
    while time.monotonic() < limit:
        if ours and loss.new_leader is None:
            leader, name = job.leader()
            if leader is not None and leader.term > loss.term:
                loss.new_leader = time.time() - loss.killed_at
                loss.new_machine = name
        events.poll()
        if (loss.new_leader is not None or not ours) and events.full_at(loss.killed_at) is not None:
            break
        time.sleep(POLL)
    first = events.first_start(loss.killed_at)
    if first is not None:
        loss.resumed = first - loss.killed_at
        group = [e for e in events.starts if e["time"] >= loss.killed_at]
        opening = min(group, key=lambda e: e["time"])
        loss.resumed_from, loss.resumed_world = opening["step"], opening["world"]
        lines = job.progress()
        last = step_at(lines, loss.killed_at) if ours else loss.step_before
        # the old generation may have gone on past the kill (a spare led): its last line
        later = [s for t, s in lines if loss.killed_at < t < first]
        if later:
            last = max(last or 0, max(later))
        loss.step_before = last
        if last is not None:
            loss.redone = max(0, last - loss.resumed_from)
    full = events.full_at(loss.killed_at)
    loss.full = None if full is None else full - loss.killed_at
    if ours:
        breakdown(job, loss)
    elif budget is not None and time.monotonic() >= budget and loss.full is None:
        raise mn.OutOfBudget("out of time (--peer-timeout): the job was stopped")


def breakdown(job: Job, loss: Loss) -> None:
    """The steps of the takeover, from the controller's events and its store record."""
    state = job.state() or {}

    def first(kind: str, since: float = 0.0) -> float | None:
        times = [
            e["time"]
            for e in state.get("events", [])
            if e.get("kind") == kind and (e.get("time") or 0) >= loss.killed_at + since
        ]
        return min(times) - loss.killed_at if times else None

    loss.recovered = first("recover")
    # (the old controller may have seen its own machine's link close as it died)
    loss.slot_lost = first("node_lost", loss.recovered) if loss.recovered is not None else None
    loss.restart_decided = first("job_restart")
    loss.first_worker = first("worker_start")
    store = state.get("store") or {}
    with contextlib.suppress(TypeError, ValueError, KeyError):
        started = psutil.boot_time() + float(store["start_time"]) / os.sysconf("SC_CLK_TCK")
        if started >= loss.killed_at:
            loss.store_started = started - loss.killed_at


def inject(
    job: Job, args: argparse.Namespace, result: RunResult, started: float, budget: float | None
) -> None:
    events = job.events
    ours = job.system == "inprocess"

    def initial() -> bool:
        events.poll()
        return events.full_at(started) is not None

    if not mn.wait_until(initial, args.deadline * 2, budget):
        raise mn.OutOfTime("the job never trained at full size")
    result.startup = events.full_at(started) - started
    print(f"  start-up: {result.startup:.2f} s", flush=True)
    since = started
    spares = MACHINES
    for index in range(1, args.losses + 1):
        if not mn.wait_stable(job, args, since, budget):
            raise mn.OutOfTime(f"loss {index}: the job is not running at full size")
        if ours:
            leader, name = job.leader()
            if leader is None or name is None:
                raise mn.OutOfTime(f"loss {index}: no leader of this job's machines in etcd")
            role = "training" if job.has_workers(name) else "spare"
            loss = Loss(index, name, role, leader.term, 0.0)
            others = [n for n in job.machines if n != name and job.machines[n].poll() is None]
            if role == "training":  # (a spare lost: no spare needed)
                loss.spare_warm = any(job.standby_up(n) and not job.has_workers(n) for n in others)
        else:
            name = job.rank0_machine()
            if name is None:
                raise mn.OutOfTime(f"loss {index}: no machine runs rank 0")
            loss = Loss(index, name, "training", 0, 0.0)
        loss.killed_at = job.kill_machine(name, loss.killed)
        if not ours:
            loss.step_before = job.step()  # nothing completes without the dead
        result.losses.append(loss)
        measure(job, loss, args, budget)
        print(f"  {describe(loss)}", flush=True)
        if loss.full is None:
            raise mn.OutOfTime(f"loss {index}: not back at full size within {args.deadline:.0f} s")
        since = loss.killed_at
        if index == args.losses:
            break
        fresh = f"m{spares}"
        spares += 1
        restarted = time.time()
        job.start_machine(fresh)
        if not ours:
            since = restarted  # torchrun restarts every worker when a machine joins
            continue

        def warm(n: str = fresh) -> bool:
            return job.standby_up(n)

        if not mn.wait_until(warm, args.warm_timeout, budget):
            result.notes.append(
                f"machine {fresh} started after loss {index}: no warm standby after "
                f"{args.warm_timeout:.0f} s"
            )


def survived(job: Job) -> bool:
    """Still training: the step moving on."""
    before = job.step()
    time.sleep(2.0)
    after = job.step()
    return before is not None and after is not None and after > before


def describe(loss: Loss) -> str:
    if loss.term == 0:  # torchrun
        return (
            f"loss {loss.index} (machine {loss.machine}, rank 0's): resumed "
            f"{fvt.seconds(loss.resumed)} s (world {loss.resumed_world}, step "
            f"{loss.resumed_from}), full size {fvt.seconds(loss.full)} s, redone "
            f"{loss.redone if loss.redone is not None else '-'} (last step {loss.step_before})"
        )
    return (
        f"loss {loss.index} (machine {loss.machine}, the leader, {loss.role}; term "
        f"{loss.term}): new leader {fvt.seconds(loss.new_leader)} s ({loss.new_machine}), "
        f"resumed {fvt.seconds(loss.resumed)} s (world {loss.resumed_world}, step "
        f"{loss.resumed_from}), full size {fvt.seconds(loss.full)} s, redone "
        f"{loss.redone if loss.redone is not None else '-'} (last step {loss.step_before}), "
        f"spare {'-' if loss.spare_warm is None else 'warm' if loss.spare_warm else 'COLD'}; "
        "controller recovered "
        f"{fvt.seconds(loss.recovered)} s, cold restart decided "
        f"{fvt.seconds(loss.restart_decided)} s, store server started "
        f"{fvt.seconds(loss.store_started)} s, lost slot found "
        f"{fvt.seconds(loss.slot_lost)} s, first worker started "
        f"{fvt.seconds(loss.first_worker)} s"
    )


def run(system: str, args: argparse.Namespace, root: Path) -> RunResult:
    """A 3-member etcd, the system's job on 5 machines, the losses; every process
    of the run (etcd's included) ended after."""
    result = RunResult(LABELS[system])
    etcd_cluster = _load_etcd_cluster()
    reason = etcd_cluster.unavailable()
    if reason is not None:
        raise SystemExit(f"coordinator_loss.py: {reason}")
    if system != "inprocess" and importlib.util.find_spec("etcd") is None:
        result.notes.append("skipped: torchrun's etcd-v2 rendezvous needs python-etcd")
        print(f"\n== {result.system}: {result.notes[-1]}", flush=True)
        return result
    result.load.append(os.getloadavg()[0])
    cluster = etcd_cluster.EtcdCluster(root / system / "etcd", 3, system != "inprocess").start()
    budget = None if system == "inprocess" else time.monotonic() + args.peer_timeout
    try:
        work = root / system / "job"
        work.mkdir(parents=True)
        job = Job(system, args, work, cluster.endpoints)
        result.command = job.shown_command()
        print(f"\n== {result.system}: {result.command}  (x{MACHINES})", flush=True)
        started = time.time()
        try:
            for i in range(MACHINES):
                job.start_machine(f"m{i}")
            inject(job, args, result, started, budget)
        except mn.OutOfTime as ex:
            result.cut = isinstance(ex, mn.OutOfBudget)
            result.notes.append(str(ex))
            print(f"  {ex}", flush=True)
        finally:
            result.survived = survived(job)
            result.wall = time.time() - started
            result.load.append(os.getloadavg()[0])
            stops = {signal.SIGINT, signal.SIGTERM}
            signal.pthread_sigmask(signal.SIG_BLOCK, stops)
            try:
                result.leftovers = job.stop()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            result.notes.append(mn.log_summary(work))
    finally:
        cluster.close()
    return result


def table(results: list[RunResult], args: argparse.Namespace) -> str:
    cols = [
        "system",
        "start-up s",
        "new leader s",
        "resumed s",
        "full size s",
        "redone steps",
        "survived",
    ]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    planned = args.losses
    for r in results:
        got = r.losses
        if not r.load:  # skipped
            rows.append(f"| {r.system} | {'; '.join(r.notes)} |" + " |" * (len(cols) - 2))
            continue
        cells = [
            r.system,
            fvt.seconds(r.startup),
            mn.cell([x.new_leader for x in got], planned, "s")
            if r.system == LABELS["inprocess"]
            else "n/a",
            mn.cell([x.resumed for x in got], planned, "s"),
            mn.cell([x.full for x in got], planned, "s"),
            mn.cell([x.redone for x in got], planned),
            f"cut off by --peer-timeout ({args.peer_timeout:.0f} s)"
            if r.cut
            else ("yes" if r.survived else "no"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", type=int, default=3, help="losses of the leader's machine")
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="the example's short Wrapper intervals (default: the Wrapper's defaults)",
    )
    parser.add_argument("--steps", type=int, default=1_000_000, help="job length (stopped early)")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds per step")
    parser.add_argument(
        "--persist-every", type=int, default=10, help="steps between two snapshots on disk"
    )
    parser.add_argument("--settle", type=float, default=2.0, help="s at full size before a loss")
    parser.add_argument("--deadline", type=float, default=120.0, help="s for a loss to recover")
    parser.add_argument(
        "--warm-timeout",
        type=float,
        default=60.0,
        help="s a new machine has to bring its warm standby up",
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=180.0, help="s each torchrun run may take in all"
    )
    parser.add_argument(
        "--only", choices=SYSTEMS, action="append", help="run only this system (repeatable)"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "coordinator_loss.json"
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs and events")
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    if args.losses < 1:
        parser.error(f"--losses must be >= 1, got {args.losses}")
    if args.persist_every < 1:
        parser.error(f"--persist-every must be >= 1, got {args.persist_every}")
    for name in ("step_time", "settle", "deadline", "warm_timeout", "peer_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    systems = [s for s in SYSTEMS if s in (args.only or SYSTEMS)]
    root = Path(tempfile.mkdtemp(prefix="coordinator_loss_"))
    results: list[RunResult] = []
    try:
        for system in systems:
            results.append(run(system, args, root))
    finally:
        if args.keep:
            print(f"\nlogs and events kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    text = table(results, args)
    loads = ", ".join(f"{r.system} {r.load[0]:.1f} -> {r.load[-1]:.1f}" for r in results if r.load)
    print(
        "\nmedian (worst) n/planned, seconds from the kill of the machine lost (inprocess: "
        "its launcher leads; torchrun: it runs rank 0); start-up: launch -> every rank "
        f"training at full size; {os.cpu_count()} cores, load average (start -> end): "
        f"{loads}\n" + text
    )
    for r in results:
        for note in r.notes:
            print(f"  {r.system}: {note}")
        got = [x for x in r.losses if x.term]
        if got:
            parts = ", ".join(
                f"{label} {fvt.seconds(statistics.median(v))}"
                for label, v in (
                    ("new leader", [x.new_leader for x in got if x.new_leader is not None]),
                    ("controller recovered", [x.recovered for x in got if x.recovered is not None]),
                    (
                        "cold restart decided",
                        [x.restart_decided for x in got if x.restart_decided is not None],
                    ),
                    (
                        "store server started",
                        [x.store_started for x in got if x.store_started is not None],
                    ),
                    ("lost slot found", [x.slot_lost for x in got if x.slot_lost is not None]),
                    (
                        "first worker started",
                        [x.first_worker for x in got if x.first_worker is not None],
                    ),
                    ("resumed", [x.resumed for x in got if x.resumed is not None]),
                )
                if v
            )
            print(f"  {r.system}: medians from the kill: {parts}")
    record = {
        "command": "benchmarks/coordinator_loss.py " + " ".join(argv),
        "date": str(datetime.date.today()),
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
            "etcd": _etcd_version(),
        },
        "args": {k: mn.shown(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": [dataclasses.asdict(r) for r in results],
        "table": text,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    ours = next((r for r in results if r.system == LABELS["inprocess"]), None)
    if ours is None:
        return 0
    done = len(ours.losses) == args.losses and all(x.full is not None for x in ours.losses)
    return 0 if done and ours.survived else 1


def _etcd_version() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [shutil.which("etcd") or "etcd", "--version"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return out.splitlines()[0] if out else None
    return None


if __name__ == "__main__":
    sys.exit(main())
