"""The demo: a real training job that survives faults, with a summary at the end.

Runs ``examples/train_state.py`` (data-parallel, gloo on CPU; its training state
kept by ``call_wrapper.restore``/``commit`` in host memory, no checkpoint file)
under ``inprocess-run`` on 2 nodes x 2 workers, and while it trains:

* the training script raises an exception on a random rank every 150 steps:
  every rank restarts in-process (the Wrapper), nobody's process is restarted;
* the demo SIGKILLs a worker process: the survivors go on in-process at world
  size 3 from their own memory, the controller relaunches the worker, and it
  rejoins (world size 4), its state healed from a peer;
* the demo SIGKILLs the controller: the supervisor starts a new one, which
  recovers from its state file and re-attaches to the workers, which never
  stopped training.

At the end it prints every fault with its restart latency (from the fault to
the moment every rank trains again with a working process group), the steps it
made the job redo (completed before the fault, run again after it) and where
the state came from, and checks that the job applied exactly the requested
number of steps. Then it writes the
job's report (``inprocess-run report``) and its timeline picture, and prints
their paths.

    python examples/demo.py [--steps 600] [--out runs/demo]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train_state.py"


class Demo:
    def __init__(self, out: Path, steps: int) -> None:
        self.out = out
        self.steps = steps
        self.state_dir = out / "state"
        self.results = out / "results"
        self.kills: list[tuple[str, float]] = []

    def launch(self) -> subprocess.Popen[bytes]:
        env = dict(
            os.environ,
            PYTHONWARNINGS="ignore:Failed to initialize NumPy",
            RES_OPTIONS=os.environ.get("RES_OPTIONS", "timeout:1 attempts:1"),
        )
        command = [
            sys.executable, "-m", "inprocess.failover.cli",
            "--nnodes", "2", "--nproc-per-node", "2",
            "--state-dir", str(self.state_dir),
            "--log-level", "WARNING",
            str(TRAIN),
            "--steps", str(self.steps), "--step-time", "0.02",
            "--fault-every", "150", "--seed", "1",
            "--result-dir", str(self.results),
        ]  # fmt: skip
        print("$", " ".join(command[2:]).replace(str(REPO) + "/", ""), flush=True)
        return subprocess.Popen(command, env=env)

    def step(self) -> int:
        """The newest step rank 0 reported (its ``progress`` lines, every 10 steps)."""
        try:
            lines = (self.results / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return 0
        steps = [0]
        for line in lines:
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if e.get("kind") in ("progress", "start") and e.get("rank") == 0:
                steps.append(e["step"])
        return max(steps)

    def wait_for_step(self, step: int, job: subprocess.Popen[bytes]) -> None:
        while self.step() < step:
            if job.poll() is not None:
                raise SystemExit(f"the job ended early (exit code {job.returncode})")
            time.sleep(0.05)

    def kill_worker(self, rank: int) -> None:
        state = json.loads((self.state_dir / "state.json").read_text())
        pid = state["workers"][str(rank)]["pid"]
        print(f"\n>>> demo: SIGKILL worker {rank} (pid {pid}) at step {self.step()}\n", flush=True)
        self.kills.append((f"worker {rank} process killed (SIGKILL)", time.time()))
        os.kill(pid, signal.SIGKILL)

    def kill_controller(self) -> None:
        pid = int((self.state_dir / "controller.pid").read_text())
        print(f"\n>>> demo: SIGKILL the controller (pid {pid}) at step {self.step()}\n", flush=True)
        self.kills.append(("controller killed (SIGKILL)", time.time()))
        os.kill(pid, signal.SIGKILL)

    def events(self) -> list[dict]:
        lines = (self.results / "events.jsonl").read_text().splitlines()
        return sorted((json.loads(line) for line in lines if line), key=lambda e: e["time"])

    @staticmethod
    def state_of(group: list[dict]) -> tuple[str, str]:
        """A restart's redone steps (rank 0's account) and where the ranks' state came from."""
        first = next((s for s in group if s["rank"] == 0), group[0])
        redone = str(max(0, first["completed"] - first["step"]))
        record = next((s["restore"] for s in group if s.get("restore")), None) or {}
        sources = ", ".join(f"{k} {n}" for k, n in (record.get("sources") or {}).items() if n)
        return redone, sources or "-"

    def summary(self, exit_code: int, elapsed: float) -> bool:
        events = self.events()
        starts = [e for e in events if e["kind"] == "start"]
        faults = [(f"exception on worker {e['rank']} at step {e['step']}", e["time"])
                  for e in events if e["kind"] == "fault"]  # fmt: skip
        print("\n" + "=" * 100)
        print(
            f"{'fault':<42} {'back in training after':>24} {'world':>6} {'redone':>7}  "
            "state restored from"
        )
        redone_total = 0
        for label, when in sorted(faults + self.kills, key=lambda f: f[1]):
            if label.startswith("controller"):
                print(f"{label:<42} {'(workers never stopped)':>24} {'4':>6} {'0':>7}  -")
                continue
            after = [s for s in starts if s["time"] > when]
            if not after:
                continue
            first_iteration = after[0]["iteration"]
            group = [s for s in after if s["iteration"] == first_iteration]
            latency = max(s["time"] for s in group) - when
            redone, sources = self.state_of(group)
            redone_total += int(redone)
            print(f"{label:<42} {latency:>22.3f} s {group[0]['world']:>6} {redone:>7}  {sources}")
            if label.startswith("worker"):  # a lost worker: when was the job at full size again?
                full = [s for s in after if s["world"] == 4]
                if full:
                    iteration = full[0]["iteration"]
                    group = [s for s in full if s["iteration"] == iteration]
                    back = max(s["time"] for s in group)
                    redone, sources = self.state_of(group)
                    redone_total += int(redone)
                    print(
                        f"{'  ... relaunched worker rejoined':<42} {back - when:>22.3f} s {4:>6} "
                        f"{redone:>7}  {sources}"
                    )
        state = json.loads((self.state_dir / "state.json").read_text())
        finishes = [e for e in events if e["kind"] == "finish"]
        exact = len(finishes) == 4 and all(
            e["result"] == {"step": self.steps, "w": float(self.steps), "world": 4}
            for e in finishes
        )
        print("=" * 100)
        print(
            f"redone steps in all: {redone_total} (a fault costs at most the step it interrupted; "
            "no checkpoint file)"
        )
        print(f"job exit code {exit_code} ({state['reason']}) after {elapsed:.1f} s")
        print(
            f"worker process restarts {sum(state['worker_restarts'].values())}, "
            f"cold job restarts {state['job_restarts']}, in-process restarts "
            f"{max(s['iteration'] for s in starts)}"
        )
        verdict = "exact" if exact else "NOT exact"
        print(f"steps applied: {self.steps} requested, {verdict} on all 4 workers (w == step)")
        print(f"state file: {self.state_dir / 'state.json'}")
        return exit_code == 0 and exact

    def report(self) -> None:
        """The job's report and timeline picture (``inprocess-run report``)."""
        picture = self.out / "timeline.png"
        print("\n$ inprocess-run report", self.state_dir, "--plot", picture, flush=True)
        subprocess.run(
            [sys.executable, "-m", "inprocess.failover.cli", "report", str(self.state_dir),
             "--plot", str(picture)],
            check=False,
        )  # fmt: skip
        print(f"records: {self.state_dir / 'restarts.jsonl'}")
        print(f"events:  {self.state_dir / 'events.jsonl'}")
        if picture.exists():
            print(f"picture: {picture}")


def main() -> int:
    parser = argparse.ArgumentParser(description="inprocess demo")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / time.strftime("demo-%H%M%S"))
    args = parser.parse_args()
    demo = Demo(args.out.absolute(), args.steps)
    start = time.time()
    job = demo.launch()
    try:
        demo.wait_for_step(100, job)
        demo.kill_worker(1)
        demo.wait_for_step(320, job)
        demo.kill_controller()
        exit_code = job.wait(timeout=600)
    except BaseException:
        job.send_signal(signal.SIGTERM)
        job.wait(60)
        raise
    ok = demo.summary(exit_code, time.time() - start)
    demo.report()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
