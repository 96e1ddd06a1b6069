"""What an operator sees of a healthy job (issue 39): a quiet output, and every process
recognisable in ``ps`` / ``pgrep -f`` for what it is.

One real ``inprocess-run`` job with default settings (a warm standby per node,
default Wrapper settings): three workers under ``MaxActiveWorldSize(2)``, so
one is a spare that waits in the completion barrier for the whole call, and
one rank that starts its call 20 s late, so the others wait that long at the
call's first barrier. No fault.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from inprocess.failover.supervisor import job_processes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "workers" / "quiet_job.py"
ENV = dict(
    os.environ,
    PYTHONWARNINGS="ignore:Failed to initialize NumPy",
    RES_OPTIONS="timeout:1 attempts:1",
)
#: torch's store client's warnings (socket.cpp), whatever their wording
TORCH_SOCKET_WARNING = re.compile(r"socket\.cpp|waitForInput|c10d\]")
#: the one such line that is the machine's, not a wait's: torch's store server
#: names each client it accepts, and says so when the resolver fails meanwhile
#: (getnameinfo's EAI_AGAIN, seen here where DNS is unreachable)
RESOLVER_HICCUP = re.compile(r"The hostname of the client socket cannot be retrieved")
#: a log line of the library's at WARNING or above (the workers log as
#: "worker<N> LEVEL name: ...", inprocess-run as "inprocess-run[...] LEVEL ...")
INPROCESS_WARNING = re.compile(
    r"(WARNING|ERROR|CRITICAL) inprocess|inprocess-run\S* (WARNING|ERROR|CRITICAL)"
    r"|Warning: inprocess|inprocess.*Warning:"
)


def pgrep(pattern: str) -> set[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return {int(pid) for pid in found.split()} - {os.getpid()}


def title(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(psutil.Process(pid).cmdline())
    return ""


def describe(pid: int) -> dict[str, object]:
    """A process that pgrep matched beside the workers: who made it, how old it is."""
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(pid)
        parent = p.parent()
        return {
            "cmdline": title(pid),
            "age_s": round(time.time() - p.create_time(), 2),
            "ppid": p.ppid(),
            "parent": title(parent.pid) if parent is not None else None,
            "threads": p.num_threads(),
            "status": p.status(),
        }
    return {}


@pytest.fixture(scope="module")
def healthy_job(tmp_path_factory):
    """Runs the job to its end; yields (exit code, its whole output, what pgrep saw)."""
    tmp = tmp_path_factory.mktemp("operator_view")
    out, job_id = tmp / "out", f"test-view-{os.getpid()}-{time.monotonic_ns()}"
    log = open(tmp / "launcher.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "inprocess.failover.cli",
            "--nproc-per-node", "3", "--state-dir", str(tmp / "state"), "--job-id", job_id,
            str(SCRIPT), "--result-dir", str(out),
            "--seconds", "15", "--slow-rank", "2", "--slow-seconds", "20",
        ],
        env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    seen: dict[str, object] = {"samples": [], "workers": set(), "titles": {}, "extras": {}}
    try:
        deadline = time.monotonic() + 240
        workers: set[int] = set()
        while proc.poll() is None and time.monotonic() < deadline:
            files = [out / f"pid{r}" for r in range(3)]
            pids = {int(f.read_text()) for f in files if f.exists()}
            running = not any((out / f"done{r}").exists() for r in range(3))
            if len(pids) == 3 and running:
                workers = pids
                # The script and this job's own argument: the module's tests may run
                # on two pytest workers at once (a module fixture is made once per
                # worker), each with its own job of this script
                mine = f"{SCRIPT} --result-dir {out} "
                matched = pgrep(mine)
                if matched != workers:
                    # a monitor process forked from its rank this instant carries the
                    # rank's title until it sets its own: look again a moment later
                    time.sleep(1.0)
                    matched = pgrep(mine)
                if not any((out / f"done{r}").exists() for r in range(3)):
                    seen["samples"].append(matched)
                    for pid in matched - workers:  # what it is, should the test fail
                        seen["extras"].setdefault(pid, describe(pid))
                    for pid in job_processes(job_id):
                        seen["titles"][pid.pid] = title(pid.pid)
            time.sleep(0.5)
        seen["workers"] = workers
        code = proc.wait(max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in job_processes(job_id):
            with contextlib.suppress(psutil.Error):
                p.kill()
        log.close()
    yield code, (tmp / "launcher.log").read_text(errors="replace"), seen


@pytest.mark.timeout(300)
def test_a_healthy_job_prints_no_warning(healthy_job):
    code, output, _ = healthy_job
    assert code == 0, output[-6000:]
    torch_lines = [
        line
        for line in output.splitlines()
        if TORCH_SOCKET_WARNING.search(line) and not RESOLVER_HICCUP.search(line)
    ]
    assert not torch_lines, "\n".join(torch_lines[:10])
    ours = [line for line in output.splitlines() if INPROCESS_WARNING.search(line)]
    assert not ours, "\n".join(ours[:10])


@pytest.mark.timeout(300)
def test_pgrep_finds_exactly_the_workers_and_each_process_says_what_it_is(healthy_job):
    code, output, seen = healthy_job
    assert code == 0, output[-6000:]
    workers, samples = seen["workers"], seen["samples"]
    # the job ran ~35 s, sampled every 0.5 s: many looks while all three workers ran
    assert len(workers) == 3 and len(samples) >= 10, (workers, samples)
    assert all(s == workers for s in samples), (workers, seen["extras"], samples)
    titles = seen["titles"]
    for pid in workers:
        assert str(SCRIPT) in titles[pid] and "--slow-rank" in titles[pid], titles[pid]
    others = [t for pid, t in titles.items() if pid not in workers]
    monitors = [t for t in others if t.startswith("inprocess monitor of rank")]
    assert len(monitors) >= 3, titles  # one per worker
    assert any("-m inprocess.failover.standby --zygote" in t for t in others), titles
    assert any("-m inprocess.failover.standby" in t and "--zygote" not in t for t in others), titles
    assert any(t.startswith("inprocess-run controller of job") for t in others), titles
