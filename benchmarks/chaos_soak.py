"""Chaos soak of ``inprocess-run``: random faults on every process of a job.

Each run launches a 2 nodes x 2 workers job (``tests/workers/chaos_train.py``,
gloo on CPU, loopback) and injects a seeded sequence of faults, each once the
job made progress since the previous one:

* a worker: SIGKILL, SIGSTOP, SIGTERM, or an exception raised in its training loop;
* the controller: SIGKILL, SIGSTOP, SIGTERM;
* the store server: SIGKILL, SIGSTOP, SIGTERM.

Every run must end with exit 0 and the exact step count (the checkpoint and
every worker's result: ``step == w == --steps``), or with a non-zero exit and
a reason recorded in ``state.json`` (a limit was hit, or SIGTERM of the
controller, which stops the job by design); within the deadline; and with no
process of the job left running. ``tests/test_chaos.py`` runs a few seeded
runs of this in CI.

    .venv/bin/python benchmarks/chaos_soak.py --runs 10 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from inprocess.failover.supervisor import job_processes

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "workers" / "chaos_train.py"
ENV = dict(
    os.environ,
    PYTHONWARNINGS="ignore:Failed to initialize NumPy",
    RES_OPTIONS="timeout:1 attempts:1",
)
#: (target, kind) -> weight
FAULTS: dict[tuple[str, str], int] = {
    ("worker", "SIGKILL"): 4,
    ("worker", "SIGSTOP"): 2,
    ("worker", "SIGTERM"): 2,
    ("worker", "exception"): 4,
    ("controller", "SIGKILL"): 2,
    ("controller", "SIGSTOP"): 1,
    ("controller", "SIGTERM"): 1,
    ("store", "SIGKILL"): 2,
    ("store", "SIGSTOP"): 1,
    ("store", "SIGTERM"): 1,
}
#: limits of every run: generous, so that most runs complete
FLAGS = [
    "--max-restarts", "8",
    "--per-node-max-failures", "6",
    "--job-max-restarts", "6",
    "--node-max-relaunches", "2",
    "--spare-nodes", "1",
    "--monitor-interval", "0.05",
]  # fmt: skip


@dataclasses.dataclass
class Fault:
    at: float  # seconds since the launch
    target: str
    kind: str
    pid: int | None
    step: int


@dataclasses.dataclass
class RunResult:
    seed: int
    faults: list[Fault]
    exit_code: int | None
    reason: str | None
    duration: float
    final_step: int | None
    generations: int
    problems: list[str]  # broken guarantees; empty when the run is correct

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        faults = ", ".join(f"{f.target}:{f.kind}@{f.step}" for f in self.faults) or "none"
        verdict = "OK" if self.ok else "BROKEN: " + "; ".join(self.problems)
        return (
            f"seed {self.seed}: exit {self.exit_code} in {self.duration:.1f}s, "
            f"{self.generations} generation(s), final step {self.final_step}; faults: {faults}; "
            f"reason: {self.reason}; {verdict}"
        )


def _read_json(path: Path) -> Any:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, ValueError):
        return json.loads(path.read_text())
    return None


def _belongs(pid: int, job_id: str) -> bool:
    """Whether ``pid`` is a live process of this job (never signal a reused pid)."""
    try:
        proc = psutil.Process(pid)
        return proc.environ().get("INPROCESS_JOB_ID") == job_id and proc.status() not in (
            psutil.STATUS_ZOMBIE,
            psutil.STATUS_DEAD,
        )
    except psutil.Error:
        return False


def run_one(
    seed: int,
    workdir: Path,
    faults: int = 3,
    steps: int = 400,
    deadline: float = 300.0,
    log: Any = None,
    time_scale: float = 1.0,
) -> RunResult:
    """One launch with ``faults`` random faults; checks every guarantee.
    ``time_scale`` stretches the workers' detection timeouts (a loaded machine)."""
    rng = random.Random(seed)
    job_id = f"chaos-{seed}-{os.getpid()}-{time.monotonic_ns()}"
    state_dir, out = workdir / "state", workdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    say = log or (lambda msg: None)
    start = time.monotonic()
    with open(workdir / "launcher.log", "wb") as output:
        # fmt: off
        command = [
            sys.executable, "-m", "inprocess.failover.cli",
            "--nnodes", "2", "--nproc-per-node", "2",
            "--state-dir", str(state_dir), "--job-id", job_id, *FLAGS,
            str(SCRIPT), "--steps", str(steps), "--step-time", "0.03",
            "--result-dir", str(out),
        ]
        # fmt: on
        proc = subprocess.Popen(
            command,
            env={**ENV, "CHAOS_TIME_SCALE": str(time_scale)},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        injected: list[Fault] = []
        try:
            _inject(proc, rng, faults, start, deadline, state_dir, out, job_id, injected, say)
            code = proc.wait(max(1.0, start + deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    duration = time.monotonic() - start
    return _check(seed, injected, code, duration, steps, state_dir, out, job_id)


def _inject(proc, rng, faults, start, deadline, state_dir, out, job_id, injected, say) -> None:
    checkpoint = out / "checkpoint.json"
    targets = list(FAULTS)
    weights = [FAULTS[t] for t in targets]

    def step() -> int:
        data = _read_json(checkpoint)
        return data["step"] if data else 0

    last = 0
    for _ in range(faults):
        # wait for progress since the previous fault (the job recovered), then a random delay
        need = last + rng.randint(5, 25)
        while step() < need:
            if proc.poll() is not None or time.monotonic() > start + deadline:
                return
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 1.0))
        if proc.poll() is not None:
            return
        target, kind = rng.choices(targets, weights)[0]
        state = _read_json(state_dir / "state.json") or {}
        pid: int | None = None
        if target == "worker":
            rank = rng.randrange(4)
            if kind == "exception":
                (out / f"raise{rank}").write_text("")
            else:
                pid = (state.get("workers", {}).get(str(rank)) or {}).get("pid")
            target = f"worker{rank}"
        elif target == "controller":
            with contextlib.suppress(OSError, ValueError):
                pid = int((state_dir / "controller.pid").read_text())
        else:
            pid = (state.get("store") or {}).get("pid")
        if kind != "exception":
            if pid is None or not _belongs(pid, job_id):
                continue  # between incarnations: skip this fault
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, getattr(signal, kind))
        last = step()
        fault = Fault(round(time.monotonic() - start, 2), target, kind, pid, last)
        injected.append(fault)
        say(f"  {fault.at:6.1f}s step {last}: {target} {kind}")


def _check(seed, injected, code, duration, steps, state_dir, out, job_id) -> RunResult:
    problems: list[str] = []
    if code is None:
        problems.append("the job did not end before the deadline")
    state = _read_json(state_dir / "state.json") or {}
    reason = state.get("reason")
    checkpoint = _read_json(out / "checkpoint.json")
    final = checkpoint["step"] if checkpoint else None
    if code == 0:
        if checkpoint != {"step": steps, "w": float(steps)}:
            problems.append(f"exit 0 but the checkpoint is {checkpoint}")
        last: dict[int, dict] = {}
        events = (out / "events.jsonl").read_text().splitlines()
        for line in events:
            e = json.loads(line)
            if e["kind"] == "finish":
                last[e["rank"]] = e["result"]
        # A relaunched worker that the job completed without returns None.
        exact = {"step": steps, "w": float(steps)}
        results = [r for r in last.values() if r is not None]
        wrong = [r for r in results if {k: r[k] for k in exact} != exact]
        if sorted(last) != [0, 1, 2, 3] or not results or wrong:
            problems.append(f"exit 0 but the workers' results are {last}")
    elif code is not None:
        if state.get("stage") != "STOPPED" or not reason or state.get("exit_code") != code:
            problems.append(
                f"exit {code} without a recorded reason (stage {state.get('stage')}, "
                f"exit_code {state.get('exit_code')}, reason {reason!r})"
            )
    deadline = time.monotonic() + 10
    while job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = job_processes(job_id)
    if leftovers:
        problems.append(f"processes left running: {[p.pid for p in leftovers]}")
        for p in leftovers:
            with contextlib.suppress(psutil.Error):
                p.kill()
    return RunResult(
        seed=seed,
        faults=injected,
        exit_code=code,
        reason=reason,
        duration=duration,
        final_step=final,
        generations=int(state.get("generation", 0)) + 1,
        problems=problems,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="run i uses seed SEED + i")
    parser.add_argument("--faults", type=int, default=4, help="faults per run")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--deadline", type=float, default=400.0, help="seconds per run")
    parser.add_argument("--keep", type=Path, help="keep each run's directory under this one")
    args = parser.parse_args()
    results = []
    for i in range(args.runs):
        seed = args.seed + i
        print(f"run {i + 1}/{args.runs} (seed {seed})", flush=True)
        with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
            workdir = (args.keep / f"seed{seed}") if args.keep else Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            result = run_one(seed, workdir, args.faults, args.steps, args.deadline, _print)
        results.append(result)
        print(result.summary(), flush=True)
    faults = collections.Counter(
        f"{f.target.rstrip('0123456789')} {f.kind}" for r in results for f in r.faults
    )
    outcomes = collections.Counter(
        "completed, exact step count"
        if r.ok and r.exit_code == 0
        else f"exit {r.exit_code}: {_reason_kind(r.reason)}"
        if r.ok
        else "BROKEN"
        for r in results
    )
    durations = sorted(r.duration for r in results)
    print(f"\n{len(results)} runs, {sum(len(r.faults) for r in results)} faults")
    for name, n in sorted(faults.items()):
        print(f"  fault {name}: {n}")
    for name, n in sorted(outcomes.items()):
        print(f"  outcome {name}: {n}")
    print(f"  run time: median {durations[len(durations) // 2]:.1f}s, max {durations[-1]:.1f}s")
    broken = [r for r in results if not r.ok]
    print(f"  guarantees broken: {len(broken)}")
    return 1 if broken else 0


def _print(message: str) -> None:
    print(message, flush=True)


def _reason_kind(reason: str | None) -> str:
    if not reason:
        return "no reason"
    for key in ("SIGTERM", "max_restarts", "job_max_restarts", "node_max_relaunches"):
        if key in reason:
            return key
    return reason[:60]


if __name__ == "__main__":
    sys.exit(main())
