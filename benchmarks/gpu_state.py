"""Training state on a GPU: what ``commit`` costs a step, and what a fault costs.

One command, at most about 5 minutes on one GPU, JSON lines on stdout:

1. **Overhead** (this process, no faults): an MLP of 8 x 4096 x 4096 layers, bf16
   autocast, Adam (1.61 GB of fp32 state on the GPU), at two step lengths (the
   batch is calibrated to ``--short-ms`` and ``--long-ms`` without snapshots).
   Rounds of blocks, one block per way of keeping state, interleaved in the same
   process; the median step per way (``kind: overhead``):

   * ``none``: nothing;
   * ``commit``: ``commit`` every step, the library's default (staged on the
     device where it has room, coalesced while a copy is in flight);
   * ``commit_unstaged``: the same with ``snapshot_staging=False`` (the optimizer
     step waits for the copy to host);
   * ``blocking_pinned``: a copy into pinned host memory that the step waits for
     (the shape of DLRover's flash checkpoint);
   * ``side_stream``: the same copy on a side stream, only the next optimizer
     step waits for it (the reference for the library's overhead);

   and the blocking part of a save per call (``kind: save``): DCP ``async_save``
   and ``torch.save`` to ``/dev/shm``. Each ``commit`` way reports the commits it
   coalesced: at most ``coalesced / commits`` of the steps lack a snapshot.
2. **Faults** (``inprocess-run --nproc-per-node 2``, default settings, 2 ranks on
   one GPU over gloo with CUDA tensors, ``workers/gpu_train.py``, 50 MB of
   state per ``--layers``; only the failure limits raised, to 10): a fault-free
   run, then one run with an exception, a device-side assert and 5 SIGKILLs
   (each healed from a peer), each fault once the job has run ``--settle`` seconds at full size (the
   standby is ready again). ``kind: exactness``: the final parameters' CRC
   against the fault-free run's, the steps redone per fault, the exit code of
   the rank whose GPU faulted and whether anything printed ``terminate
   called``; ``kind: rejoin``: kill to full size per kill, median and max, and
   each kill's timeline (relaunched, the replacement's script running and what
   its CUDA start took, the survivor restarted at reduced size, the full-size
   iteration's restore, both ranks at full size, and how long that iteration's
   first step took: a new rank's first commit pins its host buffers).

    .venv/bin/python benchmarks/gpu_state.py                  # on a GPU machine
    .venv/bin/python benchmarks/gpu_state.py --device cpu --quick   # smoke test here

Exit status 0 when the faults run's CRC equals the fault-free run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "workers" / "gpu_train.py"
sys.path.insert(0, str(REPO))


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


# ---------------------------------------------------------------- overhead


def build(hidden: int, layers: int, device: torch.device):
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for q in model.parameters():  # the moments exist from the start: the state's full size
        q.grad = torch.zeros_like(q)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


class Ways:
    """Each way of keeping state: ``before_optimizer()`` and ``after_step(step)``."""

    def __init__(self, model, opt, device: torch.device, shm: Path) -> None:
        from inprocess.snapshot import Snapshots

        self.model, self.opt, self.device, self.shm = model, opt, device, shm
        self.state = {"model": model, "optim": opt}
        self.snapshots = {
            "commit": Snapshots(),
            "commit_unstaged": Snapshots(staging=False),
        }
        self.commits = dict.fromkeys(self.snapshots, 0)
        cuda = device.type == "cuda"
        self.tensors = _tensors(self.state)
        self.host = (
            [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self.tensors]
            if cuda
            else []
        )
        self.side = torch.cuda.Stream() if cuda else None
        self.pending = None
        self.names = ["none", "commit", "commit_unstaged"]
        if cuda:
            self.names += ["blocking_pinned", "side_stream"]

    def before_optimizer(self, way: str) -> None:
        if way == "side_stream" and self.pending is not None:
            torch.cuda.current_stream().wait_event(self.pending)
            self.pending = None

    def after_step(self, way: str, step: int) -> None:
        if way in self.snapshots:
            self.snapshots[way].commit(self.state, step, 0)
            self.commits[way] += 1
        elif way == "blocking_pinned":
            with torch.no_grad():
                for dst, src in zip(self.host, self.tensors, strict=True):
                    dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream().synchronize()
        elif way == "side_stream":
            current = torch.cuda.current_stream()
            self.side.wait_stream(current)
            with torch.no_grad(), torch.cuda.stream(self.side):
                for dst, src in zip(self.host, self.tensors, strict=True):
                    dst.copy_(src, non_blocking=True)
                self.pending = torch.cuda.Event()
                self.pending.record(self.side)

    def coalesced(self, way: str) -> int:
        return self.snapshots[way]._device.coalesced

    def close(self) -> None:
        for s in self.snapshots.values():
            s.close()


def _tensors(state) -> list[torch.Tensor]:
    from inprocess.snapshot import layout

    return layout.capture(state)[1]


def run_steps(model, opt, ways: Ways, way: str, n: int, batch: int, hidden: int, step0: int):
    """``n`` steps; the wall time of each (one synchronization a step, ``loss.item()``)."""
    device = ways.device
    x = torch.randn(batch, hidden, device=device)
    times = []
    t0 = time.perf_counter()
    for i in range(n):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(x).float().square().mean()
        loss.backward()
        ways.before_optimizer(way)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ways.after_step(way, step0 + i + 1)
        loss.item()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times


def calibrate(model, opt, ways: Ways, hidden: int, target_s: float) -> int:
    """The batch whose step takes about ``target_s`` without snapshots."""

    def measure(b: int) -> float:
        run_steps(model, opt, ways, "none", 3, b, hidden, 0)
        return statistics.median(run_steps(model, opt, ways, "none", 8, b, hidden, 0))

    return calibrated_batch(measure, target_s)


def calibrated_batch(
    measure: Callable[[int], float], target_s: float, start: int = 512, most: int = 1 << 17
) -> int:
    """The batch (at most ``most``) whose ``measure`` is about ``target_s``: doubled
    from ``start`` until a step takes half of it (small batches all take the GPU's
    fixed latency, so no line through two of them says anything), then up to four
    proportional corrections (a busy GPU's step time is about proportional to
    its batch)."""
    b = start
    t = measure(b)
    while t < target_s / 2 and b < most:
        b = min(most, b * 2)
        t = measure(b)
    for _ in range(4):
        if abs(t / target_s - 1) < 0.03:
            break
        b = min(most, max(8, round(b * target_s / t)))
        t = measure(b)
    return b


def overhead(args, device: torch.device) -> None:
    hidden, layers = (4096, 8) if not args.quick else (512, 4)
    model, opt = build(hidden, layers, device)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        ways = Ways(model, opt, device, Path(d))
        state_gb = sum(t.numel() * t.element_size() for t in ways.tensors) / 1e9
        step = 0
        for label, target in (("short", args.short_ms / 1e3), ("long", args.long_ms / 1e3)):
            batch = calibrate(model, opt, ways, hidden, target) if not args.quick else 64
            per_way: dict[str, list[float]] = {w: [] for w in ways.names}
            for _round in range(args.rounds):
                for way in ways.names:
                    times = run_steps(model, opt, ways, way, args.block, batch, hidden, step)
                    step += args.block
                    per_way[way] += times[3:]  # the first steps of a block: the switch
            base = statistics.median(per_way["none"])
            for way, times in per_way.items():
                med = statistics.median(times)
                line = {
                    "kind": "overhead", "step": label, "batch": batch, "way": way,
                    "state_gb": round(state_gb, 3), "median_ms": round(med * 1e3, 2),
                    "overhead_pct": round(100 * (med / base - 1), 1), "steps": len(times),
                }  # fmt: skip
                if way in ways.snapshots:
                    line["commits"] = ways.commits[way]
                    line["coalesced"] = ways.coalesced(way)
                emit(**line)
            saves(args, ways, label)
        ways.close()


def saves(args, ways: Ways, label: str) -> None:
    """The blocking part of one save, per call: DCP async_save and torch.save."""
    import torch.distributed.checkpoint as dcp

    sd = {"model": ways.model.state_dict(), "optim": ways.opt.state_dict()}
    shm = ways.shm
    blocking = []
    for i in range(args.saves):
        t0 = time.perf_counter()
        future = dcp.async_save(sd, checkpoint_id=str(shm / f"dcp-{label}-{i}"))
        blocking.append(time.perf_counter() - t0)
        future.result()
    emit(kind="save", step=label, way="dcp_async_save", seconds=[round(x, 3) for x in blocking])
    blocking = []
    for i in range(args.saves):
        t0 = time.perf_counter()
        torch.save(sd, shm / f"save-{label}-{i}.pt")
        blocking.append(time.perf_counter() - t0)
        (shm / f"save-{label}-{i}.pt").unlink()
    emit(kind="save", step=label, way="torch_save_shm", seconds=[round(x, 3) for x in blocking])


# ---------------------------------------------------------------- faults


def job(args, out: Path, faults: str, extra: list[str]) -> tuple[int, str, float]:
    out.mkdir(parents=True)
    # Only the failure limits are raised (their defaults, 3, stop a job that loses
    # workers this often; they bound how many faults are tolerated, not how fast)
    cmd = [
        sys.executable, "-m", "inprocess.failover.cli", "--nnodes", "1",
        "--nproc-per-node", "2", "--max-restarts", "10", "--per-node-max-failures", "10",
        "--state-dir", str(out / "state"),
        str(WORKER), "--out", str(out), "--device", args.device, "--faults", faults, *extra,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    started = time.monotonic()
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout, cwd=REPO
    )
    output = proc.stdout + proc.stderr
    (out / "output.txt").write_text(output)  # what the launcher and the workers printed
    return proc.returncode, output, time.monotonic() - started


def events(out: Path) -> list[dict]:
    with open(out / "events.jsonl") as f:
        return [json.loads(line) for line in f]


def controller_events(out: Path) -> list[dict]:
    with open(out / "state" / "events.jsonl") as f:
        return [e for e in map(json.loads, f) if e.get("type") == "event"]


def _since(t: float | None, fault: dict) -> float | None:
    return None if t is None else round(t - fault["time"], 3)


def everything_printed(out: Path, output: str) -> str:
    texts = [output]
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".txt", ".json", ".jsonl"):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                texts.append(path.read_text())
    return "\n".join(texts)


def faults_phase(args, root: Path) -> bool:
    steps = 60 if args.quick else 120
    extra = ["--steps", str(steps), "--settle", str(args.settle), "--layers", str(args.layers)]
    if args.quick:
        extra += ["--hidden", "256", "--layers", "2", "--batch", "16"]
    rc, output, seconds = job(args, root / "clean", "", extra)
    clean = [e for e in events(root / "clean") if e["event"] == "done"]
    emit(kind="job", run="clean", returncode=rc, seconds=round(seconds, 1))
    if rc != 0 or not clean:
        print(output[-4000:], file=sys.stderr)
        return False
    kills = ["kill:1:{}", "kill:0:{}", "kill:1:{}", "kill:0:{}", "kill:1:{}"]
    at = [8 + i * (steps - 16) // 7 for i in range(7)]
    plan = [f"raise:0:{at[0]}"]
    if args.device == "cuda":
        plan.append(f"assert:1:{at[1]}")
    plan += [k.format(s) for k, s in zip(kills, at[2:], strict=True)]
    out = root / "faults"
    rc, output, seconds = job(args, out, ",".join(plan), extra)
    emit(kind="job", run="faults", returncode=rc, seconds=round(seconds, 1))
    evs = events(out)
    done = [e for e in evs if e["event"] == "done"]
    printed = everything_printed(out, output)
    starts = [e for e in evs if e["event"] == "start"]
    faults = [e for e in evs if e["event"] == "fault"]
    relaunches = [e for e in controller_events(out) if e["event"] == "worker_relaunch"]
    redone, rejoin, timeline = [], [], []
    for n, fault in enumerate(faults):
        # what happened between this fault and the next one
        until = faults[n + 1]["time"] if n + 1 < len(faults) else float("inf")
        after = [s for s in starts if fault["time"] < s["time"] < until]
        if not after:
            continue
        redone.append({"kind": fault["kind"], "step": fault["step"],
                       "restored": sorted({s["step"] for s in after}),
                       "redone": fault["step"] - min(s["step"] for s in after)})  # fmt: skip
        full = [s for s in after if s["world"] == 2]
        if fault["kind"] == "kill" and full:
            iteration = full[0]["iteration"]
            back = max(s["time"] for s in full if s["iteration"] == iteration)
            rejoin.append(back - fault["time"])
            relaunch = next((r["time"] for r in relaunches if r["time"] > fault["time"]), None)
            script = [e for e in evs
                      if e["event"] == "script" and fault["time"] < e["time"] < back]  # fmt: skip
            restores = [s["restore"] for s in full
                        if s["iteration"] == iteration and s.get("restore")]  # fmt: skip
            timeline.append({
                "rank": fault["rank"],
                "relaunched_s": _since(relaunch, fault),
                "script_s": _since(script[0]["time"] if script else None, fault),
                # of the script's start: CUDA's driver and the device's context
                "cuda_start_s": script[0].get("cuda") if script else None,
                "reduced_size_s": _since(min(s["time"] for s in after), fault),
                # the full-size iteration's restore (a peer sends the new rank its state)
                "restore_s": max((r["seconds"] for r in restores), default=None),
                "restore_mb": round(max((r["bytes"] for r in restores), default=0) / 1e6, 1),
                "full_size_s": round(back - fault["time"], 3),
                # the full-size iteration's first step, slowest rank (a new rank's
                # first commit pins its host buffers meanwhile)
                "first_step_s": max((e["seconds"] for e in evs if e["event"] == "first_step"
                                     and e["iteration"] == iteration and e["world"] == 2
                                     and e["time"] > fault["time"]), default=None),
            })  # fmt: skip
    ok = rc == 0 and bool(done) and done[0]["crc"] == clean[0]["crc"]
    emit(
        kind="exactness",
        crc_equal=ok,
        crc=done[0]["crc"] if done else None,
        reference=clean[0]["crc"],
        faults=redone,
        redone_max=max((r["redone"] for r in redone), default=None),
        gpu_fault_exit_code_seen="exited with code 75" in printed,
        terminate_called="terminate called" in printed,
        cold_restarts=sum(e["event"] == "cold_restart" for e in controller_events(out)),
    )
    if rejoin:
        emit(kind="rejoin", kills=len(rejoin), seconds=[round(x, 3) for x in rejoin],
             median_s=round(statistics.median(rejoin), 3), max_s=round(max(rejoin), 3),
             timeline=timeline)  # fmt: skip
    if not ok:
        print(output[-6000:], file=sys.stderr)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="small model, few steps: a smoke test")
    parser.add_argument("--short-ms", type=float, default=26.0)
    parser.add_argument("--long-ms", type=float, default=93.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=15)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--job-timeout", type=float, default=240.0)
    parser.add_argument(
        "--settle",
        type=float,
        default=None,
        help="seconds at full size before each fault (default 6, 3 with --quick): the "
        "launcher's standby is ready again, as between a real job's faults",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers of 2048 x 2048 in the faults' job (default 1: 50 MB of state with "
        "Adam, what a peer sends a relaunched worker; each layer adds 50 MB)",
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the faults' jobs (events, output) here"
    )
    parser.add_argument("--skip", choices=["overhead", "faults"], action="append", default=[])
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.block, args.saves = 1, 6, 1
    if args.settle is None:
        args.settle = 3.0 if args.quick else 6.0
    device = torch.device(args.device)
    emit(kind="machine", device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
         torch=torch.__version__, cuda=torch.version.cuda)  # fmt: skip
    import torch.distributed as dist

    from inprocess._net import free_port

    # DCP's async_save wants a process group: a group of one
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("gloo")
    try:
        if "overhead" not in args.skip:
            overhead(args, device)
    finally:
        dist.destroy_process_group()
    ok = True
    if "faults" not in args.skip:
        if args.keep is not None:
            ok = faults_phase(args, args.keep)
        else:
            with tempfile.TemporaryDirectory() as d:
                ok = faults_phase(args, Path(d))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
